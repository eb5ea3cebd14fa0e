"""The "xla" backend: ReplaySSM decode in plain jax.numpy / lax, the readable specification.

One layer's step for B rows under a `StepPlan` (row i uses physical slot `plan.slot[i]`):

1. `replay_state` rebuilds each row's live state S_{t-1} from its checkpoint S_c and the
   `pos` valid cache entries (replay identity, per key channel; a per-head decay is
   broadcast over the channels):

       S_{t-1} = S_c * exp(G) + sum_j u_j (W_j * k_j)^T,
       G = sum_j g_j,  W_j = exp(G - cumsum_j g)   (entries j < pos only)

2. `layer_step` takes the readout `u = beta (v - S_{t-1}(alpha*k))`,
   `y = S_{t-1}(alpha*q) + u (k.q)`; flush rows write `S_t = S_{t-1} * alpha + u k^T` into
   the checkpoint, other rows append `(u, k, g)` at `pos`.

The cursors are moved by the caller (`plan.advance_write_pos`), once per forward pass.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from replayssm_jax import gating
from replayssm_jax.plan import StepPlan
from replayssm_jax.state import ReplayState
from replayssm_jax.tokens import Tokens

_HIGHEST = jax.lax.Precision.HIGHEST


def _per_channel(g: Float[Array, "... Hv *Dk"], head_k_dim: int, per_channel: bool):
    """Log-decay per key channel: a per-head scalar broadcast over d_k."""
    return g if per_channel else jnp.broadcast_to(g[..., None], (*g.shape, head_k_dim))


def _expand_heads(x: Array, group_size: int, axis: int = 1) -> Array:
    """Key-head tensor to value heads: value head h uses key head h // group_size."""
    return jnp.repeat(x, group_size, axis=axis)


def replay_state(state: ReplayState, plan: StepPlan) -> Float[Array, "B Hv Dv Dk"]:
    """The live state S_{t-1} of each row's slot in float32 (zeros for padding rows).

    Stale entries (positions >= pos) are masked out of every cache tensor before use, so no
    value they hold (NaN and Inf included) reaches the result."""
    cfg = state.config
    live = (jnp.arange(cfg.cache_len)[None, :] < plan.pos[:, None])[:, None, :, None]  # [B,1,L,1]
    ckpt = state.checkpoint[plan.slot].astype(jnp.float32)
    u = jnp.where(live, state.u_cache[plan.slot].astype(jnp.float32), 0.0)  # [B, Hv, L, Dv]
    k = jnp.where(live, state.k_cache[plan.slot].astype(jnp.float32), 0.0)  # [B, Hk, L, Dk]
    g = _per_channel(state.g_cache[plan.slot], cfg.head_k_dim, cfg.per_channel_gate)
    g = jnp.where(live, g, 0.0)  # [B, Hv, L, Dk]
    prefix = jnp.cumsum(g, axis=2)  # c_j
    total = prefix[:, :, -1, :]  # G: [B, Hv, Dk]
    weights = jnp.where(live, jnp.exp(total[:, :, None, :] - prefix), 0.0)  # W_j
    keys = weights * _expand_heads(k, cfg.group_size)
    rebuilt = jnp.einsum("bhlv,bhlk->bhvk", u, keys, precision=_HIGHEST)
    live_state = ckpt * jnp.exp(total)[:, :, None, :] + rebuilt
    return jnp.where(plan.valid[:, None, None, None], live_state, 0.0)


def gate_tokens(config, tokens: Tokens, gate_params) -> Tokens:
    """`tokens` with `g`, `beta` gated from raw `a`, `b` when `gate_params` is given."""
    if gate_params is None:
        return tokens
    gate = gating.kda_gate if config.per_channel_gate else gating.gdn_gate
    return tokens.replace(g=gate(tokens.g, *gate_params), beta=gating.beta_gate(tokens.beta))


def layer_step(
    state: ReplayState,
    tokens: Tokens,
    plan: StepPlan,
    *,
    use_qk_l2norm: bool,
    scale: float | None,
    gate_params: tuple[Array, Array] | None = None,
) -> tuple[Float[Array, "B Hv Dv"], ReplayState]:
    """One layer's step under `plan`. Updates checkpoint and caches, not `write_pos`.

    Returns:
      `y [B, H_v, d_v]` in v's dtype (exactly 0 on padding rows) and the new state.
    """
    cfg = state.config
    num_slots = state.num_slots
    tokens = gate_tokens(cfg, tokens, gate_params)
    q, k = gating.prepare_qk(tokens.q, tokens.k, use_qk_l2norm=use_qk_l2norm, scale=scale)
    v, g, beta = tokens.v.astype(jnp.float32), tokens.g.astype(jnp.float32), tokens.beta.astype(jnp.float32)
    qv, kv = _expand_heads(q, cfg.group_size), _expand_heads(k, cfg.group_size)
    alpha = jnp.exp(_per_channel(g, cfg.head_k_dim, cfg.per_channel_gate))  # [B, Hv, Dk]

    prev = replay_state(state, plan)
    # The k/g appends below do not depend on the replay's reads of those caches; tie the
    # caches to `prev` so XLA orders the reads first and updates donated buffers in place
    # (without this, copy insertion copies both caches every step).
    prev, k_pool, g_pool = jax.lax.optimization_barrier((prev, state.k_cache, state.g_cache))
    matvec = lambda s, x: jnp.einsum("bhvk,bhk->bhv", s, x, precision=_HIGHEST)
    u = beta[..., None] * (v - matvec(prev, alpha * kv))
    y = matvec(prev, alpha * qv) + u * jnp.sum(kv * qv, axis=-1, keepdims=True)
    y = jnp.where(plan.valid[:, None, None], y, 0.0).astype(tokens.v.dtype)

    flush_slot = jnp.where(plan.flush, plan.slot, num_slots)  # padding rows never flush
    append_slot = jnp.where(plan.valid & ~plan.flush, plan.slot, num_slots)
    new_state = prev * alpha[:, :, None, :] + u[..., :, None] * kv[..., None, :]
    checkpoint = state.checkpoint.at[flush_slot].set(new_state.astype(cfg.state_dtype), mode="drop")
    u_cache = state.u_cache.at[append_slot, :, plan.pos].set(u.astype(cfg.cache_dtype), mode="drop")
    k_cache = k_pool.at[append_slot, :, plan.pos].set(k.astype(cfg.cache_dtype), mode="drop")
    g_cache = g_pool.at[append_slot, :, plan.pos].set(g, mode="drop")
    return y, dataclasses.replace(
        state, checkpoint=checkpoint, u_cache=u_cache, k_cache=k_cache, g_cache=g_cache
    )
