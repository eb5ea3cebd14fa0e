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
  ADDITIVE     the raw input `x` (Mamba-2): the update `dt x B^T` does not read the state,
               so the cache holds `x`, `B` and `dt` and replay forms `u_j = dt_j x_j` and the
               log-decay `A_h dt_j` from them; `C` is never cached.

Mamba-2 on the GDN layout: heads H are the value heads (`num_v_heads`), head dim P is
`head_v_dim`, state size N is `head_k_dim`, groups G are the key heads (`num_k_heads`; head h
uses group `h // (H/G)`). The state is `[N_slots, H, P, N]` like GDN's `[N_slots, H_v, d_v,
d_k]`, and the cache fields hold, per gate kind:

  field     delta rule (GDN, KDA)              additive (Mamba-2)
  u_cache   u [N, H_v, L, d_v]  cache dtype    x  [N, H, L, P]   cache dtype
  k_cache   k [N, H_k, L, d_k]  cache dtype    B  [N, G, L, N]   cache dtype
  g_cache   g [N, H_v, L, *Dk]  float32        dt [N, H, L]      float32, after softplus
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
    ADDITIVE = "additive"


@dataclasses.dataclass(frozen=True)
class GateKind:
    """One layer kind's gate: its decay shape, update rule and cache schema."""

    name: str
    decay: Decay
    update: UpdateRule

    @property
    def additive(self) -> bool:
        """The Mamba-2 rule: cache the raw inputs, no delta correction."""
        return self.update is UpdateRule.ADDITIVE

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
        [N, H_v, L, *decay]` (log-decays, float32). Additive rule (Mamba-2), the same shapes
        on its layout: `x`, `B` (once per group) and `dt` (float32, after softplus)."""
        n, hk, hv = num_slots, config.num_k_heads, config.num_v_heads
        dk, dv, length = config.head_k_dim, config.head_v_dim, config.cache_len
        return dict(
            u_cache=jax.ShapeDtypeStruct((n, hv, length, dv), config.cache_dtype),
            k_cache=jax.ShapeDtypeStruct((n, hk, length, dk), config.cache_dtype),
            g_cache=jax.ShapeDtypeStruct((n, hv, length, *self.decay_tail(dk)), jnp.float32),
        )

    def token_shapes(self, config, batch: int) -> dict[str, tuple[int, ...]]:
        """Shapes of one step's inputs for `batch` rows, by `Tokens` field (`Mamba2Tokens`
        field for the additive rule; its optional `z` has x's shape)."""
        hk, hv, dk, dv = config.num_k_heads, config.num_v_heads, config.head_k_dim, config.head_v_dim
        if self.additive:
            return dict(x=(batch, hv, dv), B=(batch, hk, dk), C=(batch, hk, dk), dt=(batch, hv))
        return dict(q=(batch, hk, dk), k=(batch, hk, dk), v=(batch, hv, dv),
                    g=(batch, hv, *self.decay_tail(dk)), beta=(batch, hv))

    def gate_param_shapes(self, config) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Shapes of `(A_log, dt_bias)` for gating from raw inputs in the step (additive rule:
        `(A, dt_bias)`, with `D` of A's shape, in `Mamba2Params`)."""
        hv = config.num_v_heads
        return (hv,), (hv, *self.decay_tail(config.head_k_dim))


GATES: dict[str, GateKind] = {
    "gdn": GateKind("gdn", Decay.PER_HEAD, UpdateRule.DELTA),
    "kda": GateKind("kda", Decay.PER_CHANNEL, UpdateRule.DELTA),
    "mamba2": GateKind("mamba2", Decay.PER_HEAD, UpdateRule.ADDITIVE),
}


def gate_kind(name: str) -> GateKind:
    """The registered gate kind called `name`."""
    try:
        return GATES[name]
    except (KeyError, TypeError):
        raise ValueError(f"gate must be one of {tuple(GATES)}, got {name!r}") from None
