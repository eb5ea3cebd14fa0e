"""v25c (H200): the table with the folding kernel's empty-cache branch at B <= 2 (GDN, fp32
state), in the sweep's row format, and the GPU checks on it.

v25/v25b measured the branch side by side with main's kernels (each tree in its own
process beside its own plain kernel): B = 1 3.17 -> 3.01 us against the plain kernel's
3.01-3.04, B = 2 (BV 4) 4.29 -> 4.07 against 4.13-4.16. The table now takes it at B <= 2
(BV 4). Rows: B = 1 at L = 4 / 8 / 16 / 32 and B = 2 at L = 16 (H_v = 32), B = 1 at H_v = 64,
L = 16 (predicted: the folding kernel level with the plain kernel or faster, ~1.00-1.02x);
and, unchanged kernels, the B = 4 rows that the summary still has from v11 (fp32 and bf16
state, L = 4 / 8 / 16 / 32) and B = 5 at L = 16 (predicted: as v23/v23b, ~1.03-1.06x).
With CHECKS=1 the GPU checks run first (`decode_bench.check_section`, on the package table).

  CHECKS=1 PYTHONPATH=$PWD python benchmarks/experiments/v25c_final.py $OUT/v25c.json

Outcome: B = 1 3.04 vs plain 3.01 us (0.99x) at every L, B = 2 4.16 vs 4.19 (1.01x),
H_v = 64 B = 1 4.00 vs 4.32 (1.08x); B = 4 1.04-1.06x (bf16 1.00-1.01x), B = 5 1.03x.
Checks pass (fp32 <= 4.6e-7, no pool copies).
"""

import json, os, sys, time, warnings
SMOKE = bool(os.environ.get("SMOKE"))
import jax.numpy as jnp
warnings.filterwarnings("ignore", message="The Pallas Triton backend is deprecated")
sys.path.insert(0, "benchmarks")
import decode_bench as DB

F32, BF16 = jnp.dtype("float32"), jnp.dtype("bfloat16")


def main(out):
    t0 = time.time(); timer = DB.Timer(SMOKE); res = dict(meta=DB.versions(), rows=[])
    bw = res["meta"]["copy_bandwidth_GBps"] = 1000.0 if SMOKE else DB.copy_bandwidth_GBps(timer)
    if os.environ.get("CHECKS"):
        res["checks"] = DB.check_section(SMOKE)
        print("checks", json.dumps([(c["gate"], c["layout"], c["precision"], c["dtype"], c["y_rel_err"],
                                     c["state_rel_err"], c["pool_copies"]) for c in res["checks"]]), flush=True)
    gdn, gdn64 = (DB.Shape(2, 4, 32), DB.Shape(2, 8, 32)) if SMOKE else (DB.Shape(), DB.Shape(16, 64, 128))
    cases = [(gdn, F32, L, 1) for L in (16, 4, 8, 32)] + [(gdn, F32, 16, 2), (gdn64, F32, 16, 1)]
    cases += [(gdn, dt, L, 4) for dt in (F32, BF16) for L in (4, 8, 16, 32)] + [(gdn, F32, 16, 5)]
    for shape, dt, L, b in (cases[:1] if SMOKE else cases):
        cfg = shape.config(L, dt)
        for row in DB.sweep_row(timer, shape, cfg, b, bw, SMOKE, DB.choose_configs({}, b, "gdn", dt, L)):
            row["source"] = "v25c"
            print("row", json.dumps({k: row[k] for k in (
                "num_v_heads", "state_dtype", "cache_len", "batch", "cursors", "block_v", "empty_cache_branch",
                "plain_us", "replay_nonflush_us", "replay_flush_us", "replay_cycle_us", "speedup_vs_plain")}),
                flush=True)
            res["rows"].append(row)
        with open(out, "w") as f: json.dump(res, f, indent=1)
    print(f"total {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main(sys.argv[1])
