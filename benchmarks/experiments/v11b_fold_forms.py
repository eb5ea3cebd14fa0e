"""v11b experiment (H200): the folding kernel with y read from the updated tile
(`y = S_t q`, the plain kernel's form) against `common.delta_rule_step`'s side-by-side
readouts, and both against the plain kernel, at small batch (GDN H_v = 32, L = 16).
Prints rows, writes JSON to argv[1].

Ran on the H200 with the kernels of commit 8af0518:
`PYTHONPATH=$PWD python benchmarks/experiments/v11b_fold_forms.py $OUT/v11b.json`
(raw/h200_2026-11-29_v11b_fold_forms.*); `SMOKE=1` runs it on a CPU in interpret mode.
"""

import dataclasses, json, os, sys, time, warnings
SMOKE = bool(os.environ.get("SMOKE"))
import jax, jax.numpy as jnp, numpy as np
warnings.filterwarnings("ignore", message="The Pallas Triton backend is deprecated")
sys.path.insert(0, "benchmarks")
import decode_bench as DB
from pallas_kernels import common
from pallas_kernels.common import KernelConfig

SIDE_BY_SIDE = common.delta_rule_step

def from_updated_tile(spec, state, q, k, v, g, beta):
    """The plain kernel's order: decay the tile, u from it, S_t, then y = S_t q."""
    decayed = state * common.over_rows(spec, jnp.exp(g))
    u = beta * (v - jnp.sum(decayed * k[None, :], axis=1))
    new = decayed + u[:, None] * k[None, :]
    return jnp.sum(new * q[None, :], axis=1), u, new

def use_step(fn):
    common.delta_rule_step = fn
    DB.replay_cycle_fn.cache_clear(); DB.plain_steps_fn.cache_clear(); DB.time_plain_cached.cache_clear()
    jax.clear_caches()

def main(out):
    t0 = time.time(); timer = DB.Timer(SMOKE); res = dict(meta=DB.versions(), rows=[])
    res["meta"]["copy_bandwidth_GBps"] = 0.0 if SMOKE else DB.copy_bandwidth_GBps(timer)
    print(res["meta"], flush=True)
    shape = DB.Shape(2, 4, 32) if SMOKE else DB.Shape()
    tiles = [(16, 1)] if SMOKE else [(8, 1), (16, 1), (16, 2), (32, 4)]
    cases = [("float32", 2)] if SMOKE else [("float32", b) for b in (1, 2, 4, 8, 16)] + [("bfloat16", 8)]
    for dtype, batch in cases:
        if time.time() - t0 > 400: print("time guard", flush=True); break
        cfg = shape.config(16, jnp.dtype(dtype))
        row = dict(state_dtype=dtype, batch=batch, plain={}, fold_side_by_side={}, fold_from_updated={})
        for bv, w in ([(16, 1)] if SMOKE else [(8, 1), (16, 1)]):
            row["plain"][f"{bv},{w}"] = DB.time_plain(timer, dataclasses.replace(cfg, cache_len=1), batch,
                                                      KernelConfig(block_v=bv, num_warps=w), np.random.default_rng(batch), 3, SMOKE)
        for name, fn in (("fold_side_by_side", SIDE_BY_SIDE), ("fold_from_updated", from_updated_tile)):
            use_step(fn)
            for bv, w in tiles:
                kc = KernelConfig(block_v=bv, num_warps=w, flush_every_step=True)
                row[name][f"{bv},{w}"] = DB.time_replay(timer, cfg, batch, kc, np.random.default_rng(0), 3, SMOKE, staggered=False)[2]
        use_step(SIDE_BY_SIDE)
        print("row", json.dumps(row), flush=True); res["rows"].append(row)
        with open(out, "w") as f: json.dump(res, f, indent=1)
    print(f"total {time.time() - t0:.0f} s")

if __name__ == "__main__":
    main(sys.argv[1])
