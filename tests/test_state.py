"""`init_state` / `ReplayState`: layout, dtypes, initial checkpoint, pytree behaviour."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import random_checkpoint, small_config
from replayssm_jax import ReplayState, init_state
from replayssm_jax.state import check_state


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("gate", ["gdn", "kda"])
def test_layout_and_zero_init(gate, dtype):
    config = small_config(gate, 4, dtype)
    state = init_state(config, 8)
    g_tail = (32,) if gate == "kda" else ()
    want = dict(
        checkpoint=((8, 4, 16, 32), dtype),
        u_cache=((8, 4, 4, 16), dtype),
        k_cache=((8, 2, 4, 32), dtype),
        g_cache=((8, 4, 4, *g_tail), jnp.float32),
        write_pos=((8,), jnp.int32),
    )
    for name, (shape, dt) in want.items():
        x = getattr(state, name)
        assert (x.shape, x.dtype) == (shape, dt), name
        np.testing.assert_array_equal(x, 0)
    assert state.config is config and state.num_slots == 8


def test_initial_checkpoint_is_kept(rng):
    config = small_config("gdn", 4, jnp.bfloat16)
    checkpoint = random_checkpoint(rng, config, 5)
    state = init_state(config, 5, checkpoint)
    np.testing.assert_array_equal(np.asarray(state.checkpoint), checkpoint)
    np.testing.assert_array_equal(state.write_pos, 0)


@pytest.mark.parametrize(
    "shape, dtype, match",
    [
        ((4, 4, 16, 32), jnp.float32, r"\(5, 4, 16, 32\) and dtype float32, got \(4, 4, 16, 32\) float32"),
        ((5, 4, 32, 16), jnp.float32, r"\(5, 4, 16, 32\) and dtype float32, got \(5, 4, 32, 16\) float32"),
        ((5, 4, 16, 32), jnp.bfloat16, r"\(5, 4, 16, 32\) and dtype float32, got \(5, 4, 16, 32\) bfloat16"),
    ],
)
def test_bad_initial_checkpoint_raises(shape, dtype, match):
    with pytest.raises(ValueError, match=r"checkpoint must have shape " + match):
        init_state(small_config("gdn", 4), 5, jnp.zeros(shape, dtype))


@pytest.mark.parametrize("num_slots", [0, -1, 2.5, True])
def test_bad_num_slots_raises(num_slots):
    with pytest.raises(ValueError, match=r"num_slots must be a positive integer"):
        init_state(small_config("gdn", 4), num_slots)


def test_pytree_with_static_config():
    """Five array leaves; the config is static metadata, so it survives jit and tree ops."""
    state = init_state(small_config("kda", 4), 3)
    leaves, treedef = jax.tree.flatten(state)
    assert len(leaves) == 5
    rebuilt = jax.tree.unflatten(treedef, leaves)
    assert isinstance(rebuilt, ReplayState) and rebuilt.config == state.config
    bumped = jax.jit(lambda s: jax.tree.map(lambda x: x + 1, s))(state)
    assert bumped.config == state.config
    np.testing.assert_array_equal(bumped.write_pos, 1)


def test_check_state_catches_mismatched_fields():
    state = init_state(small_config("gdn", 4), 3)
    check_state(state)
    wrong = ReplayState(**{**vars(state), "write_pos": jnp.zeros(3, jnp.float32)})
    with pytest.raises(ValueError, match=r"state.write_pos must have shape \(3,\) and dtype int32"):
        check_state(wrong)
