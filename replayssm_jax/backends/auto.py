"""`backend="auto"`: the backend measured fastest for a step, chosen when the step is traced.

Off GPU a step runs on "xla" (the kernel backends would run in their interpreters). On a
Hopper GPU (compute capability 9.x, the Mosaic kernels' `wgmma` and TMA), a decode step
runs on "mosaic_gpu" from the smallest batch at which its kernels measured faster than the
Pallas-Triton launch table's on the H200, each under its backend's default policy
(`MOSAIC_FROM_BATCH`, per gate and state itemsize; the measurements are lines of
`benchmarks/NOTES.md`), for rings no longer than those measured faster
(`MOSAIC_MAX_CACHE_LEN`), where its persistent kernel fits two or more CTAs per SM; and on
"pallas_triton" below that batch, past that ring, for the layers with no row and where one
CTA per SM is all that fits (Mamba-2 fp32 at L = 32 measured 0.98x plain with one, since
one warpgroup per SM leaves each tile's latency exposed, and 1.51x with two). A verify step
runs on "mosaic_gpu" (its one-launch verify kernels: 1.3-2.7x conventional verify, against
0.9-1.2x for the Triton readouts). Other GPUs run "pallas_triton" (decode) and "xla"
(verify).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# (gate, state itemsize) -> the smallest batch for "mosaic_gpu", each under its backend's
# default policy (`plan.default_flush_policy`). GDN fp32, L = 16: Mosaic 25.6 / 93.2 / 340
# µs at B = 32 / 128 / 512 against Triton 31.3 / 107.4 / 385, but 11.3 against 10.0 at
# B = 8. Mamba-2 fp32 (Nemotron-H-8B, L = 16): Mosaic 4.4 / 18.4 / 166 / 638 µs at B = 1 /
# 8 / 128 / 512 against plain 4.6 / 20.4 / 282 / 1119 (Triton folds at B <= 16 at
# 0.98-1.06x plain; its replay cycle 216 / 836 from B = 17); L = 8, B = 128: 164.9 against
# Triton 205.6. Mamba-2 bf16 (L = 16): Mosaic 150.5 µs at B = 128 (1.02x plain; Triton's
# fold 0.92-0.94x), 394.2 at B = 512 (1.53x; Triton 808; B < 128 not measured). KDA fp32 (H = 32,
# d = 128, L = 16): Mosaic 114.7 / 418.6 µs at B = 128 / 512 against Triton's fold 149.1 /
# 588.8 (B < 128 not measured). fp32 rings of 32 (two CTAs per SM): GDN 104.3 / 387.3 µs at
# B = 128 / 512 against Triton 119.6 / 409.6; Mamba-2 B = 128 187.1 against 248.2. GDN bf16
# (key side from XLA; two CTAs per SM, as its registers allow): L = 16 7.1 / 13.6 / 17.6 /
# 32.1 / 59.6 / 221.0 µs at B = 8 / 16 / 32 / 64 / 128 / 512 against Triton 8.1 / 14.8 /
# 25.3 / 46.2 / 78.5 / 273.7 (B = 512 with per-tile addresses: 206.7), L = 32 266.3
# against 382.2 at B = 512; up to B = 8 Triton folds every step
# (`plan.default_flush_policy`) at the plain kernel's 6.3 µs (B = 8).
MOSAIC_FROM_BATCH: dict[tuple[str, int], int] = {("gdn", 4): 32, ("gdn", 2): 9, ("kda", 4): 128,
                                                 ("mamba2", 4): 1, ("mamba2", 2): 128}
# (gate, state itemsize) -> the longest ring for "mosaic_gpu". Mamba-2 bf16 (Nemotron-H-8B,
# B = 512): 355.4 / 394.2 / 727.1 µs at L = 8 / 16 / 32 against plain 605 (1.70x / 1.53x /
# 0.83x): a 2-byte tile's work grows with the ring, its bytes barely (Triton folds instead).
MOSAIC_MAX_CACHE_LEN: dict[tuple[str, int], int] = {("mamba2", 2): 16}
# The fewest persistent CTAs per SM at which "auto" takes "mosaic_gpu" (every row above ran two or three).
MOSAIC_MIN_CTAS_PER_SM = 2


def _platform() -> str:
    """"hopper", "gpu" (another GPU) or "cpu" (anything else: interpret mode)."""
    if jax.default_backend() != "gpu":
        return "cpu"
    capability = getattr(jax.devices()[0], "compute_capability", "")
    return "hopper" if str(capability).startswith("9") else "gpu"


def decode_backend(config, batch: int, platform: str | None = None) -> str:
    """The backend `backend="auto"` runs a decode step of `batch` rows of `config` on;
    `platform` ("hopper", "gpu" or "cpu") defaults to the first device's."""
    platform = _platform() if platform is None else platform
    if platform == "cpu":
        return "xla"
    key = (config.gate, config.state_dtype.itemsize)
    start = MOSAIC_FROM_BATCH.get(key)
    measured = platform == "hopper" and start is not None and batch >= start
    measured = measured and config.cache_len <= MOSAIC_MAX_CACHE_LEN.get(key, config.cache_len)
    if measured and mosaic_ctas_per_sm(config) >= MOSAIC_MIN_CTAS_PER_SM:
        return "mosaic_gpu"
    return "pallas_triton"


def mosaic_ctas_per_sm(config) -> int:
    """Persistent CTAs of the layer's Mosaic decode kernel resident per SM on a GPU (as its
    shared memory and registers allow; bf16 tokens, the backend's GPU rebuild)."""
    # Imported here: `backends.mosaic_gpu` imports `plan`, which imports this module.
    from replayssm_jax.backends import mosaic_gpu

    rebuild = mosaic_gpu.gpu_rebuild(config, jnp.bfloat16)
    return mosaic_gpu.fitting_programs(config, 512, jnp.bfloat16, rebuild=rebuild, sm_count=1)


def verify_backend(config, platform: str | None = None) -> str:
    """The backend `backend="auto"` runs a verify step of `config` on."""
    platform = _platform() if platform is None else platform
    return {"hopper": "mosaic_gpu"}.get(platform, "xla")
