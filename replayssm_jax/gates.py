"""Gate kinds: what a layer's decay looks like, how its update is formed, what it caches.

A gate kind is read by `state_shapes` (the cache schema), the token checks (the input
schema), the scan reference and the xla backend (decay shape and update rule) and the
kernels' adapter. A new layer kind adds a `GateKind` here and the branches its rule needs;
the existing kinds' code paths stay as they are.

Decay:
  PER_HEAD     one log-decay per value head and token: `g [B, H_v]` (GDN).
  PER_CHANNEL  one log-decay per value head, key channel and token: `g [B, H_v, d_k]` (KDA).
Update rule (what the cache's value entry is):
  DELTA        `u = beta (v - S~ k)`, the corrected value (depends on the state).
"""

from __future__ import annotations

import dataclasses
import enum

import jax
import jax.numpy as jnp


class Decay(enum.Enum):
    PER_HEAD = "per_head"
    PER_CHANNEL = "per_channel"


class UpdateRule(enum.Enum):
    DELTA = "delta"


@dataclasses.dataclass(frozen=True)
class GateKind:
    """One layer kind's gate: its decay shape, update rule and cache schema."""

    name: str
    decay: Decay
    update: UpdateRule

    @property
    def per_channel(self) -> bool:
        return self.decay is Decay.PER_CHANNEL

    def decay_tail(self, head_k_dim: int) -> tuple[int, ...]:
        """Trailing shape of one value head's log-decay: `()` or `(d_k,)`."""
        return (head_k_dim,) if self.per_channel else ()

    def cache_shapes(self, config, num_slots: int) -> dict[str, jax.ShapeDtypeStruct]:
        """The cache arrays of a state with `num_slots` slots, by `ReplayState` field.

        Delta rule: `u_cache [N, H_v, L, d_v]` (corrected values, cache dtype), `k_cache
        [N, H_k, L, d_k]` (keys after the norm, once per key head, cache dtype), `g_cache
        [N, H_v, L, *decay]` (log-decays, float32)."""
        n, hk, hv = num_slots, config.num_k_heads, config.num_v_heads
        dk, dv, length = config.head_k_dim, config.head_v_dim, config.cache_len
        return dict(
            u_cache=jax.ShapeDtypeStruct((n, hv, length, dv), config.cache_dtype),
            k_cache=jax.ShapeDtypeStruct((n, hk, length, dk), config.cache_dtype),
            g_cache=jax.ShapeDtypeStruct((n, hv, length, *self.decay_tail(dk)), jnp.float32),
        )

    def token_shapes(self, config, batch: int) -> dict[str, tuple[int, ...]]:
        """Shapes of one step's inputs for `batch` rows, by `Tokens` field."""
        hk, hv, dk, dv = config.num_k_heads, config.num_v_heads, config.head_k_dim, config.head_v_dim
        return dict(q=(batch, hk, dk), k=(batch, hk, dk), v=(batch, hv, dv),
                    g=(batch, hv, *self.decay_tail(dk)), beta=(batch, hv))

    def gate_param_shapes(self, config) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Shapes of `(A_log, dt_bias)` for gating from raw inputs in the step."""
        hv = config.num_v_heads
        return (hv,), (hv, *self.decay_tail(config.head_k_dim))


GATES: dict[str, GateKind] = {
    "gdn": GateKind("gdn", Decay.PER_HEAD, UpdateRule.DELTA),
    "kda": GateKind("kda", Decay.PER_CHANNEL, UpdateRule.DELTA),
}


def gate_kind(name: str) -> GateKind:
    """The registered gate kind called `name`."""
    try:
        return GATES[name]
    except (KeyError, TypeError):
        raise ValueError(f"gate must be one of {tuple(GATES)}, got {name!r}") from None
