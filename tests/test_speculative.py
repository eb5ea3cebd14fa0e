"""Speculative verify (`verify_step`, `accept`) against sequential `decode_step`, the scan
reference and an independent float64 numpy model of the recurrence with rollback.

Setup for every test: a pool of slots with a random checkpoint and a random history per slot
(decoded with `decode_step`, so cursors differ per row), rows on shuffled slots with padding
rows, windows of T tokens. Capacity rule under test: a row folds when write_pos + length > L.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import (
    aliased_parameters,
    bits,
    random_checkpoint,
    random_tokens,
    rel_err,
    small_config,
    snapshot,
    state_sized_copies,
    to_device,
)
from replayssm_jax import (
    Mamba2Params,
    Mamba2Tokens,
    ReplayConfig,
    Tokens,
    accept,
    decode_step,
    init_state,
    materialize_state,
    recurrent_reference,
    verify_step,
)

# fp32: verify only reorders fp32 sums against sequential decode (a T x T solve in place of
# T mat-vecs); 1e-5 is 20x the replay tests' measured worst (< 5e-7) and an off-by-one decay
# or a missing within-window term is O(1e-1).
FP32_TOL = 1e-5
# bf16 state and caches: every cached u, k and the checkpoint are rounded once, each <= the
# unit roundoff u = 2^-8; the live state and outputs then stay within a few u (the same
# argument and bound as tests/test_decode.py's BF16_TOL).
BF16_TOL = 4 * 2.0**-8
DTYPES = {"fp32": (jnp.float32, FP32_TOL), "bf16": (jnp.bfloat16, BF16_TOL)}
NUM_SLOTS, BATCH, T = 7, 5, 3

verify = jax.jit(verify_step, static_argnames=("backend", "use_qk_l2norm", "scale"))
accept_jit = jax.jit(accept)
decode = jax.jit(functools.partial(decode_step, policy="natural", use_qk_l2norm=True))
materialize = jax.jit(materialize_state)


def column(tokens: Tokens, i: int) -> Tokens:
    return jax.tree.map(lambda x: x[:, i], tokens)


def with_history(rng, config, slots: np.ndarray, history: np.ndarray):
    """A state on `NUM_SLOTS` slots whose row r's slot has decoded `history[r]` tokens (rows
    drop out as padding once done), with a random checkpoint."""
    state = init_state(config, NUM_SLOTS, jnp.asarray(random_checkpoint(rng, config, NUM_SLOTS)))
    for step in range(int(history.max(initial=0))):
        step_slots = np.where(history > step, slots, -1).astype(np.int32)
        _, state = decode(state, to_device(random_tokens(rng, config, (slots.size,))), jnp.asarray(step_slots))
    return state


def random_rows(rng, batch: int = BATCH) -> np.ndarray:
    """Distinct slots on shuffled rows, the last row padding."""
    slots = rng.choice(NUM_SLOTS, size=batch, replace=False).astype(np.int32)
    slots[-1] = -1
    return slots


# An independent float64 model of one value head group's recurrence (no replay, no solve).


def prepare(config, tokens: Tokens) -> tuple[np.ndarray, ...]:
    """float64 q (l2-normed, scaled), k (l2-normed) expanded to value heads, v, alpha
    per channel, beta; leading axes kept."""
    f64 = lambda x: np.asarray(x, np.float64)
    norm = lambda x: x / np.sqrt(np.sum(x * x, axis=-1, keepdims=True) + 1e-6)
    r = config.group_size
    q = np.repeat(norm(f64(tokens.q)), r, axis=-2) * config.head_k_dim**-0.5
    k = np.repeat(norm(f64(tokens.k)), r, axis=-2)
    g = f64(tokens.g)
    alpha = np.exp(g if config.per_channel_gate else np.repeat(g[..., None], config.head_k_dim, -1))
    return q, k, f64(tokens.v), alpha, f64(tokens.beta)


def model_step(state, q, k, v, alpha, beta):
    """One token: state `[Hv, dv, dk]`, the rest per value head."""
    decayed = state * alpha[:, None, :]
    u = beta[:, None] * (v - np.einsum("hvk,hk->hv", decayed, k))
    new = decayed + u[:, :, None] * k[:, None, :]
    return np.einsum("hvk,hk->hv", new, q), new


def model_window(config, live, window_row: Tokens, parents_row, length):
    """Outputs and states of each window position of one row (position i continues from its
    parent's state, or from `live`)."""
    q, k, v, alpha, beta = prepare(config, window_row)
    ys, states = [], []
    for i in range(length):
        p = i - 1 if parents_row is None else int(parents_row[i])
        y, s = model_step(live if p < 0 else states[p], q[i], k[i], v[i], alpha[i], beta[i])
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
@pytest.mark.parametrize("gate", ["gdn", "kda"])
def test_window_matches_sequential_decode_and_reference(gate, ring, dtype, rng):
    state_dtype, tol = DTYPES[dtype]
    config = small_config(gate, ring * T, state_dtype)
    length = config.cache_len
    slots = random_rows(rng)
    # Histories over the whole range, so rows fold (write_pos + T > L) and rows append.
    history = rng.integers(0, length, size=BATCH)
    history[0], history[1] = length - 1, 0
    state = with_history(rng, config, slots, history)
    window = to_device(random_tokens(rng, config, (BATCH, T)))
    jslots = jnp.asarray(slots)
    pos = np.where(slots >= 0, np.asarray(state.write_pos)[np.maximum(slots, 0)], 0)
    fold = (slots >= 0) & (pos + T > length)
    assert fold[0] and not fold[1]

    before = snapshot(state)
    live = np.asarray(materialize(state, jslots))
    y, verified = verify(state, window, jslots, use_qk_l2norm=True)
    y = np.asarray(y, np.float32)
    after = snapshot(verified)
    active = slots >= 0
    assert np.all(y[~active] == 0)

    # Against T sequential decode steps (NATURAL policy) over the same tokens.
    seq, s = [], state
    for i in range(T):
        yi, s = decode(s, column(window, i), jslots)
        seq.append(np.asarray(yi, np.float32))
    seq = np.stack(seq, axis=1)
    assert rel_err(y[active].reshape(-1, *y.shape[2:]), seq[active].reshape(-1, *y.shape[2:])).max() < tol

    # Against the scan reference from the live state: outputs and states of every prefix.
    ref_y, _, ref_states = recurrent_reference(window, jnp.asarray(live), use_qk_l2norm=True,
                                               return_all_states=True)
    ref_y, ref_states = np.asarray(ref_y), np.asarray(ref_states)
    for i in range(T):
        assert rel_err(y[active, i], ref_y[active, i]).max() < tol, f"position {i}"

    # Cursors untouched by verify except the folds; folded rows' checkpoint is the live state.
    want_pos = np.asarray(before["write_pos"]).copy()
    want_pos[slots[fold]] = 0
    np.testing.assert_array_equal(after["write_pos"], want_pos)
    check_untouched(before, after, slots, fold)
    if fold.any():
        assert rel_err(after["checkpoint"][slots[fold]], live[fold]).max() < tol

    # Accept 0..T per row (all counts present); the live state is the reference's prefix.
    counts = rng.permutation(np.resize(np.arange(T + 1), BATCH)).astype(np.int32)
    accepted = accept_jit(verified, jslots, jnp.asarray(counts))
    got = np.asarray(materialize(accepted, jslots))
    want = np.where((counts > 0)[:, None, None, None],
                    ref_states[np.arange(BATCH), np.maximum(counts - 1, 0)], live)
    assert rel_err(got[active], want[active]).max() < tol
    new_pos = np.asarray(accepted.write_pos)
    np.testing.assert_array_equal(new_pos[slots[active]], np.where(fold, 0, pos)[active] + counts[active])


@pytest.mark.parametrize("gate", ["gdn", "kda"])
def test_ragged_lengths_write_and_count_only_their_records(gate, rng):
    config = small_config(gate, 2 * T)
    slots = random_rows(rng)
    # L = 2T. Row 0 fills the ring exactly (L - 1 + 1 = L: no fold), row 1 overflows it.
    history = np.array([2 * T - 1, T + 1, 0, 2, 0])
    state = with_history(rng, config, slots, history)
    lengths = np.array([1, T, 0, T - 1, T], np.int32)
    window = random_tokens(rng, config, (BATCH, T), v_scale=50.0)
    jslots = jnp.asarray(slots)
    before = snapshot(state)
    live = np.asarray(materialize(state, jslots))
    y, verified = verify(state, to_device(window), jslots, lengths=jnp.asarray(lengths), use_qk_l2norm=True)
    y, after = np.asarray(y), snapshot(verified)
    pos = np.asarray(state.write_pos)[np.maximum(slots, 0)]
    fold = (slots >= 0) & (pos + lengths > config.cache_len)
    np.testing.assert_array_equal(fold, [False, True, False, False, False])
    check_untouched(before, after, slots, fold)
    for r in np.flatnonzero(slots >= 0):
        n, base = lengths[r], 0 if fold[r] else pos[r]
        assert np.all(y[r, n:] == 0), f"row {r}: padding positions output"
        ys, _ = model_window(config, live[r], jax.tree.map(lambda x: x[r], window), None, n)
        for i in range(n):
            assert rel_err(y[r, i][None], ys[i][None]).max() < FP32_TOL
        for name in ("u_cache", "k_cache", "g_cache"):
            np.testing.assert_array_equal(bits(after[name][slots[r]][:, base + n:]),
                                          bits(before[name][slots[r]][:, base + n:]),
                                          err_msg=f"{name} of row {r} written past its length")

    # Accept every record: row 0's cursor reaches L (a full ring); a plain decode step then
    # folds it and every row continues from its accepted window.
    accepted = accept_jit(verified, jslots, jnp.asarray(lengths))
    assert int(accepted.write_pos[slots[0]]) == config.cache_len
    token = random_tokens(rng, config, (BATCH,))
    y_next, _ = decode(accepted, to_device(token), jslots)
    for r in np.flatnonzero(slots >= 0):
        ys, states = model_window(config, live[r], jax.tree.map(lambda x: x[r], window), None, lengths[r])
        start = states[-1] if states else live[r]
        want, _ = model_step(start, *(x[0] for x in prepare(config, jax.tree.map(lambda x: x[r:r + 1], token))))
        assert rel_err(np.asarray(y_next[r])[None], want[None]).max() < FP32_TOL, f"row {r}"


@pytest.mark.parametrize(("gate", "dtype"), [("gdn", "fp32"), ("kda", "fp32"), ("gdn", "bf16")])
def test_rollback_schedule_matches_float64_model(gate, dtype, rng):
    """verify, accept k (0..T mixed per row), verify, ... with rows reshuffled and ragged
    windows, over enough rounds to fold every sequence several times; one executable."""
    state_dtype, tol = DTYPES[dtype]
    config = small_config(gate, 2 * T, state_dtype)
    num_seqs, rounds = BATCH - 1, 10
    seq_slots = rng.choice(NUM_SLOTS, size=num_seqs, replace=False)
    ckpt = random_checkpoint(rng, config, NUM_SLOTS)
    state = init_state(config, NUM_SLOTS, jnp.asarray(ckpt))
    model = [np.asarray(ckpt[s], np.float64) for s in seq_slots]
    traces = []

    def traced(fn):
        def run(*args, **kwargs):
            traces.append(fn.__name__)  # Python side effect: runs once per trace
            return fn(*args, **kwargs)
        return run

    step = jax.jit(traced(verify_step), static_argnames=("use_qk_l2norm",))
    keep = jax.jit(traced(accept))
    schedule = [np.array([T] * num_seqs), np.zeros(num_seqs, int)]  # accept all, then none
    schedule += [rng.integers(0, T + 1, num_seqs) for _ in range(rounds - 2)]
    y_err = state_err = 0.0
    for counts in schedule:
        rows = rng.permutation(BATCH)
        slots = np.full(BATCH, -1, np.int32)
        slots[rows[:num_seqs]] = seq_slots
        lengths = np.full(BATCH, T, np.int32)
        lengths[rows[:num_seqs]] = np.maximum(counts, rng.integers(0, T + 1, num_seqs))
        window = random_tokens(rng, config, (BATCH, T))
        y, state = step(state, to_device(window), jnp.asarray(slots), lengths=jnp.asarray(lengths),
                        use_qk_l2norm=True)
        row_counts = np.zeros(BATCH, np.int32)
        row_counts[rows[:num_seqs]] = counts
        state = keep(state, jnp.asarray(slots), jnp.asarray(row_counts))
        y = np.asarray(y, np.float32)
        for s in range(num_seqs):
            r = rows[s]
            ys, states = model_window(config, model[s], jax.tree.map(lambda x: x[r], window), None, lengths[r])
            if ys:
                y_err = max(y_err, rel_err(y[r, : lengths[r]], np.stack(ys)).max())
            if counts[s]:
                model[s] = states[counts[s] - 1]
        live = np.asarray(materialize(state, jnp.asarray(seq_slots, jnp.int32)))
        state_err = max(state_err, rel_err(live, np.stack(model)).max())
    assert y_err < tol and state_err < tol, (y_err, state_err)
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


@pytest.mark.parametrize("gate", ["gdn", "kda"])
def test_tree_window_matches_path_by_path_decode(gate, rng):
    width = 4
    config = small_config(gate, 2 * width)
    slots = random_rows(rng)
    history = np.array([width + 2, 1, 0, width, 0])  # row 0 folds, row 3 fills the ring
    state = with_history(rng, config, slots, history)
    parents = random_tree(rng, BATCH, width)
    window = to_device(random_tokens(rng, config, (BATCH, width)))
    jslots = jnp.asarray(slots)
    y, verified = verify(state, window, jslots, parents=jnp.asarray(parents), use_qk_l2norm=True)
    y = np.asarray(y)
    assert np.all(y[slots < 0] == 0)

    def decode_paths(paths):
        """Decode each row's path (a list of window positions) with `decode_step`; returns
        the output at each path step `[B, depth]` and the state after each row's path."""
        depth = max(len(p) for p in paths)
        s, outs = state, []
        for d in range(depth):
            idx = np.array([p[d] if d < len(p) else 0 for p in paths])
            step_slots = np.array([sl if d < len(p) else -1 for sl, p in zip(slots, paths)], np.int32)
            tok = jax.tree.map(lambda x: x[np.arange(BATCH), idx], window)
            yd, s = decode(s, tok, jnp.asarray(step_slots))
            outs.append(np.asarray(yd))
        return outs, s

    for i in range(width):
        paths = [branch(parents[r], i) for r in range(BATCH)]
        outs, _ = decode_paths(paths)
        for r in np.flatnonzero(slots >= 0):
            got, want = y[r, i], outs[len(paths[r]) - 1][r]
            assert rel_err(got[None], want[None]).max() < FP32_TOL, f"row {r} position {i}"

    # Accept a root-to-node path per row (row 2 accepts nothing); the ring then holds the
    # path in order: the live state equals decoding the path, and a next chain window
    # verified from it matches the same decode continued.
    ends = rng.integers(0, width, BATCH)
    ends[1] = width - 1  # row 1 (a star) accepts [width - 1]: its record must move to the base
    paths = [branch(parents[r], int(ends[r])) for r in range(BATCH)]
    paths[2] = []
    counts = np.array([len(p) for p in paths], np.int32)
    path = np.array([p + [0] * (width - len(p)) for p in paths], np.int32)
    accepted = accept(verified, jslots, jnp.asarray(counts), path=jnp.asarray(path))
    _, decoded = decode_paths(paths)
    active = slots >= 0
    got = np.asarray(materialize(accepted, jslots))
    want = np.asarray(materialize(decoded, jslots))
    assert rel_err(got[active], want[active]).max() < FP32_TOL
    pos = np.asarray(state.write_pos)[np.maximum(slots, 0)]
    base = np.where(pos + width > config.cache_len, 0, pos)
    np.testing.assert_array_equal(np.asarray(accepted.write_pos)[slots[active]], (base + counts)[active])

    nxt = to_device(random_tokens(rng, config, (BATCH, 2)))
    y_next, _ = verify(accepted, nxt, jslots, use_qk_l2norm=True)
    s, ref = decoded, []
    for i in range(2):
        yi, s = decode(s, column(nxt, i), jslots)
        ref.append(np.asarray(yi))
    assert rel_err(np.asarray(y_next)[active], np.stack(ref, 1)[active]).max() < FP32_TOL


@pytest.mark.parametrize("gate", ["gdn", "mamba2"])
def test_verify_on_a_ring_of_one_is_refused(gate, rng):
    """Regression (found by tests/test_property.py): at L = 1 a verified token accepted with
    `accept(.., 1)` stayed in the cache (cursor 1), and the next pallas_triton decode step, the
    plain kernel at L = 1, ignored it (outputs off by O(1e-2) for GDN, O(1) for Mamba-2, while
    the xla step replayed it). verify_step now refuses L = 1."""
    if gate == "mamba2":
        config = ReplayConfig.mamba2(2, 16, 16, 1, 1)
        window = Mamba2Tokens(*(jnp.ones((BATCH, 1, *s), jnp.float32) for s in ((2, 16), (1, 16), (1, 16), (2,))))
        gate_params = Mamba2Params(A=-jnp.ones(2), D=jnp.ones(2), dt_bias=jnp.zeros(2))
    else:
        config, gate_params = small_config(gate, 1), None
        window = to_device(random_tokens(rng, config, (BATCH, 1)))
    with pytest.raises(ValueError, match="cache_len >= 2"):
        verify_step(init_state(config, NUM_SLOTS), window, jnp.arange(BATCH, dtype=jnp.int32),
                    gate_params=gate_params)


def test_verify_and_accept_reject_bad_input(rng):
    config = small_config("gdn", 2 * T)
    state = init_state(config, NUM_SLOTS)
    window = to_device(random_tokens(rng, config, (BATCH, T)))
    slots = jnp.arange(BATCH, dtype=jnp.int32)
    wide = to_device(random_tokens(rng, config, (BATCH, 2 * T + 1)))
    cases = [
        (dict(window=wide), "exceeds the ring"),
        (dict(window=column(window, 0)), r"window.q must be \[B, T"),
        (dict(window=window.replace(beta=window.beta[..., :1])), "window.beta"),
        (dict(lengths=jnp.full((BATCH,), T + 1, jnp.int32)), "lengths must lie"),
        (dict(lengths=jnp.full((BATCH,), 1.0)), "lengths must be an integer"),
        (dict(parents=jnp.zeros((BATCH, T), jnp.int32)), r"parents\[0, 0\] = 0"),
        (dict(parents=jnp.zeros((BATCH,), jnp.int32)), "parents must have shape"),
        (dict(backend="tpu"), "backend must be one of"),
        (dict(backend="mosaic_gpu"), "multiple of 64"),
        (dict(backend="pallas_triton", kernel_params={"block_v": 16}), "kernel_params must be VerifyReadoutParams"),
        (dict(interpret=True), "apply to the kernel backends only"),
        (dict(slots=jnp.array([0, 0, 1, 2, 3], jnp.int32)), "more than once"),
    ]
    for kwargs, match in cases:
        args = dict(window=window, slots=slots) | kwargs
        with pytest.raises(ValueError, match=match):
            verify_step(state, args.pop("window"), args.pop("slots"), **args)
    _, verified = verify(state, window, slots)
    for kwargs, match in [
        (dict(num_accepted=jnp.full((BATCH,), -1, jnp.int32)), ">= 0"),
        (dict(num_accepted=jnp.full((BATCH,), 2 * T + 1, jnp.int32)), "past the ring"),
        (dict(num_accepted=jnp.ones((BATCH - 1,), jnp.int32)), "num_accepted must have shape"),
        (dict(path=jnp.zeros((BATCH, T), jnp.int32)), "increasing"),
        (dict(path=jnp.zeros((BATCH, 1), jnp.int32)), "exceeds the path length"),
    ]:
        args = dict(num_accepted=jnp.full((BATCH,), 2, jnp.int32)) | kwargs
        with pytest.raises(ValueError, match=match):
            accept(verified, slots, args.pop("num_accepted"), **args)


@pytest.mark.parametrize("gate", ["gdn", "kda"])
def test_every_decode_backend_continues_after_a_full_ring(gate, backend, rng):
    """`accept` can leave a cursor at L (a window that exactly filled the ring), which plain
    decode never does; each backend's next decode step folds it and agrees with the model."""
    config = small_config(gate, T)
    slots = random_rows(rng)
    ckpt = random_checkpoint(rng, config, NUM_SLOTS)
    state = init_state(config, NUM_SLOTS, jnp.asarray(ckpt))
    window = random_tokens(rng, config, (BATCH, T))
    jslots = jnp.asarray(slots)
    _, state = verify(state, to_device(window), jslots, use_qk_l2norm=True)
    state = accept_jit(state, jslots, jnp.full((BATCH,), T, jnp.int32))
    token = random_tokens(rng, config, (BATCH,))
    y, state = decode_step(state, to_device(token), jslots, backend=backend, policy="natural",
                           use_qk_l2norm=True)
    np.testing.assert_array_equal(np.asarray(state.write_pos)[slots[slots >= 0]], 0)
    live = np.asarray(materialize(state, jslots))
    for r in np.flatnonzero(slots >= 0):
        _, states = model_window(config, np.asarray(ckpt[slots[r]], np.float64),
                                 jax.tree.map(lambda x: x[r], window), None, T)
        want_y, want_s = model_step(states[-1], *(x[0] for x in prepare(config, jax.tree.map(lambda x: x[r:r + 1], token))))
        assert rel_err(np.asarray(y[r])[None], want_y[None]).max() < FP32_TOL, f"row {r}"
        assert rel_err(live[r][None], want_s[None]).max() < FP32_TOL, f"row {r}"


@pytest.mark.parametrize("gate", ["gdn", "kda"])
def test_gate_params_and_scale_without_norm(gate, rng):
    """Raw `a`, `b` gated in the step equal pre-gated g, beta (gating formula written here);
    without the l2 norm and with a custom scale the window still matches the model."""
    config = small_config(gate, 2 * T)
    slots = random_rows(rng)
    state = with_history(rng, config, slots, np.array([2, 0, T + 1, 1, 0]))
    raw = random_tokens(rng, config, (BATCH, T))
    raw = raw.replace(g=rng.normal(size=raw.g.shape).astype(np.float32),
                      beta=rng.normal(size=raw.beta.shape).astype(np.float32))
    a_log = rng.normal(size=(config.num_v_heads,)).astype(np.float32)
    dt_bias = rng.normal(size=config.gate_kind.gate_param_shapes(config)[1]).astype(np.float32)
    decay = np.exp(a_log)[:, None] if config.per_channel_gate else np.exp(a_log)
    gated = raw.replace(g=(-decay * np.logaddexp(0.0, raw.g + dt_bias)).astype(np.float32),
                        beta=(1 / (1 + np.exp(-raw.beta))).astype(np.float32))
    jslots = jnp.asarray(slots)
    y_raw, _ = verify(state, to_device(raw), jslots, use_qk_l2norm=True,
                      gate_params=(jnp.asarray(a_log), jnp.asarray(dt_bias)))
    y_gated, _ = verify(state, to_device(gated), jslots, use_qk_l2norm=True)
    active = slots >= 0
    assert rel_err(np.asarray(y_raw)[active], np.asarray(y_gated)[active]).max() < FP32_TOL

    small = gated.replace(q=0.2 * gated.q, k=0.2 * gated.k)  # unnormalised keys: keep |k| ~ 1
    y, _ = verify(state, to_device(small), jslots, scale=0.5)
    live = np.asarray(materialize(state, jslots))
    ref_y, _ = recurrent_reference(to_device(small), jnp.asarray(live), scale=0.5)
    assert rel_err(np.asarray(y)[active], np.asarray(ref_y)[active]).max() < FP32_TOL


def test_donated_verify_and_accept_update_the_state_in_place(rng):
    """Under `jit` with the state donated, every state buffer is aliased to the output and
    none is copied inside verify or accept (a copy would move the whole pool per step)."""
    config = small_config("kda", 2 * T)
    state = init_state(config, NUM_SLOTS)
    window = to_device(random_tokens(rng, config, (BATCH, T)))
    slots = jnp.asarray(random_rows(rng))
    num_leaves = len(jax.tree.leaves(state))
    step = jax.jit(functools.partial(verify_step, use_qk_l2norm=True), donate_argnums=0)
    keep = jax.jit(accept, donate_argnums=0)
    for lowered in (step.lower(state, window, slots, parents=jnp.asarray(random_tree(rng, BATCH, T))),
                    keep.lower(state, slots, jnp.ones(BATCH, jnp.int32), path=jnp.zeros((BATCH, T), jnp.int32))):
        hlo = lowered.compile().as_text()
        assert aliased_parameters(hlo) >= set(range(num_leaves))
        assert not state_sized_copies(hlo, state), state_sized_copies(hlo, state)


def test_a_chain_window_compiles_its_ancestry_as_a_constant(rng):
    """A chain's ancestry (`parents=None`) is the strict lower triangle, the same as an
    explicit chain's, and enters the compiled step as a constant: XLA does not fold a
    broadcast, so a traced mask would be computed by a kernel of its own every step."""
    from replayssm_jax.speculative import ancestors

    chain = ancestors(None, BATCH, T)
    assert isinstance(chain, np.ndarray)
    explicit = ancestors(jnp.broadcast_to(jnp.arange(T) - 1, (BATCH, T)), BATCH, T)
    np.testing.assert_array_equal(chain, np.asarray(explicit))
    np.testing.assert_array_equal(chain[0], np.tril(np.ones((T, T), bool), -1))
    config = small_config("gdn", 2 * T)
    window = to_device(random_tokens(rng, config, (BATCH, T)))
    step = jax.jit(functools.partial(verify_step, use_qk_l2norm=True))
    text = step.lower(init_state(config, NUM_SLOTS), window, jnp.asarray(random_rows(rng))).as_text()
    # JAX stages a NumPy array of zero strides as a small constant and a broadcast.
    assert all(chain.strides)
    assert any("stablehlo.constant" in line and f"tensor<{BATCH}x{T}x{T}xi1>" in line for line in text.splitlines())


@pytest.mark.parametrize("backend", ["xla", "mosaic_gpu"])
def test_array_likes_are_taken_as_arrays(rng, backend):
    """Slots, lengths, parents, counts and paths given as Python lists (and flags as a list
    of bools) give the same step as int32 / bool arrays: the validation takes array-likes,
    so the steps must too (mosaic_gpu: its interpret mode, GDN on its kernels' shapes)."""
    config = ReplayConfig(1, 2, 64, 64, 8)
    state = init_state(config, NUM_SLOTS, jnp.asarray(random_checkpoint(rng, config, NUM_SLOTS)))
    slots = [int(s) for s in random_rows(rng)]
    _, state = decode_step(state, to_device(random_tokens(rng, config, (BATCH,))), slots,
                           force_flush=[True, False] * (BATCH // 2) + [False] * (BATCH % 2), use_qk_l2norm=True)
    window = to_device(random_tokens(rng, config, (BATCH, T)))
    lengths = [int(n) for n in rng.integers(1, T + 1, BATCH)]
    parents = [[-1] + [int(rng.integers(-1, i)) for i in range(1, T)] for _ in range(BATCH)]
    path = [[0] * T for _ in range(BATCH)]
    outs = []
    for cast in (lambda x: x, lambda x: jnp.asarray(x, jnp.int32)):
        y, after = verify_step(state, window, cast(slots), lengths=cast(lengths), parents=cast(parents),
                               backend=backend, use_qk_l2norm=True)
        after = accept(after, cast(slots), cast([1] * BATCH), path=cast(path))
        outs.append((y, after.write_pos, materialize_state(after, cast(slots))))
    for got, want in zip(*outs):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
