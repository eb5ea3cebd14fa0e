"""v28f (H200): what the held row index (`KernelConfig.launch_order`) does to the GPU build.

v28 / v28b timed the launch order's cost without reading the kernels: the held row cost the
(32, 4, T = 4, W = 32) entry's flush 80% at B = 32, the T = 4 non-flush step 7-18%, the bf16
H_v = 64 T = 8 entry 16%, and nothing at GDN fp32 T = 8. Here each grouped table entry
(GDN fp32 and bf16 state at H_v = 32, bf16 at H_v = 64 for B > 256) runs one flush step
(every row's cursor at L - 1, so the flush path executes) with and without the order, in
one process, under

  ncu --clock-control none --kernel-name regex:replayssm --metrics \\
      launch__registers_per_thread,smsp__sass_inst_executed_op_local_ld.sum,smsp__sass_inst_executed_op_local_st.sum \\
      python benchmarks/experiments/v28f_registers.py

Prediction: the entries the order slowed hold more registers with it (a step down in
programs per SM: W = 32 T = 4 128 -> 136+, bf16 H_v = 64 T = 8 96 -> 104+), or spill in the
flush (local loads and stores > 0); GDN fp32 T = 8 unchanged at 96.

Outcome (`raw/*v28f*`; no local loads or stores anywhere), registers without / with the
order: GDN fp32 T = 4 W = 32 128 / 128, T = 4 W = 64 96 / 96, T = 8 96 / 96; bf16 (32, 2,
T = 2) 210 / 210, T = 4 96 / 121, T = 8 96 / 96 at H_v = 32 and 96 / 128 at H_v = 64. So the
bf16 losses are occupancy (5 -> 4 programs per SM), as predicted; the fp32 ones are not:
the W = 32 flush ran 80% longer and the W = 64 non-flush step 7% longer at the same
registers and without spills, so the held row changed the schedule, not the allocation.
"""

import dataclasses, sys, warnings
import jax, jax.numpy as jnp, numpy as np
warnings.filterwarnings("ignore")
sys.path.insert(0, "benchmarks")
import decode_bench as DB
from pallas_kernels import ops
from replayssm_jax.decode import step_plan

SMOKE = "--smoke" in sys.argv
F32, BF16 = jnp.dtype("float32"), jnp.dtype("bfloat16")


def flush_step(shape, dtype, batch, kc, index):
    cfg = shape.config(16, dtype)
    num_slots = batch + 3
    slots = jnp.asarray(np.random.default_rng(batch).permutation(num_slots)[:batch], jnp.int32)
    pool = DB.random_pool(cfg, num_slots, jax.random.key(1), np.full(num_slots, cfg.cache_len - 1))
    token = DB.random_token(cfg, batch, jax.random.key(2))

    def step(st, tok):
        plan, _ = step_plan(cfg, st.write_pos, slots, None, backend="pallas", kernel_config=kc)
        return ops.pallas_layer_step(st, *tok, plan, use_qk_l2norm=True, scale=None,
                                     kernel_config=kc, interpret=SMOKE)[0]

    jax.block_until_ready(jax.jit(step)(pool, token))
    print(f"launch {index}: H_v={shape.num_v_heads} {dtype.name} B={batch} {kc}", flush=True)


def main():
    small = DB.Shape(2, 4, 32)
    cases = [(DB.Shape(), F32, b) for b in (17, 65, 257)] + [(DB.Shape(), BF16, b) for b in (9, 17, 65, 257)]
    cases += [(DB.Shape(16, 64, 128), BF16, 257)]
    index = 0
    for shape, dtype, batch in cases:
        entry = ops.default_kernel_config(batch, "replay", "gdn", dtype)
        for order in (False, True):
            kc = dataclasses.replace(entry, launch_order=order)
            flush_step(small if SMOKE else shape, dtype, 2 if SMOKE else batch, kc, index)
            index += 1


if __name__ == "__main__":
    main()
