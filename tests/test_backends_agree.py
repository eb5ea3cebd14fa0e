"""Every backend given the same plans ends in the same state.

Both backends run the same schedule from the same state, each on its own state (never
re-synchronised), under the default flush policy for the batch (so the small batches run
the fold-every-step plan and the others the natural one), with padding rows, shuffled
slots and forced flushes. After every step the cursors must be equal exactly and the
outputs, checkpoints and caches within the tolerance of their dtype.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import replayssm_jax as R

# fp32: the same algebra summed in a different order, ~1e-7 apart per step; the recurrence
# is contractive (decays < 1), so the gap stays at that size over a run.
FP32_BOUND = 1e-5
# bf16 state and caches: a sum in a different order can round to the neighbouring bf16
# value (2^-8 relative); the contraction keeps a run within a few such steps.
BF16_BOUND = 3e-2
CACHE_LEN, STEPS = 4, 11  # two natural windows and a partial one


def _normwise(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))


@functools.cache
def _step(backend: str, policy: R.FlushPolicy):
    return jax.jit(functools.partial(R.decode_step, backend=backend, policy=policy, use_qk_l2norm=True))


@pytest.mark.parametrize("batch", [1, 3, 5, 8, 32])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("gate", ["gdn", "kda"])
def test_backends_end_in_the_same_state(gate, dtype, batch, rng):
    cfg = R.ReplayConfig(2, 4, 32, 16, CACHE_LEN, gate=gate, state_dtype=dtype, cache_dtype=dtype)
    num_slots = batch + 3
    policy = R.default_flush_policy(cfg, batch)
    shape = (num_slots, cfg.num_v_heads, cfg.head_v_dim, cfg.head_k_dim)
    state0 = R.init_state(cfg, num_slots, jnp.asarray(0.3 * rng.normal(size=shape), dtype))
    states = {"xla": state0, "pallas_triton": state0}
    bound = FP32_BOUND if dtype == jnp.float32 else BF16_BOUND
    for t in range(STEPS):
        slots = rng.permutation(num_slots)[:batch].astype(np.int32)
        if batch > 1:
            slots[rng.integers(batch)] = -1  # a padding row
        force = rng.random(batch) < 0.2
        g_shape = cfg.g_shape(batch)
        tokens = R.Tokens(
            q=jnp.asarray(rng.normal(size=(batch, 2, 32)), jnp.float32),
            k=jnp.asarray(rng.normal(size=(batch, 2, 32)), jnp.float32),
            v=jnp.asarray(rng.normal(size=(batch, 4, 16)), jnp.float32),
            g=jnp.asarray(-np.logaddexp(0, rng.normal(-1.5, 1, g_shape)), jnp.float32),
            beta=jnp.asarray(rng.uniform(0.05, 0.95, (batch, 4)), jnp.float32),
        )
        out = {}
        for backend, state in states.items():
            out[backend], states[backend] = _step(backend, policy)(
                state, tokens, jnp.asarray(slots), jnp.asarray(force))
        got, want = states["pallas_triton"], states["xla"]
        np.testing.assert_array_equal(got.write_pos, want.write_pos, err_msg=f"step {t}: cursors")
        if policy is R.FlushPolicy.EVERY_STEP:
            assert np.all(np.asarray(got.write_pos)[slots[slots >= 0]] == 0), "fold-every-step left a cursor"
        errors = {"y": _normwise(out["pallas_triton"], out["xla"])}
        for name in ("checkpoint", "u_cache", "k_cache", "g_cache"):
            errors[name] = _normwise(getattr(got, name), getattr(want, name))
        assert max(errors.values()) <= bound, f"step {t} ({policy.name}): {errors}"
