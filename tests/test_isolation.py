"""Isolation (issue 24, points 1-3): no value in a stale cache entry, an unused slot or a
padding row's inputs reaches an output or another slot; a non-finite input in one live row
reaches only that row and its slot; out-of-range reads under jit give zeros; the README's
names import from where it says.

Every comparison here is bit for bit: the poisoned run against the same call on clean
memory. A masked value must not even change rounding (a `0 * x` that survives would turn
NaN into NaN, and a finite poison into a different sum).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import bits, random_log_decay, random_tokens, small_config, to_device
from replayssm_jax import ReplayConfig, Tokens, decode_step, materialize_state
from replayssm_jax.model import (
    copy_slots,
    flush_slots,
    init_model_state,
    layer_state,
    reset_slots,
    snapshot,
)
from replayssm_jax.model.state import ModelState, flat_view, from_flat_view

CACHES = ("u_cache", "k_cache", "g_cache")
FIELDS = ("checkpoint", *CACHES, "conv_state", "write_pos")
POISON = np.asarray([np.nan, np.inf, -np.inf], np.float32)
NUM_LAYERS, NUM_SLOTS, CONV = 2, 8, 6
NUM_SLOTS_MINIMAL = 3  # the issue's case


def random_model_state(rng, config: ReplayConfig, cursors) -> ModelState:
    """Finite random checkpoints, caches, conv states and the given cursors (any finite
    cache content is a valid history: the caches are just the last tokens' u, k, g)."""
    state = init_model_state(config, NUM_LAYERS, NUM_SLOTS, CONV)
    normal = lambda x: jnp.asarray(0.3 * rng.normal(size=x.shape), x.dtype)
    return dataclasses.replace(
        state,
        checkpoint=normal(state.checkpoint), u_cache=normal(state.u_cache),
        k_cache=normal(state.k_cache), conv_state=normal(state.conv_state),
        g_cache=jnp.asarray(random_log_decay(rng, state.g_cache.shape)),
        write_pos=jnp.asarray(cursors, jnp.int32),
    )


def poisoned(state, unused=()):
    """`state` (a ModelState or ReplayState) with NaN, +Inf, -Inf in every stale cache entry
    (position >= the slot's cursor) and in every element of the `unused` slots."""
    slot_axis = 1 if isinstance(state, ModelState) else 0
    cursors = np.asarray(state.write_pos)
    out = {}
    for name in FIELDS:
        if not hasattr(state, name) or name == "write_pos":
            continue
        x = np.array(getattr(state, name), copy=True)
        bad = np.resize(POISON, x.shape).astype(x.dtype)
        mask = np.zeros(x.shape, bool)
        if name in CACHES:  # [.., N, H, L, ...]: entry axis is slot_axis + 2
            length = x.shape[slot_axis + 2]
            stale = np.arange(length)[None, :] >= cursors[:, None]  # [N, L]
            shape = [1] * x.ndim
            shape[slot_axis], shape[slot_axis + 2] = stale.shape
            mask |= stale.reshape(shape)
        for s in unused:
            index = [slice(None)] * x.ndim
            index[slot_axis] = s
            mask[tuple(index)] = True
        out[name] = jnp.asarray(np.where(mask, bad, x), x.dtype)
    return dataclasses.replace(state, **out)


def assert_bits(got, want, msg=""):
    np.testing.assert_array_equal(bits(np.asarray(got)), bits(np.asarray(want)), err_msg=msg)


def assert_slots_equal(got, want, slots, fields=FIELDS, msg=""):
    """The named slots of two states agree bit for bit: checkpoint, conv, cursor, and the
    cache entries valid in `want`."""
    axis = 1 if isinstance(want, ModelState) else 0
    for name in fields:
        if not hasattr(want, name):
            continue
        g, w = np.asarray(getattr(got, name)), np.asarray(getattr(want, name))
        for s in slots:
            at = 0 if name == "write_pos" else axis
            gs, ws = np.take(g, s, axis=at), np.take(w, s, axis=at)
            if name in CACHES:
                n = int(np.asarray(want.write_pos)[s])
                gs, ws = np.take(gs, np.arange(n), axis=axis + 1), np.take(ws, np.arange(n), axis=axis + 1)
            assert_bits(gs, ws, f"{msg} {name} slot {s}")


# ---------------------------------------------------------------- the issue's minimal case


def test_issue_minimal_case_inf_key_does_not_poison_the_reused_slot(backend):
    """ReplayConfig(1, 1, 16, 16, 4), 3 slots, 6 rows (slot 0 live, 5 padding), L2 norm on:
    k = 1, then k = inf, `reset_slots([0])`, then k = 1. The last step, the live state, a
    flush and a copy of slot 0 are finite and equal to the same on a fresh state."""
    config = ReplayConfig(1, 1, 16, 16, 4)
    slots = jnp.asarray([0, -1, -1, -1, -1, -1], jnp.int32)
    step = jax.jit(functools.partial(decode_step, backend=backend, policy="natural", use_qk_l2norm=True))

    def tokens(k):
        ones = jnp.ones((6, 1, 16), jnp.float32)
        return Tokens(q=ones, k=jnp.full((6, 1, 16), k, jnp.float32), v=ones,
                      g=jnp.full((6, 1), -0.1, jnp.float32), beta=jnp.full((6, 1), 0.5, jnp.float32))

    def run(model, ks):
        for k in ks:
            view, conv = flat_view(model)
            _, view = step(view, tokens(k), slots)
            model = from_flat_view(model, view, conv, view.write_pos[:NUM_SLOTS_MINIMAL])
        return model

    used = run(init_model_state(config, 1, NUM_SLOTS_MINIMAL, 4), [1.0, jnp.inf])
    assert not np.all(np.isfinite(np.asarray(used.k_cache)))  # the inf is in the cache
    used = reset_slots(used, jnp.asarray([0], jnp.int32))
    fresh = init_model_state(config, 1, NUM_SLOTS_MINIMAL, 4)
    y_used, used_after = step(layer_state(used, 0), tokens(1.0), slots)
    y_fresh, fresh_after = step(layer_state(fresh, 0), tokens(1.0), slots)
    assert np.all(np.isfinite(np.asarray(y_used)))
    assert_bits(y_used, y_fresh)
    assert_bits(used_after.checkpoint[0], fresh_after.checkpoint[0])
    used = run(used, [1.0])
    fresh = run(fresh, [1.0])
    zero = jnp.asarray([0], jnp.int32)
    assert_bits(materialize_state(layer_state(used, 0), zero), materialize_state(layer_state(fresh, 0), zero))
    assert_bits(flush_slots(used, zero).checkpoint[:, 0], flush_slots(fresh, zero).checkpoint[:, 0])
    copied = copy_slots(used, zero, jnp.asarray([2], jnp.int32))
    assert np.all(np.isfinite(np.asarray(copied.checkpoint)))
    assert_bits(copied.checkpoint[:, 2], copy_slots(fresh, zero, jnp.asarray([2], jnp.int32)).checkpoint[:, 2])


# ----------------------------------------------- point 1: stale entries and unused slots


@pytest.mark.parametrize("gate", ["gdn", "kda"])
def test_slot_ops_never_read_stale_entries_or_unused_slots(gate, rng):
    """materialize_state, flush_slots, copy_slots, snapshot + reset (restore) and reset on a
    state whose stale entries hold NaN/Inf and whose unused slots are NaN/Inf throughout:
    the named slots come out bit-identical to the same op on clean memory and the unused
    slots are left exactly as they were."""
    config = small_config(gate, 4)
    cursors = np.array([0, 1, 2, 3, 0, 2, 1, 3])
    clean = random_model_state(rng, config, cursors)
    unused = [6, 7]
    dirty = poisoned(clean, unused)
    live = jnp.asarray([3, 0, -1, 2, 1], jnp.int32)  # every cursor, a padding entry
    named = [3, 0, 2, 1]

    for layer in range(NUM_LAYERS):
        assert_bits(materialize_state(layer_state(dirty, layer), live),
                    materialize_state(layer_state(clean, layer), live), f"materialize layer {layer}")

    restore = lambda s, snap: reset_slots(s, jnp.asarray([5, 1], jnp.int32), snap.checkpoint, snap.conv_state)
    src, dst = jnp.asarray([3, 1, -1, 2], jnp.int32), jnp.asarray([4, 5, -1, 0], jnp.int32)
    flushed = jnp.asarray([0, 4], jnp.int32)  # cursor 0: snapshot needs a flushed slot
    ops = {
        "flush_slots": (lambda s: flush_slots(s, live), named),
        "copy_slots": (lambda s: copy_slots(s, src, dst), [4, 5, 0, 3, 1, 2]),
        "reset_slots": (lambda s: reset_slots(s, live), named),
        "snapshot+restore": (lambda s: restore(s, snapshot(s, flushed)), [5, 1, 0, 4]),
    }
    for name, (op, touched) in ops.items():
        got, want = jax.jit(op)(dirty), jax.jit(op)(clean)
        assert_slots_equal(got, want, touched, msg=name)
        for field in FIELDS:
            before = np.asarray(getattr(dirty, field))
            after = np.asarray(getattr(got, field))
            axis = 0 if field == "write_pos" else 1
            assert_bits(np.take(after, unused, axis=axis), np.take(before, unused, axis=axis), f"{name} {field}")
    snap_dirty, snap_clean = snapshot(dirty, flushed), snapshot(clean, flushed)
    assert_bits(snap_dirty.checkpoint, snap_clean.checkpoint)
    assert_bits(snap_dirty.conv_state, snap_clean.conv_state)


def _step_inputs(rng, config, slots):
    return to_device(random_tokens(rng, config, (len(slots),))), jnp.asarray(slots, jnp.int32)


@pytest.mark.parametrize("gate", ["gdn", "kda"])
def test_step_never_reads_unused_slots_or_padding_inputs(gate, backend, rng):
    """A step with NaN/Inf in stale entries, in every element of the unused slots and in
    every input of the padding rows (q, k, v, g, beta): y, the used slots and the cursors
    bit-identical to the step on clean memory with finite padding inputs; the unused slots
    untouched. Both policies, forced flushes included."""
    config = small_config(gate, 4)
    clean = layer_state(random_model_state(rng, config, np.array([0, 1, 2, 3, 1, 0, 2, 3])), 0)
    unused = [4, 5, 6, 7]
    dirty = poisoned(clean, unused)
    slots = [2, -1, 0, 3, -5, 1, -1]  # every cursor; padding rows with negative slots
    tokens, slots = _step_inputs(rng, config, slots)
    pad = np.asarray(slots) < 0
    poison_rows = lambda x: jnp.where(pad.reshape(-1, *([1] * (x.ndim - 1))),
                                      jnp.asarray(np.resize(POISON, x.shape)), x)
    dirty_tokens = jax.tree.map(poison_rows, tokens)
    force = jnp.asarray([False, True, True, False, True, False, False])
    for policy in ("natural", "every_step"):
        step = jax.jit(functools.partial(decode_step, backend=backend, policy=policy, use_qk_l2norm=True))
        want_y, want = step(clean, tokens, slots, force)
        got_y, got = step(dirty, dirty_tokens, slots, force)
        assert_bits(got_y, want_y, policy)
        assert np.all(np.asarray(got_y)[pad] == 0)
        assert_slots_equal(got, want, range(4), msg=policy)
        assert_bits(got.write_pos, want.write_pos)
        for name in ("checkpoint", *CACHES):
            assert_bits(getattr(got, name)[4:], getattr(dirty, name)[4:], f"{policy} {name}")


# ------------------------------------------------- point 2: a non-finite live input


@pytest.mark.parametrize("gate", ["gdn", "kda"])
def test_non_finite_live_input_reaches_only_its_row_and_slot(gate, backend, rng):
    """NaN or Inf in one field of one live row: every other row's y and every other slot
    (checkpoint, valid cache entries, cursor) are bit-identical to the step without it."""
    config = small_config(gate, 4)
    cursors = np.array([0, 1, 2, 3, 2, 0, 1, 3])
    model = random_model_state(rng, config, cursors)
    state = layer_state(model, 0)
    tokens, slots = _step_inputs(rng, config, [1, 2, 3, -1, 0, 4])
    force = jnp.asarray([False, False, False, False, True, False])
    bad_row, bad_slot = 1, 2  # a slot with cached entries that appends
    others = [r for r in range(len(slots)) if r != bad_row]
    for policy in ("natural", "every_step"):
        step = jax.jit(functools.partial(decode_step, backend=backend, policy=policy, use_qk_l2norm=True))
        want_y, want = step(state, tokens, slots, force)
        for field, value in [("q", np.nan), ("k", np.inf), ("v", -np.inf), ("g", np.nan), ("beta", np.inf)]:
            x = getattr(tokens, field)
            bad = tokens.replace(**{field: x.at[bad_row].set(x[bad_row].ravel().at[0].set(value).reshape(x.shape[1:]))})
            got_y, got = step(state, bad, slots, force)
            assert_bits(got_y[jnp.asarray(others)], want_y[jnp.asarray(others)], f"{policy} {field}")
            rest = [s for s in range(8) if s != bad_slot]
            assert_slots_equal(got, want, rest, msg=f"{policy} {field}")
            assert_bits(got.write_pos, want.write_pos)


# ------------------------------------------------------ point 3: out-of-range reads


def test_out_of_range_sources_under_jit_read_zeros(rng):
    """Under jit (values unchecked) copy_slots from a slot >= N gives the destination zeros
    (checkpoint and conv state, cursor 0) and snapshot of a slot >= N returns zeros: never
    slot N-1's data."""
    config = small_config("gdn", 4)
    state = random_model_state(rng, config, np.array([0, 1, 2, 3, 0, 1, 2, 0]))
    copied = jax.jit(copy_slots)(state, jnp.asarray([NUM_SLOTS, 1], jnp.int32), jnp.asarray([0, 2], jnp.int32))
    np.testing.assert_array_equal(np.asarray(copied.checkpoint[:, 0]), 0.0)
    np.testing.assert_array_equal(np.asarray(copied.conv_state[:, 0]), 0.0)
    assert int(copied.write_pos[0]) == 0
    assert_bits(copied.conv_state[:, 2], state.conv_state[:, 1])
    snap = jax.jit(snapshot)(state, jnp.asarray([NUM_SLOTS + 2, 7, -1], jnp.int32))
    np.testing.assert_array_equal(np.asarray(snap.checkpoint[:, [0, 2]]), 0.0)
    np.testing.assert_array_equal(np.asarray(snap.conv_state[:, [0, 2]]), 0.0)
    assert_bits(snap.checkpoint[:, 1], state.checkpoint[:, 7])


README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def readme_api_names() -> list[tuple[str, str]]:
    """`(module, name)` for every name the README's API table lists: each code span's
    leading identifier in the first column (from `replayssm_jax`), and for a row naming a
    submodule (`replayssm_jax.x`) each code span's identifier in the second column."""
    table = re.search(r"## API\n(.*?)\n\n", README.read_text(), re.S).group(1)
    names = []
    for row in table.splitlines()[2:]:
        first, second = row.strip("|").split(" | ", 1)
        spans = re.findall(r"`([^`]*)`", first)
        module = spans[0] if spans and re.fullmatch(r"replayssm_jax(\.\w+)+", spans[0]) else None
        if module:
            names.append((module, ""))
            names += [(module, s) for s in re.findall(r"`([A-Za-z_]\w*)`", second)]
        else:
            names += [("replayssm_jax", re.match(r"[A-Za-z_]\w*", s).group(0)) for s in spans]
    return names


def test_every_name_in_the_readme_api_table_imports_from_where_it_says():
    names = readme_api_names()
    assert ("replayssm_jax.model", "reset_slots") in names and ("replayssm_jax", "decode_step") in names
    for module, name in names:
        mod = importlib.import_module(module)
        if name:
            assert hasattr(mod, name), f"README lists {name} in {module}, which has no such name"
