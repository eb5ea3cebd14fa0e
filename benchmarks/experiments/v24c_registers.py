"""One synchronised L = 16 GDN cycle of the table's replay entry for a batch, with the
rebuild unroll given, for Nsight Compute's launch metrics (registers per thread, the
occupancy limit they set): `python benchmarks/experiments/v24c_registers.py 512 1`
(`table` for the entry's own unroll; an optional third argument names the state dtype)."""
import dataclasses, sys, warnings
import jax, jax.numpy as jnp, numpy as np
warnings.filterwarnings("ignore")
sys.path.insert(0, "benchmarks")
import decode_bench as DB
from pallas_kernels.ops import default_kernel_config
batch = int(sys.argv[1])
dtype = jnp.dtype(sys.argv[3]) if len(sys.argv) > 3 else jnp.dtype("float32")
cfg = DB.Shape().config(16, dtype)
kc = default_kernel_config(batch, state_dtype=dtype)
if sys.argv[2] != "table":
    kc = dataclasses.replace(kc, rebuild_unroll=int(sys.argv[2]))
sets, n = DB.slot_sets(batch, cfg.state_bytes_per_slot(), np.random.default_rng(0), False)
pool = DB.random_pool(cfg, n, jax.random.key(1), np.zeros(n))
token = DB.random_token(cfg, batch, jax.random.key(2))
jax.block_until_ready(DB.replay_cycle_fn(cfg, kc, False)(pool, jnp.asarray(sets[:1]), token))
print("done", batch, kc)
