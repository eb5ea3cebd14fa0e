"""`backend="auto"`: the backend measured fastest for a step, chosen when the step is traced.

Off GPU a step runs on "xla" (the kernel backends would run in their interpreters). On a
Hopper GPU (compute capability 9.x, the Mosaic kernels' `wgmma` and TMA), a decode step
runs on "mosaic_gpu" from the smallest batch at which its kernels measured faster than the
Pallas-Triton launch table's on the H200 under the same default policy
(`MOSAIC_FROM_BATCH`, per gate and state itemsize; the measurements are lines of
`benchmarks/NOTES.md`), and on "pallas_triton" below it and for the layers with no row (KDA,
whose Triton table folds every step at the plain kernel's speed; 2-byte states); a verify
step runs on "mosaic_gpu" (its one-launch verify kernels: 1.3-2.7x conventional verify,
against 0.9-1.2x for the Triton readouts). Other GPUs run "pallas_triton" (decode) and
"xla" (verify).
"""

from __future__ import annotations

import jax

# (gate, state itemsize) -> the smallest batch for "mosaic_gpu". A row needs the default
# flush policy there to be NATURAL (the Mosaic kernels' flush-every-step path is slower than
# the Triton fold kernel at small batches).
MOSAIC_FROM_BATCH: dict[tuple[str, int], int] = {("gdn", 4): 128, ("mamba2", 4): 128}


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
    start = MOSAIC_FROM_BATCH.get((config.gate, config.state_dtype.itemsize))
    if platform == "hopper" and start is not None and batch >= start:
        return "mosaic_gpu"
    return "pallas_triton"


def verify_backend(config, platform: str | None = None) -> str:
    """The backend `backend="auto"` runs a verify step of `config` on."""
    platform = _platform() if platform is None else platform
    return {"hopper": "mosaic_gpu"}.get(platform, "xla")
