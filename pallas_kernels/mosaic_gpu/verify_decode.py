"""Speculative verify of a GDN draft window on Mosaic GPU (`plgpu.kernel`), one launch per step.

Grid `(B, H_v * d_v / BV)`, one warpgroup per CTA, BV = 64: CTA (b, h, t) serves value rows
`t*BV .. t*BV + BV - 1` of value head h of row b for all T window positions. Per row, `[B]`
arrays give its slot, cursor `pos`, mode and valid window length; `anc [B, T, T]` says which
window positions precede each position on its branch (a chain or a tree).

Math (as `replayssm_jax.speculative`, GDN: per-head decays, so every exponential is a
scalar). With S the row's live state before the window, G_i the sum of g over position i's
ancestors and i, and q_i, k_i after the L2 norm and the scale:

    R_i  = beta_i (v_i - e^{G_i} S k_i)
    u_i  = R_i - sum_{j in anc(i)} beta_i e^{G_i - G_j} (k_i . k_j) u_j      (forward substitution)
    y_i  = e^{G_i} S q_i + sum_{j in anc(i) + {i}} e^{G_i - G_j} (q_i . k_j) u_j

`S x` is read out as in `replay_decode` without forming S: `e^G S_c x + U^T (W * (K x))`
over the row's `pos` valid cache entries (WGMMA-layout row and column reductions, records
loaded transposed from swizzled buffers; entries at and past `pos` are masked with selects
before any product). The checkpoint tile and the records are read once for all 2T vectors.

Row modes:
- `MODE_APPEND`: the window's records go to `pos .. pos + length - 1`; the checkpoint is
  not written.
- `MODE_FLUSH` (the capacity rule folds the row): the live state S is rebuilt on chip in
  exact fp32 from the checkpoint tile in registers (newest entry first, running decay, as
  `replay_decode`), rounded to the checkpoint's dtype and stored in place; the window is
  read out from that stored value (so its records agree with what the next step replays)
  and its u records go to `0 .. length - 1`. The kernel does not write a folding row's key
  and gate records: other CTAs of the same slot may still be reading the history they
  would overwrite (the caller writes them after the launch).
- `MODE_PAD`: y = 0, nothing written.
Window positions at and past `length` give y = 0 and no records; their inputs are replaced
by zeros before use, so garbage there (NaN included) reaches nothing.

Writes in place (`jax.new_ref`): u records `[L, BV]` rows of this tile; g records (tile 0)
and k records (tile 0 of each key head's first value head) of appending rows; the folded
checkpoint tile. y `[B, T, H_v, d_v]` leaves through shared memory and one TMA copy.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
from jaxtyping import Array, Float, Int

from pallas_kernels.common import L2NORM_EPS, MODE_APPEND, MODE_FLUSH, MODE_PAD
from pallas_kernels.mosaic_gpu.layouts import (BLOCK_ROWS, COL, F32, ROW, WGMMA, bcast_cols, bcast_rows, col_sum,
                                              load_transposed, row_sum, softplus, tiled)
from pallas_kernels.mosaic_gpu.replay_decode import MosaicReplayParams, check_shapes, decay_weights, rebuild_exact

MAX_WIDTH = 16  # the window is unrolled in the kernel: code size grows as T^2


def _keep(flag, x, layout):
    """x where the scalar `flag` holds, else zeros (a select: NaN in x stays out). The
    predicate is a vector in x's layout: Mosaic selects do not broadcast a scalar one."""
    n = x.shape[0]
    mask = plgpu.broadcasted_iota(jnp.int32, (n,), 0, layout=layout) < jnp.where(flag, n, 0)
    return jnp.where(mask, x, 0.0)


def _token(i, in_window, b, hk, h, rows, refs, *, use_qk_l2norm, scale, raw_gates):
    """Position i's `(q_col, q_row, k_col, k_row, v_row, g, beta)` in fp32, q and k normalised
    and q scaled; zeros (and g = 0, beta = 0) past the row's length."""
    q_ref, k_ref, q_row_ref, k_row_ref, v_ref, g_ref, beta_ref, a_log_ref, dt_bias_ref = refs
    load = lambda ref, layout: _keep(in_window, plgpu.load(ref, layout=layout, optimized=False).astype(F32), layout)
    q_col, k_col = load(q_ref.at[b, i, hk], COL), load(k_ref.at[b, i, hk], COL)
    q_row, k_row = load(q_row_ref.at[b, i, hk], ROW), load(k_row_ref.at[b, i, hk], ROW)
    v_row = load(v_ref.at[b, i, h, rows], ROW)
    keep = lambda x: jnp.where(in_window, x, 0.0)
    q_scale, k_scale = jnp.float32(scale), jnp.float32(1.0)
    if use_qk_l2norm:
        q_scale = q_scale * lax.rsqrt(jnp.sum(q_col * q_col) + L2NORM_EPS)
        k_scale = lax.rsqrt(jnp.sum(k_col * k_col) + L2NORM_EPS)
    g = keep(g_ref[b, i, h].astype(F32))
    beta = keep(beta_ref[b, i, h].astype(F32))
    if raw_gates:
        g = keep(-jnp.exp(a_log_ref[h].astype(F32)) * softplus(g + dt_bias_ref[h].astype(F32)))
        beta = keep(1.0 / (1.0 + jnp.exp(-beta)))
    return q_col * q_scale, q_row * q_scale, k_col * k_scale, k_row * k_scale, v_row, g, beta


def _kernel(slot_ref, pos_ref, mode_ref, length_ref, anc_ref,
            q_ref, k_ref, q_row_ref, k_row_ref, v_ref, g_ref, beta_ref, a_log_ref, dt_bias_ref,
            ckpt_ref, ucache_ref, kcache_ref, gcache_ref,
            y_ref,
            t_smem, u_smem, k_smem, g_smem, o_smem, u_rows, k_rows, barrier, rows_barrier,
            *, width, group_size, tiles, use_qk_l2norm, scale, raw_gates):
    b = lax.axis_index("b")
    hv = lax.axis_index("hv")
    h, tile = hv // tiles, hv % tiles
    hk = h // group_size
    rows = pl.ds(tile * BLOCK_ROWS, BLOCK_ROWS)
    mode = mode_ref[b]
    cache_len = u_smem.shape[0]

    @pl.when(mode == MODE_PAD)
    def _padding_row():
        o_smem[...] = jnp.zeros(o_smem.shape, o_smem.dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem, y_ref.at[b, :, h, rows])

    @pl.when(mode != MODE_PAD)
    def _live_row():
        slot, pos, length = slot_ref[b], pos_ref[b], length_ref[b]
        fold = mode == MODE_FLUSH
        plgpu.copy_gmem_to_smem(ckpt_ref.at[slot, h, rows], t_smem, barrier)
        plgpu.copy_gmem_to_smem(ucache_ref.at[slot, h, :, rows], u_smem, barrier)
        plgpu.copy_gmem_to_smem(kcache_ref.at[slot, hk], k_smem, barrier)
        plgpu.copy_gmem_to_smem(gcache_ref.at[slot, h], g_smem, barrier)

        @pl.when(fold)
        def _fetch_rows():
            # The rebuild reads single records at a dynamic index, which the swizzled
            # buffers cannot serve: folding rows fetch an untiled copy (L2-resident).
            plgpu.copy_gmem_to_smem(ucache_ref.at[slot, h, :, rows], u_rows, rows_barrier)
            plgpu.copy_gmem_to_smem(kcache_ref.at[slot, hk], k_rows, rows_barrier)

        refs = (q_ref, k_ref, q_row_ref, k_row_ref, v_ref, g_ref, beta_ref, a_log_ref, dt_bias_ref)
        tokens = [_token(i, i < length, b, hk, h, rows, refs, use_qk_l2norm=use_qk_l2norm, scale=scale,
                         raw_gates=raw_gates) for i in range(width)]
        q_col, q_row, k_col, k_row, v_row, g, beta = (list(x) for x in zip(*tokens))
        # anc[i][j] for j < i (a position's ancestors precede it).
        anc = [[anc_ref[b, i, j] != 0 for j in range(i)] for i in range(width)]
        G = []
        for i in range(width):
            total = g[i]
            for j in range(i):
                total = total + jnp.where(anc[i][j], g[j], 0.0)
            G.append(total)

        plgpu.barrier_wait(barrier)
        weights, decay_total = decay_weights(g_smem, pos, cache_len)
        s_c = plgpu.load(t_smem, layout=WGMMA).astype(F32)  # [BV, Dk]

        @pl.when(fold)
        def _wait_rows():
            plgpu.barrier_wait(rows_barrier)

        # A folding row's live state, rebuilt with its whole history and rounded as stored;
        # other rows run the loop zero times and keep S_c (their history is read out below).
        rebuilt = rebuild_exact(s_c, jnp.where(fold, decay_total, 1.0), u_rows, k_rows, g_smem,
                                jnp.where(fold, pos, 0))
        s_eff = rebuilt.astype(t_smem.dtype).astype(F32)
        history_len = jnp.where(fold, 0, pos)
        decay_eff = jnp.where(fold, 1.0, decay_total)

        @pl.when(fold)
        def _store_checkpoint():
            t_smem[...] = s_eff.astype(t_smem.dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(t_smem, ckpt_ref.at[slot, h, rows])

        keys_t = load_transposed(k_smem)  # [Dk, L]
        j_tile = plgpu.broadcasted_iota(jnp.int32, (BLOCK_ROWS, cache_len), 1, layout=WGMMA)
        u_t = jnp.where(j_tile < history_len, load_transposed(u_smem), 0.0)  # [BV, L], stale entries 0
        valid = plgpu.broadcasted_iota(jnp.int32, (cache_len,), 0, layout=COL) < history_len

        def readout(x_col, x_row):
            """`S x` `[BV]` (ROW) for x given in both layouts."""
            c = col_sum(keys_t * bcast_rows(x_row, keys_t.shape))  # K x, [L]
            c = jnp.where(valid, c * weights, 0.0)
            history = row_sum(u_t * bcast_cols(c, u_t.shape))
            return history + decay_eff * row_sum(s_eff * bcast_cols(x_col, s_eff.shape))

        base = jnp.where(fold, 0, pos)
        u = []
        for i in range(width):
            decay_i = jnp.exp(G[i])
            u_i = beta[i] * (v_row[i] - decay_i * readout(k_col[i], k_row[i]))
            for j in range(i):
                coef = jnp.where(anc[i][j], jnp.exp(jnp.where(anc[i][j], G[i] - G[j], 0.0)), 0.0)
                u_i = u_i - (beta[i] * coef * jnp.sum(k_col[i] * k_col[j])) * u[j]
            u.append(u_i)
            y_i = decay_i * readout(q_col[i], q_row[i]) + jnp.sum(q_col[i] * k_col[i]) * u_i
            for j in range(i):
                coef = jnp.where(anc[i][j], jnp.exp(jnp.where(anc[i][j], G[i] - G[j], 0.0)), 0.0)
                y_i = y_i + (coef * jnp.sum(q_col[i] * k_col[j])) * u[j]
            o_smem[i] = _keep(i < length, y_i, ROW).astype(o_smem.dtype)

            @pl.when(i < length)
            def _append_u():
                ucache_ref[slot, h, base + i, rows] = u_i.astype(ucache_ref.dtype)

            @pl.when((i < length) & (mode == MODE_APPEND) & (tile == 0))
            def _append_gate():
                gcache_ref[slot, h, base + i] = g[i]

            @pl.when((i < length) & (mode == MODE_APPEND) & (tile == 0) & (h % group_size == 0))
            def _append_key():
                kcache_ref[slot, hk, base + i] = k_col[i].astype(kcache_ref.dtype)

        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem, y_ref.at[b, :, h, rows])

    plgpu.wait_smem_to_gmem(0)


@functools.lru_cache(maxsize=None)
def _build(batch, width, num_v_heads, head_v_dim, head_k_dim, cache_len, state_dtype, cache_dtype, y_dtype,
           group_size, use_qk_l2norm, scale, raw_gates, swizzle, interpret):
    tiles = head_v_dim // BLOCK_ROWS
    body = functools.partial(_kernel, width=width, group_size=group_size, tiles=tiles,
                             use_qk_l2norm=use_qk_l2norm, scale=scale, raw_gates=raw_gates)
    return plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((batch, width, num_v_heads, head_v_dim), y_dtype),
        scratch_types=[
            plgpu.SMEM((BLOCK_ROWS, head_k_dim), state_dtype, transforms=tiled(swizzle, state_dtype)),
            plgpu.SMEM((cache_len, BLOCK_ROWS), cache_dtype, transforms=tiled(128, cache_dtype)),
            plgpu.SMEM((cache_len, head_k_dim), cache_dtype, transforms=tiled(128, cache_dtype)),
            plgpu.SMEM((cache_len,), F32),
            plgpu.SMEM((width, BLOCK_ROWS), y_dtype),
            plgpu.SMEM((cache_len, BLOCK_ROWS), cache_dtype),
            plgpu.SMEM((cache_len, head_k_dim), cache_dtype),
            plgpu.Barrier(num_arrivals=4),
            plgpu.Barrier(num_arrivals=2),
        ],
        grid=(batch, num_v_heads * tiles),
        grid_names=("b", "hv"),
        interpret=plgpu.InterpretGPUParams() if interpret else None,
        kernel_name="replayssm_verify_decode_mgpu",
    )


def verify_decode_mgpu(
    checkpoint: Float[Array, "N Hv Dv Dk"],
    u_cache: Float[Array, "N Hv L Dv"],
    k_cache: Float[Array, "N Hk L Dk"],
    g_cache: Float[Array, "N Hv L"],
    q: Float[Array, "B T Hk Dk"],
    k: Float[Array, "B T Hk Dk"],
    v: Float[Array, "B T Hv Dv"],
    g: Float[Array, "B T Hv"],
    beta: Float[Array, "B T Hv"],
    slot: Int[Array, " B"],
    pos: Int[Array, " B"],
    mode: Int[Array, " B"],
    length: Int[Array, " B"],
    anc: Int[Array, "B T T"],
    *,
    use_qk_l2norm: bool = False,
    scale: float | None = None,
    gate_params: tuple[Array, Array] | None = None,
    params: MosaicReplayParams = MosaicReplayParams(),
    interpret: bool | None = None,
):
    """Verify one GDN draft window per row on Mosaic GPU (one launch).

    Args:
      checkpoint, u_cache, k_cache, g_cache: the layer's state pools (GDN: per-head decays).
      q, k, v, g, beta: the window's tokens, raw q/k (normalised in the kernel when
        `use_qk_l2norm`), g and beta activated, or raw `a`, `b` with `gate_params =
        (A_log [H_v], dt_bias [H_v])`.
      slot, pos, mode: per row its slot, cursor and `common.MODE_*` (`MODE_FLUSH`: fold the
        history into the checkpoint first).
      length: per row the valid window length in [0, T] (`pos + length <= L` unless folding).
      anc: `[B, T, T]` int, nonzero where position j precedes position i on i's branch
        (only j < i is read).
      use_qk_l2norm, scale, gate_params: as `replay_decode_mgpu`.
      params: the checkpoint tile's swizzle (`MosaicReplayParams`).
      interpret: run in Mosaic GPU interpret mode (default: off GPU).

    Returns:
      `(y [B, T, H_v, d_v] in v's dtype, checkpoint, u_cache, k_cache, g_cache)`, the state
      arrays updated in place when the caller donates them (see the module doc for which
      records the kernel writes).
    """
    batch, width, num_v_heads, head_v_dim = v.shape
    head_k_dim = q.shape[-1]
    cache_len = u_cache.shape[2]
    if g_cache.ndim != 3:
        raise ValueError(f"verify_decode_mgpu supports per-head (GDN) decay only; g_cache has shape {g_cache.shape}")
    if not 1 <= width <= min(MAX_WIDTH, cache_len):
        raise ValueError(f"verify_decode_mgpu needs a window width T in [1, min({MAX_WIDTH}, L = {cache_len})], "
                         f"got T = {width}")
    if anc.shape != (batch, width, width):
        raise ValueError(f"anc must have shape {(batch, width, width)}, got {anc.shape}")
    check_shapes(head_k_dim, head_v_dim, cache_len, checkpoint.dtype.itemsize, params.swizzle)
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    a_log, dt_bias = gate_params if gate_params is not None else (jnp.zeros((1,), F32),) * 2
    kernel = _build(
        batch, width, num_v_heads, head_v_dim, head_k_dim, cache_len, checkpoint.dtype, u_cache.dtype, v.dtype,
        num_v_heads // q.shape[2], bool(use_qk_l2norm), float(head_k_dim ** -0.5 if scale is None else scale),
        gate_params is not None, params.swizzle, bool(interpret),
    )
    refs = [jax.new_ref(x) for x in (checkpoint, u_cache, k_cache, g_cache)]
    i32 = lambda x: x.astype(jnp.int32)
    y = kernel(i32(slot), i32(pos), i32(mode), i32(length), i32(anc), q, k, q, k, v, g, beta, a_log, dt_bias, *refs)
    return (y, *(jax.freeze(r) for r in refs))
