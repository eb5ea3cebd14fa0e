"""Gates and q/k normalisation against float64 numpy formulas."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from helpers import softplus as softplus64
from replayssm_jax import beta_gate, gdn_gate, kda_gate, l2norm
from replayssm_jax.gating import SOFTPLUS_THRESHOLD, prepare_qk, softplus

# float32 evaluation of exp/log1p/rsqrt: a few ulps (ulp = 2^-23 ~ 1.2e-7) relative.
RTOL = 2e-6


def softplus_thresholded(x: np.ndarray) -> np.ndarray:
    """float64 softplus, linear above 20 (PyTorch / Triton convention)."""
    x = np.asarray(x, np.float64)
    return np.where(x > 20.0, x, softplus64(np.minimum(x, 20.0)))


def test_softplus_matches_log1p_exp_below_threshold(rng):
    x = np.concatenate([rng.uniform(-30, 20, 500), [-30.0, -1e-3, 0.0, 1e-3, 19.99, 20.0]])
    x = x.astype(np.float32)
    np.testing.assert_allclose(softplus(jnp.asarray(x)), softplus64(x), rtol=RTOL)


def test_softplus_is_identity_above_threshold(rng):
    """Above 20 the result is exactly x, with no overflow of exp for huge inputs."""
    assert SOFTPLUS_THRESHOLD == 20.0
    x = np.concatenate([rng.uniform(20.001, 80, 100), [100.0, 1e4, 1e30, 3e38]]).astype(np.float32)
    out = np.asarray(softplus(jnp.asarray(x)))
    assert out.dtype == np.float32
    np.testing.assert_array_equal(out, x)


def test_softplus_of_bf16_computes_in_float32():
    assert softplus(jnp.zeros(3, jnp.bfloat16)).dtype == jnp.float32


def test_gdn_gate(rng):
    b, hv = 5, 4
    a = rng.normal(0, 8, (b, hv)).astype(np.float32)  # some a + dt_bias > 20
    a[0, 0] = 40.0
    A_log = rng.uniform(-1, 2, hv).astype(np.float32)
    dt_bias = rng.normal(size=hv).astype(np.float32)
    want = -np.exp(A_log.astype(np.float64)) * softplus_thresholded(a + dt_bias)
    got = gdn_gate(jnp.asarray(a), jnp.asarray(A_log), jnp.asarray(dt_bias))
    assert got.shape == (b, hv) and got.dtype == jnp.float32
    np.testing.assert_allclose(got, want, rtol=RTOL)
    assert np.all(np.asarray(got) < 0)


def test_kda_gate_is_per_channel_with_per_head_decay(rng):
    b, hv, dk = 3, 4, 8
    a = rng.normal(0, 8, (b, hv, dk)).astype(np.float32)
    A_log = rng.uniform(-1, 2, hv).astype(np.float32)
    dt_bias = rng.normal(size=(hv, dk)).astype(np.float32)
    want = -np.exp(A_log.astype(np.float64))[:, None] * softplus_thresholded(a + dt_bias)
    got = kda_gate(jnp.asarray(a), jnp.asarray(A_log), jnp.asarray(dt_bias))
    assert got.shape == (b, hv, dk) and got.dtype == jnp.float32
    np.testing.assert_allclose(got, want, rtol=RTOL)


def test_beta_gate(rng):
    b = rng.normal(0, 4, (5, 4)).astype(np.float32)
    got = beta_gate(jnp.asarray(b))
    np.testing.assert_allclose(got, 1 / (1 + np.exp(-b.astype(np.float64))), rtol=RTOL)
    assert beta_gate(jnp.asarray(b, jnp.bfloat16)).dtype == jnp.float32


def test_l2norm(rng):
    x = rng.normal(size=(3, 4, 16)).astype(np.float32)
    x[0, 0] = 0.0  # eps keeps a zero vector at zero instead of NaN
    x64 = x.astype(np.float64)
    want = x64 / np.sqrt(np.sum(x64**2, axis=-1, keepdims=True) + 1e-6)
    got = l2norm(jnp.asarray(x))
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=1e-7)
    np.testing.assert_array_equal(got[0, 0], 0.0)
    assert l2norm(jnp.asarray(x, jnp.bfloat16)).dtype == jnp.float32


@pytest.mark.parametrize("use_qk_l2norm", [False, True])
@pytest.mark.parametrize("scale", [None, 0.3])
def test_prepare_qk_norms_both_then_scales_q(use_qk_l2norm, scale, rng):
    q, k = (rng.normal(size=(2, 3, 16)).astype(np.float64) for _ in range(2))
    norm = lambda x: x / np.sqrt(np.sum(x**2, -1, keepdims=True) + 1e-6)
    want_q, want_k = (norm(q), norm(k)) if use_qk_l2norm else (q, k)
    want_q = want_q * (16**-0.5 if scale is None else scale)
    got_q, got_k = prepare_qk(
        jnp.asarray(q, jnp.float32), jnp.asarray(k, jnp.float32), use_qk_l2norm=use_qk_l2norm,
        scale=scale,
    )
    np.testing.assert_allclose(got_q, want_q, rtol=RTOL)
    np.testing.assert_allclose(got_k, want_k, rtol=RTOL)
