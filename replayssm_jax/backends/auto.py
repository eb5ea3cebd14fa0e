"""`backend="auto"`: the backend measured fastest for a step, chosen when the step is traced.

Off GPU a step runs on "xla" (the kernel backends would run in their interpreters). On a
Hopper GPU (compute capability 9.x, the Mosaic kernels' `wgmma` and TMA), a decode step
runs on "mosaic_gpu" from the smallest batch at which its kernels measured faster than the
Pallas-Triton launch table's on the H200, each under its backend's default policy
(`MOSAIC_FROM_BATCH`, per gate and state itemsize; the measurements are lines of
`benchmarks/NOTES.md`), and on "pallas_triton" below it and for the layers with no row
(2-byte states); a verify step runs on "mosaic_gpu" (its one-launch verify kernels: 1.3-2.7x
conventional verify, against 0.9-1.2x for the Triton readouts). Other GPUs run
"pallas_triton" (decode) and "xla" (verify).
"""

from __future__ import annotations

import jax

# (gate, state itemsize) -> the smallest batch for "mosaic_gpu", each under its backend's
# default policy (`plan.default_flush_policy`). GDN fp32, L = 16: Mosaic 25.6 / 93.2 / 340
# µs at B = 32 / 128 / 512 against Triton 31.3 / 107.4 / 385, but 11.3 against 10.0 at
# B = 8. Mamba-2 fp32 (Nemotron-H-8B, L = 16): Mosaic 4.4 / 18.4 / 166 / 638 µs at B = 1 /
# 8 / 128 / 512 against plain 4.6 / 20.4 / 282 / 1119 (Triton folds at B <= 16 at
# 0.98-1.06x plain; its replay cycle 216 / 836 from B = 17). KDA fp32 (H = 32, d = 128,
# L = 16): Mosaic 114.7 / 418.6 µs at B = 128 / 512 against Triton's fold 149.1 / 588.8 (B < 128
# not measured). GDN bf16 states stay on Triton (Mosaic 0.86x plain at B = 512).
MOSAIC_FROM_BATCH: dict[tuple[str, int], int] = {("gdn", 4): 32, ("kda", 4): 128, ("mamba2", 4): 1}


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
