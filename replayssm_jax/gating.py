"""Gates and normalisation from raw model inputs (Qwen3-Next / Kimi conventions).

The gates compute in float32 and return float32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

SOFTPLUS_THRESHOLD = 20.0
L2NORM_EPS = 1e-6


def softplus(x: Float[Array, "..."]) -> Float[Array, "..."]:
    """`log(1 + exp(x))`, linear above 20 (the PyTorch/Triton convention)."""
    x = x.astype(jnp.float32)
    safe = jnp.minimum(x, SOFTPLUS_THRESHOLD)
    return jnp.where(x > SOFTPLUS_THRESHOLD, x, jnp.log1p(jnp.exp(safe)))


def gdn_gate(
    a: Float[Array, "B Hv"], A_log: Float[Array, " Hv"], dt_bias: Float[Array, " Hv"]
) -> Float[Array, "B Hv"]:
    """GDN log-decay `g = -exp(A_log) * softplus(a + dt_bias)`, one per value head."""
    return -jnp.exp(A_log.astype(jnp.float32)) * softplus(a.astype(jnp.float32) + dt_bias)


def kda_gate(
    a: Float[Array, "B Hv Dk"], A_log: Float[Array, " Hv"], dt_bias: Float[Array, "Hv Dk"]
) -> Float[Array, "B Hv Dk"]:
    """KDA per-channel log-decay `g = -exp(A_log)[h] * softplus(a + dt_bias)`."""
    decay = jnp.exp(A_log.astype(jnp.float32))[:, None]
    return -decay * softplus(a.astype(jnp.float32) + dt_bias)


def beta_gate(b: Float[Array, "B Hv"]) -> Float[Array, "B Hv"]:
    """Write strength `beta = sigmoid(b)`."""
    return jax.nn.sigmoid(b.astype(jnp.float32))


def l2norm(x: Float[Array, "... D"], eps: float = L2NORM_EPS) -> Float[Array, "... D"]:
    """`x / sqrt(sum(x^2) + eps)` over the last axis, in float32 (float64 stays float64)."""
    x = x.astype(jnp.promote_types(x.dtype, jnp.float32))
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def prepare_qk(
    q: Float[Array, "... Dk"],
    k: Float[Array, "... Dk"],
    *,
    use_qk_l2norm: bool,
    scale: float | None,
    dtype: jnp.dtype = jnp.float32,
) -> tuple[Float[Array, "... Dk"], Float[Array, "... Dk"]]:
    """q and k in `dtype` as the recurrence uses them: optional L2 norm, then q * scale."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    q, k = q.astype(dtype), k.astype(dtype)
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    return q * scale, k


def mamba2_dt(dt: Float[Array, "B H"], dt_bias: Float[Array, " H"], *, dt_softplus: bool = True,
              dt_limit: tuple[float, float] = (0.0, float("inf"))) -> Float[Array, "B H"]:
    """Mamba-2 time step `clip(softplus(dt + dt_bias), *dt_limit)` in float32 (no softplus
    when `dt_softplus` is False)."""
    dt = dt.astype(jnp.float32) + dt_bias.astype(jnp.float32)
    if dt_softplus:
        dt = softplus(dt)
    lo, hi = dt_limit
    return jnp.clip(dt, lo, hi) if (lo, hi) != (0.0, float("inf")) else dt


def silu(x: Float[Array, "..."]) -> Float[Array, "..."]:
    """`x * sigmoid(x)` in float32 or wider (the Mamba-2 output gate)."""
    x = x.astype(jnp.promote_types(x.dtype, jnp.float32))
    return x * jax.nn.sigmoid(x)
