"""v28d (H200): H_v = 64 at B = 512 after the launch order (v28c's sweep).

v28c measured GDN H_v = 64 with a bf16 state at B = 512, L = 16, at 621.7 us (sync) against
536.6 in the summary's row, which v8's kernels and table measured; no later kernel ran that
row. Is it the launch order? The table's B > 256 entry (rows outermost, launch order) beside
the same entry without the order and with neither, H_v = 64, bf16 and fp32 states, sync and
staggered cursors. Prediction: without the order within 2% of the entry at sync cursors
(as at H_v = 32, v28b), so 536.6 was v8's kernel, not a loss of this change.

  PYTHONPATH=$PWD python benchmarks/experiments/v28d_hv64.py $OUT/v28d.json

Outcome: wrong. bf16: the entry 621.0 / 617.4 us (sync / staggered), without the order
537.3 / 554.7, row index fastest 538.2 / 566.8: the order costs this shape 16% (non-flush
539 vs 460), while at H_v = 32 it cost nothing (v28b). fp32: the entry 788.6 / 786.9, without
the order 795.8 / 814.7, fastest 794.3 / 840.5. So 2-byte states take no launch order from
B = 257 (`ops._TWO_BYTE_REPLAY_FIRST`).
"""

import dataclasses, os, sys, time, warnings
SMOKE = bool(os.environ.get("SMOKE"))
import jax.numpy as jnp, numpy as np
warnings.filterwarnings("ignore", message="The Pallas Triton backend is deprecated")
sys.path.insert(0, "benchmarks")
import decode_bench as DB
from pallas_kernels import ops

VARIANTS = {"entry": {}, "no_order": dict(launch_order=False),
            "row_fastest": dict(launch_order=False, rows_outermost=False)}


def main(out):
    t0 = time.time(); timer = DB.Timer(SMOKE); res = dict(meta=DB.versions(), rows=[])
    shape = DB.Shape(2, 4, 32) if SMOKE else DB.Shape(16, 64, 128)
    for dt in (jnp.bfloat16, jnp.float32):
        b, bb = 512, 2 if SMOKE else 512
        cfg = shape.config(16, dt)
        entry = ops.default_kernel_config(b, "replay", "gdn", dt)
        row = dict(dtype=jnp.dtype(dt).name, num_v_heads=shape.num_v_heads, batch=b, entry=dataclasses.asdict(entry),
                   plain_us=DB.time_plain(timer, cfg, bb, ops.default_kernel_config(b, "plain", "gdn", dt),
                                          np.random.default_rng(b), 5, SMOKE))
        for name, change in VARIANTS.items():
            row.update(DB.time_both_cursors(timer, cfg, bb, name, dataclasses.replace(entry, **change), b, SMOKE))
        DB.record_row(res, row, out)
    print(f"total {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main(sys.argv[1])
