"""Chunked prefill of the gated delta rule (GDN): the UT-transform form, a `lax.scan` over
chunks of C tokens instead of over tokens.

Within a chunk starting from state S_0, with gamma_i = sum_{s <= i} g_s (per value head):

    S_i     = e^{gamma_i} S_0 + sum_{j <= i} e^{gamma_i - gamma_j} u_j k_j^T
    u_i     = beta_i (v_i - e^{gamma_i} S_0 k_i - sum_{j < i} e^{gamma_i - gamma_j} (k_i . k_j) u_j)

so the chunk's corrected values solve one unit lower-triangular system

    (I + A) U = beta * (V - e^{gamma} (S_0 K^T)^T),   A_ij = beta_i e^{gamma_i - gamma_j} k_i . k_j  (j < i)

and then `y_i = e^{gamma_i} S_0 q_i + sum_{j <= i} e^{gamma_i - gamma_j} (k_j . q_i) u_j`,
`S_C = e^{gamma_C} S_0 + sum_j e^{gamma_C - gamma_j} u_j k_j^T`. Exact algebra; the sums run
in another order than the token scan (`reference.recurrent_reference`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from replayssm_jax import gating
from replayssm_jax.tokens import Tokens
from replayssm_jax.validation import check_array, check_positive_int

DEFAULT_CHUNK = 64
_HIGHEST = jax.lax.Precision.HIGHEST


def _chunk_step(state, chunk):
    """One chunk: `state [B,H,V,K]`, chunk arrays `[B,C,H,...]` -> (new state, y [B,C,H,V])."""
    q, k, v, g, beta = chunk
    ein = lambda spec, *xs: jnp.einsum(spec, *xs, precision=_HIGHEST)
    size = g.shape[1]
    gamma = jnp.cumsum(g, axis=1)  # [B, C, H]
    diff = gamma[:, :, None, :] - gamma[:, None, :, :]  # [B, i, j, H]: gamma_i - gamma_j
    lower = jnp.arange(size)[:, None] >= jnp.arange(size)[None, :]
    strict = lower & ~jnp.eye(size, dtype=bool)
    # exponentiate only where j <= i (elsewhere the difference is positive and may overflow)
    decay = jnp.where(lower[None, :, :, None], jnp.exp(jnp.where(lower[None, :, :, None], diff, 0.0)), 0.0)
    decay = jnp.moveaxis(decay, -1, 1)  # [B, H, i, j]
    kk = ein("bihk,bjhk->bhij", k, k)
    a = jnp.where(strict, decay * kk, 0.0) * jnp.moveaxis(beta, 1, 2)[..., None]  # beta_i on row i
    e_gamma = jnp.moveaxis(jnp.exp(gamma), 1, 2)  # [B, H, C]
    s_k = ein("bhvk,bihk->bhiv", state, k)
    rhs = jnp.moveaxis(beta, 1, 2)[..., None] * (jnp.moveaxis(v, 1, 2) - e_gamma[..., None] * s_k)
    u = jax.scipy.linalg.solve_triangular(jnp.eye(size, dtype=a.dtype) + a, rhs, lower=True, unit_diagonal=True)
    s_q = ein("bhvk,bihk->bhiv", state, q)
    qk = ein("bihk,bjhk->bhij", q, k)
    y = e_gamma[..., None] * s_q + ein("bhij,bhjv->bhiv", decay * qk, u)
    tail = jnp.exp(gamma[:, -1:, :] - gamma)  # e^{gamma_C - gamma_j}: [B, C, H]
    new_state = (jnp.exp(gamma[:, -1])[:, :, None, None] * state
                 + ein("bhjv,bjhk->bhvk", u * jnp.moveaxis(tail, 1, 2)[..., None], k))
    return new_state, jnp.moveaxis(y, 1, 2)


def chunked_gated_delta_rule(
    tokens: Tokens,
    initial_state: Float[Array, "B Hv Dv Dk"],
    *,
    lengths: Int[Array, " B"] | None = None,
    chunk_size: int = DEFAULT_CHUNK,
    use_qk_l2norm: bool = False,
    scale: float | None = None,
) -> tuple[Float[Array, "B T Hv Dv"], Float[Array, "B Hv Dv Dk"]]:
    """The GDN recurrence over `tokens` (`[B, T]` leading axes, per-head decay `g [B,T,H_v]`)
    from `initial_state`, chunk by chunk.

    Positions `t >= lengths[b]` are padding: decay 1 and write strength 0, so the final state
    is the state after each row's last real token; their outputs are not meaningful.

    Returns:
      `(y [B,T,H_v,d_v], final state [B,H_v,d_v,d_k])` in float32 (float64 for float64 inputs).

    Raises:
      ValueError: for a per-channel decay (KDA: use the token scan) or a bad chunk size.
    """
    check_array("tokens.g", tokens.g, (None,) * 3, layout="a per-head decay [B, T, H_v] (KDA: use the token scan)")
    chunk_size = check_positive_int("chunk_size", chunk_size)
    dtype = jnp.float64 if any(x.dtype == jnp.float64 for x in jax.tree.leaves(tokens)) else jnp.float32
    batch, steps, hk = tokens.q.shape[:3]
    hv = tokens.v.shape[2]
    q, k = gating.prepare_qk(tokens.q, tokens.k, use_qk_l2norm=use_qk_l2norm, scale=scale, dtype=dtype)
    q, k = jnp.repeat(q, hv // hk, axis=2), jnp.repeat(k, hv // hk, axis=2)
    v, g, beta = (x.astype(dtype) for x in (tokens.v, tokens.g, tokens.beta))
    if lengths is not None:
        live = (jnp.arange(steps)[None, :] < jnp.asarray(lengths)[:, None])[..., None]
        g, beta = jnp.where(live, g, 0.0), jnp.where(live, beta, 0.0)
    pad = -steps % chunk_size
    padded = [jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2)) for x in (q, k, v, g, beta)]
    chunks = tuple(jnp.moveaxis(x.reshape(batch, -1, chunk_size, *x.shape[2:]), 1, 0) for x in padded)
    final, ys = jax.lax.scan(_chunk_step, initial_state.astype(dtype), chunks)
    y = jnp.moveaxis(ys, 0, 1).reshape(batch, steps + pad, hv, -1)[:, :steps]
    return y, final
