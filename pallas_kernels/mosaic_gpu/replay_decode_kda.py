"""Fused ReplaySSM decode step for KDA (per-channel decay) on Mosaic GPU, one launch per step.

The GDN kernel's structure (`replay_decode.py`: grid `(B, H_v * d_v / BV)`, one warpgroup
per `[BV, d_k]` tile, TMA of the checkpoint tile and the swizzled u / k record tiles, pad /
append / flush per row, in-place writes) with a log-decay per key channel: g `[B, H_v,
d_k]` per token and g records `[N, H_v, L, d_k]` (fp32, one per value head).

Step math (as `backends.xla`): with `G = sum_{j<pos} g_j` and
`W_j = exp(sum_{j<i<pos} g_i)` per channel (`[d_k]`), alpha = e^{g_t},

    S_{t-1} x = S_c (e^G * x) + sum_{j<pos} u_j ((W_j * k_j) . x)

for x = alpha * k and alpha * q, never forming `S_{t-1}`; then
`u = beta (v - S_{t-1}(alpha k))`, `y = S_{t-1}(alpha q) + u (k . q)`.

Decay weights (the part GDN does not have): the suffix sums `log W_j` run along the ring
in `channel_layout` over the untiled g records `[L, d_k]`, where thread c % 128 holds
channel c of every entry in registers: newest entry first, each step one shared-memory
load, one select (stale entries, NaN included, add 0), one add and one exp per thread, in
fp32 (the spec's `exp(G - c_j)` summed in another order); no cross-thread work, O(L) per
thread where a running sum in `ROW` writing each column of `W^T` by selects costs
O(L^2). `W` (`[L, d_k]`; 1 at and past `pos`, where the readout
selects c to 0 and the rebuild never reads) is stored to a swizzled buffer and read back
transposed, `W^T [d_k, L]` in `WGMMA` like the key records, and
`e^G` and alpha go through a `[2, d_k]` buffer into `COL` (one warpgroup barrier serves
all three).

Layouts of the readout (`WGMMA` family as in the GDN kernel):
- `WK^T = W^T * K^T` `[d_k, L]`, formed once and shared by both readouts:
  `c = WK x` is a column reduction into `COL [L]`, x broadcast from `ROW [d_k]`; stale
  columns of c are selected to 0 before `U^T c`.
- `U^T [BV, L]` (stale entries selected to 0): `U^T c` a row reduction into `ROW [BV]`.
- `S_c [BV, d_k]`: `S_c (e^G * x)` a row reduction into `ROW [BV]`, `e^G * x` in `COL`.

Append rows store u at `pos` (and g `[d_k]` from tile 0, k from tile 0 of the first value
head of each key head). Flush rows rebuild `S_{t-1} = e^G S_c + sum_j u_j (W_j * k_j)^T`
from the `S_c` tile already in registers in exact fp32 on CUDA cores (one fused
multiply-add per element and entry, newest entry first): `W_j * k_j` is formed in
`channel_layout` and written over the g records' buffer (its rows are read at a dynamic
index, which swizzled buffers cannot serve), and the u records come in an untiled copy.
They store `S_t = S_{t-1} diag(alpha) + u k^T` in place; the checkpoint is read from
memory once per step.
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
from pallas_kernels.mosaic_gpu.layouts import (COL, F32, ROW, WGMMA, bcast_cols, bcast_rows, col_sum,
                                              check_smem, copy_replay_tile, load_transposed, row_sum, softplus, tiled)
from pallas_kernels.mosaic_gpu.replay_decode import (BLOCK_V, MosaicReplayParams, append_entry, check_shapes,
                                                     load_qk, store_output, store_tile)

SMEM_BYTES = 227 * 1024  # shared memory one CTA may use on the H100 / H200


def channel_layout(head_k_dim: int):
    """The layout of an `[R, d_k]` array with channel c of every row in thread c % 128
    (warp c // 32 % 4, lane c % 32) and the rows in registers, so that sums along R are
    thread-local. d_k = 64 fills two warps, which the other two replicate."""
    width = min(head_k_dim, 128)
    warps = (plgpu.Replicated(128 // width), -3) if width < 128 else (-3,)
    return plgpu.Layout.TILED(plgpu.Tiling(((1, width), (32,), (1,))), warp_dims=warps, lane_dims=(-2,),
                              vector_dim=-1)


def smem_bytes(head_k_dim: int, cache_len: int, state_itemsize: int, cache_itemsize: int) -> int:
    """Shared memory of one CTA: the checkpoint tile, the swizzled u / k records, the g
    records (fp32, reused for `W * K` on flush rows), `W`, the `[2, d_k]` relayout buffer,
    y and the untiled u copy of flush rows."""
    tile = BLOCK_V * head_k_dim * state_itemsize
    records = cache_len * (2 * BLOCK_V + head_k_dim) * cache_itemsize + 2 * cache_len * head_k_dim * 4
    return tile + records + 2 * head_k_dim * 4 + BLOCK_V * 4


def check_kda_shapes(head_k_dim: int, head_v_dim: int, cache_len: int, state_itemsize: int,
                     cache_itemsize: int, swizzle: int = 128) -> None:
    """Raise ValueError unless the shapes fit the KDA kernel's layouts and shared memory."""
    check_shapes(head_k_dim, head_v_dim, cache_len, state_itemsize, swizzle)
    if head_k_dim > 128 and head_k_dim % 128:
        raise ValueError(f"mosaic_gpu KDA needs d_k = 64 or a multiple of 128, got d_k = {head_k_dim}")
    need = smem_bytes(head_k_dim, cache_len, state_itemsize, cache_itemsize)
    if need > SMEM_BYTES:
        raise ValueError(f"mosaic_gpu KDA with d_k = {head_k_dim}, cache_len = {cache_len} needs {need} bytes "
                         f"of shared memory per CTA, more than {SMEM_BYTES}")


def decay_weights(g_smem, w_smem, chan_smem, pos, channels):
    """`W [L, d_k]` into `w_smem` (`W_j = exp(sum_{j<i<pos} g_i)` for j < pos, 1 past it)
    and `e^G` into row 0 of `chan_smem`, from the g records `g_smem [L, d_k]`.

    The suffix sums run newest entry first in `channels`; an entry at or past `pos` adds 0
    through a select, so a stale g (NaN included) is never used."""
    cache_len, head_k_dim = g_smem.shape
    running = plgpu.layout_cast(jnp.zeros((1, head_k_dim), F32), channels)
    weights = [None] * cache_len
    for i in reversed(range(cache_len)):
        live = jnp.broadcast_to(i < pos, (1, head_k_dim))
        weights[i] = jnp.exp(running)
        g_i = plgpu.load(g_smem.at[pl.ds(i, 1)], layout=channels, optimized=False)
        running = running + jnp.where(live, g_i, 0.0)
    w_smem[...] = jnp.concatenate(weights, axis=0)
    chan_smem[pl.ds(0, 1)] = jnp.exp(running)


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


def _kernel(slot_ref, pos_ref, mode_ref, q_ref, k_ref, q_row_ref, k_row_ref, v_ref, g_ref, beta_ref, a_log_ref,
            dt_bias_ref,
            ckpt_ref, ucache_ref, kcache_ref, gcache_ref,
            y_ref,
            t_smem, u_smem, k_smem, g_smem, w_smem, chan_smem, o_smem, u_rows, barrier, rows_barrier,
            *, group_size, tiles, use_qk_l2norm, scale, raw_gates):
    b = lax.axis_index("b")
    hv = lax.axis_index("hv")
    h, tile = hv // tiles, hv % tiles
    hk = h // group_size
    rows = pl.ds(tile * BLOCK_V, BLOCK_V)
    mode = mode_ref[b]
    cache_len, head_k_dim = g_smem.shape
    channels = channel_layout(head_k_dim)

    @pl.when(mode == MODE_PAD)
    def _padding_row():
        store_output(o_smem, y_ref, plgpu.layout_cast(jnp.zeros((BLOCK_V,), o_smem.dtype), ROW), b, h, rows)

    @pl.when(mode != MODE_PAD)
    def _live_row():
        slot, pos = slot_ref[b], pos_ref[b]
        copy_replay_tile((ckpt_ref, ucache_ref, kcache_ref, gcache_ref), (t_smem, u_smem, k_smem, g_smem),
                         slot, h, hk, rows, barrier)

        # The token, while the copies fly. The gates are computed in ROW (few values per
        # thread); alpha reaches COL through shared memory with e^G below.
        q_col, k_col, q_row, k_row, k_dot_q = load_qk(*(ref.at[b, hk] for ref in (q_ref, k_ref, q_row_ref, k_row_ref)),
                                                      use_qk_l2norm=use_qk_l2norm, scale=scale)
        g = plgpu.load(g_ref.at[b, h], layout=ROW, optimized=False).astype(F32)
        beta = beta_ref[b, h].astype(F32)
        if raw_gates:
            dt_bias = plgpu.load(dt_bias_ref.at[h], layout=ROW, optimized=False).astype(F32)
            g = -jnp.exp(a_log_ref[h].astype(F32)) * softplus(g + dt_bias)
            beta = 1.0 / (1.0 + jnp.exp(-beta))
        alpha_row = jnp.exp(g)
        chan_smem[1] = alpha_row
        v_row = plgpu.load(v_ref.at[b, h, rows], layout=ROW, optimized=False).astype(F32)

        plgpu.barrier_wait(barrier)
        decay_weights(g_smem, w_smem, chan_smem, pos, channels)
        plgpu.commit_smem()  # W, e^G and alpha visible to every thread
        decayed_alpha = plgpu.load(chan_smem.at[0], layout=COL) * plgpu.load(chan_smem.at[1], layout=COL)
        wk_t = load_transposed(w_smem) * load_transposed(k_smem)  # [Dk, L]; stale columns 0 or NaN
        j = plgpu.broadcasted_iota(jnp.int32, (BLOCK_V, cache_len), 1, layout=WGMMA)
        u_t = jnp.where(j < pos, load_transposed(u_smem), 0.0)  # [BV, L], stale entries 0
        valid = plgpu.broadcasted_iota(jnp.int32, (cache_len,), 0, layout=COL) < pos
        s_c = plgpu.load(t_smem, layout=WGMMA).astype(F32)  # [BV, Dk]

        def readout(x_col, x_row):
            """`S_{t-1} (alpha * x)` `[BV]` (ROW) from `e^G * alpha * x` in COL and
            `alpha * x` in ROW."""
            c = jnp.where(valid, col_sum(wk_t * bcast_rows(x_row, wk_t.shape)), 0.0)  # (W * K) x, [L]
            history = row_sum(u_t * bcast_cols(c, u_t.shape))
            return history + row_sum(s_c * bcast_cols(x_col, s_c.shape))

        s_k = readout(decayed_alpha * k_col, alpha_row * k_row)
        s_q = readout(decayed_alpha * q_col, alpha_row * q_row)
        u = beta * (v_row - s_k)
        store_output(o_smem, y_ref, s_q + u * k_dot_q, b, h, rows)

        @pl.when(mode == MODE_APPEND)
        def _append():
            append_entry(ucache_ref, kcache_ref, gcache_ref, slot, h, tile, pos, u, k_col, g, group_size=group_size)

        @pl.when(mode == MODE_FLUSH)
        def _flush():
            plgpu.copy_gmem_to_smem(ucache_ref.at[slot, h, :, rows], u_rows, rows_barrier)
            # The g records were last read before the barrier above: their buffer takes W * K.
            weighted_keys(w_smem, k_smem, g_smem, channels)
            plgpu.commit_smem()
            plgpu.barrier_wait(rows_barrier)
            # e^G and alpha again from shared memory rather than held in registers through the readout.
            decay_col = plgpu.load(chan_smem.at[0], layout=COL)
            alpha_col = plgpu.load(chan_smem.at[1], layout=COL)
            prev = rebuild_exact(s_c * bcast_cols(decay_col, s_c.shape), u_rows, g_smem, pos)
            new = prev * bcast_cols(alpha_col, prev.shape) + bcast_rows(u, prev.shape) * bcast_cols(k_col, prev.shape)
            store_tile(t_smem, ckpt_ref, new, slot, h, rows)

    plgpu.wait_smem_to_gmem(0)


@functools.lru_cache(maxsize=None)
def _build(batch, num_v_heads, head_v_dim, head_k_dim, cache_len, state_dtype, cache_dtype, y_dtype,
           group_size, use_qk_l2norm, scale, raw_gates, swizzle, auto_barriers, interpret):
    tiles = head_v_dim // BLOCK_V
    body = functools.partial(_kernel, group_size=group_size, tiles=tiles, use_qk_l2norm=use_qk_l2norm,
                             scale=scale, raw_gates=raw_gates)
    scratch = [
        plgpu.SMEM((BLOCK_V, head_k_dim), state_dtype, transforms=tiled(swizzle, state_dtype)),
        plgpu.SMEM((cache_len, BLOCK_V), cache_dtype, transforms=tiled(128, cache_dtype)),
        plgpu.SMEM((cache_len, head_k_dim), cache_dtype, transforms=tiled(128, cache_dtype)),
        plgpu.SMEM((cache_len, head_k_dim), F32),  # g records, then W * K on flush rows
        plgpu.SMEM((cache_len, head_k_dim), F32, transforms=tiled(128, F32)),  # W
        plgpu.SMEM((2, head_k_dim), F32),  # e^G and alpha
        plgpu.SMEM((BLOCK_V,), y_dtype),
        plgpu.SMEM((cache_len, BLOCK_V), cache_dtype),
        plgpu.Barrier(num_arrivals=4),
        plgpu.Barrier(num_arrivals=1),
    ]
    check_smem(scratch, f"replay_decode_kda_mgpu at cache_len = {cache_len}, d_k = {head_k_dim}")
    return plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((batch, num_v_heads, head_v_dim), y_dtype),
        scratch_types=scratch,
        grid=(batch, num_v_heads * tiles),
        grid_names=("b", "hv"),
        compiler_params=plgpu.CompilerParams(unsafe_no_auto_barriers=not auto_barriers),
        interpret=plgpu.InterpretGPUParams() if interpret else None,
        kernel_name="replayssm_replay_decode_mgpu_kda",
    )


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
    interpret: bool | None = None,
):
    """One fused ReplaySSM decode step of one KDA layer on Mosaic GPU.

    Args and returns as `pallas_kernels.replay_decode.replay_decode` with a per-channel
    gate: g `[B, H_v, d_k]` (with `gate_params = (A_log [H_v], dt_bias [H_v, d_k])` the raw
    `a`), g records `[N, H_v, L, d_k]` fp32. Returns `(y [B, H_v, d_v] in v's dtype,
    checkpoint, u_cache, k_cache, g_cache)`, the state arrays updated in place when the
    caller donates them. `interpret`: run in Mosaic GPU interpret mode (default: off GPU).
    """
    batch, num_v_heads, head_v_dim = v.shape
    head_k_dim = q.shape[-1]
    cache_len = u_cache.shape[2]
    if g_cache.shape != (*u_cache.shape[:3], head_k_dim) or g.shape != (batch, num_v_heads, head_k_dim):
        raise ValueError(f"KDA needs g_cache [N, H_v, L, d_k] and g [B, H_v, d_k] (d_k = {head_k_dim}); "
                         f"got g_cache {g_cache.shape}, g {g.shape}")
    check_kda_shapes(head_k_dim, head_v_dim, cache_len, checkpoint.dtype.itemsize, u_cache.dtype.itemsize,
                     params.swizzle)
    if params.rebuild != "exact":
        raise ValueError(f"replay_decode_kda_mgpu rebuilds in exact fp32 only, got rebuild={params.rebuild!r}")
    if params.programs:
        raise ValueError(f"replay_decode_kda_mgpu runs one CTA per tile: programs must be 0, got {params.programs}")
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    a_log, dt_bias = gate_params if gate_params is not None else (jnp.zeros((1,), F32),) * 2
    kernel = _build(
        batch, num_v_heads, head_v_dim, head_k_dim, cache_len, checkpoint.dtype, u_cache.dtype, v.dtype,
        num_v_heads // q.shape[1], bool(use_qk_l2norm), float(head_k_dim ** -0.5 if scale is None else scale),
        gate_params is not None, params.swizzle, params.auto_barriers, bool(interpret),
    )
    refs = [jax.new_ref(x) for x in (checkpoint, u_cache, k_cache, g_cache)]
    y = kernel(slot.astype(jnp.int32), pos.astype(jnp.int32), mode.astype(jnp.int32), q, k, q, k, v, g, beta,
               a_log, dt_bias, *refs)
    return (y, *(jax.freeze(r) for r in refs))
