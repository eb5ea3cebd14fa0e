"""Model-level state: layout, per-layer views, one cursor per forward pass."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from replayssm_jax import Tokens, advance_write_pos, decode_step, layer_step, materialize_state, plan_step
from replayssm_jax.model import decoder
from replayssm_jax.model.state import (
    check_model_state,
    flat_view,
    from_flat_view,
    init_model_state,
    layer_plan,
    layer_state,
)

from .conftest import TINY


def _random_state(rng, num_slots=4, cache_len=3):
    """A model state with random checkpoints/caches/conv and random cursors."""
    state = TINY.init_state(num_slots, cache_len)
    fill = lambda x: jnp.asarray(rng.standard_normal(x.shape), x.dtype)
    g = -jnp.abs(fill(state.g_cache))
    return state.__class__(
        checkpoint=fill(state.checkpoint), u_cache=fill(state.u_cache),
        k_cache=fill(state.k_cache), g_cache=g, conv_state=fill(state.conv_state),
        write_pos=jnp.asarray(rng.integers(0, cache_len, num_slots), jnp.int32),
        config=state.config,
    )


def test_layout():
    state = TINY.init_state(num_slots=5, cache_len=3)
    y, hv, hk, d = TINY.num_layers, TINY.num_v_heads, TINY.num_k_heads, TINY.head_k_dim
    assert state.checkpoint.shape == (y, 5, hv, d, d)
    assert state.u_cache.shape == (y, 5, hv, 3, d)
    assert state.k_cache.shape == (y, 5, hk, 3, d)
    assert state.g_cache.shape == (y, 5, hv, 3)
    assert state.conv_state.shape == (y, 5, TINY.conv_kernel - 1, TINY.gdn.conv_channels)
    assert state.write_pos.shape == (5,) and state.write_pos.dtype == jnp.int32
    check_model_state(state)
    # A pytree: jit-able, and the config is static.
    assert jax.jit(lambda s: s)(state).config == state.config


def test_bad_sizes_raise():
    cfg = TINY.replay_config(4)
    with pytest.raises(ValueError, match="num_layers"):
        init_model_state(cfg, 0, 2, 8)
    with pytest.raises(ValueError, match="conv_kernel"):
        init_model_state(cfg, 1, 2, 8, conv_kernel=1)
    state = TINY.init_state(2, 4)
    with pytest.raises(ValueError, match="write_pos"):
        check_model_state(state.__class__(**{**state.__dict__, "write_pos": jnp.zeros(3, jnp.int32)}))


def test_layer_state_is_a_slice_with_the_shared_cursor(rng):
    state = _random_state(rng)
    for i in range(state.num_layers):
        layer = layer_state(state, i)
        np.testing.assert_array_equal(layer.checkpoint, state.checkpoint[i])
        np.testing.assert_array_equal(layer.k_cache, state.k_cache[i])
        assert layer.write_pos is state.write_pos


def test_flat_view_step_equals_single_layer_decode_step(rng):
    """Layer i stepped through the flat view == the core decode_step on layer i's slice."""
    state = _random_state(rng)
    cfg = state.config
    batch = 2
    slots = jnp.array([2, 0], jnp.int32)
    force = jnp.array([False, True])
    q = jnp.asarray(rng.standard_normal((batch, cfg.num_k_heads, cfg.head_k_dim)), jnp.float32)
    k = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)
    v = jnp.asarray(rng.standard_normal((batch, cfg.num_v_heads, cfg.head_v_dim)), jnp.float32)
    g = -jnp.asarray(rng.uniform(0.01, 1.0, (batch, cfg.num_v_heads)), jnp.float32)
    beta = jnp.asarray(rng.uniform(0.1, 0.9, (batch, cfg.num_v_heads)), jnp.float32)
    tokens = Tokens(q, k, v, g, beta)

    plan = plan_step(state.write_pos, slots, force, cfg.cache_len)  # NATURAL
    view, conv = flat_view(state)
    ys = []
    for i in range(state.num_layers):
        y, view = layer_step(view, tokens, layer_plan(plan, i, state.num_slots))
        ys.append(y)
    stepped = from_flat_view(state, view, conv, advance_write_pos(state.write_pos, plan))
    for i in range(state.num_layers):
        y_ref, ref = decode_step(layer_state(state, i), tokens, slots, force, policy="natural")
        chex.assert_trees_all_equal((ys[i], layer_state(stepped, i)), (y_ref, ref))
        np.testing.assert_allclose(
            materialize_state(layer_state(stepped, i), slots), materialize_state(ref, slots)
        )


def test_cursor_advances_once_per_forward_pass(params, rng):
    state = TINY.init_state(num_slots=4, cache_len=3)
    slots = jnp.array([3, -1, 1], jnp.int32)
    tokens = jnp.asarray(rng.integers(0, TINY.vocab_size, 3), jnp.int32)
    for step in range(1, 3):
        _, state, _ = decoder.jitted_decode_step(params, state, tokens, slots, policy="natural")
        np.testing.assert_array_equal(state.write_pos, [0, step, 0, step])
