"""Plain recurrent decode (the in-project baseline): read and write the full state every step.

Grid `(B, H_v, d_v // BV)` (launched reversed with a row-slowest `grid_order`); each program loads
its row's state tile `S [BV, d_k]` from the row's slot (as `[BV, W]` column chunks),
applies one token of the gated delta rule

    S~ = S diag(alpha),  u = beta (v - S~ k),  S' = S~ + u k^T,  y = S' q

and writes `S'` back in place. Same inputs and gating options as `replay_decode`.
"""

from __future__ import annotations

import dataclasses
import functools

import jax.numpy as jnp
from jax.experimental import pallas as pl
from jaxtyping import Array, Bool, Float, Int

from pallas_kernels import common
from pallas_kernels.common import GridOrder, TokenSpec


@dataclasses.dataclass(frozen=True)
class PlainParams:
    """Launch parameters of `plain_decode`.

    Attributes:
      block_v: BV, value rows of the state per program (a power of two; capped at d_v).
      num_warps: warps per program.
      column_chunk: W, the d_k columns of a tile handled as `[BV, W]` chunks (a power of
        two; 0: whole rows). Triton lays a `[BV, 128]` fp32 block out with a warp's lanes
        along d_k, so each row sum costs 5 shuffle steps; `[BV, 16]` chunks summed in
        registers leave one 2-step row sum.
      grid_order: ROW_FASTEST or ROW_SLOWEST (`common.GridOrder`).
    """

    block_v: int = 16
    num_warps: int = 1
    column_chunk: int = 0
    grid_order: GridOrder = GridOrder.ROW_FASTEST

    def __post_init__(self) -> None:
        common.check_launch(self, (GridOrder.ROW_FASTEST, GridOrder.ROW_SLOWEST))


def _plain_kernel(
    slot_ref, valid_ref, q_ref, k_ref, g_ref, beta_ref, v_ref, a_log_ref, dt_bias_ref,
    _state_in, y_ref, state_ref,
    *, spec: TokenSpec, block_v: int, slices: tuple, grid_order: GridOrder,
):
    b, h, tile = common.program_ids(grid_order)
    cols = pl.ds(tile * block_v, block_v)
    valid = valid_ref[b] != 0

    @pl.when(~valid)
    def _padding_row():
        y_ref[b, h, cols] = jnp.zeros((block_v,), y_ref.dtype)

    @pl.when(valid)
    def _live_row():
        slot = slot_ref[b]
        qs, ks, _, g, beta = common.load_token(
            spec, (q_ref, k_ref, g_ref, beta_ref, a_log_ref, dt_bias_ref), b, h, slices
        )
        v = v_ref[b, h, cols].astype(jnp.float32)
        tile = common.load_chunks(state_ref, (slot, h, cols), slices)
        decayed = common.scale_columns(tile, common.gate_map(jnp.exp, g))
        u = beta * (v - common.row_sum(decayed, ks))
        new = common.add_outer(decayed, u, ks)
        y_ref[b, h, cols] = common.row_sum(new, qs).astype(y_ref.dtype)
        common.store_chunks(state_ref, (slot, h, cols), slices, new)


def plain_decode(
    state: Float[Array, "N Hv Dv Dk"],
    q: Float[Array, "B Hk Dk"],
    k: Float[Array, "B Hk Dk"],
    v: Float[Array, "B Hv Dv"],
    g: Float[Array, "B Hv *Dk"],
    beta: Float[Array, "B Hv"],
    slot: Int[Array, " B"],
    valid: Bool[Array, " B"],
    *,
    use_qk_l2norm: bool = False,
    scale: float | None = None,
    gate_params: tuple[Array, Array] | None = None,
    params: PlainParams = PlainParams(),
    interpret: bool | None = None,
):
    """One plain decode step: `(y [B, H_v, d_v], new state [N, H_v, d_v, d_k])`.

    Args:
      state: the recurrent state pool, updated in place when donated.
      q, k, v, g, beta, gate_params, use_qk_l2norm, scale: as in `replay_decode`; KDA when
        `g` is `[B, H_v, d_k]`.
      slot: `[B]` int32 slot of each row (any valid index on padding rows).
      valid: `[B]` bool, False on padding rows (y = 0, nothing written).
      params: tile, warps, column chunks and grid order.
      interpret: run in the Pallas interpreter (default: off GPU).
    """
    batch, num_v_heads, head_v_dim = v.shape
    params = common.for_head_dim(params, head_v_dim)
    spec = common.token_spec(
        q, v, per_channel_gate=g.ndim == 3, gate_params=gate_params,
        use_qk_l2norm=use_qk_l2norm, scale=scale,
    )
    a_log, dt_bias = common.gate_param_inputs(gate_params)
    kernel = functools.partial(
        _plain_kernel, spec=spec, block_v=params.block_v,
        slices=common.column_slices(params.column_chunk, q.shape[2]), grid_order=params.grid_order,
    )
    y, new_state = common.decode_call(
        kernel,
        grid=(batch, num_v_heads, head_v_dim // params.block_v),
        inputs=(slot, valid.astype(jnp.int32), q, k, g, beta, v, a_log, dt_bias),
        state=(state,),
        y_like=v, num_warps=params.num_warps, grid_order=params.grid_order, interpret=interpret,
        name="plain_decode",
    )
    return y, new_state
