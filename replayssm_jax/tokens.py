"""One decode step's inputs as a pytree."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from replayssm_jax.config import ReplayConfig
from replayssm_jax.validation import check_float


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Tokens:
    """Inputs of the delta-rule gates (GDN, KDA), any leading axes `...` (`[B]` for one
    decode step, `[B, T]` for a sequence):

      q, k  `[..., H_k, d_k]`
      v     `[..., H_v, d_v]`
      g     `[..., H_v]` (GDN) or `[..., H_v, d_k]` (KDA): log-decay, `alpha = exp(g)`
      beta  `[..., H_v]`: write strength in (0, 1)

    With `gate_params` given to the step, `g` and `beta` hold the raw model inputs `a` and
    `b` of the same shapes, gated in the step.
    """

    q: Float[Array, "... Hk Dk"]
    k: Float[Array, "... Hk Dk"]
    v: Float[Array, "... Hv Dv"]
    g: Float[Array, "... Hv *Dk"]
    beta: Float[Array, "... Hv"]

    @property
    def batch(self) -> int:
        return jnp.shape(self.q)[0]

    def replace(self, **fields) -> Tokens:
        return dataclasses.replace(self, **fields)


def check_tokens(config: ReplayConfig, tokens: Tokens) -> int:
    """Raise ValueError naming the field whose shape or dtype is wrong; return B."""
    if not isinstance(tokens, Tokens):
        raise ValueError(f"tokens must be a Tokens, got {type(tokens).__name__}")
    if jnp.ndim(tokens.q) != 3:
        raise ValueError(f"tokens.q must be [B, H_k, d_k], got shape {tuple(jnp.shape(tokens.q))}")
    batch = tokens.batch
    for name, want in config.gate_kind.token_shapes(config, batch).items():
        check_float(f"tokens.{name}", getattr(tokens, name), want)
    return batch


def check_gate_params(config: ReplayConfig, gate_params) -> None:
    """`gate_params = (A_log [H_v], dt_bias [H_v] (GDN) or [H_v, d_k] (KDA))`."""
    if gate_params is None:
        return
    if not isinstance(gate_params, (tuple, list)) or len(gate_params) != 2:
        raise ValueError("gate_params must be a pair (A_log, dt_bias)")
    a_log_shape, dt_bias_shape = config.gate_kind.gate_param_shapes(config)
    check_float("gate_params[0] (A_log)", gate_params[0], a_log_shape)
    check_float("gate_params[1] (dt_bias)", gate_params[1], dt_bias_shape)
