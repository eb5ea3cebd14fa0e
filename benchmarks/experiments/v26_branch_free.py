"""v26 (H200): the grouped kernel with the flush decided once per program instead of once
per tile (branch `exp-v26-branch-free`).

Since v4 the grouped kernel's tile loop holds the flush as a branch in every iteration
(`pl.when(mode == FLUSH)` around the rebuild), so an append row's tile loop is a loop with
a branch in it, and ptxas cannot schedule one tile's loads ahead of the previous tile's
work. v25 showed such structure costs time even when never taken (the folding kernel's
zero-trip fold loop: 0.13-0.16 us at B = 1). Here an append row and a flush row each run a
tile loop of their own (the readout code twice in the kernel); "new" keeps the append
loop a `fori_loop`, "new-unrolled" (V26_UNROLL=1) writes its T tiles out, so tile p+1's
loads can be issued before tile p's row sums. Each tree in its own process; `_ab_old` is
main's `pallas_kernels`. v3 tried top-level flush / append branches on an older kernel and
lost to registers (the flush branch set them for every program); the GPU build held v24d's
entry at 96 registers, and the flush branch is unchanged here.
Prediction: non-flush -2 to -5% at B = 512 if the GPU build stays at 96 registers
(unrolled: more if it does, a loss like v5's if the unrolled loads cost registers); flush
unchanged.

  [V26_UNROLL=1] PYTHONPATH=<tree>:$PWD python benchmarks/experiments/v26_branch_free.py $OUT/v26_<tree>.json

Then Nsight Compute's launch__registers_per_thread of the B = 512 entry for both variants
(`v24c_registers.py 512 table`, V26_UNROLL=0/1).

Outcome (not kept): the GPU build went from 96 to 121 registers (128 unrolled), 4 programs
per SM instead of 5, and B = 512 lost: non-flush 338 -> 363 (371 unrolled), flush 1066 ->
1111, cycle 384 -> 410 (418). B = 8 9.74 -> 11.49; B = 128 105.0 -> 110.6; B = 32 30.2 ->
29.3 (-3%); bf16 state B = 512 272.4 -> 270.2 (unrolled 309); KDA 656.5 -> 654.5 (unrolled
670.7). With the readout in the kernel twice the allocation grows, whichever branch runs.
"""

import json, os, sys, time, warnings
SMOKE = bool(os.environ.get("SMOKE"))
import jax.numpy as jnp, numpy as np
warnings.filterwarnings("ignore", message="The Pallas Triton backend is deprecated")
sys.path.insert(0, "benchmarks")
import decode_bench as DB
import pallas_kernels
from pallas_kernels import ops

F32, BF16 = jnp.dtype("float32"), jnp.dtype("bfloat16")


def main(out):
    t0 = time.time(); timer = DB.Timer(SMOKE)
    res = dict(meta=DB.versions(), kernels=os.path.dirname(pallas_kernels.__file__),
               unroll=os.environ.get("V26_UNROLL"), rows=[])
    print(res["kernels"], res["unroll"], flush=True)
    gdn = DB.Shape(2, 4, 32) if SMOKE else DB.Shape()
    kda = DB.Shape(4, 4, 32, "kda") if SMOKE else DB.Shape(32, 32, 128, "kda")
    B = (lambda b: 2) if SMOKE else (lambda b: b)
    cases = [(gdn, F32, 512), (gdn, F32, 128), (gdn, F32, 32), (gdn, F32, 8), (gdn, BF16, 512), (kda, F32, 512)]
    for shape, dt, b in (cases[:1] if SMOKE else cases):
        kc = ops.default_kernel_config(b, "replay", shape.gate, dt)
        nf, fl, cyc = DB.time_replay(timer, shape.config(16, dt), B(b), kc, np.random.default_rng(b), 5, SMOKE, False)
        row = dict(gate=shape.gate, dtype=dt.name, batch=b, config=repr(kc), nonflush_us=nf, flush_us=fl, cycle_us=cyc)
        print("row", json.dumps({k: v for k, v in row.items() if k != "config"}), flush=True)
        res["rows"].append(row)
        with open(out, "w") as f: json.dump(res, f, indent=1)
    print(f"total {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main(sys.argv[1])
