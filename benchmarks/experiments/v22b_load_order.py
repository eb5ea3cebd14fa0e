"""v22b (H200): issuing every load of a step before the first reduction, side by side.

v22 ran the kernels with all loads first (`common.load_token` / `prepare_token`) and, against
v21/v21b's runs, measured the plain kernel 2.3% slower at B = 512 (552.5 vs 540 us), no change
at B = 1 (3.04), and the one-tile grouped entry 12% slower at B = 8 but 10% faster at B = 6.
The prediction (10-25% faster at B <= 8) assumed the PTX's load order is the order the GPU
issues them; ptxas schedules SASS itself, so the claim needs a same-machine A/B.

The script times one set of kernel configurations with whatever `pallas_kernels` is first on
PYTHONPATH; the device run points it at main's tree before v22 (an export of d10e7bc's
`pallas_kernels`, loads interleaved with reductions) and at the v22 tree, back to back, twice:

  PYTHONPATH=_ab_old:$PWD python benchmarks/experiments/v22b_load_order.py $OUT/old1.json
  PYTHONPATH=$PWD python benchmarks/experiments/v22b_load_order.py $OUT/new1.json   (and again)
"""

import json, os, sys, time, warnings
SMOKE = bool(os.environ.get("SMOKE"))
import jax, jax.numpy as jnp, numpy as np
warnings.filterwarnings("ignore", message="The Pallas Triton backend is deprecated")
sys.path.insert(0, "benchmarks")
import decode_bench as DB
import pallas_kernels
from pallas_kernels.common import KernelConfig as K

F32, BF16 = jnp.dtype("float32"), jnp.dtype("bfloat16")


def main(out):
    t0 = time.time(); timer = DB.Timer(SMOKE)
    res = dict(meta=DB.versions(), kernels=os.path.dirname(pallas_kernels.__file__), rows=[])
    print(res["kernels"], flush=True)
    gdn = DB.Shape(2, 4, 32) if SMOKE else DB.Shape()
    B = (lambda b: 2) if SMOKE else (lambda b: b)
    g = lambda bv, w, t, u, c: K(block_v=bv, num_warps=w, tiles_per_program=t, rebuild_unroll=u, column_chunk=c)
    plain = [(1, K(block_v=4, num_warps=1, column_chunk=32)), (8, K(block_v=16, num_warps=1)),
             (128, K(block_v=16, num_warps=1, column_chunk=16, rows_outermost=True)),
             (512, K(block_v=16, num_warps=1, column_chunk=16, rows_outermost=True))]
    replay = [(F32, 1, K(block_v=4, num_warps=1, flush_every_step=True)),
              (F32, 2, K(block_v=8, num_warps=1, flush_every_step=True)),
              (F32, 6, g(64, 4, 1, 2, 32)), (F32, 8, g(64, 4, 1, 2, 32)), (F32, 16, g(64, 4, 1, 2, 32)),
              (F32, 8, g(32, 2, 2, 4, 32)), (F32, 128, g(32, 4, 4, 2, 64)), (F32, 512, g(32, 4, 8, 2, 64)),
              (BF16, 8, g(32, 2, 2, 4, 0)), (BF16, 8, K(block_v=8, num_warps=1, flush_every_step=True)),
              (BF16, 8, K(block_v=16, num_warps=1, flush_every_step=True))]
    for b, kc in (plain[:1] if SMOKE else plain):
        us = DB.time_plain(timer, gdn.config(1, F32), B(b), kc, np.random.default_rng(b), 5, SMOKE)
        row = dict(kernel="plain", dtype="float32", batch=b, config=repr(kc), us=us)
        print("row", json.dumps(row), flush=True); res["rows"].append(row)
    for dt, b, kc in (replay[:2] if SMOKE else replay):
        rng = np.random.default_rng(b * 1000 + 16)
        nf, fl, cyc = DB.time_replay(timer, gdn.config(16, dt), B(b), kc, rng, 5, SMOKE, False)
        row = dict(kernel="replay", dtype=dt.name, batch=b, config=repr(kc), nonflush_us=nf, flush_us=fl, cycle_us=cyc)
        print("row", json.dumps(row), flush=True); res["rows"].append(row)
    if not SMOKE:
        us = DB.time_plain(timer, gdn.config(1, BF16), 8, K(block_v=16, num_warps=1), np.random.default_rng(8), 5, SMOKE)
        res["rows"].append(dict(kernel="plain", dtype="bfloat16", batch=8, config="BV16/1w", us=us))
    with open(out, "w") as f: json.dump(res, f, indent=1)
    print(f"total {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main(sys.argv[1])
