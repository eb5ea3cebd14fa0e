"""Fused ReplaySSM decode step for KDA (per-channel decay) on Mosaic GPU, one launch per step.

The GDN kernel's structure (`replay_decode.py`: one warpgroup per `[BV, d_k]` tile, BV = 64,
TMA of the checkpoint tile and the swizzled u records, pad / append / flush per row,
in-place writes; one CTA per tile or `MosaicReplayParams.programs` persistent CTAs on
`pipeline.serve_tiles`) with a log-decay per key channel: g `[B, H_v, d_k]` per token and g
records `[N, H_v, L, d_k]` (fp32, one per value head).

Step math (as `backends.xla`): with `G = sum_{j<pos} g_j` and
`W_j = exp(sum_{j<i<pos} g_i)` per channel (`[d_k]`), alpha = e^{g_t},

    S_{t-1} x = S_c (e^G * x) + sum_{j<pos} u_j ((W_j * k_j) . x)

for x = alpha * k and alpha * q, never forming `S_{t-1}`; then
`u = beta (v - S_{t-1}(alpha k))`, `y = S_{t-1}(alpha q) + u (k . q)`.

Head side (`head_side`): everything but the tile's own rows depends on the value head only,
so the head's first tile on a CTA (a *fresh* tile, `pipeline`) computes it and the head's
other tiles read it back from shared memory: the suffix sums `log W_j` in `channel_layout`
(thread c % 128 holds channel c of every entry: one load, select, add and exp per entry and
thread, O(L), no cross-thread work), the weighted keys `W * K` `[L, d_k]` (zero at and past
`pos`, so a stale record, NaN included, reaches nothing), `(W * K)(alpha k)` and
`(W * K)(alpha q)` `[L]` (column reductions of `(W * K)^T` read transposed), `e^G alpha k`,
`e^G alpha q` and `k . q`. Its inputs, the key and g records and the token's g, are the
pipeline's group copies: one buffer per CTA, the next fresh tile's copy started once this
one's head side is done (`pipeline.persistent_tiles`), which keeps two persistent CTAs per
SM at fp32, L = 16, d = 128.

Per tile: `U^T [BV, L]` (stale entries selected to 0) and `S_c [BV, d_k]` in `WGMMA`;
`S_{t-1}(alpha x) = U^T c_x + S_c (e^G alpha x)`, two row reductions into `ROW [BV]`.

Append rows store u at `pos` (and g `[d_k]` from tile 0, k from tile 0 of the first value
head of each key head). Flush rows rebuild `S_{t-1} = e^G S_c + U^T (W * K)` from the `S_c`
tile already in registers: exact fp32 on CUDA cores (one fused multiply-add per element and
entry, newest entry first, from an untiled copy of the u records in the tile's buffer), or
on tensor cores (`rebuild.rebuild_mma`, "3xtf32" the backend's GPU default), and store
`S_t = S_{t-1} diag(alpha) + u k^T` in place; the checkpoint is read from memory once per
step.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
from jaxtyping import Array, Float, Int

from pallas_kernels.common import MODE_APPEND, MODE_FLUSH, MODE_PAD
from pallas_kernels.mosaic_gpu.build import build_kernel
from pallas_kernels.mosaic_gpu.layouts import (COL, F32, ROW, WGMMA, bcast_cols, bcast_rows, col_sum, check_smem,
                                              load_transposed, records_buffer, row_sum, softplus, tiled)
from pallas_kernels.mosaic_gpu import replay_decode
from pallas_kernels.mosaic_gpu.pipeline import STAGES, launch_order_input, serve_tiles, tile_grid
from pallas_kernels.mosaic_gpu.rebuild import check_rebuild, rebuild_mma, tile_with_operands
from pallas_kernels.mosaic_gpu.replay_decode import (BLOCK_V, MosaicReplayParams, append_entry, check_fma_readout,
                                                     check_own_layout, check_shapes, copy_token, load_qk, store_output,
                                                     store_tile)


def channel_layout(head_k_dim: int):
    """The layout of an `[R, d_k]` array with channel c of every row in thread c % 128
    (warp c // 32 % 4, lane c % 32) and the rows in registers, so that sums along R are
    thread-local. d_k = 64 fills two warps, which the other two replicate."""
    width = min(head_k_dim, 128)
    warps = (plgpu.Replicated(128 // width), -3) if width < 128 else (-3,)
    return plgpu.Layout.TILED(plgpu.Tiling(((1, width), (32,), (1,))), warp_dims=warps, lane_dims=(-2,),
                              vector_dim=-1)


def check_kda_shapes(head_k_dim: int, head_v_dim: int, cache_len: int, state_itemsize: int,
                     cache_itemsize: int, swizzle: int = 128) -> None:
    """Raise ValueError unless the shapes fit the KDA kernel's layouts and shared memory."""
    check_shapes(head_k_dim, head_v_dim, cache_len, state_itemsize, swizzle)
    if head_k_dim > 128 and head_k_dim % 128:
        raise ValueError(f"mosaic_gpu KDA needs d_k = 64 or a multiple of 128, got d_k = {head_k_dim}")
    as_dtype = lambda itemsize: jnp.dtype(f"float{8 * itemsize}")  # only the sizes matter here
    check_smem(_scratch(head_k_dim, cache_len, as_dtype(state_itemsize), as_dtype(cache_itemsize), F32, F32,
                        swizzle, "exact", 1),
               f"mosaic_gpu KDA with d_k = {head_k_dim}, cache_len = {cache_len}")


def suffix_decays(g_smem, pos, channels):
    """`(W, e^G)`: `W` the L rows `W_j = exp(sum_{j<i<pos} g_i)` `[1, d_k]` (1 past `pos`)
    and `e^G` `[1, d_k]`, in `channels`, from the g records `g_smem [L, d_k]`.

    The suffix sums run newest entry first (one load, select, add and exp per entry and
    thread); an entry at or past `pos` adds 0 through a select, so a stale g (NaN
    included) is never used."""
    cache_len, head_k_dim = g_smem.shape
    running = plgpu.layout_cast(jnp.zeros((1, head_k_dim), F32), channels)
    weights = [None] * cache_len
    for i in reversed(range(cache_len)):
        live = jnp.broadcast_to(i < pos, (1, head_k_dim))
        weights[i] = jnp.exp(running)
        g_i = plgpu.load(g_smem.at[pl.ds(i, 1)], layout=channels, optimized=False)
        running = running + jnp.where(live, g_i, 0.0)
    return weights, jnp.exp(running)


def decay_weights(g_smem, w_smem, chan_smem, pos, channels):
    """`W [L, d_k]` into `w_smem` and `e^G` into row 0 of `chan_smem` (`suffix_decays`)."""
    weights, decay_total = suffix_decays(g_smem, pos, channels)
    w_smem[...] = jnp.concatenate(weights, axis=0)
    chan_smem[pl.ds(0, 1)] = decay_total


def weighted_keys(w_smem, k_smem, wk_rows, channels):
    """`W_j * k_j` `[L, d_k]` into `wk_rows`, for the rebuild, which reads the rows
    below `pos` only (a stale row may hold NaN)."""
    weights = plgpu.load(w_smem, layout=channels)
    wk_rows[...] = weights * plgpu.load(k_smem, layout=channels).astype(F32)


def rebuild_exact(state, u_rows, wk_rows, pos):
    """`state + sum_{j<pos} u_j (W_j * k_j)^T` in fp32, newest entry first."""

    def body(i, state):
        j = pos - 1 - i
        u_j = plgpu.load(u_rows.at[j], layout=ROW, optimized=False).astype(F32)
        wk_j = plgpu.load(wk_rows.at[j], layout=COL, optimized=False)
        return state + bcast_rows(u_j, state.shape) * bcast_cols(wk_j, state.shape)

    return lax.fori_loop(0, pos, body, state)


def _scratch(head_k_dim, cache_len, state_dtype, cache_dtype, qk_dtype, v_dtype, swizzle, rebuild, stages) -> list:
    """`[stages, group buffers, shared, weighted keys, barriers, group barrier, rows barrier]`.

    Per stage: the checkpoint tile (in a union with the flush rebuild's buffers, free once
    `S_c` is in registers: the tensor-core operands, or the exact rebuild's untiled copy of
    the u records), the swizzled u records, y, the token's q, k, q, k (`[4, d_k]`) and v rows.
    Once per CTA (`pipeline` group copies): the key records `[L, d_k]` and g records
    `[L, d_k]` (fp32) of the next fresh tile; the value head's shared values
    (`head_side`: `[7, d_k]` and `[3, L]` fp32) and its weighted keys `W * K` `[L, d_k]`."""
    def stage():
        tile = plgpu.SMEM((BLOCK_V, head_k_dim), state_dtype, transforms=tiled(swizzle, state_dtype))
        if rebuild == "exact":
            tile = plgpu.RefUnion(tile, [plgpu.SMEM((cache_len, BLOCK_V), cache_dtype)])
        else:
            tile = tile_with_operands(tile, BLOCK_V, head_k_dim, cache_len, rebuild)
        return [tile, records_buffer(cache_len, BLOCK_V, cache_dtype),
                plgpu.SMEM((BLOCK_V,), v_dtype), plgpu.SMEM((4, head_k_dim), qk_dtype), plgpu.SMEM((BLOCK_V,), v_dtype)]

    group = [plgpu.SMEM((cache_len, head_k_dim), cache_dtype), plgpu.SMEM((cache_len, head_k_dim), F32)]
    shared = [plgpu.SMEM((SHARED_ROWS, head_k_dim), F32), plgpu.SMEM((3, cache_len), F32)]
    return [[stage() for _ in range(stages)], group, shared, plgpu.SMEM((cache_len, head_k_dim), F32),
            plgpu.Barrier(num_arrivals=7, num_barriers=stages), plgpu.Barrier(num_arrivals=3),
            plgpu.Barrier(num_arrivals=1)]


# Rows of the value head's shared `[SHARED_ROWS, d_k]` buffer (`head_side`).
EG, ALPHA, X_K, X_Q, K_N, G_TOKEN, G_GATED = range(7)
SHARED_ROWS = 7


def head_side(b, h, pos, qk_smem, group_bufs, shared, wk_smem, a_log_ref, dt_bias_ref, *, use_qk_l2norm, scale,
              raw_gates) -> None:
    """What every tile of value head h of row b shares, into `shared` (`[7, d_k]`, `[3, L]`)
    and `wk_smem`: the token's gate `g` (row G_GATED, appended) and `alpha = e^g` (ALPHA),
    `e^G` (EG), the readout vectors `x_k = e^G alpha k` (X_K) and `x_q = e^G alpha q` (X_Q)
    with k normalised (K_N) and q normalised and scaled, `W * K` `[L, d_k]` (zero at and past
    `pos`), and `(W * K)(alpha k)`, `(W * K)(alpha q)` `[L]` and `k . q`.

    `W` comes from `suffix_decays` in `channel_layout`; a weighted key at or past `pos` is
    selected to 0, so a stale record (NaN included) reaches nothing. e^G and alpha reach
    COL through `shared` (one warpgroup barrier)."""
    k_smem, g_smem = group_bufs
    vectors, scalars = shared
    head_k_dim = g_smem.shape[1]
    channels = channel_layout(head_k_dim)
    # k normalised, q normalised and scaled, in both vector layouts (`qk_smem`: q, k, q, k).
    q_n, k_n, q_row, k_row, k_dot_q = load_qk(*(qk_smem.at[i] for i in range(4)), use_qk_l2norm=use_qk_l2norm,
                                              scale=scale)
    g = plgpu.load(vectors.at[G_TOKEN], layout=ROW, optimized=False)
    if raw_gates:
        dt_bias = plgpu.load(dt_bias_ref.at[h], layout=ROW, optimized=False).astype(F32)
        g = -jnp.exp(a_log_ref[h].astype(F32)) * softplus(g + dt_bias)
    alpha_row = jnp.exp(g)
    vectors[G_GATED] = g
    vectors[ALPHA] = alpha_row

    weights, decay_total = suffix_decays(g_smem, pos, channels)
    weighted = [jnp.where(jnp.broadcast_to(i < pos, (1, head_k_dim)),
                          w_i * plgpu.load(k_smem.at[pl.ds(i, 1)], layout=channels, optimized=False).astype(F32), 0.0)
                for i, w_i in enumerate(weights)]
    wk_smem[...] = jnp.concatenate(weighted, axis=0)
    vectors[pl.ds(EG, 1)] = decay_total
    plgpu.commit_smem()  # W * K, e^G and alpha visible to every thread

    decayed_alpha = plgpu.load(vectors.at[EG], layout=COL) * plgpu.load(vectors.at[ALPHA], layout=COL)
    wk_t = load_transposed(wk_smem)  # [Dk, L]
    for row, x in ((X_K, decayed_alpha * k_n), (X_Q, decayed_alpha * q_n), (K_N, k_n)):
        vectors[row] = x
    scalars[0] = col_sum(wk_t * bcast_rows(alpha_row * k_row, wk_t.shape))
    scalars[1] = col_sum(wk_t * bcast_rows(alpha_row * q_row, wk_t.shape))
    scalars[2, 0] = k_dot_q


def _kernel(slot_ref, pos_ref, mode_ref, q_ref, k_ref, v_ref, g_ref, beta_ref, a_log_ref, dt_bias_ref, *refs,
            group_size, tiles, use_qk_l2norm, scale, raw_gates, rebuild, num_programs, chunk, ordered):
    # Inputs, the row order first; outputs; scratch.
    order_ref, *refs = refs if ordered else (None, *refs)
    (ckpt_ref, ucache_ref, kcache_ref, gcache_ref, y_ref,
     stages, group_bufs, shared, wk_smem, barriers, group_barrier, rows_barrier) = refs
    vectors, scalars = shared

    def issue(b, h, tile, stage):
        """Start the tile's copies into `stages[stage]` (none for padding rows)."""
        tile_buf, u_smem, _, qk_smem, v_smem = stages[stage]
        t_smem = tuple(tile_buf)[0]
        barrier, slot, rows = barriers.at[stage], slot_ref[b], pl.ds(tile * BLOCK_V, BLOCK_V)

        @pl.when(mode_ref[b] != MODE_PAD)
        def _copies():
            plgpu.copy_gmem_to_smem(ckpt_ref.at[slot, h, rows], t_smem, barrier)
            plgpu.copy_gmem_to_smem(ucache_ref.at[slot, h, :, rows], u_smem, barrier)
            copy_token((q_ref, k_ref, v_ref), (qk_smem, v_smem), b, h, h // group_size, rows, barrier)

    def issue_group(b, h, tile):
        """Start the copies only a fresh tile reads: the key and g records, the token's g."""
        k_smem, g_smem = group_bufs

        @pl.when(mode_ref[b] != MODE_PAD)
        def _copies():
            slot = slot_ref[b]
            plgpu.copy_gmem_to_smem(kcache_ref.at[slot, h // group_size], k_smem, group_barrier)
            plgpu.copy_gmem_to_smem(gcache_ref.at[slot, h], g_smem, group_barrier)
            plgpu.copy_gmem_to_smem(g_ref.at[b, h], vectors.at[G_TOKEN], group_barrier)

    def compute(b, h, tile, stage, fresh, prefetch):
        tile_buf, u_smem, o_smem, qk_smem, v_smem = stages[stage]
        t_smem, rebuild_bufs = tuple(tile_buf)
        rows = pl.ds(tile * BLOCK_V, BLOCK_V)
        mode = mode_ref[b]
        cache_len = u_smem.shape[0]

        @pl.when(mode == MODE_PAD)
        def _padding_row():
            prefetch()
            store_output(o_smem, y_ref, plgpu.layout_cast(jnp.zeros((BLOCK_V,), o_smem.dtype), ROW), b, h, rows)

        @pl.when(mode != MODE_PAD)
        def _live_row():
            slot, pos = slot_ref[b], pos_ref[b]
            beta = beta_ref[b, h].astype(F32)
            if raw_gates:
                beta = 1.0 / (1.0 + jnp.exp(-beta))
            plgpu.barrier_wait(barriers.at[stage])

            def _head_side():
                plgpu.barrier_wait(group_barrier)
                head_side(b, h, pos, qk_smem, group_bufs, shared, wk_smem, a_log_ref, dt_bias_ref,
                          use_qk_l2norm=use_qk_l2norm, scale=scale, raw_gates=raw_gates)
                plgpu.commit_smem()  # the head's values visible; its group buffers free

            _head_side() if fresh is True else pl.when(fresh)(_head_side)

            prefetch()
            load = lambda i: plgpu.load(vectors.at[i], layout=COL, optimized=False)
            c_k, c_q = (plgpu.load(scalars.at[i], layout=COL, optimized=False) for i in (0, 1))
            v_row = plgpu.load(v_smem, layout=ROW, optimized=False).astype(F32)
            j = plgpu.broadcasted_iota(jnp.int32, (BLOCK_V, cache_len), 1, layout=WGMMA)
            u_t = jnp.where(j < pos, load_transposed(u_smem), 0.0)  # [BV, L], stale entries 0
            valid = plgpu.broadcasted_iota(jnp.int32, (cache_len,), 0, layout=COL) < pos
            s_c = plgpu.load(t_smem, layout=WGMMA).astype(F32)  # [BV, Dk]

            def readout(x_col, c):
                """`S_{t-1} (alpha x)` `[BV]` (ROW) from `x_col = e^G alpha x` and
                `c = (W * K)(alpha x)` `[L]`."""
                history = row_sum(u_t * bcast_cols(jnp.where(valid, c, 0.0), u_t.shape))
                return history + row_sum(s_c * bcast_cols(x_col, s_c.shape))

            s_k = readout(load(X_K), c_k)
            s_q = readout(load(X_Q), c_q)
            u = beta * (v_row - s_k)
            k_n = load(K_N)

            @pl.when(mode == MODE_FLUSH)
            def _flush():
                start = s_c * bcast_cols(load(EG), s_c.shape)
                plgpu.commit_smem()  # every thread has S_c from the buffer the rebuild reuses
                if rebuild == "exact":
                    # The rebuild reads single u records at a dynamic index, which the
                    # swizzled buffer cannot serve: an untiled copy (L2-resident).
                    (u_rows,) = rebuild_bufs
                    plgpu.copy_gmem_to_smem(ucache_ref.at[slot, h, :, rows], u_rows, rows_barrier)
                    plgpu.barrier_wait(rows_barrier)
                    prev = rebuild_exact(start, u_rows, wk_smem, pos)
                else:
                    prev = rebuild_mma(start, u_t, load_transposed(wk_smem), pos, rebuild_bufs)
                new = (prev * bcast_cols(load(ALPHA), prev.shape)
                       + bcast_rows(u, prev.shape) * bcast_cols(k_n, prev.shape))
                store_tile(t_smem, ckpt_ref, new, slot, h, rows)

            # After the tile's store: the persistent loop leaves only the newest store in flight.
            store_output(o_smem, y_ref, s_q + u * scalars[2, 0], b, h, rows)

            @pl.when(mode == MODE_APPEND)
            def _append():
                append_entry(ucache_ref, kcache_ref, gcache_ref, slot, h, tile, pos, u, k_n, load(G_GATED),
                             group_size=group_size)

    batch, num_heads = y_ref.shape[:2]
    serve_tiles(batch, num_heads, tiles, num_programs, issue, compute, chunk=chunk, issue_group=issue_group,
                row_order=order_ref)


def persistent_programs(*args, **kwargs) -> int:
    """`replay_decode.persistent_programs` (same arguments) for this kernel's buffers, as
    many CTAs per SM as they fit (its registers per thread are not measured)."""
    return replay_decode.persistent_programs(*args, **kwargs, scratch_of=_scratch, max_ctas=None)


@functools.lru_cache(maxsize=None)
def _build(batch, num_v_heads, head_v_dim, head_k_dim, cache_len, state_dtype, cache_dtype, qk_dtype, y_dtype,
           group_size, use_qk_l2norm, scale, raw_gates, swizzle, rebuild, programs, auto_barriers, chunk, ordered,
           interpret):
    tiles = head_v_dim // BLOCK_V
    num_programs = min(programs, batch * num_v_heads * tiles)
    scratch = _scratch(head_k_dim, cache_len, state_dtype, cache_dtype, qk_dtype, y_dtype, swizzle, rebuild,
                       STAGES if programs else 1)
    check_smem(scratch, f"replay_decode_kda_mgpu at cache_len = {cache_len}, d_k = {head_k_dim}")
    body = functools.partial(_kernel, group_size=group_size, tiles=tiles, use_qk_l2norm=use_qk_l2norm,
                             scale=scale, raw_gates=raw_gates, rebuild=rebuild, num_programs=num_programs, chunk=chunk,
                             ordered=ordered)
    return build_kernel(body, jax.ShapeDtypeStruct((batch, num_v_heads, head_v_dim), y_dtype), scratch,
                        tile_grid(batch, num_v_heads, tiles, num_programs),
                        name="replayssm_replay_decode_mgpu_kda", interpret=interpret, auto_barriers=auto_barriers)


def replay_decode_kda_mgpu(
    checkpoint: Float[Array, "N Hv Dv Dk"],
    u_cache: Float[Array, "N Hv L Dv"],
    k_cache: Float[Array, "N Hk L Dk"],
    g_cache: Float[Array, "N Hv L Dk"],
    q: Float[Array, "B Hk Dk"],
    k: Float[Array, "B Hk Dk"],
    v: Float[Array, "B Hv Dv"],
    g: Float[Array, "B Hv Dk"],
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
    """One fused ReplaySSM decode step of one KDA layer on Mosaic GPU.

    Args and returns as `pallas_kernels.replay_decode.replay_decode` with a per-channel
    gate: g `[B, H_v, d_k]` (with `gate_params = (A_log [H_v], dt_bias [H_v, d_k])` the raw
    `a`), g records `[N, H_v, L, d_k]` fp32. Returns `(y [B, H_v, d_v] in v's dtype,
    checkpoint, u_cache, k_cache, g_cache)`, the state arrays updated in place when the
    caller donates them. `row_order`: the order rows are served in, given iff
    `params.launch_order`. `interpret`: run in Mosaic GPU interpret mode (default: off GPU).
    """
    batch, num_v_heads, head_v_dim = v.shape
    head_k_dim = q.shape[-1]
    cache_len = u_cache.shape[2]
    if g_cache.shape != (*u_cache.shape[:3], head_k_dim) or g.shape != (batch, num_v_heads, head_k_dim):
        raise ValueError(f"KDA needs g_cache [N, H_v, L, d_k] and g [B, H_v, d_k] (d_k = {head_k_dim}); "
                         f"got g_cache {g_cache.shape}, g {g.shape}")
    check_kda_shapes(head_k_dim, head_v_dim, cache_len, checkpoint.dtype.itemsize, u_cache.dtype.itemsize,
                     params.swizzle)
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    check_rebuild(params.rebuild, cache_len, interpret)
    check_fma_readout(params, "replay_decode_kda_mgpu")
    check_own_layout(params, "replay_decode_kda_mgpu", launch_order=True)
    order = launch_order_input(params, row_order, batch, "replay_decode_kda_mgpu")
    a_log, dt_bias = gate_params if gate_params is not None else (jnp.zeros((1,), F32),) * 2
    # The token's q and k share one shared buffer (`[4, d_k]`): one dtype, promoted (lossless).
    qk_dtype = jnp.result_type(q.dtype, k.dtype)
    kernel = _build(
        batch, num_v_heads, head_v_dim, head_k_dim, cache_len, checkpoint.dtype, u_cache.dtype, qk_dtype, v.dtype,
        num_v_heads // q.shape[1], bool(use_qk_l2norm), float(head_k_dim ** -0.5 if scale is None else scale),
        gate_params is not None, params.swizzle, params.rebuild, params.programs, params.auto_barriers,
        params.chunk, bool(order), bool(interpret),
    )
    refs = [jax.new_ref(x) for x in (checkpoint, u_cache, k_cache, g_cache)]
    y = kernel(slot.astype(jnp.int32), pos.astype(jnp.int32), mode.astype(jnp.int32), q.astype(qk_dtype),
               k.astype(qk_dtype), v, g.astype(F32), beta, a_log, dt_bias, *order, *refs)
    return (y, *(jax.freeze(r) for r in refs))
