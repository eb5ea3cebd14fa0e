"""v18 (H200): the GPU check of the package with column chunks and row-outermost grids
(decode_bench's check section), then the table entries v14-v16 did not measure: the plain
and folding kernels at B = 1, 2, 4 with W in {0, 16, 32}; the grouped kernel's B = 8 and
B = 32 entries with W = 0 / 32; KDA's plain kernel at B = 128 / 512 with whole rows vs
W = 16 and rows outermost. Predictions: the folding kernel gains like the plain kernel at
B = 1 (3.81 -> 3.17 us with W = 32, v14), neither at B = 4; the grouped kernel's B = 32
entry gains like B = 128 (-8%); KDA's plain kernel like GDN's (-8% at B = 512).

  PYTHONPATH=$PWD python benchmarks/experiments/v18_chunk_table.py $OUT/v18.json
`SMOKE=1` runs it on a CPU in interpret mode.
"""

import dataclasses, json, os, sys, time, warnings
SMOKE = bool(os.environ.get("SMOKE"))
import jax, jax.numpy as jnp, numpy as np
warnings.filterwarnings("ignore", message="The Pallas Triton backend is deprecated")
sys.path.insert(0, "benchmarks")
import decode_bench as DB
from pallas_kernels.common import KernelConfig
from pallas_kernels.ops import default_kernel_config

W = dataclasses.replace


def main(out):
    t0 = time.time(); timer = DB.Timer(SMOKE); res = dict(meta=DB.versions(), rows=[])
    res["meta"]["copy_bandwidth_GBps"] = 0.0 if SMOKE else DB.copy_bandwidth_GBps(timer)
    print(res["meta"], flush=True)
    res["checks"] = DB.check_section(SMOKE)
    print(f"checks done {time.time() - t0:.0f} s", flush=True)
    gdn = DB.Shape(2, 4, 32) if SMOKE else DB.Shape()
    kda = DB.Shape(4, 4, 32, "kda") if SMOKE else DB.Shape(32, 32, 128, "kda")
    fold = KernelConfig(block_v=8, num_warps=1, flush_every_step=True)
    plain8 = KernelConfig(block_v=8, num_warps=1, cache_chunk=8)
    widths = (0, 16) if SMOKE else (0, 16, 32)
    cases = []  # (name, shape, batch, kind, config)
    for b in ((2,) if SMOKE else (1, 2, 4)):
        cases += [(f"plain_w{w}", gdn, b, "plain", W(plain8, column_chunk=w)) for w in widths]
        cases += [(f"fold_w{w}", gdn, b, "replay", W(fold, column_chunk=w)) for w in widths]
    for b in ((4,) if SMOKE else (8, 32)):
        base = default_kernel_config(b)
        cases += [(f"grouped_w{w}", gdn, b, "replay", W(base, column_chunk=w)) for w in (0, 32)]
    for b in ((4,) if SMOKE else (128, 512)):
        cases += [("kda_plain_w0", kda, b, "plain", KernelConfig(block_v=16, num_warps=1)),
                  ("kda_plain_w16_outer", kda, b, "plain", default_kernel_config(b, "plain", "kda"))]
    for name, shape, b, kind, kc in cases:
        if time.time() - t0 > 500: print("time guard", flush=True); break
        rng = np.random.default_rng(b)
        if kind == "plain":
            us = DB.time_plain(timer, shape.config(1, jnp.dtype("float32")), b, kc, rng, 5, SMOKE)
            row = dict(name=name, gate=shape.gate, batch=b, us=us)
        else:
            nf, fl, cyc = DB.time_replay(timer, shape.config(16, jnp.dtype("float32")), b, kc, rng, 3, SMOKE, False)
            row = dict(name=name, gate=shape.gate, batch=b, nonflush=nf, flush=fl, us=cyc)
        row["config"] = dataclasses.asdict(kc)
        print("row", json.dumps(row), flush=True); res["rows"].append(row)
        with open(out, "w") as f: json.dump(res, f, indent=1)
    with open(out, "w") as f: json.dump(res, f, indent=1)
    print(f"total {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main(sys.argv[1])
