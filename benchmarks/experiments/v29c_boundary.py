"""v29c (H200): where the `[64, d_k]` (T = 1) entry should hand over to the T = 4 entry.

v29b measured the T = 1 entry of B = 10-16 (BV 64, 4 warps, W = 32, rows outermost, launch
order, row per tile) beside the B = 17-64 entry (BV 32, T = 4, W = 32, the same launch
fields), GDN fp32 L = 16, sync / staggered us: B = 24 26.3 / 25.5 against 27.5 / 34.7
(both faster), B = 32 34.1 / 33.5 against 31.1 / 38.5 (sync +10%, staggered -13%), B = 48
and 64 slower in both. The table now takes the T = 1 entry up to B = 28 (the batches
nearest 24 of those measured); here both entries side by side at B = 17, 20, 28 and 30:

  table   the table's entry (T = 1 up to B = 28)
  t4      the B = 29-64 entry

  PYTHONPATH=$PWD python benchmarks/experiments/v29c_boundary.py $OUT/v29c.json

Prediction: T = 1 faster in both cursor modes at B = 17-28 (sync by 2-5%, staggered by
15-30%); at B = 30 sync +5-10% and staggered -10-15%, as at B = 32.

Outcome (raw/h200_2026-12-01_v29c_*; sync / staggered us, table against t4): B = 17 19.7 /
19.2 against 23.0 / 33.0 (plain 20.7), B = 20 23.6 / 22.6 against 25.2 / 33.5, B = 28 30.6 /
29.6 against 29.3 / 36.7: staggered gains as predicted or larger, but at B = 28 the sync
cycle is 4% slower. At B = 30 the table's entry is already t4, so that row compares t4 with
itself (30.2 / 37.8 against 30.2 / 37.6): B = 29-31 remain unmeasured with T = 1. The table
keeps B = 28.
"""

import dataclasses, os, sys, time, warnings
SMOKE = bool(os.environ.get("SMOKE"))
import jax.numpy as jnp, numpy as np
warnings.filterwarnings("ignore", message="The Pallas Triton backend is deprecated")
sys.path.insert(0, "benchmarks")
import decode_bench as DB
from pallas_kernels import ops

F32 = jnp.dtype("float32")


def main(out):
    t0 = time.time(); timer = DB.Timer(SMOKE); res = dict(meta=DB.versions(), rows=[])
    shape = DB.Shape(2, 4, 32) if SMOKE else DB.Shape()
    cfg = shape.config(16, F32)
    for b in (17, 20, 28, 30) if not SMOKE else (20,):
        bb = 2 if SMOKE else b
        configs = {"table": ops.default_kernel_config(b), "t4": ops.default_kernel_config(64)}
        row = dict(batch=b, entry={k: dataclasses.asdict(c) for k, c in configs.items()},
                   plain_us=DB.time_plain(timer, cfg, bb, ops.default_kernel_config(b, "plain"),
                                          np.random.default_rng(b), 5, SMOKE))
        for name, kc in configs.items():
            row.update(DB.time_both_cursors(timer, cfg, bb, name, kc, b, SMOKE))
        DB.record_row(res, row, out)
    print(f"total {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main(sys.argv[1])
