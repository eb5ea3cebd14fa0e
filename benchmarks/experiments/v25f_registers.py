"""v25f (H200): registers per thread of every launch the table makes, in the GPU build.

`kernel_registers.py` compiles the kernels with Triton's own pipeline on a CPU, whose
counts differ from the GPU build's (v24c: 128 vs 96 for the B > 256 entry); until now
Nsight Compute had read only the B = 512, 8, 6, 2 and 1 entries (v24c, v24d). Here one
jitted step per entry of `ops.table_entries` (plain and replay; GDN fp32, GDN bf16 state,
KDA fp32), each launched once, in one process, so that

  ncu --clock-control none --kernel-name regex:'replayssm|plain_decode' \
      --metrics launch__registers_per_thread python benchmarks/experiments/v25f_registers.py

lists the launches in the order this script prints its entries (GDN H_k = 16, H_v = 32,
KDA H_k = H_v = 32, d = 128). Prediction: the T = 4 entries 96-128, the bf16 and KDA T = 8
entries at or above GDN fp32's 96.

Outcome (`raw/*v25f*`, table in NOTES.md, Occupancy): the T = 4 entries 128 (W = 32) and 96
(W = 64); bf16 T = 4 / 8 at 96 as predicted; KDA's T = 4 / 8 at 168 (3 programs per SM) and
its (32, 2, T = 2, U = 4) entry at 255, the bf16 one at 210; the plain kernel's B >= 17
entry at 154.
"""

import sys, warnings
import jax, jax.numpy as jnp, numpy as np
warnings.filterwarnings("ignore")
sys.path.insert(0, "benchmarks")
import decode_bench as DB
from pallas_kernels import ops
from pallas_kernels.plain_decode import plain_decode
from replayssm_jax import replay as R
from replayssm_jax.decode import step_plan

SMOKE = "--smoke" in sys.argv
F32, BF16 = jnp.dtype("float32"), jnp.dtype("bfloat16")


def one_step(shape, dtype, kernel, batch, cache_len, kc, index):
    cfg = shape.config(cache_len, dtype)
    num_slots = batch + 3
    slots = jnp.asarray(np.random.default_rng(batch).permutation(num_slots)[:batch], jnp.int32)
    pool = DB.random_pool(cfg, num_slots, jax.random.key(1), np.zeros(num_slots))
    token = DB.random_token(cfg, batch, jax.random.key(2))
    if kernel == "plain":
        step = jax.jit(lambda st, tok: plain_decode(st, *tok, slots, slots >= 0, use_qk_l2norm=True,
                                                      config=kc, interpret=SMOKE)[0])
        jax.block_until_ready(step(pool.checkpoint, token))
    else:
        def step(st, tok):
            plan, _ = step_plan(cfg, st.write_pos, slots, None, backend="pallas", kernel_config=kc)
            return ops.pallas_layer_step(st, *tok, plan, use_qk_l2norm=True, scale=None,
                                         kernel_config=kc, interpret=SMOKE)[0]
        jax.block_until_ready(jax.jit(step)(pool, token))
    print(f"launch {index}: {shape.gate} {dtype.name} {kernel} B={batch} L={cache_len} {kc}", flush=True)


def main():
    gdn = DB.Shape(2, 4, 32) if SMOKE else DB.Shape()
    kda = DB.Shape(4, 4, 32, "kda") if SMOKE else DB.Shape(32, 32, 128, "kda")
    index = 0
    for shape, dtype in ((gdn, F32), (gdn, BF16), (kda, F32)):
        for kernel in ("plain", "replay"):
            for batch, cache_len, kc in ops.table_entries(kernel, shape.gate, dtype):
                one_step(shape, dtype, kernel, 2 if SMOKE else batch, cache_len, kc, index)
                index += 1


if __name__ == "__main__":
    main()
