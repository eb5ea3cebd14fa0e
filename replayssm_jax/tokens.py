"""One decode step's inputs as a pytree."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from replayssm_jax.config import ReplayConfig
from replayssm_jax.validation import check_array


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


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Mamba2Tokens:
    """Inputs of a Mamba-2 step (gate "mamba2"), any leading axes `...`:

      x     `[..., H, P]`
      B, C  `[..., G, N]` (head h uses group h // (H/G))
      dt    `[..., H]`: the raw time step; the step takes `softplus(dt + dt_bias)` (clamped
            to `Mamba2Params.dt_limit`)
      z     optional `[..., H, P]`: the output is gated `y * silu(z)`
    """

    x: Float[Array, "... H P"]
    B: Float[Array, "... G N"]
    C: Float[Array, "... G N"]
    dt: Float[Array, "... H"]
    z: Float[Array, "... H P"] | None = None

    @property
    def batch(self) -> int:
        return jnp.shape(self.x)[0]

    def replace(self, **fields) -> Mamba2Tokens:
        return dataclasses.replace(self, **fields)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Mamba2Params:
    """A Mamba-2 layer's SSM parameters, passed as the step's `gate_params`.

    Attributes:
      A: `[H]` the (negative) decay rate: `a_t = exp(A_h dt_t)`.
      D: `[H]` the skip: `y += D_h x`.
      dt_bias: `[H]` added to the raw dt before the softplus.
      dt_softplus: apply the softplus (static; False: dt + dt_bias is used as given).
      dt_limit: `(lo, hi)` clamp of dt after the softplus (static).
    """

    A: Float[Array, " H"]
    D: Float[Array, " H"]
    dt_bias: Float[Array, " H"]
    dt_softplus: bool = dataclasses.field(default=True, metadata=dict(static=True))
    dt_limit: tuple[float, float] = dataclasses.field(default=(0.0, float("inf")), metadata=dict(static=True))


def check_tokens(config: ReplayConfig, tokens: Tokens | Mamba2Tokens) -> int:
    """Raise ValueError naming the field whose shape or dtype is wrong; return B."""
    if config.gate_kind.additive:
        return _check_mamba2_tokens(config, tokens)
    if not isinstance(tokens, Tokens):
        raise ValueError(f"tokens must be a Tokens, got {type(tokens).__name__}")
    check_array("tokens.q", tokens.q, (None,) * 3, layout="[B, H_k, d_k]")
    batch = tokens.batch
    for name, want in config.gate_kind.token_shapes(config, batch).items():
        check_array(f"tokens.{name}", getattr(tokens, name), want, float)
    return batch


def _check_mamba2_tokens(config: ReplayConfig, tokens: Mamba2Tokens) -> int:
    if not isinstance(tokens, Mamba2Tokens):
        raise ValueError(f"tokens must be a Mamba2Tokens for gate 'mamba2', got {type(tokens).__name__}")
    check_array("tokens.x", tokens.x, (None,) * 3, layout="[B, H, P]")
    batch = tokens.batch
    shapes = config.gate_kind.token_shapes(config, batch)
    for name, want in shapes.items():
        check_array(f"tokens.{name}", getattr(tokens, name), want, float)
    if tokens.z is not None:
        check_array("tokens.z", tokens.z, shapes["x"], float)
    return batch


def check_gate_params(config: ReplayConfig, gate_params) -> None:
    """`gate_params = (A_log [H_v], dt_bias [H_v] (GDN) or [H_v, d_k] (KDA))`; for gate
    "mamba2" a `Mamba2Params`, required (the readout needs A)."""
    if config.gate_kind.additive:
        if not isinstance(gate_params, Mamba2Params):
            raise ValueError(f"gate 'mamba2' needs gate_params=Mamba2Params(A, D, dt_bias), got "
                             f"{type(gate_params).__name__}")
        heads = (config.num_v_heads,)
        for name in ("A", "D", "dt_bias"):
            check_array(f"gate_params.{name}", getattr(gate_params, name), heads, float)
        lo, hi = gate_params.dt_limit
        if not lo <= hi:
            raise ValueError(f"gate_params.dt_limit must be (lo, hi) with lo <= hi, got {gate_params.dt_limit}")
        return
    if gate_params is None:
        return
    if not isinstance(gate_params, (tuple, list)) or len(gate_params) != 2:
        raise ValueError("gate_params must be a pair (A_log, dt_bias)")
    a_log_shape, dt_bias_shape = config.gate_kind.gate_param_shapes(config)
    check_array("gate_params[0] (A_log)", gate_params[0], a_log_shape, float)
    check_array("gate_params[1] (dt_bias)", gate_params[1], dt_bias_shape, float)
