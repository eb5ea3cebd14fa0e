"""`pallas_kernels.verify_coefficients` (the GDN verify window's records and staged vectors in
one Pallas Triton launch) against a float64 NumPy model of the record and against XLA's
`window_coefficients` / `window_vectors`, which the Mosaic verify kernel takes otherwise.

Interpret mode on CPU: ragged lengths (0 and T included), chain and tree windows, NaN in
every input past a row's length, group sizes 1 and 2, with and without the q/k L2 norm;
one case compiled for sm_90a by the `triton` extra's compiler (no GPU needed).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.common import VerifyRows
from pallas_kernels.mosaic_gpu.verify_decode import (HISTORY_PAD, coefficient_count, history_weights,
                                                     record_key_scales, window_coefficients, window_rows,
                                                     window_vectors)
from pallas_kernels.mosaic_gpu.verify_decode_kda import kda_window_coefficients
from pallas_kernels.verify_coefficients import (KDA_VECTORS, VECTORS, VerifyCoefficientsParams,
                                                kda_verify_coefficients, verify_coefficients)
from replayssm_jax.speculative import ancestors

L2NORM_EPS = 1e-6  # the kernels' (pallas_kernels.common), restated: the model is written independently


def random_parents(rng, batch: int, width: int) -> jnp.ndarray:
    """`[B, T]` random tree parents (parent of i in [-1, i))."""
    return jnp.asarray([[rng.integers(-1, i) if i else -1 for i in range(width)] for _ in range(batch)], jnp.int32)


def model_record(q, k, g, beta, anc, length, *, use_qk_l2norm, scale, record_len):
    """The record of each `(b, h)` in float64: `[A, M, e^G, beta, g, q_scale, k_scale, 0...]`."""
    batch, width, num_k_heads, _ = q.shape
    group = g.shape[2] // num_k_heads
    out = np.zeros((batch, g.shape[2], record_len))
    for b in range(batch):
        n = int(length[b])
        for h in range(g.shape[2]):
            hk = h // group
            qs, ks = q[b, :n, hk].astype(np.float64), k[b, :n, hk].astype(np.float64)
            norm = lambda x: 1 / np.sqrt(np.sum(x * x, axis=-1) + L2NORM_EPS) if use_qk_l2norm else np.ones(len(x))
            q_scale, k_scale = scale * norm(qs), norm(ks)
            qn, kn = qs * q_scale[:, None], ks * k_scale[:, None]
            branch = anc[b, :n, :n] | np.eye(n, dtype=bool)
            G = np.array([np.sum(g[b, :n, h][branch[i]]) for i in range(n)])
            decay = np.where(branch, np.exp(np.where(branch, G[:, None] - G[None, :], 0.0)), 0.0)
            A, M = np.zeros((width, width)), np.zeros((width, width))
            A[:n, :n] = np.where(anc[b, :n, :n], beta[b, :n, h][:, None] * decay * (kn @ kn.T), 0.0)
            M[:n, :n] = decay * (qn @ kn.T)
            vectors = np.zeros((5, width))
            vectors[:, :n] = [np.exp(G), beta[b, :n, h], g[b, :n, h], q_scale, k_scale]
            flat = np.concatenate([A.ravel(), M.ravel(), vectors.ravel()])
            out[b, h, :flat.size] = flat
    return out


def random_window(rng, batch, width, num_k_heads, num_v_heads, head_dim, dtype):
    q, k = (jnp.asarray(rng.standard_normal((batch, width, num_k_heads, head_dim)), dtype) for _ in range(2))
    g = jnp.asarray(-np.log1p(np.exp(rng.standard_normal((batch, width, num_v_heads)))), jnp.float32)
    beta = jnp.asarray(1 / (1 + np.exp(-rng.standard_normal((batch, width, num_v_heads)))), jnp.float32)
    length = jnp.asarray(rng.integers(0, width + 1, batch).clip(max=width), jnp.int32).at[0].set(width)
    # Inputs past a row's length are garbage the kernel must drop: NaN everywhere there.
    past = np.arange(width)[None, :] >= np.asarray(length)[:, None]
    nan_past = lambda x: jnp.where(past.reshape(*past.shape, *[1] * (x.ndim - 2)), jnp.nan, x).astype(x.dtype)
    return (*(nan_past(x) for x in (q, k, g, beta)), length)


def random_rows(rng, batch, cache_len):
    """`(slots [B], cursors [N], slot [B], pos [B])` with N = B + 2: distinct slots, row 1
    padding (its slot out of range, negative or >= N, drawn), every slot's cursor in
    [0, L] with row 0's at L and row 3's at 0 (an empty history), and the rows' slot and
    cursor as the kernels read them (`common.verify_rows`, written out: 0 on the padding
    row)."""
    num_slots = batch + 2
    slot = rng.permutation(num_slots)[:batch].astype(np.int32)
    cursors = rng.integers(0, cache_len + 1, num_slots).astype(np.int32)
    cursors[slot[0]], cursors[slot[3]] = cache_len, 0
    slots = slot.copy()
    slots[1] = rng.choice([-1, num_slots])
    slot[1] = 0
    pos = np.where(np.arange(batch) == 1, 0, cursors[slot])
    return slots, cursors, slot, pos


def random_history(rng, slot, pos, num_slots, num_v_heads, cache_len):
    """`(g_cache [N, H_v, L] with NaN in every stale entry of the rows' slots (at and past
    their cursors: row 3's entry 0 included), the same in float64 without them)`."""
    g_cache = -rng.uniform(0.0, 2.0, (num_slots, num_v_heads, cache_len))
    stale = g_cache.copy()
    for b, (s, p) in enumerate(zip(slot, pos)):
        if b != 1:  # the padding row reads nothing
            stale[s, :, p:] = np.nan
    return jnp.asarray(stale, jnp.float32), g_cache


def model_history(g_cache, slot, pos, history_len):
    """Per (row, value head) in float64: the product of e^{g_i} over the entries after j and
    before pos for each j < pos, then over all of them, then zeros."""
    out = np.zeros((len(slot), g_cache.shape[1], history_len))
    for b, (s, p) in enumerate(zip(slot, pos)):
        decays = np.exp(g_cache[s])
        for j in range(p):
            out[b, :, j] = np.prod(decays[:, j + 1:p], axis=1)
        out[b, :, g_cache.shape[2]] = np.prod(decays[:, :p], axis=1)
    return out


def assert_rows(rows, slot, pos, requested) -> jax.Array:
    """The kernel's rows equal the model's (`random_rows`; the padding row 1 of length 0)
    and XLA's (`common.verify_rows`), exactly; returns their lengths."""
    length = jnp.asarray(requested).at[1].set(0)
    for name, got, want in zip(VerifyRows._fields, rows, (slot, pos, length)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=name)
        assert got.dtype == jnp.int32, name
    return length


def assert_key_scales(key_scales, k64, length, use_qk_l2norm: bool) -> None:
    """`key_scales [B, T, H_k]` against float64 norms of the raw keys `k64`: 1 / |k| (one
    without the norm) below each row's length, 0 past it. fp32: a sum of d_k squares and
    one rsqrt, a few ulps."""
    norms = 1 / np.sqrt(np.sum(k64 * k64, axis=-1) + L2NORM_EPS) if use_qk_l2norm else np.ones(k64.shape[:3])
    live = np.arange(k64.shape[1])[None, :, None] < np.asarray(length)[:, None, None]
    np.testing.assert_allclose(np.asarray(key_scales), np.where(live, norms, 0.0), rtol=2e-6)


@pytest.mark.parametrize("width,num_k_heads,num_v_heads,dtype,use_qk_l2norm,tree,cache_len", [
    (1, 1, 2, jnp.bfloat16, True, False, 8),
    (3, 2, 4, jnp.bfloat16, True, True, 24),   # R = 16 > 2T: masked lanes; L' = 32 > L
    (4, 1, 1, jnp.float32, False, True, 16),
    (9, 1, 2, jnp.bfloat16, True, False, 16),  # the vector stores pass the record's end (masked)
    (16, 1, 2, jnp.float32, True, True, 32),   # fp32 q, k: the products in two chunks of channels
])
def test_records_and_vectors_match_the_model_and_xla(rng, width, num_k_heads, num_v_heads, dtype, use_qk_l2norm,
                                                     tree, cache_len):
    batch, head_dim, scale = 4, 64, 0.7
    q, k, g, beta, requested = random_window(rng, batch, width, num_k_heads, num_v_heads, head_dim, dtype)
    anc = np.asarray(ancestors(random_parents(rng, batch, width) if tree else None, batch, width))
    record_len = coefficient_count(width)
    slots, cursors, slot, pos = random_rows(rng, batch, cache_len)
    g_cache, g_model = random_history(rng, slot, pos, len(cursors), num_v_heads, cache_len)
    history_len = cache_len + HISTORY_PAD
    records, vectors, key_scales, weights, rows = verify_coefficients(
        q, k, g, beta, jnp.asarray(anc), jnp.asarray(slots), jnp.asarray(cursors), requested, record_len=record_len,
        vector_rows=window_rows(width), use_qk_l2norm=use_qk_l2norm, scale=scale, history=g_cache,
        history_len=history_len, interpret=True)
    length = assert_rows(rows, slot, pos, requested)
    assert records.shape == (batch, num_v_heads, record_len) and vectors.shape[:3] == (batch, num_k_heads,
                                                                                       window_rows(width))
    assert not np.isnan(np.asarray(records)).any()
    f64 = lambda x: np.asarray(x.astype(jnp.float32), np.float64)
    want = model_record(f64(q), f64(k), f64(g), f64(beta), anc, np.asarray(length), use_qk_l2norm=use_qk_l2norm,
                        scale=scale, record_len=record_len)
    # fp32 sums over d_k = 64 products and one exp: a few ulps of each entry's scale.
    np.testing.assert_allclose(np.asarray(records), want, rtol=2e-5, atol=2e-6)
    xla = window_coefficients(q, k, g, beta, jnp.asarray(anc), length, use_qk_l2norm=use_qk_l2norm, scale=scale)
    np.testing.assert_allclose(np.asarray(records), np.asarray(xla).reshape(records.shape), rtol=2e-5, atol=2e-6)
    # The key scales are the records' k_scale runs (each key head's first value head), bit
    # for bit, in the key records' [B, T, H_k] order.
    np.testing.assert_array_equal(np.asarray(key_scales),
                                  np.asarray(record_key_scales(records, width, VECTORS, num_v_heads // num_k_heads)))
    assert_key_scales(key_scales, f64(k), length, use_qk_l2norm)
    # The staged vectors are the raw rows, bit for bit.
    np.testing.assert_array_equal(np.asarray(vectors.astype(jnp.float32)),
                                  np.asarray(window_vectors(q, k, length).astype(jnp.float32)))
    # History weights (a padding row's are never read) against float64 products and XLA's
    # form: an fp32 sum of at most L log-decays, then one exp2, errs by a few ulps of the
    # sum's magnitude |ln W|, which the exponential turns into that much relative error.
    real = np.arange(batch) != 1
    weights = np.asarray(weights)[real]
    assert weights.shape[1:] == (num_v_heads, history_len) and not np.isnan(weights).any()
    xla_weights = np.asarray(history_weights(g_cache, jnp.asarray(slot), jnp.asarray(pos)))[real]
    for want in model_history(g_model, slot, pos, history_len)[real], xla_weights:
        bound = 2.0 ** -21 * (1 + np.abs(np.log(np.where(want > 0, want, 1.0)))) * want
        assert np.all(np.abs(weights - want) <= bound), np.max(np.abs(weights - want) / np.maximum(bound, 1e-300))


def model_kda_record(q, k, g, beta, anc, length, *, use_qk_l2norm, scale, record_len):
    """A KDA window in float64: the record of each `(b, h)`, `[A, M, beta, q_scale, k_scale,
    0...]`, and `e^{G}` `[B, T, H_v, d_k]`."""
    batch, width, num_k_heads, head_dim = q.shape
    num_v_heads = g.shape[2]
    group = num_v_heads // num_k_heads
    out, decays = np.zeros((batch, num_v_heads, record_len)), np.zeros((batch, width, num_v_heads, head_dim))
    for b in range(batch):
        n = int(length[b])
        for h in range(num_v_heads):
            qs, ks = q[b, :n, h // group], k[b, :n, h // group]
            norm = lambda x: 1 / np.sqrt(np.sum(x * x, axis=-1) + L2NORM_EPS) if use_qk_l2norm else np.ones(len(x))
            q_scale, k_scale = scale * norm(qs), norm(ks)
            qn, kn = qs * q_scale[:, None], ks * k_scale[:, None]
            branch = anc[b, :n, :n] | np.eye(n, dtype=bool)
            G = branch.astype(np.float64) @ g[b, :n, h]  # [n, d_k]
            A, M = np.zeros((width, width)), np.zeros((width, width))
            for i in range(n):
                for j in range(n):
                    if branch[i, j]:
                        w = np.exp(G[i] - G[j])
                        M[i, j] = np.sum(qn[i] * w * kn[j])
                        A[i, j] = beta[b, i, h] * np.sum(kn[i] * w * kn[j]) if anc[b, i, j] else 0.0
            vectors = np.zeros((3, width))
            vectors[:, :n] = [beta[b, :n, h], q_scale, k_scale]
            flat = np.concatenate([A.ravel(), M.ravel(), vectors.ravel()])
            out[b, h, :flat.size] = flat
            decays[b, :n, h] = np.exp(G)
    return out, decays


@pytest.mark.parametrize("width,num_k_heads,num_v_heads,dtype,use_qk_l2norm,tree", [
    (1, 1, 2, jnp.bfloat16, True, False),
    (3, 2, 4, jnp.bfloat16, True, True),
    (4, 1, 1, jnp.float32, False, True),
])
def test_kda_records_and_decays_match_the_model_and_xla(rng, width, num_k_heads, num_v_heads, dtype,
                                                        use_qk_l2norm, tree):
    batch, head_dim, scale = 4, 64, 0.7
    q, k, _, beta, requested = random_window(rng, batch, width, num_k_heads, num_v_heads, head_dim, dtype)
    past = np.arange(width)[None, :] >= np.asarray(requested)[:, None]
    g = -np.log1p(np.exp(rng.standard_normal((batch, width, num_v_heads, head_dim))))
    g = jnp.asarray(np.where(past[:, :, None, None], np.nan, g), jnp.float32)
    anc = np.asarray(ancestors(random_parents(rng, batch, width) if tree else None, batch, width))
    record_len = coefficient_count(width, KDA_VECTORS)
    slots, cursors, slot, pos = random_rows(rng, batch, 8)
    records, key_scales, decays, rows = kda_verify_coefficients(
        q, k, g, beta, jnp.asarray(anc), jnp.asarray(slots), jnp.asarray(cursors), requested, record_len=record_len,
        use_qk_l2norm=use_qk_l2norm, scale=scale, interpret=True)
    length = assert_rows(rows, slot, pos, requested)
    assert records.shape == (batch, num_v_heads, record_len) and key_scales.shape == (batch, width, num_k_heads)
    assert decays.shape == (batch, width, num_v_heads, head_dim)
    assert not np.isnan(np.asarray(records)).any() and not np.isnan(np.asarray(decays)).any()
    f64 = lambda x: np.asarray(x.astype(jnp.float32), np.float64)
    want, want_decays = model_kda_record(f64(q), f64(k), f64(g), f64(beta), anc, np.asarray(length),
                                         use_qk_l2norm=use_qk_l2norm, scale=scale, record_len=record_len)
    # fp32 sums over d_k = 64 channel products, each with one exp: a few ulps of the scale.
    np.testing.assert_allclose(np.asarray(records), want, rtol=2e-5, atol=2e-6)
    np.testing.assert_allclose(np.asarray(decays), want_decays, rtol=2e-6, atol=1e-7)
    # The key scales are the records' k_scale runs, bit for bit, in the key records' order.
    group = num_v_heads // num_k_heads
    np.testing.assert_array_equal(np.asarray(key_scales),
                                  np.asarray(record_key_scales(records, width, KDA_VECTORS, group)))
    assert_key_scales(key_scales, f64(k), length, use_qk_l2norm)
    xla, xla_decays = kda_window_coefficients(q, k, g, beta, jnp.asarray(anc), length,
                                              use_qk_l2norm=use_qk_l2norm, scale=scale)
    np.testing.assert_allclose(np.asarray(records), np.asarray(xla).reshape(records.shape), rtol=2e-5, atol=2e-6)
    np.testing.assert_allclose(np.asarray(decays), np.asarray(xla_decays), rtol=2e-6, atol=1e-7)


def model_mamba2_record(B, C, dt, A, D, anc, length, record_len):
    """Float64 Mamba-2 record per (row, head) (`mamba2_verify_coefficients`' layout) from
    the gated time steps `dt [B, T, H]`, zeros at and past each row's length."""
    batch, width, groups = B.shape[:3]
    heads = dt.shape[2]
    out = np.zeros((batch, heads, record_len))
    for b in range(batch):
        n = int(length[b])
        for h in range(heads):
            g = h // (heads // groups)
            branch = [anc[b, i, :n] | (np.arange(n) == i) for i in range(n)]
            log_a = [A[h] * dt[b, :n, h][branch[i]].sum() for i in range(n)]
            for i in range(n):
                for j in range(n):
                    if branch[i][j]:
                        decay = np.exp(log_a[i] - log_a[j])
                        out[b, h, i * width + j] = decay * dt[b, j, h] * (C[b, i, g] @ B[b, j, g]) + D[h] * (i == j)
                out[b, h, width * width + i] = np.exp(log_a[i])
                out[b, h, width * width + width + i] = dt[b, i, h]
    return out


@pytest.mark.parametrize("width,groups,heads,dtype,tree,dt_softplus,dt_limit", [
    (1, 1, 2, jnp.bfloat16, False, True, (0.0, float("inf"))),
    (3, 2, 4, jnp.bfloat16, True, True, (0.0, float("inf"))),
    (4, 1, 3, jnp.float32, True, False, (0.05, 0.6)),  # fp32 B, C: the products in chunks of channels
    (9, 2, 2, jnp.float32, False, True, (0.1, 2.0)),   # R = 32 > 2T: masked lanes
])
def test_mamba2_records_match_the_model_and_xla(rng, width, groups, heads, dtype, tree, dt_softplus, dt_limit):
    """`mamba2_verify_coefficients` against a float64 model of the record and against
    XLA's `mamba2_window_coefficients` (given XLA's gated time steps), its time steps
    against `clip(softplus(dt + dt_bias))` in float64, and its rows against
    `common.verify_rows`; NaN in every input past a row's length and on the padding row."""
    from pallas_kernels.common import mamba2_time_step
    from pallas_kernels.mosaic_gpu.verify_decode_mamba2 import MAMBA2_MATRICES, mamba2_window_coefficients
    from pallas_kernels.verify_coefficients import MAMBA2_VECTORS, mamba2_verify_coefficients

    batch, state = 4, 64
    f = lambda *shape: rng.standard_normal(shape).astype(np.float32)
    slots, cursors, slot, pos = random_rows(rng, batch, 8)
    requested = rng.integers(0, width + 1, batch).astype(np.int32)
    requested[0] = width
    length = np.where(np.arange(batch) == 1, 0, requested)
    past = (np.arange(width)[None, :] >= length[:, None])[..., None]  # the padding row's inputs too
    B, C = (np.where(past[..., None], np.nan, f(batch, width, groups, state) * 0.3) for _ in range(2))
    dt = np.where(past, np.nan, np.abs(f(batch, width, heads)) if not dt_softplus else f(batch, width, heads))
    dt_bias, A, D = (x.astype(np.float32) for x in (rng.uniform(-3.0, 0.5, heads), -rng.uniform(0.5, 4.0, heads),
                                                   f(heads)))
    anc = np.asarray(ancestors(random_parents(rng, batch, width) if tree else None, batch, width))
    record_len = coefficient_count(width, MAMBA2_VECTORS, MAMBA2_MATRICES)
    to = lambda x, dt_=jnp.float32: jnp.asarray(x, dt_)
    records, gated, rows = mamba2_verify_coefficients(
        to(B, dtype), to(C, dtype), to(dt), to(dt_bias), to(A), to(D), jnp.asarray(anc), jnp.asarray(slots),
        jnp.asarray(cursors), jnp.asarray(requested), record_len=record_len, dt_softplus=dt_softplus,
        dt_limit=dt_limit, interpret=True)
    assert_rows(rows, slot, pos, requested)
    live = ~past[..., 0]
    want_dt = np.where(live[..., None], dt, 0.0).astype(np.float64) + dt_bias
    want_dt = np.clip(np.logaddexp(0.0, want_dt) if dt_softplus else want_dt, *dt_limit)
    # One softplus in fp32 (log1p of exp): a few ulps.
    np.testing.assert_allclose(np.asarray(gated), np.where(live[..., None], want_dt, 0.0), rtol=2e-6, atol=1e-7)
    f64 = lambda x: np.asarray(to(x, dtype).astype(jnp.float32), np.float64)
    want = model_mamba2_record(f64(B), f64(C), np.where(live[..., None], want_dt, 0.0), A.astype(np.float64),
                               D.astype(np.float64), anc, length, record_len)
    # fp32 sums over N = 64 products and one exp2 (6e-6 relative): a few ulps of each scale.
    np.testing.assert_allclose(np.asarray(records), want, rtol=2e-5, atol=2e-6)
    xla_dt = mamba2_time_step(to(dt) + to(dt_bias), dt_softplus, dt_limit)
    xla = mamba2_window_coefficients(to(B, dtype), to(C, dtype), xla_dt, to(A), to(D), jnp.asarray(anc),
                                     jnp.asarray(length))
    np.testing.assert_allclose(np.asarray(records), np.asarray(xla).reshape(records.shape), rtol=2e-5, atol=2e-6)


def test_refuses_what_it_cannot_take():
    q = jnp.zeros((1, 4, 1, 64), jnp.bfloat16)
    g = jnp.zeros((1, 4, 2), jnp.float32)
    anc, slots, cursors, length = (jnp.zeros((1, 4, 4), bool), jnp.zeros((1,), jnp.int32),
                                   jnp.zeros((2,), jnp.int32), jnp.array([4], jnp.int32))
    call = lambda q=q, g=g, record_len=64, vector_rows=8, slots=slots, **history: verify_coefficients(
        q, q, g, g, anc, slots, cursors, length, record_len=record_len, vector_rows=vector_rows, use_qk_l2norm=True,
        scale=1.0, interpret=True, **history)
    with pytest.raises(ValueError, match="record_len 40 is too short"):
        call(record_len=40)
    with pytest.raises(ValueError, match="vector_rows 6 is fewer than 2 T"):
        call(vector_rows=6)
    with pytest.raises(ValueError, match="d_k a power of two"):
        call(q=jnp.zeros((1, 4, 1, 192), jnp.bfloat16))
    with pytest.raises(ValueError, match="H_k \\| H_v"):
        call(q=jnp.zeros((1, 4, 2, 64), jnp.bfloat16), g=jnp.zeros((1, 4, 3), jnp.float32))
    with pytest.raises(ValueError, match="the rows must be slots \\[B\\], cursors \\[N\\] and lengths \\[B\\]"):
        call(slots=jnp.zeros((2,), jnp.int32))
    g_cache = jnp.zeros((2, 2, 8), jnp.float32)
    with pytest.raises(ValueError, match="history and history_len come together"):
        call(history_len=12)
    for bad in (g_cache[:, :1], g_cache[:1]):  # H_v heads, one slot per cursor
        with pytest.raises(ValueError, match="history must be g_cache \\[N, H_v, L\\]"):
            call(history=bad, history_len=12)
    with pytest.raises(ValueError, match="history_len 8 must exceed L = 8"):
        call(history=g_cache, history_len=8)
    with pytest.raises(ValueError, match="num_warps"):
        VerifyCoefficientsParams(num_warps=3)
    g_kda = jnp.zeros((1, 4, 2, 64), jnp.float32)
    kda = lambda g=g_kda, record_len=64: kda_verify_coefficients(
        q, q, g, g_kda[..., 0], anc, slots, cursors, length, record_len=record_len, use_qk_l2norm=True, scale=1.0,
        interpret=True)
    with pytest.raises(ValueError, match="record_len 40 is too short"):
        kda(record_len=40)
    with pytest.raises(ValueError, match="g must be \\[B, T, H_v, d_k\\]"):
        kda(g=jnp.zeros((1, 4, 2, 32), jnp.float32))


sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import kernel_registers  # noqa: E402


@pytest.mark.parametrize("num_warps", [1, 2])
def test_compiles_for_sm90a_without_spills(num_warps):
    """The benchmark's shapes (H_k = 16, H_v = 32, d_k = 128, T = 4, bf16, history weights
    at L = 32), lowered for an H200 and compiled by the `triton` extra's compiler and ptxas;
    one warp keeps every reduction inside the warp (fewer barriers than two)."""
    pytest.importorskip("triton")
    sds = jax.ShapeDtypeStruct
    batch, width, cache_len = 8, 4, 32
    args = (sds((batch, width, 16, 128), jnp.bfloat16), sds((batch, width, 16, 128), jnp.bfloat16),
            sds((batch, width, 32), jnp.float32), sds((batch, width, 32), jnp.float32),
            sds((batch, width, width), jnp.bool_), sds((batch,), jnp.int32), sds((16,), jnp.int32),
            sds((batch,), jnp.int32), sds((16, 32, cache_len), jnp.float32))
    params = VerifyCoefficientsParams(num_warps=num_warps)
    step = lambda *a: verify_coefficients(*a[:8], record_len=coefficient_count(width), vector_rows=window_rows(width),
                                          use_qk_l2norm=True, scale=128 ** -0.5, history=a[8],
                                          history_len=cache_len + HISTORY_PAD, params=params, interpret=False)
    with kernel_registers.captured_triton_ir() as modules, jax.sharding.use_abstract_mesh(kernel_registers._H200):
        jax.jit(step).trace(*args).lower(lowering_platforms=("cuda",))
    (module,) = modules
    report = kernel_registers.ptxas_report(module, params)
    assert report["spill_store_bytes"] == 0 and report["registers"] <= 128, report
    assert report["barriers"] <= (16 if num_warps == 1 else 80), report


def test_mosaic_verify_with_the_kernel_window_lowers_for_an_abstract_h200():
    """The GDN verify step with `window_side="kernel"` at the benchmark shapes (fp32 state,
    L = 16, T = 4, persistent CTAs, key sums before the launch): the window kernel's Triton
    call and the Mosaic verify kernel in one lowered step, XLA's Gram product gone."""
    from pallas_kernels.mosaic_gpu.replay_decode import MosaicReplayParams
    from pallas_kernels.mosaic_gpu.verify_decode import verify_decode_mgpu

    S, i32 = jax.ShapeDtypeStruct, jnp.int32
    n, b, hk, hv, d, cache_len, width = 16, 8, 16, 32, 128, 16, 4
    args = [S((n, hv, d, d), jnp.float32), S((n, hv, cache_len, d), jnp.float32),
            S((n, hk, cache_len, d), jnp.float32), S((n, hv, cache_len), jnp.float32),
            S((b, width, hk, d), jnp.bfloat16), S((b, width, hk, d), jnp.bfloat16), S((b, width, hv, d), jnp.bfloat16),
            S((b, width, hv), jnp.float32), S((b, width, hv), jnp.float32),
            S((b,), i32), S((n,), i32), S((b,), i32), S((b, width, width), jnp.bool_)]
    params = MosaicReplayParams(programs=264, auto_barriers=False, readout="mma", key_side="xla",
                                window_side="kernel")
    step = lambda *a: verify_decode_mgpu(*a, use_qk_l2norm=True, params=params, interpret=False)
    with jax.sharding.use_abstract_mesh(kernel_registers._H200):
        text = jax.jit(step, donate_argnums=(0, 1, 2, 3, 10)).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    calls = re.findall(r"custom_call @([\w$.]+)", text)
    # The window kernel, then the key sums' and the verify kernel's Mosaic calls.
    assert calls == ["__gpu$xla.gpu.triton", "mosaic_gpu_v2", "mosaic_gpu_v2"], calls
    # XLA's product (the window kernel's own dots name `dot_general` in its Triton module's
    # debug locations, inside the custom call's text).
    assert "stablehlo.dot_general" not in text


def lower_with_window_kernel(step, args, *, cursors: int) -> str:
    """`step` (a verify wrapper on its window kernel) jitted with the state arrays and the
    cursors (argument `cursors`) donated, lowered for an abstract H200: asserts the window
    kernel's Triton call then the Mosaic verify kernel, and the window kernel compiled for
    sm_90a without spills; returns the module text."""
    with kernel_registers.captured_triton_ir() as modules, jax.sharding.use_abstract_mesh(kernel_registers._H200):
        lowered = jax.jit(step, donate_argnums=(0, 1, 2, 3, cursors)).trace(*args).lower(lowering_platforms=("cuda",))
    text = lowered.as_text()
    assert re.findall(r"custom_call @([\w$.]+)", text) == ["__gpu$xla.gpu.triton", "mosaic_gpu_v2"]
    (module,) = modules
    report = kernel_registers.ptxas_report(module, VerifyCoefficientsParams())
    assert report["spill_store_bytes"] == 0 and report["registers"] <= 128, report
    return text


def test_kda_window_kernel_compiles_and_its_verify_step_lowers_for_an_abstract_h200():
    """The KDA verify step with `window_side="kernel"` at the benchmark shapes (H_k = H_v =
    32, d = 128, fp32 state, L = 16, T = 4): the window kernel compiles for sm_90a without
    spills, and the step lowers to its Triton call and the Mosaic verify kernel, with no
    reduction left in XLA (the channel sums it replaces)."""
    pytest.importorskip("triton")
    from pallas_kernels.mosaic_gpu.replay_decode import MosaicReplayParams
    from pallas_kernels.mosaic_gpu.verify_decode_kda import verify_decode_kda_mgpu

    S, i32 = jax.ShapeDtypeStruct, jnp.int32
    n, b, hk, hv, d, cache_len, width = 16, 8, 32, 32, 128, 16, 4
    args = [S((n, hv, d, d), jnp.float32), S((n, hv, cache_len, d), jnp.float32),
            S((n, hk, cache_len, d), jnp.float32), S((n, hv, cache_len, d), jnp.float32),
            S((b, width, hk, d), jnp.bfloat16), S((b, width, hk, d), jnp.bfloat16), S((b, width, hv, d), jnp.bfloat16),
            S((b, width, hv, d), jnp.float32), S((b, width, hv), jnp.float32),
            S((b,), i32), S((n,), i32), S((b,), i32), S((b, width, width), jnp.bool_)]
    params = MosaicReplayParams(window_side="kernel")
    text = lower_with_window_kernel(
        lambda *a: verify_decode_kda_mgpu(*a, use_qk_l2norm=True, params=params, interpret=False), args, cursors=10)
    assert "stablehlo.reduce" not in text and "dot_general" not in text


def test_mamba2_window_kernel_compiles_and_its_verify_step_lowers_for_an_abstract_h200():
    """The Mamba-2 verify step with `window_side="kernel"` at Nemotron-H-8B shapes (H = 128,
    P = 64, N = 128, G = 8, fp32 state, L = 16, T = 4, bf16 B and C): the window kernel
    compiles for sm_90a without spills, and the step lowers to its Triton call and the
    Mosaic verify kernel, with no product or softplus left in XLA."""
    pytest.importorskip("triton")
    from pallas_kernels.mosaic_gpu.mamba2_decode import MosaicMamba2Params
    from pallas_kernels.mosaic_gpu.verify_decode_mamba2 import mamba2_verify_decode_mgpu

    S, i32, f32, bf16 = jax.ShapeDtypeStruct, jnp.int32, jnp.float32, jnp.bfloat16
    n, b, heads, p, state, groups, cache_len, width = 16, 8, 128, 64, 128, 8, 16, 4
    args = [S((n, heads, p, state), f32), S((n, heads, cache_len, p), f32), S((n, groups, cache_len, state), f32),
            S((n, heads, cache_len), f32), S((b, width, heads, p), bf16), S((b, width, groups, state), bf16),
            S((b, width, groups, state), bf16), S((b, width, heads), f32), S((heads,), f32), S((heads,), f32),
            S((heads,), f32), S((b,), i32), S((n,), i32), S((b,), i32), S((b, width, width), jnp.bool_)]
    params = MosaicMamba2Params(window_side="kernel")
    text = lower_with_window_kernel(lambda *a: mamba2_verify_decode_mgpu(*a, params=params, interpret=False), args,
                                    cursors=12)
    assert "stablehlo.dot_general" not in text and "stablehlo.log_plus_one" not in text


@pytest.mark.parametrize("gate", ["gdn", "kda", "mamba2"])
def test_a_mosaic_verify_step_forms_its_rows_in_the_window_kernel(gate):
    """`verify_step(backend="mosaic_gpu")` at the benchmark's shapes, lowered for an abstract
    H200 with its defaults (the window kernels): no gather outside the kernels, i.e. XLA no
    longer reads the pool's cursors by slot to form the rows (a launch of its own at small
    batches); the window kernel does. Only the records' scatters stay in XLA."""
    from replayssm_jax import Mamba2Params, Mamba2Tokens, ReplayConfig, Tokens, init_state, verify_step

    S, bf16, f32 = jax.ShapeDtypeStruct, jnp.bfloat16, jnp.float32
    batch, width = 8, 4
    if gate == "mamba2":
        cfg = ReplayConfig.mamba2(128, 64, 128, 8, 16)
        window = Mamba2Tokens(S((batch, width, 128, 64), bf16), S((batch, width, 8, 128), bf16),
                              S((batch, width, 8, 128), bf16), S((batch, width, 128), f32))
        gate_params = Mamba2Params(*(S((128,), f32),) * 3)
        step = lambda st, w, slots, params: verify_step(st, w, slots, backend="mosaic_gpu", gate_params=params,
                                                        interpret=False)
    else:
        cfg = ReplayConfig(16, 32, 128, 128, 16, gate=gate)
        g = S((batch, width, 32, 128) if gate == "kda" else (batch, width, 32), f32)
        window = Tokens(S((batch, width, 16, 128), bf16), S((batch, width, 16, 128), bf16),
                        S((batch, width, 32, 128), bf16), g, S((batch, width, 32), f32))
        gate_params = None
        step = lambda st, w, slots, _: verify_step(st, w, slots, backend="mosaic_gpu", use_qk_l2norm=True,
                                                   interpret=False)
    state = jax.eval_shape(lambda: init_state(cfg, 16))
    with jax.sharding.use_abstract_mesh(kernel_registers._H200):
        text = jax.jit(step, donate_argnums=0).trace(state, window, S((batch,), jnp.int32), gate_params).lower(
            lowering_platforms=("cuda",)).as_text()
    calls = re.findall(r"custom_call @([\w$.]+)", text)
    assert calls[0] == "__gpu$xla.gpu.triton" and calls[-1] == "mosaic_gpu_v2", calls
    assert "stablehlo.gather" not in text and "stablehlo.scatter" in text
