"""v23b (H200): where the folding kernel should hand over to the grouped kernel.

v23 (the package's table) measured the replay cycle against the plain kernel at B = 4 1.06x
(folding kernel, BV 8), B = 5 0.96x, 6 1.00x, 7 0.99x, 8 1.02x (grouped, one `[64, d_k]`
tile per program). Here the folding kernel (BV 8, as at B = 2-4) at B = 3, 5, 6, 7 beside the
plain kernel's table entry in the same run. Prediction: the folding kernel's margin shrinks
with B (v11: 1.05x at B = 4, 0.98x at B = 8), so ~1.02x at B = 5 and below 1.0 from B = 6.

  PYTHONPATH=$PWD python benchmarks/experiments/v23b_fold_boundary.py $OUT/v23b.json
"""

import json, os, sys, time, warnings
SMOKE = bool(os.environ.get("SMOKE"))
import jax, jax.numpy as jnp, numpy as np
warnings.filterwarnings("ignore", message="The Pallas Triton backend is deprecated")
sys.path.insert(0, "benchmarks")
import decode_bench as DB
from pallas_kernels.common import KernelConfig as K

F32 = jnp.dtype("float32")


def main(out):
    t0 = time.time(); timer = DB.Timer(SMOKE); res = dict(meta=DB.versions(), rows=[])
    gdn = DB.Shape(2, 4, 32) if SMOKE else DB.Shape()
    fold = K(block_v=8, num_warps=1, flush_every_step=True)
    for b in ((2,) if SMOKE else (3, 5, 6, 7)):
        plain_kc, table_kc = DB.choose_configs({}, b)
        plain = DB.time_plain(timer, gdn.config(1, F32), b, plain_kc, np.random.default_rng(b), 5, SMOKE)
        rng = np.random.default_rng(b * 1000 + 16)
        _, _, folded = DB.time_replay(timer, gdn.config(16, F32), b, fold, rng, 5, SMOKE, False)
        _, _, table = DB.time_replay(timer, gdn.config(16, F32), b, table_kc, rng, 5, SMOKE, False)
        row = dict(batch=b, plain_us=plain, fold_bv8_us=folded, table_cycle_us=table, table=repr(table_kc))
        print("row", json.dumps(row), flush=True); res["rows"].append(row)
    with open(out, "w") as f: json.dump(res, f, indent=1)
    print(f"total {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main(sys.argv[1])
