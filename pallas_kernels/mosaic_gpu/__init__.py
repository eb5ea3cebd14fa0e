"""Decode kernels on Pallas Mosaic GPU (`plgpu.kernel`): TMA tiles and WGMMA-layout reductions."""
