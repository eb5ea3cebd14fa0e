"""Slot operations: reset, flush, copy, track_flush, snapshot, and their validation."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import checkify

from replayssm_jax import checked
from replayssm_jax.model import decoder
from replayssm_jax.model import slots as slot_ops
from replayssm_jax.model.slots import copy_slots, flush_slots, reset_slots, snapshot, track_flush

from .conftest import STATE_ATOL, TINY, decode_both

L = 3
N = 4
# Jitted ops for the functional tests (eager op-by-op dispatch is slow on CPU); the
# validation tests call the plain functions to exercise the Python boundary.
jreset = jax.jit(reset_slots)
jflush = jax.jit(flush_slots)
jcopy = jax.jit(copy_slots)
jsnapshot = jax.jit(snapshot)
live_states = jax.jit(slot_ops.live_states)


def _busy_state(params, rng, steps):
    """Slots 0..2 decoded for `steps` random tokens (slot 3 idle); plain states alongside."""
    state = TINY.init_state(N, L)
    plain = decoder.init_plain_state(TINY, 3)
    tokens = rng.integers(0, TINY.vocab_size, (steps, 3))
    state, plain, _, _ = decode_both(params, state, plain, [2, 0, 1], tokens)
    return state, plain  # plain rows: slot 2, slot 0, slot 1


def _assert_untouched(before, after, slot):
    for name in ("checkpoint", "u_cache", "k_cache", "g_cache", "conv_state"):
        np.testing.assert_array_equal(getattr(before, name)[:, slot], getattr(after, name)[:, slot])
    assert int(before.write_pos[slot]) == int(after.write_pos[slot])


def test_track_flush_semantics():
    seq_lens = jnp.array([0, 1, 3, 4, 7, 8, -1], jnp.int32)
    np.testing.assert_array_equal(
        track_flush(seq_lens, 4), [False, False, False, True, False, True, False]
    )
    np.testing.assert_array_equal(track_flush(seq_lens, 1), seq_lens > 0)
    for bad in (0, True, 2.0):
        with pytest.raises(ValueError, match=f"track_interval must be a positive integer, got {bad}"):
            track_flush(seq_lens, bad)


def test_forced_flush_at_track_position_matches_reference(params, rng):
    """Checkpoints written by track_flush equal the plain state at that position, every layer."""
    interval = 4  # not a multiple of L: forced and natural flushes interleave
    state = TINY.init_state(N, L)
    plain = decoder.init_plain_state(TINY, 3)
    slots = jnp.array([1, 3, -1], jnp.int32)
    seen = 0
    for seq_len in range(1, 3 * L + 2):
        force = track_flush(jnp.array([seq_len, seq_len, 0], jnp.int32), interval)
        token = rng.integers(0, TINY.vocab_size, (1, 3))
        state, plain, _, _ = decode_both(params, state, plain, slots, token, force[None])
        if seq_len % interval == 0:
            seen += 1
            np.testing.assert_array_equal(state.write_pos[slots[:2]], [0, 0])
            np.testing.assert_allclose(
                state.checkpoint[:, slots[:2]], plain.ssm[:, :2], atol=STATE_ATOL, rtol=0
            )
            snap = jsnapshot(state, slots)
            np.testing.assert_array_equal(snap.checkpoint[:, :2], state.checkpoint[:, slots[:2]])
            np.testing.assert_allclose(snap.conv_state[:, :2], plain.conv[:, :2], atol=STATE_ATOL, rtol=0)
    assert seen == 2


def test_reset_slots_zero_and_given(params, rng):
    state, _ = _busy_state(params, rng, steps=L + 2)
    fresh = jreset(state, jnp.array([0, -1], jnp.int32))
    assert int(fresh.write_pos[0]) == 0
    assert not np.any(fresh.checkpoint[:, 0]) and not np.any(fresh.conv_state[:, 0])
    for slot in (1, 2, 3):
        _assert_untouched(state, fresh, slot)
    ckpt = jnp.asarray(rng.standard_normal((TINY.num_layers, 1, *state.checkpoint.shape[2:])), jnp.float32)
    conv = jnp.asarray(rng.standard_normal((TINY.num_layers, 1, *state.conv_state.shape[2:])), jnp.float32)
    given = jreset(state, jnp.array([2], jnp.int32), ckpt, conv)
    np.testing.assert_array_equal(given.checkpoint[:, 2], ckpt[:, 0])
    np.testing.assert_array_equal(given.conv_state[:, 2], conv[:, 0])
    np.testing.assert_array_equal(live_states(given, jnp.array([2]))[:, 0], ckpt[:, 0])


def test_flush_slots_writes_live_state_and_changes_nothing_else(params, rng):
    state, plain = _busy_state(params, rng, steps=L + 1)  # cursor 1 on every busy slot
    assert np.all(np.asarray(state.write_pos[:3]) > 0)
    before = live_states(state, jnp.array([0, 1, 2]))
    flushed = jflush(state, jnp.array([0, 2, -1], jnp.int32))
    np.testing.assert_array_equal(flushed.write_pos, [0, state.write_pos[1], 0, 0])
    np.testing.assert_allclose(flushed.checkpoint[:, 0], plain.ssm[:, 1], atol=STATE_ATOL, rtol=0)
    np.testing.assert_allclose(flushed.checkpoint[:, 2], plain.ssm[:, 0], atol=STATE_ATOL, rtol=0)
    np.testing.assert_allclose(live_states(flushed, jnp.array([0, 1, 2])), before, atol=1e-6)
    _assert_untouched(state, flushed, 1)
    np.testing.assert_array_equal(flushed.conv_state, state.conv_state)


def test_copy_from_unflushed_source_copies_the_full_live_state(params, rng):
    """dst gets src's checkpoint replayed with ALL its cache entries, and keeps decoding equal."""
    state, plain = _busy_state(params, rng, steps=2 * L + 2)
    src, pos = 0, int(state.write_pos[0])
    assert 1 < pos < L  # cache holds several entries; the checkpoint is stale
    copied = jcopy(state, jnp.array([src, -1], jnp.int32), jnp.array([3, -1], jnp.int32))
    assert int(copied.write_pos[3]) == 0 and int(copied.write_pos[src]) == pos
    reference = plain.ssm[:, 1]  # plain row 1 decoded slot 0
    np.testing.assert_allclose(copied.checkpoint[:, 3], reference, atol=STATE_ATOL, rtol=0)
    np.testing.assert_array_equal(copied.conv_state[:, 3], copied.conv_state[:, src])
    # A copy that kept only the first pos-1 entries (or none) would differ by far more.
    cut = state.__class__(**{**state.__dict__, "write_pos": state.write_pos.at[src].add(-1)})
    short = live_states(cut, jnp.array([src]))[:, 0]
    assert float(jnp.max(jnp.abs(short - reference))) > 100 * STATE_ATOL
    assert float(jnp.max(jnp.abs(state.checkpoint[:, src] - reference))) > 100 * STATE_ATOL
    _assert_untouched(state, copied, src)
    # Source and copy continue identically.
    tokens = np.repeat(rng.integers(0, TINY.vocab_size, (L + 1, 1)), 2, axis=1)
    plain2 = decoder.PlainState(ssm=plain.ssm[:, 1:2], conv=plain.conv[:, 1:2])
    plain2 = jax.tree.map(lambda x: jnp.concatenate([x, x], axis=1), plain2)
    _, _, replay_logits, plain_logits = decode_both(params, copied, plain2, [src, 3], tokens)
    np.testing.assert_allclose(replay_logits[:, 0], replay_logits[:, 1], atol=1e-4)
    np.testing.assert_allclose(replay_logits, plain_logits, atol=1e-4)


def test_snapshot_requires_a_flushed_slot(params, rng):
    state, _ = _busy_state(params, rng, steps=L + 1)
    with pytest.raises(ValueError, match="unflushed"):
        snapshot(state, jnp.array([0], jnp.int32))
    with pytest.raises(checkify.JaxRuntimeError, match="unflushed"):
        checked(snapshot)(state, jnp.array([0], jnp.int32))
    snap = jsnapshot(state, jnp.array([3, -1], jnp.int32))  # idle slot 3 is flushed
    assert snap.checkpoint.shape == (TINY.num_layers, 2, *state.checkpoint.shape[2:])
    assert not np.any(snap.checkpoint[:, 1]) and not np.any(snap.conv_state[:, 1])


@pytest.mark.parametrize(
    "op, args, message",
    [
        (reset_slots, ([N],), "slots holds slot"),
        (reset_slots, ([1, 1],), "more than once"),
        (flush_slots, ([0, N + 3],), "slots holds slot"),
        (copy_slots, ([0, 1], [2]), "same shape"),
        (copy_slots, ([0, 1], [2, 2]), "dst names a slot more than once"),
        (copy_slots, ([N], [2]), "src holds slot"),
        (copy_slots, ([-1], [2]), "src has padding"),
        (snapshot, ([N],), "slots holds slot"),
    ],
)
def test_bad_slots_raise_at_the_boundary_and_under_checkify(op, args, message):
    state = TINY.init_state(N, L)
    arrays = [jnp.array(a, jnp.int32) for a in args]
    with pytest.raises(ValueError, match=message):
        op(state, *arrays)
    if message == "same shape":
        return  # a shape error is static: raised while tracing too
    with pytest.raises(checkify.JaxRuntimeError):
        checked(op)(state, *arrays)


def test_bad_restore_shapes_raise():
    state = TINY.init_state(N, L)
    slots = jnp.array([0, 1], jnp.int32)
    with pytest.raises(ValueError, match="checkpoint must have shape"):
        reset_slots(state, slots, jnp.zeros((TINY.num_layers, 1, *state.checkpoint.shape[2:])))
    with pytest.raises(ValueError, match="conv_state must have shape"):
        reset_slots(state, slots, None, jnp.zeros((TINY.num_layers, 2, 1, 1)))


def test_valid_slot_ops_pass_checkify_under_jit(params, rng):
    state, _ = _busy_state(params, rng, steps=2)
    # no error: duplicate sources and padding pairs are fine
    checked(copy_slots)(state, jnp.array([0, 0, -1], jnp.int32), jnp.array([3, 2, -1], jnp.int32))
