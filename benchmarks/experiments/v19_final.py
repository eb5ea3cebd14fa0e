"""v19 and v20 (H200): the package after v14-v18 (column chunks, row-outermost plain grid,
per-dtype table; the folding kernel's step in the plain kernel's order).

1. Small batch side by side: the folding kernel (W = 0 / 16 / 32) and the plain kernel
   (W = 0 / 16 / 32) at B = 1, 2, 4. Prediction: the plain-order fold at W = 32 within 5%
   of the plain kernel's 3.20 us at B = 1 (the side-by-side fold measured 3.74 at W = 32,
   3.36 at W = 0 in v18).
2. decode_bench sweep rows with the package's table: GDN fp32 L = 16 at B = 1 ... 512,
   L = 1 / 4 / 8 / 32 at B = 512, bf16 state L = 16 at B = 8 / 128 / 512, KDA at
   B = 128 / 512.

v19 ran without the check section. v20 (the commit that adds this line: q/k norms from
whole-row loads again, the T = 8 entry on whole rows) runs decode_bench's check section
first (CHECKS=1). Predictions for v20: the plain kernel back at v15's ~540 us at B = 512;
the B = 512 replay cycle back at ~407 us (flush ~1095).

  PYTHONPATH=$PWD python benchmarks/experiments/v19_final.py $OUT/v19.json
  CHECKS=1 PYTHONPATH=$PWD python benchmarks/experiments/v19_final.py $OUT/v20.json
`SMOKE=1` runs it on a CPU in interpret mode.
"""

import dataclasses, json, os, sys, time, warnings
SMOKE = bool(os.environ.get("SMOKE"))
import jax, jax.numpy as jnp, numpy as np
warnings.filterwarnings("ignore", message="The Pallas Triton backend is deprecated")
sys.path.insert(0, "benchmarks")
import decode_bench as DB
from pallas_kernels.common import KernelConfig

W = dataclasses.replace


def main(out):
    t0 = time.time(); timer = DB.Timer(SMOKE); res = dict(meta=DB.versions(), small=[], rows=[])
    bw = res["meta"]["copy_bandwidth_GBps"] = 1000.0 if SMOKE else DB.copy_bandwidth_GBps(timer)
    res["meta"]["timing"] = "CUPTI per-kernel times, median over steps; slot sets rotated past 3x L2"
    print(res["meta"], flush=True)
    if os.environ.get("CHECKS"):
        res["checks"] = DB.check_section(SMOKE)
    gdn = DB.Shape(2, 4, 32) if SMOKE else DB.Shape()
    kda = DB.Shape(4, 4, 32, "kda") if SMOKE else DB.Shape(32, 32, 128, "kda")
    fold = KernelConfig(block_v=8, num_warps=1, flush_every_step=True)
    plain8 = KernelConfig(block_v=8, num_warps=1, cache_chunk=8)
    for b in ((2,) if SMOKE else (1, 2, 4)):
        for w in ((0, 16) if SMOKE else (0, 16, 32)):
            rng = np.random.default_rng(b)
            p = DB.time_plain(timer, gdn.config(1, jnp.dtype("float32")), b, W(plain8, column_chunk=w), rng, 5, SMOKE)
            _, _, f = DB.time_replay(timer, gdn.config(16, jnp.dtype("float32")), b, W(fold, column_chunk=w), rng, 3, SMOKE, False)
            row = dict(batch=b, column_chunk=w, plain_us=p, fold_us=f)
            print("small", json.dumps(row), flush=True); res["small"].append(row)
    f32, bf16 = jnp.dtype("float32"), jnp.dtype("bfloat16")
    grid = [(gdn, f32, 16, b) for b in ((2,) if SMOKE else (512, 128, 8, 1, 4, 32, 64, 256))]
    if not SMOKE:
        grid += [(gdn, f32, L, 512) for L in (32, 8, 4, 1)] + [(gdn, bf16, 16, b) for b in (512, 128, 8)]
        grid += [(kda, f32, 16, b) for b in (512, 128)]
    for shape, dt, L, b in grid:
        if time.time() - t0 > (60 if SMOKE else 470):
            print("time guard", flush=True); break
        rows = DB.sweep_row(timer, shape, shape.config(L, dt), b, bw, SMOKE, DB.choose_configs({}, b, shape.gate, dt))
        for row in rows:
            row["source"] = os.path.basename(out).split(".")[0]
            print("row", json.dumps({k: row[k] for k in ("gate", "state_dtype", "cache_len", "batch", "cursors",
                  "plain_us", "replay_nonflush_us", "replay_flush_us", "replay_cycle_us",
                  "replay_roofline_fraction", "plain_roofline_fraction", "speedup_vs_plain")}), flush=True)
            res["rows"].append(row)
        with open(out, "w") as f: json.dump(res, f, indent=1)
    with open(out, "w") as f: json.dump(res, f, indent=1)
    print(f"total {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main(sys.argv[1])
