"""FLA-compatible entry points and the chunked prefill, against recurrences written here."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import replayssm_jax as R
from replayssm_jax import fla
from replayssm_jax.chunked import chunked_gated_delta_rule

# fp32: the chunked form sums the same terms in another order (and solves a triangular
# system), ~1e-7 relative on these sizes; 1e-5 is the package's fp32 bound.
FP32_BOUND = 1e-5


def _err(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


def _fla_inputs(rng, batch, steps, hk=2, hv=4, dk=16, dv=8, per_channel=False):
    g_shape = (batch, steps, hv, dk) if per_channel else (batch, steps, hv)
    return dict(
        q=rng.normal(size=(batch, steps, hk, dk)).astype(np.float32),
        k=rng.normal(size=(batch, steps, hk, dk)).astype(np.float32),
        v=rng.normal(size=(batch, steps, hv, dv)).astype(np.float32),
        g=(-np.logaddexp(0, rng.normal(-1.5, 1, g_shape))).astype(np.float32),
        beta=rng.uniform(0.05, 0.95, (batch, steps, hv)).astype(np.float32),
    )


def _fla_convention(x, h0, scale, l2norm=True):
    """FLA's recurrence in its own layout, float64 numpy: h `[K, V]` per head,
    h = h * exp(g); v' = beta (v - h^T k); h = h + k v'^T; o = h^T q (q scaled; q, k
    L2-normalised first when `l2norm`)."""
    q, k, v, g, beta = (np.asarray(x[n], np.float64) for n in ("q", "k", "v", "g", "beta"))
    norm = (lambda a: a / np.sqrt((a * a).sum(-1, keepdims=True) + 1e-6)) if l2norm else (lambda a: a)
    q, k = norm(q) * scale, norm(k)
    r = v.shape[2] // q.shape[2]
    q, k = np.repeat(q, r, axis=2), np.repeat(k, r, axis=2)
    h = np.array(h0, np.float64)
    out = np.zeros(v.shape)
    for t in range(v.shape[1]):
        decay = np.exp(g[:, t])
        h = h * (decay[..., None] if g.ndim == 4 else decay[..., None, None])
        corrected = beta[:, t, :, None] * (v[:, t] - np.einsum("bhkv,bhk->bhv", h, k[:, t]))
        h = h + np.einsum("bhk,bhv->bhkv", k[:, t], corrected)
        out[:, t] = np.einsum("bhkv,bhk->bhv", h, q[:, t])
    return out, h


@pytest.mark.parametrize("fn,per_channel", [(fla.fused_recurrent_gated_delta_rule, False),
                                            (fla.fused_recurrent_kda, True),
                                            (fla.chunk_gated_delta_rule, False)])
def test_fla_functions_follow_flas_convention_and_layout(fn, per_channel, rng):
    x = _fla_inputs(rng, 2, 37, per_channel=per_channel)
    h0 = (0.3 * rng.normal(size=(2, 4, 16, 8))).astype(np.float32)  # FLA layout [N, H, K, V]
    o, final = fn(**x, initial_state=jnp.asarray(h0), output_final_state=True, use_qk_l2norm_in_kernel=True)
    want_o, want_h = _fla_convention(x, h0, 16 ** -0.5)
    assert _err(o, want_o) < FP32_BOUND and _err(final, want_h) < FP32_BOUND
    assert fn(**x)[1] is None  # no final state unless asked


@pytest.mark.parametrize("fn", [fla.fused_recurrent_gated_delta_rule, fla.chunk_gated_delta_rule])
def test_cu_seqlens_runs_each_packed_sequence_alone(fn, rng):
    lengths = [5, 1, 12]
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    x = _fla_inputs(rng, 1, int(offsets[-1]))
    x["k"] = x["k"] / np.linalg.norm(x["k"], axis=-1, keepdims=True)  # unnormalised keys: keep the state bounded
    h0 = (0.3 * rng.normal(size=(3, 4, 16, 8))).astype(np.float32)
    o, final = fn(**x, initial_state=jnp.asarray(h0), output_final_state=True, cu_seqlens=offsets)
    assert o.shape == x["v"].shape and final.shape == h0.shape
    for i, (start, stop) in enumerate(zip(offsets[:-1], offsets[1:])):
        alone = {n: a[:, start:stop] for n, a in x.items()}
        want_o, want_h = _fla_convention(alone, h0[i:i + 1], 16 ** -0.5, l2norm=False)
        assert _err(o[:, start:stop], want_o) < FP32_BOUND, i
        assert _err(final[i:i + 1], want_h) < FP32_BOUND, i


def test_state_layout_conversions_are_inverse_transposes(rng):
    s = rng.normal(size=(3, 4, 8, 16)).astype(np.float32)  # package layout [N, H_v, d_v, d_k]
    f = fla.to_fla_state(s)
    assert f.shape == (3, 4, 16, 8) and np.array_equal(f[1, 2], s[1, 2].T)
    assert np.array_equal(fla.from_fla_state(f), s)


@pytest.mark.parametrize("chunk_size", [1, 7, 64])
def test_chunked_prefill_matches_the_token_scan(chunk_size, rng):
    x = _fla_inputs(rng, 3, 70)
    tokens = R.Tokens(**{n: jnp.asarray(a) for n, a in x.items()})
    s0 = jnp.asarray(0.3 * rng.normal(size=(3, 4, 8, 16)), jnp.float32)
    lengths = jnp.asarray([70, 33, 1])
    y, final = chunked_gated_delta_rule(tokens, s0, lengths=lengths, chunk_size=chunk_size, use_qk_l2norm=True)
    for b, n in enumerate([70, 33, 1]):
        alone = jax.tree.map(lambda a: a[b:b + 1, :n], tokens)
        want_y, want_s = R.recurrent_reference(alone, s0[b:b + 1], use_qk_l2norm=True)
        assert _err(y[b:b + 1, :n], want_y) < FP32_BOUND and _err(final[b:b + 1], want_s) < FP32_BOUND


def test_chunked_prefill_rejects_per_channel_decays_and_bad_chunks(rng):
    x = _fla_inputs(rng, 1, 4, per_channel=True)
    tokens = R.Tokens(**{n: jnp.asarray(a) for n, a in x.items()})
    with pytest.raises(ValueError, match="per-head decay"):
        chunked_gated_delta_rule(tokens, jnp.zeros((1, 4, 8, 16)))
    gdn = R.Tokens(**{n: jnp.asarray(a) for n, a in _fla_inputs(rng, 1, 4).items()})
    for bad in (0, True):
        with pytest.raises(ValueError, match=f"chunk_size must be a positive integer, got {bad}"):
            chunked_gated_delta_rule(gdn, jnp.zeros((1, 4, 8, 16)), chunk_size=bad)
    with pytest.raises(ValueError, match="cu_seqlens"):
        fla.chunk_gated_delta_rule(**_fla_inputs(rng, 2, 4), cu_seqlens=np.array([0, 4]))
    with pytest.raises(ValueError, match="initial_state must be"):
        fla.fused_recurrent_gated_delta_rule(**_fla_inputs(rng, 1, 4), initial_state=jnp.zeros((1, 4, 8, 16)))


@pytest.mark.parametrize("per_channel, name, bad, match", [
    (False, "q", lambda a: a[0], r"q must be \[B, T, H, K\], got shape \(4, 2, 16\)"),
    (False, "q", lambda a: a.astype(np.int32), r"q must be a floating array, got dtype int32"),
    (False, "k", lambda a: a[..., :8], r"k must have shape \(1, 4, 2, 16\), got \(1, 4, 2, 8\)"),
    (False, "v", lambda a: a[:, :3], r"v must be \[B, T, H_v, V\] with B, T = 1, 4, got shape \(1, 3, 4, 8\)"),
    (False, "g", lambda a: a[..., None].repeat(16, -1), r"g must be .*\(1, 4, 4\) \(one decay per head\).*\(1, 4, 4, 16\)"),
    (True, "g", lambda a: a[..., 0], r"g must be .*\(1, 4, 4, 16\) \(one decay per key channel\).*\(1, 4, 4\)"),
    (False, "beta", lambda a: a[..., :1], r"beta must have shape \(1, 4, 4\), got \(1, 4, 1\)"),
])
def test_fla_entry_points_name_the_bad_input(rng, per_channel, name, bad, match):
    x = _fla_inputs(rng, 1, 4, per_channel=per_channel)
    x[name] = bad(x[name])
    fns = [fla.fused_recurrent_kda] if per_channel else [fla.fused_recurrent_gated_delta_rule,
                                                         fla.chunk_gated_delta_rule]
    for fn in fns:
        with pytest.raises(ValueError, match=match):
            fn(**x)
