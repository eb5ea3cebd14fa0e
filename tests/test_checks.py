"""Debug mode (`replayssm_jax.checked`): each in-jit check fires under jit, passes valid
inputs, and is off by default (the same jitted call without `checked` returns)."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import checkify

from helpers import random_tokens, small_config, to_device
from replayssm_jax import accept, checked, decode_step, init_state, verify_step
from replayssm_jax.model import copy_slots, decoder, flush_slots, reset_slots, snapshot

N = 4
TINY = decoder.DecoderConfig(
    vocab_size=16, d_model=16, num_layers=1, num_k_heads=1, num_v_heads=2,
    head_k_dim=8, head_v_dim=8, mlp_hidden=16,
)
i32 = lambda x: jnp.asarray(x, jnp.int32)


def busy_model_state():
    """Slot 1 holds cached entries (cursor 2); the others are flushed."""
    return dataclasses.replace(TINY.init_state(N, 4), write_pos=i32([0, 2, 0, 0]))


def layer_case(slots):
    config = small_config("gdn", 4)
    tokens = to_device(random_tokens(np.random.default_rng(0), config, (len(slots),)))
    return functools.partial(decode_step, policy="natural"), (init_state(config, N), tokens, i32(slots))


def model_step_case(tokens, slots):
    params = decoder.init_params(TINY, seed=0)
    return functools.partial(decoder.decode_step, policy="natural"), (params, TINY.init_state(N, 4), i32(tokens), i32(slots))


def prefill_case(tokens, lengths):
    params = decoder.init_params(TINY, seed=0)
    return decoder.prefill, (params, TINY.init_state(N, 4), i32(tokens), i32(lengths), i32([0, 1]))


def verify_case(lengths, parents=None, slots=(0, 1)):
    config = small_config("gdn", 4)
    window = to_device(random_tokens(np.random.default_rng(1), config, (len(slots), 3)))
    fn = lambda state, window, slots, lengths, parents: verify_step(state, window, slots, lengths=lengths,
                                                                       parents=parents)
    maybe = lambda x: None if x is None else i32(x)
    return fn, (init_state(config, N), window, i32(slots), maybe(lengths), maybe(parents))


def accept_case(counts, write_pos=(0, 2, 0, 0), path=None):
    state = dataclasses.replace(init_state(small_config("gdn", 4), N), write_pos=i32(write_pos))
    fn = lambda state, slots, counts, path: accept(state, slots, counts, path=path)
    return fn, (state, i32([0, 1]), i32(counts), None if path is None else i32(path))


# Each case: (fn, args) that fails one check, the message, and the same call made valid.
CASES = {
    "step slot >= N": (lambda: layer_case([0, N]), "holds a slot >= 4", lambda: layer_case([0, 3])),
    "step slot twice": (lambda: layer_case([1, -1, 1]), "names a slot twice", lambda: layer_case([1, -1, -1])),
    "reset slot twice": (lambda: (reset_slots, (busy_model_state(), i32([2, 2]))), "names a slot twice",
                         lambda: (reset_slots, (busy_model_state(), i32([2, -1])))),
    "flush slot >= N": (lambda: (flush_slots, (busy_model_state(), i32([N + 1]))), "holds a slot >= 4",
                        lambda: (flush_slots, (busy_model_state(), i32([1])))),
    "copy src >= N": (lambda: (copy_slots, (busy_model_state(), i32([N]), i32([0]))), "src holds a slot",
                      lambda: (copy_slots, (busy_model_state(), i32([1]), i32([0])))),
    "copy dst twice": (lambda: (copy_slots, (busy_model_state(), i32([0, 1]), i32([2, 2]))), "dst names a slot twice",
                       lambda: (copy_slots, (busy_model_state(), i32([0, 0]), i32([2, 3])))),
    "copy padding src": (lambda: (copy_slots, (busy_model_state(), i32([-1]), i32([2]))), "src has padding",
                         lambda: (copy_slots, (busy_model_state(), i32([-1]), i32([-1])))),
    "snapshot unflushed": (lambda: (snapshot, (busy_model_state(), i32([1]))), "unflushed",
                           lambda: (snapshot, (busy_model_state(), i32([0, 2])))),
    "snapshot slot >= N": (lambda: (snapshot, (busy_model_state(), i32([N]))), "holds a slot >= 4",
                           lambda: (snapshot, (busy_model_state(), i32([-1])))),
    "token id >= vocab": (lambda: model_step_case([3, 16], [0, 1]), "outside \\[0, 16\\)",
                          lambda: model_step_case([3, 16], [0, -1])),  # padding row: ignored
    "negative token id": (lambda: model_step_case([-2, 1], [0, 1]), "outside \\[0, 16\\)",
                          lambda: model_step_case([0, 15], [0, 1])),
    "model slot twice": (lambda: model_step_case([1, 2], [3, 3]), "names a slot twice",
                         lambda: model_step_case([1, 2], [3, 2])),
    "prefill length > T": (lambda: prefill_case([[1, 2, 3], [4, 5, 6]], [3, 4]), "lengths must be in \\[0, 3\\]",
                           lambda: prefill_case([[1, 2, 3], [4, 5, 6]], [3, 0])),
    "prefill token id": (lambda: prefill_case([[1, 99, 3], [4, 5, 6]], [3, 1]), "token id outside",
                         lambda: prefill_case([[1, 2, 99], [4, 99, 6]], [2, 1])),  # 99s past lengths
    "verify slot twice": (lambda: verify_case(None, slots=(2, 2)), "names a slot twice",
                          lambda: verify_case(None, slots=(2, -1))),
    "verify length > T": (lambda: verify_case([3, 4]), "lengths must lie in \\[0, 3\\]",
                          lambda: verify_case([3, 0])),
    "verify parent": (lambda: verify_case(None, [[-1, 0, 2], [-1, 0, 0]]), "parents must be -1 or an earlier",
                      lambda: verify_case(None, [[-1, 0, 1], [-1, 0, 0]])),
    "accept past the ring": (lambda: accept_case([1, 3]), "moves a cursor past the ring",
                             lambda: accept_case([4, 2])),
    "accept negative": (lambda: accept_case([-1, 0]), "must be >= 0", lambda: accept_case([0, 0])),
    "accept path order": (lambda: accept_case([2, 1], path=[[0, 0], [1, 0]]), "increasing window positions",
                          lambda: accept_case([2, 1], path=[[0, 2], [1, 0]])),
    "accept path past the ring": (lambda: accept_case([1, 1], path=[[0, 1], [2, 0]]), "inside the ring",
                                  lambda: accept_case([1, 1], path=[[0, 1], [1, 0]])),
}


@pytest.mark.parametrize("name", list(CASES))
def test_check_fires_under_jit_and_is_off_by_default(name):
    bad, message, good = CASES[name]
    fn, args = bad()
    with pytest.raises(checkify.JaxRuntimeError, match=message):
        checked(fn)(*args)
    jax.block_until_ready(jax.jit(fn)(*args))  # off by default: no error, no raise
    fn, args = good()
    checked(fn)(*args)


def test_checked_keeps_jit_options_and_results():
    """`checked(fn, donate_argnums=...)` returns what `jit(fn)` returns, with the state donated."""
    fn, args = layer_case([2, -1, 0])
    want_y, want = jax.jit(fn)(*args)
    y, got = checked(fn, donate_argnums=0)(*jax.tree.map(jnp.copy, args))
    np.testing.assert_array_equal(np.asarray(y), np.asarray(want_y))
    np.testing.assert_array_equal(np.asarray(got.write_pos), np.asarray(want.write_pos))


def test_checked_takes_static_keyword_arguments():
    config = small_config("gdn", 4)
    step = checked(decode_step, static_argnames=("backend", "policy"))
    tokens = to_device(random_tokens(np.random.default_rng(1), config, (2,)))
    y, _ = step(init_state(config, N), tokens, i32([0, 1]), backend="xla", policy="natural")
    assert y.shape == (2, config.num_v_heads, config.head_v_dim)
    with pytest.raises(checkify.JaxRuntimeError, match="names a slot twice"):
        step(init_state(config, N), tokens, i32([1, 1]), backend="xla", policy="natural")


def test_prefill_length_past_the_chunk_raises_at_the_boundary():
    fn, args = prefill_case([[1, 2, 3], [4, 5, 6]], [3, 4])
    with pytest.raises(ValueError, match="lengths must be in"):
        fn(*args)


@pytest.mark.parametrize("name", ["step slot >= N", "verify length > T", "accept past the ring", "copy src >= N",
                                  "snapshot unflushed", "token id >= vocab", "prefill length > T"])
def test_plain_traces_carry_no_checks(name):
    """Off by default means absent from the trace: a jaxpr with a check has an effect, and
    JAX dispatches every call of such a jitted function through its slow Python path."""
    fn, args = CASES[name][0]()
    assert not jax.make_jaxpr(fn)(*args).effects
