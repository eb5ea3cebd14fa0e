"""`recurrent_reference` (the oracle) against an independent float64 numpy loop."""

from __future__ import annotations

import chex
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import astuple, random_tokens, rel_err, small_config, to_device
from replayssm_jax import Tokens, recurrent_reference

# The scan runs in float32 over T steps; the numpy loop in float64. Per-step rounding is
# ~1e-7 relative and the recurrence is contractive (alpha < 1, l2-normalised keys), so the
# measured error is ~1e-7; 1e-5 is the bound the replay tests use for fp32.
TOL = 1e-5


def numpy_recurrence(q, k, v, g, beta, state, *, use_qk_l2norm, scale):
    """The gated delta rule token by token, value head h reading key head h // (H_v/H_k)."""
    q, k, v, g, beta, state = (np.asarray(x, np.float64) for x in (q, k, v, g, beta, state))
    if use_qk_l2norm:
        q = q / np.sqrt(np.sum(q**2, -1, keepdims=True) + 1e-6)
        k = k / np.sqrt(np.sum(k**2, -1, keepdims=True) + 1e-6)
    q = q * (q.shape[-1] ** -0.5 if scale is None else scale)
    batch, steps, hk = q.shape[:3]
    hv = v.shape[2]
    ys = np.zeros(v.shape)
    states = np.zeros((batch, steps, *state.shape[1:]))
    for b in range(batch):
        s = state[b].copy()
        for t in range(steps):
            for h in range(hv):
                kh = h // (hv // hk)
                s[h] = s[h] * np.exp(g[b, t, h])  # scalar (GDN) or per column d_k (KDA)
                u = beta[b, t, h] * (v[b, t, h] - s[h] @ k[b, t, kh])
                s[h] = s[h] + np.outer(u, k[b, t, kh])
                ys[b, t, h] = s[h] @ q[b, t, kh]
            states[b, t] = s
    return ys, states


@pytest.mark.parametrize("use_qk_l2norm, scale", [(True, None), (False, 0.25)])
@pytest.mark.parametrize("gate", ["gdn", "kda"])
def test_reference_matches_numpy_loop(gate, use_qk_l2norm, scale, rng):
    config = small_config(gate, 4)
    batch, steps = 2, 9
    tokens = random_tokens(rng, config, (batch, steps))
    if not use_qk_l2norm:  # keep the delta rule stable: beta ||k||^2 < 2
        tokens = tokens.replace(k=tokens.k / np.float32(np.sqrt(config.head_k_dim)))
    state0 = 0.3 * rng.normal(size=(batch, 4, 16, 32)).astype(np.float32)
    want_y, want_states = numpy_recurrence(
        *astuple(tokens), state0, use_qk_l2norm=use_qk_l2norm, scale=scale
    )
    y, final, states = recurrent_reference(
        to_device(tokens), jnp.asarray(state0),
        use_qk_l2norm=use_qk_l2norm, scale=scale, return_all_states=True,
    )
    assert y.shape == (batch, steps, 4, 16) and states.shape == (batch, steps, 4, 16, 32)
    assert y.dtype == final.dtype == jnp.float32
    for t in range(steps):
        assert rel_err(y[:, t], want_y[:, t]).max() <= TOL, t
        assert rel_err(states[:, t], want_states[:, t]).max() <= TOL, t
    np.testing.assert_array_equal(final, states[:, -1])
    y_only, final_only = recurrent_reference(
        to_device(tokens), jnp.asarray(state0),
        use_qk_l2norm=use_qk_l2norm, scale=scale,
    )
    chex.assert_trees_all_equal((y_only, final_only), (y, final))


def test_reference_rejects_ungrouped_heads(rng):
    q = jnp.zeros((1, 2, 3, 8))
    v = jnp.zeros((1, 2, 4, 8))
    with pytest.raises(ValueError, match=r"v heads \(4\) must be a multiple of q/k heads \(3\)"):
        recurrent_reference(Tokens(q, q, v, jnp.zeros((1, 2, 4)), jnp.zeros((1, 2, 4))),
                            jnp.zeros((1, 4, 8, 8)))
