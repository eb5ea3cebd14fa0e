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

from pallas_kernels.common import set_records, set_rows
from replayssm_jax import gating
from replayssm_jax.plan import StepPlan
from replayssm_jax.state import ReplayState
from replayssm_jax.tokens import Tokens

_HIGHEST = jax.lax.Precision.HIGHEST


def per_channel_decay(
    g: Float[Array, "... Hv *Dk"], head_k_dim: int, per_channel: bool
) -> Float[Array, "... Hv Dk"]:
    """The log-decay per key channel: `g` itself for a per-channel gate (KDA, `[..., H_v,
    d_k]`), else the per-head scalar (`[..., H_v]`) broadcast over the `head_k_dim` channels,
    so that the replay and the readout are written once for both gates."""
    return g if per_channel else jnp.broadcast_to(g[..., None], (*g.shape, head_k_dim))


def expand_heads(x: Array, group_size: int, axis: int = 1) -> Array:
    """A key-head tensor (`H_k` along `axis`) repeated to value heads (`H_k * group_size`):
    value head h uses key head `h // group_size`, as the GDN/KDA layers share key heads."""
    return jnp.repeat(x, group_size, axis=axis)


def _append_record(plan: StepPlan):
    """`append(pool [N, heads, L, ...], x [B, heads, ...])`: each appending row's record at its
    slot's cursor, in the pool's dtype (flush and padding rows append nothing)."""
    keep = (plan.valid & ~plan.flush)[:, None]
    return lambda pool, x: set_records(pool, plan.slot, plan.pos[:, None], x[:, None], keep)


def replay_state(state: ReplayState, plan: StepPlan) -> Float[Array, "B Hv Dv Dk"]:
    """The live state S_{t-1} of each row's slot in float32 (zeros for padding rows).

    Stale entries (positions >= pos) are masked out of every cache tensor before use, so no
    value they hold (NaN and Inf included) reaches the result."""
    cfg = state.config
    live = (jnp.arange(cfg.cache_len)[None, :] < plan.pos[:, None])[:, None, :, None]  # [B,1,L,1]
    ckpt = state.checkpoint[plan.slot].astype(jnp.float32)
    u = jnp.where(live, state.u_cache[plan.slot].astype(jnp.float32), 0.0)  # [B, Hv, L, Dv]
    k = jnp.where(live, state.k_cache[plan.slot].astype(jnp.float32), 0.0)  # [B, Hk, L, Dk]
    g = per_channel_decay(state.g_cache[plan.slot], cfg.head_k_dim, cfg.per_channel_gate)
    g = jnp.where(live, g, 0.0)  # [B, Hv, L, Dk]
    prefix = jnp.cumsum(g, axis=2)  # c_j
    total = prefix[:, :, -1, :]  # G: [B, Hv, Dk]
    weights = jnp.where(live, jnp.exp(total[:, :, None, :] - prefix), 0.0)  # W_j
    keys = weights * expand_heads(k, cfg.group_size)
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
    tokens = gate_tokens(cfg, tokens, gate_params)
    q, k = gating.prepare_qk(tokens.q, tokens.k, use_qk_l2norm=use_qk_l2norm, scale=scale)
    v, g, beta = tokens.v.astype(jnp.float32), tokens.g.astype(jnp.float32), tokens.beta.astype(jnp.float32)
    qv, kv = expand_heads(q, cfg.group_size), expand_heads(k, cfg.group_size)
    alpha = jnp.exp(per_channel_decay(g, cfg.head_k_dim, cfg.per_channel_gate))  # [B, Hv, Dk]

    prev = replay_state(state, plan)
    # The k/g appends below do not depend on the replay's reads of those caches; tie the
    # caches to `prev` so XLA orders the reads first and updates donated buffers in place
    # (without this, copy insertion copies both caches every step).
    prev, k_pool, g_pool = jax.lax.optimization_barrier((prev, state.k_cache, state.g_cache))
    matvec = lambda s, x: jnp.einsum("bhvk,bhk->bhv", s, x, precision=_HIGHEST)
    u = beta[..., None] * (v - matvec(prev, alpha * kv))
    y = matvec(prev, alpha * qv) + u * jnp.sum(kv * qv, axis=-1, keepdims=True)
    y = jnp.where(plan.valid[:, None, None], y, 0.0).astype(tokens.v.dtype)

    new_state = prev * alpha[:, :, None, :] + u[..., :, None] * kv[..., None, :]
    checkpoint = set_rows(state.checkpoint, plan.slot, new_state, plan.flush)  # padding rows never flush
    append = _append_record(plan)
    u_cache, k_cache, g_cache = append(state.u_cache, u), append(k_pool, k), append(g_pool, g)
    return y, dataclasses.replace(
        state, checkpoint=checkpoint, u_cache=u_cache, k_cache=k_cache, g_cache=g_cache
    )


# Mamba-2 (gate "mamba2", the additive rule). The cache holds the raw x_j, B_j and dt_j
# (u_cache, k_cache, g_cache); with the window's cumulative step Gamma and prefix sums c_j,
#
#     S = exp(A Gamma) S_c + sum_j dt_j exp(A (Gamma - c_j)) x_j B_j^T.
#
# The step's window is the valid cache entries plus this token (its weight is dt_t), so
# the readout needs no state:
#
#     y = exp(A Gamma) (S_c C) + sum_j dt_j exp(A (Gamma - c_j)) (B_j . C) x_j + D x,
#
# and a flush row writes S over the same window once.


def _mamba2_window(state: ReplayState, plan: StepPlan, A: Float[Array, " H"], dt_now=None):
    """The window's `(x [B,H,L',P], B [B,H,L',N], weights [B,H,L'], decay [B,H])`, float32:
    the valid cache entries (stale ones masked out before use) and, with `dt_now [B, H]`, one
    more entry for this token (L' = L + 1; its x and B are filled in by the caller).
    `weights_j = dt_j exp(A (Gamma - c_j))`, `decay = exp(A Gamma)`."""
    cfg = state.config
    live = jnp.arange(cfg.cache_len)[None, :] < plan.pos[:, None]  # [B, L]
    x = jnp.where(live[:, None, :, None], state.u_cache[plan.slot].astype(jnp.float32), 0.0)
    b = jnp.where(live[:, None, :, None], state.k_cache[plan.slot].astype(jnp.float32), 0.0)
    dt = jnp.where(live[:, None, :], state.g_cache[plan.slot], 0.0)  # [B, H, L]
    if dt_now is not None:
        dt = jnp.concatenate([dt, dt_now[:, :, None]], axis=2)
    log_a = A.astype(jnp.float32)[None, :, None] * dt
    prefix = jnp.cumsum(log_a, axis=2)
    total = prefix[:, :, -1]  # A Gamma
    weights = dt * jnp.exp(total[:, :, None] - prefix)
    return x, expand_heads(b, cfg.group_size), weights, jnp.exp(total)


def mamba2_replay_state(state: ReplayState, plan: StepPlan, A: Float[Array, " H"]) -> Float[Array, "B H P N"]:
    """The live Mamba-2 state of each row's slot in float32 (zeros for padding rows)."""
    x, b, weights, decay = _mamba2_window(state, plan, A)
    ckpt = state.checkpoint[plan.slot].astype(jnp.float32)
    rebuilt = jnp.einsum("bhlp,bhln->bhpn", weights[..., None] * x, b, precision=_HIGHEST)
    live_state = decay[:, :, None, None] * ckpt + rebuilt
    return jnp.where(plan.valid[:, None, None, None], live_state, 0.0)


def mamba2_layer_step(state: ReplayState, tokens, plan: StepPlan, *, params) -> tuple[Float[Array, "B H P"], ReplayState]:
    """One Mamba-2 layer step under `plan` (`tokens: Mamba2Tokens`, `params: Mamba2Params`).
    Updates checkpoint and caches, not `write_pos`.

    Returns:
      `y [B, H, P]` in x's dtype (exactly 0 on padding rows) and the new state.
    """
    cfg = state.config
    dt = gating.mamba2_dt(tokens.dt, params.dt_bias, dt_softplus=params.dt_softplus, dt_limit=params.dt_limit)
    x_now = tokens.x.astype(jnp.float32)
    b_now = expand_heads(tokens.B.astype(jnp.float32), cfg.group_size)  # [B, H, N]
    c_now = expand_heads(tokens.C.astype(jnp.float32), cfg.group_size)
    x, b, weights, decay = _mamba2_window(state, plan, params.A, dt)
    x = jnp.concatenate([x, x_now[:, :, None]], axis=2)
    b = jnp.concatenate([b, b_now[:, :, None]], axis=2)
    ckpt = state.checkpoint[plan.slot].astype(jnp.float32)
    # As in the delta-rule step: order the window's cache reads before the appends below so
    # donated caches are updated in place.
    (ckpt, x, b, weights), x_pool, b_pool, dt_pool = jax.lax.optimization_barrier(
        ((ckpt, x, b, weights), state.u_cache, state.k_cache, state.g_cache))

    s_c_dot_c = jnp.einsum("bhpn,bhn->bhp", ckpt, c_now, precision=_HIGHEST)
    b_dot_c = jnp.einsum("bhln,bhn->bhl", b, c_now, precision=_HIGHEST)
    y = decay[..., None] * s_c_dot_c + jnp.einsum("bhl,bhlp->bhp", weights * b_dot_c, x, precision=_HIGHEST)
    y = y + params.D.astype(jnp.float32)[None, :, None] * x_now
    if tokens.z is not None:
        y = y * gating.silu(tokens.z)
    y = jnp.where(plan.valid[:, None, None], y, 0.0).astype(tokens.x.dtype)

    new_state = decay[:, :, None, None] * ckpt + jnp.einsum(
        "bhlp,bhln->bhpn", weights[..., None] * x, b, precision=_HIGHEST)
    checkpoint = set_rows(state.checkpoint, plan.slot, new_state, plan.flush)  # padding rows never flush
    append = _append_record(plan)
    x_cache, b_cache, dt_cache = (append(x_pool, tokens.x), append(b_pool, tokens.B), append(dt_pool, dt))
    return y, dataclasses.replace(state, checkpoint=checkpoint, u_cache=x_cache, k_cache=b_cache, g_cache=dt_cache)
