"""Fused Mamba-2 ReplaySSM decode step on Mosaic GPU (`plgpu.kernel`), one launch per step.

Per head h (H heads, head dim P, state size N, G groups; head h uses group h // (H/G)):
`dt = clip(softplus(dt_raw + dt_bias_h))`, `S_t = exp(A_h dt) S_{t-1} + dt x B^T` (`S [P, N]`),
`y = S_t C + D_h x`, times `silu(z)` when z is given (as `pallas_kernels.mamba2_decode`).

Grid `(B, H * P / BP)`, one warpgroup (128 threads) per CTA, BP = 64: CTA (b, h, t)
serves state rows `t*BP .. t*BP + BP - 1` of head h of row b, whose slot, cursor `pos`
and mode (padding / append / flush) it reads from `[B]` arrays; or, with
`MosaicMamba2Params.programs = n`, n persistent CTAs serve chunks of the tiles dealt round robin
(`pipeline.persistent_tiles`); the tiles of a chunk belong to one B/C group, and what they
share (`group_side`: `B_j . C`, `B . C`) is computed on the chunk's first tile and read back
from shared memory by the rest (`pipeline.group_shared`).

Data movement (TMA, one barrier per stage): the checkpoint tile `S_c [BP, N]`, the slot's
x records `[L, BP]` of this tile and its B records `[L, N]` (group h // (H/G)), all
swizzled, its time steps dt `[L]`, and the token (`copy_token`: B, C and C again `[3, N]`,
this tile's rows of x and z `[2, BP]`) land in shared memory, so a persistent CTA has the
next tile's token with its state. Where that fits more CTAs per SM
(`MosaicMamba2Params.group_records`: fp32 rings of 32), the B records, which only a
group's fresh tile and flush rows read, go to one buffer per CTA instead, copied for each
fresh tile (`pipeline` group copies). The exact rebuild fetches a second, untiled copy of
the records; everything else is registers. C is never cached; with `readout="mma"` the
raw C is staged by XLA as a `wgmma` operand (`readout.stage_vectors`).

Layouts (Hopper WGMMA family, `m % 64 == 0 == n % 8`):
- `S_c` in `WGMMA` `[BP, N]`; `S_c C` is a row reduction into `ROW = WGMMA.reduce(1)`
  `[BP]`, with C broadcast from `COL = WGMMA.reduce(0)` `[N]`.
- B records read transposed, `B^T [N, L]` (`WGMMA_TRANSPOSED` load, cast to `WGMMA`):
  `B_j . C` for every j is a column reduction into `COL [L]`, C broadcast from `ROW [N]`
  (C comes in twice, once per layout: layout inference gives one ref one layout).
- x records read transposed, `X^T [BP, L]`: `X^T (w * (B C))` is a row reduction into
  `ROW [BP]`, the layout of `S_c C` and of this token's x, so the parts add as they are.
- weights `w_j = dt_j exp(A sum_{j<i<pos} dt_i)` `COL [L]`: suffix sums of the valid
  entries' time steps, newest first (scalars read from shared memory), exponentiated as
  one vector.

Step math (method note §14): with the live state
`S_{t-1} = e^{A Gamma} S_c + sum_{j<pos} w_j x_j B_j^T` (Gamma the sum of the valid dt),
`y = exp(A dt) (e^{A Gamma} S_c C + X^T (w * (B C))) + dt (B . C) x + D x`, never forming
`S_{t-1}`. Entries at and past `pos` are masked with selects before any sum over entries,
so a stale record (NaN included) cannot reach an output.

Append rows store x at `pos` (each tile its rows; dt from tile 0; B from tile 0 of the
first head of each group). Flush rows rebuild `S_{t-1}` from the `S_c` tile already in
registers, in exact fp32 on CUDA cores (one fused multiply-add per element and entry,
newest entry first with a running decay), or with `MosaicMamba2Params.rebuild` on tensor
cores as `e^{A Gamma} S_c + (X^T diag(w)) B` (`rebuild.rebuild_mma`, operands in a union with
the stage's tile buffer), and store `S_t = exp(A dt) S_{t-1} + dt x B^T` in place through
shared memory and TMA; the checkpoint is read from memory once per step, flush or not.
Padding rows write y = 0 and nothing else.

The state arrays are mutable refs (`jax.new_ref`): under a donated `jit` the kernel
updates them in place.
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

from pallas_kernels.common import MODE_APPEND, MODE_FLUSH, MODE_PAD
from pallas_kernels.mosaic_gpu.build import build_kernel, check_no_window, check_shared_params
from pallas_kernels.mosaic_gpu.layouts import (BLOCK_ROWS, COL, F32, ROW, WGMMA, bcast_cols, bcast_rows, col_sum,
                                               check_smem, copy_record_rows, load_transposed,
                                               record_copies, replay_scratch, row_sum, smem_bytes, softplus, tiled)
from pallas_kernels.mosaic_gpu.pipeline import (STAGES, group_shared, grouped_fits_more, launch_order_input,
                                                programs_that_fit, serve_tiles, tile_grid)
from pallas_kernels.mosaic_gpu.readout import (buffer_products, column, stage_vectors, tile_parts, tile_products,
                                               vector_rows)
from pallas_kernels.mosaic_gpu.rebuild import (check_rebuild, rebuild_mma, split_tile_buffer,
                                               tile_with_operands)

BLOCK_P = BLOCK_ROWS
# Persistent CTAs resident per SM at most (`pipeline.ctas_per_sm`), from timing: with a bf16
# state three per SM ran faster than two on the H200, i.e. three are resident (four not
# measured; the GDN kernel's registers allow two). NOTES: "resident CTAs: registers, not
# shared memory". A caller may ask for fewer (`persistent_programs(max_ctas=...)`).
RESIDENT_CTAS = 3


@dataclasses.dataclass(frozen=True)
class MosaicMamba2Params:
    """Launch parameters of `mamba2_replay_decode_mgpu`.

    Attributes:
      swizzle: shared-memory swizzle of the checkpoint tile in bytes (32, 64 or 128).
      rebuild: how flush rows rebuild `S_{t-1} = e^{A Gamma} S_c + X^T diag(w) B`: "exact"
        (default) in fp32 on CUDA cores; "3xtf32", "tf32" or "bf16" on tensor cores, as
        `MosaicReplayParams.rebuild` (`rebuild.py`); the backend's `default_params` takes
        "3xtf32" on a GPU where it costs no CTAs per SM.
      programs: 0 (default) launches one CTA per tile (grid `(B, H P / 64)`); n > 0
        launches n persistent CTAs (at most one per tile), each walking chunks of tiles
        dealt round robin, the next tile's copies in flight (`pipeline.persistent_tiles`).
      auto_barriers: as `MosaicReplayParams.auto_barriers`.
      chunk: tiles per chunk of a persistent CTA; 0 (default) one head group's tiles (the
        heads sharing B and C, whose `B_j . C` a CTA sums once per chunk), at most
        `pipeline.MAX_CHUNK`. Longer chunks share more and balance rows that flush (twice
        the work) worse over the CTAs when cursors are staggered.
      readout: `S_c C` as a row reduction on CUDA cores ("fma", default) or as a `wgmma`
        against the raw bf16 C ("mma", as `MosaicReplayParams.readout`: a bf16 tile read
        from its shared-memory buffer, an fp32 one split into three exact bf16 parts in
        registers); it needs bf16 B and C. The verify kernel reads out with "fma".
      group_records: whether the B records `[L, N]` are copied once per group of tiles
        into one buffer per CTA (True) or with every tile into its stage (False); None
        (default): grouped where that fits more persistent CTAs per SM in shared memory
        (`pipeline.grouped_fits_more`: fp32 rings of 32), as `MosaicReplayParams`.
      launch_order: serve the rows in the caller's `row_order` (the backend's plan's launch
        order), as `MosaicReplayParams.launch_order`; the Mamba-2 verify kernel (one CTA per
        tile) refuses it.
      window_side: where the verify kernel's window scalars (`M`, `e^{A Gamma}`, the gated
        dt) are formed before its launch: "xla" (default) by XLA, in several small kernels;
        "kernel" by `pallas_kernels.verify_coefficients.mamba2_verify_coefficients`, one
        Pallas Triton launch (N a power of two). The decode kernels refuse "kernel".
    """

    swizzle: int = 128
    programs: int = 0
    auto_barriers: bool = True
    chunk: int = 0
    rebuild: str = "exact"
    readout: str = "fma"
    group_records: bool | None = None
    launch_order: bool = False
    window_side: str = "xla"

    def __post_init__(self) -> None:
        check_shared_params(self)


def _scratch(state_size, cache_len, state_dtype, cache_dtype, bc_dtype, xz_dtype, y_dtype, swizzle, stages=1,
             has_z=True, rebuild="exact", readout="fma", grouped=False) -> list:
    """`[stages, group B records, shared, record copies, barriers, group barrier, rows
    barrier]`: `stages` sets of a `[64, N]` state tile's replay buffers (the tile in a
    union with a tensor-core rebuild's operands, `rebuild.tile_with_operands`; the B
    records among them `[b]` unless `grouped`, else `[]`), its token's (`bc_smem [3, N]`,
    `xz_smem [2, BP]`) and, for the "mma" readout, `[c]` the raw C `[8, N]` (swizzled: the
    `wgmma` operand, `stage_vectors`); if `grouped`, `[b]` the B records of the CTA's
    current group (a pipeline group copy: only fresh tiles and flushes read them) and
    `[barrier]` for their copy (else `[]`, `[]`); the head group's shared values
    (`store_group_side`, `[2, L]` fp32), the exact rebuild's untiled record copies, a
    barrier per stage (the tile's copies and the token's, `copy_token`) and one for the
    record copies."""
    def stage():
        tile, x, _, dts, y = replay_scratch(BLOCK_P, state_size, cache_len, state_dtype, cache_dtype, (BLOCK_P,),
                                            y_dtype, swizzle)
        tile = tile_with_operands(tile, BLOCK_P, state_size, cache_len, rebuild, cache_dtype)
        vectors = ([plgpu.SMEM((vector_rows(1), state_size), bc_dtype, transforms=tiled(128, bc_dtype))]
                   if readout == "mma" else [])
        return [tile, x, dts, y, plgpu.SMEM((3, state_size), bc_dtype), plgpu.SMEM((2, BLOCK_P), xz_dtype),
                [] if grouped else [b_records], vectors]

    b_records = replay_scratch(BLOCK_P, state_size, cache_len, state_dtype, cache_dtype, (BLOCK_P,), y_dtype,
                               swizzle)[2]
    copies = record_copies(BLOCK_P, state_size, cache_len, cache_dtype) if rebuild == "exact" else []
    tma_copies = 3 + (not grouped) + token_copies(has_z) + (readout == "mma")
    return [[stage() for _ in range(stages)], [b_records] if grouped else [], plgpu.SMEM((2, cache_len), F32), copies,
            plgpu.Barrier(num_arrivals=tma_copies, num_barriers=stages),
            [plgpu.Barrier(num_arrivals=1)] if grouped else [], plgpu.Barrier(num_arrivals=2)]


def token_copies(has_z: bool) -> int:
    """TMA copies of one tile's token: B, C twice, x, and z when given."""
    return 5 if has_z else 4


def copy_token(token_refs, bufs, b, h, grp, rows, barrier, *, has_z) -> None:
    """Start the TMA copies of row b's token for one tile (`token_copies` arrivals on
    `barrier`): B and C of group grp, C again (`bc_smem [3, N]` rows: one copy per vector
    layout), and the tile's rows of x and z of head h (`xz_smem [2, BP]`), from
    `token_refs = (x, B, C, z)`."""
    x_ref, b_ref, c_ref, z_ref = token_refs
    bc_smem, xz_smem = bufs
    for i, ref in enumerate((b_ref, c_ref, c_ref)):
        plgpu.copy_gmem_to_smem(ref.at[b, grp], bc_smem.at[i], barrier)
    plgpu.copy_gmem_to_smem(x_ref.at[b, h, rows], xz_smem.at[0], barrier)
    if has_z:
        plgpu.copy_gmem_to_smem(z_ref.at[b, h, rows], xz_smem.at[1], barrier)


def group_side(bc_smem, b_smem):
    """What every tile of a head group (one row, one B/C group) shares: `(B_j . C` `[L]`
    (COL) for every ring entry (stale entries included: each tile masks them), `B . C)`.
    `bc_smem [3, N]`: the token's B, C, C (`copy_token`)."""
    b_col, c_col = (plgpu.load(bc_smem.at[i], layout=COL, optimized=False).astype(F32) for i in (0, 1))
    c_row = plgpu.load(bc_smem.at[2], layout=ROW, optimized=False).astype(F32)
    b_t = load_transposed(b_smem)  # [N, L]
    return col_sum(b_t * bcast_rows(c_row, b_t.shape)), jnp.sum(b_col * c_col)


def store_group_side(shared_smem, values) -> None:
    """`group_side`'s values into `shared_smem [2, L]`: row 0, and row 1's first entry."""
    shared_smem[0], shared_smem[1, 0] = values


def load_group_side(shared_smem):
    """`group_side`'s values back from `shared_smem` (`store_group_side`)."""
    return plgpu.load(shared_smem.at[0], layout=COL, optimized=False), shared_smem[1, 0]


def xla_side_inputs(C: Float[Array, "B G N"], *, params: MosaicMamba2Params) -> list[Array]:
    """The inputs XLA computes before the launch: for the "mma" readout the raw C staged as
    its operand (`stage_vectors`, `[B, G, 8, N]`); none by default. Part of a step's time."""
    return [stage_vectors(C[:, None])] if params.readout == "mma" else []


def check_shapes(head_dim: int, state_size: int, cache_len: int, state_itemsize: int, cache_itemsize: int,
                 y_itemsize: int = 4, swizzle: int = 128) -> None:
    """Raise ValueError unless the shapes (P, N, L and the itemsizes) fit the kernel."""
    if head_dim % BLOCK_P:
        raise ValueError(f"mosaic_gpu needs the Mamba-2 head dim P a multiple of {BLOCK_P}, got P = {head_dim}")
    if state_size % 64:
        raise ValueError(f"mosaic_gpu needs the Mamba-2 state size N a multiple of 64, got N = {state_size}")
    if (state_size * state_itemsize) % swizzle:
        raise ValueError(f"an N = {state_size} state row is not a multiple of the {swizzle}-byte swizzle")
    if cache_len % 8 or cache_len < 8:
        raise ValueError(f"mosaic_gpu needs cache_len a multiple of 8 (at least 8), got {cache_len}")
    as_dtype = lambda itemsize: jnp.dtype(f"float{8 * itemsize}")  # only the sizes matter here
    check_smem(_scratch(state_size, cache_len, as_dtype(state_itemsize), as_dtype(cache_itemsize),
                        as_dtype(y_itemsize), as_dtype(y_itemsize), as_dtype(y_itemsize), swizzle),
               f"the Mamba-2 kernel at cache_len = {cache_len}, N = {state_size}")


def _time_step(dt_raw, dt_bias, dt_softplus, dt_limit):
    """`clip(softplus(dt_raw + dt_bias))` (scalars), the gating of the Triton kernels."""
    dt = dt_raw + dt_bias
    if dt_softplus:
        dt = softplus(dt)
    lo, hi = dt_limit
    if (lo, hi) != (0.0, float("inf")):
        dt = jnp.minimum(jnp.maximum(dt, lo), hi)
    return dt


def window_weights(dt_smem, a, pos, cache_len):
    """`(w [L] in COL, e^{A Gamma})`: `w_j = dt_j exp(A sum_{j<i<pos} dt_i)` for j < pos, 0 past it.

    The valid entries' time steps are summed newest first as scalars (unrolled over the
    ring; an entry at or past `pos` adds 0 through a select, so a stale dt, NaN included,
    is never used), and the suffix sums exponentiated as one vector: the chain of
    dependent operations is L additions, not L exponentials."""
    j = plgpu.broadcasted_iota(jnp.int32, (cache_len,), 0, layout=COL)
    zeros = plgpu.layout_cast(jnp.zeros((cache_len,), F32), COL)
    suffix, dts = zeros, zeros
    total = jnp.float32(0.0)
    for i in reversed(range(cache_len)):
        dt_i = jnp.where(i < pos, dt_smem[i], 0.0)
        suffix = jnp.where(j == i, total, suffix)
        dts = jnp.where(j == i, dt_i, dts)
        total = total + dt_i
    return jnp.where(j < pos, dts * jnp.exp(a * suffix), 0.0), jnp.exp(a * total)


def rebuild_exact(s_c, decay_total, x_smem, b_smem, dt_smem, a, pos):
    """`S_{t-1} = e^{A Gamma} S_c + sum_j w_j x_j B_j^T` in fp32, newest entry first with a
    running decay."""

    def body(i, carry):
        state, running = carry
        j = pos - 1 - i
        dt_j = dt_smem[j]
        x_j = plgpu.load(x_smem.at[j], layout=ROW, optimized=False).astype(F32)
        b_j = plgpu.load(b_smem.at[j], layout=COL, optimized=False).astype(F32)
        state = state + bcast_rows((dt_j * running) * x_j, state.shape) * bcast_cols(b_j, state.shape)
        return state, running * jnp.exp(a * dt_j)

    state, _ = lax.fori_loop(0, pos, body, (s_c * decay_total, jnp.float32(1.0)))
    return state


def _kernel(slot_ref, pos_ref, mode_ref, x_ref, b_ref, c_ref, dt_ref, z_ref, a_ref, d_ref, dt_bias_ref, *refs,
            group_size, tiles, dt_softplus, dt_limit, has_z, num_programs, chunk, rebuild, readout, parts, grouped,
            ordered, interpret):
    # Inputs, the row order and the raw C staged for the "mma" readout first; outputs; scratch.
    order_ref, *refs = refs if ordered else (None, *refs)
    cv_ref, *refs = refs if readout == "mma" else (None, *refs)
    (ckpt_ref, xcache_ref, bcache_ref, dtcache_ref, y_ref,
     stages, group_b, shared_smem, record_bufs, barriers, group_barrier, rows_barrier) = refs

    def issue(b, h, tile, stage):
        """Start the tile's copies into `stages[stage]` (none for padding rows)."""
        tile_buf, x_smem, dt_smem, _, bc_smem, xz_smem, stage_b, c_smem = stages[stage]
        t_smem, _ = split_tile_buffer(tile_buf, rebuild)
        barrier, slot, rows = barriers.at[stage], slot_ref[b], pl.ds(tile * BLOCK_P, BLOCK_P)

        @pl.when(mode_ref[b] != MODE_PAD)
        def _copies():
            plgpu.copy_gmem_to_smem(ckpt_ref.at[slot, h, rows], t_smem, barrier)
            plgpu.copy_gmem_to_smem(xcache_ref.at[slot, h, :, rows], x_smem, barrier)
            plgpu.copy_gmem_to_smem(dtcache_ref.at[slot, h], dt_smem, barrier)
            if not grouped:
                plgpu.copy_gmem_to_smem(bcache_ref.at[slot, h // group_size], stage_b[0], barrier)
            copy_token((x_ref, b_ref, c_ref, z_ref), (bc_smem, xz_smem), b, h, h // group_size, rows, barrier,
                       has_z=has_z)
            if readout == "mma":
                plgpu.copy_gmem_to_smem(cv_ref.at[b, h // group_size], c_smem[0], barrier)

    def issue_group(b, h, tile):
        """Start the copy of the B records, which only a fresh tile (and a flush) reads."""
        @pl.when(mode_ref[b] != MODE_PAD)
        def _copy():
            plgpu.copy_gmem_to_smem(bcache_ref.at[slot_ref[b], h // group_size], group_b[0], group_barrier[0])

    def compute(b, h, tile, stage, fresh, prefetch=lambda: None):
        tile_buf, x_smem, dt_smem, o_smem, bc_smem, xz_smem, stage_b, c_smem = stages[stage]
        b_smem = group_b[0] if grouped else stage_b[0]
        barrier = barriers.at[stage]
        t_smem, operands = split_tile_buffer(tile_buf, rebuild)
        grp = h // group_size
        rows = pl.ds(tile * BLOCK_P, BLOCK_P)
        mode = mode_ref[b]
        cache_len = x_smem.shape[0]

        @pl.when(mode == MODE_PAD)
        def _padding_row():
            prefetch()
            o_smem[...] = plgpu.layout_cast(jnp.zeros((BLOCK_P,), o_smem.dtype), ROW)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(o_smem, y_ref.at[b, h, rows])

        @pl.when(mode != MODE_PAD)
        def _live_row():
            slot, pos = slot_ref[b], pos_ref[b]
            # The gates as scalars, while the copies fly.
            dt = _time_step(dt_ref[b, h].astype(F32), dt_bias_ref[h].astype(F32), dt_softplus, dt_limit)
            a, d = a_ref[h].astype(F32), d_ref[h].astype(F32)
            alpha = jnp.exp(a * dt)

            with jax.named_scope("wait"):
                plgpu.barrier_wait(barrier)
            # The token: B and C in COL (C again in ROW for the group's `B_j . C`, a second
            # copy: layout inference gives one ref one layout), x and z on this tile's rows.
            def fresh_group_side():
                if grouped:
                    plgpu.barrier_wait(group_barrier[0])
                return group_side(bc_smem, b_smem)

            with jax.named_scope("key_side"):
                b_dot_c_records, b_dot_c = group_shared(  # B_j . C [L], B . C
                    fresh, fresh_group_side, functools.partial(store_group_side, shared_smem),
                    functools.partial(load_group_side, shared_smem))
            # The next group's B records may replace these now, unless this row flushes: a
            # flush reads them again (all tiles of a group are one row's, one mode).
            pl.when(mode != MODE_FLUSH)(prefetch)
            with jax.named_scope("records"):
                b_col = plgpu.load(bc_smem.at[0], layout=COL, optimized=False).astype(F32)
                x_row = plgpu.load(xz_smem.at[0], layout=ROW, optimized=False).astype(F32)
                weights, decay_total = window_weights(dt_smem, a, pos, cache_len)
                j = plgpu.broadcasted_iota(jnp.int32, (BLOCK_P, cache_len), 1, layout=WGMMA)
                x_t = jnp.where(j < pos, load_transposed(x_smem), 0.0)  # [BP, L], stale entries 0
                valid = plgpu.broadcasted_iota(jnp.int32, (cache_len,), 0, layout=COL) < pos
            with jax.named_scope("readout"):
                load_tile = lambda: plgpu.load(t_smem, layout=WGMMA).astype(F32)  # [BP, N]
                if readout == "mma":
                    # `S_c C` as one product; a bf16 tile straight from its buffer, so a
                    # non-flush row never holds it in registers.
                    s_c = None if parts == 1 else load_tile()
                    products = (buffer_products(t_smem, c_smem[0], interpret=interpret) if s_c is None
                                else tile_products(s_c, c_smem[0], parts, interpret=interpret))
                    tile_c = column(products, 0)
                else:
                    s_c = load_tile()
                    c_col = plgpu.load(bc_smem.at[1], layout=COL, optimized=False).astype(F32)
                    tile_c = row_sum(s_c * bcast_cols(c_col, s_c.shape))

                coef = jnp.where(valid, b_dot_c_records * weights, 0.0)
                prev_readout = decay_total * tile_c + row_sum(x_t * bcast_cols(coef, x_t.shape))  # S_{t-1} C, [BP]
                y = alpha * prev_readout + (dt * b_dot_c + d) * x_row
                if has_z:
                    z = plgpu.load(xz_smem.at[1], layout=ROW, optimized=False).astype(F32)
                    y = y * (z / (1.0 + jnp.exp(-z)))

            @pl.when(mode == MODE_FLUSH)
            def _flush():
                with jax.named_scope("flush"):
                    s_tile = load_tile() if s_c is None else s_c
                    if rebuild == "exact":
                        # The rebuild reads single records at a dynamic index, which the swizzled
                        # buffers cannot serve: flush rows fetch an untiled copy (L2-resident).
                        x_rows, b_rows = record_bufs
                        copy_record_rows((xcache_ref, bcache_ref), record_bufs, slot, h, grp, rows, rows_barrier)
                        plgpu.barrier_wait(rows_barrier)
                        prev = rebuild_exact(s_tile, decay_total, x_rows, b_rows, dt_smem, a, pos)
                    else:
                        b_t = load_transposed(b_smem)  # [N, L]
                        plgpu.commit_smem()  # every thread has S_c from the buffer its operands reuse
                        prev = rebuild_mma(s_tile * decay_total, x_t * bcast_cols(weights, x_t.shape), b_t, pos,
                                           operands)
                    new = alpha * prev + bcast_rows(dt * x_row, prev.shape) * bcast_cols(b_col, prev.shape)
                    plgpu.commit_smem()  # every thread's loads of the tile done before it is rewritten
                    t_smem[...] = new.astype(t_smem.dtype)
                    plgpu.commit_smem()
                    plgpu.copy_smem_to_gmem(t_smem, ckpt_ref.at[slot, h, rows])
                    prefetch()

            with jax.named_scope("store"):
                # After the tile's store: the persistent loop leaves only the newest store in flight.
                o_smem[...] = y.astype(o_smem.dtype)
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(o_smem, y_ref.at[b, h, rows])

                @pl.when(mode == MODE_APPEND)
                def _append():
                    xcache_ref[slot, h, pos, rows] = x_row.astype(xcache_ref.dtype)

                    @pl.when(tile == 0)
                    def _append_dt():
                        dtcache_ref[slot, h, pos] = dt

                    @pl.when((tile == 0) & (h % group_size == 0))
                    def _append_b():
                        bcache_ref[slot, grp, pos] = b_col.astype(bcache_ref.dtype)

    batch, heads = y_ref.shape[:2]
    serve_tiles(batch, heads, tiles, num_programs, issue, compute, group_size=group_size, chunk=chunk,
                issue_group=issue_group if grouped else None, row_order=order_ref)


def persistent_programs(batch: int, heads: int, head_dim: int, state_size: int, cache_len: int, state_dtype,
                        cache_dtype, token_dtype, sm_count: int, *, swizzle: int = 128, rebuild: str = "exact",
                        readout: str = "fma", max_ctas: int = RESIDENT_CTAS) -> int:
    """`MosaicMamba2Params.programs` for a device of `sm_count` SMs: as many persistent CTAs
    per SM as the two-stage buffers fit in shared memory, at most `max_ctas` (at most
    `RESIDENT_CTAS`; `token_dtype`: x, B, C, z and y's; the B records grouped where that fits
    more, `group_records=None`)."""
    if not 1 <= max_ctas <= RESIDENT_CTAS:
        raise ValueError(f"max_ctas must lie in [1, {RESIDENT_CTAS}], got {max_ctas}")
    scratch = _scratch(state_size, cache_len, state_dtype, cache_dtype, token_dtype, token_dtype, token_dtype,
                       swizzle, STAGES, rebuild=rebuild, readout=readout, grouped=True)
    return programs_that_fit(smem_bytes(scratch), sm_count, batch * heads * (head_dim // BLOCK_P), max_ctas)


@functools.lru_cache(maxsize=None)
def _build(batch, heads, head_dim, state_size, cache_len, state_dtype, cache_dtype, bc_dtype, xz_dtype, y_dtype,
           group_size, dt_softplus, dt_limit, has_z, swizzle, programs, auto_barriers, chunk, rebuild, readout,
           group_records, ordered, interpret):
    tiles = head_dim // BLOCK_P
    num_programs = min(programs, batch * heads * tiles)
    scratch_of = functools.partial(_scratch, state_size, cache_len, state_dtype, cache_dtype, bc_dtype, xz_dtype,
                                   y_dtype, swizzle, STAGES if programs else 1, has_z, rebuild, readout)
    grouped = group_records if group_records is not None else bool(programs) and grouped_fits_more(scratch_of)
    scratch = scratch_of(grouped)
    check_smem(scratch, f"the Mamba-2 kernel at cache_len = {cache_len}, N = {state_size}")
    body = functools.partial(_kernel, group_size=group_size, tiles=tiles, dt_softplus=dt_softplus,
                             dt_limit=dt_limit, has_z=has_z, num_programs=num_programs, chunk=chunk, rebuild=rebuild,
                             readout=readout, parts=tile_parts(state_dtype), grouped=grouped, ordered=ordered,
                             interpret=interpret)
    return build_kernel(body, jax.ShapeDtypeStruct((batch, heads, head_dim), y_dtype), scratch,
                        tile_grid(batch, heads, tiles, num_programs),
                        name="replayssm_mamba2_decode_mgpu", interpret=interpret, auto_barriers=auto_barriers)


def mamba2_replay_decode_mgpu(
    state: Float[Array, "N H P Ns"],
    x_cache: Float[Array, "N H L P"],
    b_cache: Float[Array, "N G L Ns"],
    dt_cache: Float[Array, "N H L"],
    x: Float[Array, "B H P"],
    B: Float[Array, "B G Ns"],
    C: Float[Array, "B G Ns"],
    dt: Float[Array, "B H"],
    A: Float[Array, " H"],
    D: Float[Array, " H"],
    dt_bias: Float[Array, " H"],
    slot: Int[Array, " B"],
    pos: Int[Array, " B"],
    mode: Int[Array, " B"],
    *,
    z: Float[Array, "B H P"] | None = None,
    dt_softplus: bool = True,
    dt_limit: tuple[float, float] = (0.0, float("inf")),
    params: MosaicMamba2Params = MosaicMamba2Params(),
    row_order: Int[Array, " B"] | None = None,
    interpret: bool | None = None,
):
    """One fused Mamba-2 ReplaySSM step on Mosaic GPU: `(y, state, x_cache, b_cache, dt_cache)`.

    Args and returns as `pallas_kernels.mamba2_decode.mamba2_replay_decode`: y `[B, H, P]`
    in x's dtype (0 on padding rows), the state arrays updated in place when the caller
    donates them. `params`: the checkpoint tile's swizzle, flush rebuild, persistent CTAs.
    `row_order`: the order rows are served in, given iff `params.launch_order`.
    `interpret`: run in Mosaic GPU interpret mode (default: off GPU).

    Raises:
      ValueError: on shapes the kernel cannot take (`check_shapes`), a dt_cache that is not
        float32, caches of two dtypes, a group count that does not divide H, or a
        tensor-core rebuild in interpret mode or with a ring it cannot take (`rebuild.check_rebuild`).
    """
    batch, heads, head_dim = x.shape
    num_groups, state_size = B.shape[1], B.shape[2]
    cache_len = x_cache.shape[2]
    if dt_cache.dtype != F32:
        raise ValueError(f"dt_cache must be float32 (dt after the softplus), got {dt_cache.dtype}")
    if b_cache.dtype != x_cache.dtype:
        raise ValueError(f"b_cache ({b_cache.dtype}) and x_cache ({x_cache.dtype}) must share one dtype")
    if heads % num_groups:
        raise ValueError(f"the head count H = {heads} must be a multiple of the group count G = {num_groups}")
    check_shapes(head_dim, state_size, cache_len, state.dtype.itemsize, x_cache.dtype.itemsize,
                 x.dtype.itemsize, params.swizzle)
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    check_rebuild(params.rebuild, cache_len, interpret)
    check_no_window(params, "mamba2_replay_decode_mgpu")
    # The token's shared buffers hold B and C in one dtype, x and z in another: promoted
    # (lossless) where the caller's differ.
    bc_dtype = jnp.result_type(B.dtype, C.dtype)
    xz_dtype = x.dtype if z is None else jnp.result_type(x.dtype, z.dtype)
    if params.readout == "mma" and bc_dtype != jnp.bfloat16:
        raise ValueError("mamba2_replay_decode_mgpu: readout='mma' multiplies the tile by the raw C on tensor cores: "
                         f"it needs bf16 B and C, got {bc_dtype}")
    order = launch_order_input(params, row_order, batch, "mamba2_replay_decode_mgpu")
    kernel = _build(
        batch, heads, head_dim, state_size, cache_len, state.dtype, x_cache.dtype, bc_dtype, xz_dtype, x.dtype,
        heads // num_groups, bool(dt_softplus), tuple(float(v) for v in dt_limit), z is not None, params.swizzle,
        params.programs, params.auto_barriers, params.chunk, params.rebuild, params.readout,
        params.group_records, bool(order), bool(interpret),
    )
    z = jnp.zeros((1,), xz_dtype) if z is None else z.astype(xz_dtype)
    refs = [jax.new_ref(a) for a in (state, x_cache, b_cache, dt_cache)]
    vectors = xla_side_inputs(C.astype(bc_dtype), params=params)
    y = kernel(slot.astype(jnp.int32), pos.astype(jnp.int32), mode.astype(jnp.int32), x.astype(xz_dtype),
               B.astype(bc_dtype), C.astype(bc_dtype), dt, z, A, D, dt_bias, *order, *vectors, *refs)
    return (y, *(jax.freeze(r) for r in refs))
