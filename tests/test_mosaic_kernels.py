"""The Mosaic GPU decode kernel against a float64 NumPy model of one step.

Runs in Mosaic GPU interpret mode on CPU (tiny batch, the kernel's smallest tile shapes),
with padding, append and flush rows in one call, slots != rows, and NaN / Inf planted in
every stale cache entry and in a padding row's inputs. A second test lowers the kernel for
an abstract H200 at the benchmark shapes (layout inference and shared-memory transforms
run there), so a layout the hardware cannot take fails CI without a GPU.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import common
from pallas_kernels.mosaic_gpu.replay_decode import MosaicReplayParams, check_shapes, replay_decode_mgpu

NUM_SLOTS, H_K, H_V, D, L = 6, 1, 2, 64, 8
SLOTS = np.array([4, 0, 2, 5, 1], np.int32)
MODES = np.array([common.MODE_APPEND, common.MODE_PAD, common.MODE_FLUSH, common.MODE_APPEND, common.MODE_FLUSH],
                 np.int32)
POS = np.array([5, 3, 7, 0, 0], np.int32)
EPS = 1e-6


def _softplus(x):
    return np.where(x > 20.0, x, np.log1p(np.exp(np.minimum(x, 20.0))))


def _model_step(ckpt, u_c, k_c, g_c, q, k, v, g, beta, a_log, dt_bias, *, l2norm, raw):
    """Float64 step: `(y, checkpoint, u_cache, k_cache, g_cache)` after the step."""
    ckpt, u_c, k_c, g_c = (np.array(x, np.float64) for x in (ckpt, u_c, k_c, g_c))
    y = np.zeros(v.shape)
    for b, (slot, pos, mode) in enumerate(zip(SLOTS, POS, MODES)):
        if mode == common.MODE_PAD:
            continue
        for h in range(H_V):
            qh, kh = q[b, h // (H_V // H_K)].astype(np.float64), k[b, h // (H_V // H_K)].astype(np.float64)
            if l2norm:
                qh, kh = qh / np.sqrt(qh @ qh + EPS), kh / np.sqrt(kh @ kh + EPS)
            qh = qh * D ** -0.5
            gh, bh = float(g[b, h]), float(beta[b, h])
            if raw:
                gh = -np.exp(a_log[h]) * _softplus(gh + dt_bias[h])
                bh = 1.0 / (1.0 + np.exp(-bh))
            hk = h // (H_V // H_K)
            live = ckpt[slot, h] * np.exp(g_c[slot, h, :pos].sum())
            for j in range(pos):
                w = np.exp(g_c[slot, h, j + 1:pos].sum())
                live = live + w * np.outer(u_c[slot, h, j], k_c[slot, hk, j])
            alpha = np.exp(gh)
            u = bh * (v[b, h] - alpha * live @ kh)
            y[b, h] = alpha * live @ qh + u * (kh @ qh)
            if mode == common.MODE_FLUSH:
                ckpt[slot, h] = alpha * live + np.outer(u, kh)
            else:
                u_c[slot, h, pos] = u
                g_c[slot, h, pos] = gh
                k_c[slot, hk, pos] = kh
    return y, ckpt, u_c, k_c, g_c


def _inputs(rng, state_dtype, cache_dtype):
    f = lambda *s: rng.standard_normal(s).astype(np.float32)
    ckpt = f(NUM_SLOTS, H_V, D, D)
    u_c, k_c = f(NUM_SLOTS, H_V, L, D), f(NUM_SLOTS, H_K, L, D) * 0.2
    g_c = -np.abs(f(NUM_SLOTS, H_V, L)) * 0.2
    # Stale entries (at and past each row's cursor) hold NaN / Inf: they must never be read.
    for slot, pos in zip(SLOTS, POS):
        u_c[slot, :, pos:], k_c[slot, :, pos:], g_c[slot, :, pos:] = np.nan, np.inf, np.nan
    ckpt, u_c, k_c = (np.asarray(jnp.asarray(x).astype(dt).astype(jnp.float32))
                      for x, dt in ((ckpt, state_dtype), (u_c, cache_dtype), (k_c, cache_dtype)))
    batch = len(SLOTS)
    q, k, v = f(batch, H_K, D), f(batch, H_K, D), f(batch, H_V, D)
    g, beta = -np.abs(f(batch, H_V)) * 0.3, rng.random((batch, H_V)).astype(np.float32)
    pad = MODES == common.MODE_PAD
    q[pad], v[pad], g[pad] = np.nan, np.inf, np.nan  # a padding row's inputs reach nothing
    return ckpt, u_c, k_c, g_c, q, k, v, g, beta


@pytest.mark.parametrize("state_dtype,cache_dtype", [(jnp.float32, jnp.float32), (jnp.bfloat16, jnp.bfloat16)])
@pytest.mark.parametrize("l2norm,raw", [(True, False), (False, True)])
def test_step_matches_the_float64_model(rng, state_dtype, cache_dtype, l2norm, raw):
    ckpt, u_c, k_c, g_c, q, k, v, g, beta = _inputs(rng, state_dtype, cache_dtype)
    a_log, dt_bias = rng.standard_normal(H_V).astype(np.float32) * 0.3, rng.standard_normal(H_V).astype(np.float32)
    if raw:
        g = rng.standard_normal(g.shape).astype(np.float32)
        g[MODES == common.MODE_PAD] = np.nan
    out = replay_decode_mgpu(
        jnp.asarray(ckpt, state_dtype), jnp.asarray(u_c, cache_dtype), jnp.asarray(k_c, cache_dtype),
        jnp.asarray(g_c), jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray(g), jnp.asarray(beta),
        jnp.asarray(SLOTS), jnp.asarray(POS), jnp.asarray(MODES), use_qk_l2norm=l2norm,
        gate_params=(jnp.asarray(a_log), jnp.asarray(dt_bias)) if raw else None, interpret=True)
    want = _model_step(ckpt, u_c, k_c, g_c, q, k, v, g, beta, a_log, dt_bias, l2norm=l2norm, raw=raw)
    # fp32: the model's float64 sums vs fp32 FMAs in another order, relative ~1e-6 of the
    # largest entry. bf16 state/caches: the inputs are the rounded values in both, and the
    # stores round the new entries (unit roundoff 2^-9 of each value).
    tol = 2e-5 if state_dtype == jnp.float32 else 1e-2
    names = ("y", "checkpoint", "u_cache", "k_cache", "g_cache")
    for name, got, ref in zip(names, out, want):
        got = np.asarray(jnp.asarray(got).astype(jnp.float32), np.float64)
        stale = ~np.isfinite(ref)
        np.testing.assert_array_equal(np.isnan(got), np.isnan(ref), err_msg=f"{name}: NaN moved")
        scale = np.max(np.abs(np.where(stale, 0.0, ref))) + 1e-30
        np.testing.assert_allclose(np.where(stale, 0.0, got) / scale, np.where(stale, 0.0, ref) / scale,
                                   atol=tol, err_msg=name)
    assert not np.any(np.asarray(out[0])[MODES == common.MODE_PAD]), "padding rows must output zeros"


@pytest.mark.parametrize("state_dtype,cache_dtype,cache_len,raw", [
    (jnp.float32, jnp.float32, 16, False), (jnp.bfloat16, jnp.bfloat16, 16, True),
    (jnp.float32, jnp.bfloat16, 32, True), (jnp.float32, jnp.float32, 8, False), (jnp.float32, jnp.float32, 64, False),
])
def test_lowers_for_an_abstract_h200(state_dtype, cache_dtype, cache_len, raw):
    """GDN H_k = 16, H_v = 32, d = 128 (the benchmark shapes), lowered for CUDA on CPU."""
    S = jax.ShapeDtypeStruct
    n, b, hk, hv, d = 16, 8, 16, 32, 128
    args = [S((n, hv, d, d), state_dtype), S((n, hv, cache_len, d), cache_dtype),
            S((n, hk, cache_len, d), cache_dtype), S((n, hv, cache_len), jnp.float32),
            S((b, hk, d), jnp.bfloat16), S((b, hk, d), jnp.bfloat16), S((b, hv, d), jnp.bfloat16),
            S((b, hv), jnp.float32), S((b, hv), jnp.float32), S((b,), jnp.int32), S((b,), jnp.int32), S((b,), jnp.int32)]
    gate_params = (jnp.zeros((hv,)), jnp.zeros((hv,))) if raw else None
    step = lambda *a: replay_decode_mgpu(*a, use_qk_l2norm=True, gate_params=gate_params, interpret=False)
    text = jax.jit(step, donate_argnums=(0, 1, 2, 3)).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text


@pytest.mark.parametrize("dims,match", [
    ((64, 96, 16, 4), "d_v a multiple of 64"), ((96, 64, 16, 4), "d_k a multiple of 64"),
    ((64, 64, 12, 4), "cache_len a multiple of 8"), ((64, 64, 512, 4), "cache_len a multiple of 8"),
])
def test_shape_checks_name_the_bad_size(dims, match):
    with pytest.raises(ValueError, match=match):
        check_shapes(*dims)
    with pytest.raises(ValueError, match="swizzle"):
        MosaicReplayParams(swizzle=48)


@pytest.mark.parametrize("state_dtype", [jnp.float32, jnp.bfloat16])
def test_backend_steps_match_xla(rng, state_dtype):
    """`decode_step(backend="mosaic_gpu")` against the xla backend over a schedule that
    crosses natural flushes, with a forced flush and a padding row, on its own state."""
    from replayssm_jax import ReplayConfig, Tokens, decode_step, init_state, materialize_state

    cfg = ReplayConfig(1, 2, 64, 64, 8, state_dtype=state_dtype, cache_dtype=state_dtype)
    start = jnp.asarray(rng.standard_normal((4, 2, 64, 64)) * 0.1, state_dtype)
    states = {b: init_state(cfg, 4, checkpoint=start) for b in ("xla", "mosaic_gpu")}
    slots = jnp.asarray([2, -1, 0], jnp.int32)
    for step in range(cfg.cache_len + 3):
        f = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)
        tokens = Tokens(f(3, 1, 64), f(3, 1, 64), f(3, 2, 64), -jnp.abs(f(3, 2)) * 0.2, jax.nn.sigmoid(f(3, 2)))
        force = jnp.asarray([False, False, step == 3])
        ys = {}
        for b in states:
            ys[b], states[b] = decode_step(states[b], tokens, slots, force, backend=b, policy="natural",
                                           use_qk_l2norm=True)
        # fp32: two summation orders (~1e-7 relative). bf16: the stores round to bf16 on
        # both backends, and an entry that rounds differently differs by one bf16 ulp.
        tol = 1e-5 if state_dtype == jnp.float32 else 2e-2
        np.testing.assert_allclose(np.asarray(ys["mosaic_gpu"], np.float32), np.asarray(ys["xla"], np.float32),
                                   atol=tol, rtol=tol, err_msg=f"y at step {step}")
        np.testing.assert_array_equal(np.asarray(states["mosaic_gpu"].write_pos), np.asarray(states["xla"].write_pos))
    live = {b: materialize_state(s, jnp.arange(4, dtype=jnp.int32)) for b, s in states.items()}
    np.testing.assert_allclose(np.asarray(live["mosaic_gpu"]), np.asarray(live["xla"]), atol=tol, rtol=tol)


def test_backend_refuses_other_gates_and_shapes():
    from replayssm_jax import ReplayConfig
    from replayssm_jax.backends import mosaic_gpu

    with pytest.raises(ValueError, match=r"supports gates \('gdn', 'mamba2'\), got 'kda'"):
        mosaic_gpu.check_config(ReplayConfig(1, 2, 64, 64, 8, gate="kda"))
    with pytest.raises(ValueError, match="cache_len a multiple of 8"):
        mosaic_gpu.check_config(ReplayConfig(1, 2, 64, 64, 4))
    mosaic_gpu.check_config(ReplayConfig.mamba2(2, 64, 128, 1, 16))
    with pytest.raises(ValueError, match="head dim P a multiple of 64"):  # P and N are not swapped
        mosaic_gpu.check_config(ReplayConfig.mamba2(2, 32, 128, 1, 16))
