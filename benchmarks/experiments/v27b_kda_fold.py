"""v27b (H200): KDA with a 4-byte state flushing every step at every batch (the table after
v27), its GPU checks, and its B = 9-16 entry.

v27 measured the folding kernel on the plain kernel's large-batch tile (BV 16, `[16, 16]`
chunks, rows outermost) with the empty-cache branch at 1.00-1.05x the plain kernel for KDA
at B = 32-512, against the replay cycle's 0.82-0.89x, and the table now takes it from B = 9.
Here: the GPU checks (with the new "fold_kda" cases), the sweep rows at B = 128 and 512
(L = 16; synchronised and staggered), and at B = 12 and 16 that entry beside the others it
could be (the former (32, 2 warps, T = 2, U = 4) replay entry, the folding kernel at BV 8
with and without the branch, BV 16 on whole rows with the branch) and the plain kernel.
Prediction: B = 128 / 512 at ~1.02 / 1.00x; at B = 12-16 the chosen entry within 3% of the
best fold variant and above the T = 2 replay cycle (whose entry holds 255 registers, v25f).

  CHECKS=1 PYTHONPATH=$PWD python benchmarks/experiments/v27b_kda_fold.py $OUT/v27b.json

Outcome: B = 128 147.4 vs plain 150.7 us (1.02x; staggered 1.02x), B = 512 582.7 vs 583.4
(1.00x both); B = 12 the table's entry 16.0 vs plain 17.1 (1.07x; fold BV 8 16.4, BV 16 whole
rows 16.4, the T = 2 replay cycle 24.9), B = 16 20.6 vs 23.1 (1.12x; 20.9 / 22.3 / 26.2).
Checks pass (fold_kda 1.6e-7 both plans, every case as before, no pool copies).
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
    t0 = time.time(); timer = DB.Timer(SMOKE); res = dict(meta=DB.versions(), rows=[], small=[])
    bw = res["meta"]["copy_bandwidth_GBps"] = 1000.0 if SMOKE else DB.copy_bandwidth_GBps(timer)
    if os.environ.get("CHECKS"):
        res["checks"] = DB.check_section(SMOKE)
        print("checks", json.dumps([(c["gate"], c["layout"], c["precision"], c["dtype"], c["y_rel_err"],
                                     c["state_rel_err"], c["pool_copies"]) for c in res["checks"]]), flush=True)
    kda = DB.Shape(4, 4, 32, "kda") if SMOKE else DB.Shape(32, 32, 128, "kda")
    cfg = kda.config(16, F32)
    variants = {
        "table": None,
        "replay_t2": K(block_v=32, num_warps=2, tiles_per_program=2, rebuild_unroll=4),
        "fold_bv8": K(block_v=8, num_warps=1, flush_every_step=True),
        "fold_bv8_branch": K(block_v=8, num_warps=1, flush_every_step=True, empty_cache_branch=True),
        "fold_bv16_branch": K(block_v=16, num_warps=1, flush_every_step=True, empty_cache_branch=True),
    }
    for b in ((2,) if SMOKE else (12, 16)):
        row = dict(batch=b, plain_us=DB.time_plain(timer, cfg, b, ops.default_kernel_config(b, "plain", "kda"),
                                                   np.random.default_rng(b), 5, SMOKE))
        for name, kc in variants.items():
            kc = kc or ops.default_kernel_config(b, "replay", "kda")
            row[name + "_us"] = DB.time_replay(timer, cfg, b, kc, np.random.default_rng(b), 5, SMOKE, False)[2]
        print("small", json.dumps(row), flush=True)
        res["small"].append(row)
    for b in ((2,) if SMOKE else (128, 512)):
        for row in DB.sweep_row(timer, kda, cfg, b, bw, SMOKE, DB.choose_configs({}, b, "kda", F32, 16)):
            row["source"] = "v27b"
            print("row", json.dumps({k: row[k] for k in ("gate", "cache_len", "batch", "cursors", "block_v",
                  "flush_every_step", "empty_cache_branch", "plain_us", "replay_cycle_us", "speedup_vs_plain")}),
                  flush=True)
            res["rows"].append(row)
    with open(out, "w") as f: json.dump(res, f, indent=1)
    print(f"total {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main(sys.argv[1])
