"""Tensor-core flush rebuilds shared by the Mosaic decode kernels (GDN, Mamba-2).

A flush row rebuilds the live state `S_{t-1} = D S_c + A B^T` from the checkpoint tile
`S_c [M, W]` already in registers (D a scalar decay), where `A [M, L]` is the tile's value
records weighted per entry (GDN `U^T diag(W)`, Mamba-2 `X^T diag(w)`) and `B^T [W, L]` the
key-side records (GDN `K^T`, Mamba-2 `B^T`). `rebuild_mma` forms `A B^T` as `wgmma`s over
K-major shared-memory operands, accumulating in fp32 from `D S_c`:

- "tf32" / "bf16": one `wgmma` with both operands rounded to that type;
- "3xtf32": three tf32 `wgmma`s over each operand's high and low tf32 parts
  (`tf32_split`: `lo hi + hi lo + hi hi`, about 2^-21 relative per product); where the
  key-side records are 2-byte floats (`keys_exact`: exact in tf32, their low part 0) two
  (`lo hi + hi hi`, the same sums) and no buffer for that low part.

The operands live in a `plgpu.RefUnion` with the stage's checkpoint-tile buffer
(`tile_with_operands`), which is free once `S_c` is in registers; the ring is reduced
over in chunks of `operand_entries` entries through one chunk's operands, as many as fit
the tile's bytes (up to `OPERAND_ENTRIES`), so the union is no larger than the tile: a ring
of 32 keeps two fp32 CTAs per SM, and a 2-byte tile takes "3xtf32" chunks of 8.
"exact" (CUDA-core FMAs) is each kernel's own.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.mosaic_gpu.layouts import WGMMA, tiled

# The tensor-core rebuild's operand type per mode (fp32 operands are tf32 in `wgmma`);
# "3xtf32" splits each fp32 operand into two tf32 parts (`tf32_split`).
REBUILD_DTYPES = {"exact": None, "tf32": jnp.float32, "bf16": jnp.bfloat16, "3xtf32": jnp.float32}
# The most ring entries per operand chunk: "3xtf32" operands of a [64, 16] and a [128, 16]
# chunk (hi and lo) take 24 KiB, within a [64, 128] fp32 tile's 32 KiB.
OPERAND_ENTRIES = 16


def check_rebuild_mode(rebuild: str) -> None:
    """Raise ValueError unless `rebuild` names a mode of `REBUILD_DTYPES`."""
    if rebuild not in REBUILD_DTYPES:
        raise ValueError(f"rebuild must be one of {tuple(REBUILD_DTYPES)}, got {rebuild!r}")


def check_rebuild(rebuild: str, cache_len: int, interpret: bool = False) -> None:
    """Raise ValueError unless the tensor-core rebuild can take a ring of `cache_len`
    (`wgmma` reduces over whole 32-byte rows of the operands: 8 fp32 or 16 bf16 entries)
    and can run (interpret mode does not run `wgmma`)."""
    dtype = REBUILD_DTYPES[rebuild]
    if dtype is None:
        return
    if (cache_len * jnp.dtype(dtype).itemsize) % 32:
        raise ValueError(f"rebuild={rebuild!r} needs cache_len a multiple of {32 // jnp.dtype(dtype).itemsize}, "
                         f"got {cache_len}")
    if interpret:
        raise ValueError(f"rebuild={rebuild!r} runs on tensor cores (wgmma), which Mosaic GPU interpret "
                         "mode does not run: use rebuild='exact' off GPU")


def keys_exact(rebuild: str, keys_dtype) -> bool:
    """Whether "3xtf32" takes the key-side records `keys_dtype` as one exact tf32 part: a
    2-byte float (bf16: 8 significant bits, fp16: 11, both within tf32's 11 and range)."""
    return rebuild == "3xtf32" and keys_dtype is not None and jnp.dtype(keys_dtype).itemsize == 2


def operand_parts(rebuild: str, keys_dtype=None) -> tuple[int, int]:
    """`(A parts, B parts)` of the rebuild's operands: two tf32 parts each for "3xtf32" (B
    one where `keys_exact`), one for the single-`wgmma` modes."""
    if rebuild != "3xtf32":
        return 1, 1
    return 2, 1 if keys_exact(rebuild, keys_dtype) else 2


def tile_with_operands(tile, rows: int, width: int, cache_len: int, rebuild: str, keys_dtype=None):
    """A stage's checkpoint-tile buffer `tile` (`plgpu.SMEM`), as a `plgpu.RefUnion` with
    the rebuild's operands (`rebuild_operands`) for a tensor-core rebuild, or alone for
    "exact"."""
    if REBUILD_DTYPES[rebuild] is None:
        return tile
    return plgpu.RefUnion(tile, rebuild_operands(tile, rows, width, cache_len, rebuild, keys_dtype))


def rebuild_operands(tile, rows: int, width: int, cache_len: int, rebuild: str, keys_dtype=None) -> list:
    """The tensor-core rebuild's K-major operand buffers, `A [rows, n]` and `B^T [width,
    n]` (`operand_parts` of each: hi, then lo), for chunks of n = `operand_entries` ring
    entries: no more bytes than the checkpoint tile `tile` (`plgpu.SMEM`), whose union they
    share (`tile_with_operands`) unless a kernel gives them buffers of their own.
    `keys_dtype`: the key-side records' (B's) dtype."""
    operand = REBUILD_DTYPES[rebuild]
    entries = operand_entries(cache_len, rows, width, rebuild, math.prod(tile.shape) * jnp.dtype(tile.dtype).itemsize,
                              keys_dtype)
    swizzle = min(128, entries * jnp.dtype(operand).itemsize)
    return [plgpu.SMEM((n, entries), operand, transforms=tiled(swizzle, operand))
            for n, parts in zip((rows, width), operand_parts(rebuild, keys_dtype)) for _ in range(parts)]


def stacked_operands(tile, rows: int, width: int, cache_len: int, rebuild: str, keys_dtype=None):
    """`rebuild_operands`' buffers stacked into one, `[R, n]` of exactly the checkpoint
    tile's bytes (the parts as row ranges, `operand_views`; they share one dtype, one width
    n and one swizzle), for a union with the tile whose two members a kernel of several
    programs can give a program axis each (`pipeline.with_program_axis`): equal bytes, so
    program p's slice of either starts at the same offset."""
    operand = REBUILD_DTYPES[rebuild]
    tile_bytes = math.prod(tile.shape) * jnp.dtype(tile.dtype).itemsize
    entries = operand_entries(cache_len, rows, width, rebuild, tile_bytes, keys_dtype)
    row_bytes = entries * jnp.dtype(operand).itemsize
    if tile_bytes % (8 * row_bytes):
        raise ValueError(f"the tile's {tile_bytes} bytes are not whole 8-row blocks of [{entries}] "
                         f"{jnp.dtype(operand).name} operand rows")
    return plgpu.SMEM((tile_bytes // row_bytes, entries), operand, transforms=tiled(min(128, row_bytes), operand))


def operand_views(stack, rows: int, width: int, rebuild: str, keys_dtype=None) -> list:
    """The operand buffers of `rebuild_operands`, in its order, as row ranges of `stack`
    (`stacked_operands`: the A parts' `rows` rows each, then the B parts' `width`)."""
    views, start = [], 0
    for n, parts in zip((rows, width), operand_parts(rebuild, keys_dtype)):
        for _ in range(parts):
            views.append(stack.at[pl.ds(start, n)])
            start += n
    return views


def operand_entries(cache_len: int, rows: int, width: int, rebuild: str, tile_bytes: int, keys_dtype=None) -> int:
    """Ring entries in one chunk of the rebuild's operands `A [rows, n]`, `B^T [width, n]`
    (the K extent of its `wgmma`s): the most, up to `OPERAND_ENTRIES`, that divide the ring
    and whose operands (`operand_parts` of each) fit in `tile_bytes` (the checkpoint tile's
    buffer they share), but at least one 32-byte row of the operand type (`wgmma`'s K
    step). `cache_len` is a multiple of that row (`check_rebuild`)."""
    operand = jnp.dtype(REBUILD_DTYPES[rebuild])
    a_parts, b_parts = operand_parts(rebuild, keys_dtype)
    entry_bytes = (rows * a_parts + width * b_parts) * operand.itemsize
    least = 32 // operand.itemsize
    entries = min(cache_len, OPERAND_ENTRIES)
    while entries > least and (cache_len % entries or entries * entry_bytes > tile_bytes):
        entries -= least
    return entries


def split_tile_buffer(tile_buf, rebuild: str, own_operands: bool = False, keys_dtype=None):
    """`(checkpoint tile ref, operand refs)` of a buffer made by `tile_with_operands`, or of
    a union of the tile with `stacked_operands` (the operands its row ranges,
    `operand_views`; `keys_dtype` the key-side records'); operands `()` where the buffer is
    the tile alone: the exact rebuild, or operands in buffers of their own."""
    if rebuild == "exact" or own_operands:
        return tile_buf, ()
    t_smem, operands = tuple(tile_buf)
    if not isinstance(operands, (list, tuple)):  # one stacked buffer
        operands = operand_views(operands, t_smem.shape[0], t_smem.shape[1], rebuild, keys_dtype)
    return t_smem, operands


def tf32_split(x):
    """`(hi, lo)` with `hi + lo == x` exactly and hi exact in tf32: hi is x rounded to 11
    significant bits by integer arithmetic on its bits (an arithmetic split such as
    Veltkamp's `s - (s - x)` can be folded to `x` by the compiler, which makes lo 0 and the
    result plain tf32); lo, at most 2^-11 of x, keeps 12 bits, which a tf32 `wgmma`
    truncates to 11, so `hi b + lo b` is off by about 2^-22 of `x b`."""
    bits = lax.bitcast_convert_type(x, jnp.int32)
    hi = lax.bitcast_convert_type((bits + jnp.int32(1 << 12)) & jnp.int32(-(1 << 13)), jnp.float32)
    return hi, x - hi


def rebuild_mma(start, a, keys_t, pos, operands):
    """`start + A B^T` on tensor cores, accumulating in fp32 from `start` `[M, W]` (the
    decayed checkpoint tile): `A` `[M, L]` (stale entries already 0) and `B^T` `[W, L]`
    with stale entries replaced by 0 here (a NaN there would reach every output through
    the product), both written K-major (L contiguous) into `operands` one chunk of
    `operand_entries` entries at a time: `(a, b)` rounded to their dtype for one `wgmma`,
    `(a_hi, a_lo, b_hi, b_lo)` for three (`tf32_split`; the small products first), or
    `(a_hi, a_lo, b)` for two where B is exact in tf32 (`keys_exact`). The caller has
    synchronised the warpgroup if `operands` alias a buffer it was reading."""
    j = plgpu.broadcasted_iota(jnp.int32, keys_t.shape, 1, layout=WGMMA)
    b = jnp.where(j < pos, keys_t, 0.0)
    entries = operands[0].shape[1]

    # A has as many parts as B or more (`operand_parts`): (1, 1), (2, 1) or (2, 2) buffers.
    a_bufs, b_bufs = operands[:(len(operands) + 1) // 2], operands[(len(operands) + 1) // 2:]

    def write(chunk):
        """The operands of entries `chunk` (a slice) into shared memory; the products, the
        small ones (a low part's) first."""
        for bufs, x in ((a_bufs, a[:, chunk]), (b_bufs, b[:, chunk])):
            if len(bufs) == 1:
                bufs[0][...] = x.astype(bufs[0].dtype)
            else:
                for buf, part in zip(bufs, tf32_split(x)):
                    buf[...] = part
        plgpu.commit_smem()
        (a_hi, *a_lo), (b_hi, *b_lo) = a_bufs, b_bufs
        return [(lo, b_hi) for lo in a_lo] + [(a_hi, lo) for lo in b_lo] + [(a_hi, b_hi)]

    def mma(acc_ref):  # returns nothing: `run_state` gives the accumulator's final value
        for first in range(0, keys_t.shape[1], entries):
            if first:
                # The previous chunk's `wgmma`s read the operands until they complete, and
                # every thread must be past them before the buffers are rewritten.
                plgpu.wgmma_wait(0)
                plgpu.commit_smem()
            for a_smem, b_smem in write(slice(first, first + entries)):
                plgpu.wgmma(acc_ref, a_smem, b_smem.T)

    return pl.run_state(mma)(plgpu.ACC.init(start))
