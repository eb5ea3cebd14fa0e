"""Isolation (issue 24, points 1-3): no value in a stale cache entry, an unused slot or a
padding row's inputs reaches an output or another slot; a non-finite input in one live row
reaches only that row and its slot; out-of-range reads under jit give zeros; the README's
names import from where it says. Covered: decode steps and slot operations for GDN, KDA and
Mamba-2, and speculative verify + accept (chain and tree windows, ragged lengths, folds)
for GDN and KDA on both backends and for Mamba-2 on xla (its only verify backend).

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
from replayssm_jax import ReplayConfig, Tokens, accept, decode_step, materialize_state, verify_step
from replayssm_jax.model import (
    copy_slots,
    flush_slots,
    init_model_state,
    layer_state,
    reset_slots,
    snapshot,
)
from replayssm_jax.model.state import ModelState, flat_view, from_flat_view
from test_mamba2 import config as mamba2_config
from test_mamba2 import random_params as mamba2_params
from test_mamba2 import random_tokens as mamba2_tokens

CACHES = ("u_cache", "k_cache", "g_cache")
FIELDS = ("checkpoint", *CACHES, "conv_state", "write_pos")
POISON = np.asarray([np.nan, np.inf, -np.inf], np.float32)
NUM_LAYERS, NUM_SLOTS, CONV = 2, 8, 6
NUM_SLOTS_MINIMAL = 3  # the issue's case
GATES = ("gdn", "kda", "mamba2")


def layer_config(gate: str, cache_len: int) -> ReplayConfig:
    """The delta-rule gates' GQA test config, or Mamba-2's (H = 4, P = 16, N = 32, G = 2)."""
    return mamba2_config(cache_len) if gate == "mamba2" else small_config(gate, cache_len)


def random_model_state(rng, config: ReplayConfig, cursors) -> ModelState:
    """Finite random checkpoints, caches, conv states and the given cursors (any finite
    cache content is a valid history: the caches are just the last tokens' u, k, g, or for
    Mamba-2 x, B and dt, which is positive after its softplus)."""
    state = init_model_state(config, NUM_LAYERS, NUM_SLOTS, CONV)
    normal = lambda x: jnp.asarray(0.3 * rng.normal(size=x.shape), x.dtype)
    shape = state.g_cache.shape
    g = rng.uniform(0.01, 0.5, shape) if config.gate_kind.additive else random_log_decay(rng, shape)
    return dataclasses.replace(
        state,
        checkpoint=normal(state.checkpoint), u_cache=normal(state.u_cache),
        k_cache=normal(state.k_cache), conv_state=normal(state.conv_state),
        g_cache=jnp.asarray(g, jnp.float32), write_pos=jnp.asarray(cursors, jnp.int32),
    )


def random_inputs(rng, config: ReplayConfig, lead: tuple[int, ...]):
    """Finite step inputs (`lead = (B,)`) or draft windows (`(B, T)`) for the config's gate:
    `Tokens`, or `Mamba2Tokens` with the z gate (so z is covered too)."""
    if config.gate_kind.additive:
        return jax.tree.map(jnp.asarray, mamba2_tokens(rng, config, lead, with_z=True))
    return to_device(random_tokens(rng, config, lead))


def gate_options(rng, config: ReplayConfig, num_layers: int | None = None) -> dict:
    """The step's keyword options: the q/k L2 norm for the delta rule; for Mamba-2 random
    `Mamba2Params` (stacked over `num_layers` layers, as the slot operations take them)."""
    if not config.gate_kind.additive:
        return {"use_qk_l2norm": True} if num_layers is None else {}
    if num_layers is None:
        return {"gate_params": mamba2_params(rng)}
    return {"gate_params": jax.tree.map(lambda *a: jnp.stack(a), *[mamba2_params(rng) for _ in range(num_layers)])}


def layer_options(options: dict, layer: int) -> dict:
    """Layer `layer`'s slice of `gate_options(..., num_layers)` (for `materialize_state`)."""
    return {name: jax.tree.map(lambda a: a[layer], value) for name, value in options.items()}


def fields_of(tokens) -> list[str]:
    """The input fields a step or window carries (z only when given)."""
    return [f.name for f in dataclasses.fields(tokens) if getattr(tokens, f.name) is not None]


def poison_where(mask: np.ndarray, tokens):
    """`tokens` with NaN, +Inf, -Inf in every element of every field where `mask` (over the
    leading axes: `[B]` rows or `[B, T]` window positions) holds."""
    def one(x):
        m = mask.reshape(*mask.shape, *([1] * (x.ndim - mask.ndim)))
        return jnp.where(m, jnp.asarray(np.resize(POISON, x.shape)), x)
    return jax.tree.map(one, tokens)


def plant(tokens, field: str, index: tuple, value: float):
    """`tokens` with `value` in the first element of `field[index]` (index over the leading axes)."""
    x = getattr(tokens, field)
    row = x[index]
    return tokens.replace(**{field: x.at[index].set(row.ravel().at[0].set(value).reshape(row.shape))})


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


def assert_untouched(got, before, unused, msg=""):
    """Every field of the `unused` slots of `got` is bit for bit as in `before`."""
    axis = 1 if isinstance(before, ModelState) else 0
    for field in FIELDS:
        if hasattr(before, field):
            at = 0 if field == "write_pos" else axis
            assert_bits(np.take(np.asarray(getattr(got, field)), unused, axis=at),
                        np.take(np.asarray(getattr(before, field)), unused, axis=at), f"{msg} {field}")


def assert_slots_equal(got, want, slots, fields=FIELDS, msg="", entries=None):
    """The named slots of two states agree bit for bit: checkpoint, conv, cursor, and the
    cache entries valid in `want` (or the first `entries[s]` of slot s, e.g. a verified
    window's records, which lie past the cursor until `accept`)."""
    axis = 1 if isinstance(want, ModelState) else 0
    entries = np.asarray(want.write_pos) if entries is None else np.asarray(entries)
    for name in fields:
        if not hasattr(want, name):
            continue
        g, w = np.asarray(getattr(got, name)), np.asarray(getattr(want, name))
        for s in slots:
            at = 0 if name == "write_pos" else axis
            gs, ws = np.take(g, s, axis=at), np.take(w, s, axis=at)
            if name in CACHES:
                n = int(entries[s])
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


@pytest.mark.parametrize("gate", GATES)
def test_slot_ops_never_read_stale_entries_or_unused_slots(gate, rng):
    """materialize_state, flush_slots, copy_slots, snapshot + reset (restore) and reset on a
    state whose stale entries hold NaN/Inf and whose unused slots are NaN/Inf throughout:
    the named slots come out bit-identical to the same op on clean memory and the unused
    slots are left exactly as they were. (Mamba-2: the ops that replay take its A.)"""
    config = layer_config(gate, 4)
    cursors = np.array([0, 1, 2, 3, 0, 2, 1, 3])
    clean = random_model_state(rng, config, cursors)
    options = gate_options(rng, config, NUM_LAYERS)
    unused = [6, 7]
    dirty = poisoned(clean, unused)
    live = jnp.asarray([3, 0, -1, 2, 1], jnp.int32)  # every cursor, a padding entry
    named = [3, 0, 2, 1]

    for layer in range(NUM_LAYERS):
        materialize = functools.partial(materialize_state, **layer_options(options, layer))
        assert_bits(materialize(layer_state(dirty, layer), live),
                    materialize(layer_state(clean, layer), live), f"materialize layer {layer}")

    restore = lambda s, snap: reset_slots(s, jnp.asarray([5, 1], jnp.int32), snap.checkpoint, snap.conv_state)
    src, dst = jnp.asarray([3, 1, -1, 2], jnp.int32), jnp.asarray([4, 5, -1, 0], jnp.int32)
    flushed = jnp.asarray([0, 4], jnp.int32)  # cursor 0: snapshot needs a flushed slot
    ops = {
        "flush_slots": (lambda s: flush_slots(s, live, **options), named),
        "copy_slots": (lambda s: copy_slots(s, src, dst, **options), [4, 5, 0, 3, 1, 2]),
        "reset_slots": (lambda s: reset_slots(s, live), named),
        "snapshot+restore": (lambda s: restore(s, snapshot(s, flushed)), [5, 1, 0, 4]),
    }
    for name, (op, touched) in ops.items():
        got, want = jax.jit(op)(dirty), jax.jit(op)(clean)
        assert_slots_equal(got, want, touched, msg=name)
        assert_untouched(got, dirty, unused, name)
    snap_dirty, snap_clean = snapshot(dirty, flushed), snapshot(clean, flushed)
    assert_bits(snap_dirty.checkpoint, snap_clean.checkpoint)
    assert_bits(snap_dirty.conv_state, snap_clean.conv_state)


@pytest.mark.parametrize("gate", GATES)
def test_step_never_reads_unused_slots_or_padding_inputs(gate, backend, rng):
    """A step with NaN/Inf in stale entries, in every element of the unused slots and in
    every input of the padding rows (every field: q, k, v, g, beta; Mamba-2 x, B, C, dt, z):
    y, the used slots and the cursors bit-identical to the step on clean memory with finite
    padding inputs; the unused slots untouched. Both policies, forced flushes included."""
    config = layer_config(gate, 4)
    clean = layer_state(random_model_state(rng, config, np.array([0, 1, 2, 3, 1, 0, 2, 3])), 0)
    unused = [4, 5, 6, 7]
    dirty = poisoned(clean, unused)
    slots = np.array([2, -1, 0, 3, -5, 1, NUM_SLOTS + 1])  # every cursor; padding rows: negative and >= N
    pad = (slots < 0) | (slots >= NUM_SLOTS)
    tokens = random_inputs(rng, config, (len(slots),))
    dirty_tokens = poison_where(pad, tokens)
    options = gate_options(rng, config)
    force = jnp.asarray([False, True, True, False, True, False, True])
    for policy in ("natural", "every_step"):
        step = jax.jit(functools.partial(decode_step, backend=backend, policy=policy, **options))
        want_y, want = step(clean, tokens, jnp.asarray(slots, jnp.int32), force)
        got_y, got = step(dirty, dirty_tokens, jnp.asarray(slots, jnp.int32), force)
        assert_bits(got_y, want_y, policy)
        assert np.all(np.asarray(got_y)[pad] == 0)
        assert_slots_equal(got, want, range(4), msg=policy)
        assert_bits(got.write_pos, want.write_pos)
        assert_untouched(got, dirty, unused, policy)


# ------------------------------------------------- point 2: a non-finite live input


@pytest.mark.parametrize("gate", GATES)
def test_non_finite_live_input_reaches_only_its_row_and_slot(gate, backend, rng):
    """NaN or Inf in one field of one live row: every other row's y and every other slot
    (checkpoint, valid cache entries, cursor) are bit-identical to the step without it."""
    config = layer_config(gate, 4)
    cursors = np.array([0, 1, 2, 3, 2, 0, 1, 3])
    model = random_model_state(rng, config, cursors)
    state = layer_state(model, 0)
    slots = jnp.asarray([1, 2, 3, -1, 0, 4], jnp.int32)
    tokens = random_inputs(rng, config, (len(slots),))
    options = gate_options(rng, config)
    force = jnp.asarray([False, False, False, False, True, False])
    bad_row, bad_slot = 1, 2  # a slot with cached entries that appends
    others = jnp.asarray([r for r in range(len(slots)) if r != bad_row])
    rest = [s for s in range(NUM_SLOTS) if s != bad_slot]
    for policy in ("natural", "every_step"):
        step = jax.jit(functools.partial(decode_step, backend=backend, policy=policy, **options))
        want_y, want = step(state, tokens, slots, force)
        for i, field in enumerate(fields_of(tokens)):
            got_y, got = step(state, plant(tokens, field, (bad_row,), POISON[i % 3]), slots, force)
            msg = f"{policy} {field}"
            assert not np.all(np.isfinite(np.asarray(got_y[bad_row]))), f"{msg}: the planted value never arrived"
            assert_bits(got_y[others], want_y[others], msg)
            assert_slots_equal(got, want, rest, msg=msg)
            assert_bits(got.write_pos, want.write_pos)


# ------------------------------------- speculative verify + accept (points 1 and 2)

VERIFY_CASES = [("gdn", "xla"), ("gdn", "pallas_triton"), ("kda", "xla"), ("kda", "pallas_triton"),
                ("mamba2", "xla")]  # Mamba-2 verifies on xla only
RING, WIDTH = 4, 3  # L, T
# Row r verifies a window of VERIFY_LENGTHS[r] positions on slot VERIFY_SLOTS[r] (cursor
# VERIFY_CURSORS[slot]) and accepts VERIFY_COUNTS[r] of them (every count 0..T occurs).
# Capacity rule: row 0 folds (2 + 3 > 4), and so does row 6 (a full ring: 4 + 2 > 4); row 3
# fills the ring exactly (3 + 1 = 4, no fold); row 7 is live with an empty window; rows 1
# and 4 are padding (slot -1 and slot >= N). Slots 6 and 7 are unused.
VERIFY_CURSORS = np.array([0, 1, 2, 3, 4, 2, 1, 3])
VERIFY_SLOTS = np.array([2, -1, 0, 3, NUM_SLOTS + 1, 1, 4, 5])
VERIFY_LENGTHS = np.array([3, 0, 3, 1, 0, 2, 2, 0])
VERIFY_COUNTS = np.array([0, 0, 3, 1, 0, 1, 2, 0])
VERIFY_UNUSED = [6, 7]
# Tree windows (parents[r, i] < i, -1: a child of the current state) and each row's accepted
# root-down path (entries past its count are ignored): row 5 keeps its second root child,
# row 6 the branch 0 -> 2.
VERIFY_PARENTS = np.array([[-1, 0, 0], [-1, 0, 1], [-1, 0, 1], [-1, -1, 0],
                           [-1, 0, 1], [-1, -1, 0], [-1, 0, 0], [-1, 0, 1]])
VERIFY_PATHS = np.array([[0, 1, 2], [0, 0, 0], [0, 1, 2], [0, 0, 0],
                         [0, 0, 0], [1, 0, 0], [0, 2, 0], [0, 0, 0]])


def verify_rows() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`(live [B], fold [B], base [B])` of the rows above by the capacity rule; `base` is
    where a row's records start (0 on a folding row, else its cursor)."""
    live = (VERIFY_SLOTS >= 0) & (VERIFY_SLOTS < NUM_SLOTS)
    cursor = VERIFY_CURSORS[np.where(live, VERIFY_SLOTS, 0)]
    fold = live & (cursor + VERIFY_LENGTHS > RING)
    np.testing.assert_array_equal(np.flatnonzero(fold), [0, 6])
    return live, fold, np.where(fold, 0, cursor)


def record_counts(live, base) -> np.ndarray:
    """`[N]`: the cache entries of each slot that are history or a verified record."""
    counts = np.zeros(NUM_SLOTS, int)
    counts[VERIFY_SLOTS[live]] = (base + VERIFY_LENGTHS)[live]
    return counts


def verify_setup(rng, gate: str, backend: str):
    """`(clean layer state, window [B, T], jitted verify, jitted live-state readout)`."""
    config = layer_config(gate, RING)
    state = layer_state(random_model_state(rng, config, VERIFY_CURSORS), 0)
    window = random_inputs(rng, config, (len(VERIFY_SLOTS), WIDTH))
    options = gate_options(rng, config)
    verify = jax.jit(functools.partial(verify_step, backend=backend, **options))
    materialize = jax.jit(functools.partial(materialize_state, gate_params=options.get("gate_params")))
    return state, window, verify, materialize


def int_rows(x: np.ndarray) -> jnp.ndarray:
    return jnp.asarray(x, jnp.int32)


@pytest.mark.parametrize("gate, backend", VERIFY_CASES)
def test_verify_and_accept_never_read_stale_entries_unused_slots_or_padding(gate, backend, rng):
    """verify_step, then accept, with NaN/Inf in every stale cache entry, in every element
    of the unused slots, in every input of the padding rows (their lengths, parents, counts
    and paths are garbage as well) and in every window position past a row's length: y,
    the records, the folded checkpoints and the cursors bit-identical to the same calls on
    clean memory with finite padding; after accept (counts 0..length, chain and tree) the
    used slots and their live states too; the unused slots untouched."""
    clean, window, verify, materialize = verify_setup(rng, gate, backend)
    dirty = poisoned(clean, VERIFY_UNUSED)
    live, _, base = verify_rows()
    in_window = live[:, None] & (np.arange(WIDTH)[None, :] < VERIFY_LENGTHS[:, None])
    dirty_window = poison_where(~in_window, window)
    past_count = np.arange(WIDTH)[None, :] >= VERIFY_COUNTS[:, None]

    def junk(x, value, where=~live):
        """`x` with `value` on the padding rows (or where `where` holds): garbage the
        dirty run passes where the clean one passes the real rows' values."""
        return np.where(where.reshape(*where.shape, *([1] * (x.ndim - where.ndim))), value, x)

    slots, used = int_rows(VERIFY_SLOTS), VERIFY_SLOTS[live]
    records = record_counts(live, base)
    accept_jit = jax.jit(accept)
    for tree in (False, True):
        parents, path = (VERIFY_PARENTS, VERIFY_PATHS) if tree else (None, None)
        clean_args = dict(lengths=int_rows(VERIFY_LENGTHS), parents=None if parents is None else int_rows(parents))
        dirty_args = dict(lengths=int_rows(junk(VERIFY_LENGTHS, WIDTH)),
                          parents=None if parents is None else int_rows(junk(parents, -1)))
        msg = "tree" if tree else "chain"
        want_y, want = verify(clean, window, slots, **clean_args)
        got_y, got = verify(dirty, dirty_window, slots, **dirty_args)
        assert_bits(got_y, want_y, f"{msg} y")
        assert np.all(np.asarray(got_y)[~in_window] == 0), f"{msg}: padding rows or positions output"
        assert_slots_equal(got, want, used, msg=f"{msg} verify", entries=records)
        assert_bits(got.write_pos, want.write_pos, f"{msg} verify cursors")
        assert_untouched(got, dirty, VERIFY_UNUSED, f"{msg} verify")

        clean_path = None if path is None else int_rows(path)
        dirty_path = None if path is None else int_rows(junk(junk(path, WIDTH - 1, past_count), WIDTH + 3))
        want_acc = accept_jit(want, slots, int_rows(VERIFY_COUNTS), path=clean_path)
        got_acc = accept_jit(got, slots, int_rows(junk(VERIFY_COUNTS, WIDTH)), path=dirty_path)
        np.testing.assert_array_equal(np.asarray(want_acc.write_pos)[used], (base + VERIFY_COUNTS)[live])
        assert_slots_equal(got_acc, want_acc, used, msg=f"{msg} accept")
        assert_bits(got_acc.write_pos, want_acc.write_pos, f"{msg} accept cursors")
        assert_untouched(got_acc, dirty, VERIFY_UNUSED, f"{msg} accept")
        assert_bits(materialize(got_acc, int_rows(used)), materialize(want_acc, int_rows(used)), f"{msg} live")


@pytest.mark.parametrize("gate, backend", VERIFY_CASES)
def test_verify_non_finite_window_input_reaches_only_its_row_and_slot(gate, backend, rng):
    """NaN or Inf in one field at the first position of one live row's window (a folding
    row and an appending row in turn): every other row's y and every other slot (checkpoint,
    history and records, cursor), after verify and after accept, bit-identical to the run
    without it."""
    state, window, verify, _ = verify_setup(rng, gate, backend)
    live, _, base = verify_rows()
    slots, lengths, counts = int_rows(VERIFY_SLOTS), int_rows(VERIFY_LENGTHS), int_rows(VERIFY_COUNTS)
    records = record_counts(live, base)
    accept_jit = jax.jit(accept)
    want_y, want = verify(state, window, slots, lengths=lengths)
    want_acc = accept_jit(want, slots, counts)
    for i, field in enumerate(fields_of(window)):
        bad_row = (0, 5)[i % 2]  # row 0 folds, row 5 appends
        others = jnp.asarray([r for r in range(len(VERIFY_SLOTS)) if r != bad_row])
        rest = [s for s in range(NUM_SLOTS) if s != VERIFY_SLOTS[bad_row]]
        got_y, got = verify(state, plant(window, field, (bad_row, 0), POISON[i % 3]), slots, lengths=lengths)
        msg = f"{field} in row {bad_row}"
        assert not np.all(np.isfinite(np.asarray(got_y[bad_row]))), f"{msg}: the planted value never arrived"
        assert_bits(got_y[others], want_y[others], msg)
        assert_slots_equal(got, want, rest, msg=f"{msg} verify", entries=records)
        assert_bits(got.write_pos, want.write_pos, f"{msg} verify cursors")
        got_acc = accept_jit(got, slots, counts)
        assert_slots_equal(got_acc, want_acc, rest, msg=f"{msg} accept")
        assert_bits(got_acc.write_pos, want_acc.write_pos, f"{msg} accept cursors")


# ------------------------------------------------------ point 3: out-of-range reads


@pytest.mark.parametrize("gate", ["gdn", "mamba2"])
def test_out_of_range_sources_under_jit_read_zeros(gate, rng):
    """Under jit (values unchecked) copy_slots from a slot >= N gives the destination zeros
    (checkpoint and conv state, cursor 0) and snapshot of a slot >= N returns zeros: never
    slot N-1's data."""
    config = layer_config(gate, 4)
    state = random_model_state(rng, config, np.array([0, 1, 2, 3, 0, 1, 2, 0]))
    options = gate_options(rng, config, NUM_LAYERS)
    copy = jax.jit(lambda s, src, dst: copy_slots(s, src, dst, **options))
    copied = copy(state, jnp.asarray([NUM_SLOTS, 1], jnp.int32), jnp.asarray([0, 2], jnp.int32))
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
