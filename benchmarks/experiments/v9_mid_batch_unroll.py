"""v9 experiment (H200): grouped kernel at T = 4 (batch 32-256), sequential vs weighted
rebuild and the rebuild unroll, side by side. Prints rows, writes JSON to argv[1].

Ran on the H200 with the kernels of commit ba797d0:
`PYTHONPATH=$PWD python benchmarks/experiments/v9_mid_batch_unroll.py $OUT/v9.json`
(raw/h200_2026-11-29_v9_unroll.*).
"""

import dataclasses, json, sys, time, warnings
import jax.numpy as jnp, numpy as np
warnings.filterwarnings("ignore", message="The Pallas Triton backend is deprecated")
sys.path.insert(0, "benchmarks"); sys.path.insert(0, "benchmarks/experiments")
import decode_bench as DB
from v8_flush_fallback import WEIGHTED, sequential_rebuild, use_rebuild
from pallas_kernels.ops import default_kernel_config

def main(out):
    t0 = time.time(); timer = DB.Timer(False); shape = DB.Shape(); res = dict(meta=DB.versions(), rows=[])
    print(res["meta"], flush=True)
    for name, fn, unroll in [("sequential", sequential_rebuild, 4), ("weighted", WEIGHTED, 1),
                             ("weighted", WEIGHTED, 2), ("weighted", WEIGHTED, 4)]:
        use_rebuild(fn)
        for batch, L in [(32, 16), (128, 16), (128, 32), (128, 8)]:
            kc = dataclasses.replace(default_kernel_config(batch), rebuild_unroll=unroll)
            nf, fl, cyc = DB.time_replay(timer, shape.config(L, jnp.float32), batch, kc, np.random.default_rng(0), 3, False, staggered=False)
            row = dict(rebuild=name, unroll=unroll, batch=batch, cache_len=L, tiles_per_program=kc.tiles_per_program, nonflush_us=nf, flush_us=fl, cycle_us=cyc)
            print("v9", json.dumps(row), flush=True); res["rows"].append(row)
    use_rebuild(WEIGHTED)
    with open(out, "w") as f: json.dump(res, f, indent=1)
    print(f"total {time.time() - t0:.0f} s")

if __name__ == "__main__":
    main(sys.argv[1])
