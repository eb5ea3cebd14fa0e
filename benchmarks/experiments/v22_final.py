"""v22 and v23 (H200): the package's table after v21/v21b — W = 64 chunks in the grouped kernel
from B = 65, `[64, d_k]` tiles one per program at B = 5-16, BV 4 at B = 1 (plain and folding
kernels) and B <= 2 (plain).

v22 ran it with every kernel issuing all of a step's loads before its first reduction (the
local branch `exp-v22-loads-first`, commit 42b3a11); v22b (`v22b_load_order.py`) then
measured that change side by side and it was not kept. v23 (CHECKS=1, B = 5 and 7 added, no
alternates) is the run of the kernels as committed; the summary file and README come from it.

Why the load order: ptxas issues global loads in program order and keeps them behind warp
shuffles, so the PTX of v21's kernels loaded q, reduced its norm, then loaded k, reduced,
then issued the gate, v and state-tile loads: three dependent memory round trips before the
tile's bytes were even requested. At small batch, where a step is one program's latency,
that is most of it. Predictions (against v21/v21b, same GPU, other runs): B = 1-8 plain and
replay 10-25% faster (two round trips of ~0.3-0.6 us each out of 3-10 us); B >= 128 within
2% (bandwidth-bound, many programs in flight); the fold-vs-plain ratio at B = 1-2 unchanged
(both lose the same round trips).

With CHECKS=1 the GPU checks run first. Then decode_bench sweep rows with the package's
table: GDN fp32 L = 16 at B = 1 ... 512 (with B = 2, 6, 16), L = 1/4/8/32 at B = 512, bf16
state L = 16 at B = 8/128/512, KDA at B = 1/8/128/512; and the alternates the table was not
sure of: B = 64 with W = 64, bf16 at B = 8 with the pre-v21 (32, 2, T = 2) entry.

  CHECKS=1 PYTHONPATH=$PWD python benchmarks/experiments/v22_final.py $OUT/v22.json
`SMOKE=1` runs it on a CPU in interpret mode.
"""

import dataclasses, json, os, sys, time, warnings
SMOKE = bool(os.environ.get("SMOKE"))
import jax, jax.numpy as jnp, numpy as np
warnings.filterwarnings("ignore", message="The Pallas Triton backend is deprecated")
sys.path.insert(0, "benchmarks")
import decode_bench as DB
from pallas_kernels.common import KernelConfig as K

KEYS = ("gate", "state_dtype", "cache_len", "batch", "cursors", "plain_us", "replay_nonflush_us",
        "replay_flush_us", "replay_cycle_us", "replay_roofline_fraction", "plain_roofline_fraction",
        "speedup_vs_plain")


def main(out):
    t0 = time.time(); timer = DB.Timer(SMOKE); res = dict(meta=DB.versions(), rows=[], alternates=[])
    bw = res["meta"]["copy_bandwidth_GBps"] = 1000.0 if SMOKE else DB.copy_bandwidth_GBps(timer)
    res["meta"]["timing"] = "CUPTI per-kernel times, median over steps; slot sets rotated past 3x L2"
    print(res["meta"], flush=True)
    if os.environ.get("CHECKS"):
        res["checks"] = DB.check_section(SMOKE)
    gdn = DB.Shape(2, 4, 32) if SMOKE else DB.Shape()
    kda = DB.Shape(4, 4, 32, "kda") if SMOKE else DB.Shape(32, 32, 128, "kda")
    f32, bf16 = jnp.dtype("float32"), jnp.dtype("bfloat16")

    def save():
        with open(out, "w") as f: json.dump(res, f, indent=1)

    def sweep(key, shape, dt, L, b, configs=None):
        if time.time() - t0 > (90 if SMOKE else 545):
            print("time guard", flush=True); return
        configs = configs or DB.choose_configs({}, b, shape.gate, dt)
        try:
            rows = DB.sweep_row(timer, shape, shape.config(L, dt), b, bw, SMOKE, configs)
        except Exception as e:
            print("failed", shape, dt, L, b, repr(e)[:300], flush=True); return
        for row in rows:
            row["source"] = os.path.basename(out).split(".")[0]
            print(key, json.dumps({k: row[k] for k in KEYS}), flush=True)
            res[key].append(row)
        save()

    v23 = os.path.basename(out).startswith("v23")
    batches = (512, 128, 8, 1, 2, 4, 6, 16, 32, 64, 256) + ((5, 7) if v23 else ())
    grid = [(gdn, f32, 16, b) for b in ((2,) if SMOKE else batches)]
    if not SMOKE:
        grid += [(gdn, f32, L, 512) for L in (32, 8, 4, 1)] + [(gdn, bf16, 16, b) for b in (512, 128, 8)]
        grid += [(kda, f32, 16, b) for b in (512, 128, 8, 1)]
    for shape, dt, L, b in grid:
        sweep("rows", shape, dt, L, b)
    if not SMOKE and not v23:
        w64 = K(block_v=32, num_warps=4, tiles_per_program=4, rebuild_unroll=2, column_chunk=64)
        sweep("alternates", gdn, f32, 16, 64, (DB.choose_configs({}, 64)[0], w64))
        old8 = K(block_v=32, num_warps=2, tiles_per_program=2, rebuild_unroll=4)
        sweep("alternates", gdn, bf16, 16, 8, (DB.choose_configs({}, 8, "gdn", bf16)[0], old8))
    save()
    print(f"total {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main(sys.argv[1])
