"""v28j (H200): where between B = 8 and 16 the re-read row's launch order starts to pay.

The B = 6-16 entry (one `[64, d_k]` tile per program, T = 1, W = 32) keeps row order: with
the launch order and the row read per tile (`reload_row`) it measured 19% slower at B = 8
(v28h: 9.9 / 9.7 -> 11.8 / 11.5 us, sync / staggered) but 20% faster staggered at B = 16
(17.9 / 22.8 -> 18.9 / 18.2). Here B = 10, 12, 14, 16 with both, sync and staggered, GDN fp32
L = 16, and the sweep rows (`decode_bench.sweep_row`, the summary file's format) of both at
B = 12 and 16, so the summary can take the chosen one. Prediction: the staggered gain grows
with B (flush rows per step ~B/16: at B = 10 most steps have none or one), so the crossover
of the sync/staggered geometric mean sits near B = 12.

  PYTHONPATH=$PWD python benchmarks/experiments/v28j_small_mid.py $OUT/v28j.json

Outcome: the crossover is below B = 10, not near 12. Sync / staggered us, table -> reload:
B = 10 14.0 / 13.9 -> 13.2 / 12.9, B = 12 15.6 / 19.9 -> 14.3 / 15.3 (faster in both), B = 14
16.8 / 21.2 -> 17.6 / 17.0, B = 16 17.9 / 22.9 -> 19.1 / 18.4. The table takes the re-read
launch order on this tile from B = 10 (B = 8 lost 19% in v28h; B = 9 stays in row order,
unmeasured).
"""

import dataclasses, json, os, sys, time, warnings
SMOKE = bool(os.environ.get("SMOKE"))
import jax.numpy as jnp, numpy as np
warnings.filterwarnings("ignore", message="The Pallas Triton backend is deprecated")
sys.path.insert(0, "benchmarks")
import decode_bench as DB
from pallas_kernels import ops

RELOAD = dict(rows_outermost=True, launch_order=True, reload_row=True)


def main(out):
    t0 = time.time(); timer = DB.Timer(SMOKE); res = dict(meta=DB.versions(), rows=[], sweep=[])
    bandwidth = res["meta"]["copy_bandwidth_GBps"] = 1000.0 if SMOKE else DB.copy_bandwidth_GBps(timer)
    shape = DB.Shape(2, 4, 32) if SMOKE else DB.Shape()
    cfg = shape.config(16, jnp.float32)
    for b in ((10,) if SMOKE else (10, 12, 14, 16)):
        bb = 2 if SMOKE else b
        entry = ops.default_kernel_config(b)
        plain = ops.default_kernel_config(b, "plain")
        row = dict(batch=b, entry=dataclasses.asdict(entry),
                   plain_us=DB.time_plain(timer, cfg, bb, plain, np.random.default_rng(b), 5, SMOKE))
        row.update(DB.time_both_cursors(timer, cfg, bb, "table", entry, b, SMOKE))
        row.update(DB.time_both_cursors(timer, cfg, bb, "reload", dataclasses.replace(entry, **RELOAD), b, SMOKE))
        DB.record_row(res, row, out)
        if b in (12, 16) or SMOKE:
            for name, kc in (("table", entry), ("reload", dataclasses.replace(entry, **RELOAD))):
                for r in DB.sweep_row(timer, shape, cfg, bb, bandwidth, SMOKE, (plain, kc)):
                    res["sweep"].append(dict(r, variant=name))
    with open(out, "w") as f:
        json.dump(res, f, indent=1)
    print(f"total {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main(sys.argv[1])
