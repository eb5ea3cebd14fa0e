"""v28g (H200): the launch order at B = 32-256 on other grouped tiles.

After v28 the B = 17-64 entry (T = 4, W = 32) runs rows outermost without the order: the held
row index cost its flush 80% (v28f: same registers, so the schedule), and staggered steps
stay at 0.82x plain at B = 32. The B = 65-256 entry (T = 4, W = 64) takes the order, but its
sync flush grew 270 -> 322 us at B = 128. Two tiles the order did not slow elsewhere, beside
the table's entry, sync and staggered cursors, GDN fp32 L = 16:

  table   the table's entry
  w64     T = 4 with W = 64 chunks, rows outermost, launch order (the B = 65-256 entry)
  t8      T = 8 with W = 64 chunks, rows outermost, launch order, U = 2 (the B > 256 entry
          with the longer-cache unroll)

Prediction: at B = 32-64 "w64" without the W = 32 flush penalty: sync within 7% of the
table (v21: W = 64 7% slower at B = 32), staggered 10-15% faster; at B = 128-256 "t8"
within 3% of the table at sync cursors and no worse staggered.

  PYTHONPATH=$PWD python benchmarks/experiments/v28g_mid_batch.py $OUT/v28g.json

Outcome: wrong; the table stays. B = 32: "w64" sync 33.2 vs 29.5 us (+13%) and staggered
50.9 vs 44.2 (worse: its flush 97 vs 78 us, and at this batch the flush program's own length
is the staggered step's tail whatever the order); "t8" 30.4 / 73.3. B = 64: "w64" 59.1 / 66.6
vs 55.2 / 67.2, "t8" 61.0 / 91.5. B = 128 ("w64" is the entry): 107.3 / 106.1, "t8" 109.9 /
121.9. B = 256: "t8" 203.0 / 202.7 vs 204.4 / 205.3 (within 1.3%, not worth a row).
"""

import dataclasses, os, sys, time, warnings
SMOKE = bool(os.environ.get("SMOKE"))
import jax.numpy as jnp, numpy as np
warnings.filterwarnings("ignore", message="The Pallas Triton backend is deprecated")
sys.path.insert(0, "benchmarks")
import decode_bench as DB
from pallas_kernels import ops
from pallas_kernels.common import KernelConfig as K

VARIANTS = {
    "w64": K(block_v=32, num_warps=4, tiles_per_program=4, rebuild_unroll=2, column_chunk=64,
             rows_outermost=True, launch_order=True),
    "t8": K(block_v=32, num_warps=4, tiles_per_program=8, rebuild_unroll=2, column_chunk=64,
            rows_outermost=True, launch_order=True),
}


def main(out):
    t0 = time.time(); timer = DB.Timer(SMOKE); res = dict(meta=DB.versions(), rows=[])
    shape = DB.Shape(2, 4, 32) if SMOKE else DB.Shape()
    cfg = shape.config(16, jnp.float32)
    for b in ((32,) if SMOKE else (32, 64, 128, 256)):
        bb = 2 if SMOKE else b
        entry = ops.default_kernel_config(b)
        row = dict(batch=b, entry=dataclasses.asdict(entry), plain_us=DB.time_plain(
            timer, cfg, bb, ops.default_kernel_config(b, "plain"), np.random.default_rng(b), 5, SMOKE))
        for name, kc in {"table": entry, **VARIANTS}.items():
            row.update(DB.time_both_cursors(timer, cfg, bb, name, kc, b, SMOKE))
        DB.record_row(res, row, out)
    print(f"total {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main(sys.argv[1])
