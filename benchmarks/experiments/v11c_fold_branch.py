"""v11c experiment (H200): the folding kernel with a straight-line branch for an empty
cache (no loop between the loads and the update) against the plain kernel at small batch,
and the replay cycle of the table's entry beside them. Prints rows, writes JSON to argv[1].

Ran on the H200 with the kernels of commit fb70d18 (the branch, reverted after this run):
`PYTHONPATH=$PWD python benchmarks/experiments/v11c_fold_branch.py $OUT/v11c.json`
(raw/h200_2026-11-29_v11c_fold_branch.*); `SMOKE=1` runs it on a CPU in interpret mode.
"""

import dataclasses, json, os, sys, time, warnings
SMOKE = bool(os.environ.get("SMOKE"))
import jax.numpy as jnp, numpy as np
warnings.filterwarnings("ignore", message="The Pallas Triton backend is deprecated")
sys.path.insert(0, "benchmarks")
import decode_bench as DB
from pallas_kernels.common import KernelConfig
from pallas_kernels.ops import default_kernel_config

def main(out):
    t0 = time.time(); timer = DB.Timer(SMOKE); res = dict(meta=DB.versions(), rows=[])
    res["meta"]["copy_bandwidth_GBps"] = 0.0 if SMOKE else DB.copy_bandwidth_GBps(timer)
    print(res["meta"], flush=True)
    shapes = {"gdn": DB.Shape(2, 4, 32) if SMOKE else DB.Shape(),
              "kda": DB.Shape(4, 4, 32, "kda") if SMOKE else DB.Shape(32, 32, 128, "kda"),
              "gdn_hv64": DB.Shape(2, 4, 32) if SMOKE else DB.Shape(16, 64, 128)}
    tiles = [(16, 1)] if SMOKE else [(8, 1), (16, 1), (16, 2), (32, 4)]
    cases = [("gdn", "float32", 2)] if SMOKE else (
        [("gdn", "float32", b) for b in (1, 2, 4, 8, 16)]
        + [("gdn", "bfloat16", b) for b in (1, 4, 8)] + [("kda", "float32", b) for b in (1, 4, 8)]
        + [("gdn_hv64", "float32", b) for b in (1, 8)])
    for shape, dtype, batch in cases:
        if time.time() - t0 > 420: print("time guard", flush=True); break
        cfg = shapes[shape].config(16, jnp.dtype(dtype))
        row = dict(shape=shape, state_dtype=dtype, batch=batch, plain={}, fold={})
        for bv, w in ([(16, 1)] if SMOKE else [(8, 1), (16, 1)]):
            row["plain"][f"{bv},{w}"] = DB.time_plain(timer, dataclasses.replace(cfg, cache_len=1), batch,
                                                      KernelConfig(block_v=bv, num_warps=w), np.random.default_rng(batch), 3, SMOKE)
        for bv, w in tiles:
            kc = KernelConfig(block_v=bv, num_warps=w, flush_every_step=True)
            row["fold"][f"{bv},{w}"] = DB.time_replay(timer, cfg, batch, kc, np.random.default_rng(0), 3, SMOKE, staggered=False)[2]
        if batch >= 4:
            kc = dataclasses.replace(default_kernel_config(16), flush_every_step=False)
            nf, fl, cyc = DB.time_replay(timer, cfg, batch, kc, np.random.default_rng(0), 3, SMOKE, staggered=False)
            stag = DB.time_replay(timer, cfg, batch, kc, np.random.default_rng(0), 3, SMOKE, staggered=True)[2]
            row["replay_table16"] = dict(nonflush_us=nf, flush_us=fl, cycle_us=cyc, staggered_us=stag)
        print("row", json.dumps(row), flush=True); res["rows"].append(row)
        with open(out, "w") as f: json.dump(res, f, indent=1)
    print(f"total {time.time() - t0:.0f} s")

if __name__ == "__main__":
    main(sys.argv[1])
