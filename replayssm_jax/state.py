"""The ReplaySSM state of one layer: a checkpoint and a circular cache per slot.

Layout (N physical slots, L = cache_len; the caches are the gate kind's schema,
`replayssm_jax.gates.GateKind.cache_shapes`):

  checkpoint  [N, H_v, d_v, d_k]   state_dtype   S at the slot's last flush
  u_cache     [N, H_v, L, d_v]     cache_dtype   corrected values u_j since then
  k_cache     [N, H_k, L, d_k]     cache_dtype   keys k_j (per key head, shared by its group)
  g_cache     [N, H_v, L]          float32       log-decays g_j (GDN)
              [N, H_v, L, d_k]     float32       (KDA: one per key channel)
  write_pos   [N]                  int32         valid entries = next write position

Gate "mamba2" (the additive rule) holds its raw inputs in the same fields, on the layout
`H_v = H`, `d_v = P`, `d_k = N`, `H_k = G` (`replayssm_jax.gates`): checkpoint
`[N, H, P, N_state]`, u_cache = x `[N, H, L, P]`, k_cache = B `[N, G, L, N_state]`,
g_cache = dt `[N, H, L]` (float32, after the softplus); C is never cached.

Entries at positions >= write_pos are stale: they are never read and never zeroed.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from replayssm_jax.config import ReplayConfig
from replayssm_jax.validation import check_like, check_positive_int


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ReplayState:
    """Pytree of one layer's ReplaySSM state; `config` is static metadata."""

    checkpoint: Float[Array, "N Hv Dv Dk"]
    u_cache: Float[Array, "N Hv L Dv"]
    k_cache: Float[Array, "N Hk L Dk"]
    g_cache: Float[Array, "N Hv L *Dk"]
    write_pos: Int[Array, " N"]
    config: ReplayConfig = dataclasses.field(metadata=dict(static=True))

    @property
    def num_slots(self) -> int:
        return self.checkpoint.shape[0]


def state_shapes(config: ReplayConfig, num_slots: int) -> dict[str, jax.ShapeDtypeStruct]:
    """Shapes and dtypes of every array field of a state with `num_slots` slots."""
    checkpoint = (num_slots, config.num_v_heads, config.head_v_dim, config.head_k_dim)
    return dict(
        checkpoint=jax.ShapeDtypeStruct(checkpoint, config.state_dtype),
        **config.gate_kind.cache_shapes(config, num_slots),
        write_pos=jax.ShapeDtypeStruct((num_slots,), jnp.int32),
    )


def init_state(
    config: ReplayConfig,
    num_slots: int,
    checkpoint: Float[Array, "N Hv Dv Dk"] | None = None,
) -> ReplayState:
    """A state with `num_slots` slots, empty caches and a zero (or given) checkpoint.

    Args:
      config: the layer configuration.
      num_slots: N, the number of physical slots.
      checkpoint: optional initial checkpoint `[N, H_v, d_v, d_k]` in `config.state_dtype`.

    Raises:
      ValueError: if `num_slots` is not positive or `checkpoint` has the wrong shape/dtype.
    """
    shapes = state_shapes(config, check_positive_int("num_slots", num_slots))
    if checkpoint is None:
        checkpoint = jnp.zeros(shapes["checkpoint"].shape, config.state_dtype)
    else:
        check_like("checkpoint", checkpoint, shapes["checkpoint"])
        checkpoint = jnp.asarray(checkpoint)
    arrays = {
        name: jnp.zeros(s.shape, s.dtype) for name, s in shapes.items() if name != "checkpoint"
    }
    return ReplayState(checkpoint=checkpoint, config=config, **arrays)


def check_state(state: ReplayState) -> None:
    """Raise ValueError unless every array field matches the state's config."""
    if not isinstance(state, ReplayState):
        raise ValueError(f"state must be a ReplayState, got {type(state).__name__}")
    shapes = state_shapes(state.config, state.checkpoint.shape[0])
    for name, want in shapes.items():
        check_like(f"state.{name}", getattr(state, name), want, context=f" for {state.config}")
