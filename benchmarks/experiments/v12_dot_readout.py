"""v12 experiment (H200): the grouped kernel's checkpoint readout `S_c x` (GDN) as a
tensor-core product `S_c [BV, d_k] @ X [d_k, 16]` (x in column 0, zeros elsewhere)
instead of a row sum, whose lane shuffles keep the load/store pipe busy (NOTES, v8).
Variants: row sum (the package, and at BV 16), one product per tile for both readouts in
3xTF32, in tf32 (lossy, for scale) and, at BV 16, in IEEE fp32 (Triton's FMA dot).
Per variant: y of one step against the row sum's (same state and token), and the replay
cycle at B = 512 and 128, L = 16. Prints rows, writes JSON to argv[1].

Ran on the H200 with the kernels of the commit that adds this script:
`PYTHONPATH=$PWD python benchmarks/experiments/v12_dot_readout.py $OUT/v12.json`
(raw/h200_2026-11-29_v12_dot_readout.*); `SMOKE=1` runs it on a CPU in interpret mode.
"""

import dataclasses, json, os, sys, time, warnings
SMOKE = bool(os.environ.get("SMOKE"))
import jax, jax.numpy as jnp, numpy as np
warnings.filterwarnings("ignore", message="The Pallas Triton backend is deprecated")
sys.path.insert(0, "benchmarks")
import decode_bench as DB
import replayssm_jax as R
from pallas_kernels import replay_decode_grouped as RG
from pallas_kernels.ops import default_kernel_config, pallas_layer_step
from replayssm_jax.decode import step_plan

ROW_SUM = RG.checkpoint_readout
N_COLS = 16  # a tensor-core product needs N >= 16
_trace = {}  # trace-time side channel: this program's q, and the last product per tile

def _load_qk_keeping_q(spec, q_ref, k_ref, b, hk):
    q, k = LOAD_QK(spec, q_ref, k_ref, b, hk)
    _trace["q"] = q
    return q, k

LOAD_QK = RG.common.load_qk

def paired_dot_readout(algorithm):
    """One `[BV, Dk] @ [Dk, 16]` product per tile for both readouts: the kernel asks for
    `S_c k` and then `S_c q` of the same tile; the first call computes both (q from the
    side channel) and the second returns the cached column."""
    def readout(s_c, x):
        col = jnp.arange(N_COLS)[None, :]
        if _trace.get("tile") is s_c:
            return jnp.sum(jnp.where(col == 1, _trace.pop("product"), 0.0), axis=1)
        xs = jnp.where(col == 0, x[:, None], jnp.where(col == 1, _trace["q"][:, None], 0.0))
        r = jnp.dot(s_c, xs, precision=algorithm, preferred_element_type=jnp.float32)  # [BV, 16]
        _trace.update(tile=s_c, product=r)
        return jnp.sum(jnp.where(col == 0, r, 0.0), axis=1)
    return readout

P = jax.lax.DotAlgorithmPreset
# (name, readout, kernel config at B = 512 / 128 or None for the package's)
VARIANTS = [
    ("row_sum", ROW_SUM, None),
    ("row_sum_bv16", ROW_SUM, (16, 4)),
    ("dot_tf32x3", paired_dot_readout(P.TF32_TF32_F32_X3), None),
    ("dot_tf32", paired_dot_readout(P.TF32_TF32_F32), None),
    ("dot_ieee_bv16", paired_dot_readout(P.F32_F32_F32), (16, 4)),
]

def use(fn):
    RG.checkpoint_readout = fn
    RG.common.load_qk = LOAD_QK if fn is ROW_SUM else _load_qk_keeping_q
    _trace.clear()
    DB.replay_cycle_fn.cache_clear(); DB.plain_steps_fn.cache_clear(); DB.time_plain_cached.cache_clear()
    jax.clear_caches()

def one_step_y(cfg, batch, kc):
    """y of one pallas step from a fixed pool (every row at cursor 7) and token."""
    pool = DB.random_pool(cfg, 2 * batch, jax.random.key(1), np.full(2 * batch, 7))
    token = DB.random_token(cfg, batch, jax.random.key(2))
    slots = jnp.asarray(np.random.default_rng(0).permutation(2 * batch)[:batch], jnp.int32)
    plan, kc = step_plan(cfg, pool.write_pos, slots, None, backend="pallas", kernel_config=kc)
    y, _ = jax.jit(lambda s: pallas_layer_step(s, *token, plan, use_qk_l2norm=True, scale=None,
                                               kernel_config=kc, interpret=SMOKE))(pool)
    return np.asarray(y, np.float64)

def main(out):
    t0 = time.time(); timer = DB.Timer(SMOKE); res = dict(meta=DB.versions(), rows=[])
    res["meta"]["copy_bandwidth_GBps"] = 0.0 if SMOKE else DB.copy_bandwidth_GBps(timer)
    print(res["meta"], flush=True)
    shape = DB.Shape(2, 4, 32) if SMOKE else DB.Shape()
    cfg = shape.config(16, jnp.float32)
    batches = (32,) if SMOKE else (512, 128)
    plain = {b: DB.time_plain(timer, dataclasses.replace(cfg, cache_len=1), b, default_kernel_config(b, "plain"),
                              np.random.default_rng(b), 3, SMOKE) for b in batches}
    config_of = lambda b, tiles: default_kernel_config(b) if tiles is None else dataclasses.replace(
        default_kernel_config(b), block_v=tiles[0], num_warps=tiles[1])
    use(ROW_SUM); y_ref = one_step_y(cfg, batches[0], config_of(batches[0], None))
    for name, fn, tiles in VARIANTS:
        if time.time() - t0 > 420: print("time guard", flush=True); break
        use(fn)
        try:
            y = one_step_y(cfg, batches[0], config_of(batches[0], tiles))
            row = dict(variant=name, tiles=tiles, y_rel_err_vs_row_sum=float(np.linalg.norm(y - y_ref) / np.linalg.norm(y_ref)))
            for b in batches:
                nf, fl, cyc = DB.time_replay(timer, cfg, b, config_of(b, tiles), np.random.default_rng(0), 3, SMOKE, staggered=False)
                row[f"B{b}"] = dict(plain_us=plain[b], nonflush_us=nf, flush_us=fl, cycle_us=cyc, speedup=plain[b] / cyc)
        except Exception as e:
            row = dict(variant=name, tiles=tiles, error=repr(e)[:800])
        print("row", json.dumps(row), flush=True); res["rows"].append(row)
        with open(out, "w") as f: json.dump(res, f, indent=1)
    use(ROW_SUM)
    print(f"total {time.time() - t0:.0f} s")

if __name__ == "__main__":
    main(sys.argv[1])
