"""B = 8 GDN steps for Nsight Compute: the plain kernel and the folding kernel at the same
tile (BV 16, 1 warp), two launches each, to see why the plain kernel is faster there
(9.9 vs 12.7 us; NOTES, v11).

Tried once with the kernels of commit 3291047 as
`ncu --kernel-name regex:"plain_decode|replayssm_decode_fold" --launch-count 4 --section ...
python benchmarks/experiments/ncu_b8_target.py`; it did not finish inside the 200 s given:
ncu saved and restored the whole device memory around each of its 18 replay passes (the
pools are sized past 3x the L2), and the report is printed only at the end
(raw/h200_2026-11-29_v11_ncu_b8_incomplete.txt). Next time: a pool of 2B slots, or
`--replay-mode application`.
"""
import dataclasses, sys, warnings
import jax, jax.numpy as jnp, numpy as np
warnings.filterwarnings("ignore")
sys.path.insert(0, "benchmarks")
import decode_bench as DB
from pallas_kernels.common import KernelConfig

batch, tile = 8, dict(block_v=16, num_warps=1)
cfg = DB.Shape().config(16, jnp.float32)
sets, n = DB.slot_sets(batch, cfg.state_bytes_per_slot(), np.random.default_rng(0), False)
sets = jnp.asarray(sets[:1])
token = DB.random_token(cfg, batch, jax.random.key(2))
pool = DB.random_pool(cfg, n, jax.random.key(1), np.zeros(n))
plain = DB.plain_steps_fn(KernelConfig(**tile), 1, False)
fold = DB.replay_cycle_fn(dataclasses.replace(cfg, cache_len=2), KernelConfig(**tile, flush_every_step=True), False)
fold_pool = DB.random_pool(dataclasses.replace(cfg, cache_len=2), n, jax.random.key(1), np.zeros(n))
for _ in range(2):
    jax.block_until_ready(plain(pool.checkpoint, sets, token))
jax.block_until_ready(fold(fold_pool, sets, token))  # L = 2: two fold launches, caches empty
print("done")
