"""`decode_step` / `materialize_state` against the plain recurrence, step semantics,
compilation and donation, and input validation. Every decode test runs per `backend`."""

from __future__ import annotations

import dataclasses
import functools
import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import (
    STATE_FIELDS,
    aliased_parameters,
    bits,
    donated_step,
    make_schedule,
    random_checkpoint,
    random_tokens,
    rel_err,
    run_schedule,
    small_config,
    snapshot,
    state_sized_copies,
    take,
    to_device,
)
from pallas_kernels.replay_decode import ReplayTileParams
from replayssm_jax import (
    FlushPolicy,
    ReplayConfig,
    decode_step,
    default_flush_policy,
    init_state,
    materialize_state,
    plan_step,
    recurrent_reference,
)

# fp32: the bound. Replay only reorders fp32 sums (products of decays in log space,
# the rebuild as one contraction); measured worst normwise error over these runs is < 5e-7,
# so 1e-5 leaves 20x margin while an off-by-one decay or a stale cache entry is O(1e-1).
FP32_TOL = 1e-5
# bf16 state and caches: the checkpoint is rounded once per window and every cached u and k
# once, each a relative error of at most the unit roundoff u = 2^-8. The live state is
# checkpoint (<= u) plus replayed terms (u and k rounded: <= 2u each); errors of earlier
# windows are contracted by the recurrence (alpha < 1, ||I - beta k k^T|| <= 1 with
# l2-normalised keys), so the state and y = S q stay within a few u. Measured worst: 1.5u for
# y, 0.9u for the state; 4u = 2^-6 gives 2.7x margin and still fails on any algebra error.
BF16_TOL = 4 * 2.0**-8
TOLERANCE = {"fp32": FP32_TOL, "bf16": BF16_TOL}
DTYPES = {"fp32": jnp.float32, "bf16": jnp.bfloat16}
# BATCH = 9: the default flush policy replays (NATURAL) from batch 6 for GDN with a 4-byte
# state and from 9 for 2-byte states, and folds every step (EVERY_STEP) below; KDA with a
# 4-byte state folds at every batch (test_default_flush_policy_by_gate_dtype_and_batch).
NUM_SLOTS, BATCH, NUM_SEQS = 12, 9, 3


def run_random_schedule(rng, config, backend, *, steps, force_prob=0.2, **kwargs):
    """A random run (joins within the first L steps, shuffled rows, forced flushes)."""
    schedule = make_schedule(
        rng, num_seqs=NUM_SEQS, batch=BATCH, num_slots=NUM_SLOTS, steps=steps,
        max_join=config.cache_len, force_prob=force_prob,
    )
    tokens = kwargs.pop("tokens", None) or random_tokens(rng, config, (NUM_SEQS, steps))
    checkpoint0 = random_checkpoint(rng, config, NUM_SLOTS)
    return run_schedule(config, schedule, tokens, checkpoint0, rng, backend=backend, **kwargs)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("cache_len", [1, 2, 4, 16])
@pytest.mark.parametrize("gate", ["gdn", "kda"])
def test_replay_matches_reference_every_step(gate, cache_len, dtype, backend, rng):
    """Outputs, flushed checkpoints and live states equal the scan at every step, with
    padding rows, shuffled rows on a larger slot pool, staggered joins and forced flushes
    (the exact invariants are asserted inside `run_schedule`)."""
    config = small_config(gate, cache_len, DTYPES[dtype])
    # Joins happen by step L, so every sequence decodes >= 3L + 2 tokens.
    report = run_random_schedule(rng, config, backend, steps=max(4 * cache_len + 2, 8))
    tol = TOLERANCE[dtype]
    assert report.y_err <= tol, report
    assert report.state_err <= tol, report
    assert report.checkpoint_err <= tol, report
    # The default policy flushes every live row at every step for KDA with a 4-byte state,
    # on every backend (test_kda_replay_kernel_matches_reference_every_step replays it).
    folds = gate == "kda" and dtype == "fp32"
    assert report.flush_every_step == folds, report
    if folds and cache_len > 1:  # (at L = 1 every flush is natural)
        assert report.natural_flushes == 0, report
        return
    assert report.natural_flushes > 0, report
    if cache_len >= 4:  # with L <= 2 a forced flush that is not also natural is rare
        assert report.forced_flushes > 0, report


@pytest.mark.parametrize("cache_len", [2, 13])
def test_kda_replay_kernel_matches_reference_every_step(cache_len, backend, rng):
    """KDA with a 4-byte state under the NATURAL policy (the default folds it every step):
    the xla backend's replay and, on pallas_triton, the launch table's replay kernel (the
    grouped one) and the per-tile kernel walking the cache in chunks, under the same
    invariants as above."""
    config = small_config("kda", cache_len)
    kernels = (None, ReplayTileParams(block_v=8, num_warps=1, cache_chunk=4, rebuild_unroll=3))
    for kernel_params in kernels if backend == "pallas_triton" else (None,):
        report = run_random_schedule(rng, config, backend, steps=4 * cache_len + 2, policy="natural",
                                     kernel_params=kernel_params)
        assert not report.flush_every_step, report
        assert max(report.y_err, report.state_err, report.checkpoint_err) <= FP32_TOL, report
        assert report.natural_flushes > 0 and report.forced_flushes > 0, report


def test_l2norm_off_and_custom_scale(backend, rng):
    """`use_qk_l2norm=False` and an explicit `scale` reach the recurrence unchanged."""
    config = small_config("kda", 4)
    tokens = random_tokens(rng, config, (NUM_SEQS, 14))
    # Unit-norm keys keep the un-normalised delta rule stable (beta ||k||^2 < 2).
    k = tokens.k / np.linalg.norm(tokens.k, axis=-1, keepdims=True)
    tokens = tokens.replace(k=k.astype(np.float32))
    report = run_random_schedule(
        rng, config, backend, steps=14, tokens=tokens, use_qk_l2norm=False, scale=0.7
    )
    assert max(report.y_err, report.state_err, report.checkpoint_err) <= FP32_TOL, report


@pytest.mark.parametrize("gate", ["gdn", "kda"])
def test_cache_len_one_is_plain_recurrence(gate, backend, rng):
    """L = 1 flushes every row every step: the checkpoint is the recurrent state after each
    token and the cursor never leaves 0."""
    config, steps = small_config(gate, 1), 6
    slots = rng.choice(NUM_SLOTS, BATCH, replace=False)
    tokens = random_tokens(rng, config, (BATCH, steps))
    checkpoint0 = random_checkpoint(rng, config, NUM_SLOTS)
    ref_y, _, ref_states = recurrent_reference(
        to_device(tokens), jnp.asarray(checkpoint0[slots]), use_qk_l2norm=True, return_all_states=True,
    )
    step = donated_step(backend, use_qk_l2norm=True)
    state = init_state(config, NUM_SLOTS, jnp.asarray(checkpoint0))
    for t in range(steps):
        inputs = to_device(take(tokens, (slice(None), t)))
        y, state = step(state, inputs, jnp.asarray(slots, jnp.int32))
        assert rel_err(y, ref_y[:, t]).max() <= FP32_TOL
        assert rel_err(state.checkpoint[slots], ref_states[:, t]).max() <= FP32_TOL
        np.testing.assert_array_equal(state.write_pos, 0)


@pytest.mark.parametrize("gate", ["gdn", "kda"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_default_flush_policy_by_gate_dtype_and_batch(gate, dtype):
    """EVERY_STEP where it measured faster on the H200 than the replay cycle (GDN with a
    4-byte state up to batch 5, any 2-byte state up to batch 8, KDA with a 4-byte state at
    every batch), NATURAL elsewhere; L plays no part (L = 1 runs the plain kernel anyway)."""
    itemsize = jnp.dtype(dtype).itemsize
    for cache_len in (1, 4, 32):
        config = ReplayConfig(2, 4, 32, 16, cache_len, gate=gate, state_dtype=dtype)
        for batch in (1, 2, 5, 6, 8, 9, 16, 64, 512, 1 << 20):
            if itemsize == 4:
                every = gate == "kda" or batch <= 5
            else:
                every = batch <= 8
            want = FlushPolicy.EVERY_STEP if every else FlushPolicy.NATURAL
            assert default_flush_policy(config, batch) is want, (cache_len, batch)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_default_flush_policy_for_mamba2(dtype):
    """Mamba-2 folds every step where its replay cycle measured slower than the plain kernel
    on the H200 (plan.py cites the results): up to batch 16 with a 4-byte state, at every
    batch with a 2-byte one; L plays no part."""
    itemsize = jnp.dtype(dtype).itemsize
    for cache_len in (1, 4, 32):
        config = ReplayConfig.mamba2(4, 16, 32, 2, cache_len, state_dtype=dtype)
        for batch in (1, 8, 16, 17, 64, 512, 1 << 20):
            every = itemsize == 2 or batch <= 16
            want = FlushPolicy.EVERY_STEP if every else FlushPolicy.NATURAL
            assert default_flush_policy(config, batch) is want, (cache_len, batch)


@pytest.mark.parametrize("gate", ["gdn", "kda"])
def test_default_policy_flushes_every_step_at_small_batch(gate, backend, rng):
    """At batch 4 (one padding row) the default policy (policy=None) flushes every live row
    on every backend: the first such step folds the row's cached entries (from two NATURAL
    steps before) into the checkpoint, then every step writes the recurrent state, the
    cursor stays 0 and the caches are not written; outputs and checkpoints equal the
    reference, the padding row outputs 0."""
    config, steps, warm, batch = small_config(gate, 4), 5, 2, 4
    assert default_flush_policy(config, batch) is FlushPolicy.EVERY_STEP
    slots = rng.choice(NUM_SLOTS, batch, replace=False)
    slots[rng.integers(batch)] = -1
    live = slots >= 0
    tokens = random_tokens(rng, config, (batch, warm + steps))
    checkpoint0 = random_checkpoint(rng, config, NUM_SLOTS)
    ref_y, _, ref_states = recurrent_reference(
        to_device(take(tokens, live)), jnp.asarray(checkpoint0[slots[live]]), use_qk_l2norm=True,
        return_all_states=True,
    )
    replaying = donated_step(backend, use_qk_l2norm=True, policy="natural")
    default = donated_step(backend, use_qk_l2norm=True)
    state = init_state(config, NUM_SLOTS, jnp.asarray(checkpoint0))
    for t in range(warm + steps):
        inputs = to_device(take(tokens, (slice(None), t)))
        caches = snapshot(state)
        y, state = (replaying if t < warm else default)(state, inputs, jnp.asarray(slots, jnp.int32))
        assert rel_err(y[live], ref_y[:, t]).max() <= FP32_TOL
        np.testing.assert_array_equal(np.asarray(y[~live]), 0.0)
        if t < warm:  # replay: the checkpoint waits, the cursor advances
            np.testing.assert_array_equal(state.write_pos[slots[live]], t + 1)
            continue
        assert rel_err(state.checkpoint[slots[live]], ref_states[:, t]).max() <= FP32_TOL
        np.testing.assert_array_equal(state.write_pos, 0)
        for name in ("u_cache", "k_cache", "g_cache"):
            np.testing.assert_array_equal(bits(np.asarray(getattr(state, name))), bits(caches[name]))


def test_plan_step_flushes_every_live_row_only_under_every_step():
    """`plan_step`: EVERY_STEP flushes every live row (padding rows never flush), NATURAL
    flushes at cursor L-1 or where forced; the plan records its policy, and the policy can
    be given by value."""
    write_pos = jnp.asarray([0, 1, 2, 3, 0, 1, 2, 3], jnp.int32)
    natural = lambda slots: np.asarray([s >= 0 and int(write_pos[s]) == 3 for s in slots])
    for slots in ([5, -1], [1, 3, 6, 2, 0], [0, 1, 3, 5, -1, 6, 7]):
        slots_arr = jnp.asarray(slots, jnp.int32)
        for policy in (FlushPolicy.EVERY_STEP, "every_step"):
            plan = plan_step(write_pos, slots_arr, None, 4, policy)
            assert plan.policy is FlushPolicy.EVERY_STEP and plan.batch == len(slots)
            np.testing.assert_array_equal(plan.flush, np.asarray(slots) >= 0)
        for policy in (FlushPolicy.NATURAL, "natural"):
            plan = plan_step(write_pos, slots_arr, None, 4, policy)
            assert plan.policy is FlushPolicy.NATURAL
            np.testing.assert_array_equal(plan.flush, natural(slots))
        np.testing.assert_array_equal(plan_step(write_pos, slots_arr, None, 4).flush, natural(slots))
    force = jnp.asarray([True, True, False])
    plan = plan_step(write_pos, jnp.asarray([0, -1, 3], jnp.int32), force, 4)
    np.testing.assert_array_equal(plan.flush, [True, False, True])  # forced, padding, natural
    with pytest.raises(ValueError, match=r"policy must be a FlushPolicy or one of \('natural', 'every_step'\)"):
        plan_step(write_pos, jnp.asarray([0], jnp.int32), None, 4, "sometimes")


def test_launch_order_puts_costliest_rows_first(rng):
    """`StepPlan.launch_order`: flushing rows, then appending rows, each by descending
    cursor, then padding rows; ties keep row order. Against a sort written out here."""
    cache_len, num_slots = 6, 40
    for batch in (1, 7, 33):
        write_pos = jnp.asarray(rng.integers(0, cache_len, num_slots), jnp.int32)
        slots = rng.permutation(num_slots)[:batch].astype(np.int32)
        slots[rng.random(batch) < 0.2] = -1
        force = rng.random(batch) < 0.2
        for policy in FlushPolicy:
            plan = plan_step(write_pos, jnp.asarray(slots), jnp.asarray(force), cache_len, policy)
            pos = np.asarray(write_pos)[np.maximum(slots, 0)]
            every = policy is FlushPolicy.EVERY_STEP
            flush = (slots >= 0) & ((pos == cache_len - 1) | force | every)

            def rank(row):
                if slots[row] < 0:
                    return (2, 0, row)
                return (0 if flush[row] else 1, -pos[row], row)

            np.testing.assert_array_equal(plan.launch_order, sorted(range(batch), key=rank))
            assert plan.launch_order.dtype == jnp.int32


def _one_step_inputs(rng, config, slots, force=None):
    """`(tokens, slots, force_flush)` of one step."""
    tokens = to_device(random_tokens(rng, config, (len(slots),)))
    force = None if force is None else jnp.asarray(force)
    return tokens, jnp.asarray(slots, jnp.int32), force


def test_padding_rows_are_isolated(backend, rng):
    """NaN inputs on padding rows (negative slots, forced flush set) give y exactly 0, write
    nothing, and do not change the other rows' results."""
    config = small_config("gdn", 4)
    state = init_state(config, NUM_SLOTS, jnp.asarray(random_checkpoint(rng, config, NUM_SLOTS)))
    # The NATURAL policy for the 2-row and the 4-row call (the default flushes every step
    # at batch <= 5, which would keep the cursors at 0).
    step = donated_step(backend, use_qk_l2norm=True, policy="natural")
    state, _ = _warm_up(step, state, rng, config, steps=2)  # nonzero cursors and caches
    live = np.array([5, 1])
    tokens, _, _ = _one_step_inputs(rng, config, live)
    pad = lambda x: jnp.concatenate([x[:1], jnp.full_like(x[:2], jnp.nan), x[1:]])
    padded = jax.tree.map(pad, tokens)
    slots = jnp.asarray([5, -1, -7, 1], jnp.int32)
    force = jnp.asarray([False, True, True, False])

    want_y, want_state = step(jax.tree.map(jnp.copy, state), tokens, jnp.asarray(live, jnp.int32))
    before = snapshot(state)
    y, state = step(state, padded, slots, force)
    after = snapshot(state)
    np.testing.assert_array_equal(np.asarray(y[1:3]), 0.0)
    # The 4-row and the 2-row call are separate fp32 programs (other batch shapes): their
    # sums may differ in the last bits, so the live rows agree within a few ulps.
    chex.assert_trees_all_close((y[jnp.array([0, 3])], after), (want_y, snapshot(want_state)),
                                rtol=1e-6, atol=1e-7)
    others = np.setdiff1d(np.arange(NUM_SLOTS), live)
    for name in STATE_FIELDS:
        np.testing.assert_array_equal(bits(after[name][others]), bits(before[name][others]))


@pytest.mark.parametrize("gate", ["gdn", "kda"])
def test_stale_cache_entries_never_reach_the_step(gate, backend, rng):
    """Entries at positions >= write_pos are stale and not zeroed (a reused slot keeps its
    last occupant's): NaN, +Inf and -Inf planted there in u_cache, k_cache and g_cache give
    bit for bit the step of clean caches (y, checkpoint, cursors, and every cache entry
    valid after the step), under both policies: natural rows that append, flush at L-1 and
    are forced to flush, and fold-every-step rows."""
    config = small_config(gate, 4)
    state = init_state(config, NUM_SLOTS, jnp.asarray(random_checkpoint(rng, config, NUM_SLOTS)))
    cursors = np.arange(NUM_SLOTS) % config.cache_len  # cursors 0 .. L-1, cleanly made:
    for t in range(config.cache_len - 1):  # slot s gets s % L entries
        live = np.where(cursors > t, np.arange(NUM_SLOTS), -1)
        _, state = decode_step(state, *_one_step_inputs(rng, config, live), policy="natural")
    np.testing.assert_array_equal(state.write_pos, cursors)
    stale = np.arange(config.cache_len)[None, :] >= cursors[:, None]  # [N, L]
    poison = np.resize(np.asarray([np.nan, np.inf, -np.inf], np.float32), stale.shape)

    def plant(cache):
        mask = stale.reshape(*stale.shape[:1], 1, stale.shape[1], *([1] * (cache.ndim - 3)))
        poisoned = np.broadcast_to(poison.reshape(mask.shape), mask.shape)
        return jnp.asarray(np.where(mask, poisoned, np.asarray(cache)), cache.dtype)

    dirty = dataclasses.replace(state, u_cache=plant(state.u_cache), k_cache=plant(state.k_cache),
                                g_cache=plant(state.g_cache))
    assert all(np.isnan(np.asarray(getattr(dirty, name))).any() for name in ("u_cache", "k_cache", "g_cache"))
    # Rows: a slot at every cursor, others at random, a padding row; forced flushes at
    # cursors 1 and 2 (and on the padding row, where they are ignored).
    first = [rng.choice(np.flatnonzero(cursors == c)) for c in range(config.cache_len)]
    others = rng.permutation(np.setdiff1d(np.arange(NUM_SLOTS), first))[: BATCH - config.cache_len - 1]
    slots = rng.permutation(np.concatenate([first, others, [-1]]))
    force = (slots < 0) | np.isin(cursors[np.maximum(slots, 0)], [1, 2])
    tokens, slots, force = _one_step_inputs(rng, config, slots, force)
    for policy in ("natural", "every_step"):
        step = jax.jit(functools.partial(decode_step, backend=backend, policy=policy, use_qk_l2norm=True))
        want_y, want = step(state, tokens, slots, force)
        got_y, got = step(dirty, tokens, slots, force)
        np.testing.assert_array_equal(bits(np.asarray(got_y)), bits(np.asarray(want_y)))
        for name in ("checkpoint", "write_pos"):
            np.testing.assert_array_equal(bits(np.asarray(getattr(got, name))),
                                          bits(np.asarray(getattr(want, name))), err_msg=name)
        valid = np.arange(config.cache_len)[None, :] < np.asarray(want.write_pos)[:, None]
        for name in ("u_cache", "k_cache", "g_cache"):
            g, w = np.asarray(getattr(got, name)), np.asarray(getattr(want, name))
            for slot in range(NUM_SLOTS):
                np.testing.assert_array_equal(bits(g[slot][:, valid[slot]]), bits(w[slot][:, valid[slot]]),
                                              err_msg=f"{name} slot {slot} ({policy})")
        assert np.all(np.isfinite(np.asarray(got_y))) and np.all(np.isfinite(np.asarray(got.checkpoint)))


def _warm_up(step, state, rng, config, *, steps):
    """A few steps on every slot so cursors and caches are not trivial."""
    slots = np.arange(NUM_SLOTS)
    for _ in range(steps):
        y, state = step(state, *_one_step_inputs(rng, config, slots))
    return state, y


def test_out_of_range_slot_under_jit_is_padding(backend, rng):
    """Under jit slot values cannot be validated; a slot >= N then acts as a padding row."""
    config = small_config("kda", 4)
    step = donated_step(backend, use_qk_l2norm=True)
    state = init_state(config, NUM_SLOTS, jnp.asarray(random_checkpoint(rng, config, NUM_SLOTS)))
    before = snapshot(state)
    y, state = step(state, *_one_step_inputs(rng, config, [NUM_SLOTS, 2, NUM_SLOTS + 3]))
    after = snapshot(state)
    np.testing.assert_array_equal(np.asarray(y[jnp.array([0, 2])]), 0.0)
    assert np.all(np.asarray(y[1]) != 0)
    others = np.setdiff1d(np.arange(NUM_SLOTS), [2])
    for name in STATE_FIELDS:
        np.testing.assert_array_equal(bits(after[name][others]), bits(before[name][others]))


@pytest.mark.parametrize("gate", ["gdn", "kda"])
def test_materialize_state_padding_and_fresh_slots(gate, backend, rng):
    """A fresh slot's live state is its checkpoint; padding rows materialise as zeros."""
    config = small_config(gate, 4)
    checkpoint0 = random_checkpoint(rng, config, NUM_SLOTS)
    state = init_state(config, NUM_SLOTS, jnp.asarray(checkpoint0))
    live = materialize_state(state, jnp.asarray([3, -1, 0], jnp.int32))
    assert live.dtype == jnp.float32 and live.shape == (3, *checkpoint0.shape[1:])
    np.testing.assert_array_equal(live[0], checkpoint0[3])
    np.testing.assert_array_equal(live[1], 0.0)
    np.testing.assert_array_equal(live[2], checkpoint0[0])


def test_output_dtype_follows_v(backend, rng):
    """bf16 inputs give a bf16 y of shape [B, H_v, d_v]."""
    config = small_config("gdn", 4)
    state = init_state(config, NUM_SLOTS)
    tokens, slots, _ = _one_step_inputs(rng, config, [0, 4, 2])
    bf16 = lambda x: x.astype(jnp.bfloat16)
    tokens = tokens.replace(q=bf16(tokens.q), k=bf16(tokens.k), v=bf16(tokens.v))
    y, _ = decode_step(state, tokens, slots, backend=backend)
    assert y.dtype == jnp.bfloat16 and y.shape == (3, config.num_v_heads, config.head_v_dim)


def test_one_compilation_and_donated_state(backend, rng):
    """Changing cursors, flushes, slots, padding and forced flushes over many steps reuse a
    single trace/executable; the donated state buffers are consumed, aliased to the outputs,
    and never copied inside the step."""
    config = small_config("gdn", 4)
    traces = []

    def traced_step(state, *args):
        traces.append(1)  # Python side effect: runs once per trace
        return decode_step(state, *args, backend=backend, use_qk_l2norm=True)

    step = jax.jit(traced_step, donate_argnums=0)
    state = init_state(config, NUM_SLOTS)
    num_leaves = len(jax.tree.leaves(state))
    for _ in range(3 * config.cache_len + 1):
        slots = rng.choice(np.arange(-2, NUM_SLOTS), BATCH, replace=False)
        old = state
        _, state = step(state, *_one_step_inputs(rng, config, slots, rng.random(BATCH) < 0.3))
        assert all(leaf.is_deleted() for leaf in jax.tree.leaves(old)), "state was not donated"
    assert len(traces) == 1
    assert step._cache_size() == 1
    hlo = step.lower(state, *_one_step_inputs(rng, config, np.arange(BATCH), np.zeros(BATCH, bool)))
    hlo_text = hlo.compile().as_text()
    assert aliased_parameters(hlo_text) >= set(range(num_leaves))
    # Off-GPU the Pallas kernels run in interpret mode, an HLO emulation loop that copies its
    # operands by construction; there the no-copy property belongs to the real kernels.
    if backend == "xla" or jax.default_backend() == "gpu":
        assert not state_sized_copies(hlo_text, state), "the step copies a state buffer"


TOKEN_FIELDS = ("q", "k", "v", "g", "beta")


def _valid_inputs(rng, gate="gdn"):
    config = small_config(gate, 4)
    tokens, slots, force = _one_step_inputs(rng, config, [6, -1, 0, 3], [False] * 4)
    return init_state(config, NUM_SLOTS), dict(tokens=tokens, slots=slots, force_flush=force)


def _with(inputs, name, bad):
    """`inputs` with the token field or argument `name` replaced by `bad`."""
    if name in TOKEN_FIELDS:
        return {**inputs, "tokens": inputs["tokens"].replace(**{name: bad})}
    return {**inputs, name: bad}


def _shape_message(name, want, got):
    return re.escape(f"{name} must have shape {want}") + r".*" + re.escape(str(got))


@pytest.mark.parametrize(
    "name, bad, match",
    [
        ("q", np.zeros((4, 2, 31), np.float32), _shape_message("tokens.q", (4, 2, 32), (4, 2, 31))),
        ("q", np.zeros((4, 64), np.float32), r"tokens.q must be \[B, H_k, d_k\].*\(4, 64\)"),
        ("k", np.zeros((3, 2, 32), np.float32), _shape_message("tokens.k", (4, 2, 32), (3, 2, 32))),
        ("k", np.zeros((4, 4, 32), np.float32), _shape_message("tokens.k", (4, 2, 32), (4, 4, 32))),
        ("v", np.zeros((4, 2, 16), np.float32), _shape_message("tokens.v", (4, 4, 16), (4, 2, 16))),
        ("g", np.zeros((4, 4, 32), np.float32), _shape_message("tokens.g", (4, 4), (4, 4, 32))),
        ("beta", np.zeros((4, 4, 1), np.float32), _shape_message("tokens.beta", (4, 4), (4, 4, 1))),
        ("q", np.zeros((4, 2, 32), np.int32), r"tokens.q must be a floating array.*int32"),
        ("v", np.zeros((4, 4, 16), np.int32), r"tokens.v must be a floating array.*int32"),
        ("g", np.zeros((4, 4), np.int32), r"tokens.g must be a floating array.*int32"),
        ("beta", np.zeros((4, 4), bool), r"tokens.beta must be a floating array.*bool"),
        ("slots", np.zeros(3, np.int32), r"slots must have shape \(4,\).*\(3,\)"),
        ("slots", np.zeros((4, 1), np.int32), r"slots must have shape \(4,\).*\(4, 1\)"),
        ("slots", np.arange(4, dtype=np.float32), r"slots must be an integer array.*float32"),
        ("slots", np.array([0, 1, NUM_SLOTS, 2], np.int32), rf"slots holds slot {NUM_SLOTS}.*{NUM_SLOTS} slots"),
        ("slots", np.array([5, -1, 5, -1], np.int32), r"slots names a slot more than once"),
        ("force_flush", np.zeros(5, bool), _shape_message("force_flush", (4,), (5,))),
        ("force_flush", np.zeros(4, np.int32), r"force_flush must be bool.*int32"),
    ],
    ids=[
        "q-shape", "q-rank", "k-batch", "k-heads", "v-heads", "g-shape", "beta-shape",
        "q-dtype", "v-dtype", "g-dtype", "beta-dtype", "slots-length", "slots-rank",
        "slots-dtype", "slots-out-of-range", "slots-duplicate", "force_flush-length",
        "force_flush-dtype",
    ],
)
def test_decode_step_rejects_bad_input(name, bad, match, rng):
    state, inputs = _valid_inputs(rng)
    decode_step(state, **inputs)  # the valid inputs pass
    with pytest.raises(ValueError, match=match):
        decode_step(state, **_with(inputs, name, jnp.asarray(bad)))


def test_kda_gate_shape_is_checked(rng):
    state, inputs = _valid_inputs(rng, gate="kda")
    decode_step(state, **inputs)
    with pytest.raises(ValueError, match=_shape_message("tokens.g", (4, 4, 32), (4, 4))):
        decode_step(state, **_with(inputs, "g", jnp.zeros((4, 4))))


def test_bad_backend_and_state_are_rejected(rng):
    state, inputs = _valid_inputs(rng)
    for bad in ("cuda", "pallas"):  # "pallas" is now "pallas_triton"
        with pytest.raises(ValueError, match=rf"backend must be one of \('xla', 'pallas_triton', 'mosaic_gpu', 'auto'\), got '{bad}'"):
            decode_step(state, **inputs, backend=bad)
    with pytest.raises(ValueError, match=r"policy must be a FlushPolicy or one of"):
        decode_step(state, **inputs, policy="always")
    with pytest.raises(ValueError, match=r"tokens must be a Tokens, got tuple"):
        tok = inputs["tokens"]
        decode_step(state, (tok.q, tok.k, tok.v, tok.g, tok.beta), inputs["slots"])
    with pytest.raises(ValueError, match=r"state must be a ReplayState"):
        decode_step(state.checkpoint, **inputs)
    other = init_state(small_config("kda", 4), NUM_SLOTS)
    with pytest.raises(ValueError, match=_shape_message("state.g_cache", (NUM_SLOTS, 4, 4, 32), (NUM_SLOTS, 4, 4))):
        decode_step(type(state)(**{**vars(other), "g_cache": state.g_cache}), **inputs)


def test_materialize_state_rejects_bad_slots():
    state = init_state(small_config("gdn", 4), NUM_SLOTS)
    with pytest.raises(ValueError, match=r"slots must be a 1-D \[B\] array.*\(2, 2\)"):
        materialize_state(state, jnp.zeros((2, 2), jnp.int32))
    with pytest.raises(ValueError, match=rf"slots holds slot {NUM_SLOTS + 1}.*{NUM_SLOTS} slots"):
        materialize_state(state, jnp.asarray([NUM_SLOTS + 1, 0], jnp.int32))
    with pytest.raises(ValueError, match=r"slots names a slot more than once"):
        materialize_state(state, jnp.asarray([2, 2], jnp.int32))
