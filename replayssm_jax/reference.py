"""The plain gated delta-rule recurrence as a `lax.scan`: the oracle for every test.

This module shares no code with the replay path (only the q/k preparation from
`gating`). It materialises the state at every step:

    S~  = S_{t-1} * alpha          (alpha = exp(g): per head for GDN, per key channel for KDA)
    u_t = beta * (v - S~ k)
    S_t = S~ + u_t k^T
    y_t = S_t q
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from replayssm_jax import gating
from replayssm_jax.tokens import Tokens

_HIGHEST = jax.lax.Precision.HIGHEST


def _compute_dtype(*arrays: Array) -> jnp.dtype:
    """float64 when any input is float64 (x64 enabled), else float32."""
    if any(a.dtype == jnp.float64 for a in arrays):
        return jnp.dtype(jnp.float64)
    return jnp.dtype(jnp.float32)


def _decay(state: Float[Array, "B Hv Dv Dk"], g: Float[Array, "B Hv *Dk"]) -> Array:
    """`S * exp(g)`: scalar per head (GDN, g [B,Hv]) or per key channel (KDA, g [B,Hv,Dk])."""
    alpha = jnp.exp(g)
    if g.ndim == 2:
        return state * alpha[:, :, None, None]
    return state * alpha[:, :, None, :]


def recurrent_step(
    state: Float[Array, "B Hv Dv Dk"],
    q: Float[Array, "B Hv Dk"],
    k: Float[Array, "B Hv Dk"],
    v: Float[Array, "B Hv Dv"],
    g: Float[Array, "B Hv *Dk"],
    beta: Float[Array, "B Hv"],
) -> tuple[Float[Array, "B Hv Dv"], Float[Array, "B Hv Dv Dk"]]:
    """One token of the plain recurrence; q, k already expanded to value heads."""
    decayed = _decay(state, g)
    u = beta[..., None] * (v - jnp.einsum("bhvk,bhk->bhv", decayed, k, precision=_HIGHEST))
    new_state = decayed + u[..., :, None] * k[..., None, :]
    y = jnp.einsum("bhvk,bhk->bhv", new_state, q, precision=_HIGHEST)
    return y, new_state


def recurrent_reference(
    tokens: Tokens,
    initial_state: Float[Array, "B Hv Dv Dk"],
    *,
    use_qk_l2norm: bool = False,
    scale: float | None = None,
    return_all_states: bool = False,
):
    """Run the plain recurrence over a time axis.

    Args:
      tokens: `Tokens` with leading axes `[B, T]`: q, k `[B, T, H_k, d_k]`, v
        `[B, T, H_v, d_v]`, g `[B, T, H_v]` (per-head decay, GDN) or `[B, T, H_v, d_k]`
        (per-channel decay, KDA), beta `[B, T, H_v]`.
      initial_state: `[B, H_v, d_v, d_k]`.
      use_qk_l2norm: L2-normalise q and k (eps 1e-6) before use.
      scale: multiplies q after the norm; default `d_k ** -0.5`.
      return_all_states: also return the state after every step.

    Returns:
      `(y [B,T,H_v,d_v], final_state [B,H_v,d_v,d_k])`, plus `states [B,T,H_v,d_v,d_k]`
      when `return_all_states`; in float64 if any input is float64, else float32.
    """
    q, k, v, g, beta = tokens.q, tokens.k, tokens.v, tokens.g, tokens.beta
    dtype = _compute_dtype(q, k, v, g, beta, initial_state)
    hk, hv = q.shape[2], v.shape[2]
    if hv % hk:
        raise ValueError(f"v heads ({hv}) must be a multiple of q/k heads ({hk})")
    q, k = gating.prepare_qk(q, k, use_qk_l2norm=use_qk_l2norm, scale=scale, dtype=dtype)
    q = jnp.repeat(q, hv // hk, axis=2)
    k = jnp.repeat(k, hv // hk, axis=2)
    xs = tuple(jnp.moveaxis(x.astype(dtype), 1, 0) for x in (q, k, v, g, beta))

    def step(state, x):
        y, new_state = recurrent_step(state, *x)
        return new_state, (y, new_state) if return_all_states else y

    final, out = jax.lax.scan(step, initial_state.astype(dtype), xs)
    if return_all_states:
        ys, states = out
        return jnp.moveaxis(ys, 0, 1), final, jnp.moveaxis(states, 0, 1)
    return jnp.moveaxis(out, 0, 1), final


# Mamba-2: the plain selective-state recurrence, per head h (state S [P, N]):
#
#     dt_t = softplus(dt_raw + dt_bias)       (clamped to dt_limit)
#     S_t  = exp(A_h dt_t) S_{t-1} + dt_t x_t B_t^T
#     y_t  = S_t C_t + D_h x_t                (times silu(z_t) when z is given)


def mamba2_step(state, x, B, C, dt, A, D):
    """One token of the Mamba-2 recurrence; B, C expanded to heads.

    Shapes: state `[B, H, P, N]`, x `[B, H, P]`, B/C `[B, H, N]`, dt `[B, H]` (after the
    softplus), A/D `[H]`. Returns `(y [B, H, P] before the z gate, S_t)`."""
    decay = jnp.exp(A[None, :] * dt)[:, :, None, None]
    new_state = decay * state + (dt[..., None] * x)[..., :, None] * B[..., None, :]
    y = jnp.einsum("bhpn,bhn->bhp", new_state, C, precision=_HIGHEST) + D[None, :, None] * x
    return y, new_state


def mamba2_reference(tokens, initial_state, params, *, return_all_states: bool = False):
    """Run the Mamba-2 recurrence over a time axis.

    Args:
      tokens: `Mamba2Tokens` with leading axes `[B, T]`: x `[B, T, H, P]`, B/C
        `[B, T, G, N]`, raw dt `[B, T, H]`, optional z `[B, T, H, P]`.
      initial_state: `[B, H, P, N]`.
      params: `Mamba2Params` (A, D, dt_bias `[H]`; dt_softplus, dt_limit).
      return_all_states: also return the state after every step.

    Returns:
      `(y [B, T, H, P], final_state)`, plus `states [B, T, H, P, N]` when
      `return_all_states`; float64 if any input is float64, else float32.
    """
    x, B, C = tokens.x, tokens.B, tokens.C
    dtype = _compute_dtype(x, B, C, tokens.dt, initial_state, params.A)
    heads, groups = x.shape[2], B.shape[2]
    if heads % groups:
        raise ValueError(f"heads ({heads}) must be a multiple of groups ({groups})")
    dt = gating.mamba2_dt(tokens.dt, params.dt_bias, dt_softplus=params.dt_softplus,
                          dt_limit=params.dt_limit).astype(dtype)
    B = jnp.repeat(B.astype(dtype), heads // groups, axis=2)
    C = jnp.repeat(C.astype(dtype), heads // groups, axis=2)
    xs = tuple(jnp.moveaxis(a.astype(dtype), 1, 0) for a in (x, B, C, dt))
    A, D = params.A.astype(dtype), params.D.astype(dtype)

    def step(state, inputs):
        y, new_state = mamba2_step(state, *inputs, A, D)
        return new_state, (y, new_state) if return_all_states else y

    final, out = jax.lax.scan(step, initial_state.astype(dtype), xs)
    ys, states = out if return_all_states else (out, None)
    ys = jnp.moveaxis(ys, 0, 1)
    if tokens.z is not None:
        ys = ys * gating.silu(tokens.z.astype(dtype)).astype(dtype)
    if return_all_states:
        return ys, final, jnp.moveaxis(states, 0, 1)
    return ys, final
