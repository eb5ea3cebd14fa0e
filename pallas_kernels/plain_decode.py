"""Plain recurrent decode (the in-project baseline): read and write the full state every step.

Grid `(B, H_v, d_v // BV)` (launched reversed with `rows_outermost`); each program loads
its row's state tile `S [BV, d_k]` from the row's slot (as `[BV, W]` column chunks),
applies one token of the gated delta rule

    S~ = S diag(alpha),  u = beta (v - S~ k),  S' = S~ + u k^T,  y = S' q

and writes `S'` back in place. Same inputs and gating options as `replay_decode`.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
from jax.experimental import pallas as pl
from jaxtyping import Array, Bool, Float, Int

from pallas_kernels import common
from pallas_kernels.common import KernelConfig, TokenSpec


def _plain_kernel(
    slot_ref, valid_ref, q_ref, k_ref, g_ref, beta_ref, v_ref, a_log_ref, dt_bias_ref,
    _state_in, y_ref, state_ref,
    *, spec: TokenSpec, block_v: int, slices: tuple, rows_outermost: bool,
):
    b, h, tile = common.program_ids(rows_outermost)
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
    config: KernelConfig = KernelConfig(),
    interpret: bool | None = None,
):
    """One plain decode step: `(y [B, H_v, d_v], new state [N, H_v, d_v, d_k])`.

    Args:
      state: the recurrent state pool, updated in place when donated.
      q, k, v, g, beta, gate_params, use_qk_l2norm, scale: as in `replay_decode`; KDA when
        `g` is `[B, H_v, d_k]`.
      slot: `[B]` int32 slot of each row (any valid index on padding rows).
      valid: `[B]` bool, False on padding rows (y = 0, nothing written).
      config: tile, warps, column chunks and grid order (`rebuild_precision` is unused:
        there is no rebuild).
      interpret: run in the Pallas interpreter (default: off GPU).
    """
    batch, num_v_heads, head_v_dim = v.shape
    config = config.for_head_dim(head_v_dim)
    spec = common.token_spec(
        q, v, per_channel_gate=g.ndim == 3, gate_params=gate_params,
        use_qk_l2norm=use_qk_l2norm, scale=scale,
    )
    a_log, dt_bias = common.gate_param_inputs(gate_params)
    kernel = functools.partial(
        _plain_kernel, spec=spec, block_v=config.block_v,
        slices=config.column_slices(q.shape[2]), rows_outermost=config.rows_outermost,
    )
    y, new_state = common.decode_call(
        kernel,
        grid=(batch, num_v_heads, head_v_dim // config.block_v),
        inputs=(slot, valid.astype(jnp.int32), q, k, g, beta, v, a_log, dt_bias),
        state=(state,),
        y_like=v, config=config, interpret=interpret, name="plain_decode",
    )
    return y, new_state
