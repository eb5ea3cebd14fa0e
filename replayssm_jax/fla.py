"""Entry points with flash-linear-attention's (FLA's) signatures, shapes and state layout.

FLA lays a head's state out as `[K, V]` (`initial_state [N, H_v, K, V]`); this package as
`[V, K]` (`[N, H_v, d_v, d_k]`, K contiguous). `to_fla_state` / `from_fla_state` convert (a
transpose of the last two axes). Inputs follow FLA: `q, k [B, T, H, K]`, `v [B, T, H_v, V]`,
`g [B, T, H_v]` (GDN) or `[B, T, H_v, K]` (KDA), `beta [B, T, H_v]`. With `cu_seqlens`
(`[N + 1]` offsets, concrete) the batch is one packed row of N sequences, as in FLA.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from replayssm_jax.chunked import DEFAULT_CHUNK, chunked_gated_delta_rule
from replayssm_jax.reference import recurrent_reference
from replayssm_jax.tokens import Tokens
from replayssm_jax.validation import check_array, concrete_or_none


def to_fla_state(state: Float[Array, "... Dv Dk"]) -> Float[Array, "... Dk Dv"]:
    """This package's `[..., d_v, d_k]` state in FLA's `[..., K, V]` layout."""
    return jnp.swapaxes(state, -1, -2)


def from_fla_state(state: Float[Array, "... Dk Dv"]) -> Float[Array, "... Dv Dk"]:
    """FLA's `[..., K, V]` state in this package's `[..., d_v, d_k]` layout."""
    return jnp.swapaxes(state, -1, -2)


def _unpack(x: Array, starts: np.ndarray, lengths: np.ndarray, width: int) -> Array:
    """One packed row `[1, T, ...]` -> `[N, width, ...]` (zero past each length)."""
    index = starts[:, None] + np.minimum(np.arange(width)[None, :], np.maximum(lengths - 1, 0)[:, None])
    rows = x[0][index]
    live = (np.arange(width)[None, :] < lengths[:, None]).reshape(*index.shape, *([1] * (x.ndim - 2)))
    return jnp.where(live, rows, 0)


def _pack(y: Array, lengths: np.ndarray) -> Array:
    """`[N, width, ...]` -> one packed row `[1, sum(lengths), ...]`."""
    return jnp.concatenate([y[i, :n] for i, n in enumerate(lengths)], axis=0)[None]


def _check_inputs(q, k, v, g, beta, *, per_channel: bool) -> None:
    """FLA's input shapes (module doc), each a floating array; ValueErrors name the input."""
    check_array("q", q, (None,) * 4, float, layout="[B, T, H, K]")
    batch, steps, heads, head_k = jnp.shape(q)
    check_array("k", k, (batch, steps, heads, head_k), float)
    check_array("v", v, (batch, steps, None, None), float,
                layout=f"[B, T, H_v, V] with B, T = {batch}, {steps}")
    num_v_heads = jnp.shape(v)[2]
    if per_channel:
        want = (batch, steps, num_v_heads, head_k)
        check_array("g", g, want, float, layout=f"[B, T, H_v, K] = {want} (one decay per key channel)")
    else:
        want = (batch, steps, num_v_heads)
        check_array("g", g, want, float, layout=f"[B, T, H_v] = {want} (one decay per head)")
    check_array("beta", beta, (batch, steps, num_v_heads), float)


def _run(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
         cu_seqlens, *, per_channel: bool, chunked: bool, chunk_size: int = DEFAULT_CHUNK):
    _check_inputs(q, k, v, g, beta, per_channel=per_channel)
    batch, steps, _, head_k = jnp.shape(q)
    num_v_heads, head_v = jnp.shape(v)[2:]
    lengths = None
    if cu_seqlens is not None:
        offsets = concrete_or_none(cu_seqlens)
        if offsets is None or offsets.ndim != 1 or offsets.size < 2 or batch != 1:
            raise ValueError("cu_seqlens must be a concrete [N + 1] array of offsets, with a batch of 1 packed row")
        offsets = offsets.astype(np.int64)
        if offsets[0] != 0 or offsets[-1] != steps or np.any(np.diff(offsets) < 0):
            raise ValueError(f"cu_seqlens must rise from 0 to T = {steps}, got {offsets.tolist()}")
        lengths_np = np.diff(offsets)
        width = max(int(lengths_np.max()), 1)
        q, k, v, g, beta = (_unpack(x, offsets[:-1], lengths_np, width) for x in (q, k, v, g, beta))
        lengths = jnp.asarray(lengths_np, jnp.int32)
    num_seqs = q.shape[0]
    if initial_state is None:
        state = jnp.zeros((num_seqs, num_v_heads, head_v, head_k), jnp.float32)
    else:
        want = (num_seqs, num_v_heads, head_k, head_v)
        check_array("initial_state", initial_state, want, layout=f"[N, H_v, K, V] = {want}")
        state = from_fla_state(initial_state)
    tokens = Tokens(q, k, v, g, beta)
    if chunked:
        y, final = chunked_gated_delta_rule(tokens, state, lengths=lengths, chunk_size=chunk_size,
                                            use_qk_l2norm=use_qk_l2norm_in_kernel, scale=scale)
    else:
        if lengths is not None:  # padding positions: decay 1, no write, so the state stops at the length
            live = jnp.arange(q.shape[1])[None, :] < lengths[:, None]
            live_g = live.reshape(*live.shape, *([1] * (g.ndim - 2)))
            tokens = tokens.replace(g=jnp.where(live_g, g, 0.0), beta=jnp.where(live[..., None], beta, 0.0))
        y, final = recurrent_reference(tokens, state, use_qk_l2norm=use_qk_l2norm_in_kernel, scale=scale)
    if cu_seqlens is not None:
        y = _pack(y, lengths_np)
    return y, (to_fla_state(final) if output_final_state else None)


def fused_recurrent_gated_delta_rule(
    q, k, v, g, beta, scale: float | None = None, initial_state=None, output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False, cu_seqlens: Int[Array, " Np1"] | None = None,
):
    """GDN over a sequence, token by token (FLA's `fused_recurrent_gated_delta_rule`).

    Returns `(o [B, T, H_v, V], final_state [N, H_v, K, V] or None)`, float32."""
    return _run(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
                cu_seqlens, per_channel=False, chunked=False)


def fused_recurrent_kda(
    q, k, v, g, beta, scale: float | None = None, initial_state=None, output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False, cu_seqlens: Int[Array, " Np1"] | None = None,
):
    """KDA over a sequence, token by token: as `fused_recurrent_gated_delta_rule` with a
    per-channel decay `g [B, T, H_v, K]`."""
    return _run(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
                cu_seqlens, per_channel=True, chunked=False)


def chunk_gated_delta_rule(
    q, k, v, g, beta, scale: float | None = None, initial_state=None, output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False, cu_seqlens: Int[Array, " Np1"] | None = None,
    chunk_size: int = DEFAULT_CHUNK,
):
    """GDN over a sequence in chunks of `chunk_size` (FLA's `chunk_gated_delta_rule`; see
    `replayssm_jax.chunked`). Same arguments and results as the fused recurrent form."""
    return _run(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
                cu_seqlens, per_channel=False, chunked=True, chunk_size=chunk_size)
