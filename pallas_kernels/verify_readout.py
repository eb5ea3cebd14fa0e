"""Replay readouts of a speculative verify window (GDN and KDA), one launch per layer step.

Grid `(B, H_v, d_v // BV)` (launched reversed with `GridOrder.ROW_SLOWEST`): one program per
(row, value head, BV-row tile of the state). For the T window vectors `x_t` of each of two
sets (the caller passes `x = exp(G_t) * k_t` and `exp(G_t) * q_t`, G_t the window's
cumulative log-decay up to and including position t, per key channel), each program returns
`S x_t` for the row's live state S (the state before the window) without forming it:

    S x = S_c (e^G * x) + sum_j u_j (k_j . (W_j * x))         (GDN: e^G, W_j scalars)

with G the sum of the valid cache entries' log-decays and `W_j = exp(sum_{j<i<pos} g_i)`.
The checkpoint tile `S_c [BV, d_k]` is read once and the row's `pos` valid cache entries are
loaded once (masked: entries at and past `pos` are never read, so a stale entry, NaN
included, cannot contribute), then reused for all 2T vectors.

Rows in `MODE_FLUSH` (a verify row that must fold its history first) rebuild the tile on
chip entry by entry in fp32 (`replay_decode.rebuild_exact`), round it to the checkpoint's
dtype, store it in place (aliased), and read out from the stored value, so the readouts
agree with what the next step replays from that checkpoint. `MODE_PAD` rows return zeros and
touch nothing.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
from jaxtyping import Array, Float, Int

from pallas_kernels import common
from pallas_kernels.common import GridOrder
from pallas_kernels.replay_decode import rebuild_exact
from pallas_kernels.replay_decode_grouped import cache_block_len


@dataclasses.dataclass(frozen=True)
class VerifyReadoutParams:
    """Launch parameters of `verify_readout`.

    Attributes:
      block_v: BV, value rows of the state per program (a power of two; capped at d_v).
      num_warps: warps per program.
      rebuild_unroll: U, cache entries a folding row's exact rebuild loads per memory round
        trip (the result is the same for every U).
      grid_order: ROW_FASTEST or ROW_SLOWEST.
    """

    block_v: int = 32
    num_warps: int = 4
    rebuild_unroll: int = 2
    grid_order: GridOrder = GridOrder.ROW_SLOWEST

    def __post_init__(self) -> None:
        common.check_launch(self, (GridOrder.ROW_FASTEST, GridOrder.ROW_SLOWEST))
        common.check_rebuild_unroll(self.rebuild_unroll)


def _readout_kernel(
    slot_ref, pos_ref, mode_ref, xk_ref, xq_ref, _ckpt_in, ucache_ref, kcache_ref, gcache_ref,
    sk_ref, sq_ref, ckpt_ref,
    *, per_channel: bool, group_size: int, width: int, block_v: int, cache_block: int, unroll: int,
    grid_order: GridOrder,
):
    b, h, tile = common.program_ids(grid_order)
    cols = pl.ds(tile * block_v, block_v)
    mode = mode_ref[b]
    whole = (pl.ds(0, xk_ref.shape[3]),)
    load_x = lambda ref, t: ref[b, h, t, :].astype(jnp.float32)

    def store(readouts):
        for t, (s_k, s_q) in enumerate(readouts):
            sk_ref[b, h, t, cols] = s_k.astype(sk_ref.dtype)
            sq_ref[b, h, t, cols] = s_q.astype(sq_ref.dtype)

    @pl.when(mode == common.MODE_PAD)
    def _padding_row():
        zeros = jnp.zeros((block_v,), jnp.float32)
        store([(zeros, zeros)] * width)

    @pl.when(mode == common.MODE_APPEND)
    def _replay_row():
        slot, pos = slot_ref[b], pos_ref[b]
        live = jnp.arange(cache_block) < pos
        live2 = live[:, None]
        entries = pl.ds(0, cache_block)
        s_c = ckpt_ref[slot, h, cols, :].astype(jnp.float32)  # [BV, Dk]
        k_c = plgpu.load(kcache_ref.at[slot, h // group_size, entries, :], mask=live2, other=0.0)
        u_c = plgpu.load(ucache_ref.at[slot, h, entries, cols], mask=live2, other=0.0)
        k_c, u_c = k_c.astype(jnp.float32), u_c.astype(jnp.float32)  # [Lb, Dk], [Lb, BV]
        if per_channel:
            g_c = plgpu.load(gcache_ref.at[slot, h, entries, :], mask=live2, other=0.0)
            g_c = g_c.astype(jnp.float32)
            total = jnp.sum(g_c, axis=0)  # [Dk]
            w_keys = k_c * jnp.where(live2, jnp.exp(total[None, :] - jnp.cumsum(g_c, axis=0)), 0.0)
            decay = jnp.exp(total)[None, :]
        else:
            g_c = plgpu.load(gcache_ref.at[slot, h, entries], mask=live, other=0.0).astype(jnp.float32)
            total = jnp.sum(g_c, axis=0)
            w_keys = k_c * jnp.where(live, jnp.exp(total - jnp.cumsum(g_c, axis=0)), 0.0)[:, None]
            decay = jnp.exp(total)
        s_c = s_c * decay  # S_c diag(e^G), shared by every vector

        def readout(x):
            return jnp.sum(s_c * x[None, :], axis=1) + jnp.sum(
                u_c * jnp.sum(w_keys * x[None, :], axis=1)[:, None], axis=0)

        store([(readout(load_x(xk_ref, t)), readout(load_x(xq_ref, t))) for t in range(width)])

    @pl.when(mode == common.MODE_FLUSH)
    def _folding_row():
        slot, pos = slot_ref[b], pos_ref[b]
        spec = common.TokenSpec(group_size=group_size, per_channel_gate=per_channel, raw_gates=False,
                                use_qk_l2norm=False, scale=1.0)
        s_c = ckpt_ref[slot, h, cols, :].astype(jnp.float32)
        if per_channel:
            g_c = plgpu.load(gcache_ref.at[slot, h, pl.ds(0, cache_block), :],
                             mask=(jnp.arange(cache_block) < pos)[:, None], other=0.0)
            decay = (jnp.exp(jnp.sum(g_c.astype(jnp.float32), axis=0)),)
        else:
            g_c = plgpu.load(gcache_ref.at[slot, h, pl.ds(0, cache_block)],
                             mask=jnp.arange(cache_block) < pos, other=0.0)
            decay = jnp.exp(jnp.sum(g_c.astype(jnp.float32)))
        (prev,) = rebuild_exact(spec, (ucache_ref, kcache_ref, gcache_ref), slot, h, cols, whole, pos,
                                (s_c,), decay, unroll)
        stored = prev.astype(ckpt_ref.dtype)
        ckpt_ref[slot_ref[b], h, cols, :] = stored
        stored = stored.astype(jnp.float32)
        readout = lambda x: jnp.sum(stored * x[None, :], axis=1)
        store([(readout(load_x(xk_ref, t)), readout(load_x(xq_ref, t))) for t in range(width)])


def verify_readout(
    checkpoint: Float[Array, "N Hv Dv Dk"],
    u_cache: Float[Array, "N Hv L Dv"],
    k_cache: Float[Array, "N Hk L Dk"],
    g_cache: Float[Array, "N Hv L *Dk"],
    xk: Float[Array, "B Hv T Dk"],
    xq: Float[Array, "B Hv T Dk"],
    slot: Int[Array, " B"],
    pos: Int[Array, " B"],
    mode: Int[Array, " B"],
    *,
    params: VerifyReadoutParams = VerifyReadoutParams(),
    interpret: bool | None = None,
):
    """Replay readouts `S x` of the live state of each row for the window's vectors.

    Args:
      checkpoint, u_cache, k_cache, g_cache: the layer's state arrays (the checkpoint is
        updated in place for folding rows when donated; the caches are only read).
      xk, xq: `[B, H_v, T, d_k]` float32 vectors per value head (e.g. `exp(G_t) * k_t`).
      slot: `[B]` int32 slot of each row (any valid index on padding rows).
      pos: `[B]` int32 valid cache entries of the row's slot.
      mode: `[B]` int32, `common.MODE_PAD` (zeros, nothing read), `MODE_APPEND` (replay
        readout) or `MODE_FLUSH` (fold the history into the checkpoint, read out from it).
      params: tile, warps, rebuild unroll and grid order.
      interpret: run the kernel in the Pallas interpreter (default: off GPU).

    Returns:
      `(S xk [B, H_v, T, d_v], S xq [B, H_v, T, d_v], checkpoint)`, readouts in float32.
    """
    batch, num_v_heads, width, _ = xk.shape
    head_v_dim = u_cache.shape[3]
    params = common.for_head_dim(params, head_v_dim)
    kernel = functools.partial(
        _readout_kernel, per_channel=g_cache.ndim == 4, group_size=num_v_heads // k_cache.shape[1],
        width=width, block_v=params.block_v, cache_block=cache_block_len(u_cache.shape[2]),
        unroll=params.rebuild_unroll, grid_order=params.grid_order,
    )
    grid = (batch, num_v_heads, head_v_dim // params.block_v)
    readout = jax.ShapeDtypeStruct((batch, num_v_heads, width, head_v_dim), jnp.float32)
    operands = (slot, pos, mode, xk, xq, checkpoint, u_cache, k_cache, g_cache)
    spec = common.any_spec()
    return pl.pallas_call(
        kernel,
        out_shape=(readout, readout, jax.ShapeDtypeStruct(checkpoint.shape, checkpoint.dtype)),
        grid=tuple(reversed(grid)) if params.grid_order.row_slowest else grid,
        in_specs=[spec] * len(operands),
        out_specs=[spec] * 3,
        input_output_aliases={5: 2},
        compiler_params=plgpu.CompilerParams(num_warps=params.num_warps, num_stages=1),
        interpret=common.default_interpret() if interpret is None else interpret,
        name="replayssm_verify_readout",
    )(*operands)
