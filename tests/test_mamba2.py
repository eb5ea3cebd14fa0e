"""Mamba-2 (gate "mamba2") decode against the scan reference and against the selective
state update written here in numpy float64, on both backends (Pallas in interpret mode).

Each run decodes a few sequences through a pool of more slots than rows, with the rows
shuffled every step, one padding row and random forced flushes, and checks at every step:
the outputs, the live state (`materialize_state`), the checkpoint of every row that flushed,
the cursors, and that slots no row names are left bit for bit.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import replayssm_jax as R
from helpers import aliased_parameters, state_sized_copies
from replayssm_jax.backends import pallas_triton

HEADS, HEAD_DIM, STATE_SIZE = 4, 16, 32  # P != N so a transposed state cannot pass
NUM_SLOTS, SEQS = 5, 3
FIELDS = ("checkpoint", "u_cache", "k_cache", "g_cache", "write_pos")


def config(cache_len: int, groups: int = 2, dtype=jnp.float32) -> R.ReplayConfig:
    return R.ReplayConfig.mamba2(HEADS, HEAD_DIM, STATE_SIZE, groups, cache_len,
                                 state_dtype=dtype, cache_dtype=dtype)


def random_params(rng, **static) -> R.Mamba2Params:
    """A in [-8, -0.5] (as exp(A_log) in Mamba-2 inits), dt_bias near softplus^-1(0.01..0.1)."""
    return R.Mamba2Params(
        A=jnp.asarray(-rng.uniform(0.5, 8.0, HEADS), jnp.float32),
        D=jnp.asarray(rng.normal(size=HEADS), jnp.float32),
        dt_bias=jnp.asarray(rng.uniform(-4.5, -2.0, HEADS), jnp.float32),
        **static,
    )


def random_tokens(rng, cfg: R.ReplayConfig, lead: tuple[int, ...], *, with_z: bool) -> R.Mamba2Tokens:
    """float32 inputs; x and B are bf16-representable when the cache is bf16, so caching
    them is exact and the comparison sees the checkpoint's rounding only."""
    groups = cfg.num_k_heads
    normal = lambda *shape: rng.normal(size=(*lead, *shape)).astype(np.float32)
    cached = lambda a: np.asarray(jnp.asarray(a).astype(cfg.cache_dtype).astype(jnp.float32))
    return R.Mamba2Tokens(
        x=cached(normal(HEADS, HEAD_DIM)), B=cached(normal(groups, STATE_SIZE)),
        C=normal(groups, STATE_SIZE), dt=rng.normal(0.0, 1.5, (*lead, HEADS)).astype(np.float32),
        z=normal(HEADS, HEAD_DIM) if with_z else None,
    )


def selective_state_update(state, x, B, C, dt, z, A, D, dt_bias, dt_softplus=True, dt_limit=(0.0, np.inf)):
    """The Mamba-2 selective state update, numpy float64, one token for one sequence.

    state `[H, P, N]`, x/z `[H, P]`, B/C `[G, N]`, dt `[H]`, A/D/dt_bias `[H]`."""
    f = lambda a: np.asarray(a, np.float64)
    state, x, B, C, dt, A, D = map(f, (state, x, B, C, dt, A, D))
    heads, groups = x.shape[0], B.shape[0]
    B, C = np.repeat(B, heads // groups, axis=0), np.repeat(C, heads // groups, axis=0)
    dt = dt + f(dt_bias)
    if dt_softplus:
        dt = np.logaddexp(0.0, dt)
    dt = np.clip(dt, *dt_limit)
    dA = np.exp(dt * A)[:, None, None]
    dBx = (dt[:, None] * x)[:, :, None] * B[:, None, :]
    state = state * dA + dBx
    out = np.einsum("hpn,hn->hp", state, C) + D[:, None] * x
    if z is not None:
        z = f(z)
        out = out * z / (1.0 + np.exp(-z))
    return out, state


def _step_fn(backend: str, policy: str):
    return jax.jit(functools.partial(R.decode_step, backend=backend, policy=policy), donate_argnums=0)


def run_and_check(rng, cfg, backend, *, steps, params, policy="natural", force_prob=0.25, with_z=True,
                  want=None, tol):
    """Decode `steps` tokens of SEQS sequences and check every step (see the module doc).

    `want(tokens, initial) -> (y [S, T, H, P], states [S, T, H, P, N])` gives the expected
    values (default: `mamba2_reference`). `tol` is the allowed error relative to the largest
    magnitude of the compared quantity."""
    seq_slots = rng.choice(NUM_SLOTS, SEQS, replace=False)
    tokens = random_tokens(rng, cfg, (SEQS, steps), with_z=with_z)
    initial = (0.3 * rng.normal(size=(NUM_SLOTS, HEADS, HEAD_DIM, STATE_SIZE))).astype(cfg.state_dtype)
    initial_f32 = np.asarray(jnp.asarray(initial).astype(jnp.float32))
    if want is None:
        ref_y, _, ref_states = R.mamba2_reference(jax.tree.map(jnp.asarray, tokens),
                                                  jnp.asarray(initial_f32[seq_slots]), params,
                                                  return_all_states=True)
    else:
        ref_y, ref_states = want(tokens, initial_f32[seq_slots])
    ref_y, ref_states = np.asarray(ref_y), np.asarray(ref_states)
    close = lambda got, exp, what: np.testing.assert_allclose(
        got, exp, rtol=0, atol=tol * max(1.0, float(np.max(np.abs(exp)))), err_msg=what)

    step = _step_fn(backend, policy)
    state = R.init_state(cfg, NUM_SLOTS, checkpoint=jnp.asarray(initial))
    cursor = np.zeros(NUM_SLOTS, np.int64)
    batch = SEQS + 1
    for t in range(steps):
        rows = rng.permutation(np.r_[np.arange(SEQS), -1])  # sequence per row, -1 padding
        slots = np.where(rows >= 0, seq_slots[np.maximum(rows, 0)], -1).astype(np.int32)
        force = rng.random(batch) < force_prob
        row_tokens = jax.tree.map(lambda a: jnp.asarray(a[np.maximum(rows, 0), t]), tokens)
        before = {f: np.asarray(getattr(state, f)).copy() for f in FIELDS}
        y, state = step(state, row_tokens, jnp.asarray(slots), jnp.asarray(force), gate_params=params)
        y = np.asarray(y.astype(jnp.float32))
        live = rows >= 0
        assert np.all(y[~live] == 0.0)
        close(y[live], ref_y[rows[live], t], f"y at step {t}")
        got = np.asarray(R.materialize_state(state, jnp.asarray(seq_slots, jnp.int32), params))
        close(got, ref_states[:, t], f"live state after step {t}")
        pos = cursor[slots[live]]
        flushed = (pos == cfg.cache_len - 1) | force[live] | (policy == "every_step")
        for seq, slot, did in zip(rows[live], slots[live], flushed):
            if did:
                ckpt = np.asarray(state.checkpoint[slot].astype(jnp.float32))
                close(ckpt, ref_states[seq, t], f"checkpoint of the flush at step {t}")
        cursor[slots[live]] = np.where(flushed, 0, pos + 1)
        np.testing.assert_array_equal(np.asarray(state.write_pos), cursor)
        untouched = np.setdiff1d(np.arange(NUM_SLOTS), slots[live])
        for f in FIELDS:
            np.testing.assert_array_equal(np.asarray(getattr(state, f))[untouched], before[f][untouched],
                                          err_msg=f"{f} of a slot no row named")
    return state


# fp32: float32 arithmetic over up to 16 replayed entries against a float32 scan, a few
# ulps of the largest value each. bf16: the checkpoint is rounded to bf16 at every flush
# (relative 2^-9) and the rounding compounds over the flushes of a run.
TOL = {"fp32": 2e-5, "bf16": 2e-2}
DTYPES = {"fp32": jnp.float32, "bf16": jnp.bfloat16}


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("groups", [1, 2])
@pytest.mark.parametrize("cache_len", [1, 3, 4, 16])
def test_matches_scan_reference_every_step(cache_len, groups, dtype, backend, rng):
    cfg = config(cache_len, groups, DTYPES[dtype])
    steps = min(cache_len + 3, 12) if backend == "pallas_triton" else cache_len + 5
    run_and_check(rng, cfg, backend, steps=steps, params=random_params(rng), tol=TOL[dtype],
                  force_prob=0.1 if cache_len == 16 else 0.25)


def _numpy_reference(params, **static):
    def want(tokens, initial):
        ys, states = [], []
        for s in range(initial.shape[0]):
            state, y_s, st_s = initial[s], [], []
            for t in range(tokens.x.shape[1]):
                z = None if tokens.z is None else tokens.z[s, t]
                y, state = selective_state_update(state, tokens.x[s, t], tokens.B[s, t], tokens.C[s, t],
                                                  tokens.dt[s, t], z, params.A, params.D, params.dt_bias, **static)
                y_s.append(y)
                st_s.append(state)
            ys.append(y_s)
            states.append(st_s)
        return np.asarray(ys), np.asarray(states)
    return want


@pytest.mark.parametrize("with_z", [True, False])
@pytest.mark.parametrize("dt_options", [dict(), dict(dt_softplus=False, dt_limit=(0.001, 0.1)),
                                        dict(dt_limit=(0.0, 0.05))], ids=["softplus", "raw-clamped", "clamped"])
def test_matches_selective_state_update_in_float64(dt_options, with_z, backend, rng):
    params = random_params(rng, **dt_options)
    if not dt_options.get("dt_softplus", True):  # raw dt + dt_bias must be positive
        params = R.Mamba2Params(params.A, params.D, jnp.zeros(HEADS, jnp.float32) + 0.05, **dt_options)
    run_and_check(rng, config(4), backend, steps=7, params=params, with_z=with_z, tol=2e-5,
                  want=_numpy_reference(params, **dt_options))


def test_every_step_policy_is_the_plain_recurrence(backend, rng):
    state = run_and_check(rng, config(4), backend, steps=5, params=random_params(rng), policy="every_step",
                          tol=2e-5)
    assert np.all(np.asarray(state.write_pos) == 0)


def test_caches_hold_x_b_and_post_softplus_dt(rng):
    cfg = config(4)
    params = random_params(rng)
    tokens = jax.tree.map(jnp.asarray, random_tokens(rng, cfg, (2,), with_z=False))
    _, state = R.decode_step(R.init_state(cfg, 3), tokens, jnp.array([2, 0]), gate_params=params, policy="natural")
    np.testing.assert_array_equal(np.asarray(state.u_cache[jnp.array([2, 0]), :, 0]), np.asarray(tokens.x))
    np.testing.assert_array_equal(np.asarray(state.k_cache[jnp.array([2, 0]), :, 0]), np.asarray(tokens.B))
    dt = np.logaddexp(0.0, np.asarray(tokens.dt, np.float64) + np.asarray(params.dt_bias, np.float64))
    np.testing.assert_allclose(np.asarray(state.g_cache[jnp.array([2, 0]), :, 0]), dt, rtol=1e-6)
    assert cfg.gate_kind.cache_shapes(cfg, 3)["k_cache"].shape == (3, 2, 4, STATE_SIZE)


def test_stale_cache_entries_never_reach_the_step(backend, rng):
    """NaN in every entry at or past a slot's cursor changes nothing."""
    cfg = config(4)
    params = random_params(rng)
    tokens = jax.tree.map(jnp.asarray, random_tokens(rng, cfg, (2, 2), with_z=False))
    state = R.init_state(cfg, 2, checkpoint=jnp.asarray(0.3 * rng.normal(size=(2, HEADS, HEAD_DIM, STATE_SIZE)),
                                                        jnp.float32))
    slots = jnp.array([1, 0])
    _, state = R.decode_step(state, jax.tree.map(lambda a: a[:, 0], tokens), slots, gate_params=params,
                             policy="natural", backend=backend)
    stale = jnp.arange(4)[None, None, :] >= 1
    poisoned = state.__class__(
        checkpoint=state.checkpoint, config=cfg, write_pos=state.write_pos,
        u_cache=jnp.where(stale[..., None], jnp.nan, state.u_cache),
        k_cache=jnp.where(stale[..., None], jnp.nan, state.k_cache),
        g_cache=jnp.where(stale, jnp.nan, state.g_cache),
    )
    step = lambda s: R.decode_step(s, jax.tree.map(lambda a: a[:, 1], tokens), slots, gate_params=params,
                                   policy="natural", backend=backend)[0]
    np.testing.assert_array_equal(np.asarray(step(poisoned)), np.asarray(step(state)))


MAMBA2_ROWS = [row for row in pallas_triton.LAUNCH_TABLE if row.gate == "mamba2"]
# The plan each kernel step runs under: L = 1 runs the plain kernel, a fold-every-step plan
# the replay kernel with every live row flushing, a natural plan the replay kernel.
STEP_SETUP = {"plain": (1, "natural"), "fold": (4, "every_step"), "replay": (4, "natural")}


@pytest.mark.parametrize("row", MAMBA2_ROWS, ids=[f"{r.step}-{r.state_bytes}-{r.batch}" for r in MAMBA2_ROWS])
def test_every_launch_row_matches_xla_and_the_reference(row, rng):
    """Each Mamba-2 launch-table row's parameters (plain, fold and replay kernels, interpret
    mode) on its kernel step: one xla step puts a cache entry in the live slots, then the
    row's step runs on both backends (a padding row, slots != rows, a forced flush) and is
    checked against the xla backend (outputs, every state field, cursors) and against the
    scan reference over both tokens (outputs and live state)."""
    cache_len, policy = STEP_SETUP[row.step]
    cfg = config(cache_len)
    params = random_params(rng)
    tokens = random_tokens(rng, cfg, (3, 2), with_z=True)
    column = lambda t: jax.tree.map(lambda a: jnp.asarray(a[:, t]), tokens)
    slots, force = jnp.array([3, -1, 1]), jnp.array([False, False, True])
    initial = (0.3 * rng.normal(size=(4, HEADS, HEAD_DIM, STATE_SIZE))).astype(np.float32)
    state = R.init_state(cfg, 4, checkpoint=jnp.asarray(initial))
    _, state = R.decode_step(state, column(0), slots, gate_params=params, policy="natural")
    want, want_state = R.decode_step(state, column(1), slots, force, gate_params=params, policy=policy)
    got, got_state = R.decode_step(state, column(1), slots, force, gate_params=params, policy=policy,
                                   backend="pallas_triton", kernel_params=row.params)
    assert pallas_triton.step_kind(cfg, R.FlushPolicy(policy)) == row.step
    # fp32 on both sides, the same sums in another order: a few ulps of O(1) values.
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(got_state.write_pos), np.asarray(want_state.write_pos))
    for name in FIELDS[:-1]:
        np.testing.assert_allclose(np.asarray(getattr(got_state, name)), np.asarray(getattr(want_state, name)),
                                   rtol=0, atol=1e-5, err_msg=name)
    live = np.array([0, 2])
    ref_y, _, ref_states = R.mamba2_reference(
        jax.tree.map(lambda a: jnp.asarray(a[live]), tokens), jnp.asarray(initial[np.asarray(slots)[live]]),
        params, return_all_states=True)
    np.testing.assert_allclose(np.asarray(got)[live], np.asarray(ref_y[:, 1]), rtol=0, atol=1e-5)
    materialized = R.materialize_state(got_state, slots[live], params)
    np.testing.assert_allclose(np.asarray(materialized), np.asarray(ref_states[:, 1]), rtol=0, atol=1e-5)


def test_one_compilation_and_donated_state(rng):
    """Every mix of cursors, flushes and padding rows reuses one executable; the donated
    state is aliased to the outputs and never copied in the xla step (the interpreted Pallas
    kernels copy their operands by construction, see test_decode.py)."""
    cfg = config(3)
    params = random_params(rng)
    traces = []

    def traced_step(state, tokens, slots, force):
        traces.append(1)  # Python side effect: runs once per trace
        return R.decode_step(state, tokens, slots, force, gate_params=params, policy="natural")

    step = jax.jit(traced_step, donate_argnums=0)
    state = R.init_state(cfg, NUM_SLOTS)
    for _ in range(7):
        tokens = jax.tree.map(jnp.asarray, random_tokens(rng, cfg, (3,), with_z=True))
        slots = jnp.asarray(rng.choice(np.arange(-2, NUM_SLOTS), 3, replace=False), jnp.int32)
        old = state
        _, state = step(state, tokens, slots, jnp.asarray(rng.random(3) < 0.3))
        assert all(leaf.is_deleted() for leaf in jax.tree.leaves(old)), "state was not donated"
    assert len(traces) == 1
    hlo_text = step.lower(state, tokens, slots, jnp.zeros(3, bool)).compile().as_text()
    assert aliased_parameters(hlo_text) >= set(range(len(jax.tree.leaves(state))))
    assert not state_sized_copies(hlo_text, state), "the step copies a state buffer"


def test_bad_mamba2_inputs_are_rejected(rng):
    cfg = config(4)
    params = random_params(rng)
    state = R.init_state(cfg, 2)
    tokens = jax.tree.map(jnp.asarray, random_tokens(rng, cfg, (2,), with_z=True))
    slots = jnp.array([0, 1])
    with pytest.raises(ValueError, match="needs gate_params=Mamba2Params"):
        R.decode_step(state, tokens, slots)
    with pytest.raises(ValueError, match="tokens must be a Mamba2Tokens"):
        R.decode_step(state, R.Tokens(tokens.x, tokens.x, tokens.x, tokens.dt, tokens.dt), slots, gate_params=params)
    with pytest.raises(ValueError, match=r"tokens.B must have shape \(2, 2, 32\)"):
        R.decode_step(state, tokens.replace(B=tokens.C[:, :1]), slots, gate_params=params)
    with pytest.raises(ValueError, match=r"tokens.z must have shape \(2, 4, 16\)"):
        R.decode_step(state, tokens.replace(z=tokens.x[:, :, :8]), slots, gate_params=params)
    with pytest.raises(ValueError, match=r"gate_params.D must have shape \(4,\)"):
        R.decode_step(state, tokens, slots, gate_params=R.Mamba2Params(params.A, params.D[:2], params.dt_bias))
    with pytest.raises(ValueError, match="use_qk_l2norm and scale"):
        R.decode_step(state, tokens, slots, gate_params=params, use_qk_l2norm=True)
    with pytest.raises(ValueError, match="needs gate_params"):
        R.materialize_state(state, slots)
