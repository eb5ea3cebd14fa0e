"""v14 experiment: the state tile handled as d_k / W column chunks `[BV, W]` instead of one
`[BV, d_k]` block.

Why: a `[BV, 128]` fp32 load gets Triton's layout with the 32 lanes of a warp along d_k
(4 elements each), so every row sum (`S k`, `S q`) costs 5 shuffle steps per row held by a
thread (NOTES v8: the non-flush step is bound by the load/store pipe). A `[BV, 16]` chunk
gets 4 lanes along d_k and 8 along rows; products summed chunk by chunk in registers leave
one row sum over 4 lanes (2 shuffle steps) per row, at the same 16-byte vector loads.
v10 put the lanes on rows through gather indices and lost to scalar addressing work; here
every load is a rectangular slice.

Variants of the plain kernel (GDN, precomputed gates), compared with the package's kernel:
  python benchmarks/experiments/v14_column_chunks.py --ptx            # CPU: ptxas stats
  PYTHONPATH=$PWD python benchmarks/experiments/v14_column_chunks.py $OUT/v14.json   # H200
`SMOKE=1` runs the timing part on a CPU in interpret mode.
"""

import functools, json, os, re, subprocess, sys, tempfile, time, warnings
SMOKE = bool(os.environ.get("SMOKE"))
import jax, jax.numpy as jnp, numpy as np
warnings.filterwarnings("ignore", message="The Pallas Triton backend is deprecated")
sys.path.insert(0, "benchmarks")
import decode_bench as DB
from jax.experimental import pallas as pl
from pallas_kernels import common, plain_decode as PD
from pallas_kernels.common import KernelConfig
from pallas_kernels.ops import default_kernel_config

CURRENT = PD._plain_kernel


def chunked_plain(slot_ref, valid_ref, q_ref, k_ref, g_ref, beta_ref, v_ref, a_log_ref, dt_bias_ref,
                  _state_in, y_ref, state_ref, *, spec, block_v, width):
    """The plain kernel over `[BV, width]` column chunks (GDN only)."""
    assert not spec.per_channel_gate
    b, h, tile = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    cols = pl.ds(tile * block_v, block_v)
    valid = valid_ref[b] != 0
    hk = h // spec.group_size
    head_k_dim = q_ref.shape[-1]
    chunks = [pl.ds(c * width, width) for c in range(head_k_dim // width)]

    @pl.when(~valid)
    def _padding_row():
        y_ref[b, h, cols] = jnp.zeros((block_v,), y_ref.dtype)

    @pl.when(valid)
    def _live_row():
        slot = slot_ref[b]
        q_fac, k_fac = spec.scale, 1.0
        if spec.use_qk_l2norm:
            qf = q_ref[b, hk, :].astype(jnp.float32)
            kf = k_ref[b, hk, :].astype(jnp.float32)
            q_fac = q_fac * jax.lax.rsqrt(jnp.sum(qf * qf) + common.L2NORM_EPS)
            k_fac = jax.lax.rsqrt(jnp.sum(kf * kf) + common.L2NORM_EPS)
        g, beta = common.load_gates(spec, g_ref, beta_ref, a_log_ref, dt_bias_ref, b, h)
        alpha = jnp.exp(g)
        v = v_ref[b, h, cols].astype(jnp.float32)
        ks = [k_ref[b, hk, c].astype(jnp.float32) * k_fac for c in chunks]
        qs = [q_ref[b, hk, c].astype(jnp.float32) * q_fac for c in chunks]
        decayed = [state_ref[slot, h, cols, c].astype(jnp.float32) * alpha for c in chunks]
        acc = decayed[0] * ks[0][None, :]
        for t, kc in zip(decayed[1:], ks[1:]):
            acc = acc + t * kc[None, :]
        u = beta * (v - jnp.sum(acc, axis=1))
        new = [t + u[:, None] * kc[None, :] for t, kc in zip(decayed, ks)]
        acc = new[0] * qs[0][None, :]
        for t, qc in zip(new[1:], qs[1:]):
            acc = acc + t * qc[None, :]
        y_ref[b, h, cols] = jnp.sum(acc, axis=1).astype(y_ref.dtype)
        for c, t in zip(chunks, new):
            state_ref[slot, h, cols, c] = t.astype(state_ref.dtype)


def variants(state_dtype):
    out = {"current": CURRENT}
    for w in ((8, 16, 32) if state_dtype == "float32" else (16, 32)):
        out[f"chunk{w}"] = functools.partial(chunked_plain, width=w)
    return out


def use(kernel):
    PD._plain_kernel = kernel
    DB.plain_steps_fn.cache_clear(); DB.time_plain_cached.cache_clear()
    jax.clear_caches()


def ptx_stats():
    """CPU: compile each variant for sm_90a; count registers and key PTX instructions."""
    import kernel_registers as KR
    import triton
    from triton.backends.compiler import GPUTarget
    from replayssm_jax.config import ReplayConfig
    for dtype in ("float32", "bfloat16"):
        for batch, kc in ((512, default_kernel_config(512, "plain")), (8, default_kernel_config(8, "plain")),
                          (512, KernelConfig(block_v=32, num_warps=4))):
            cfg = ReplayConfig(16, 32, 128, 128, 1, state_dtype=jnp.dtype(dtype), cache_dtype=jnp.dtype(dtype))
            for name, kernel in variants(dtype).items():
                use(kernel)
                ir = KR.kernel_ir(cfg, kc, batch)
                rep = KR.ptxas_report(ir, kc)
                with tempfile.TemporaryDirectory() as tmp:
                    p = os.path.join(tmp, "k.ttir"); open(p, "w").write(ir)
                    ptx = triton.compile(p, target=GPUTarget("cuda", 90, 32),
                                         options=dict(num_warps=kc.num_warps, num_stages=1)).asm["ptx"]
                count = lambda pat: len(re.findall(pat, ptx))
                print(f"{dtype:8} B={batch:3} BV={kc.block_v:2} w={kc.num_warps} {name:8} regs={rep['registers']:3} "
                      f"spill={rep['spill_store_bytes']:3} shfl={count(r'shfl.sync'):4} bar={count(r'bar.sync'):3} "
                      f"ld.v4={count(r'ld.global[^;]*v4'):3} ld={count(r'ld.global'):3} st={count(r'st.global'):3} "
                      f"st.shared={count(r'st.shared'):3} instr={count(r';'):5}", flush=True)
    use(CURRENT)


def check(cfg, batch, kc, name_kernels):
    """Normwise error of each variant's (y, state) against the package kernel, one step."""
    from pallas_kernels.plain_decode import plain_decode
    rng = np.random.default_rng(0)
    num_slots = 2 * batch
    pool = DB.random_pool(cfg, num_slots, jax.random.key(3), np.zeros(num_slots)).checkpoint
    token = DB.random_token(cfg, batch, jax.random.key(4))
    slots = jnp.asarray(rng.permutation(num_slots)[:batch].astype(np.int32))
    outs = {}
    for name, kernel in name_kernels.items():
        use(kernel)
        y, st = jax.jit(lambda p, t, s: plain_decode(p, *t, s, s >= 0, use_qk_l2norm=True, config=kc,
                                                     interpret=SMOKE))(pool, token, slots)
        outs[name] = (np.asarray(y, np.float32), np.asarray(st.astype(jnp.float32)))
    use(CURRENT)
    ref = outs["current"]
    return {n: [DB.rel_err(o[0], ref[0]), DB.rel_err(o[1], ref[1])] for n, o in outs.items() if n != "current"}


def main(out):
    t0 = time.time(); timer = DB.Timer(SMOKE); res = dict(meta=DB.versions(), rows=[])
    res["meta"]["copy_bandwidth_GBps"] = 0.0 if SMOKE else DB.copy_bandwidth_GBps(timer)
    print(res["meta"], flush=True)
    shape = DB.Shape(2, 4, 32) if SMOKE else DB.Shape()
    cases = ([("float32", 4, None)] if SMOKE else
             [("float32", b, None) for b in (512, 128, 32, 8, 4, 1)]
             + [("float32", 512, KernelConfig(block_v=32, num_warps=4)),
                ("float32", 8, KernelConfig(block_v=8, num_warps=1)),
                ("bfloat16", 512, None), ("bfloat16", 8, None)])
    for dtype, batch, kc in cases:
        kc = kc or default_kernel_config(batch, "plain")
        cfg = shape.config(1, jnp.dtype(dtype))
        row = dict(state_dtype=dtype, batch=batch, block_v=kc.block_v, num_warps=kc.num_warps)
        row["err_y_state"] = check(cfg, min(batch, 8), kc, variants(dtype))
        for name, kernel in variants(dtype).items():
            if time.time() - t0 > 420: print("time guard", flush=True); break
            use(kernel)
            try:
                row[name] = DB.time_plain(timer, cfg, batch, kc, np.random.default_rng(batch), 5, SMOKE)
            except Exception as e:
                row[name] = repr(e)[:400]
        use(CURRENT)
        print("row", json.dumps(row), flush=True); res["rows"].append(row)
        with open(out, "w") as f: json.dump(res, f, indent=1)
    print(f"total {time.time() - t0:.0f} s")


if __name__ == "__main__":
    ptx_stats() if sys.argv[1] == "--ptx" else main(sys.argv[1])
