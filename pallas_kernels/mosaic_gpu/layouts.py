"""Layout and elementwise helpers shared by the Mosaic GPU kernels (Hopper WGMMA register layouts).

One warpgroup holds a `[M, N]` fp32 tile (M a multiple of 64, N of 8) in `WGMMA`; its row
sums live in `ROW = WGMMA.reduce(1)` `[M]` and its column sums in `COL = WGMMA.reduce(0)`
`[N]`. A row sum stays inside each warp (two shuffle steps); a column sum crosses the four
warps through shared memory, so kernels prefer row sums on their hot path.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.common import SOFTPLUS_THRESHOLD

WGMMA = plgpu.Layout.WGMMA
ROW = WGMMA.reduce(1)
COL = WGMMA.reduce(0)
F32 = jnp.float32
BLOCK_ROWS = 64  # one warpgroup's WGMMA tile height


def tiled(swizzle: int, dtype) -> tuple:
    """Shared-memory transforms of a TMA tile swizzled by `swizzle` bytes."""
    return (plgpu.TilingTransform((8, swizzle // jnp.dtype(dtype).itemsize)), plgpu.SwizzleTransform(swizzle))


def bcast_rows(x, shape):
    """A `ROW` vector `[M]` repeated along the columns of `[M, N]` (`WGMMA`)."""
    return plgpu.layout_cast(lax.broadcast_in_dim(plgpu.layout_cast(x, ROW), shape, [0]), WGMMA)


def bcast_cols(x, shape):
    """A `COL` vector `[N]` repeated along the rows of `[M, N]` (`WGMMA`)."""
    return plgpu.layout_cast(lax.broadcast_in_dim(plgpu.layout_cast(x, COL), shape, [1]), WGMMA)


def row_sum(x):
    """`[M, N]` (`WGMMA`) summed over N: `ROW [M]`."""
    return plgpu.layout_cast(jnp.sum(x, axis=1), ROW)


def col_sum(x):
    """`[M, N]` (`WGMMA`) summed over M: `COL [N]`."""
    return plgpu.layout_cast(jnp.sum(x, axis=0), COL)


def load_transposed(smem):
    """A `[R, C]` shared-memory buffer as a `[C, R]` `WGMMA`-layout array in fp32 (the
    buffer should be swizzled: untiled transposed loads conflict on shared-memory banks)."""
    x = plgpu.load(smem.T, layout=plgpu.Layout.WGMMA_TRANSPOSED, optimized=False)
    return plgpu.layout_cast(x, WGMMA).astype(F32)


def softplus(x):
    """`log(1 + e^x)`, linear above the threshold (as the Triton kernels' softplus)."""
    return jnp.where(x > SOFTPLUS_THRESHOLD, x, jnp.log(1.0 + jnp.exp(jnp.minimum(x, SOFTPLUS_THRESHOLD))))
