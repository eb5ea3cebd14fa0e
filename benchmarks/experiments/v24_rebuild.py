"""v24 (H200): the exact rebuild's loop made lean, side by side with the v23 kernels.

The flush step is issue-bound (v8 profile: 5.5 cycles per issued instruction at 16 warps per
SM, FMA pipe 47%), and in the SASS of the B = 512 entry (BV 32, 4 warps, T = 8, U = 2,
W = 64; `triton` 3.6 + ptxas for sm_90a on a CPU) the rebuild loop spent 183 instructions
per two entries on 64 useful FMAs. v24 takes out
  * the masks and clamped rows of its loads (GDN: the newest pos % U entries one by one,
    then unmasked blocks): -12 instructions per block;
  * libdevice's expf (~9 instructions): `exp2(x log2 e)` lowers to `ex2` (~2): -14;
  * the decay alpha, folded into the rebuild's starting scale and weight: -32 multiplies
    per tile (the flushed tile is `S~ + u k^T` with one FMA per element).
Loop 183 -> 157 instructions per block, ~2150 -> ~1910 per flushed tile (-11%). KDA keeps
one masked loop (two loops: 166 -> 233 registers); its per-channel exps (8 per entry and
thread) get the cheaper `ex2` in the rebuild and in the readout's weights.

Predictions (H200, L = 16, synchronised cursors):
  * GDN fp32 B = 512: flush 1149 -> ~1040 us (-9%), non-flush within 1%, cycle 390 -> ~383
    (1.38x -> ~1.40x); B = 128-256 the same proportions; B = 8-16 (T = 1 `[64, d_k]`
    tiles, loop 2 x 64 FMAs per block) flush -5 to -10%.
  * KDA: flush -15 to -25% (per-channel exp in the loop), non-flush -3 to -8% (readout
    exps over `[L, d_k]` weights).
  * plain kernel and the folding kernel at B = 1: within 1% (one scalar exp each).
  * bf16 state B = 9-16 entry: 168 -> 200 registers (6 -> 5 programs per SM), so its
    non-flush step may lose up to 5%.

The script times one list of cases with whatever `pallas_kernels` is first on PYTHONPATH;
the device run points it at an export of v23's `pallas_kernels` and at v24's, back to
back, and runs the GPU checks (`decode_bench.check_section`) on v24 first:

  PYTHONPATH=_ab_old:$PWD python benchmarks/experiments/v24_rebuild.py $OUT/old.json
  CHECKS=1 PYTHONPATH=$PWD python benchmarks/experiments/v24_rebuild.py $OUT/new.json

`SHORT=1` times seven of the cases (v24b: B = 8, 128, 512, the plain kernel at B = 512,
KDA, the bf16 state at B = 512) for four trees: v23 (`_ab_old`), v24 with `jnp.exp` for
every exp (v1), v24 with `exp2` in the rebuild loop only (v2) and v24 as above ("new").
`SMOKE=1` runs it on a CPU in interpret mode.

Outcome (NOTES.md v24, v24b): flush -16% but non-flush +9% at B = 512; the GPU build's
registers went 96 -> 128 (v24c). Not kept: the v2 tree, with the U = 1 loop of v24c, is
the local branch `exp-v24-rebuild`; main keeps v23's kernels.
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
    res = dict(meta=DB.versions(), kernels=os.path.dirname(pallas_kernels.__file__), rows=[])
    print(res["kernels"], flush=True)
    if os.environ.get("CHECKS"):
        res["checks"] = DB.check_section(SMOKE)
        print("checks", json.dumps(res["checks"]), flush=True)
    gdn = DB.Shape(2, 4, 32) if SMOKE else DB.Shape()
    kda = DB.Shape(4, 4, 32, "kda") if SMOKE else DB.Shape(32, 32, 128, "kda")
    B = (lambda b: 2) if SMOKE else (lambda b: b)
    table = lambda b, kernel="replay", gate="gdn", dt=F32: ops.default_kernel_config(b, kernel, gate, dt)
    g = lambda t, u: K(block_v=32, num_warps=4, tiles_per_program=t, rebuild_unroll=u, column_chunk=64)
    # (shape, state dtype, batch, kernel, config)
    cases = [(gdn, F32, 1, "plain", table(1, "plain")), (gdn, F32, 1, "replay", table(1)),
             *((gdn, F32, b, "replay", table(b)) for b in (8, 16, 32, 128, 512)),
             (gdn, F32, 512, "replay", g(4, 2)), (gdn, F32, 512, "replay", g(8, 4)),
             (gdn, F32, 512, "plain", table(512, "plain")),
             (kda, F32, 128, "replay", table(128, gate="kda")), (kda, F32, 512, "replay", table(512, gate="kda")),
             (kda, F32, 512, "plain", table(512, "plain", "kda")),
             (gdn, BF16, 16, "replay", table(16, dt=BF16)), (gdn, BF16, 512, "replay", table(512, dt=BF16)),
             (gdn, F32, 128, "replay", table(128)), (gdn, F32, 512, "replay", table(512))]  # repeats: noise
    if os.environ.get("SHORT"):  # v24b: which change costs the non-flush step
        cases = [cases[i] for i in (2, 5, 6, 9, 11, 12, 14)]
    for shape, dt, b, kernel, kc in (cases[:2] + cases[-3:-2] if SMOKE else cases):
        row = dict(gate=shape.gate, dtype=dt.name, batch=b, kernel=kernel, config=repr(kc))
        if kernel == "plain":
            row["us"] = DB.time_plain(timer, shape.config(1, dt), B(b), kc, np.random.default_rng(b), 5, SMOKE)
        else:
            rng = np.random.default_rng(b * 1000 + 16)
            nf, fl, cyc = DB.time_replay(timer, shape.config(16, dt), B(b), kc, rng, 5, SMOKE, False)
            row.update(nonflush_us=nf, flush_us=fl, cycle_us=cyc)
        print("row", json.dumps({k: v for k, v in row.items() if k != "config"}), flush=True)
        res["rows"].append(row)
        with open(out, "w") as f: json.dump(res, f, indent=1)  # after each row: a timeout keeps the rest
    print(f"total {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main(sys.argv[1])
