"""Speculative verify of a KDA draft window (per-channel decay) on Mosaic GPU, one launch per step.

The GDN verify kernel's structure (`verify_decode.py`: grid `(B, H_v * d_v / BV)`, one
warpgroup per `[BV, d_k]` tile, row modes, ragged lengths, tree windows through `anc`, the
forward substitution and the records) with the KDA decode kernel's readout of the history
(`replay_decode_kda.py`: per-channel decay weights `W [L, d_k]`, `W * K` for both the
readout and the exact rebuild).

Math (as `replayssm_jax.speculative`): with S the row's live state before the window, G_i
`[d_k]` the sum of g over position i's ancestors and i (per key channel), q_i, k_i after
the L2 norm and the scale,

    R_i  = beta_i (v_i - S (e^{G_i} * k_i))
    u_i  = R_i - sum_{j in anc(i)} A_ij u_j                             (forward substitution)
    y_i  = S (e^{G_i} * q_i) + sum_{j in anc(i) + {i}} M_ij u_j
    A_ij = beta_i sum_c k_i[c] e^{G_i[c] - G_j[c]} k_j[c],   M_ij = sum_c q_i[c] e^{G_i[c] - G_j[c]} k_j[c]

The `T x T` scalars A, M (and beta and the q / k norms) come packed per (row, value head)
from `kda_window_coefficients` in XLA (or its Pallas Triton kernel), as in the GDN kernel;
the per-channel factors `e^{G_i}` `[B, T, H_v, d_k]` come beside them (zeros at and past a
row's length), since they scale the vectors that the readout reads out. `S x` is read out
without forming S: `S_c (e^{G_h} * x) + U^T ((W * K) x)` over the row's `pos` valid cache entries, with
`G_h = sum_{j<pos} g_j` and `W_j = exp(sum_{j<i<pos} g_i)` per channel (`decay_weights`
of `replay_decode_kda`); entries at and past `pos` are selected to 0 before any product.

Row modes as in the GDN kernel: `MODE_APPEND` writes the window's records at
`pos .. pos + length - 1` and not the checkpoint (the gate records from a copy of the
window's gates taken with the tile, by tile 0 of each value head); `MODE_FLUSH` rebuilds
the live state `S_c diag(e^{G_h}) + sum_j u_j (W_j * k_j)^T` on chip in exact fp32
(`rebuild_exact` of `replay_decode_kda`: newest entry first, `W * K` written over the g
records' buffer), stores it rounded to the checkpoint's dtype in place, reads the window
out from that stored value and writes its u records at `0 .. length - 1` (the wrapper
writes its key and gate records after the launch: other CTAs of the slot may still read
the history they overwrite) and sets the row's cursor to 0 in place;
`MODE_PAD` gives y = 0 and writes nothing. Window positions
at and past `length` give y = 0 and no records; their inputs are replaced by zeros before
use.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
from jaxtyping import Array, Bool, Float, Int

from pallas_kernels.common import MODE_APPEND, MODE_FLUSH, MODE_PAD, verify_rows
from pallas_kernels.mosaic_gpu.build import build_kernel
from pallas_kernels.mosaic_gpu.layouts import (BLOCK_ROWS, COL, F32, ROW, WGMMA, bcast_cols, bcast_rows, col_sum,
                                              check_smem, copy_replay_tile, load_transposed, records_buffer, row_sum,
                                              tiled)
from pallas_kernels.mosaic_gpu.replay_decode import MosaicReplayParams
from pallas_kernels.mosaic_gpu.replay_decode_kda import (channel_layout, check_kda_shapes, decay_weights,
                                                         rebuild_exact, weighted_keys)
from pallas_kernels.mosaic_gpu.verify_decode import (MAX_WIDTH, append_folding_records, check_params, check_rows,
                                                     coefficient_count, coefficient_shape, pack_coefficients,
                                                     prepare_window, record_key_scales, reset_cursor, select_if,
                                                     solve_positions, state_refs, store_zeros, unpack_coefficients,
                                                     window_mode)
from pallas_kernels.verify_coefficients import KDA_VECTORS, VerifyCoefficientsParams, kda_verify_coefficients


def kda_window_coefficients(
    q: Float[Array, "B T Hk Dk"],
    k: Float[Array, "B T Hk Dk"],
    g: Float[Array, "B T Hv Dk"],
    beta: Float[Array, "B T Hv"],
    anc: Bool[Array, "B T T"],
    length: Int[Array, " B"],
    *,
    use_qk_l2norm: bool,
    scale: float,
) -> tuple[Float[Array, "B Hv R Lanes"], Float[Array, "B T Hv Dk"]]:
    """The window's scalars per `(row, value head)`, packed for the kernel (fp32,
    `coefficient_count(T, KDA_VECTORS)` floats shaped as `coefficient_shape`): `A [T, T]`,
    `M [T, T]`, `beta [T]`, `q_scale [T]`, `k_scale [T]`, then zeros (A, M as in the module
    doc, q_scale, k_scale the norms' and the scale's factors for the raw q, k); and `e^{G}`
    `[B, T, H_v, d_k]`. Positions at and past a row's length get zeros everywhere (their
    inputs, NaN included, are dropped first)."""
    width, num_k_heads = q.shape[1], q.shape[2]
    group = g.shape[2] // num_k_heads
    in_window, qn, kn, g, beta, q_scale, k_scale = prepare_window(q, k, g, beta, length, use_qk_l2norm=use_qk_l2norm,
                                                                   scale=scale)
    heads = lambda x: jnp.repeat(x, group, axis=2)  # [B, T, Hk, ...] -> [B, T, Hv, ...]
    qh, kh = heads(qn), heads(kn)
    seen = (anc | jnp.eye(width, dtype=bool)[None]) & in_window[:, :, None] & in_window[:, None, :]
    G = jnp.einsum("bij,bjhc->bihc", seen.astype(F32), g, precision=lax.Precision.HIGHEST)  # [B, T, Hv, Dk]
    # e^{G_i - G_j} only where j is on i's branch (<= 1 there); elsewhere the difference
    # can be large and positive, so it is zeroed before the exponential.
    mask = seen[:, :, :, None, None]
    decay = jnp.where(mask, jnp.exp(jnp.where(mask, G[:, :, None] - G[:, None, :], 0.0)), 0.0)  # [B, T, T, Hv, Dk]
    # k_i . k_j and q_i . k_j under the decays as one channel sum of elementwise products,
    # the decays' only consumer, which XLA fuses into one reduction (an einsum, or two
    # sums, could materialise the [B, T, T, H_v, d_k] decays).
    x = jnp.stack([kh, qh], axis=2)[:, :, None]  # [B, T(i), 1, 2, Hv, Dk]
    kk, qk = jnp.moveaxis(jnp.sum(x * decay[:, :, :, None] * kh[:, None, :, None], axis=-1), 3, 0)  # [B, T, T, Hv]
    heads_first = lambda y: jnp.moveaxis(y, 3, 1)  # [B, Hv, T, T]
    beta_t = jnp.moveaxis(beta, 1, 2)  # [B, Hv, T]
    A = jnp.where((anc & seen)[:, None], beta_t[..., :, None] * heads_first(kk), 0.0)
    M = heads_first(qk)
    scales = [jnp.repeat(jnp.moveaxis(x, 1, 2), group, axis=1) for x in (q_scale, k_scale)]
    e_G = jnp.where(in_window[:, :, None, None], jnp.exp(G), 0.0)
    return pack_coefficients([A, M, beta_t, *scales], width, KDA_VECTORS), e_G


def _kernel(slot_ref, pos_ref, length_ref, q_ref, k_ref, v_ref, g_ref, decay_ref, coef_ref,
            ckpt_ref, ucache_ref, kcache_ref, gcache_ref, cursor_ref, *refs, width, group_size, tiles):
    (y_ref, t_smem, u_smem, k_smem, g_smem, w_smem, chan_smem, o_smem, c_smem, rows_or_gates, window_smem,
     barrier, rows_barrier, gate_barrier) = refs
    b = lax.axis_index("b")
    hv = lax.axis_index("hv")
    h, tile = hv // tiles, hv % tiles
    hk = h // group_size
    rows = pl.ds(tile * BLOCK_ROWS, BLOCK_ROWS)
    cache_len, head_k_dim = g_smem.shape
    mode = window_mode(pos_ref[b], length_ref[b], cache_len)
    u_rows, gate_rows = tuple(rows_or_gates)  # a folding row's u records, or an appending row's gates
    channels = channel_layout(head_k_dim)

    @pl.when(mode == MODE_PAD)
    def _padding_row():
        store_zeros(o_smem, y_ref, b, h, rows, width)

    @pl.when(mode != MODE_PAD)
    def _live_row():
        slot, pos, length = slot_ref[b], pos_ref[b], length_ref[b]
        fold = mode == MODE_FLUSH
        copy_replay_tile((ckpt_ref, ucache_ref, kcache_ref, gcache_ref), (t_smem, u_smem, k_smem, g_smem),
                         slot, h, hk, rows, barrier)
        plgpu.copy_gmem_to_smem(coef_ref.at[b, h], c_smem, barrier)
        # The window's vectors, one buffer per load layout (as in the GDN kernel).
        q_cols, k_cols, q_rows, k_rows, v_rows, e_cols, e_rows = window_smem
        for src, dst in ((q_ref.at[b, :, hk], q_cols), (k_ref.at[b, :, hk], k_cols), (q_ref.at[b, :, hk], q_rows),
                         (k_ref.at[b, :, hk], k_rows), (v_ref.at[b, :, h, rows], v_rows),
                         (decay_ref.at[b, :, h], e_cols), (decay_ref.at[b, :, h], e_rows)):
            plgpu.copy_gmem_to_smem(src, dst, barrier)

        @pl.when(fold)
        def _fetch_rows():
            # The rebuild reads single u records at a dynamic index, which the swizzled
            # buffer cannot serve: folding rows fetch an untiled copy (L2-resident).
            plgpu.copy_gmem_to_smem(ucache_ref.at[slot, h, :, rows], u_rows, rows_barrier)

        # The window's gates, which tile 0 of an appending row stores as its gate records:
        # copied with the tile, so that no append waits on a load from global memory.
        stores_gates = (mode == MODE_APPEND) & (tile == 0)

        @pl.when(stores_gates)
        def _fetch_gates():
            plgpu.copy_gmem_to_smem(g_ref.at[b, :, h], gate_rows, gate_barrier)

        plgpu.barrier_wait(barrier)
        decay_weights(g_smem, w_smem, chan_smem, pos, channels)
        plgpu.commit_smem()  # W and e^{G_h} visible to every thread

        @pl.when(fold)
        def _weigh_keys():
            # The g records were last read above: their buffer takes W * K for the rebuild.
            weighted_keys(w_smem, k_smem, g_smem, channels)
            plgpu.commit_smem()
            plgpu.barrier_wait(rows_barrier)

        decay_total = plgpu.load(chan_smem.at[0], layout=COL)  # e^{G_h} [Dk]
        s_c = plgpu.load(t_smem, layout=WGMMA).astype(F32)  # [BV, Dk]
        # A folding row's live state, rebuilt with its whole history and rounded as stored;
        # other rows run the loop zero times and keep S_c (their history is read out below).
        start = s_c * bcast_cols(select_if(fold, decay_total, COL, 1.0), s_c.shape)
        s_eff = rebuild_exact(start, u_rows, g_smem, jnp.where(fold, pos, 0)).astype(t_smem.dtype).astype(F32)
        history_len = jnp.where(fold, 0, pos)
        decay_eff = select_if(jnp.logical_not(fold), decay_total, COL, 1.0)

        reset_cursor(cursor_ref, slot, fold & (h == 0) & (tile == 0))

        @pl.when(fold)
        def _store_checkpoint():
            t_smem[...] = s_eff.astype(t_smem.dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(t_smem, ckpt_ref.at[slot, h, rows])

        wk_t = load_transposed(w_smem) * load_transposed(k_smem)  # [Dk, L]; stale columns selected out below
        j_tile = plgpu.broadcasted_iota(jnp.int32, (BLOCK_ROWS, cache_len), 1, layout=WGMMA)
        u_t = jnp.where(j_tile < history_len, load_transposed(u_smem), 0.0)  # [BV, L], stale entries 0
        valid = plgpu.broadcasted_iota(jnp.int32, (cache_len,), 0, layout=COL) < history_len

        def readout(x_col, x_row):
            """`S x` `[BV]` (ROW) for x given in both layouts."""
            c = jnp.where(valid, col_sum(wk_t * bcast_rows(x_row, wk_t.shape)), 0.0)  # (W * K) x, [L]
            history = row_sum(u_t * bcast_cols(c, u_t.shape))
            return history + row_sum(s_eff * bcast_cols(decay_eff * x_col, s_eff.shape))

        A, M, beta, q_scale, k_scale = unpack_coefficients(c_smem, width, KDA_VECTORS)
        base = jnp.where(fold, 0, pos)

        def read_k(i, load):
            k_col = k_scale(i) * load(k_cols.at[i], COL)
            k_row = k_scale(i) * load(k_rows.at[i], ROW)
            return readout(load(e_cols.at[i], COL) * k_col, load(e_rows.at[i], ROW) * k_row), k_col

        def read_q(i, load):
            q_col = q_scale(i) * load(q_cols.at[i], COL)
            q_row = q_scale(i) * load(q_rows.at[i], ROW)
            return readout(load(e_cols.at[i], COL) * q_col, load(e_rows.at[i], ROW) * q_row)

        def append(i, in_window, u_i, k_col):
            @pl.when(in_window)
            def _append_u():
                ucache_ref[slot, h, base + i, rows] = u_i.astype(ucache_ref.dtype)

            @pl.when(in_window & stores_gates)
            def _append_gate():
                gcache_ref[slot, h, base + i] = plgpu.load(gate_rows.at[i], layout=ROW, optimized=False).astype(F32)

            @pl.when(in_window & stores_gates & (h % group_size == 0))
            def _append_key():
                kcache_ref[slot, hk, base + i] = k_col.astype(kcache_ref.dtype)

        @pl.when(stores_gates)
        def _gates_landed():
            plgpu.barrier_wait(gate_barrier)

        solve_positions(width, length, A, M, beta, v_rows, o_smem, read_k, read_q, append)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem, y_ref.at[b, :, h, rows])

    plgpu.wait_smem_to_gmem(0)


@functools.lru_cache(maxsize=None)
def _build(batch, width, num_v_heads, head_v_dim, head_k_dim, cache_len, state_dtype, cache_dtype, qk_dtype, y_dtype,
           gate_dtype, group_size, swizzle, interpret):
    tiles = head_v_dim // BLOCK_ROWS
    body = functools.partial(_kernel, width=width, group_size=group_size, tiles=tiles)
    scratch = [
        plgpu.SMEM((BLOCK_ROWS, head_k_dim), state_dtype, transforms=tiled(swizzle, state_dtype)),
        records_buffer(cache_len, BLOCK_ROWS, cache_dtype),
        records_buffer(cache_len, head_k_dim, cache_dtype),
        plgpu.SMEM((cache_len, head_k_dim), F32),  # g records, then W * K on folding rows
        plgpu.SMEM((cache_len, head_k_dim), F32, transforms=tiled(128, F32)),  # W
        plgpu.SMEM((1, head_k_dim), F32),  # e^{G_h}
        plgpu.SMEM((width, BLOCK_ROWS), y_dtype),
        plgpu.SMEM(coefficient_shape(width, KDA_VECTORS), F32),
        # Untiled u records for a folding row's rebuild, or the window's gates on the tile of
        # an appending row that stores them: never both, so they share their bytes.
        plgpu.RefUnion(plgpu.SMEM((cache_len, BLOCK_ROWS), cache_dtype), plgpu.SMEM((width, head_k_dim), gate_dtype)),
        [plgpu.SMEM((width, head_k_dim), qk_dtype) for _ in range(4)] + [plgpu.SMEM((width, BLOCK_ROWS), y_dtype)]
        + [plgpu.SMEM((width, head_k_dim), F32) for _ in range(2)],
        plgpu.Barrier(num_arrivals=12),
        plgpu.Barrier(num_arrivals=1),
        plgpu.Barrier(num_arrivals=1),
    ]
    check_smem(scratch, f"verify_decode_kda_mgpu at T = {width}, cache_len = {cache_len}, d_k = {head_k_dim}")
    return build_kernel(body, jax.ShapeDtypeStruct((batch, width, num_v_heads, head_v_dim), y_dtype), scratch,
                        dict(grid=(batch, num_v_heads * tiles), grid_names=("b", "hv")),
                        name="replayssm_verify_decode_mgpu_kda", interpret=interpret)


def verify_decode_kda_mgpu(
    checkpoint: Float[Array, "N Hv Dv Dk"],
    u_cache: Float[Array, "N Hv L Dv"],
    k_cache: Float[Array, "N Hk L Dk"],
    g_cache: Float[Array, "N Hv L Dk"],
    q: Float[Array, "B T Hk Dk"],
    k: Float[Array, "B T Hk Dk"],
    v: Float[Array, "B T Hv Dv"],
    g: Float[Array, "B T Hv Dk"],
    beta: Float[Array, "B T Hv"],
    slots: Int[Array, " B"],
    cursors: Int[Array, " N"],
    lengths: Int[Array, " B"],
    anc: Bool[Array, "B T T"],
    *,
    use_qk_l2norm: bool = False,
    scale: float | None = None,
    params: MosaicReplayParams = MosaicReplayParams(),
    interpret: bool | None = None,
):
    """Verify one KDA draft window per row on Mosaic GPU: `kda_window_coefficients` in XLA
    (or with `params.window_side="kernel"` `verify_coefficients.kda_verify_coefficients`,
    one Pallas Triton launch), then one kernel launch.

    Args and returns as `verify_decode.verify_decode_mgpu` with a per-channel decay: g
    `[B, T, H_v, d_k]` (activated log-decays) and g records `[N, H_v, L, d_k]` fp32. Returns
    `(y [B, T, H_v, d_v] in v's dtype, checkpoint, u_cache, k_cache, g_cache, cursors)`
    (each folding row's cursor at 0), the state arrays updated in place when
    the caller donates them (a folding row's key and gate records by XLA after the launch:
    this kernel reads the gate records, see the module doc).
    """
    batch, width, num_v_heads, head_v_dim = v.shape
    head_k_dim = q.shape[-1]
    cache_len = u_cache.shape[2]
    if g_cache.shape != (*u_cache.shape[:3], head_k_dim) or g.shape != (batch, width, num_v_heads, head_k_dim):
        raise ValueError(f"KDA verify needs g_cache [N, H_v, L, d_k] and g [B, T, H_v, d_k] (d_k = {head_k_dim}); "
                         f"got g_cache {g_cache.shape}, g {g.shape}")
    if not 1 <= width <= min(MAX_WIDTH, cache_len):
        raise ValueError(f"verify_decode_kda_mgpu needs a window width T in [1, min({MAX_WIDTH}, L = {cache_len})], "
                         f"got T = {width}")
    if anc.shape != (batch, width, width):
        raise ValueError(f"anc must have shape {(batch, width, width)}, got {anc.shape}")
    if q.dtype != k.dtype:
        raise ValueError(f"q and k must share a dtype, got {q.dtype} and {k.dtype}")
    check_rows(slots, cursors, lengths, batch, checkpoint.shape[0])
    check_kda_shapes(head_k_dim, head_v_dim, cache_len, checkpoint.dtype.itemsize, u_cache.dtype.itemsize,
                     params.swizzle)
    check_params(params, "verify_decode_kda_mgpu", window_side=True)
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    scale = float(head_k_dim ** -0.5 if scale is None else scale)
    if params.window_side == "kernel":
        coef, key_scales, decay, rows = kda_verify_coefficients(
            q, k, g, beta, anc.astype(bool), slots, cursors, lengths, record_len=coefficient_count(width, KDA_VECTORS),
            use_qk_l2norm=bool(use_qk_l2norm), scale=scale,
            params=VerifyCoefficientsParams(num_warps=params.window_warps), interpret=interpret)
        coef = coef.reshape(batch, num_v_heads, *coefficient_shape(width, KDA_VECTORS))
    else:
        rows = verify_rows(slots, cursors, lengths)
        coef, decay = kda_window_coefficients(q, k, g, beta, anc.astype(bool), rows.length,
                                              use_qk_l2norm=bool(use_qk_l2norm), scale=scale)
        key_scales = record_key_scales(coef, width, KDA_VECTORS, num_v_heads // q.shape[2])
    slot, pos, length = rows
    kernel = _build(batch, width, num_v_heads, head_v_dim, head_k_dim, cache_len, checkpoint.dtype, u_cache.dtype,
                    q.dtype, v.dtype, g.dtype, num_v_heads // q.shape[2], params.swizzle, bool(interpret))
    refs = state_refs((checkpoint, u_cache, k_cache, g_cache), cursors)
    y = kernel(slot, pos, length, q, k, v, g, decay, coef, *refs)
    checkpoint, u_cache, k_cache, g_cache, cursors = (jax.freeze(r) for r in refs)
    keys = k.astype(F32) * key_scales[..., None]
    mode = window_mode(pos, length, cache_len)  # XLA fuses it into the records' scatters
    return (y, checkpoint, u_cache, *append_folding_records(k_cache, g_cache, keys, g, slot, mode, length), cursors)
