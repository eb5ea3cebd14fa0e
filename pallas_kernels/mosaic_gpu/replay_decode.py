"""Fused ReplaySSM decode step for GDN on Mosaic GPU (`plgpu.kernel`), one launch per step.

Grid `(B, H_v * d_v / BV)`, one warpgroup (128 threads) per CTA, BV = 64: CTA (b, h, t)
serves value rows `t*BV .. t*BV + BV - 1` of value head h of row b, whose slot, cursor
`pos` and mode (padding / append / flush) it reads from `[B]` arrays. With
`MosaicReplayParams.programs = n`, n persistent CTAs serve chunks of the tiles dealt round robin, the
next tile's copies in flight while one is computed (`pipeline.persistent_tiles`); a chunk
is one key head's tiles, and what they share (`key_side`: `K k`, `K q`, the q/k norms,
`k . q`) is computed on the chunk's first tile and read back from shared memory by the rest
(`pipeline.group_shared`). With `MosaicReplayParams.warpgroups = w`, a CTA runs w of those
programs side by side, one per warpgroup, each on its own slice of the buffers.

Data movement (TMA, one barrier per stage): the checkpoint tile `S_c [BV, d_k]`, the
slot's u records `[L, BV]` of this tile and its key records `[L, d_k]` (key head h // G),
all swizzled, its log-decays `[L]` and the token's q, k (twice: one copy per vector
layout) and v rows land in shared memory. Where that fits more CTAs per SM
(`MosaicReplayParams.group_records`: fp32 rings of 32), the key records, which only a
group's fresh tile and flush rows read, go to one buffer per CTA instead, copied for each
fresh tile (`pipeline` group copies, started while the tile before it is computed). The
exact rebuild fetches a second, untiled copy of the records; everything else is registers.

Readout: `S_c x` for x = q, k is a row reduction per vector ("fma") or, with
`readout="mma"`, one `wgmma` against the raw bf16 q and k as adjacent rows of a flat array
(`readout.vector_pairs`, `[2 B H_k, d_k]`): each tile copies the aligned 8-row box that
holds its key head's pair (and three others') and reads the pair's two columns of the
`[BV, 8]` product; a bf16 tile straight from its buffer, an fp32 one in three exact bf16
register parts (`readout.py`).

Layouts (Hopper WGMMA family, `m % 64 == 0 == n % 8`):
- `S_c` in `WGMMA` `[BV, d_k]`; `S_c x` is a row reduction into `ROW = WGMMA.reduce(1)`
  `[BV]`, with x broadcast from `COL = WGMMA.reduce(0)` `[d_k]`.
- key records read transposed, `K^T [d_k, L]` (`WGMMA_TRANSPOSED` load, cast to `WGMMA`):
  `c = K x` is a column reduction into `COL [L]`, x broadcast from `ROW [d_k]`.
- u records read transposed, `U^T [BV, L]`: `U^T (w * c)` is a row reduction into
  `ROW [BV]`, the same layout as `S_c x`, so the two parts add without a relayout.
- decay weights `W_j = exp(sum_{j<i<pos} g_i)` `COL [L]`: suffix sums of the valid
  entries' log-decays, newest first (scalars read from shared memory), exponentiated as
  one vector.

Step math (as `pallas_kernels.replay_decode`): with the live state
`S_{t-1} = e^G S_c + sum_{j<pos} W_j u_j k_j^T` (G the sum of the valid log-decays),
`S_{t-1} x = e^G S_c x + U^T (W * (K x))` for x = alpha k and alpha q, never forming
`S_{t-1}`; then `u = beta (v - S_{t-1} alpha k)`, `y = S_{t-1} alpha q + u (k . q)`.
Entries at and past `pos` are masked with selects before any product, so a stale
record (NaN included) cannot reach an output.

Append rows store u at `pos` (and g from tile 0, k from tile 0 of the first value head of
each key head). Flush rows rebuild `S_{t-1}` from the `S_c` tile already in registers,
in exact fp32 on CUDA cores (one fused multiply-add per element and entry, newest entry
first with a running decay: the same order as the Triton kernel's "ieee" rebuild), and
store `S_t = alpha S_{t-1} + u k^T` in place through shared memory and TMA; the
checkpoint is read from memory once per step, flush or not.

The state arrays are mutable refs (`jax.new_ref`): under a donated `jit` the kernel
updates them in place.

KDA (per-channel decay) has its own kernel, `replay_decode_kda.py`, sharing this file's
q / k loading, output, append and tile-store helpers.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
from jaxtyping import Array, Float, Int

from pallas_kernels.common import L2NORM_EPS, MODE_APPEND, MODE_FLUSH, MODE_PAD, is_int
from pallas_kernels.mosaic_gpu.build import build_kernel, check_no_window, check_shared_params
from pallas_kernels.mosaic_gpu.layouts import (BLOCK_ROWS, COL, F32, ROW, WGMMA, bcast_cols, bcast_rows, check_smem,
                                               col_sum, copy_record_rows, load_transposed, record_copies,
                                               replay_scratch, row_sum, smem_bytes, softplus, tiled)
from pallas_kernels.mosaic_gpu.pipeline import (STAGES, group_shared, grouped_fits_more, kernel_scratch,
                                                launch_order_input, programs_that_fit, serve_tiles, tile_buffers,
                                                tile_grid)
from pallas_kernels.mosaic_gpu.readout import (buffer_products, column, pair_box, summed_products, tile_parts,
                                               tile_products, vector_pairs, vector_rows)
from pallas_kernels.mosaic_gpu.rebuild import (check_rebuild, rebuild_mma, rebuild_operands, split_tile_buffer,
                                               stacked_operands, tile_with_operands)

BLOCK_V = BLOCK_ROWS
# Persistent CTAs resident per SM at most (`pipeline.ctas_per_sm`): ptxas gives this kernel
# 250-254 registers per thread at B = 512 on the H200 (fp32 and bf16 states), two CTAs' worth.
RESIDENT_CTAS = 2
DECODE_VECTORS = 2  # the "mma" readout's vectors: q, then k
KEY_SIDES = ("kernel", "xla", "mma")
MAX_WARPGROUPS = 4  # a CTA of 512 threads, 128 registers each



@dataclasses.dataclass(frozen=True)
class MosaicReplayParams:
    """Launch parameters of `replay_decode_mgpu`.

    Attributes:
      swizzle: shared-memory swizzle of the checkpoint tile in bytes (32, 64 or 128).
      rebuild: how flush rows rebuild `S_{t-1} = e^G S_c + U^T diag(W) K` (the decode kernels
        and the GDN verify kernel's folds): "exact" (default) in fp32 on CUDA cores, one fused
        multiply-add per element and entry in the Triton "ieee" order; "tf32" or "bf16" (opt-in)
        as one `wgmma` on tensor cores with the operands `U^T diag(W)` and `K` rounded to that
        type (fp32 accumulation from `e^G S_c`), which leaves out the untiled record copies;
        "3xtf32" as three tf32 `wgmma`s over each operand's high and low tf32 parts
        (`rebuild.tf32_split`: hi hi + hi lo + lo hi, about 2^-21 relative per product; measured
        within 1.3e-7 normwise of the IEEE rebuild, and the backend's `default_params` choice on
        a GPU). The operands live in the stage's checkpoint-tile buffer (a `plgpu.RefUnion`),
        free once `S_c` is in registers. Their errors are measured by
        `benchmarks/mosaic_bench.py`'s check section.
      programs: 0 (default) launches one CTA per tile (grid `(B, H_v d_v / 64)`); n > 0
        launches n persistent CTAs (at most one per tile), each walking chunks of tiles
        dealt round robin, the next tile's copies in flight (`pipeline.persistent_tiles`,
        two stages of shared buffers). `pipeline.programs_that_fit` picks n for a device;
        the backend's `default_params` does so on GPU.
      auto_barriers: True (default) keeps Mosaic's conservative warpgroup barriers around
        every vector store and before every TMA copy; False leaves only the kernel's own
        (`commit_smem` before each TMA store, each shared buffer a thread rewrites, and
        each stage refill), which its access pattern needs.
      readout: how the GDN kernels read the checkpoint tile out on their vectors (decode:
        k and q; verify: the window's 2T): "fma" (default) as a row reduction per vector
        on CUDA cores; "mma" as `wgmma`s over all of them at once against the raw bf16
        vectors (`readout.tile_products`: an fp32 tile split into three bf16 parts in
        registers, exact products, so fp32 accuracy; a bf16 tile read by the tensor cores
        from its shared-memory buffer, `readout.buffer_products`); interpret mode computes
        the same products as dots. It needs bf16 q and k; the KDA kernels refuse it.
      group_records: whether the GDN decode kernel copies a key head's records `[L, d_k]`
        once per group of tiles into one buffer per CTA (True) or with every tile into its
        stage (False); None (default): grouped where that fits more persistent CTAs per SM
        in shared memory (`grouped_fits_more`: fp32 rings of 32, bf16 states at L = 16),
        since a fresh tile then waits for the group's copy (measured 5% slower with bf16
        states at L = 16 where it fitted no more CTAs). The KDA kernel always groups its
        records.
      chunk: tiles per chunk of a persistent CTA (`pipeline.serve_tiles`); 0 (default) the
        tiles that share a group's values (a key head's for GDN, a value head's for KDA), at
        most `pipeline.MAX_CHUNK`. A chunk computes its group's values once (chunks of one
        tile measured 1.5x slower for GDN bf16 at B = 512); shorter chunks balance flushing
        rows better.
      key_side: where a key head's values (`K k`, `K q` over its ring, the q/k scales and
        `k . q`) are computed: "kernel" (default) on each CTA's fresh tile, a column sum
        across the warpgroup's warps; "mma" on the fresh tile on tensor cores (`ring_products`:
        `K k`, `K q` as one `wgmma` of the raw bf16 k and q, each broadcast over half the
        tile's 64 rows, against the key records, so each row of the product holds all of one
        and no sum crosses warps; bf16 q, k and key records; a `[BV, L]` fp32 buffer per
        program takes the product to read a row of each back); "xla" before the launch
        (`key_side_values`, `[B, H_k, 3, L]` fp32, copied with each tile), so no tile sums
        across warps and a tile copies the key records only to flush (the tensor-core
        rebuilds' operand; the exact rebuild reads its untiled copies). Its records are never
        grouped. The GDN verify kernel takes
        it too: the window's `K k_i`, `K q_i` before its launch (`verify_decode.
        window_key_values`, a small kernel of their own) in place of its key records and
        group sums.
      per_tile_addresses: False (default) lets the compiler compute the shared buffers'
        addresses and `wgmma` descriptors once and hold them in registers across a
        persistent CTA's loop; True indexes every buffer by a zero it cannot prove
        (`pipeline.program_view`), so each tile recomputes them: fewer registers per thread
        for more address arithmetic per tile (the GDN decode and verify kernels).
      warpgroups: persistent programs per CTA (GDN decode and verify; default 1): w > 1 runs w
        warpgroups side by side, each a program on its own slice of the buffers
        (`pipeline.with_program_axis`), so ptxas must fit a thread in 65,536 / (128 w)
        registers (168 at w = 3: what three resident CTAs need, which a 128-thread CTA
        cannot ask for). Needs `programs` a multiple of w, `auto_barriers=False` and
        `key_side` "xla" or "mma" ("kernel" sums across warps through the one reduction
        scratch of the CTA, which the warpgroups would share: wrong results on the GPU); a
        tensor-core rebuild's operands get a buffer per program instead of the union
        with the tile, unless `operands_in_tile`.
      launch_order: False (default) serves the rows in their order; True in the caller's
        `row_order` (the backends pass the plan's launch order, the costliest rows first:
        flushing rows in decode, folding rows in verify), so that those rows (about twice
        a tile's work) are dealt evenly over the persistent programs instead of where their
        index falls (`pipeline.serve_tiles`). GDN and KDA decode, GDN verify.
      window_side: where the GDN and KDA verify kernels' window scalars (`T x T` products,
        decays, norms; GDN: staged vectors) are formed before their launch: "xla" (default)
        by XLA, in about eight small kernels; "kernel" by `pallas_kernels.
        verify_coefficients`, one Pallas Triton launch (one program per row and key head).
        The decode kernels refuse "kernel".
      window_warps: warps per program of that launch (`VerifyCoefficientsParams.num_warps`;
        default 2; 1 keeps its reductions inside one warp, without cross-warp barriers);
        only with `window_side="kernel"`.
      prefetch_folds: the GDN verify kernel's persistent programs only: False (default) a
        folding row fetches what its fold reads besides the tile once `S_c` is in registers
        and waits for it (the exact rebuild's untiled record copies, into the stage's tile
        buffer; with `key_side="xla"` a tensor-core fold's key records, into one buffer per
        program); True gives each stage buffers of their own for them, copied with a
        folding row's tile one tile ahead (more shared memory per CTA; the exact rebuild on
        one warpgroup per CTA; the decode kernels refuse it).
      operands_in_tile: the GDN decode kernel with `warpgroups` > 1 and a tensor-core
        rebuild only: True stacks each program's rebuild operands into one buffer of the
        checkpoint tile's bytes in a union with its tile (`rebuild.stacked_operands`: the
        union's two members of equal bytes per program, which `pipeline.with_program_axis`
        can split between programs), as a single warpgroup's operands share its tile,
        instead of buffers of their own: 16 KiB less a program with a bf16 tile, so four
        programs fit with the key side on tensor cores (opt-in: NOTES "four programs per SM
        with tensor-core folds").
      group_folds: the GDN verify kernel's persistent programs with exact folds on one
        warpgroup per CTA only (not with `prefetch_folds`): True takes a folding row's
        value records with its tile, untiled, into the stage's value-record buffer (a
        union: a folding row reads out no history), and its key records once per key-head
        group into one buffer per CTA, copied a tile ahead (`pipeline` group copies), for
        a sixth of `prefetch_folds`' extra shared memory (an fp32 tile on a ring of 32
        keeps two CTAs per SM); the decode kernels refuse it.
    """

    swizzle: int = 128
    rebuild: str = "exact"
    programs: int = 0
    auto_barriers: bool = True
    readout: str = "fma"
    group_records: bool | None = None
    chunk: int = 0
    key_side: str = "kernel"
    per_tile_addresses: bool = False
    warpgroups: int = 1
    launch_order: bool = False
    window_side: str = "xla"
    window_warps: int = 2
    prefetch_folds: bool = False
    group_folds: bool = False
    operands_in_tile: bool = False

    def __post_init__(self) -> None:
        check_shared_params(self)
        for name in ("prefetch_folds", "group_folds", "operands_in_tile"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.prefetch_folds and self.group_folds:
            raise ValueError("prefetch_folds and group_folds are two ways to copy a fold's records: set one")
        if isinstance(self.window_warps, bool) or self.window_warps not in (1, 2, 4, 8):
            raise ValueError(f"window_warps must be 1, 2, 4 or 8, got {self.window_warps!r}")
        if self.window_warps != 2 and self.window_side != "kernel":
            raise ValueError(f"window_warps applies to window_side='kernel', got window_warps={self.window_warps} "
                             f"with window_side={self.window_side!r}")
        if self.key_side not in KEY_SIDES:
            raise ValueError(f"key_side must be one of {KEY_SIDES}, got {self.key_side!r}")
        if self.key_side == "xla" and self.group_records:
            raise ValueError("key_side='xla' copies the key records only to flush: group_records must not be True")
        if not isinstance(self.per_tile_addresses, bool):
            raise ValueError(f"per_tile_addresses must be a bool, got {self.per_tile_addresses!r}")
        if not is_int(self.warpgroups) or not 1 <= self.warpgroups <= MAX_WARPGROUPS:
            raise ValueError(f"warpgroups must be an int in [1, {MAX_WARPGROUPS}], got {self.warpgroups!r}")
        if self.warpgroups > 1 and (not self.programs or self.programs % self.warpgroups):
            raise ValueError(f"warpgroups={self.warpgroups} runs persistent programs: programs must be a positive "
                             f"multiple of it, got {self.programs}")
        if self.warpgroups > 1 and self.key_side == "kernel":
            # The kernel's column sums cross a warpgroup's warps through Mosaic's one
            # reduction scratch per CTA, which several warpgroups would share: measured wrong
            # on the GPU (interpret mode runs the programs one at a time and cannot see it).
            raise ValueError(f"warpgroups={self.warpgroups} shares one cross-warp reduction scratch per CTA: "
                             f"key_side must be 'xla' or 'mma', got {self.key_side!r}")
        if self.warpgroups > 1 and self.auto_barriers:
            raise ValueError(f"warpgroups={self.warpgroups} keeps each program's own barriers: auto_barriers must "
                             "be False")
        if self.operands_in_tile and (self.warpgroups == 1 or self.rebuild == "exact"):
            raise ValueError("operands_in_tile puts several programs' tensor-core rebuild operands in their tiles' "
                             f"union: it needs warpgroups > 1 and a tensor-core rebuild, got warpgroups="
                             f"{self.warpgroups}, rebuild={self.rebuild!r}")


def check_own_layout(params, kernel: str, *, per_tile_addresses: bool = False, key_side: bool = False,
                     warpgroups: bool = False, launch_order: bool = False, window_side: bool = False) -> None:
    """Raise ValueError if `params` sets `group_records`, an option of the GDN and Mamba-2
    decode kernels that a kernel with its own record layout (KDA decode, verify) ignores,
    or `per_tile_addresses`, `key_side`, `warpgroups` or `launch_order` unless the kernel
    takes it (the GDN verify kernel takes all four, KDA decode the last); `window_side`
    other than "xla" only in the verify kernels that take it; `operands_in_tile` (the GDN
    decode kernel's) never."""
    if getattr(params, "operands_in_tile", False):
        raise ValueError(f"{kernel} gives several programs' rebuild operands buffers of their own: "
                         "operands_in_tile must be False")
    if getattr(params, "group_records", None) is not None:
        raise ValueError(f"{kernel} lays out its records itself: group_records must be None, got "
                         f"{params.group_records!r}")
    if getattr(params, "warpgroups", 1) != 1 and not warpgroups:
        raise ValueError(f"{kernel} runs one program per CTA: warpgroups must be 1, got {params.warpgroups}")
    if getattr(params, "key_side", "kernel") != "kernel" and not key_side:
        raise ValueError(f"{kernel} computes its key side itself: key_side must be 'kernel', got {params.key_side!r}")
    if getattr(params, "per_tile_addresses", False) and not per_tile_addresses:
        raise ValueError(f"{kernel} holds its buffers' addresses itself: per_tile_addresses must be False")
    if getattr(params, "launch_order", False) and not launch_order:
        raise ValueError(f"{kernel} serves its rows in their order: launch_order must be False")
    if not window_side:
        check_no_window(params, kernel)


def check_fma_readout(params, kernel: str) -> None:
    """Raise ValueError unless `params` reads out on CUDA cores ("mma" is the GDN kernels';
    parameters without a readout, `MosaicMamba2Params`, pass)."""
    if getattr(params, "readout", "fma") != "fma":
        raise ValueError(f"{kernel} reads out with readout='fma' only, got readout={params.readout!r}")


def check_mma_readout(params, qk_dtype, kernel: str) -> None:
    """Raise ValueError if `params` asks for the "mma" readout without bf16 q and k (its
    products are exact for raw bf16 vectors only)."""
    if params.readout == "mma" and jnp.dtype(qk_dtype) != jnp.bfloat16:
        raise ValueError(f"{kernel}: readout='mma' multiplies the tile by the raw q and k on tensor cores: it needs "
                         f"bf16 q and k, got {jnp.dtype(qk_dtype)}")


def check_mma_key_side(params, qk_dtype, cache_dtype, kernel: str) -> None:
    """Raise ValueError if `params` asks for the key side on tensor cores (`key_side="mma"`)
    without bf16 q, k and key records (the `wgmma` operands, exact only as bf16)."""
    dtypes = (jnp.dtype(qk_dtype), jnp.dtype(cache_dtype))
    if params.key_side == "mma" and dtypes != (jnp.dtype(jnp.bfloat16),) * 2:
        raise ValueError(f"{kernel}: key_side='mma' multiplies the raw q and k by the key records on tensor cores: it "
                         f"needs bf16 q, k and cache, got q {dtypes[0]} and cache {dtypes[1]}")


def check_shapes(head_k_dim: int, head_v_dim: int, cache_len: int, state_itemsize: int,
                 swizzle: int = 128) -> None:
    """Raise ValueError unless the shapes fit the kernel's layouts."""
    if head_v_dim % BLOCK_V:
        raise ValueError(f"mosaic_gpu needs d_v a multiple of {BLOCK_V}, got d_v = {head_v_dim}")
    if head_k_dim % 64:
        raise ValueError(f"mosaic_gpu needs d_k a multiple of 64, got d_k = {head_k_dim}")
    if (head_k_dim * state_itemsize) % swizzle:
        raise ValueError(f"a d_k = {head_k_dim} row is not a multiple of the {swizzle}-byte swizzle")
    # The ring's length is bounded by shared memory, which each kernel checks (`check_smem`).
    if cache_len % 8 or cache_len < 8:
        raise ValueError(f"mosaic_gpu needs cache_len a multiple of 8 (at least 8), got {cache_len}")


def decay_weights(g_smem, pos, cache_len):
    """`(W [L] in COL, e^G)`: `W_j = exp(sum_{j<i<pos} g_i)` for j < pos, 0 past it.

    The valid entries' log-decays are summed newest first as scalars (unrolled over the
    ring; an entry at or past `pos` adds 0 through a select, so a stale g, NaN included,
    is never used), and the suffix sums exponentiated as one vector: the chain of
    dependent operations is L additions, not L exponentials."""
    j = plgpu.broadcasted_iota(jnp.int32, (cache_len,), 0, layout=COL)
    suffix = plgpu.layout_cast(jnp.zeros((cache_len,), F32), COL)
    total = jnp.float32(0.0)
    for i in reversed(range(cache_len)):
        suffix = jnp.where(j == i, total, suffix)
        total = total + jnp.where(i < pos, g_smem[i], 0.0)
    return jnp.where(j < pos, jnp.exp(suffix), 0.0), jnp.exp(total)


def rebuild_exact(s_c, decay_total, u_smem, k_smem, g_smem, pos):
    """`S_{t-1} = e^G S_c + sum_j W_j u_j k_j^T` in fp32, newest entry first (running W)."""

    def body(i, carry):
        state, weight = carry
        j = pos - 1 - i
        u_j = plgpu.load(u_smem.at[j], layout=ROW, optimized=False).astype(F32)
        k_j = plgpu.load(k_smem.at[j], layout=COL, optimized=False).astype(F32)
        state = state + bcast_rows(weight * u_j, state.shape) * bcast_cols(k_j, state.shape)
        return state, weight * jnp.exp(g_smem[j])

    state, _ = lax.fori_loop(0, pos, body, (s_c * decay_total, jnp.float32(1.0)))
    return state


def rebuild_weighted(s_c, decay_total, u_smem, k_smem, weights_smem, pos):
    """`rebuild_exact` with the weights given: `S_{t-1} = e^G S_c + sum_j W_j u_j k_j^T` in
    fp32, newest entry first, W_j read from `weights_smem [>= pos]`."""

    def body(i, state):
        j = pos - 1 - i
        u_j = plgpu.load(u_smem.at[j], layout=ROW, optimized=False).astype(F32)
        k_j = plgpu.load(k_smem.at[j], layout=COL, optimized=False).astype(F32)
        return state + bcast_rows(weights_smem[j] * u_j, state.shape) * bcast_cols(k_j, state.shape)

    return lax.fori_loop(0, pos, body, s_c * decay_total)


def rebuild_tensor_cores(s_c, decay_total, u_t, weights, k_smem, pos, operands):
    """`S_{t-1} = e^G S_c + U^T diag(W) K` by `rebuild.rebuild_mma`: `u_t` `[BV, L]` the
    value records with entries at and past `pos` already 0, `weights` `[L]` (COL), the key
    records read from `k_smem`; `operands` may alias the buffer `S_c` was loaded from (a
    warpgroup barrier comes first)."""
    keys_t = load_transposed(k_smem)  # [Dk, L]
    plgpu.commit_smem()  # every thread has S_c from the buffer its operands reuse
    return rebuild_mma(s_c * decay_total, u_t * bcast_cols(weights, u_t.shape), keys_t, pos, operands)


def qk_scales(q, k, *, use_qk_l2norm, scale):
    """`(q_scale, k_scale)`: the factors that normalise q and k `[..., d_k]` (if asked, over
    their last axis) and scale q; scalars without the norms."""
    q_scale, k_scale = jnp.float32(scale), jnp.float32(1.0)
    if use_qk_l2norm:
        q_scale = q_scale * lax.rsqrt(jnp.sum(q * q, axis=-1) + L2NORM_EPS)
        k_scale = lax.rsqrt(jnp.sum(k * k, axis=-1) + L2NORM_EPS)
    return q_scale, k_scale


def load_qk(q_ref, k_ref, q_row_ref, k_row_ref, *, use_qk_l2norm, scale):
    """q, k `[d_k]` (global or shared memory refs) in both vector layouts, normalised (if
    asked) and q scaled: `(q_col, k_col, q_row, k_row, k . q)`, fp32, in COL and ROW.

    Layout inference cannot give two layouts to loads of one ref: the ROW copies come
    from second refs (to the same arrays, or second shared-memory copies)."""
    q_col = plgpu.load(q_ref, layout=COL, optimized=False).astype(F32)
    k_col = plgpu.load(k_ref, layout=COL, optimized=False).astype(F32)
    q_row = plgpu.load(q_row_ref, layout=ROW, optimized=False).astype(F32)
    k_row = plgpu.load(k_row_ref, layout=ROW, optimized=False).astype(F32)
    q_scale, k_scale = qk_scales(q_col, k_col, use_qk_l2norm=use_qk_l2norm, scale=scale)
    q_col, q_row = q_col * q_scale, q_row * q_scale
    k_col, k_row = k_col * k_scale, k_row * k_scale
    return q_col, k_col, q_row, k_row, jnp.sum(k_col * q_col)


def key_side(qk_smem, k_smem, *, use_qk_l2norm, scale, products_smem=None, interpret=False):
    """What every tile of a key-head group (one row, one key head) shares: `(K k, K q,
    q_scale, k_scale, k . q)`, `K x` `[L]` (COL) over every ring entry with k normalised and
    q normalised and scaled (stale entries included: each tile masks them), and the
    factors that normalise and scale the raw q and k. `qk_smem [4, d_k]`: the token's q,
    k, q, k (`copy_token`). `K x` of the raw vectors are column sums across the
    warpgroup's warps, or with `products_smem` (`key_side="mma"`) `ring_products`."""
    q_col, k_col = (plgpu.load(qk_smem.at[i], layout=COL, optimized=False).astype(F32) for i in (0, 1))
    q_scale, k_scale = qk_scales(q_col, k_col, use_qk_l2norm=use_qk_l2norm, scale=scale)
    if products_smem is None:
        q_row, k_row = (plgpu.load(qk_smem.at[i], layout=ROW, optimized=False).astype(F32) for i in (2, 3))
        keys_t = load_transposed(k_smem)  # [Dk, L]
        k_x, q_x = (col_sum(keys_t * bcast_rows(x, keys_t.shape)) for x in (k_row, q_row))
    else:
        k_x, q_x = ring_products(k_col, q_col, k_smem, products_smem, interpret=interpret)
    return k_scale * k_x, q_scale * q_x, q_scale, k_scale, q_scale * k_scale * jnp.sum(k_col * q_col)


def ring_products(k_col, q_col, k_smem, products_smem, *, interpret):
    """`K k`, `K q` `[L]` (COL) of the raw k, q `[d_k]` (COL) from tensor cores: one `wgmma`
    of k broadcast over the upper BV / 2 rows and q over the lower (bf16, a register A
    operand, exact) times the bf16 key records `k_smem [L, d_k]` (K-major, swizzled), fp32
    accumulation, gives `[BV, L]` (WGMMA) whose upper rows are `K k` and lower ones `K q`;
    stored to `products_smem [BV, L]` fp32, a row of each comes back as a vector. No sum
    crosses the warpgroup's warps through Mosaic's one reduction scratch per CTA (as the
    column sums do), so several warpgroups may run it."""
    shape = (BLOCK_V, k_col.shape[0])
    upper = plgpu.broadcasted_iota(jnp.int32, shape, 0, layout=WGMMA) < BLOCK_V // 2
    a = jnp.where(upper, bcast_cols(k_col, shape), bcast_cols(q_col, shape)).astype(jnp.bfloat16)
    products_smem[...] = summed_products([a], [k_smem], interpret=interpret)
    plgpu.commit_smem()
    return tuple(plgpu.load(products_smem.at[row], layout=COL, optimized=False) for row in (0, BLOCK_V // 2))


def key_side_values(q: Float[Array, "B Hk Dk"], k: Float[Array, "B Hk Dk"], k_cache: Float[Array, "N Hk L Dk"],
                    slot: Int[Array, " B"], *, use_qk_l2norm: bool, scale: float) -> Float[Array, "B Hk 3 L"]:
    """`key_side`'s values of every row and key head, in XLA, laid out as `store_key_side`
    writes them: `[K k, K q, (q_scale, k_scale, k . q, 0, ...)]` over each slot's whole ring
    (stale entries included: the kernel masks them; a padding row reads slot 0's). fp32
    products and sums of the raw vectors, then the scales, as the kernel orders them."""
    q32, k32 = q.astype(F32), k.astype(F32)
    keys = k_cache[jnp.maximum(slot, 0)].astype(F32)  # [B, Hk, L, Dk]; fused into the sums
    q_scale, k_scale = (jnp.broadcast_to(x, q.shape[:2])
                        for x in qk_scales(q32, k32, use_qk_l2norm=use_qk_l2norm, scale=scale))
    k_x = k_scale[..., None] * jnp.sum(keys * k32[:, :, None], axis=-1)
    q_x = q_scale[..., None] * jnp.sum(keys * q32[:, :, None], axis=-1)
    k_dot_q = q_scale * k_scale * jnp.sum(k32 * q32, axis=-1)
    scalars = jnp.stack([q_scale, k_scale, k_dot_q], axis=-1)
    scalars = jnp.pad(scalars, ((0, 0), (0, 0), (0, k_x.shape[-1] - 3)))
    return jnp.stack([k_x, q_x, scalars], axis=2)


def xla_side_inputs(q: Float[Array, "B Hk Dk"], k: Float[Array, "B Hk Dk"], k_cache: Float[Array, "N Hk L Dk"],
                    slot: Int[Array, " B"], *, params: MosaicReplayParams, use_qk_l2norm: bool,
                    scale: float | None) -> list[Array]:
    """The inputs XLA computes before the launch, in the kernel's order: for the "mma"
    readout the raw q and k as row pairs (`vector_pairs`, `[2 B H_k, d_k]`, padded to 8 rows),
    for `key_side="xla"` the key side (`key_side_values`, `[B, H_k, 3, L]`); none by
    default. Their kernels are part of a step's time (they read the slots' key records)."""
    vectors = [vector_pairs(q, k)] if params.readout == "mma" else []
    if params.key_side == "xla":
        scale = float(q.shape[-1] ** -0.5 if scale is None else scale)
        vectors.append(key_side_values(q, k, k_cache, slot, use_qk_l2norm=use_qk_l2norm, scale=scale))
    return vectors


def store_key_side(shared_smem, values) -> None:
    """`key_side`'s values into `shared_smem [3, L]`: the two `K x` rows, then the three
    scalars in row 2."""
    k_x, q_x, *scalars = values
    shared_smem[0] = k_x
    shared_smem[1] = q_x
    for i, value in enumerate(scalars):
        shared_smem[2, i] = value


def load_key_side(shared_smem):
    """`key_side`'s values back from `shared_smem` (`store_key_side`)."""
    k_x, q_x = (plgpu.load(shared_smem.at[i], layout=COL, optimized=False) for i in (0, 1))
    return k_x, q_x, shared_smem[2, 0], shared_smem[2, 1], shared_smem[2, 2]


def store_output(o_smem, y_ref, y, b, h, rows):
    """`y [BV]` (ROW) into `y_ref[b, h, rows]` through shared memory and TMA."""
    o_smem[...] = y.astype(o_smem.dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(o_smem, y_ref.at[b, h, rows])


def store_tile(t_smem, ckpt_ref, new, slot, h, rows):
    """The new state tile `[BV, d_k]` (WGMMA) into the checkpoint in place, through the
    checkpoint tile's shared-memory buffer and TMA (after a warpgroup barrier: a thread's
    optimised load of the tile may have read the elements another thread now writes)."""
    plgpu.commit_smem()
    t_smem[...] = new.astype(t_smem.dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(t_smem, ckpt_ref.at[slot, h, rows])


def append_entry(ucache_ref, kcache_ref, gcache_ref, slot, h, tile, pos, u, k, g, *, group_size):
    """Store this token's cache entry at `pos`: u rows from every tile, g (a scalar, or a
    `[d_k]` vector for KDA) from tile 0, k from tile 0 of the first value head of each key
    head (once per key head)."""
    rows = pl.ds(tile * BLOCK_V, BLOCK_V)
    ucache_ref[slot, h, pos, rows] = u.astype(ucache_ref.dtype)

    @pl.when(tile == 0)
    def _append_gate():
        gcache_ref[slot, h, pos] = g

    @pl.when((tile == 0) & (h % group_size == 0))
    def _append_key():
        kcache_ref[slot, h // group_size, pos] = k.astype(kcache_ref.dtype)


def copy_token(token_refs, bufs, b, h, hk, rows, barrier) -> None:
    """Start the TMA copies of row b's token for one tile, five arrivals on `barrier`: q and
    k of key head hk twice each (`qk_smem [4, d_k]` rows: one copy per vector layout) and
    the tile's rows of v of head h (`v_smem [BV]`), from `token_refs = (q, k, v)`."""
    q_ref, k_ref, v_ref = token_refs
    qk_smem, v_smem = bufs
    for i, ref in enumerate((q_ref, k_ref, q_ref, k_ref)):
        plgpu.copy_gmem_to_smem(ref.at[b, hk], qk_smem.at[i], barrier)
    plgpu.copy_gmem_to_smem(v_ref.at[b, h, rows], v_smem, barrier)


def _kernel(slot_ref, pos_ref, mode_ref, q_ref, k_ref, v_ref, g_ref, beta_ref, a_log_ref, dt_bias_ref, *refs,
            group_size, tiles, use_qk_l2norm, scale, raw_gates, rebuild, num_programs, chunk, readout, parts, grouped,
            xla_side, mma_side, program_scratch, per_tile, warpgroups, ordered, operands_in_tile, interpret):
    # Inputs, the row order, the raw q and k staged for the "mma" readout and the key side
    # from XLA first; outputs; scratch.
    order_ref, *refs = refs if ordered else (None, *refs)
    xv_ref, *refs = refs if readout == "mma" else (None, *refs)
    side_ref, *refs = refs if xla_side else (None, *refs)
    (ckpt_ref, ucache_ref, kcache_ref, gcache_ref, y_ref,
     *all_scratch) = refs
    batch, num_heads = y_ref.shape[:2]
    # A tensor-core rebuild's operands in their own buffers, not the tile's union.
    own_operands = warpgroups > 1 and not operands_in_tile

    def buffers(b):
        """`(stages, group keys, shared, rebuild buffers or own operands, barriers, group
        barrier, rows barrier)` (`_scratch`) for a tile of row b."""
        return tile_buffers(all_scratch, program_scratch, b, batch, per_tile=per_tile, warpgroups=warpgroups)

    def issue(b, h, tile, stage):
        """Start the tile's copies into `stages[stage]` (none for padding rows)."""
        stages, _, _, _, barriers, _, _ = buffers(b)
        tile_buf, u_smem, g_smem, _, qk_smem, v_smem, stage_keys, x_smem, side_smem = stages[stage]
        t_smem, _ = split_tile_buffer(tile_buf, rebuild, own_operands, kcache_ref.dtype)
        barrier, slot, rows = barriers.at[stage], slot_ref[b], pl.ds(tile * BLOCK_V, BLOCK_V)

        @pl.when(mode_ref[b] != MODE_PAD)
        def _copies():
            plgpu.copy_gmem_to_smem(ckpt_ref.at[slot, h, rows], t_smem, barrier)
            plgpu.copy_gmem_to_smem(ucache_ref.at[slot, h, :, rows], u_smem, barrier)
            plgpu.copy_gmem_to_smem(gcache_ref.at[slot, h], g_smem, barrier)
            if xla_side:
                plgpu.copy_gmem_to_smem(side_ref.at[b, h // group_size], side_smem[0], barrier)
            elif not grouped:
                plgpu.copy_gmem_to_smem(kcache_ref.at[slot, h // group_size], stage_keys[0], barrier)
            copy_token((q_ref, k_ref, v_ref), (qk_smem, v_smem), b, h, h // group_size, rows, barrier)
            if readout == "mma":
                start, _ = pair_box(b, h // group_size, q_ref.shape[1])
                plgpu.copy_gmem_to_smem(xv_ref.at[pl.ds(start, x_smem[0].shape[0])], x_smem[0], barrier)

    def issue_group(b, h, tile):
        """Start the copy of the key records, which only a fresh tile (and a flush) reads."""
        _, group_keys, _, _, _, group_barrier, _ = buffers(b)

        @pl.when(mode_ref[b] != MODE_PAD)
        def _copy():
            plgpu.copy_gmem_to_smem(kcache_ref.at[slot_ref[b], h // group_size], group_keys[0], group_barrier[0])

    def compute(b, h, tile, stage, fresh, prefetch=lambda: None):
        stages, group_keys, shared_smem, rebuild_bufs, barriers, group_barrier, rows_barrier = buffers(b)
        tile_buf, u_smem, g_smem, o_smem, qk_smem, v_smem, stage_keys, x_smem, side_smem = stages[stage]
        k_smem = group_keys[0] if grouped or xla_side and group_keys else stage_keys[0] if stage_keys else None
        t_smem, operands = split_tile_buffer(tile_buf, rebuild, own_operands, kcache_ref.dtype)
        operands = rebuild_bufs if own_operands else operands
        rows = pl.ds(tile * BLOCK_V, BLOCK_V)
        mode = mode_ref[b]
        cache_len = u_smem.shape[0]
        barrier = barriers.at[stage]

        @pl.when(mode == MODE_PAD)
        def _padding_row():
            prefetch()
            store_output(o_smem, y_ref, plgpu.layout_cast(jnp.zeros((BLOCK_V,), o_smem.dtype), ROW), b, h, rows)

        @pl.when(mode != MODE_PAD)
        def _live_row():
            slot, pos = slot_ref[b], pos_ref[b]
            # The gates as scalars while the copies fly.
            g = g_ref[b, h].astype(F32)
            beta = beta_ref[b, h].astype(F32)
            if raw_gates:
                g = -jnp.exp(a_log_ref[h].astype(F32)) * softplus(g + dt_bias_ref[h].astype(F32))
                beta = 1.0 / (1.0 + jnp.exp(-beta))
            alpha = jnp.exp(g)

            with jax.named_scope("wait"):
                plgpu.barrier_wait(barrier)

            def fresh_key_side():
                if grouped:
                    plgpu.barrier_wait(group_barrier[0])
                return key_side(qk_smem, k_smem, use_qk_l2norm=use_qk_l2norm, scale=scale,
                                products_smem=shared_smem[1] if mma_side else None, interpret=interpret)

            # The token from shared memory (copied with the tile, so a persistent CTA has
            # it one tile ahead); the key side shared by the key head's tiles.
            with jax.named_scope("key_side"):
                if xla_side:
                    k_x, q_x, q_scale, k_scale, k_dot_q = load_key_side(side_smem[0])
                else:
                    k_x, q_x, q_scale, k_scale, k_dot_q = group_shared(
                        fresh, fresh_key_side, functools.partial(store_key_side, shared_smem[0]),
                        functools.partial(load_key_side, shared_smem[0]))
            # The next group's key records may replace these now, unless this row flushes:
            # a flush reads them again (all tiles of a group are one row's, one mode).
            pl.when(mode != MODE_FLUSH)(prefetch)
            with jax.named_scope("records"):
                k_col = plgpu.load(qk_smem.at[1], layout=COL, optimized=False).astype(F32) * k_scale
                v_row = plgpu.load(v_smem, layout=ROW, optimized=False).astype(F32)
                weights, decay_total = decay_weights(g_smem, pos, cache_len)
                j = plgpu.broadcasted_iota(jnp.int32, (BLOCK_V, cache_len), 1, layout=WGMMA)
                u_t = jnp.where(j < pos, load_transposed(u_smem), 0.0)  # [BV, L], stale entries 0
            valid = plgpu.broadcasted_iota(jnp.int32, (cache_len,), 0, layout=COL) < pos
            with jax.named_scope("readout"):
                load_tile = lambda: plgpu.load(t_smem, layout=WGMMA).astype(F32)  # [BV, Dk]
                if readout == "mma":
                    # `S_c q`, `S_c k` (raw vectors) as one product; a bf16 tile straight from
                    # its buffer, so a non-flush row never holds it in registers.
                    s_c = None if parts == 1 else load_tile()
                    products = (buffer_products(t_smem, x_smem[0], interpret=interpret) if s_c is None
                                else tile_products(s_c, x_smem[0], parts, interpret=interpret))
                    _, j = pair_box(b, h // group_size, q_ref.shape[1])
                    tile_q, tile_k = q_scale * column(products, j), k_scale * column(products, j + 1)
                else:
                    s_c = load_tile()
                    q_col = plgpu.load(qk_smem.at[0], layout=COL, optimized=False).astype(F32) * q_scale
                    tile_q, tile_k = (row_sum(s_c * bcast_cols(x, s_c.shape)) for x in (q_col, k_col))

                def live_readout(tile_x, k_x):
                    """`S_{t-1} x` `[BV]` (ROW) from the tile's `S_c x` (ROW) and `K x` `[L]` (COL)."""
                    c = jnp.where(valid, k_x * weights, 0.0)
                    return row_sum(u_t * bcast_cols(c, u_t.shape)) + decay_total * tile_x

                s_k = alpha * live_readout(tile_k, k_x)
                s_q = alpha * live_readout(tile_q, q_x)
                u = beta * (v_row - s_k)

            @pl.when(mode == MODE_FLUSH)
            def _flush():
                with jax.named_scope("flush"):
                    s_tile = load_tile() if s_c is None else s_c
                    if rebuild == "exact":
                        # The rebuild reads single records at a dynamic index, which the swizzled
                        # buffers cannot serve: flush rows fetch an untiled copy (L2-resident).
                        u_rows, k_rows = rebuild_bufs
                        copy_record_rows((ucache_ref, kcache_ref), rebuild_bufs, slot, h, h // group_size, rows,
                                         rows_barrier)
                        plgpu.barrier_wait(rows_barrier)
                        prev = rebuild_exact(s_tile, decay_total, u_rows, k_rows, g_smem, pos)
                    else:
                        if xla_side:  # the key records, which only this flush reads, into the CTA's buffer
                            plgpu.copy_gmem_to_smem(kcache_ref.at[slot, h // group_size], k_smem, group_barrier[0])
                            plgpu.barrier_wait(group_barrier[0])
                        prev = rebuild_tensor_cores(s_tile, decay_total, u_t, weights, k_smem, pos, operands)
                    new = alpha * prev + bcast_rows(u, prev.shape) * bcast_cols(k_col, prev.shape)
                    store_tile(t_smem, ckpt_ref, new, slot, h, rows)
                    prefetch()

            with jax.named_scope("store"):
                # After the tile's store: the persistent loop leaves only the newest store in flight.
                store_output(o_smem, y_ref, s_q + u * k_dot_q, b, h, rows)

                @pl.when(mode == MODE_APPEND)
                def _append():
                    append_entry(ucache_ref, kcache_ref, gcache_ref, slot, h, tile, pos, u, k_col, g,
                                 group_size=group_size)

    serve_tiles(batch, num_heads, tiles, num_programs, issue, compute, group_size=group_size, chunk=chunk,
                issue_group=issue_group if grouped else None, warpgroups=warpgroups, row_order=order_ref)


def _scratch(head_k_dim, cache_len, state_dtype, cache_dtype, qk_dtype, v_dtype, swizzle, rebuild, stages,
             readout="fma", grouped=False, xla_side=False, own_operands=False, mma_side=False,
             operands_in_tile=False) -> list:
    """`[stages, group keys, shared, rebuild buffers, barriers, group barrier, rows
    barrier]`: `stages` sets of the replay buffers (the key records among them `[k]` unless
    `grouped`, else `[]`), the token's (`copy_token`) and, for the "mma" readout, `[x]` the
    box of q, k pairs `[8, d_k]` (swizzled: the `wgmma` operand, `vector_pairs`); if `grouped`,
    `[k]` the key records of the CTA's current key head (a pipeline group copy: only fresh
    tiles and flushes read them) and `[barrier]` for their copy (else `[]`, `[]`); the
    key-head group's shared values (`[values]`, `store_key_side`, `[3, L]` fp32; with
    `mma_side`, `[values, products]`, `ring_products`' `[BV, L]` fp32), the exact rebuild's
    untiled record copies, one barrier per stage and one for the record copies.
    Tensor-core rebuilds keep their `wgmma` operands (K-major: `U^T diag(W)` `[BV, L]` and
    `K^T` `[d_k, L]`, hi and lo parts for "3xtf32") in a union with each stage's
    checkpoint-tile buffer instead, or, with `own_operands` (several warpgroups, which cannot
    share a union of unequal members), in the rebuild buffers' place, unless
    `operands_in_tile` stacks them into one buffer of the tile's bytes in the tile's union
    (`rebuild.stacked_operands`). With the key side from XLA (`xla_side`), each stage
    takes `[side]` (`[3, L]` fp32, `key_side_values`) in place of the key records, which a
    tensor-core rebuild copies into one buffer per CTA (the group keys') when it flushes."""
    own_operands = own_operands and not operands_in_tile  # stacked in the tile's union instead

    def stage():
        tile, u, keys, g, y = replay_scratch(BLOCK_V, head_k_dim, cache_len, state_dtype, cache_dtype, (BLOCK_V,),
                                             v_dtype, swizzle)
        if operands_in_tile:
            tile = plgpu.RefUnion(tile, stacked_operands(tile, BLOCK_V, head_k_dim, cache_len, rebuild, cache_dtype))
        elif not own_operands:
            tile = tile_with_operands(tile, BLOCK_V, head_k_dim, cache_len, rebuild, cache_dtype)
        vectors = ([plgpu.SMEM((vector_rows(DECODE_VECTORS), head_k_dim), qk_dtype, transforms=tiled(128, qk_dtype))]
                   if readout == "mma" else [])
        side = [plgpu.SMEM((3, cache_len), F32)] if xla_side else []
        return [tile, u, g, y, plgpu.SMEM((4, head_k_dim), qk_dtype), plgpu.SMEM((BLOCK_V,), v_dtype),
                [] if grouped or xla_side else [keys], vectors, side]

    tile, _, keys, _, _ = replay_scratch(BLOCK_V, head_k_dim, cache_len, state_dtype, cache_dtype, (BLOCK_V,),
                                         v_dtype, swizzle)
    per_stage = [stage() for _ in range(stages)]
    rebuild_bufs = (record_copies(BLOCK_V, head_k_dim, cache_len, cache_dtype) if rebuild == "exact"
                    else rebuild_operands(tile, BLOCK_V, head_k_dim, cache_len, rebuild, cache_dtype) if own_operands
                    else [])
    one_keys = grouped or xla_side and rebuild != "exact"  # one buffer per CTA for the key records
    copies = 8 + (not grouped) + (readout == "mma")  # with xla_side: the side in place of the records
    shared = [plgpu.SMEM((3, cache_len), F32)] + ([plgpu.SMEM((BLOCK_V, cache_len), F32)] if mma_side else [])
    return [per_stage, [keys] if one_keys else [], shared, rebuild_bufs,
            plgpu.Barrier(num_arrivals=copies, num_barriers=stages),
            [plgpu.Barrier(num_arrivals=1)] if one_keys else [], plgpu.Barrier(num_arrivals=2)]



def persistent_programs(batch: int, num_v_heads: int, head_v_dim: int, head_k_dim: int, cache_len: int,
                        state_dtype, cache_dtype, token_dtype, sm_count: int, *, swizzle: int = 128,
                        rebuild: str = "exact", readout: str = "fma", key_side: str = "kernel", scratch_of=None,
                        max_ctas: int | None = RESIDENT_CTAS, warpgroups: int = 1,
                        operands_in_tile: bool = False) -> int:
    """`MosaicReplayParams.programs` for a device of `sm_count` SMs: as many persistent CTAs
    per SM as the two-stage buffers fit in shared memory, at most `max_ctas` (`token_dtype`:
    q, k and v's; the key records grouped where that fits more, `group_records=None`, unless
    `key_side="xla"`), times `warpgroups` (GDN: a CTA of w > 1 warpgroups holds w programs'
    buffers and, its threads taking up to 65,536 / (128 w) registers each, is the one CTA
    resident per SM; 0 where its buffers do not fit; `operands_in_tile` as
    `MosaicReplayParams`'). `scratch_of`: the kernel's scratch
    builder, this module's by default (the KDA kernel's takes the same arguments but
    `readout`, `key_side` and `grouped`)."""
    args = (head_k_dim, cache_len, state_dtype, cache_dtype, token_dtype, token_dtype, swizzle, rebuild, STAGES)
    xla_side = key_side == "xla"
    scratch = (scratch_of(*args) if scratch_of
               else _scratch(*args, readout, grouped=not xla_side, xla_side=xla_side, own_operands=warpgroups > 1,
                             mma_side=key_side == "mma", operands_in_tile=operands_in_tile))
    cta_scratch, _ = kernel_scratch(scratch, per_tile=False, warpgroups=warpgroups)
    return programs_that_fit(smem_bytes(cta_scratch), sm_count, batch * num_v_heads * (head_v_dim // BLOCK_V),
                             max_ctas, warpgroups)


@functools.lru_cache(maxsize=None)
def _build(batch, num_v_heads, head_v_dim, head_k_dim, cache_len, state_dtype, cache_dtype, qk_dtype, y_dtype,
           group_size, use_qk_l2norm, scale, raw_gates, swizzle, rebuild, programs, auto_barriers, readout,
           group_records, chunk, key_side, per_tile_addresses, warpgroups, ordered, operands_in_tile, interpret):
    tiles = head_v_dim // BLOCK_V
    num_tiles = batch * num_v_heads * tiles
    warpgroups = min(warpgroups, num_tiles)  # every program serves at least one tile
    operands_in_tile = operands_in_tile and warpgroups > 1
    xla_side = key_side == "xla"
    scratch_of = functools.partial(_scratch, head_k_dim, cache_len, state_dtype, cache_dtype, qk_dtype, y_dtype,
                                   swizzle, rebuild, STAGES if programs else 1, readout, xla_side=xla_side,
                                   own_operands=warpgroups > 1, mma_side=key_side == "mma",
                                   operands_in_tile=operands_in_tile)
    grouped = (not xla_side and group_records if group_records is not None
               else not xla_side and bool(programs) and grouped_fits_more(scratch_of))
    program_scratch = scratch_of(grouped)
    scratch, view = kernel_scratch(program_scratch, per_tile=per_tile_addresses, warpgroups=warpgroups)
    check_smem(scratch, f"replay_decode_mgpu at cache_len = {cache_len}, d_k = {head_k_dim}"
               + (f", {warpgroups} warpgroups" if warpgroups > 1 else ""))
    num_programs = min(programs, num_tiles) // warpgroups * warpgroups
    body = functools.partial(_kernel, group_size=group_size, tiles=tiles, use_qk_l2norm=use_qk_l2norm,
                             scale=scale, raw_gates=raw_gates, rebuild=rebuild, num_programs=num_programs,
                             chunk=chunk, readout=readout, parts=tile_parts(state_dtype), grouped=grouped,
                             xla_side=xla_side, mma_side=key_side == "mma", program_scratch=view,
                             per_tile=per_tile_addresses, warpgroups=warpgroups, ordered=ordered,
                             operands_in_tile=operands_in_tile, interpret=interpret)
    return build_kernel(body, jax.ShapeDtypeStruct((batch, num_v_heads, head_v_dim), y_dtype), scratch,
                        tile_grid(batch, num_v_heads, tiles, num_programs, warpgroups),
                        name="replayssm_replay_decode_mgpu", interpret=interpret, auto_barriers=auto_barriers)


def replay_decode_mgpu(
    checkpoint: Float[Array, "N Hv Dv Dk"],
    u_cache: Float[Array, "N Hv L Dv"],
    k_cache: Float[Array, "N Hk L Dk"],
    g_cache: Float[Array, "N Hv L"],
    q: Float[Array, "B Hk Dk"],
    k: Float[Array, "B Hk Dk"],
    v: Float[Array, "B Hv Dv"],
    g: Float[Array, "B Hv"],
    beta: Float[Array, "B Hv"],
    slot: Int[Array, " B"],
    pos: Int[Array, " B"],
    mode: Int[Array, " B"],
    *,
    use_qk_l2norm: bool = False,
    scale: float | None = None,
    gate_params: tuple[Array, Array] | None = None,
    params: MosaicReplayParams = MosaicReplayParams(),
    row_order: Int[Array, " B"] | None = None,
    interpret: bool | None = None,
):
    """One fused ReplaySSM decode step of one GDN layer on Mosaic GPU.

    Args and returns as `pallas_kernels.replay_decode.replay_decode` (GDN only: g and beta
    `[B, H_v]`): `(y [B, H_v, d_v] in v's dtype, checkpoint, u_cache, k_cache, g_cache)`,
    the state arrays updated in place when the caller donates them.
    `row_order`: the order rows are served in, given iff `params.launch_order`.
    `interpret`: run in Mosaic GPU interpret mode (default: off GPU).
    """
    batch, num_v_heads, head_v_dim = v.shape
    head_k_dim = q.shape[-1]
    cache_len = u_cache.shape[2]
    if g_cache.ndim != 3:
        raise ValueError(f"replay_decode_mgpu takes a per-head (GDN) decay, g_cache [N, H_v, L]; got shape "
                         f"{g_cache.shape} (per-channel decay: replay_decode_kda.replay_decode_kda_mgpu)")
    check_shapes(head_k_dim, head_v_dim, cache_len, checkpoint.dtype.itemsize, params.swizzle)
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    check_rebuild(params.rebuild, cache_len, interpret)
    check_mma_readout(params, q.dtype, "replay_decode_mgpu")
    check_mma_key_side(params, q.dtype, k_cache.dtype, "replay_decode_mgpu")
    check_no_window(params, "replay_decode_mgpu")
    order = launch_order_input(params, row_order, batch, "replay_decode_mgpu")
    a_log, dt_bias = gate_params if gate_params is not None else (jnp.zeros((1,), F32),) * 2
    kernel = _build(
        batch, num_v_heads, head_v_dim, head_k_dim, cache_len, checkpoint.dtype, u_cache.dtype, q.dtype, v.dtype,
        num_v_heads // q.shape[1], bool(use_qk_l2norm), float(head_k_dim ** -0.5 if scale is None else scale),
        gate_params is not None, params.swizzle, params.rebuild, params.programs, params.auto_barriers,
        params.readout, params.group_records, params.chunk, params.key_side, params.per_tile_addresses,
        params.warpgroups, bool(order), params.operands_in_tile, bool(interpret),
    )
    k = k.astype(q.dtype)
    vectors = xla_side_inputs(q, k, k_cache, slot, params=params, use_qk_l2norm=bool(use_qk_l2norm), scale=scale)
    refs = [jax.new_ref(x) for x in (checkpoint, u_cache, k_cache, g_cache)]
    y = kernel(slot.astype(jnp.int32), pos.astype(jnp.int32), mode.astype(jnp.int32), q, k, v, g, beta,
               a_log, dt_bias, *order, *vectors, *refs)
    return (y, *(jax.freeze(r) for r in refs))
