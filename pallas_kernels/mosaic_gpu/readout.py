"""Tensor-core readouts of a state tile on a few vectors, shared by the Mosaic kernels.

`S X^T` `[M, N]` for a state tile `S [M, W]` and the N rows of `X [N, W]` (raw bf16 token
vectors, K-major in shared memory, N a multiple of 8: `wgmma`'s N) as `wgmma`s accumulating
in fp32. A bf16 times a bf16 is exact in fp32, so the products are as exact as the tile's
parts: an fp32 tile is split into three bf16 parts in registers (`split_bf16`: their sum is
the tile exactly) and each part is a register A operand; a bf16 tile is one part and can be
read by the tensor cores straight from its swizzled shared-memory buffer, never entering
registers. Column j of the result is `S x_j` (`column`).

Interpret mode runs no `wgmma`: `tile_products(..., interpret=True)` forms the same parts
and products as fp32 dots, so CPU tests cover everything around the instruction.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
from jaxtyping import Array, Float

from pallas_kernels.mosaic_gpu.layouts import F32, WGMMA, row_sum

READOUTS = ("fma", "mma")


def vector_rows(count: int) -> int:
    """N for `count` vectors: rounded up to a multiple of 8 (`wgmma`'s N)."""
    return -(-count // 8) * 8


def stage_vectors(x: Float[Array, "B V Hk Dk"]) -> Float[Array, "B Hk N Dk"]:
    """The V vectors per (row, key head) as the readout's B operand: `[B, Hk, N, d_k]`
    with zero rows up to `vector_rows(V)` (a tile copied per (row, key head))."""
    x = jnp.moveaxis(x, 1, 2)
    return jnp.pad(x, ((0, 0), (0, 0), (0, vector_rows(x.shape[2]) - x.shape[2]), (0, 0)))


def vector_pairs(q: Float[Array, "B Hk Dk"], k: Float[Array, "B Hk Dk"]) -> Float[Array, "R Dk"]:
    """q and k of each (row, key head) as adjacent rows of a flat `[2 B H_k, d_k]` (zero
    rows up to a multiple of 8): the aligned box of 8 rows holding a pair (`pair_box`) holds
    four, so a tile copies one box (TMA copies a `wgmma` operand in 8-row-aligned boxes) and
    reads two columns of one `[M, 8]` product, where `stage_vectors` writes 6 zero rows per
    pair."""
    pairs = jnp.stack([q, k.astype(q.dtype)], axis=2).reshape(-1, q.shape[-1])
    return jnp.pad(pairs, ((0, -pairs.shape[0] % 8), (0, 0)))


def pair_box(b, hk, num_k_heads: int):
    """`(first row, column)` of (row b, key head hk)'s pair in `vector_pairs`: the start of
    its 8-row box (a multiple of 8) and its q's row within the box (its k's is the next)."""
    row = 2 * (b * num_k_heads + hk)
    return pl.multiple_of(row // 8 * 8, 8), row % 8


def tile_parts(state_dtype) -> int:
    """How many bf16 parts hold a value of `state_dtype` exactly (8 significant bits each)."""
    return -(-(jnp.finfo(state_dtype).nmant + 1) // 8)


def split_bf16(x, parts: int) -> list:
    """`parts` bf16 arrays whose sum is x: each the bf16 rounding of what the ones before
    left (the remainder of a rounding is exact in fp32), so three carry an fp32 value's 24
    significant bits and one a bf16 value."""
    out, rest = [], x
    for p in range(parts):
        part = rest.astype(jnp.bfloat16)
        out.append(part)
        if p + 1 < parts:
            rest = rest - part.astype(F32)
    return out


def summed_products(a_operands, x_smems, *, interpret: bool = False):
    """`sum_p sum_x A_p X^T` `[M, N]` in fp32 (WGMMA layout) over `a_operands` (bf16
    register arrays, or one bf16 buffer) and the raw bf16 vectors of each buffer in
    `x_smems` (each `[N, W]`, K-major, swizzled). `interpret`: the same products as fp32
    dots."""
    if interpret:
        dot = lambda a, x: lax.dot_general(a[...].astype(F32), x[...].astype(F32), (((1,), (1,)), ((), ())),
                                           precision=lax.Precision.HIGHEST)
        return sum(dot(a, x) for x in x_smems for a in a_operands)

    def mma(acc_ref):  # returns nothing: `run_state` gives the accumulator's final value
        for x_smem in x_smems:
            for a in a_operands:
                plgpu.wgmma(acc_ref, a, x_smem.T)
                plgpu.wgmma_wait(0)  # a register operand is read until its `wgmma` completes

    zeros = plgpu.layout_cast(jnp.zeros((a_operands[0].shape[0], x_smems[0].shape[0]), F32), WGMMA)
    return pl.run_state(mma)(plgpu.ACC.init(zeros))


def tile_products(s, x_smem, parts: int, *, interpret: bool = False):
    """`S X^T` `[M, N]` in fp32 (WGMMA layout) for the tile `s` in registers (WGMMA),
    split into `parts` bf16 register operands, against the raw bf16 vectors `x_smem
    [N, W]` (K-major, swizzled). `interpret`: the same parts and products as fp32 dots."""
    return summed_products(split_bf16(s, parts), [x_smem], interpret=interpret)


def buffer_products(s_smem, x_smem, *, interpret: bool = False):
    """`S X^T` `[M, N]` in fp32 (WGMMA layout) for a bf16 tile read by the tensor cores
    from its shared-memory buffer `s_smem [M, W]` (swizzled as a `wgmma` operand)."""
    return summed_products([s_smem], [x_smem], interpret=interpret)


def column(products, j: int):
    """Column j of `[M, N]` (WGMMA) as a ROW vector `[M]`."""
    cols = plgpu.broadcasted_iota(jnp.int32, products.shape, 1, layout=WGMMA)
    return row_sum(jnp.where(cols == j, products, 0.0))
