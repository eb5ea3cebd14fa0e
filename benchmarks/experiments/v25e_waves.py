"""v25e (H200): does the B > 256 entry lose its last partial wave?

The T = 8 entry runs one program per (row, key head): 16 B programs of 4 warps at 96
registers per thread (5 per SM, v24c), so 660 run at once on the H200's 132 SMs and
B = 512 is 12.4 waves. If the step were quantised in waves, the per-row time would be
~4.6% higher at B = 512 than at B = 495 (12.0 waves) or 536 (13.0). B = 412 / 454 / 495 /
512 / 536 / 577 (10.0 / 11.0 / 12.0 / 12.4 / 13.0 / 14.0 waves), GDN fp32, L = 16, sync
cursors: replay non-flush, flush and cycle, and the plain kernel (one-warp programs, 16x
as many: its control). Prediction: a partial staircase, per-row time at 512 2-4% above
495 and 536; none for the plain kernel.

  PYTHONPATH=$PWD python benchmarks/experiments/v25e_waves.py $OUT/v25e.json

Outcome: no staircase. Per-row time is flat within 1% from 10 to 14 waves: non-flush
659-665 ns, flush 2078-2095, cycle 748-755, plain 1052-1055 (B = 512: 660 / 2084 / 749 /
1052). The tail of a partial wave costs nothing measurable; the step is not wave-bound.
"""

import json, os, sys, time, warnings
SMOKE = bool(os.environ.get("SMOKE"))
import jax.numpy as jnp, numpy as np
warnings.filterwarnings("ignore", message="The Pallas Triton backend is deprecated")
sys.path.insert(0, "benchmarks")
import decode_bench as DB
from pallas_kernels import ops

F32 = jnp.dtype("float32")


def main(out):
    t0 = time.time(); timer = DB.Timer(SMOKE); res = dict(meta=DB.versions(), rows=[])
    gdn = DB.Shape(2, 4, 32) if SMOKE else DB.Shape()
    for b in ((2,) if SMOKE else (412, 454, 495, 512, 536, 577)):
        rng = np.random.default_rng(b)
        plain = DB.time_plain(timer, gdn.config(1, F32), b, ops.default_kernel_config(b, "plain"), rng, 5, SMOKE)
        nf, fl, cyc = DB.time_replay(timer, gdn.config(16, F32), b, ops.default_kernel_config(b), rng, 5, SMOKE, False)
        row = dict(batch=b, waves=16 * b / 660, plain_us=plain, nonflush_us=nf, flush_us=fl, cycle_us=cyc)
        row.update({f"{k}_per_row_ns": 1e3 * row[k] / b for k in ("plain_us", "nonflush_us", "flush_us", "cycle_us")
                    if row[k] is not None})
        print("row", json.dumps(row), flush=True)
        res["rows"].append(row)
        with open(out, "w") as f: json.dump(res, f, indent=1)
    print(f"total {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main(sys.argv[1])
