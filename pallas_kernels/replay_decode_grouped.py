"""Fused ReplaySSM decode step, key-head-grouped layout (GDN and KDA).

Grid `(B, H_k, P / T)` (launched reversed with a row-slowest `grid_order`; the row axis in
`row_order` with the launch-order grids, as in `replay_decode`) with P = r * d_v / BV
(value-head tiles of one key-head group) and T = `tiles_per_program`: each program serves
T (value head, BV-tile) pairs of one row and one key head. The key-side work of the replay
is done once per program instead of once per tile: the program loads the key head's valid
cache entries `K [L, d_k]` once and, for GDN, reduces them to `K k` and `K q` (`[L]`); each
tile then only needs its value head's g entries (`[L]`), its u entries (`[L, BV]`) and its
checkpoint tile (`[BV, d_k]`). Every `[., d_k]` operand is held as `[., W]` column chunks.

    S_{t-1}(alpha x) = alpha (e^G S_c x + U^T (w * K x)),   w_j = exp(G - c_j)   (GDN)
    S_{t-1}(alpha x) = S_c (e^G * alpha * x) + U^T ((W * K)(alpha * x))         (KDA)

Flush rows rebuild the tile on chip (exact entry-by-entry replay, or `[BV, L] x [L, d_k]`
on tensor cores) and write `S_t` in place; append rows store u (and g once per value head,
k once per key head). The checkpoint is read from memory once per step.
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
from pallas_kernels.common import GridOrder, TokenSpec
from pallas_kernels.replay_decode import (
    append_gate,
    append_key,
    rebuild_exact,
    write_flushed_tile,
)


@dataclasses.dataclass(frozen=True)
class ReplayGroupedParams:
    """Launch parameters of `replay_decode_grouped`.

    Attributes:
      block_v: BV, value rows per tile (a power of two; capped at d_v; >= 16 for the
        tensor-core rebuild precisions).
      num_warps: warps per program.
      tiles_per_program: T >= 1 (value head, BV-tile) pairs of one key-head group per
        program (lowered to a divisor of the group's pairs).
      rebuild_precision: "ieee", "tf32" or "bf16", as in `ReplayTileParams`.
      rebuild_unroll: U, cache entries the exact rebuild loads per memory round trip.
      column_chunk: W, every `[., d_k]` operand as `[., W]` column chunks (0: whole rows);
        see `PlainParams`.
      grid_order: any `GridOrder`.
    """

    block_v: int = 32
    num_warps: int = 4
    tiles_per_program: int = 4
    rebuild_precision: common.Precision = "ieee"
    rebuild_unroll: int = 2
    column_chunk: int = 0
    grid_order: GridOrder = GridOrder.ROW_FASTEST

    def __post_init__(self) -> None:
        common.check_launch(self, tuple(GridOrder))
        if not common.is_int(self.tiles_per_program) or self.tiles_per_program < 1:
            raise ValueError(f"tiles_per_program must be an int >= 1, got {self.tiles_per_program!r}")
        common.check_rebuild(self, {"block_v": self.block_v, "column_chunk": self.column_chunk})


def cache_block_len(cache_len: int) -> int:
    """Cache rows a program loads at once: a power of two >= 16 (the dot's K dimension).

    Rows at or past the cursor are masked, so the padding costs no memory traffic.
    """
    return max(common.next_power_of_two(cache_len), common.MIN_DOT_DIM)


def _grouped_kernel(
    row_ref, slot_ref, pos_ref, mode_ref, q_ref, k_ref, g_ref, beta_ref, v_ref, a_log_ref, dt_bias_ref,
    _ckpt_in, _u_in, _k_in, _g_in,
    y_ref, ckpt_ref, ucache_ref, kcache_ref, gcache_ref,
    *, spec: TokenSpec, block_v: int, tiles_per_head: int, tiles_per_program: int,
    cache_block: int, precision: str, unroll: int, slices: tuple, grid_order: GridOrder,
):
    launch, hk, split = common.program_ids(grid_order)
    b = common.launch_row(row_ref, launch, grid_order)
    reload_row = grid_order is GridOrder.LAUNCH_ORDER_RELOAD
    tile_row = (lambda: common.launch_row(row_ref, launch, grid_order)) if reload_row else (lambda: b)
    mode, slot, pos = mode_ref[launch], slot_ref[launch], pos_ref[launch]  # in launch order
    first = split * tiles_per_program

    def tile_of(p):
        pair = first + p
        vh = hk * spec.group_size + pair // tiles_per_head
        tile = pair % tiles_per_head
        return vh, tile, pl.ds(tile * block_v, block_v)

    @pl.when(mode == common.MODE_PAD)
    def _padding_row():
        def body(p, carry):
            vh, _, cols = tile_of(p)
            y_ref[tile_row(), vh, cols] = jnp.zeros((block_v,), y_ref.dtype)
            return carry

        jax.lax.fori_loop(0, tiles_per_program, body, 0)

    @pl.when(mode != common.MODE_PAD)
    def _live_row():
        live = jnp.arange(cache_block) < pos
        live2 = live[:, None]
        entries = pl.ds(0, cache_block)

        # Load order, measured on the H200 (benchmarks/NOTES.md): GDN is faster with the
        # key cache before q, k and each tile's cache and checkpoint before its gates; KDA
        # the other way round.
        operands_first = not spec.per_channel_gate

        def load_tile(p, b):
            """Tile p's inputs in storage dtypes: `(g_c, u_c, s_c)` cache entries and
            checkpoint tile chunks, v `[BV]`, and row b's `(log_alpha, beta)`; in the gate
            type's order."""
            vh, _, cols = tile_of(p)

            def operands():
                if spec.per_channel_gate:
                    g_c = tuple(plgpu.load(gcache_ref.at[slot, vh, entries, c], mask=live2, other=0.0)
                                for c in slices)
                else:
                    g_c = plgpu.load(gcache_ref.at[slot, vh, entries], mask=live, other=0.0)
                u_c = plgpu.load(ucache_ref.at[slot, vh, entries, cols], mask=live2, other=0.0)
                return g_c, u_c, tuple(ckpt_ref[slot, vh, cols, c] for c in slices)

            gates = lambda: common.load_gates(
                spec, g_ref, beta_ref, a_log_ref, dt_bias_ref, b, vh, slices)
            if operands_first:
                cached, v, gate = operands(), v_ref[b, vh, cols], gates()
            else:
                gate, v, cached = gates(), v_ref[b, vh, cols], operands()
            return cached, v, gate

        def load_keys():
            return tuple(plgpu.load(kcache_ref.at[slot, hk, entries, c], mask=live2, other=0.0)
                         for c in slices)

        if operands_first:
            k_c = load_keys()
            qs, ks, k_dot_q = common.load_qk(spec, q_ref, k_ref, b, hk, slices)
        else:
            qs, ks, k_dot_q = common.load_qk(spec, q_ref, k_ref, b, hk, slices)
            k_c = load_keys()
        k_c = tuple(x.astype(jnp.float32) for x in k_c)  # [Lb, W] chunks, shared by every tile
        if not spec.per_channel_gate:
            kk, kq = common.row_sum(k_c, ks), common.row_sum(k_c, qs)

        def body(p, carry):
            vh, tile, cols = tile_of(p)
            b_tile = tile_row()
            (g_c, u_c, s_c), v, (g, beta) = load_tile(p, b_tile)
            alpha = common.gate_map(jnp.exp, g)
            v = v.astype(jnp.float32)
            u_c = u_c.astype(jnp.float32)  # [Lb, BV]
            s_c = tuple(x.astype(jnp.float32) for x in s_c)  # [BV, W] chunks
            if spec.per_channel_gate:
                totals = tuple(jnp.sum(x, axis=0) for x in g_c)
                weights = tuple(jnp.where(live2, jnp.exp(t - jnp.cumsum(x, axis=0)), 0.0)
                                for t, x in zip(totals, g_c))
                decay_c = tuple(jnp.exp(t) for t in totals)
                w_keys = tuple(x * w for x, w in zip(k_c, weights))
                xk, xq = common.scale_vector(ks, alpha), common.scale_vector(qs, alpha)
                s_k = common.row_sum(s_c, common.scale_vector(xk, decay_c)) + jnp.sum(
                    u_c * common.row_sum(w_keys, xk)[:, None], axis=0)
                s_q = common.row_sum(s_c, common.scale_vector(xq, decay_c)) + jnp.sum(
                    u_c * common.row_sum(w_keys, xq)[:, None], axis=0)
            else:
                total = jnp.sum(g_c, axis=0)
                weights = jnp.where(live, jnp.exp(total - jnp.cumsum(g_c, axis=0)), 0.0)
                decay_c = jnp.exp(total)
                s_k = alpha * (decay_c * common.row_sum(s_c, ks)
                               + jnp.sum(u_c * (weights * kk)[:, None], axis=0))
                s_q = alpha * (decay_c * common.row_sum(s_c, qs)
                               + jnp.sum(u_c * (weights * kq)[:, None], axis=0))
            u = beta * (v - s_k)
            y_ref[b_tile, vh, cols] = (s_q + u * k_dot_q).astype(y_ref.dtype)

            @pl.when(mode == common.MODE_FLUSH)
            def _flush():
                if precision == "ieee":
                    cache_refs = (ucache_ref, kcache_ref, gcache_ref)
                    prev = rebuild_exact(spec, cache_refs, slot, vh, cols, slices, pos, s_c, decay_c, unroll)
                else:
                    keys = w_keys if spec.per_channel_gate else tuple(x * weights[:, None] for x in k_c)
                    rebuilt = tuple(common.rebuild_dot(u_c.T, w, precision) for w in keys)
                    prev = tuple(s + r for s, r in zip(common.scale_columns(s_c, decay_c), rebuilt))
                write_flushed_tile(ckpt_ref, slot_ref[launch], vh, cols, slices, prev, alpha, u, ks)

            @pl.when(mode == common.MODE_APPEND)
            def _append():
                ucache_ref[slot, vh, pos, cols] = u.astype(ucache_ref.dtype)

                @pl.when(tile == 0)
                def _append_gate():
                    append_gate(spec, gcache_ref, slot, vh, slices, pos, g)

            return carry

        jax.lax.fori_loop(0, tiles_per_program, body, 0)

        @pl.when((mode == common.MODE_APPEND) & (split == 0))
        def _append_key():  # once per key head
            append_key(kcache_ref, slot, hk, slices, pos, ks)


def replay_decode_grouped(
    checkpoint: Float[Array, "N Hv Dv Dk"],
    u_cache: Float[Array, "N Hv L Dv"],
    k_cache: Float[Array, "N Hk L Dk"],
    g_cache: Float[Array, "N Hv L *Dk"],
    q: Float[Array, "B Hk Dk"],
    k: Float[Array, "B Hk Dk"],
    v: Float[Array, "B Hv Dv"],
    g: Float[Array, "B Hv *Dk"],
    beta: Float[Array, "B Hv"],
    slot: Int[Array, " B"],
    pos: Int[Array, " B"],
    mode: Int[Array, " B"],
    *,
    row_order: Int[Array, " B"] | None = None,
    use_qk_l2norm: bool = False,
    scale: float | None = None,
    gate_params: tuple[Array, Array] | None = None,
    params: ReplayGroupedParams = ReplayGroupedParams(),
    interpret: bool | None = None,
):
    """Same arguments and results as `replay_decode.replay_decode`; grouped layout, with
    `params` a `ReplayGroupedParams` (`row_order` with the launch-order grids)."""
    batch, num_v_heads, head_v_dim = v.shape
    num_k_heads = q.shape[1]
    params = common.for_head_dim(params, head_v_dim)
    spec = common.token_spec(
        q, v, per_channel_gate=g_cache.ndim == 4, gate_params=gate_params,
        use_qk_l2norm=use_qk_l2norm, scale=scale,
    )
    tiles_per_head = head_v_dim // params.block_v
    pairs = spec.group_size * tiles_per_head
    tiles_per_program = min(params.tiles_per_program, pairs)
    while pairs % tiles_per_program:
        tiles_per_program //= 2
    a_log, dt_bias = common.gate_param_inputs(gate_params)
    kernel = functools.partial(
        _grouped_kernel, spec=spec, block_v=params.block_v, tiles_per_head=tiles_per_head,
        tiles_per_program=tiles_per_program, cache_block=cache_block_len(u_cache.shape[2]),
        precision=params.rebuild_precision, unroll=params.rebuild_unroll,
        slices=common.column_slices(params.column_chunk, q.shape[2]), grid_order=params.grid_order,
    )
    return common.decode_call(
        kernel,
        grid=(batch, num_k_heads, pairs // tiles_per_program),
        inputs=(*common.launch_rows(slot, pos, mode, row_order, params.grid_order),
                q, k, g, beta, v, a_log, dt_bias),
        state=(checkpoint, u_cache, k_cache, g_cache),
        y_like=v, num_warps=params.num_warps, grid_order=params.grid_order, interpret=interpret,
        name="replayssm_replay_decode_grouped",
    )
