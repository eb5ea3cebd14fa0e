"""Backends of the decode step: each adapts a `ReplayState` and a `StepPlan` to its way of
computing one layer's step, with the same arguments and results.

  xla            `backends.xla`: plain jax.numpy / lax, the readable specification.
  pallas_triton  `backends.pallas_triton`: the Pallas (Triton lowering) kernels of
                 `pallas_kernels`, with the launch table.
  mosaic_gpu     `backends.mosaic_gpu`: the Mosaic GPU kernels of `pallas_kernels.mosaic_gpu`
                 (GDN, KDA and Mamba-2; TMA tiles, WGMMA-layout readout, in-place flush).
  auto           `backends.auto`: one of the above per step, the one measured fastest for
                 the layer, its batch and the device (xla off GPU).
"""

BACKENDS: tuple[str, ...] = ("xla", "pallas_triton", "mosaic_gpu", "auto")
