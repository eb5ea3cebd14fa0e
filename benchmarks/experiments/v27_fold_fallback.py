"""v27 (H200): where the replay cycle loses to the plain kernel at large batch (KDA at
B >= 128: 0.87-0.89x; a bf16 state at B = 8-256: 0.85-0.97x), does flushing every step
through the folding kernel, as the table does at small batch, lose less?

Once a row's cache is folded in, each such step is the plain recurrence on the checkpoint,
so at best it costs the plain kernel's time (1.00x). The folding kernel at the table's
small-batch tile (BV 8, whole rows) and at the plain kernel's large-batch tile (BV 16,
`[16, 16]` chunks, rows outermost), with and without the empty-cache branch, beside the
plain kernel and the replay entry, L = 16, synchronised cursors. KDA H_k = H_v = 32 at
B = 32 / 128 / 512; GDN with a bf16 state at B = 32 / 128. Prediction: the plain-tile
variant with the branch within 3% of the plain kernel (0.97-1.00x), so the table would
fold there instead of replaying.

  PYTHONPATH=$PWD python benchmarks/experiments/v27_fold_fallback.py $OUT/v27.json

Outcome: KDA as predicted, with the branch: plain-tile fold 39.2 / 147.9 / 583.1 us against
plain 41.0 / 150.3 / 585.9 (1.05 / 1.02 / 1.00x) and replay 50.2 / 172.4 / 656.5; without the
branch the same tile loses (44.5 / 169.0 / 666.3), BV 8 is between (39.3 / 157.5 / 678.5). A
bf16 state does not gain: B = 32 fold BV 8 21.6 vs plain 20.7 (replay 24.1), B = 128 82.2
vs 76.4 (replay 78.9); the plain tile 25.7-27.0 / 98.3-98.7. So the table folds KDA with a
4-byte state at every batch (v27b) and leaves bf16 states as they were.
"""

import json, os, sys, time, warnings
SMOKE = bool(os.environ.get("SMOKE"))
import jax.numpy as jnp, numpy as np
warnings.filterwarnings("ignore", message="The Pallas Triton backend is deprecated")
sys.path.insert(0, "benchmarks")
import decode_bench as DB
from pallas_kernels import ops
from pallas_kernels.common import KernelConfig as K

F32, BF16 = jnp.dtype("float32"), jnp.dtype("bfloat16")


def main(out):
    t0 = time.time(); timer = DB.Timer(SMOKE); res = dict(meta=DB.versions(), rows=[])
    gdn = DB.Shape(2, 4, 32) if SMOKE else DB.Shape()
    kda = DB.Shape(4, 4, 32, "kda") if SMOKE else DB.Shape(32, 32, 128, "kda")
    folds = {
        "fold_bv8": K(block_v=8, num_warps=1, flush_every_step=True),
        "fold_bv8_branch": K(block_v=8, num_warps=1, flush_every_step=True, empty_cache_branch=True),
        "fold_plain_tile": K(block_v=16, num_warps=1, flush_every_step=True, column_chunk=16, rows_outermost=True),
        "fold_plain_tile_branch": K(block_v=16, num_warps=1, flush_every_step=True, empty_cache_branch=True,
                                    column_chunk=16, rows_outermost=True),
    }
    cases = [(kda, F32, b) for b in (32, 128, 512)] + [(gdn, BF16, b) for b in (32, 128)]
    for shape, dt, b in (cases[:1] if SMOKE else cases):
        bb = 2 if SMOKE else b
        cfg = shape.config(16, dt)
        plain = ops.default_kernel_config(b, "plain", shape.gate, dt)
        row = dict(gate=shape.gate, dtype=dt.name, batch=b,
                   plain_us=DB.time_plain(timer, cfg, bb, plain, np.random.default_rng(b), 5, SMOKE))
        variants = {"replay_table": ops.default_kernel_config(b, "replay", shape.gate, dt), **folds}
        for name, kc in variants.items():
            row[name + "_us"] = DB.time_replay(timer, cfg, bb, kc, np.random.default_rng(b), 5, SMOKE, False)[2]
        print("row", json.dumps({k: (round(v, 2) if isinstance(v, float) else v) for k, v in row.items()}), flush=True)
        res["rows"].append(row)
        with open(out, "w") as f: json.dump(res, f, indent=1)
    print(f"total {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main(sys.argv[1])
