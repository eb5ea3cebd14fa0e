"""Long decodes: 10^4 replay steps against a float64 scan of the plain recurrence.

Slow decay (alpha ~ 1 - 7e-4, a memory of ~1000 steps) gives rounding the longest chance to
accumulate. The decay also forgets old rounding errors, so the error settles at a level set by
the memory, not by the number of steps; the bounds are on the live state's normwise relative
error over the last 5000 steps (median, and 4x that for the worst step):
fp32: measured ~2e-7 (a few fp32 ulps); bound 2e-6.
bf16 state and caches: a checkpoint write rounds at 2^-9 ~ 2e-3 once per window of L steps
  and every cache entry is rounded; measured 4e-3 (L = 16) to 6e-3 (L = 4); bound 2e-2.
Notebook 03 plots the same quantities per L.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import replayssm_jax as R

STEPS = 10_000
BOUNDS = {"float32": 2e-6, "bfloat16": 2e-2}


def _inputs(rng, steps: int) -> R.Tokens:
    a = rng.normal(size=(1, steps, 2)).astype(np.float32)
    return R.Tokens(
        q=jnp.asarray(rng.normal(size=(1, steps, 1, 32)), jnp.float32),
        k=jnp.asarray(rng.normal(size=(1, steps, 1, 32)), jnp.float32),
        v=jnp.asarray(rng.normal(size=(1, steps, 2, 32)), jnp.float32),
        g=jnp.asarray(-1e-3 * np.logaddexp(0, a), jnp.float32),
        beta=jnp.asarray(rng.uniform(0.05, 0.95, (1, steps, 2)), jnp.float32),
    )


def _live_states(cfg: R.ReplayConfig, tokens: R.Tokens) -> jax.Array:
    """Replay decode over every step (natural policy), the live state after each: [T, Hv, Dv, Dk]."""
    slots = jnp.array([0], jnp.int32)

    def step(state, x):
        _, state = R.decode_step(state, x, slots, policy="natural", use_qk_l2norm=True)
        return state, R.materialize_state(state, slots)[0]

    xs = jax.tree.map(lambda a: jnp.moveaxis(a, 1, 0), tokens)
    _, live = jax.lax.scan(step, R.init_state(cfg, 1), xs)
    return live


@pytest.mark.parametrize("cache_len", [4, 16])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_ten_thousand_steps_stay_within_the_bound(dtype, cache_len, rng):
    tokens = _inputs(rng, STEPS)
    cfg = R.ReplayConfig(1, 2, 32, 32, cache_len, state_dtype=dtype, cache_dtype=dtype)
    live = np.asarray(jax.jit(_live_states, static_argnums=0)(cfg, tokens), np.float64)
    with jax.enable_x64(True):
        ref64 = jax.tree.map(lambda a: jnp.asarray(np.asarray(a, np.float64)), tokens)
        _, _, states = R.recurrent_reference(ref64, jnp.zeros((1, 2, 32, 32), jnp.float64),
                                             use_qk_l2norm=True, return_all_states=True)
        states = np.asarray(states[0])
    late = slice(STEPS // 2, None)
    err = np.linalg.norm((live - states)[late].reshape(STEPS - STEPS // 2, -1), axis=1) / np.linalg.norm(
        states[late].reshape(STEPS - STEPS // 2, -1), axis=1)
    assert np.all(np.isfinite(err))
    assert np.median(err) <= BOUNDS[dtype], f"median {np.median(err):.2e}, max {err.max():.2e}"
    assert err.max() <= 4 * BOUNDS[dtype], f"max {err.max():.2e}"
