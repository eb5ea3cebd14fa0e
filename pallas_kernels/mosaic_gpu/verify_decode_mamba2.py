"""Speculative verify of a Mamba-2 draft window on Mosaic GPU (`plgpu.kernel`), one launch per step.

The GDN verify kernel's structure (`verify_decode.py`: grid `(B, H * P / BP)`, one
warpgroup per CTA, BP = 64, row modes, ragged lengths, tree windows through `anc`) with the
Mamba-2 decode kernel's readout of the history (`mamba2_decode.py`). CTA (b, h, t) serves
state rows `t*BP .. t*BP + BP - 1` of head h of row b for all T window positions.

Math (as `replayssm_jax.speculative`, gate "mamba2"; no delta-rule correction, so the
window is a masked sum). With S the row's live state before the window, dt after the
softplus and Gamma_i the sum of dt over position i's ancestors and i:

    y_i = e^{A Gamma_i} S C_i + sum_{j in anc(i) + {i}} M_ij x_j       (times silu(z_i) when z is given)
    M_ij = dt_j e^{A (Gamma_i - Gamma_j)} (B_j . C_i)  (+ D on the diagonal: the skip D x_i)

The `T x T` scalars M and the per-position `e^{A Gamma_i}` and dt_i come packed per (row,
head) from `mamba2_window_coefficients` in XLA (`verify_decode.pack_coefficients`, one
block) or, with `MosaicMamba2Params.window_side = "kernel"`, from one Pallas Triton launch
(`pallas_kernels.verify_coefficients.mamba2_verify_coefficients`, which also gates the raw
time steps and forms the rows); the kernel applies them to the window's x vectors.
`S C_i` is the decode kernel's readout without forming S: `e^{A Gamma_h} S_c C_i + X^T (w *
(B C_i))` over the row's `pos` valid cache entries (`mamba2_decode.window_weights`), the
checkpoint tile and the records read once for all T vectors C_i; entries at and past `pos`
are selected to 0 before any sum, so a stale record (NaN included) cannot reach an output.

Row modes as in the GDN kernel:
- `MODE_APPEND`: the window's records go to `pos .. pos + length - 1` (x: each tile its
  rows; dt: tile 0; B: tile 0 of each group's first head); the checkpoint is not written.
- `MODE_FLUSH` (the capacity rule folds the row): the live state is rebuilt on chip in
  exact fp32 (`mamba2_decode.rebuild_exact`), rounded to the checkpoint's dtype and stored
  in place; the window is read out from that stored value and its x records go to
  `0 .. length - 1`. Its B records are written by the wrapper after the launch
  (`verify_decode.append_records`): other heads' CTAs of the slot may still be reading
  the history they would overwrite; so are its dt records where a head has several tiles
  (P > 64); with one tile a head (P = 64) its CTA alone reads them, from its own copy, and
  writes them itself. It sets the row's cursor to 0 in place.
- `MODE_PAD`: y = 0, nothing written.
Window positions at and past `length` give y = 0 and no records; their inputs are replaced
by zeros before use (in XLA for the scalars, by selects for the vectors).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
from jaxtyping import Array, Bool, Float, Int

from pallas_kernels.common import MODE_APPEND, MODE_FLUSH, MODE_PAD, mamba2_time_step, verify_rows
from pallas_kernels.mosaic_gpu.build import build_kernel
from pallas_kernels.mosaic_gpu.layouts import (BLOCK_ROWS, COL, F32, ROW, WGMMA, bcast_cols, bcast_rows, col_sum,
                                               check_smem, copy_record_rows, copy_replay_tile, load_transposed,
                                               record_copies, replay_scratch, row_sum)
from pallas_kernels.mosaic_gpu.mamba2_decode import MosaicMamba2Params, check_shapes, rebuild_exact, window_weights
from pallas_kernels.mosaic_gpu.verify_decode import (MAX_WIDTH, append_records, check_params, check_rows,
                                                     coefficient_count, coefficient_shape, pack_coefficients,
                                                     reset_cursor, select_if, state_refs, store_zeros,
                                                     unpack_coefficients, window_mode)
from pallas_kernels.verify_coefficients import MAMBA2_VECTORS, mamba2_verify_coefficients

MAMBA2_MATRICES = 1  # M


def mamba2_window_coefficients(
    B: Float[Array, "B T G Ns"],
    C: Float[Array, "B T G Ns"],
    dt: Float[Array, "B T H"],
    A: Float[Array, " H"],
    D: Float[Array, " H"],
    anc: Bool[Array, "B T T"],
    length: Int[Array, " B"],
) -> Float[Array, "B H R Lanes"]:
    """The window's scalars per `(row, head)`, packed for the kernel (fp32,
    `coefficient_count(T, 2, 1)` floats shaped as `coefficient_shape(T, 2, 1)`): `M [T, T]`,
    `e^{A Gamma} [T]`, `dt [T]`, then zeros (M as in the module doc, 0 off i's branch).
    Positions at and past a row's length get zeros everywhere (their inputs, NaN
    included, are dropped first)."""
    batch, width, groups = B.shape[:3]
    heads = dt.shape[2]
    in_window = jnp.arange(width)[None, :] < length[:, None]  # [B, T]
    keep = lambda x: jnp.where(in_window.reshape(batch, width, *[1] * (x.ndim - 2)), x.astype(F32), 0.0)
    B, C, dt = keep(B), keep(C), keep(dt)
    b_dot_c = jnp.einsum("bjgn,bign->bgij", B, C, precision=lax.Precision.HIGHEST)  # B_j . C_i
    b_dot_c = jnp.repeat(b_dot_c, heads // groups, axis=1)  # [B, H, T(i), T(j)]
    seen = (anc | jnp.eye(width, dtype=bool)[None]) & in_window[:, :, None] & in_window[:, None, :]
    dt_t = jnp.moveaxis(dt, 1, 2)  # [B, H, T]
    gamma = jnp.einsum("bij,bhj->bhi", seen.astype(F32), dt_t, precision=lax.Precision.HIGHEST)
    log_a = A.astype(F32)[None, :, None] * gamma
    # e^{A (Gamma_i - Gamma_j)} only where j is on i's branch (<= 1 there); elsewhere the
    # difference can be large and positive, so it is zeroed before the exponential.
    mask = seen[:, None]
    decay = jnp.where(mask, jnp.exp(jnp.where(mask, log_a[..., :, None] - log_a[..., None, :], 0.0)), 0.0)
    skip = D.astype(F32)[None, :, None, None] * (jnp.eye(width, dtype=bool)[None] & mask)
    M = decay * dt_t[:, :, None, :] * b_dot_c + skip
    e_a = jnp.where(in_window[:, None, :], jnp.exp(log_a), 0.0)
    return pack_coefficients([M, e_a, dt_t], width, MAMBA2_VECTORS, MAMBA2_MATRICES)


def _kernel(slot_ref, pos_ref, length_ref, x_ref, b_ref, c_ref, z_ref, a_ref, coef_ref,
            ckpt_ref, xcache_ref, bcache_ref, dtcache_ref, cursor_ref, *refs, width, group_size, tiles, has_z):
    (y_ref, t_smem, xrec_smem, brec_smem, dt_smem, o_smem, c_smem, x_rows, b_rows, window_smem, barrier,
     rows_barrier) = refs
    b = lax.axis_index("b")
    hp = lax.axis_index("hp")
    h, tile = hp // tiles, hp % tiles
    grp = h // group_size
    rows = pl.ds(tile * BLOCK_ROWS, BLOCK_ROWS)
    cache_len = xrec_smem.shape[0]
    mode = window_mode(pos_ref[b], length_ref[b], cache_len)

    @pl.when(mode == MODE_PAD)
    def _padding_row():
        store_zeros(o_smem, y_ref, b, h, rows, width)

    @pl.when(mode != MODE_PAD)
    def _live_row():
        slot, pos, length = slot_ref[b], pos_ref[b], length_ref[b]
        fold = mode == MODE_FLUSH
        copy_replay_tile((ckpt_ref, xcache_ref, bcache_ref, dtcache_ref), (t_smem, xrec_smem, brec_smem, dt_smem),
                         slot, h, grp, rows, barrier)
        plgpu.copy_gmem_to_smem(coef_ref.at[b, h], c_smem, barrier)
        # The window's vectors, C once per layout (layout inference gives one buffer's loads
        # one layout), x and z on this tile's rows.
        c_cols, c_rows_w, x_win, *z_win = window_smem
        sources = [c_ref.at[b, :, grp], c_ref.at[b, :, grp], x_ref.at[b, :, h, rows]]
        sources += [z_ref.at[b, :, h, rows]] if has_z else []
        for src, dst in zip(sources, window_smem):
            plgpu.copy_gmem_to_smem(src, dst, barrier)

        @pl.when(fold)
        def _fetch_rows():
            # The rebuild reads single records at a dynamic index, which the swizzled
            # buffers cannot serve: folding rows fetch an untiled copy (L2-resident).
            copy_record_rows((xcache_ref, bcache_ref), (x_rows, b_rows), slot, h, grp, rows, rows_barrier)

        a = a_ref[h].astype(F32)
        plgpu.barrier_wait(barrier)
        weights, decay_total = window_weights(dt_smem, a, pos, cache_len)
        s_c = plgpu.load(t_smem, layout=WGMMA).astype(F32)  # [BP, N]

        @pl.when(fold)
        def _wait_rows():
            plgpu.barrier_wait(rows_barrier)

        # A folding row's live state, rebuilt with its whole history and rounded as stored;
        # other rows run the loop zero times and keep S_c (their history is read out below).
        rebuilt = rebuild_exact(s_c, jnp.where(fold, decay_total, 1.0), x_rows, b_rows, dt_smem, a,
                                jnp.where(fold, pos, 0))
        s_eff = rebuilt.astype(t_smem.dtype).astype(F32)
        history_len = jnp.where(fold, 0, pos)
        decay_eff = jnp.where(fold, 1.0, decay_total)

        reset_cursor(cursor_ref, slot, fold & (h == 0) & (tile == 0))

        @pl.when(fold)
        def _store_checkpoint():
            t_smem[...] = s_eff.astype(t_smem.dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(t_smem, ckpt_ref.at[slot, h, rows])

        b_t = load_transposed(brec_smem)  # [N, L]
        j_tile = plgpu.broadcasted_iota(jnp.int32, (BLOCK_ROWS, cache_len), 1, layout=WGMMA)
        x_t = jnp.where(j_tile < history_len, load_transposed(xrec_smem), 0.0)  # [BP, L], stale entries 0
        valid = plgpu.broadcasted_iota(jnp.int32, (cache_len,), 0, layout=COL) < history_len
        M, e_a, dt = unpack_coefficients(c_smem, width, MAMBA2_VECTORS, MAMBA2_MATRICES)
        base = jnp.where(fold, 0, pos)

        xs = []
        for i in range(width):
            in_window = i < length
            load = lambda ref, layout: select_if(
                in_window, plgpu.load(ref, layout=layout, optimized=False).astype(F32), layout)
            c_col, c_row = load(c_cols.at[i], COL), load(c_rows_w.at[i], ROW)
            coef = jnp.where(valid, col_sum(b_t * bcast_rows(c_row, b_t.shape)) * weights, 0.0)  # w * (B C_i)
            readout = decay_eff * row_sum(s_eff * bcast_cols(c_col, s_eff.shape)) + row_sum(
                x_t * bcast_cols(coef, x_t.shape))  # S C_i, [BP]
            xs.append(load(x_win.at[i], ROW))
            y_i = e_a(i) * readout
            for j in range(i + 1):
                y_i = y_i + M(i, j) * xs[j]
            if has_z:
                z = load(z_win[0].at[i], ROW)
                y_i = y_i * (z / (1.0 + jnp.exp(-z)))
            o_smem[i] = select_if(in_window, y_i, ROW).astype(o_smem.dtype)

            @pl.when(in_window)
            def _append_x():
                xcache_ref[slot, h, base + i, rows] = xs[i].astype(xcache_ref.dtype)

            # With one tile a head, this CTA alone reads the head's dt records, and its copy
            # of them has landed: a folding row's records are written here too.
            @pl.when(in_window & ((mode == MODE_APPEND) | (fold & (tiles == 1))) & (tile == 0))
            def _append_dt():
                dtcache_ref[slot, h, base + i] = dt(i)

            @pl.when(in_window & (mode == MODE_APPEND) & (tile == 0) & (h % group_size == 0))
            def _append_b():
                b_i = plgpu.load(b_ref.at[b, i, grp], layout=COL, optimized=False)
                bcache_ref[slot, grp, base + i] = b_i.astype(bcache_ref.dtype)

        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem, y_ref.at[b, :, h, rows])

    plgpu.wait_smem_to_gmem(0)


def _scratch(width, head_dim_tile, state_size, cache_len, state_dtype, cache_dtype, c_dtype, x_dtype, z_dtype,
             y_dtype, swizzle) -> list:
    """The kernel's shared buffers: the replay buffers of a `[64, N]` tile (y `[T, 64]`), the
    coefficient record, the rebuild's untiled record copies, the window's C (twice), x and
    z (when given) and the two barriers."""
    window = [plgpu.SMEM((width, state_size), c_dtype) for _ in range(2)] + [
        plgpu.SMEM((width, head_dim_tile), x_dtype)]
    window += [plgpu.SMEM((width, head_dim_tile), z_dtype)] if z_dtype is not None else []
    return [
        *replay_scratch(head_dim_tile, state_size, cache_len, state_dtype, cache_dtype, (width, head_dim_tile),
                        y_dtype, swizzle),
        plgpu.SMEM(coefficient_shape(width, MAMBA2_VECTORS, MAMBA2_MATRICES), F32),
        *record_copies(head_dim_tile, state_size, cache_len, cache_dtype),
        window,
        plgpu.Barrier(num_arrivals=5 + len(window)),
        plgpu.Barrier(num_arrivals=2),
    ]


@functools.lru_cache(maxsize=None)
def _build(batch, width, heads, head_dim, state_size, cache_len, state_dtype, cache_dtype, c_dtype, x_dtype, z_dtype,
           group_size, swizzle, interpret):
    tiles = head_dim // BLOCK_ROWS
    body = functools.partial(_kernel, width=width, group_size=group_size, tiles=tiles, has_z=z_dtype is not None)
    scratch = _scratch(width, BLOCK_ROWS, state_size, cache_len, state_dtype, cache_dtype, c_dtype, x_dtype, z_dtype,
                       x_dtype, swizzle)
    check_smem(scratch, f"mamba2_verify_decode_mgpu at T = {width}, cache_len = {cache_len}, N = {state_size}")
    return build_kernel(body, jax.ShapeDtypeStruct((batch, width, heads, head_dim), x_dtype), scratch,
                        dict(grid=(batch, heads * tiles), grid_names=("b", "hp")),
                        name="replayssm_mamba2_verify_decode_mgpu", interpret=interpret)


def mamba2_verify_decode_mgpu(
    checkpoint: Float[Array, "N H P Ns"],
    x_cache: Float[Array, "N H L P"],
    b_cache: Float[Array, "N G L Ns"],
    dt_cache: Float[Array, "N H L"],
    x: Float[Array, "B T H P"],
    B: Float[Array, "B T G Ns"],
    C: Float[Array, "B T G Ns"],
    dt: Float[Array, "B T H"],
    A: Float[Array, " H"],
    D: Float[Array, " H"],
    dt_bias: Float[Array, " H"],
    slots: Int[Array, " B"],
    cursors: Int[Array, " N"],
    lengths: Int[Array, " B"],
    anc: Bool[Array, "B T T"],
    *,
    z: Float[Array, "B T H P"] | None = None,
    dt_softplus: bool = True,
    dt_limit: tuple[float, float] = (0.0, float("inf")),
    params: MosaicMamba2Params = MosaicMamba2Params(),
    interpret: bool | None = None,
):
    """Verify one Mamba-2 draft window per row on Mosaic GPU: the window's scalars from XLA
    (`mamba2_window_coefficients`) or their Pallas Triton kernel (`window_side="kernel"`),
    then one kernel launch.

    Args:
      checkpoint, x_cache, b_cache, dt_cache: the layer's state pools (dt_cache float32,
        after the softplus).
      x, B, C: the window's tokens; z: the optional output gate (`y * silu(z)`).
      dt: the window's raw time steps; dt_bias `[H]`, `dt_softplus`, `dt_limit`: their
        gating, `clip(softplus(dt + dt_bias), *dt_limit)` (no softplus when `dt_softplus`
        is False), as `mamba2_replay_decode_mgpu`'s.
      A, D: `[H]` the decay rate and the skip.
      slots, cursors, lengths: the rows as `verify_decode.verify_decode_mgpu` takes them
        (`slots [B]`, negative or >= N a padding row; the pool's `cursors [N]`, each
        folding row's set to 0 in place; `lengths [B]` in [0, T]); the rows' slot, cursor
        and length (`common.verify_rows`) are formed with the window's scalars.
      anc: `[B, T, T]` bool, True where position j precedes position i on i's branch.
      params: the checkpoint tile's swizzle and where the window's scalars are formed
        (`MosaicMamba2Params`; one CTA per tile; `window_side="kernel"`: by
        `verify_coefficients.mamba2_verify_coefficients`, one Pallas Triton launch).
      interpret: run in Mosaic GPU interpret mode (default: off GPU).

    Returns:
      `(y [B, T, H, P] in x's dtype, checkpoint, x_cache, b_cache, dt_cache, cursors)`, with
      every row's window records appended and each folding row's cursor at 0, the state arrays
      updated in place when the caller donates them (a folding row's B records, and its dt
      records where P > 64, by XLA after the launch, see the module doc).

    Raises:
      ValueError: on shapes the kernel cannot take (`mamba2_decode.check_shapes`, a width
        outside [1, min(16, L)], an `anc` or z of the wrong shape), a dt_cache that is not
        float32, caches of two dtypes, a group count that does not divide H or launch
        options it does not take (`verify_decode.check_params`).
    """
    batch, width, heads, head_dim = x.shape
    num_groups, state_size = B.shape[2], B.shape[3]
    cache_len = x_cache.shape[2]
    if dt_cache.dtype != F32:
        raise ValueError(f"dt_cache must be float32 (dt after the softplus), got {dt_cache.dtype}")
    if b_cache.dtype != x_cache.dtype:
        raise ValueError(f"b_cache ({b_cache.dtype}) and x_cache ({x_cache.dtype}) must share one dtype")
    if heads % num_groups:
        raise ValueError(f"the head count H = {heads} must be a multiple of the group count G = {num_groups}")
    if not 1 <= width <= min(MAX_WIDTH, cache_len):
        raise ValueError(f"mamba2_verify_decode_mgpu needs a window width T in [1, min({MAX_WIDTH}, L = {cache_len})], "
                         f"got T = {width}")
    if anc.shape != (batch, width, width):
        raise ValueError(f"anc must have shape {(batch, width, width)}, got {anc.shape}")
    if z is not None and z.shape != x.shape:
        raise ValueError(f"z must have x's shape {x.shape}, got {z.shape}")
    if dt.shape != (batch, width, heads) or dt_bias.shape != (heads,):
        raise ValueError(f"dt must be [B, T, H] = {(batch, width, heads)} and dt_bias [H], got {dt.shape} and "
                         f"{dt_bias.shape}")
    check_rows(slots, cursors, lengths, batch, checkpoint.shape[0])
    check_shapes(head_dim, state_size, cache_len, checkpoint.dtype.itemsize, x_cache.dtype.itemsize,
                 x.dtype.itemsize, params.swizzle)
    check_params(params, "mamba2_verify_decode_mgpu", window_side=True)
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    record_len = coefficient_count(width, MAMBA2_VECTORS, MAMBA2_MATRICES)
    if params.window_side == "kernel":
        coef, dt, rows = mamba2_verify_coefficients(
            B, C, dt, dt_bias, A, D, anc.astype(bool), slots, cursors, lengths, record_len=record_len,
            dt_softplus=dt_softplus, dt_limit=dt_limit, interpret=interpret)
        coef = coef.reshape(batch, heads, *coefficient_shape(width, MAMBA2_VECTORS, MAMBA2_MATRICES))
    else:
        rows = verify_rows(slots, cursors, lengths)
        dt = mamba2_time_step(dt.astype(F32) + dt_bias.astype(F32), dt_softplus, dt_limit)
        coef = mamba2_window_coefficients(B, C, dt, A, D, anc.astype(bool), rows.length)
    slot, pos, length = rows
    kernel = _build(batch, width, heads, head_dim, state_size, cache_len, checkpoint.dtype, x_cache.dtype, C.dtype,
                    x.dtype, None if z is None else z.dtype, heads // num_groups, params.swizzle, bool(interpret))
    z = jnp.zeros((1,), x.dtype) if z is None else z
    refs = state_refs((checkpoint, x_cache, b_cache, dt_cache), cursors)
    y = kernel(slot, pos, length, x, B, C, z, A, coef, *refs)
    checkpoint, x_cache, b_cache, dt_cache, cursors = (jax.freeze(r) for r in refs)
    mode = window_mode(pos, length, cache_len)  # XLA fuses it into the records' scatters
    b_cache = append_records(b_cache, B, slot, mode, length)
    if head_dim > BLOCK_ROWS:  # several tiles a head: the kernel writes no folding row's dt records
        dt_cache = append_records(dt_cache, dt, slot, mode, length)
    return y, checkpoint, x_cache, b_cache, dt_cache, cursors
