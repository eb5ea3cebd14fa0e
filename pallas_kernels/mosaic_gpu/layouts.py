"""Layout and elementwise helpers shared by the Mosaic GPU kernels (Hopper WGMMA register layouts).

One warpgroup holds a `[M, N]` fp32 tile (M a multiple of 64, N of 8) in `WGMMA`; its row
sums live in `ROW = WGMMA.reduce(1)` `[M]` and its column sums in `COL = WGMMA.reduce(0)`
`[N]`. A row sum stays inside each warp (two shuffle steps); a column sum crosses the four
warps through shared memory, so kernels prefer row sums on their hot path.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.common import SOFTPLUS_THRESHOLD

WGMMA = plgpu.Layout.WGMMA
ROW = WGMMA.reduce(1)
COL = WGMMA.reduce(0)
F32 = jnp.float32
BLOCK_ROWS = 64  # one warpgroup's WGMMA tile height


# Shared memory per CTA on Hopper (the opt-in maximum); Mosaic aligns every buffer to 1 KiB
# and adds its cross-warp reduction scratch (`CompilerParams.reduction_scratch_bytes`).
SMEM_LIMIT = 227 * 1024
_SMEM_ALIGN = 1024
_REDUCTION_SCRATCH = 2048


def records_buffer(cache_len: int, width: int, cache_dtype):
    """A swizzled `[L, width]` buffer of cache records (the transposed readout loads of
    untiled ones conflict on banks)."""
    return plgpu.SMEM((cache_len, width), cache_dtype, transforms=tiled(128, cache_dtype))


def replay_scratch(rows: int, width: int, cache_len: int, state_dtype, cache_dtype, y_shape: tuple, y_dtype,
                   swizzle: int) -> list:
    """The shared buffers of a replay kernel's `[rows, width]` state tile, in kernel order:
    the tile, the u `[L, rows]` and k `[L, width]` records (`records_buffer`), the decays
    `[L]` and the output `y_shape`."""
    return [
        plgpu.SMEM((rows, width), state_dtype, transforms=tiled(swizzle, state_dtype)),
        records_buffer(cache_len, rows, cache_dtype),
        records_buffer(cache_len, width, cache_dtype),
        plgpu.SMEM((cache_len,), F32),
        plgpu.SMEM(y_shape, y_dtype),
    ]


def record_copies(rows: int, width: int, cache_len: int, cache_dtype) -> list:
    """Untiled u `[L, rows]` and k `[L, width]` record buffers for the exact flush rebuild,
    which reads single records at a dynamic index (swizzled buffers cannot serve that)."""
    return [plgpu.SMEM((cache_len, rows), cache_dtype), plgpu.SMEM((cache_len, width), cache_dtype)]


def copy_replay_tile(state_refs, bufs, slot, h, hk, rows, barrier, *, keys=None, gates=None) -> None:
    """Start the TMA copies of one state tile's replay buffers, four arrivals on `barrier`:
    from `state_refs = (checkpoint, value records, key records, gate records)` of `slot`,
    the checkpoint tile `rows` of head h, the value records of those rows, the key records
    of key head (group) hk (or the ref `keys` in their place) and the gate records of head
    h (or the ref `gates` in their place), into `bufs` (`replay_scratch` order)."""
    ckpt_ref, vcache_ref, kcache_ref, gcache_ref = state_refs
    t_smem, v_smem, k_smem, g_smem = bufs
    plgpu.copy_gmem_to_smem(ckpt_ref.at[slot, h, rows], t_smem, barrier)
    plgpu.copy_gmem_to_smem(vcache_ref.at[slot, h, :, rows], v_smem, barrier)
    plgpu.copy_gmem_to_smem(kcache_ref.at[slot, hk] if keys is None else keys, k_smem, barrier)
    plgpu.copy_gmem_to_smem(gcache_ref.at[slot, h] if gates is None else gates, g_smem, barrier)


def copy_record_rows(cache_refs, bufs, slot, h, hk, rows, barrier) -> None:
    """Start the copies of the exact rebuild's untiled records (`record_copies`), two
    arrivals on `barrier`: the value records of `rows` of head h and the key records of
    key head (group) hk, from `cache_refs = (value records, key records)`."""
    vcache_ref, kcache_ref = cache_refs
    v_rows, k_rows = bufs
    plgpu.copy_gmem_to_smem(vcache_ref.at[slot, h, :, rows], v_rows, barrier)
    plgpu.copy_gmem_to_smem(kcache_ref.at[slot, hk], k_rows, barrier)


def smem_bytes(scratch: list) -> int:
    """Shared memory of one CTA for `scratch` (nested lists of `plgpu.SMEM` and barriers):
    each buffer rounded up to 1 KiB, the barriers' 8 bytes each, the reduction scratch."""
    align = lambda n: -(-n // _SMEM_ALIGN) * _SMEM_ALIGN
    total, barriers = _REDUCTION_SCRATCH, 0
    for ref in _flatten(scratch):
        if isinstance(ref, plgpu.Barrier):
            barriers += math.prod(ref.num_barriers)
        else:
            total += align(math.prod(ref.shape) * jnp.dtype(ref.dtype).itemsize)
    return total + align(8 * barriers)


def check_smem(scratch: list, what: str) -> None:
    """Raise ValueError when `scratch` does not fit one CTA's shared memory."""
    used = smem_bytes(scratch)
    if used > SMEM_LIMIT:
        raise ValueError(f"{what} needs {used} bytes of shared memory per CTA (limit {SMEM_LIMIT}): "
                         "use a shorter cache or a narrower state dtype")


def _flatten(items):
    for item in items:
        if isinstance(item, (list, tuple)):
            yield from _flatten(item)
        else:
            yield item


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
