"""v28h (H200): the re-read row (`KernelConfig.reload_row`) at B = 8-64, side by side.

v28b measured a grouped kernel that reads its row again in every tile: at B = 16-64 its
staggered steps beat the table's (B = 16 18.2 vs 22.6 us, B = 32 38.8 vs 44.3, B = 64 59.3 vs
67.9) at +2-6% on the sync cycle, but in a different process from v28's held row. Now both
are package options; per batch, in one process, sync and staggered cursors, GDN fp32 L = 16:

  table        the table's entry (B <= 16: T = 1, row order; B = 17-64: rows outermost)
  outer        rows outermost (B <= 16), or the table's entry
  held         rows outermost, launch order, the row held (v28)
  reload       rows outermost, launch order, the row read per tile (v28b)

and for a bf16 state at B = 16-64, where the table holds the row, "reload" beside it.
Prediction: "reload" as in v28b (staggered -12 to -19% at B = 16-64, sync +2-6%); "held"
as in v28 (the W = 32 flush +80% at B = 32-64).

  PYTHONPATH=$PWD python benchmarks/experiments/v28h_reload_row.py $OUT/v28h.json

Outcome: as predicted. Sync / staggered us, table -> reload: B = 16 17.9 / 22.8 -> 18.9 /
18.2, B = 32 29.5 / 44.2 -> 31.1 / 38.5, B = 48 42.3 / 56.3 -> 44.4 / 47.4, B = 64 55.2 /
67.7 -> 57.7 / 59.1; "held" at B = 32-64 as in v28 (flush 136-263 us, staggered 74-92);
but B = 8 9.9 / 9.7 -> 11.8 / 11.5. bf16: reload loses to the table's held row (B = 16
16.2 / 20.0 vs 15.6 / 19.2, B = 32 25.9 / 28.4 vs 24.1 / 26.2, B = 64 47.4 / 46.0 vs 46.2 /
47.0). The table's B = 17-64 entry takes the order with the row re-read; B = 6-16 (one entry
with B = 8) keeps row order.
"""

import dataclasses, os, sys, time, warnings
SMOKE = bool(os.environ.get("SMOKE"))
import jax.numpy as jnp, numpy as np
warnings.filterwarnings("ignore", message="The Pallas Triton backend is deprecated")
sys.path.insert(0, "benchmarks")
import decode_bench as DB
from pallas_kernels import ops

F32, BF16 = jnp.dtype("float32"), jnp.dtype("bfloat16")
VARIANTS = {"table": {}, "outer": dict(rows_outermost=True),
            "held": dict(rows_outermost=True, launch_order=True, reload_row=False),
            "reload": dict(rows_outermost=True, launch_order=True, reload_row=True)}


def main(out):
    t0 = time.time(); timer = DB.Timer(SMOKE); res = dict(meta=DB.versions(), rows=[])
    shape = DB.Shape(2, 4, 32) if SMOKE else DB.Shape()
    cases = [(F32, b) for b in (8, 16, 32, 48, 64)] + [(BF16, b) for b in (16, 32, 64)]
    for dt, b in (cases[:1] if SMOKE else cases):
        bb = 2 if SMOKE else b
        cfg = shape.config(16, dt)
        entry = ops.default_kernel_config(b, "replay", "gdn", dt)
        variants = VARIANTS if dt == F32 else {k: VARIANTS[k] for k in ("table", "reload")}
        row = dict(dtype=dt.name, batch=b, entry=dataclasses.asdict(entry), plain_us=DB.time_plain(
            timer, cfg, bb, ops.default_kernel_config(b, "plain", "gdn", dt), np.random.default_rng(b), 5, SMOKE))
        for name, change in variants.items():
            row.update(DB.time_both_cursors(timer, cfg, bb, name, dataclasses.replace(entry, **change), b, SMOKE))
        DB.record_row(res, row, out)
    print(f"total {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main(sys.argv[1])
