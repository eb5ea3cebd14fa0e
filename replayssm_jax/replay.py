"""ReplaySSM decode in plain jax.numpy / lax: the readable specification ("xla" backend).

One decode step for B rows (row i uses physical slot `slots[i]`):

1. `plan_step` decides per row, on the device, whether it flushes: the slot already holds
   L - 1 cached entries, or the caller forces it. Padding rows (slot < 0 or >= N) do nothing.
2. `replay_state` rebuilds the slot's live state S_{t-1} from its checkpoint S_c and the
   `pos` valid cache entries (replay identity, per key channel; GDN broadcasts its scalar):

       S_{t-1} = S_c * exp(G) + sum_j u_j (W_j * k_j)^T,
       G = sum_j g_j,  W_j = exp(G - cumsum_j g)   (entries j < pos only)

3. `xla_layer_step` takes the readout `u = beta (v - S_{t-1}(alpha*k))`,
   `y = S_{t-1}(alpha*q) + u (k.q)`; flush rows write `S_t = S_{t-1} * alpha + u k^T` into the
   checkpoint, other rows append `(u, k, g)` at `pos`.
4. `advance_write_pos` moves each slot's cursor once: 0 after a flush, else pos + 1.

`decode_step` in `replayssm_jax.decode` chains the four; a model with several layers calls
`plan_step` and `advance_write_pos` once per forward pass and a layer step per layer.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from replayssm_jax import gating
from replayssm_jax.state import ReplayState

_HIGHEST = jax.lax.Precision.HIGHEST


class StepPlan(NamedTuple):
    """Per-row decisions of one decode step, computed once per forward pass.

    Attributes:
      slot: `[B]` int32, the row's slot, 0 for padding rows (safe to gather with).
      valid: `[B]` bool, False for padding rows (slot < 0 or slot >= N).
      pos: `[B]` int32, cached entries before this token (the write position).
      flush: `[B]` bool, the row writes its checkpoint this step (False on padding rows).
      launch_order: `[B]` int32, a permutation of the rows, costliest step first: flushing
        rows, then appending rows, each by descending `pos`, then padding rows. Pallas
        replay kernels with `KernelConfig.launch_order` issue their programs in this order,
        so that a step mixing flush and append rows starts the long flush programs first
        instead of leaving some of them at the end of the launch; where nothing reads it
        (the xla backend, the other kernels) jit drops the sort.
    """

    slot: Int[Array, " B"]
    valid: Bool[Array, " B"]
    pos: Int[Array, " B"]
    flush: Bool[Array, " B"]
    launch_order: Int[Array, " B"]


def plan_step(
    write_pos: Int[Array, " N"],
    slots: Int[Array, " B"],
    force_flush: Bool[Array, " B"] | None,
    cache_len: int,
    flush_every_step: bool = False,
) -> StepPlan:
    """Which rows flush this step: natural (`write_pos == L-1`), forced, or every live row
    when `flush_every_step` (the plain recurrence; see `KernelConfig.flush_every_step`)."""
    num_slots = write_pos.shape[0]
    slots = slots.astype(jnp.int32)
    valid = (slots >= 0) & (slots < num_slots)
    slot = jnp.where(valid, slots, 0)
    pos = jnp.where(valid, write_pos[slot], 0)
    flush = (pos >= cache_len - 1) | flush_every_step
    if force_flush is not None:
        flush = flush | force_flush.astype(bool)
    flush = flush & valid
    return StepPlan(slot=slot, valid=valid, pos=pos, flush=flush,
                    launch_order=launch_order(valid, pos, flush, cache_len))


def launch_order(
    valid: Bool[Array, " B"], pos: Int[Array, " B"], flush: Bool[Array, " B"], cache_len: int
) -> Int[Array, " B"]:
    """Rows by descending cost of their step (see `StepPlan.launch_order`); stable, so a
    step whose rows all cost the same keeps the rows in order."""
    cost = jnp.where(valid, jnp.where(flush, cache_len + pos, pos), -1)
    return jnp.argsort(-cost, stable=True).astype(jnp.int32)


def advance_write_pos(write_pos: Int[Array, " N"], plan: StepPlan) -> Int[Array, " N"]:
    """Cursor after the step: 0 for flushed slots, pos + 1 otherwise; padding rows untouched."""
    num_slots = write_pos.shape[0]
    target = jnp.where(plan.valid, plan.slot, num_slots)  # out of range: dropped
    new_pos = jnp.where(plan.flush, 0, plan.pos + 1).astype(jnp.int32)
    return write_pos.at[target].set(new_pos, mode="drop")


def _per_channel(g: Float[Array, "B Hv *Dk"], head_k_dim: int) -> Float[Array, "B Hv Dk"]:
    """Log-decay per key channel: GDN's per-head scalar broadcast over d_k."""
    if g.ndim == 2:
        return jnp.broadcast_to(g[..., None], (*g.shape, head_k_dim))
    return g


def _expand_heads(x: Array, group_size: int, axis: int = 1) -> Array:
    """Key-head tensor to value heads: value head h uses key head h // group_size."""
    return jnp.repeat(x, group_size, axis=axis)


def replay_state(state: ReplayState, plan: StepPlan) -> Float[Array, "B Hv Dv Dk"]:
    """The live state S_{t-1} of each row's slot in float32 (zeros for padding rows)."""
    cfg = state.config
    length = cfg.cache_len
    ckpt = state.checkpoint[plan.slot].astype(jnp.float32)
    u = state.u_cache[plan.slot].astype(jnp.float32)  # [B, Hv, L, Dv]
    k = _expand_heads(state.k_cache[plan.slot].astype(jnp.float32), cfg.group_size)
    g = state.g_cache[plan.slot]  # [B, Hv, L] or [B, Hv, L, Dk]
    if g.ndim == 3:
        g = jnp.broadcast_to(g[..., None], (*g.shape, cfg.head_k_dim))
    live = (jnp.arange(length)[None, :] < plan.pos[:, None])[:, None, :, None]  # [B,1,L,1]
    g = jnp.where(live, g, 0.0)
    prefix = jnp.cumsum(g, axis=2)  # c_j
    total = prefix[:, :, -1, :]  # G: [B, Hv, Dk]
    weights = jnp.where(live, jnp.exp(total[:, :, None, :] - prefix), 0.0)  # W_j
    u = jnp.where(live, u, 0.0)
    rebuilt = jnp.einsum("bhlv,bhlk->bhvk", u, weights * k, precision=_HIGHEST)
    live_state = ckpt * jnp.exp(total)[:, :, None, :] + rebuilt
    return jnp.where(plan.valid[:, None, None, None], live_state, 0.0)


def xla_layer_step(
    state: ReplayState,
    q: Float[Array, "B Hk Dk"],
    k: Float[Array, "B Hk Dk"],
    v: Float[Array, "B Hv Dv"],
    g: Float[Array, "B Hv *Dk"],
    beta: Float[Array, "B Hv"],
    plan: StepPlan,
    *,
    use_qk_l2norm: bool,
    scale: float | None,
) -> tuple[Float[Array, "B Hv Dv"], ReplayState]:
    """One layer's step for a given plan. Updates checkpoint and caches, not `write_pos`.

    Returns:
      `y [B, H_v, d_v]` in v's dtype (exactly 0 on padding rows) and the new state.
    """
    cfg = state.config
    num_slots = state.num_slots
    q, k = gating.prepare_qk(q, k, use_qk_l2norm=use_qk_l2norm, scale=scale)
    g = g.astype(jnp.float32)
    qv, kv = _expand_heads(q, cfg.group_size), _expand_heads(k, cfg.group_size)
    alpha = jnp.exp(_per_channel(g, cfg.head_k_dim))  # [B, Hv, Dk]

    prev = replay_state(state, plan)
    # The k/g appends below do not depend on the replay's reads of those caches; tie the
    # caches to `prev` so XLA orders the reads first and updates donated buffers in place
    # (without this, copy insertion copies both caches every step).
    prev, k_pool, g_pool = jax.lax.optimization_barrier((prev, state.k_cache, state.g_cache))
    matvec = lambda s, x: jnp.einsum("bhvk,bhk->bhv", s, x, precision=_HIGHEST)
    u = beta.astype(jnp.float32)[..., None] * (v.astype(jnp.float32) - matvec(prev, alpha * kv))
    y = matvec(prev, alpha * qv) + u * jnp.sum(kv * qv, axis=-1, keepdims=True)
    y = jnp.where(plan.valid[:, None, None], y, 0.0).astype(v.dtype)

    flush_slot = jnp.where(plan.flush, plan.slot, num_slots)  # padding rows never flush
    append_slot = jnp.where(plan.valid & ~plan.flush, plan.slot, num_slots)
    new_state = prev * alpha[:, :, None, :] + u[..., :, None] * kv[..., None, :]
    checkpoint = state.checkpoint.at[flush_slot].set(
        new_state.astype(cfg.state_dtype), mode="drop"
    )
    u_cache = state.u_cache.at[append_slot, :, plan.pos].set(u.astype(cfg.cache_dtype), mode="drop")
    k_cache = k_pool.at[append_slot, :, plan.pos].set(k.astype(cfg.cache_dtype), mode="drop")
    g_cache = g_pool.at[append_slot, :, plan.pos].set(g, mode="drop")
    return y, dataclasses.replace(
        state, checkpoint=checkpoint, u_cache=u_cache, k_cache=k_cache, g_cache=g_cache
    )
