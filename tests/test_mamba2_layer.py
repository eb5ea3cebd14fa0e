"""The model package's Mamba-2 layer: token-by-token ReplaySSM decode against the plain
recurrence over the whole sequence, and padded prefill against an unpadded one."""

from __future__ import annotations

import dataclasses

import chex
import jax.numpy as jnp
import numpy as np
import pytest

from replayssm_jax import init_state, plan_step
from replayssm_jax.model.mamba2_layer import Mamba2Dims, init_mamba2_params, mamba2_plain, mamba2_replay
from replayssm_jax.plan import advance_write_pos

DIMS = Mamba2Dims(d_model=32, num_heads=4, head_dim=16, state_size=16, num_groups=2)
# fp32 on both sides; the replayed state is the plain one re-associated: a few ulps per
# step through the conv, the SSM and the projections.
TOL = 2e-5


@pytest.mark.parametrize("cache_len", [1, 3])
def test_replay_decode_matches_plain_recurrence(cache_len, backend, rng):
    params = init_mamba2_params(rng, DIMS)
    steps, slots = 7, jnp.array([2, -1, 0])
    u = jnp.asarray(rng.normal(size=(3, steps, DIMS.d_model)), jnp.float32)
    want, want_ssm, want_conv = mamba2_plain(
        params, DIMS, u[jnp.array([0, 2])], jnp.zeros((2, 4, 16, 16)), jnp.zeros((2, 3, DIMS.conv_channels)))
    state = init_state(DIMS.replay_config(cache_len), 3)
    conv = jnp.zeros((3, 3, DIMS.conv_channels))
    for t in range(steps):
        plan = plan_step(state.write_pos, slots, None, cache_len, "natural")
        out, state, conv = mamba2_replay(params, DIMS, u[:, t], state, conv, plan, backend=backend)
        state = dataclasses.replace(state, write_pos=advance_write_pos(state.write_pos, plan))
        scale = float(np.max(np.abs(want[:, t])))
        np.testing.assert_allclose(np.asarray(out)[[0, 2]], np.asarray(want[:, t]), rtol=0, atol=TOL * scale)
        assert np.all(np.asarray(out)[1] == 0)
    np.testing.assert_allclose(np.asarray(conv)[[2, 0]], np.asarray(want_conv), rtol=0, atol=1e-6)


def test_padded_prefill_stops_at_each_rows_length(rng):
    params = init_mamba2_params(rng, DIMS)
    u = jnp.asarray(rng.normal(size=(2, 6, DIMS.d_model)), jnp.float32)
    zeros = lambda b: (jnp.zeros((b, 4, 16, 16)), jnp.zeros((b, 3, DIMS.conv_channels)))
    out, ssm, conv = mamba2_plain(params, DIMS, u, *zeros(2), lengths=jnp.array([6, 4]))
    short, short_ssm, short_conv = mamba2_plain(params, DIMS, u[1:, :4], *zeros(1))
    np.testing.assert_allclose(np.asarray(out[1, :4]), np.asarray(short[0]), rtol=0, atol=1e-6)
    # The padded row's state (SSM and conv) is the unpadded run's, exactly.
    chex.assert_trees_all_equal((ssm[1], conv[1]), (short_ssm[0], short_conv[0]))
