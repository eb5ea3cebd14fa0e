"""v29b (H200): the flush branch's cost to the committed kernel, and shorter flush programs
for staggered cursors at B = 17-64.

(a) v29's nf_only removed the flush branch from the hoisted kernel ("table" there); here the
    same edit on the committed kernel (`nf_head`) beside it (`head`), B = 512 and 128: what
    the non-flush step gains when the kernel carries no flush at all.
(b) At B = 32 a staggered step (38.8 us) outlasts the synchronised cycle (31.1 us) and the
    plain kernel (36.1): the B = 17-64 entry (BV 32, 4 warps, T = 4, W = 32, rows outermost,
    launch order, row per tile) runs a flush program over 4 tiles, ~3x an append program,
    and ~B/L rows flush in every step, so the step ends on a flush program however early it
    is issued (v28g). Fewer tiles per program shorten it, at the price of loading the key
    cache and reducing `K k`, `K q` once per T tiles instead of once per 4:

      table   the entry
      t2      T = 2 (the entry's other fields)
      t1      T = 1
      t1_64   one `[64, d_k]` tile per program (the B = 10-16 entry: BV 64, T = 1, W = 32)

    at B = 24, 32, 48, 64, GDN fp32 L = 16, sync and staggered cursors; each candidate's
    pool after one cycle checked against the entry's (< 1e-5).

  PYTHONPATH=$PWD python benchmarks/experiments/v29b_mid_batch.py $OUT/v29b.json
  ncu ... python benchmarks/experiments/v29_tile_pipeline.py regs head      (and nf_head, ...)

Predictions:
  (a) nf_head's non-flush step within 2% of head's (v29: the hoisted kernel without its
      flush, 334.5 us, against head's 338.2).
  (b) B = 32: t2 staggered ~32-34 us (a flush program half as long), sync +3-5% (the key
      side twice per key head); t1 / t1_64 staggered ~31-33, sync +5-10%; at B = 64, where
      staggered costs the entry only 3% over its sync cycle (59.2 vs 57.5), no candidate
      gains more than 3% staggered and each loses sync.

Outcome (raw/h200_2026-12-01_v29b_*): (a) B = 512 nf_head non-flush 344.0 us against head's
340.6 (cycle 386.3, flush 1071.7), Nsight Compute 72 registers against head's 96 (v25f):
7 programs per SM instead of 5 and no faster, so occupancy does not bind the non-flush step;
B = 128 nf_head 108.1 against 93.0, slower without the branch at the same 96 registers.
(b) sync / staggered: B = 24 table 27.5 / 34.7, t2 26.3 / 26.7, t1 30.7 / 29.6, t1_64 26.3 /
25.5; B = 32 31.1 / 38.5, 33.7 / 33.6, 39.5 / 39.2, 34.1 / 33.5; B = 48 44.3 / 47.1, 48.1 /
47.6, 55.8 / 56.2, 47.8 / 48.2; B = 64 57.6 / 59.0, 62.1 / 61.0, 72.4 / 72.4, 61.5 / 61.8.
At B = 32 the sync cost (+8-10%) was larger than predicted and B = 24 gained in both modes;
B = 64 as predicted. v29c places the hand-over.
"""

import dataclasses, os, sys, time, warnings
SMOKE = bool(os.environ.get("SMOKE"))
import numpy as np
warnings.filterwarnings("ignore", message="The Pallas Triton backend is deprecated")
sys.path.insert(0, "benchmarks")
sys.path.insert(0, "benchmarks/experiments")
import decode_bench as DB
import v29_tile_pipeline as V29
from pallas_kernels import ops

F32 = V29.F32
MID = {"table": {}, "t2": dict(tiles_per_program=2), "t1": dict(tiles_per_program=1),
       "t1_64": dict(block_v=64, tiles_per_program=1)}


def main(out):
    t0 = time.time(); timer = DB.Timer(SMOKE); res = dict(meta=DB.versions(), rows=[])
    shape = DB.Shape(2, 4, 32) if SMOKE else DB.Shape()
    cfg = shape.config(16, F32)
    plain = lambda b, bb: DB.time_plain(timer, cfg, bb, ops.default_kernel_config(b, "plain", "gdn", F32),
                                        np.random.default_rng(b), 5, SMOKE)
    for b in (512, 128) if not SMOKE else (512,):
        bb = 2 if SMOKE else b
        entry = ops.default_kernel_config(b, "replay", "gdn", F32)
        if SMOKE:
            entry = dataclasses.replace(entry, block_v=8, column_chunk=0)
        row = dict(part="a", batch=b, entry=dataclasses.asdict(entry), plain_us=plain(b, bb))
        for name in ("head", "nf_head"):
            row.update(DB.time_both_cursors(timer, cfg, bb, name, V29.use(name, entry), b, SMOKE))
        DB.record_row(res, row, out)
    V29.use("head", ops.default_kernel_config(32))  # (b) on the committed kernel
    for b in (24, 32, 48, 64) if not SMOKE else (32,):
        bb = 2 if SMOKE else b
        entry = ops.default_kernel_config(b, "replay", "gdn", F32)
        configs = {name: dataclasses.replace(entry, **change) for name, change in MID.items()}
        ref = DB.pool_after_cycle(cfg, bb, entry, SMOKE)
        row = dict(part="b", batch=b, entry=dataclasses.asdict(entry), plain_us=plain(b, bb))
        for name, kc in configs.items():
            got = DB.pool_after_cycle(cfg, bb, kc, SMOKE)
            row[f"err_{name}"] = max(DB.rel_err(x, y) for x, y in zip(got, ref))
            assert row[f"err_{name}"] < 1e-5, (name, row[f"err_{name}"])
            row.update(DB.time_both_cursors(timer, cfg, bb, name, kc, b, SMOKE))
        DB.record_row(res, row, out)
    print(f"total {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main(sys.argv[1])
