"""v8 experiment (H200): weighted flush rebuild vs sequential replay; flush-every-step
fallback at small batch; bf16-state tiles. One process; prints rows, writes JSON to argv[1].

Ran on the H200 with the kernels of commit 39291cd (table: T = 8 with U = 4):
`PYTHONPATH=$PWD python benchmarks/experiments/v8_flush_fallback.py $OUT/v8.json`
(raw/h200_2026-11-29_v8_rebuild_fallback.*); `SMOKE=1` runs it on a CPU in interpret mode.
"""

import dataclasses, functools, json, os, statistics, sys, time, warnings
SMOKE = bool(os.environ.get("SMOKE"))
import jax, jax.numpy as jnp, numpy as np
warnings.filterwarnings("ignore", message="The Pallas Triton backend is deprecated")
sys.path.insert(0, "benchmarks")
import decode_bench as DB
import replayssm_jax as R
from pallas_kernels import replay_decode as RD, replay_decode_grouped as RG
from pallas_kernels.common import KernelConfig
from pallas_kernels.ops import pallas_layer_step, default_kernel_config
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

def sequential_rebuild(spec, refs, slot, h, cols, pos, s_c, decay_total, unroll=1):
    """The v7 rebuild (state = state * decay + u k^T, oldest entry first)."""
    ucache_ref, kcache_ref, gcache_ref = refs
    hk = h // spec.group_size
    block_v, head_k_dim = s_c.shape
    def load_entry(j):
        live = j < pos
        row = jnp.minimum(j, pos - 1)
        u_j = plgpu.load(ucache_ref.at[slot, h, row, cols], mask=jnp.full((block_v,), live), other=0.0)
        k_j = plgpu.load(kcache_ref.at[slot, hk, row, :], mask=jnp.full((head_k_dim,), live), other=0.0)
        if spec.per_channel_gate:
            g_j = plgpu.load(gcache_ref.at[slot, h, row, :], mask=jnp.full((head_k_dim,), live), other=0.0)
        else:
            g_j = jnp.where(live, gcache_ref[slot, h, row], 0.0)
        return u_j.astype(jnp.float32), k_j.astype(jnp.float32), g_j
    def body(i, state):
        entries = [load_entry(i * unroll + e) for e in range(unroll)]
        for u_j, k_j, g_j in entries:
            decay = jnp.exp(g_j)[None, :] if spec.per_channel_gate else jnp.exp(g_j)
            state = state * decay + u_j[:, None] * k_j[None, :]
        return state
    return jax.lax.fori_loop(0, (pos + unroll - 1) // unroll, body, s_c)

WEIGHTED = RD.rebuild_exact

def use_rebuild(fn):
    RD.rebuild_exact = RG.rebuild_exact = fn
    DB.replay_cycle_fn.cache_clear(); DB.plain_steps_fn.cache_clear(); DB.time_plain_cached.cache_clear()
    jax.clear_caches()

@functools.lru_cache(maxsize=None)
def flush_all_fn(cfg, kc):
    def one_step(token, state, slots):
        plan = R.plan_step(state.write_pos, slots, slots >= 0, cfg.cache_len)
        y, state = pallas_layer_step(state, *token, plan, use_qk_l2norm=True, scale=None, kernel_config=kc, interpret=SMOKE)
        return dataclasses.replace(state, write_pos=R.advance_write_pos(state.write_pos, plan)), y[0, 0, 0]
    def run(state, sets, token):
        over = lambda st, _: jax.lax.scan(functools.partial(one_step, token), st, sets)
        return jax.lax.scan(over, state, None, length=4)[0]
    return jax.jit(run)

def time_flush_all(timer, cfg, batch, kc):
    rng = np.random.default_rng(batch)
    sets, n = DB.slot_sets(batch, cfg.state_bytes_per_slot(), rng, SMOKE)
    pool = DB.random_pool(cfg, n, jax.random.key(1), np.zeros(n))
    token = DB.random_token(cfg, batch, jax.random.key(2))
    return statistics.median(timer.kernel_times(flush_all_fn(cfg, kc), (pool, jnp.asarray(sets), token), DB.REPLAY_KERNEL, 3))

def main(out):
    t0 = time.time(); timer = DB.Timer(SMOKE); shape = DB.Shape(2, 4, 32) if SMOKE else DB.Shape(); res = dict(meta=DB.versions(), rebuild=[], fallback=[], bf16=[])
    res["meta"]["copy_bandwidth_GBps"] = 0.0 if SMOKE else DB.copy_bandwidth_GBps(timer)
    print(res["meta"], flush=True)
    # A: rebuild variants
    cases = [(4, 4)] if SMOKE else [(512, 16), (512, 32), (64, 32), (8, 16), (1, 16)]
    variants = [("sequential", sequential_rebuild, 4), ("weighted", WEIGHTED, 1), ("weighted", WEIGHTED, 2), ("weighted", WEIGHTED, 4)]
    for name, fn, unroll in variants:
        use_rebuild(fn)
        for batch, L in cases:
            kc = dataclasses.replace(default_kernel_config(batch), rebuild_unroll=unroll if batch > 2 else 8)
            cfg = shape.config(L, jnp.float32)
            try:
                nf, fl, cyc = DB.time_replay(timer, cfg, batch, kc, np.random.default_rng(0), 3, SMOKE, staggered=False)
            except Exception as e:
                print("FAILED", name, unroll, batch, L, repr(e)[:500], flush=True); continue
            row = dict(rebuild=name, unroll=kc.rebuild_unroll, batch=batch, cache_len=L, nonflush_us=nf, flush_us=fl, cycle_us=cyc)
            print("rebuild", json.dumps(row), flush=True); res["rebuild"].append(row)
    use_rebuild(WEIGHTED)
    # B: flush every step (pos 0) vs plain, small batch
    cfg = shape.config(16, jnp.float32)
    fb_cfgs = [(16, 1, 16, 0, 4)] if SMOKE else [(8, 1, 8, 0, 8), (16, 1, 16, 0, 4), (32, 2, 16, 0, 4), (32, 4, 16, 0, 4), (16, 1, 16, 1, 4), (32, 2, 16, 2, 4)]
    for batch in ((2,) if SMOKE else (1, 2, 4, 8, 16)):
        if time.time() - t0 > 420: break
        plain = {}
        for pc in (((16, 1),) if SMOKE else ((8, 1), (16, 1))):
            kcp = KernelConfig(block_v=pc[0], num_warps=pc[1])
            plain[pc] = DB.time_plain(timer, dataclasses.replace(cfg, cache_len=1), batch, kcp, np.random.default_rng(batch), 3, SMOKE)
        for bv, w, c, t, u in fb_cfgs:
            kc = KernelConfig(block_v=bv, num_warps=w, cache_chunk=c, tiles_per_program=t, rebuild_unroll=u)
            try:
                us = time_flush_all(timer, cfg, batch, kc)
            except Exception as e:
                print("FAILED fallback", batch, kc, repr(e)[:500], flush=True); continue
            row = dict(batch=batch, config=[bv, w, c, t, u], flush_all_us=us, plain_us={f"{k[0]},{k[1]}": v for k, v in plain.items()})
            print("fallback", json.dumps(row), flush=True); res["fallback"].append(row)
    # C: bf16 state tiles
    for batch in ((2,) if SMOKE else (64, 512)):
        if time.time() - t0 > 480: break
        cfgb = shape.config(16, jnp.bfloat16)
        plain = {}
        for pc in (((16, 1),) if SMOKE else ((16, 1), (32, 1), (32, 2))):
            kcp = KernelConfig(block_v=pc[0], num_warps=pc[1])
            plain[f"{pc[0]},{pc[1]}"] = DB.time_plain(timer, dataclasses.replace(cfgb, cache_len=1), batch, kcp, np.random.default_rng(batch), 3, SMOKE)
        for bv, w, t in (((16, 1, 1),) if SMOKE else ((32, 4, 4), (32, 4, 8), (64, 4, 4), (64, 8, 4), (64, 4, 2))):
            kc = KernelConfig(block_v=bv, num_warps=w, cache_chunk=16, tiles_per_program=t, rebuild_unroll=2)
            try:
                nf, fl, cyc = DB.time_replay(timer, cfgb, batch, kc, np.random.default_rng(0), 3, SMOKE, staggered=False)
            except Exception as e:
                print("FAILED bf16", batch, kc, repr(e)[:500], flush=True); continue
            row = dict(batch=batch, config=[bv, w, t], nonflush_us=nf, flush_us=fl, cycle_us=cyc, plain_us=plain)
            print("bf16", json.dumps(row), flush=True); res["bf16"].append(row)
        with open(out, "w") as f: json.dump(res, f, indent=1)
    with open(out, "w") as f: json.dump(res, f, indent=1)
    print(f"total {time.time() - t0:.0f} s")

if __name__ == "__main__":
    main(sys.argv[1])
