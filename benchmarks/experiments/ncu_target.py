"""One synchronised B=512, L=16 GDN cycle (16 replay kernels) for Nsight Compute.

Ran with the kernels of commit 39291cd (table: T = 8 with U = 4) as
`ncu --kernel-name regex:replayssm --launch-skip 14 --launch-count 2 --section ... python
benchmarks/experiments/ncu_target.py 512` (raw/h200_2026-11-29_v8_ncu_*.txt).
"""
import sys, warnings
import jax, jax.numpy as jnp, numpy as np
warnings.filterwarnings("ignore")
sys.path.insert(0, "benchmarks")
import decode_bench as DB
from pallas_kernels.ops import default_kernel_config
batch = int(sys.argv[1]) if len(sys.argv) > 1 else 512
cfg = DB.Shape().config(16, jnp.float32)
rng = np.random.default_rng(0)
sets, n = DB.slot_sets(batch, cfg.state_bytes_per_slot(), rng, False)
sets = sets[:1]
pool = DB.random_pool(cfg, n, jax.random.key(1), np.zeros(n))
token = DB.random_token(cfg, batch, jax.random.key(2))
fn = DB.replay_cycle_fn(cfg, default_kernel_config(batch), False)
jax.block_until_ready(fn(pool, jnp.asarray(sets), token))
print("done")
