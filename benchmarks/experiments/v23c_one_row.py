"""v23c (H200): batch 1 and 2 after v23, with the v23 kernels.

1. bf16 state: v23's table gives the plain kernel the fp32 entry on whole rows at B <= 2
   (BV 4: 2.59 us at B = 1, was 3.17 at BV 8) while the folding kernel stays at BV 8 (3.01),
   so ReplaySSM is 0.86x there. The folding kernel at BV 4, as for fp32 at B = 1 (3.17 vs
   3.30 at BV 8): sweep rows at L = 4 / 8 / 16 / 32 with it, and BV 4 / 8 side by side at
   B = 2. Prediction: ~2.8 us at B = 1 (0.92x), no better than BV 8 at B = 2 (fp32: 4.38 vs
   4.29).
2. fp32 B = 1: is the folding kernel's 5% (3.17 vs 3.01 us) the plain kernel's `[4, 32]`
   chunks? The plain kernel at BV 4 on whole rows beside both kernels' chunked and
   whole-row tiles. Prediction: plain BV 4 whole rows ~3.1-3.2 us, i.e. the chunks are
   most of the gap.

  PYTHONPATH=$PWD python benchmarks/experiments/v23c_one_row.py $OUT/v23c.json
"""

import json, os, sys, time, warnings
SMOKE = bool(os.environ.get("SMOKE"))
import jax, jax.numpy as jnp, numpy as np
warnings.filterwarnings("ignore", message="The Pallas Triton backend is deprecated")
sys.path.insert(0, "benchmarks")
import decode_bench as DB
from pallas_kernels.common import KernelConfig as K

F32, BF16 = jnp.dtype("float32"), jnp.dtype("bfloat16")


def main(out):
    t0 = time.time(); timer = DB.Timer(SMOKE); res = dict(meta=DB.versions(), rows=[], small=[])
    bw = res["meta"]["copy_bandwidth_GBps"] = 1000.0 if SMOKE else DB.copy_bandwidth_GBps(timer)
    gdn = DB.Shape(2, 4, 32) if SMOKE else DB.Shape()
    fold = lambda bv, c=0: K(block_v=bv, num_warps=1, flush_every_step=True, column_chunk=c)
    plain_bf16 = DB.choose_configs({}, 1, "gdn", BF16)[0]
    for L in ((4,) if SMOKE else (4, 8, 16, 32)):
        for row in DB.sweep_row(timer, gdn, gdn.config(L, BF16), 1, bw, SMOKE, (plain_bf16, fold(4))):
            row["source"] = "v23c"
            print("row", json.dumps({k: row[k] for k in ("state_dtype", "cache_len", "batch", "cursors", "plain_us",
                                                        "replay_cycle_us", "speedup_vs_plain")}), flush=True)
            res["rows"].append(row)

    def small(dt, b, kernel, kc):
        if kernel == "plain":
            us = DB.time_plain(timer, gdn.config(1, dt), b, kc, np.random.default_rng(b), 5, SMOKE)
        else:
            us = DB.time_replay(timer, gdn.config(16, dt), b, kc, np.random.default_rng(b), 5, SMOKE, False)[2]
        row = dict(dtype=dt.name, batch=b, kernel=kernel, config=repr(kc), us=us)
        print("small", json.dumps(row), flush=True); res["small"].append(row)

    small(BF16, 2, "plain", DB.choose_configs({}, 2, "gdn", BF16)[0])
    for bv in (4, 8):
        small(BF16, 2, "fold", fold(bv))
    for kernel, kc in (("plain", K(block_v=4, num_warps=1)), ("plain", K(block_v=4, num_warps=1, column_chunk=32)),
                       ("fold", fold(4)), ("fold", fold(4, 32))):
        small(F32, 1, kernel, kc)
    with open(out, "w") as f: json.dump(res, f, indent=1)
    print(f"total {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main(sys.argv[1])
