"""v24d (H200): U = 1 against U = 2 for the T = 8 entry (B > 256), on the v23 kernels.

v24c measured v23's kernels (HEAD's `pallas_kernels`, the rebuild as in v23) at B = 512,
L = 16, GDN fp32: U = 1 383.0 us against U = 2 390.6 (flush 1064 vs 1152, non-flush 337.6
vs 339.8; both 96 registers in the GPU build); B = 128 (T = 4) 105.6 vs 104.9; bf16 state
278.9 vs 272.3; KDA 660.8 vs 656.2. Before the table takes U = 1 for GDN fp32 at B > 256,
the other rows that entry serves, each with both unrolls and the sweep's row format
(synchronised and staggered cursors, bytes and floors):
  * L = 4 / 8 / 16 / 32 at B = 512 (predicted: U = 1 ahead by ~2% at L = 8-16; at L = 32
    the rebuild walks 31 entries, U = 1 may lose), B = 300 at L = 16 (predicted ~2% ahead);
  * H_v = 64 at B = 512 (predicted: as H_v = 32).
With CHECKS=1 the GPU checks run first (`decode_bench.check_section`, on the package table).

  CHECKS=1 PYTHONPATH=$PWD python benchmarks/experiments/v24d_final.py $OUT/v24d.json
"""

import dataclasses, json, os, sys, time, warnings
SMOKE = bool(os.environ.get("SMOKE"))
import jax.numpy as jnp
warnings.filterwarnings("ignore", message="The Pallas Triton backend is deprecated")
sys.path.insert(0, "benchmarks")
import decode_bench as DB
from pallas_kernels import ops

F32 = jnp.dtype("float32")


def main(out):
    t0 = time.time(); timer = DB.Timer(SMOKE); res = dict(meta=DB.versions(), rows=[])
    bw = res["meta"]["copy_bandwidth_GBps"] = 1000.0 if SMOKE else DB.copy_bandwidth_GBps(timer)
    if os.environ.get("CHECKS"):
        res["checks"] = DB.check_section(SMOKE)
        print("checks", json.dumps([(c["gate"], c["layout"], c["precision"], c["dtype"], c["y_rel_err"],
                                     c["state_rel_err"], c["pool_copies"]) for c in res["checks"]]), flush=True)
    gdn, gdn64 = (DB.Shape(2, 4, 32), DB.Shape(2, 8, 32)) if SMOKE else (DB.Shape(), DB.Shape(16, 64, 128))
    B = (lambda b: 2) if SMOKE else (lambda b: b)
    cases = [(gdn, L, 512) for L in (16, 4, 8, 32)] + [(gdn, 16, 300), (gdn64, 16, 512)]
    for shape, L, b in (cases[:1] if SMOKE else cases):
        plain = ops.default_kernel_config(b, "plain")
        for unroll in (1, 2):
            replay = dataclasses.replace(ops.default_kernel_config(b), rebuild_unroll=unroll)
            for row in DB.sweep_row(timer, shape, shape.config(L, F32), B(b), bw, SMOKE, (plain, replay)):
                row["source"] = "v24d"
                print("row", json.dumps({k: row[k] for k in (
                    "num_v_heads", "cache_len", "batch", "cursors", "rebuild_unroll", "plain_us",
                    "replay_nonflush_us", "replay_flush_us", "replay_cycle_us", "speedup_vs_plain",
                    "replay_roofline_fraction")}), flush=True)
                res["rows"].append(row)
            with open(out, "w") as f: json.dump(res, f, indent=1)
    print(f"total {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main(sys.argv[1])
