"""v25 (H200): batch 1-8 latency (slot and token loads hoisted; the folding kernel's
empty-cache branch), and the tensor-core rebuild precisions at the table's entries.

1. Small batch. After v24d ReplaySSM is 0.95x the plain kernel at B = 1 (folding kernel
   3.17 vs 3.01 us) and 0.97x at B = 2 (4.29 vs 4.16); v23c found the chunks are not the
   gap. Two changes, each tree timed in its own process beside its own plain kernel:
   * `_ab_hoist`: the plain and folding kernels load the row's slot (and cursor) and its
     token before the branch on the row's mode, which held them back one dependent round
     trip (mode -> slot -> state tile). Prediction: both kernels ~0.3-0.5 us faster at
     B = 1-8 (one L2 round trip of ~3 us), their ratio unchanged; B = 512 within 1%.
   * the working tree ("new"): as `_ab_hoist`, and the folding kernel branches on
     `pos == 0` to a copy of the token step without the fold loop. Prediction: the
     folding kernel within 1-2% of the plain kernel at B = 1-2 (v23c: the loop and its
     branches were the remaining difference).
   `_ab_old` is main's `pallas_kernels` (fac5e0a).
2. Rebuild precision (PRECISION=1, one tree). The default exact rebuild's flush is 2.0x
   the plain kernel at B = 512 (1065 us); SGLang's peer, whose flush re-reads the
   checkpoint, takes 843 us and its cycle 376 us (../shared/replayssm.md §10; §11 says such
   peers rebuild on tensor cores in the input dtype). The package's "tf32" and "bf16"
   rebuilds at the table entries for B = 8, 32, 128, 512 (L = 16, fp32 state), with
   "ieee" beside them. Prediction: tf32 flush ~800-850 us at B = 512 if the dot's
   registers stay within the non-flush step's 96 (cycle ~370 us, 1.46x); if they do not,
   the non-flush step loses as in v12 and the cycle does too.

Outcome (NOTES.md v25, v25b): hoisting the token loads made the plain kernel slower
everywhere (B = 1 3.01 -> 3.10, B = 8 9.95 -> 11.04, B = 512 538 -> 565 us: the q/k norms
then run before the branch and the state tile's load waits for them); the slot alone
hoisted (v25b, tree "slot") changed nothing. The empty-cache branch alone (v25b, tree
"split") took the folding kernel to 3.01 us at B = 1 (plain 3.04 in that process) and
4.07 at B = 2 (BV 4), but to 8.5 at B = 5 (7.26) and 2.75 for a bf16 state at B = 1 (2.64).
The tensor-core rebuilds cut the flush (B = 512: 1066 -> 790 us) but slowed the non-flush
step (338 -> 411), so every cycle lost (B = 512 384 -> 434 us, B = 128 105 -> 122).

With CHECKS=1 the GPU checks run first (`decode_bench.check_section`, on the tree's table).

  PYTHONPATH=<tree>:$PWD python benchmarks/experiments/v25_small_batch.py $OUT/v25_<tree>.json

v25b ran it again on `_ab_old`, `_ab_split` (main plus the branch) and "slot" (the branch
plus the slot and cursor loaded beside the mode, token loads left in the branch), with
CHECKS=1 on the last two.
"""

import json, os, sys, time, warnings
SMOKE = bool(os.environ.get("SMOKE"))
import jax.numpy as jnp, numpy as np
warnings.filterwarnings("ignore", message="The Pallas Triton backend is deprecated")
sys.path.insert(0, "benchmarks")
import decode_bench as DB
import pallas_kernels
from pallas_kernels import ops
from pallas_kernels.common import KernelConfig as K

F32, BF16 = jnp.dtype("float32"), jnp.dtype("bfloat16")


def main(out):
    t0 = time.time(); timer = DB.Timer(SMOKE)
    res = dict(meta=DB.versions(), kernels=os.path.dirname(pallas_kernels.__file__), small=[], precision=[])
    print(res["kernels"], flush=True)
    if os.environ.get("CHECKS"):
        res["checks"] = DB.check_section(SMOKE)
        print("checks", json.dumps([(c["gate"], c["layout"], c["precision"], c["dtype"], c["y_rel_err"],
                                     c["state_rel_err"], c["pool_copies"]) for c in res["checks"]]), flush=True)
    gdn = DB.Shape(2, 4, 32) if SMOKE else DB.Shape()
    B = (lambda b: 2) if SMOKE else (lambda b: b)
    fold = lambda bv: K(block_v=bv, num_warps=1, flush_every_step=True)

    def small(dt, b, kernel, kc, rep):
        rng = np.random.default_rng(b)
        if kernel == "plain":
            us = DB.time_plain(timer, gdn.config(1, dt), B(b), kc, rng, 5, SMOKE)
        else:
            us = DB.time_replay(timer, gdn.config(16, dt), B(b), kc, rng, 5, SMOKE, False)[2]
        row = dict(dtype=dt.name, batch=b, kernel=kernel, rep=rep, config=repr(kc), us=us)
        print("small", json.dumps({k: v for k, v in row.items() if k != "config"}), flush=True)
        res["small"].append(row)

    table = lambda b, kernel, dt=F32: ops.default_kernel_config(b, kernel, "gdn", dt)
    cases = [(F32, b, kernel, table(b, kernel)) for b in (1, 2, 4, 5, 8) for kernel in ("plain", "replay")]
    cases += [(F32, 2, "replay", fold(4)), (BF16, 1, "plain", table(1, "plain", BF16)),
              (BF16, 1, "replay", table(1, "replay", BF16)), (BF16, 8, "plain", table(8, "plain", BF16)),
              (BF16, 8, "replay", table(8, "replay", BF16))]
    for rep in range(1 if SMOKE else 2):
        for case in (cases[:2] if SMOKE else cases):
            small(*case, rep)
    small(F32, 512, "plain", table(512, "plain"), 0)
    with open(out, "w") as f: json.dump(res, f, indent=1)

    if os.environ.get("PRECISION"):
        for b in ((8,) if SMOKE else (8, 32, 128, 512)):
            for precision in ("ieee", "tf32", "bf16"):
                kc = table(b, "replay").with_rebuild_precision(precision)
                nf, fl, cyc = DB.time_replay(timer, gdn.config(16, F32), B(b), kc, np.random.default_rng(b), 5, SMOKE, False)
                row = dict(batch=b, precision=precision, config=repr(kc), nonflush_us=nf, flush_us=fl, cycle_us=cyc)
                print("precision", json.dumps({k: v for k, v in row.items() if k != "config"}), flush=True)
                res["precision"].append(row)
                with open(out, "w") as f: json.dump(res, f, indent=1)
    print(f"total {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main(sys.argv[1])
