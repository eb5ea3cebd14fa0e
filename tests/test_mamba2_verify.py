"""Mamba-2 speculative verify (`verify_step`, `accept` with gate "mamba2") against sequential
`decode_step`, the scan reference (`mamba2_reference`) and the selective state update written
in numpy float64 (tests/test_mamba2.py).

Setup as in tests/test_speculative.py: a pool of slots with a random checkpoint and a random
history per slot (decoded with `decode_step`, so cursors differ per row), rows on shuffled
slots with a padding row, windows of T tokens. Capacity rule: a row folds when
write_pos + length > L.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import replayssm_jax as R
from helpers import aliased_parameters, bits, rel_err, snapshot, state_sized_copies
from test_mamba2 import HEAD_DIM, HEADS, STATE_SIZE, config, random_params, random_tokens, selective_state_update

# fp32: verify only reorders fp32 sums against sequential decode (one masked T x T sum in
# place of T replays); 1e-5 normwise leaves a wide margin over the ~1e-7 measured, while an
# off-by-one decay or a dropped window term is O(1e-1).
FP32_TOL = 1e-5
# bf16 state and caches: x and B are bf16-representable (random_tokens), so only the
# checkpoint is rounded, once per fold or flush (unit roundoff 2^-8); sequential decode
# flushes at other steps than verify folds, so the two see different roundings of a few u.
BF16_TOL = 4 * 2.0**-8
DTYPES = {"fp32": (jnp.float32, FP32_TOL), "bf16": (jnp.bfloat16, BF16_TOL)}
NUM_SLOTS, BATCH, T = 7, 5, 3

verify = jax.jit(R.verify_step)
accept_jit = jax.jit(R.accept)
decode = jax.jit(functools.partial(R.decode_step, policy="natural"))
materialize = jax.jit(R.materialize_state)


def device(tokens: R.Mamba2Tokens) -> R.Mamba2Tokens:
    return jax.tree.map(jnp.asarray, tokens)


def column(tokens: R.Mamba2Tokens, i: int) -> R.Mamba2Tokens:
    return jax.tree.map(lambda x: x[:, i], tokens)


def random_rows(rng, batch: int = BATCH) -> np.ndarray:
    """Distinct slots on shuffled rows, the last row padding."""
    slots = rng.choice(NUM_SLOTS, size=batch, replace=False).astype(np.int32)
    slots[-1] = -1
    return slots


def with_history(rng, cfg, params, slots: np.ndarray, history: np.ndarray):
    """A state on `NUM_SLOTS` slots whose row r's slot has decoded `history[r]` tokens, from a
    random checkpoint."""
    initial = (0.3 * rng.normal(size=(NUM_SLOTS, HEADS, HEAD_DIM, STATE_SIZE))).astype(cfg.state_dtype)
    state = R.init_state(cfg, NUM_SLOTS, jnp.asarray(initial))
    for step in range(int(history.max(initial=0))):
        step_slots = np.where(history > step, slots, -1).astype(np.int32)
        tokens = device(random_tokens(rng, cfg, (slots.size,), with_z=True))
        _, state = decode(state, tokens, jnp.asarray(step_slots), gate_params=params)
    return state


def model_window(params, live, window_row: R.Mamba2Tokens, parents_row, length):
    """float64 outputs and states of one row's window positions (position i continues from
    its parent's state, or from `live`), by the selective state update."""
    ys, states = [], []
    for i in range(length):
        p = i - 1 if parents_row is None else int(parents_row[i])
        z = None if window_row.z is None else window_row.z[i]
        y, s = selective_state_update(live if p < 0 else states[p], window_row.x[i], window_row.B[i],
                                      window_row.C[i], window_row.dt[i], z, params.A, params.D, params.dt_bias)
        ys.append(y)
        states.append(s)
    return ys, states


def check_untouched(before, after, slots, fold):
    """Slots no row names are unchanged; non-folding rows keep their checkpoint bit for bit."""
    named = slots[slots >= 0]
    others = np.setdiff1d(np.arange(NUM_SLOTS), named)
    for name, a in before.items():
        np.testing.assert_array_equal(bits(after[name][others]), bits(a[others]), err_msg=name)
    keep = named[~fold[slots >= 0]]
    np.testing.assert_array_equal(bits(after["checkpoint"][keep]), bits(before["checkpoint"][keep]))


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("ring", [1, 2, 4])
@pytest.mark.parametrize("groups", [1, 2])
def test_window_matches_sequential_decode_and_reference(groups, ring, dtype, rng):
    state_dtype, tol = DTYPES[dtype]
    cfg = config(ring * T, groups, state_dtype)
    length = cfg.cache_len
    params = random_params(rng)
    slots = random_rows(rng)
    history = rng.integers(0, length, size=BATCH)
    history[0], history[1] = length - 1, 0  # row 0 folds (L - 1 + T > L), row 1 appends
    state = with_history(rng, cfg, params, slots, history)
    window = device(random_tokens(rng, cfg, (BATCH, T), with_z=True))
    jslots = jnp.asarray(slots)
    pos = np.where(slots >= 0, np.asarray(state.write_pos)[np.maximum(slots, 0)], 0)
    fold = (slots >= 0) & (pos + T > length)
    assert fold[0] and not fold[1]

    before = snapshot(state)
    live = np.asarray(materialize(state, jslots, params))
    y, verified = verify(state, window, jslots, gate_params=params)
    y, after = np.asarray(y, np.float32), snapshot(verified)
    active = slots >= 0
    assert np.all(y[~active] == 0)

    # Against T sequential decode steps (NATURAL policy) over the same tokens.
    seq, s = [], state
    for i in range(T):
        yi, s = decode(s, column(window, i), jslots, gate_params=params)
        seq.append(np.asarray(yi, np.float32))
    seq = np.stack(seq, axis=1)
    assert rel_err(y[active].reshape(-1, *y.shape[2:]), seq[active].reshape(-1, *y.shape[2:])).max() < tol

    # Against the scan reference from the live state: outputs and states of every prefix.
    ref_y, _, ref_states = R.mamba2_reference(window, jnp.asarray(live), params, return_all_states=True)
    ref_y, ref_states = np.asarray(ref_y), np.asarray(ref_states)
    for i in range(T):
        assert rel_err(y[active, i], ref_y[active, i]).max() < tol, f"position {i}"

    # Cursors untouched except the folds; a folded row's checkpoint is its live state.
    want_pos = np.asarray(before["write_pos"]).copy()
    want_pos[slots[fold]] = 0
    np.testing.assert_array_equal(after["write_pos"], want_pos)
    check_untouched(before, after, slots, fold)
    assert rel_err(after["checkpoint"][slots[fold]].astype(np.float32), live[fold]).max() < tol

    # Accept 0..T per row (every count present); the live state is the reference's prefix.
    counts = rng.permutation(np.resize(np.arange(T + 1), BATCH)).astype(np.int32)
    accepted = accept_jit(verified, jslots, jnp.asarray(counts))
    got = np.asarray(materialize(accepted, jslots, params))
    want = np.where((counts > 0)[:, None, None, None],
                    ref_states[np.arange(BATCH), np.maximum(counts - 1, 0)], live)
    assert rel_err(got[active], want[active]).max() < tol
    new_pos = np.asarray(accepted.write_pos)
    np.testing.assert_array_equal(new_pos[slots[active]], np.where(fold, 0, pos)[active] + counts[active])


def test_ragged_lengths_write_and_count_only_their_records(rng):
    cfg = config(2 * T)
    params = random_params(rng)
    slots = random_rows(rng)
    # L = 2T. Row 0 fills the ring exactly (L - 1 + 1 = L: no fold), row 1 overflows it.
    history = np.array([2 * T - 1, T + 1, 0, 2, 0])
    state = with_history(rng, cfg, params, slots, history)
    lengths = np.array([1, T, 0, T - 1, T], np.int32)
    window = random_tokens(rng, cfg, (BATCH, T), with_z=True)
    jslots = jnp.asarray(slots)
    before = snapshot(state)
    live = np.asarray(materialize(state, jslots, params))
    y, verified = verify(state, device(window), jslots, lengths=jnp.asarray(lengths), gate_params=params)
    y, after = np.asarray(y), snapshot(verified)
    pos = np.asarray(state.write_pos)[np.maximum(slots, 0)]
    fold = (slots >= 0) & (pos + lengths > cfg.cache_len)
    np.testing.assert_array_equal(fold, [False, True, False, False, False])
    check_untouched(before, after, slots, fold)
    for r in np.flatnonzero(slots >= 0):
        n, base = lengths[r], 0 if fold[r] else pos[r]
        assert np.all(y[r, n:] == 0), f"row {r}: padding positions output"
        ys, _ = model_window(params, live[r], jax.tree.map(lambda x: x[r], window), None, n)
        for i in range(n):
            assert rel_err(y[r, i][None], ys[i][None]).max() < FP32_TOL
        for name in ("u_cache", "k_cache", "g_cache"):
            np.testing.assert_array_equal(bits(after[name][slots[r]][:, base + n:]),
                                          bits(before[name][slots[r]][:, base + n:]),
                                          err_msg=f"{name} of row {r} written past its length")
        # The records are the raw x and B and the post-softplus dt, as decode caches them.
        np.testing.assert_array_equal(after["u_cache"][slots[r]][:, base:base + n], window.x[r, :n].swapaxes(0, 1))
        np.testing.assert_array_equal(after["k_cache"][slots[r]][:, base:base + n], window.B[r, :n].swapaxes(0, 1))

    # Accept every record: row 0's cursor reaches L (a full ring); a decode step then folds
    # it, and every row continues from its accepted window.
    accepted = accept_jit(verified, jslots, jnp.asarray(lengths))
    assert int(accepted.write_pos[slots[0]]) == cfg.cache_len
    token = random_tokens(rng, cfg, (BATCH,), with_z=True)
    for backend in ("xla", "pallas_triton"):
        y_next, after_next = R.decode_step(accepted, device(token), jslots, gate_params=params, policy="natural",
                                           backend=backend)
        assert int(after_next.write_pos[slots[0]]) == 0
        for r in np.flatnonzero(slots >= 0):
            _, states = model_window(params, live[r], jax.tree.map(lambda x: x[r], window), None, lengths[r])
            start = states[-1] if states else live[r]
            want, _ = selective_state_update(start, token.x[r], token.B[r], token.C[r], token.dt[r], token.z[r],
                                             params.A, params.D, params.dt_bias)
            assert rel_err(np.asarray(y_next[r])[None], want[None]).max() < FP32_TOL, f"{backend} row {r}"


def test_rollback_schedule_matches_float64_model(rng):
    """verify, accept k (0..T mixed per row), verify, ... with rows reshuffled and ragged
    windows, over enough rounds to fold every sequence several times; one executable."""
    cfg = config(2 * T)
    params = random_params(rng)
    num_seqs, rounds = BATCH - 1, 10
    seq_slots = rng.choice(NUM_SLOTS, size=num_seqs, replace=False)
    ckpt = (0.3 * rng.normal(size=(NUM_SLOTS, HEADS, HEAD_DIM, STATE_SIZE))).astype(np.float32)
    state = R.init_state(cfg, NUM_SLOTS, jnp.asarray(ckpt))
    model = [np.asarray(ckpt[s], np.float64) for s in seq_slots]
    traces = []

    def traced(fn):
        def run(*args, **kwargs):
            traces.append(fn.__name__)  # Python side effect: runs once per trace
            return fn(*args, **kwargs)
        return run

    step, keep = jax.jit(traced(R.verify_step)), jax.jit(traced(R.accept))
    schedule = [np.array([T] * num_seqs), np.zeros(num_seqs, int)]  # accept all, then none
    schedule += [rng.integers(0, T + 1, num_seqs) for _ in range(rounds - 2)]
    y_err = state_err = 0.0
    folds = 0
    for counts in schedule:
        rows = rng.permutation(BATCH)
        slots = np.full(BATCH, -1, np.int32)
        slots[rows[:num_seqs]] = seq_slots
        lengths = np.full(BATCH, T, np.int32)
        lengths[rows[:num_seqs]] = np.maximum(counts, rng.integers(0, T + 1, num_seqs))
        pos = np.asarray(state.write_pos)[seq_slots]
        folds += int(np.sum(pos + lengths[rows[:num_seqs]] > cfg.cache_len))
        window = random_tokens(rng, cfg, (BATCH, T), with_z=True)
        y, state = step(state, device(window), jnp.asarray(slots), lengths=jnp.asarray(lengths), gate_params=params)
        row_counts = np.zeros(BATCH, np.int32)
        row_counts[rows[:num_seqs]] = counts
        state = keep(state, jnp.asarray(slots), jnp.asarray(row_counts))
        y = np.asarray(y, np.float32)
        for s in range(num_seqs):
            r = rows[s]
            ys, states = model_window(params, model[s], jax.tree.map(lambda x: x[r], window), None, lengths[r])
            if ys:
                y_err = max(y_err, rel_err(y[r, : lengths[r]], np.stack(ys)).max())
            if counts[s]:
                model[s] = states[counts[s] - 1]
        live = np.asarray(materialize(state, jnp.asarray(seq_slots, jnp.int32), params))
        state_err = max(state_err, rel_err(live, np.stack(model)).max())
    assert folds >= num_seqs  # the schedule exercised the capacity rule
    assert y_err < FP32_TOL and state_err < FP32_TOL, (y_err, state_err)
    assert sorted(traces) == ["accept", "verify_step"], traces  # one trace for every mix of rows


def random_tree(rng, batch: int, width: int) -> np.ndarray:
    """`parents [B, T]`: each position's parent uniform over -1 and the earlier positions;
    row 0 is a chain and row 1 a star (every position a child of the state)."""
    parents = np.stack([rng.integers(-1, np.arange(width)) for _ in range(batch)])
    parents = np.where(np.arange(width)[None, :] == 0, -1, parents).astype(np.int32)
    parents[0] = np.arange(width) - 1
    parents[1] = -1
    return parents


def branch(parents_row: np.ndarray, i: int) -> list[int]:
    """Window positions from the root down to i."""
    out = [i]
    while parents_row[out[-1]] >= 0:
        out.append(int(parents_row[out[-1]]))
    return out[::-1]


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_tree_window_matches_path_by_path_decode(dtype, rng):
    state_dtype, tol = DTYPES[dtype]
    width = 4
    cfg = config(2 * width, dtype=state_dtype)
    params = random_params(rng)
    slots = random_rows(rng)
    history = np.array([width + 2, 1, 0, width, 0])  # row 0 folds, row 3 fills the ring
    state = with_history(rng, cfg, params, slots, history)
    parents = random_tree(rng, BATCH, width)
    window = device(random_tokens(rng, cfg, (BATCH, width), with_z=True))
    jslots = jnp.asarray(slots)
    y, verified = verify(state, window, jslots, parents=jnp.asarray(parents), gate_params=params)
    y = np.asarray(y, np.float32)
    assert np.all(y[slots < 0] == 0)

    def decode_paths(paths):
        """Decode each row's path (window positions) with `decode_step`: the output at each
        path step `[B, depth]` and the state after each row's path."""
        s, outs = state, []
        for d in range(max(len(p) for p in paths)):
            idx = np.array([p[d] if d < len(p) else 0 for p in paths])
            step_slots = np.array([sl if d < len(p) else -1 for sl, p in zip(slots, paths)], np.int32)
            yd, s = decode(s, jax.tree.map(lambda x: x[np.arange(BATCH), idx], window), jnp.asarray(step_slots),
                           gate_params=params)
            outs.append(np.asarray(yd, np.float32))
        return outs, s

    for i in range(width):
        paths = [branch(parents[r], i) for r in range(BATCH)]
        outs, _ = decode_paths(paths)
        for r in np.flatnonzero(slots >= 0):
            got, want = y[r, i], outs[len(paths[r]) - 1][r]
            assert rel_err(got[None], want[None]).max() < tol, f"row {r} position {i}"

    # Accept a root-to-node path per row (row 2 accepts nothing); the ring then holds the
    # path in order: the live state equals decoding the path, and a next chain window
    # verified from it matches the same decode continued.
    ends = rng.integers(0, width, BATCH)
    ends[1] = width - 1  # row 1 (a star) accepts [width - 1]: its record must move to the base
    paths = [branch(parents[r], int(ends[r])) for r in range(BATCH)]
    paths[2] = []
    counts = np.array([len(p) for p in paths], np.int32)
    path = np.array([p + [0] * (width - len(p)) for p in paths], np.int32)
    accepted = R.accept(verified, jslots, jnp.asarray(counts), path=jnp.asarray(path))
    _, decoded = decode_paths(paths)
    active = slots >= 0
    got = np.asarray(materialize(accepted, jslots, params))
    want = np.asarray(materialize(decoded, jslots, params))
    assert rel_err(got[active], want[active]).max() < tol

    nxt = device(random_tokens(rng, cfg, (BATCH, 2), with_z=False))
    y_next, _ = verify(accepted, nxt, jslots, gate_params=params)
    s, ref = decoded, []
    for i in range(2):
        yi, s = decode(s, column(nxt, i), jslots, gate_params=params)
        ref.append(np.asarray(yi, np.float32))
    assert rel_err(np.asarray(y_next, np.float32)[active], np.stack(ref, 1)[active]).max() < tol


def test_donated_verify_and_accept_update_the_state_in_place(rng):
    """Under `jit` with the state donated, every state buffer is aliased to the output and
    none is copied inside verify or accept."""
    cfg = config(2 * T)
    params = random_params(rng)
    state = R.init_state(cfg, NUM_SLOTS)
    window = device(random_tokens(rng, cfg, (BATCH, T), with_z=True))
    slots = jnp.asarray(random_rows(rng))
    num_leaves = len(jax.tree.leaves(state))
    step = jax.jit(functools.partial(R.verify_step, gate_params=params), donate_argnums=0)
    keep = jax.jit(R.accept, donate_argnums=0)
    for lowered in (step.lower(state, window, slots, parents=jnp.asarray(random_tree(rng, BATCH, T))),
                    keep.lower(state, slots, jnp.ones(BATCH, jnp.int32), path=jnp.zeros((BATCH, T), jnp.int32))):
        hlo = lowered.compile().as_text()
        assert aliased_parameters(hlo) >= set(range(num_leaves))
        assert not state_sized_copies(hlo, state), state_sized_copies(hlo, state)


def test_mamba2_verify_rejects_bad_input(rng):
    cfg = config(2 * T)
    params = random_params(rng)
    state = R.init_state(cfg, NUM_SLOTS)
    window = device(random_tokens(rng, cfg, (BATCH, T), with_z=True))
    slots = jnp.arange(BATCH, dtype=jnp.int32)
    delta = R.Tokens(window.B, window.B, window.x, window.dt, window.dt)
    cases = [
        (dict(backend="pallas_triton"), "runs on backend 'xla' or 'mosaic_gpu'"),
        (dict(backend="mosaic_gpu"), "head dim P a multiple of 64"),
        (dict(gate_params=None), "needs gate_params=Mamba2Params"),
        (dict(use_qk_l2norm=True), "use_qk_l2norm and scale apply to the delta-rule gates"),
        (dict(window=delta), "window must be a Mamba2Tokens for gate 'mamba2'"),
        (dict(window=column(window, 0)), r"window.x must be \[B, T, H, P\]"),
        (dict(window=window.replace(C=window.C[..., :8])), r"window.C must have shape \(5, 3, 2, 32\)"),
        (dict(window=window.replace(z=window.z[..., :8])), r"window.z must have shape \(5, 3, 4, 16\)"),
        (dict(lengths=jnp.full((BATCH,), T + 1, jnp.int32)), "lengths must lie"),
    ]
    for kwargs, match in cases:
        args = dict(window=window, slots=slots, gate_params=params) | kwargs
        with pytest.raises(ValueError, match=match):
            R.verify_step(state, args.pop("window"), args.pop("slots"), **args)
