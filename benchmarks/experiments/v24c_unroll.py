"""v24c (H200): the v24 rebuild without its register cost.

v24/v24b measured the unmasked two-loop rebuild (the newest pos % U entries one by one,
then unmasked blocks of U) at B = 512: flush 1154 -> 965-985 us, but non-flush 342 -> 368
(+8%), from B = 8 to 512 and for a bf16 state (+22%), so the cycle lost 393 -> 405.
Nsight Compute on the GPU build gave the reason: XLA's Triton pipeline allocates the v23
kernel 96 registers per thread (5 programs per SM), the v24 kernel 128 (4 per SM); the
`triton` + ptxas build that `kernel_registers.py` runs on a CPU reports 128 for both.
Two ways to keep the flush's gain at v23's registers, each side by side with v23's
kernels (the export `_ab_old`):
  * U = 1: one unmasked loop of pos iterations (no remainder loop, one entry's loads
    live). v9 measured U = 1 fastest at B = 128, L = 16 with the v8 rebuild (111.7 vs
    119.3 us at U = 2). Prediction: 96 registers; flush between v23 and v24 (more round
    trips than U = 2, fewer instructions than v23), non-flush back to v23's.
  * "C" (tree `_ab_c`): one loop of ceil(pos / U) blocks, loads masked below row 0 but
    not clamped (v23 clamped the row, which breaks the addresses' constant stride).
    Prediction: 96 registers, flush -3 to -8%.
All three trees take `exp2` in the rebuild loop only and fold alpha into the rebuild.

  PYTHONPATH=<tree>:$PWD python benchmarks/experiments/v24c_unroll.py $OUT/v24c_<tree>.json

Trees: `_ab_old` (v23, commit 0479cb4's `pallas_kernels`), "new" (v24's rebuild with the
U = 1 loop and `exp2` in the loop only: branch `exp-v24-rebuild`) and `_ab_c` (as "new"
with the masked single loop). Outcome (NOTES.md v24c): v23 at U = 1 is as fast as either
(B = 512: 383.0 / 382.3 / 384.8 us against v23's U = 2 390.6), so main keeps v23's kernels
and v24d measures U = 1 for the table.
"""

import json, os, sys, time, warnings
SMOKE = bool(os.environ.get("SMOKE"))
import dataclasses
import jax.numpy as jnp, numpy as np
warnings.filterwarnings("ignore", message="The Pallas Triton backend is deprecated")
sys.path.insert(0, "benchmarks")
import decode_bench as DB
import pallas_kernels
from pallas_kernels import ops

F32, BF16 = jnp.dtype("float32"), jnp.dtype("bfloat16")


def main(out):
    t0 = time.time(); timer = DB.Timer(SMOKE)
    res = dict(meta=DB.versions(), kernels=os.path.dirname(pallas_kernels.__file__), rows=[])
    print(res["kernels"], flush=True)
    gdn = DB.Shape(2, 4, 32) if SMOKE else DB.Shape()
    kda = DB.Shape(4, 4, 32, "kda") if SMOKE else DB.Shape(32, 32, 128, "kda")
    B = (lambda b: 2) if SMOKE else (lambda b: b)
    table = lambda b, gate="gdn", dt=F32: ops.default_kernel_config(b, "replay", gate, dt)
    u1 = lambda kc: dataclasses.replace(kc, rebuild_unroll=1)
    cases = [(gdn, F32, b, kc) for b in (8, 128, 512) for kc in (table(b), u1(table(b)))]
    cases += [(gdn, BF16, 512, table(512, dt=BF16)), (gdn, BF16, 512, u1(table(512, dt=BF16))),
              (kda, F32, 512, table(512, "kda")), (kda, F32, 512, u1(table(512, "kda")))]
    for shape, dt, b, kc in (cases[:2] if SMOKE else cases):
        rng = np.random.default_rng(b * 1000 + 16)
        nf, fl, cyc = DB.time_replay(timer, shape.config(16, dt), B(b), kc, rng, 5, SMOKE, False)
        row = dict(gate=shape.gate, dtype=dt.name, batch=b, unroll=kc.rebuild_unroll, config=repr(kc),
                   nonflush_us=nf, flush_us=fl, cycle_us=cyc)
        print("row", json.dumps({k: v for k, v in row.items() if k != "config"}), flush=True)
        res["rows"].append(row)
        with open(out, "w") as f: json.dump(res, f, indent=1)
    print(f"total {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main(sys.argv[1])
