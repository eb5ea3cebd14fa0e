"""The GDN layer: causal conv, padded prefill, replay path vs plain path."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np

from replayssm_jax import advance_write_pos, materialize_state, plan_step
from replayssm_jax.model.layer import causal_conv, gdn_plain, gdn_replay
from replayssm_jax.state import init_state

from .conftest import LOGIT_ATOL, STATE_ATOL, TINY

DIMS = TINY.gdn


def _layer0(params):
    return jax.tree.map(lambda x: x[0], params.blocks.gdn)


def test_causal_conv_matches_numpy_and_streams(rng):
    k, c, t = 4, 5, 7
    weight = rng.standard_normal((k, c)).astype(np.float32)
    history = rng.standard_normal((2, k - 1, c)).astype(np.float32)
    x = rng.standard_normal((2, t, c)).astype(np.float32)
    out, last = causal_conv(jnp.asarray(history), jnp.asarray(x), jnp.asarray(weight))
    full = np.concatenate([history, x], axis=1)
    expect = np.stack([(full[:, i : i + k] * weight).sum(1) for i in range(t)], axis=1)
    np.testing.assert_allclose(out, expect, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(last, full[:, -(k - 1) :])
    # One token at a time from the carried conv state gives the same outputs.
    state = jnp.asarray(history)
    for i in range(t):
        step, state = causal_conv(state, jnp.asarray(x[:, i : i + 1]), jnp.asarray(weight))
        np.testing.assert_allclose(step[:, 0], expect[:, i], rtol=1e-5, atol=1e-5)
    # With lengths, the state stops at each row's last real token.
    _, cut = causal_conv(jnp.asarray(history), jnp.asarray(x), jnp.asarray(weight), jnp.array([2, 7]))
    np.testing.assert_array_equal(cut[0], full[0, 2 : 2 + k - 1])
    np.testing.assert_array_equal(cut[1], full[1, -(k - 1) :])


def test_padded_positions_leave_the_state_unchanged(params, rng):
    layer = _layer0(params)
    x = jnp.asarray(rng.standard_normal((2, 6, DIMS.d_model)), jnp.float32)
    ssm = jnp.asarray(rng.standard_normal((2, DIMS.num_v_heads, DIMS.head_v_dim, DIMS.head_k_dim)), jnp.float32)
    conv = jnp.asarray(rng.standard_normal((2, DIMS.conv_kernel - 1, DIMS.conv_channels)), jnp.float32)
    lengths = jnp.array([3, 6], jnp.int32)
    run = jax.jit(gdn_plain, static_argnums=1)
    out, ssm_end, conv_end = run(layer, DIMS, x, ssm, conv, lengths)
    # Whatever sits in the padded positions, row 0's state and conv state are bit-identical.
    junk = x.at[0, 3:].set(jnp.asarray(rng.standard_normal((3, DIMS.d_model)), jnp.float32))
    _, ssm_junk, conv_junk = run(layer, DIMS, junk, ssm, conv, lengths)
    chex.assert_trees_all_equal((ssm_junk, conv_junk), (ssm_end, conv_end))
    # ...and equal to running the 3 real tokens alone (other batch shape: last-ulp matmul noise).
    out3, ssm3, conv3 = run(layer, DIMS, x[:1, :3], ssm[:1], conv[:1])
    chex.assert_trees_all_close((ssm_end[0], conv_end[0]), (ssm3[0], conv3[0]), rtol=0, atol=1e-6)
    chex.assert_trees_all_close(out[0, :3], out3[0], rtol=0, atol=1e-5)


def test_replay_layer_matches_plain_layer(params, rng):
    """Single layer, 3L+1 steps, rows on permuted slots with a padding row, forced flushes."""
    layer = _layer0(params)
    cache_len, steps = 3, 10
    cfg = TINY.replay_config(cache_len)
    state = init_state(cfg, 4)
    conv_pool = jnp.zeros((4, DIMS.conv_kernel - 1, DIMS.conv_channels), jnp.float32)
    slots = jnp.array([3, -1, 0], jnp.int32)
    ssm = jnp.zeros((3, DIMS.num_v_heads, DIMS.head_v_dim, DIMS.head_k_dim), jnp.float32)
    conv = jnp.zeros((3, DIMS.conv_kernel - 1, DIMS.conv_channels), jnp.float32)

    @jax.jit
    def replay_step(state, conv_pool, x, force):
        plan = plan_step(state.write_pos, slots, force, cache_len)
        out, state, conv_pool = gdn_replay(layer, DIMS, x, state, conv_pool, plan)
        return out, state.__class__(**{**state.__dict__, "write_pos": advance_write_pos(state.write_pos, plan)}), conv_pool

    plain_step = jax.jit(lambda x, ssm, conv: gdn_plain(layer, DIMS, x[:, None], ssm, conv))
    for t in range(steps):
        x = jnp.asarray(rng.standard_normal((3, DIMS.d_model)), jnp.float32)
        force = jnp.asarray(rng.random(3) < 0.2)
        out, state, conv_pool = replay_step(state, conv_pool, x, force)
        ref, ssm, conv = plain_step(x, ssm, conv)
        out, ref = np.asarray(out), np.asarray(ref[:, 0])
        np.testing.assert_allclose(out[[0, 2]], ref[[0, 2]], atol=LOGIT_ATOL, rtol=0)
        np.testing.assert_array_equal(out[1], 0.0)  # padding row: y = 0, so the output is 0
        np.testing.assert_array_equal(conv_pool[jnp.array([3, 0])], conv[jnp.array([0, 2])])
    live = materialize_state(state, jnp.array([3, 0], jnp.int32))
    np.testing.assert_allclose(live, ssm[jnp.array([0, 2])], atol=STATE_ATOL, rtol=0)
    assert not np.any(conv_pool[jnp.array([1, 2])])  # unused slots untouched
