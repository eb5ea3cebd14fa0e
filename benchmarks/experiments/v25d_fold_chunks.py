"""v25d (H200): the folding kernel's empty-cache branch on `[4, 32]` column chunks at B <= 2.

With the branch (v25b/v25c) the folding kernel at BV 4 on whole rows takes 3.01-3.04 us at
B = 1 against the plain kernel's 3.01-3.04 (its `[4, 32]` chunks; on whole rows 3.07,
v23c). Chunks had cost the folding kernel layout conversions in its fold loop (v18: 3.74
vs 3.36 us); with the branch, rows at cursor 0 never enter that loop. Prediction: the
chunked branch at the plain kernel's time or up to 1% below it at B = 1 and 2. Each
configuration three times, interleaved, in one process beside the plain kernel's entry.

  PYTHONPATH=$PWD python benchmarks/experiments/v25d_fold_chunks.py $OUT/v25d.json

Outcome: whole rows stay best. B = 1: whole rows 3.008, `[4, 32]` 3.103, `[4, 16]` 3.135,
plain 3.008 us; B = 2: 4.064 / 4.097 / 4.26-4.29, plain 4.160 (all three repeats alike).
"""

import json, os, sys, time, warnings
SMOKE = bool(os.environ.get("SMOKE"))
import jax.numpy as jnp, numpy as np
warnings.filterwarnings("ignore", message="The Pallas Triton backend is deprecated")
sys.path.insert(0, "benchmarks")
import decode_bench as DB
from pallas_kernels import ops
from pallas_kernels.common import KernelConfig as K

F32 = jnp.dtype("float32")


def main(out):
    t0 = time.time(); timer = DB.Timer(SMOKE); res = dict(meta=DB.versions(), rows=[])
    gdn = DB.Shape(2, 4, 32) if SMOKE else DB.Shape()
    fold = lambda bv, w: K(block_v=bv, num_warps=1, flush_every_step=True, empty_cache_branch=True, column_chunk=w)
    cases = [(b, "plain", ops.default_kernel_config(b, "plain")) for b in (1, 2)]
    cases += [(b, "replay", fold(4, w)) for b in (1, 2) for w in (0, 32, 16)]
    for rep in range(1 if SMOKE else 3):
        for b, kernel, kc in cases:
            rng = np.random.default_rng(b)
            if kernel == "plain":
                us = DB.time_plain(timer, gdn.config(1, F32), b, kc, rng, 5, SMOKE)
            else:
                us = DB.time_replay(timer, gdn.config(16, F32), b, kc, rng, 5, SMOKE, False)[2]
            row = dict(batch=b, kernel=kernel, column_chunk=kc.column_chunk, rep=rep, config=repr(kc), us=us)
            print("row", json.dumps({k: v for k, v in row.items() if k != "config"}), flush=True)
            res["rows"].append(row)
    with open(out, "w") as f: json.dump(res, f, indent=1)
    print(f"total {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main(sys.argv[1])
