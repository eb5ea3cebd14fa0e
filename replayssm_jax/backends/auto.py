"""`backend="auto"`: the backend measured fastest for a step, chosen when the step is traced.

Off GPU a step runs on "xla" (the kernel backends would run in their interpreters). On a
Hopper GPU (compute capability 9.x, the Mosaic kernels' `wgmma` and TMA), a decode step
runs on "mosaic_gpu" from the smallest batch at which its kernels measured faster than the
Pallas-Triton launch table's on the H200, each under its backend's default policy
(`MOSAIC_FROM_BATCH`, per gate and state itemsize; the measurements are lines of
`benchmarks/NOTES.md`), for rings no longer than those measured faster
(`MOSAIC_MAX_CACHE_LEN`, or a device kind's own: `MOSAIC_MAX_CACHE_LEN_BY_KIND`), where
its persistent kernel fits two or more CTAs per SM; and on
"pallas_triton" below that batch, past that ring, for the layers with no row and where one
CTA per SM is all that fits (one warpgroup per SM leaves each tile's latency exposed: no
faster than plain). A verify step runs on "mosaic_gpu" (its one-launch verify kernels
measured faster than the Triton readouts at every shape timed). Other GPUs run
"pallas_triton" (decode) and "xla" (verify).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# (gate, state itemsize) -> the smallest batch for "mosaic_gpu", each under its backend's
# default policy (`plan.default_flush_policy`): below it the Triton kernels (folding every
# step at the smallest batches) measured faster; for KDA and Mamba-2 bf16 the smaller
# batches are not measured (NOTES: "backend "auto", policy per backend", "mamba2 coverage",
# "rings of 32 on two CTAs per SM"). GDN bf16: from B = 32, where the Mosaic kernel's lead
# over Triton's cycle exceeds what the XLA pass before it can cost (below, its timing left
# that pass out: NOTES "step timing with XLA's side inputs").
MOSAIC_FROM_BATCH: dict[tuple[str, int], int] = {("gdn", 4): 32, ("gdn", 2): 32, ("kda", 4): 128,
                                                 ("mamba2", 4): 1, ("mamba2", 2): 128}
# (gate, state itemsize) -> the longest ring for "mosaic_gpu": a 2-byte Mamba-2 tile's work
# grows with the ring while its bytes barely do, slower than plain at L = 32 (NOTES: "coverage
# (2026-12-04, sixth session)"; Triton folds instead).
MOSAIC_MAX_CACHE_LEN: dict[tuple[str, int], int] = {("mamba2", 2): 16}
# Device kinds whose own measurements replace those bounds: on an H100, where it runs two CTAs
# per SM (`mosaic_gpu.MAMBA2_CTAS_PER_SM`), the 2-byte Mamba-2 kernel ran rings of 32 faster
# than plain and Triton (B = 128, 512; NOTES: "Mamba-2 bf16 decode, two CTAs per SM on the
# H100").
MOSAIC_MAX_CACHE_LEN_BY_KIND: dict[str, dict[tuple[str, int], int]] = {"H100": {("mamba2", 2): 32}}
# The fewest persistent CTAs per SM at which "auto" takes "mosaic_gpu" (every row above ran two or three).
MOSAIC_MIN_CTAS_PER_SM = 2


def _platform() -> str:
    """"hopper", "gpu" (another GPU) or "cpu" (anything else: interpret mode)."""
    if jax.default_backend() != "gpu":
        return "cpu"
    capability = getattr(jax.devices()[0], "compute_capability", "")
    return "hopper" if str(capability).startswith("9") else "gpu"


def decode_backend(config, batch: int, platform: str | None = None, kind: str | None = None) -> str:
    """The backend `backend="auto"` runs a decode step of `batch` rows of `config` on;
    `platform` ("hopper", "gpu" or "cpu") and `kind` (`device_kind`, e.g. "NVIDIA H100 80GB
    HBM3") default to the first device's."""
    platform = _platform() if platform is None else platform
    if platform == "cpu":
        return "xla"
    key = (config.gate, config.state_dtype.itemsize)
    start = MOSAIC_FROM_BATCH.get(key)
    measured = platform == "hopper" and start is not None and batch >= start
    measured = measured and config.cache_len <= max_cache_len(kind).get(key, config.cache_len)
    if measured and mosaic_ctas_per_sm(config) >= MOSAIC_MIN_CTAS_PER_SM:
        return "mosaic_gpu"
    return "pallas_triton"


def max_cache_len(kind: str | None = None) -> dict[tuple[str, int], int]:
    """The ring bounds `decode_backend` applies on a device of `kind` (default: this one's):
    `MOSAIC_MAX_CACHE_LEN` with the kind's own entries (`MOSAIC_MAX_CACHE_LEN_BY_KIND`) over it."""
    from replayssm_jax.backends import mosaic_gpu  # as in `mosaic_ctas_per_sm`

    return {**MOSAIC_MAX_CACHE_LEN, **mosaic_gpu.for_device_kind(MOSAIC_MAX_CACHE_LEN_BY_KIND, {}, kind)}


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
