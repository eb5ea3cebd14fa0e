"""v17 experiment: a per-tile replay kernel built like the v15 plain kernel (one warp,
BV = 16, grid `(d_v / BV, H_v, B)` so neighbouring blocks stream one slot, every
`[rows, d_k]` operand handled as `[rows, W]` column chunks). GDN only.

v4 chose the key-head-grouped kernel over the per-tile one because the per-tile kernel
redid the key side (`K k`, `K q` over `[L, d_k]`) in every tile, with 5 shuffle steps per
row sum. With column chunks those row sums cost 2-3 steps, the key cache is an L2 hit
for all but the first of the 16 tiles of a key head, and the tile stream gets the plain
kernel's 0.93 of floor (v15). The flush rebuilds the chunks held in registers (exact,
newest entry first, U entries per round trip) and stores them in place: no second read.

Prediction: non-flush at B = 512 ~300-320 us (grouped: 360; plain kernel per byte would
give ~282), the flush near the grouped kernel's ~1095, cycle ~350-370 (1.45-1.55x over the
v15 plain kernel's 538.5); at B = 8 the one-warp grid gives 2048 programs instead of 512,
non-flush below the grouped 9.8 us.

  python benchmarks/experiments/v17_tile_chunks.py --ptx          # CPU: ptxas stats
  PYTHONPATH=$PWD python benchmarks/experiments/v17_tile_chunks.py $OUT/v17.json   # H200
`SMOKE=1` runs the check and timing on a CPU in interpret mode.
"""

import functools, json, os, re, sys, tempfile, time, warnings
SMOKE = bool(os.environ.get("SMOKE"))
import jax, jax.numpy as jnp, numpy as np
warnings.filterwarnings("ignore", message="The Pallas Triton backend is deprecated")
sys.path.insert(0, "benchmarks")
import decode_bench as DB
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
from pallas_kernels import common, ops
from pallas_kernels.common import KernelConfig
from pallas_kernels.ops import default_kernel_config, pallas_layer_step
from pallas_kernels.replay_decode_grouped import cache_block_len
from replayssm_jax.decode import step_plan

CURRENT_PER_TILE = ops.replay_decode


def row_sum(tiles, vecs):
    """`sum_c tiles[c] @ vecs[c]`: `[R]` from chunks `[R, W]` and `[W]`, one row sum."""
    acc = tiles[0] * vecs[0][None, :]
    for t, x in zip(tiles[1:], vecs[1:]):
        acc = acc + t * x[None, :]
    return jnp.sum(acc, axis=1)


def rebuild_chunks(refs, slot, h, hk, cols, pos, s_chunks, decay_total, unroll, chunk_cols):
    """`S_c e^G + sum_j u_j (W_j k_j)^T` over the column chunks, newest entry first."""
    ucache_ref, kcache_ref, gcache_ref = refs
    block_v, width = s_chunks[0].shape

    def load_entry(j):
        live = j >= 0
        row = jnp.maximum(j, 0)
        u_j = plgpu.load(ucache_ref.at[slot, h, row, cols], mask=jnp.full((block_v,), live), other=0.0)
        k_j = [plgpu.load(kcache_ref.at[slot, hk, row, c], mask=jnp.full((width,), live), other=0.0)
               .astype(jnp.float32) for c in chunk_cols]
        g_j = jnp.where(live, gcache_ref[slot, h, row], 0.0)
        return u_j.astype(jnp.float32), k_j, g_j

    def body(i, carry):
        state, weight = carry
        for u_j, k_j, g_j in [load_entry(pos - 1 - i * unroll - e) for e in range(unroll)]:
            wu = (weight * u_j)[:, None]
            state = tuple(s + wu * kc[None, :] for s, kc in zip(state, k_j))
            weight = weight * jnp.exp(g_j)
        return state, weight

    state0 = tuple(s * decay_total for s in s_chunks)
    state, _ = jax.lax.fori_loop(0, (pos + unroll - 1) // unroll, body, (state0, jnp.float32(1.0)))
    return state


def tile_chunked_kernel(
    slot_ref, pos_ref, mode_ref, q_ref, k_ref, g_ref, beta_ref, v_ref, a_log_ref, dt_bias_ref,
    _ckpt_in, _u_in, _k_in, _g_in, y_ref, ckpt_ref, ucache_ref, kcache_ref, gcache_ref,
    *, spec, block_v, cache_block, width, unroll,
):
    assert not spec.per_channel_gate
    tile, h, b = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    hk = h // spec.group_size
    cols = pl.ds(tile * block_v, block_v)
    mode = mode_ref[b]
    chunk_cols = [pl.ds(c * width, width) for c in range(q_ref.shape[-1] // width)]

    @pl.when(mode == common.MODE_PAD)
    def _padding_row():
        y_ref[b, h, cols] = jnp.zeros((block_v,), y_ref.dtype)

    @pl.when(mode != common.MODE_PAD)
    def _live_row():
        slot, pos = slot_ref[b], pos_ref[b]
        live = jnp.arange(cache_block) < pos
        entries = pl.ds(0, cache_block)
        key_chunks = [plgpu.load(kcache_ref.at[slot, hk, entries, c], mask=live[:, None], other=0.0)
                      .astype(jnp.float32) for c in chunk_cols]
        qf = q_ref[b, hk, :].astype(jnp.float32); kf = k_ref[b, hk, :].astype(jnp.float32)
        q_fac, k_fac = spec.scale, 1.0
        if spec.use_qk_l2norm:
            q_fac = q_fac * jax.lax.rsqrt(jnp.sum(qf * qf) + common.L2NORM_EPS)
            k_fac = jax.lax.rsqrt(jnp.sum(kf * kf) + common.L2NORM_EPS)
        k_dot_q = jnp.sum(qf * kf) * q_fac * k_fac
        qs = [q_ref[b, hk, c].astype(jnp.float32) * q_fac for c in chunk_cols]
        ks = [k_ref[b, hk, c].astype(jnp.float32) * k_fac for c in chunk_cols]
        g_c = plgpu.load(gcache_ref.at[slot, h, entries], mask=live, other=0.0)
        u_c = plgpu.load(ucache_ref.at[slot, h, entries, cols], mask=live[:, None], other=0.0).astype(jnp.float32)
        s_chunks = [ckpt_ref[slot, h, cols, c].astype(jnp.float32) for c in chunk_cols]
        v = v_ref[b, h, cols].astype(jnp.float32)
        g, beta = common.load_gates(spec, g_ref, beta_ref, a_log_ref, dt_bias_ref, b, h)
        kk, kq = row_sum(key_chunks, ks), row_sum(key_chunks, qs)
        alpha = jnp.exp(g)
        total = jnp.sum(g_c)
        weights = jnp.where(live, jnp.exp(total - jnp.cumsum(g_c)), 0.0)
        decay_c = jnp.exp(total)
        s_k = alpha * (decay_c * row_sum(s_chunks, ks) + jnp.sum(u_c * (weights * kk)[:, None], axis=0))
        s_q = alpha * (decay_c * row_sum(s_chunks, qs) + jnp.sum(u_c * (weights * kq)[:, None], axis=0))
        u = beta * (v - s_k)
        y_ref[b, h, cols] = (s_q + u * k_dot_q).astype(y_ref.dtype)

        @pl.when(mode == common.MODE_FLUSH)
        def _flush():
            prev = rebuild_chunks((ucache_ref, kcache_ref, gcache_ref), slot, h, hk, cols, pos,
                                  s_chunks, decay_c, unroll, chunk_cols)
            fresh_slot = slot_ref[b]
            for c, p, kc in zip(chunk_cols, prev, ks):
                ckpt_ref[fresh_slot, h, cols, c] = (p * alpha + u[:, None] * kc[None, :]).astype(ckpt_ref.dtype)

        @pl.when(mode == common.MODE_APPEND)
        def _append():
            ucache_ref[slot, h, pos, cols] = u.astype(ucache_ref.dtype)

            @pl.when(tile == 0)
            def _gate():
                gcache_ref[slot, h, pos] = g

            @pl.when((tile == 0) & (h % spec.group_size == 0))
            def _key():
                kcache_ref[slot, hk, pos, :] = (kf * k_fac).astype(kcache_ref.dtype)


def tile_chunked_decode(checkpoint, u_cache, k_cache, g_cache, q, k, v, g, beta, slot, pos, mode, *,
                        use_qk_l2norm=False, scale=None, gate_params=None, config=KernelConfig(),
                        interpret=None, width=16):
    batch, num_v_heads, head_v_dim = v.shape
    config = config.for_head_dim(head_v_dim)
    spec = common.token_spec(q, v, per_channel_gate=False, gate_params=gate_params,
                             use_qk_l2norm=use_qk_l2norm, scale=scale)
    a_log, dt_bias = common.gate_param_inputs(gate_params)
    kernel = functools.partial(tile_chunked_kernel, spec=spec, block_v=config.block_v,
                               cache_block=cache_block_len(u_cache.shape[2]), width=width,
                               unroll=config.rebuild_unroll)
    return common.decode_call(
        kernel, grid=(head_v_dim // config.block_v, num_v_heads, batch),
        inputs=(slot, pos, mode, q, k, g, beta, v, a_log, dt_bias),
        state=(checkpoint, u_cache, k_cache, g_cache),
        y_like=v, config=config, interpret=interpret, name="replayssm_decode",
    )


def use(width):
    ops.replay_decode = CURRENT_PER_TILE if width is None else functools.partial(tile_chunked_decode, width=width)
    DB.replay_cycle_fn.cache_clear()
    jax.clear_caches()


def variants(smoke):
    bv = 8 if smoke else 16
    out = {}
    for w in ((8,) if smoke else (16, 32)):
        for unroll in (2, 4):
            out[f"w{w}_u{unroll}"] = (w, KernelConfig(block_v=bv, num_warps=1, rebuild_unroll=unroll))
    return out


def ptx_stats():
    import kernel_registers as KR
    import triton
    from triton.backends.compiler import GPUTarget
    from replayssm_jax.config import ReplayConfig
    cfg = ReplayConfig(16, 32, 128, 128, 16)
    for name, (w, kc) in variants(False).items():
        use(w)
        ir = KR.kernel_ir(cfg, kc, 512)
        rep = KR.ptxas_report(ir, kc)
        with tempfile.TemporaryDirectory() as tmp:
            p = os.path.join(tmp, "k.ttir"); open(p, "w").write(ir)
            ptx = triton.compile(p, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=1, num_stages=1)).asm["ptx"]
        count = lambda pat: len(re.findall(pat, ptx))
        print(f"{name:8} regs={rep['registers']:3} spill={rep['spill_store_bytes']:3} shfl={count(r'shfl.sync'):4} "
              f"bar={count(r'bar.sync'):3} st.shared={count(r'st.shared'):3} ld={count(r'ld.global'):3} "
              f"instr={count(r';'):5}", flush=True)
    use(None)


def check(cfg, batch):
    """Normwise errors of (y, checkpoint, u, k, g caches) against the package's per-tile kernel
    (exact rebuild), one step at random cursors: some rows flush, some append, one pads."""
    rng = np.random.default_rng(0)
    n = 2 * batch
    state = DB.random_pool(cfg, n, jax.random.key(3), rng.integers(0, cfg.cache_len, n))
    token = DB.random_token(cfg, batch, jax.random.key(4))
    slots = rng.permutation(n)[:batch].astype(np.int32); slots[1] = -1
    slots = jnp.asarray(slots)
    force = jnp.asarray(np.arange(batch) % 3 == 0)

    def run(kc):
        def step(st, t, s):
            plan, _ = step_plan(cfg, st.write_pos, s, force, backend="pallas", kernel_config=kc)
            y, st = pallas_layer_step(st, *t, plan, use_qk_l2norm=True, scale=None, kernel_config=kc, interpret=SMOKE)
            return y, st.checkpoint, st.u_cache, st.k_cache, st.g_cache
        return [np.asarray(x.astype(jnp.float32)) for x in jax.jit(step)(state, token, slots)]

    use(None)
    ref = run(KernelConfig(block_v=8, num_warps=1, cache_chunk=8, rebuild_unroll=1))
    errs = {}
    for name, (w, kc) in variants(SMOKE).items():
        use(w)
        errs[name] = [DB.rel_err(a, r) for a, r in zip(run(kc), ref)]
    use(None)
    return errs


def main(out):
    t0 = time.time(); timer = DB.Timer(SMOKE); res = dict(meta=DB.versions(), rows=[])
    res["meta"]["copy_bandwidth_GBps"] = 0.0 if SMOKE else DB.copy_bandwidth_GBps(timer)
    print(res["meta"], flush=True)
    shape = DB.Shape(2, 4, 32) if SMOKE else DB.Shape()
    cfg = shape.config(16, jnp.dtype("float32"))
    res["check_rel_err_y_ckpt_u_k_g"] = check(cfg, 5 if SMOKE else 16)
    print("check", res["check_rel_err_y_ckpt_u_k_g"], flush=True)
    for batch in ([4] if SMOKE else [512, 128, 32, 8]):
        row = dict(batch=batch)
        cases = {"table": (None, default_kernel_config(batch, "replay"))} | variants(SMOKE)
        for name, (w, kc) in cases.items():
            if time.time() - t0 > 420: print("time guard", flush=True); break
            use(w)
            try:
                for cursors in ("sync", "staggered"):
                    nf, fl, cyc = DB.time_replay(timer, cfg, batch, kc, np.random.default_rng(batch), 3, SMOKE,
                                                 cursors == "staggered")
                    row[f"{name}_{cursors}"] = dict(nonflush=nf, flush=fl, cycle=cyc)
            except Exception as e:
                row[name] = repr(e)[:300]
        use(None)
        print("row", json.dumps(row), flush=True); res["rows"].append(row)
        with open(out, "w") as f: json.dump(res, f, indent=1)
    print(f"total {time.time() - t0:.0f} s")


if __name__ == "__main__":
    ptx_stats() if sys.argv[1] == "--ptx" else main(sys.argv[1])
