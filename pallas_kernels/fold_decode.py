"""ReplaySSM decode step that materialises the live state (GDN and KDA): the small-batch kernel.

Grid `(B, H_v, d_v // BV)` (launched reversed with a row-slowest `grid_order`): one program
per (row, value head, BV-row tile of the state). Each program loads its checkpoint tile
`S_c [BV, d_k]` (as `[BV, W]` column chunks), folds the row's `pos` valid cache entries into
it oldest first, in exact fp32,

    S <- S diag(alpha_j) + u_j k_j^T,   j = 0 .. pos-1,

which is the live state `S_{t-1}`, and then applies one token of the gated delta rule on
chip in the plain kernel's order:

    S~ = S_{t-1} diag(alpha),   u = beta (v - S~ k),   S_t = S~ + u k^T,   y = S_t q

Flush rows write `S_t` into the checkpoint in place; append rows store `(u, k, g)` at the
cursor as the replay kernels do, so the kernel is correct for any plan.

Its cost grows with `pos` (one FMA per tile element and cached entry, every step), so it is
meant for plans that flush every live row (the fold-every-step policy): a row's cached
entries are folded in on its first step, its cursor returns to 0, and from then on each
step is the plain recurrence on the checkpoint with no cache traffic. At small batch, where
the replay kernels' reads and the plain kernel's reads cost the same latency, that beats
the replay cycle (benchmarks/NOTES.md). With `FoldParams.empty_cache_branch` a row at
cursor 0 takes a branch with its own copy of the token step and no fold loop.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jaxtyping import Array, Float, Int

from pallas_kernels import common
from pallas_kernels.common import GridOrder, TokenSpec
from pallas_kernels.replay_decode import append_entry


@dataclasses.dataclass(frozen=True)
class FoldParams:
    """Launch parameters of `fold_decode` (the fold is exact fp32; there is no other
    rebuild).

    Attributes:
      block_v: BV, value rows of the state per program (a power of two; capped at d_v).
      num_warps: warps per program.
      column_chunk: W, `[BV, W]` column chunks (0: whole rows); see `PlainParams`.
      grid_order: ROW_FASTEST or ROW_SLOWEST.
      empty_cache_branch: rows at cursor 0 (every step of a row after its first under a
        fold-every-step plan) take a branch of their own without the fold loop, so their
        step compiles like the plain kernel's; the loop costs a little even when it runs
        no iteration, and the branch costs registers (benchmarks/NOTES.md).
    """

    block_v: int = 8
    num_warps: int = 1
    column_chunk: int = 0
    grid_order: GridOrder = GridOrder.ROW_FASTEST
    empty_cache_branch: bool = False

    def __post_init__(self) -> None:
        common.check_launch(self, (GridOrder.ROW_FASTEST, GridOrder.ROW_SLOWEST))
        if not isinstance(self.empty_cache_branch, bool):
            raise ValueError(f"empty_cache_branch must be a bool, got {self.empty_cache_branch!r}")


def fold_cache(spec: TokenSpec, refs, slot, h, cols, slices, pos, s_c):
    """The live state tile `S_{t-1}` (float32 column chunks `[BV, W]`): the slot's first
    `pos` cache entries folded into the checkpoint tile `s_c`, oldest first."""
    ucache_ref, kcache_ref, gcache_ref = refs
    hk = h // spec.group_size

    def body(j, state):
        u_j = ucache_ref[slot, h, j, cols].astype(jnp.float32)
        k_j = common.load_chunks(kcache_ref, (slot, hk, j), slices)
        if spec.per_channel_gate:
            g_j = common.load_chunks(gcache_ref, (slot, h, j), slices)
        else:
            g_j = gcache_ref[slot, h, j].astype(jnp.float32)
        return common.add_outer(common.scale_columns(state, common.gate_map(jnp.exp, g_j)), u_j, k_j)

    return jax.lax.fori_loop(0, pos, body, s_c)


def _fold_kernel(
    slot_ref, pos_ref, mode_ref, q_ref, k_ref, g_ref, beta_ref, v_ref, a_log_ref, dt_bias_ref,
    _ckpt_in, _u_in, _k_in, _g_in,
    y_ref, ckpt_ref, ucache_ref, kcache_ref, gcache_ref,
    *, spec: TokenSpec, block_v: int, slices: tuple, grid_order: GridOrder, empty_cache_branch: bool,
):
    b, h, tile = common.program_ids(grid_order)
    cols = pl.ds(tile * block_v, block_v)
    mode = mode_ref[b]

    @pl.when(mode == common.MODE_PAD)
    def _padding_row():
        y_ref[b, h, cols] = jnp.zeros((block_v,), y_ref.dtype)

    @pl.when(mode != common.MODE_PAD)
    def _live_row():
        slot, pos = slot_ref[b], pos_ref[b]
        qs, ks, _, g, beta = common.load_token(
            spec, (q_ref, k_ref, g_ref, beta_ref, a_log_ref, dt_bias_ref), b, h, slices
        )
        v = v_ref[b, h, cols].astype(jnp.float32)
        s_c = common.load_chunks(ckpt_ref, (slot, h, cols), slices)
        cache_refs = (ucache_ref, kcache_ref, gcache_ref)

        def token_step(live):
            y, u, new = common.delta_rule_step(live, qs, ks, v, g, beta)
            y_ref[b, h, cols] = y.astype(y_ref.dtype)

            @pl.when(mode == common.MODE_FLUSH)
            def _flush():
                common.store_chunks(ckpt_ref, (slot, h, cols), slices, new)

            @pl.when(mode == common.MODE_APPEND)
            def _append():
                append_entry(spec, cache_refs, slot, h, tile, cols, slices, pos, u, g, ks)

        if not empty_cache_branch:
            token_step(fold_cache(spec, cache_refs, slot, h, cols, slices, pos, s_c))
            return

        @pl.when(pos == 0)
        def _checkpoint_is_live():
            token_step(s_c)

        @pl.when(pos != 0)
        def _fold_then_step():
            token_step(fold_cache(spec, cache_refs, slot, h, cols, slices, pos, s_c))


def fold_decode(
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
    use_qk_l2norm: bool = False,
    scale: float | None = None,
    gate_params: tuple[Array, Array] | None = None,
    params: FoldParams = FoldParams(),
    interpret: bool | None = None,
):
    """One ReplaySSM decode step of one layer through the live state (see module docstring).

    Same arguments and results as `replay_decode` (without `row_order`: rows launch in
    row order), with `params` a `FoldParams`.

    Returns:
      `(y [B, H_v, d_v] in v's dtype, checkpoint, u_cache, k_cache, g_cache)`.
    """
    batch, num_v_heads, head_v_dim = v.shape
    params = common.for_head_dim(params, head_v_dim)
    spec = common.token_spec(
        q, v, per_channel_gate=g_cache.ndim == 4, gate_params=gate_params,
        use_qk_l2norm=use_qk_l2norm, scale=scale,
    )
    a_log, dt_bias = common.gate_param_inputs(gate_params)
    kernel = functools.partial(
        _fold_kernel, spec=spec, block_v=params.block_v,
        slices=common.column_slices(params.column_chunk, q.shape[2]), grid_order=params.grid_order,
        empty_cache_branch=params.empty_cache_branch,
    )
    return common.decode_call(
        kernel,
        grid=(batch, num_v_heads, head_v_dim // params.block_v),
        inputs=(slot, pos, mode, q, k, g, beta, v, a_log, dt_bias),
        state=(checkpoint, u_cache, k_cache, g_cache),
        y_like=v, num_warps=params.num_warps, grid_order=params.grid_order, interpret=interpret,
        name="replayssm_fold_decode",
    )
