"""v16 experiment: the grouped replay kernel's checkpoint readout `S_c k`, `S_c q` over
`[BV, W]` column chunks (v14/v15: the plain kernel got 5-8% faster with W = 16 once
its grid ran tiles fastest). GDN only; the flush branch re-reads its tile whole (timing
the non-flush step, which is what changes; the package's flush must not re-read).

Variants: W in {16, 32}; the q/k chunks loaded once per program ("hoisted") or again per
tile ("reload", L1 hits, fewer live registers). Prediction: the non-flush step 5-8% faster
at B = 512 (361 -> ~340 us), like the plain kernel; ptxas: 169 -> 93 shuffles (static),
128 -> 96 registers (reload) or 158 (hoisted, 3 programs per SM: slower).
  python benchmarks/experiments/v16_grouped_chunks.py --ptx          # CPU: ptxas stats
  PYTHONPATH=$PWD python benchmarks/experiments/v16_grouped_chunks.py $OUT/v16.json   # H200
"""

import functools, json, os, re, sys, tempfile, time, warnings
SMOKE = bool(os.environ.get("SMOKE"))
import jax, jax.numpy as jnp, numpy as np
warnings.filterwarnings("ignore", message="The Pallas Triton backend is deprecated")
sys.path.insert(0, "benchmarks")
import decode_bench as DB
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
from pallas_kernels import common, replay_decode_grouped as G
from pallas_kernels.common import KernelConfig
from pallas_kernels.ops import default_kernel_config, pallas_layer_step
from pallas_kernels.replay_decode import append_gate, rebuild_exact, write_flushed_tile
from replayssm_jax.decode import step_plan

CURRENT = G._grouped_kernel


def qk_chunks(spec, q_ref, k_ref, b, hk, width, q_fac, k_fac):
    dk = q_ref.shape[-1]
    cs = [pl.ds(c * width, width) for c in range(dk // width)]
    return ([q_ref[b, hk, c].astype(jnp.float32) * q_fac for c in cs],
            [k_ref[b, hk, c].astype(jnp.float32) * k_fac for c in cs])


def chunked_grouped(
    slot_ref, pos_ref, mode_ref, q_ref, k_ref, g_ref, beta_ref, v_ref, a_log_ref, dt_bias_ref,
    _ckpt_in, _u_in, _k_in, _g_in, y_ref, ckpt_ref, ucache_ref, kcache_ref, gcache_ref,
    *, spec, block_v, tiles_per_head, tiles_per_program, cache_block, precision, unroll, width, reload,
):
    assert not spec.per_channel_gate and precision == "ieee"
    b, hk, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    mode, slot, pos = mode_ref[b], slot_ref[b], pos_ref[b]
    first = split * tiles_per_program
    dk = q_ref.shape[-1]
    chunk_cols = [pl.ds(c * width, width) for c in range(dk // width)]

    def tile_of(p):
        pair = first + p
        vh = hk * spec.group_size + pair // tiles_per_head
        tile = pair % tiles_per_head
        return vh, tile, pl.ds(tile * block_v, block_v)

    @pl.when(mode == common.MODE_PAD)
    def _padding_row():
        def body(p, carry):
            vh, _, cols = tile_of(p)
            y_ref[b, vh, cols] = jnp.zeros((block_v,), y_ref.dtype)
            return carry
        jax.lax.fori_loop(0, tiles_per_program, body, 0)

    @pl.when(mode != common.MODE_PAD)
    def _live_row():
        live = jnp.arange(cache_block) < pos
        live2 = live[:, None]
        entries = pl.ds(0, cache_block)
        k_c = plgpu.load(kcache_ref.at[slot, hk, entries, :], mask=live2, other=0.0)
        q, k = common.load_qk(spec, q_ref, k_ref, b, hk)
        q_fac, k_fac = spec.scale, 1.0
        if spec.use_qk_l2norm:
            qf = q_ref[b, hk, :].astype(jnp.float32); kf = k_ref[b, hk, :].astype(jnp.float32)
            q_fac = q_fac * jax.lax.rsqrt(jnp.sum(qf * qf) + common.L2NORM_EPS)
            k_fac = jax.lax.rsqrt(jnp.sum(kf * kf) + common.L2NORM_EPS)
        if not reload:
            qs, ks = qk_chunks(spec, q_ref, k_ref, b, hk, width, q_fac, k_fac)
        k_c = k_c.astype(jnp.float32)
        k_dot_q = jnp.sum(k * q)
        kk, kq = jnp.sum(k_c * k[None, :], axis=1), jnp.sum(k_c * q[None, :], axis=1)

        def body(p, carry):
            vh, tile, cols = tile_of(p)
            g_c = plgpu.load(gcache_ref.at[slot, vh, entries], mask=live, other=0.0)
            u_c = plgpu.load(ucache_ref.at[slot, vh, entries, cols], mask=live2, other=0.0)
            s_chunks = [ckpt_ref[slot, vh, cols, c].astype(jnp.float32) for c in chunk_cols]
            v = v_ref[b, vh, cols].astype(jnp.float32)
            g, beta = common.load_gates(spec, g_ref, beta_ref, a_log_ref, dt_bias_ref, b, vh)
            qs_, ks_ = qk_chunks(spec, q_ref, k_ref, b, hk, width, q_fac, k_fac) if reload else (qs, ks)
            alpha = jnp.exp(g)
            total = jnp.sum(g_c, axis=0)
            weights = jnp.where(live, jnp.exp(total - jnp.cumsum(g_c, axis=0)), 0.0)
            u_c = u_c.astype(jnp.float32)
            decay_c = jnp.exp(total)
            acc_k = s_chunks[0] * ks_[0][None, :]
            acc_q = s_chunks[0] * qs_[0][None, :]
            for s, kc, qc in zip(s_chunks[1:], ks_[1:], qs_[1:]):
                acc_k = acc_k + s * kc[None, :]
                acc_q = acc_q + s * qc[None, :]
            s_k = alpha * (decay_c * jnp.sum(acc_k, axis=1) + jnp.sum(u_c * (weights * kk)[:, None], axis=0))
            s_q = alpha * (decay_c * jnp.sum(acc_q, axis=1) + jnp.sum(u_c * (weights * kq)[:, None], axis=0))
            u = beta * (v - s_k)
            y_ref[b, vh, cols] = (s_q + u * k_dot_q).astype(y_ref.dtype)

            @pl.when(mode == common.MODE_FLUSH)
            def _flush():
                s_c = ckpt_ref[slot, vh, cols, :].astype(jnp.float32)  # experiment only: a second read
                prev = rebuild_exact(spec, (ucache_ref, kcache_ref, gcache_ref), slot, vh, cols, pos, s_c, decay_c, unroll)
                write_flushed_tile(spec, ckpt_ref, slot_ref[b], vh, cols, prev, alpha, u, k)

            @pl.when(mode == common.MODE_APPEND)
            def _append():
                ucache_ref[slot, vh, pos, cols] = u.astype(ucache_ref.dtype)

                @pl.when(tile == 0)
                def _append_gate():
                    append_gate(spec, gcache_ref, slot, vh, pos, g)
            return carry

        jax.lax.fori_loop(0, tiles_per_program, body, 0)

        @pl.when((mode == common.MODE_APPEND) & (split == 0))
        def _append_key():
            kcache_ref[slot, hk, pos, :] = k.astype(kcache_ref.dtype)


VARIANTS = {"current": CURRENT}
for _w in (16, 32):
    for _r in (False, True):
        VARIANTS[f"w{_w}{'_reload' if _r else ''}"] = functools.partial(chunked_grouped, width=_w, reload=_r)


def use(kernel):
    G._grouped_kernel = kernel
    DB.replay_cycle_fn.cache_clear()
    jax.clear_caches()


def ptx_stats():
    import kernel_registers as KR
    import triton
    from triton.backends.compiler import GPUTarget
    from replayssm_jax.config import ReplayConfig
    cfg = ReplayConfig(16, 32, 128, 128, 16)
    for batch in (512, 128):
        kc = default_kernel_config(batch, "replay")
        for name, kernel in VARIANTS.items():
            use(kernel)
            ir = KR.kernel_ir(cfg, kc, batch)
            rep = KR.ptxas_report(ir, kc)
            with tempfile.TemporaryDirectory() as tmp:
                p = os.path.join(tmp, "k.ttir"); open(p, "w").write(ir)
                ptx = triton.compile(p, target=GPUTarget("cuda", 90, 32),
                                     options=dict(num_warps=kc.num_warps, num_stages=1)).asm["ptx"]
            count = lambda pat: len(re.findall(pat, ptx))
            print(f"B={batch:3} T={kc.tiles_per_program} {name:11} regs={rep['registers']:3} spill={rep['spill_store_bytes']:3} "
                  f"shfl={count(r'shfl.sync'):4} bar={count(r'bar.sync'):3} st.shared={count(r'st.shared'):3} "
                  f"ld={count(r'ld.global'):3} instr={count(r';'):5}", flush=True)
    use(CURRENT)


def check(cfg, batch):
    """Normwise error of each variant's y and state against the package kernel, one step
    at random cursors (some rows flush)."""
    rng = np.random.default_rng(0)
    n = 2 * batch
    state = DB.random_pool(cfg, n, jax.random.key(3), rng.integers(0, cfg.cache_len, n))
    token = DB.random_token(cfg, batch, jax.random.key(4))
    slots = jnp.asarray(rng.permutation(n)[:batch].astype(np.int32))
    kc = KernelConfig(block_v=32, num_warps=4, tiles_per_program=8, rebuild_unroll=2)

    def step(st, t, s):
        plan, _ = step_plan(cfg, st.write_pos, s, None, backend="pallas", kernel_config=kc)
        y, st = pallas_layer_step(st, *t, plan, use_qk_l2norm=True, scale=None, kernel_config=kc, interpret=SMOKE)
        return y, st.checkpoint, st.u_cache

    outs = {}
    for name, kernel in VARIANTS.items():
        use(kernel)
        outs[name] = [np.asarray(x.astype(jnp.float32)) for x in jax.jit(step)(state, token, slots)]
    use(CURRENT)
    return {n: [DB.rel_err(a, r) for a, r in zip(o, outs["current"])] for n, o in outs.items() if n != "current"}


def main(out):
    t0 = time.time(); timer = DB.Timer(SMOKE); res = dict(meta=DB.versions(), rows=[])
    res["meta"]["copy_bandwidth_GBps"] = 0.0 if SMOKE else DB.copy_bandwidth_GBps(timer)
    print(res["meta"], flush=True)
    shape = DB.Shape(2, 4, 32) if SMOKE else DB.Shape()
    cfg = shape.config(16, jnp.dtype("float32"))
    res["check_rel_err_y_ckpt_ucache"] = check(cfg, 4 if SMOKE else 16)
    print("check", res["check_rel_err_y_ckpt_ucache"], flush=True)
    for batch in ([4] if SMOKE else [512, 128]):
        kc = default_kernel_config(batch, "replay")
        if SMOKE: kc = KernelConfig(block_v=8, num_warps=1, tiles_per_program=2)
        row = dict(batch=batch, block_v=kc.block_v, num_warps=kc.num_warps, tiles_per_program=kc.tiles_per_program)
        for name, kernel in VARIANTS.items():
            if time.time() - t0 > 400: print("time guard", flush=True); break
            use(kernel)
            try:
                nf, fl, cyc = DB.time_replay(timer, cfg, batch, kc, np.random.default_rng(batch), 3, SMOKE, False)
                row[name] = dict(nonflush=nf, flush=fl, cycle=cyc)
            except Exception as e:
                row[name] = repr(e)[:300]
        use(CURRENT)
        print("row", json.dumps(row), flush=True); res["rows"].append(row)
        with open(out, "w") as f: json.dump(res, f, indent=1)
    print(f"total {time.time() - t0:.0f} s")


if __name__ == "__main__":
    ptx_stats() if sys.argv[1] == "--ptx" else main(sys.argv[1])
