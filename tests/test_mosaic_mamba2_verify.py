"""The Mosaic GPU Mamba-2 verify kernel against a float64 NumPy model that decodes each window
position along its branch, token by token, from the row's live state (the selective state
update written out here), and `verify_step(backend="mosaic_gpu")` against the xla backend.

Interpret mode on CPU (tiny shapes: P = N = 64, H = 2, L = 8, T = 3): appending, folding
and padding rows in one call, slots != rows, ragged window lengths (0 included), tree
windows, NaN / Inf in every stale cache entry, in positions past a row's length and in a
padding row's inputs; G in {1, 2}, fp32 and bf16 state, z on and off. A second test lowers
the kernel for an abstract H200 at Nemotron-H-8B shapes.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.mosaic_gpu.mamba2_decode import MosaicMamba2Params
from pallas_kernels.mosaic_gpu.verify_decode_mamba2 import mamba2_verify_decode_mgpu

NUM_SLOTS, H, P, N, L, T = 6, 2, 64, 64, 8, 3
SLOTS = np.array([4, 0, 2, 5], np.int32)
POS = np.array([5, 3, 7, 2], np.int32)
# Row 1 pads (length 0: the kernel derives each row's mode from its cursor and length), row 2
# folds (7 + 2 > 8).
LENGTHS = np.array([3, 0, 2, 1], np.int32)
PAD = np.array([False, True, False, False])
FOLD = ~PAD & (POS + LENGTHS > L)


def _branch(parents, i):
    """Window positions from the root to i (i's ancestors, then i)."""
    path = [i]
    while parents[path[-1]] >= 0:
        path.append(parents[path[-1]])
    return path[::-1]


def _ancestors(parents):
    anc = np.zeros((len(parents), T, T), bool)
    for b, row in enumerate(parents):
        for i in range(T):
            anc[b, i, _branch(row, i)[:-1]] = True
    return anc


def _round(x, dtype):
    return np.asarray(jnp.asarray(x, jnp.float32).astype(dtype).astype(jnp.float32), np.float64)


def _model(ckpt, x_c, b_c, dt_c, x, B, C, dt, z, A, D, parents, *, state_dtype):
    """Float64 verify: `(y, checkpoint, x_cache, b_cache, dt_cache)` with every live row's
    records at `base .. base + length - 1` (a folding row's from 0)."""
    ckpt, x_c, b_c, dt_c = (np.array(a, np.float64) for a in (ckpt, x_c, b_c, dt_c))
    b_in, dt_in = b_c.copy(), dt_c.copy()  # the history every head reads, before any record lands
    y = np.zeros(x.shape)
    group = H // B.shape[2]
    for b, (slot, pos, length) in enumerate(zip(SLOTS, POS, LENGTHS)):
        if PAD[b]:
            continue
        base = 0 if FOLD[b] else pos
        for h in range(H):
            g = h // group
            live = ckpt[slot, h] * np.exp(A[h] * dt_in[slot, h, :pos].sum())
            for j in range(pos):
                w = dt_in[slot, h, j] * np.exp(A[h] * dt_in[slot, h, j + 1:pos].sum())
                live = live + w * np.outer(x_c[slot, h, j], b_in[slot, g, j])
            if FOLD[b]:  # the folded checkpoint as stored, and the window read from it
                live = _round(live, state_dtype)
                ckpt[slot, h] = live
            for i in range(length):
                state = live
                for t in _branch(parents[b], i):
                    d = float(dt[b, t, h])
                    state = np.exp(A[h] * d) * state + d * np.outer(x[b, t, h], B[b, t, g])
                out = state @ C[b, i, g].astype(np.float64) + D[h] * x[b, i, h]
                if z is not None:
                    out = out * z[b, i, h] / (1.0 + np.exp(-z[b, i, h].astype(np.float64)))
                y[b, i, h] = out
                x_c[slot, h, base + i] = x[b, i, h]
                dt_c[slot, h, base + i] = dt[b, i, h]
                b_c[slot, g, base + i] = B[b, i, g]
    return y, ckpt, x_c, b_c, dt_c


def _inputs(rng, groups, state_dtype, with_z, head_dim=P):
    f = lambda *s: rng.standard_normal(s).astype(np.float32)
    ckpt = f(NUM_SLOTS, H, head_dim, N) * 0.3
    x_c, b_c = f(NUM_SLOTS, H, L, head_dim), f(NUM_SLOTS, groups, L, N) * 0.3
    dt_c = rng.uniform(0.01, 0.3, (NUM_SLOTS, H, L)).astype(np.float32)
    for slot, pos in zip(SLOTS, POS):  # stale entries: never read
        x_c[slot, :, pos:], b_c[slot, :, pos:], dt_c[slot, :, pos:] = np.nan, np.inf, np.nan
    ckpt = _round(ckpt, state_dtype).astype(np.float32)
    x_c, b_c = (_round(a, state_dtype).astype(np.float32) for a in (x_c, b_c))
    batch = len(SLOTS)
    # x and B bf16-representable so their records compare exactly in both dtypes.
    x, B = (_round(a, jnp.bfloat16).astype(np.float32)
            for a in (f(batch, T, H, head_dim), f(batch, T, groups, N) * 0.3))
    C, z = f(batch, T, groups, N), f(batch, T, H, head_dim) if with_z else None
    dt = f(batch, T, H)  # raw: gated with the window
    past = np.arange(T)[None, :] >= np.where(PAD, 0, LENGTHS)[:, None]  # padding rows and positions
    for a in (x, B, C, dt) + ((z,) if with_z else ()):
        a[past] = np.nan
    A = -rng.uniform(0.5, 4.0, H).astype(np.float32)
    D = rng.standard_normal(H).astype(np.float32)
    parents = np.stack([rng.integers(-1, np.arange(T)) for _ in range(batch)]).astype(np.int32)
    return ckpt, x_c, b_c, dt_c, x, B, C, dt, z, A, D, parents


def _gated(dt, dt_bias, dt_softplus, dt_limit):
    """Mamba-2's time step in float64: `clip(softplus(dt + dt_bias), *dt_limit)` (NaN where
    dt is: positions past a row's length)."""
    dt = dt.astype(np.float64) + dt_bias.astype(np.float64)
    with np.errstate(invalid="ignore"):
        return np.clip(np.logaddexp(0.0, dt) if dt_softplus else dt, *dt_limit)


@pytest.mark.parametrize("groups,state_dtype,with_z,window_side,dt_softplus,dt_limit,head_dim", [
    (1, jnp.float32, True, "xla", True, (0.0, float("inf")), P),
    (2, jnp.float32, False, "kernel", True, (0.0, float("inf")), P),
    (2, jnp.bfloat16, True, "xla", False, (0.05, 0.4), P),
    (1, jnp.bfloat16, False, "kernel", True, (0.1, 0.3), P),
    (2, jnp.float32, True, "kernel", False, (0.02, 0.5), P),
    (1, jnp.float32, True, "kernel", True, (0.0, float("inf")), 2 * P),  # two tiles a head
])
def test_verify_matches_the_float64_model(rng, groups, state_dtype, with_z, window_side, dt_softplus, dt_limit,
                                          head_dim):
    """The window's scalars formed by XLA and by their Pallas Triton kernel
    (`window_side`), raw time steps gated with and without the softplus and the clamp; one
    tile a head (a folding row's dt records written by its CTA) and two (by XLA after the
    launch: the head's other tile may still read them)."""
    ckpt, x_c, b_c, dt_c, x, B, C, dt, z, A, D, parents = _inputs(rng, groups, state_dtype, with_z, head_dim)
    dt_bias = rng.uniform(-3.0, 0.5, H).astype(np.float32)
    if not dt_softplus:  # a positive time step without the softplus
        dt = np.abs(dt)
    # The padding row's slot out of range with a full requested length (its inputs NaN);
    # the live rows' cursors at POS, the unused slots' drawn.
    slots = np.where(PAD, rng.choice([-1, NUM_SLOTS]), SLOTS).astype(np.int32)
    cursors = rng.integers(1, L, NUM_SLOTS).astype(np.int32)
    cursors[SLOTS[~PAD]] = POS[~PAD]
    *out, got_cursors = mamba2_verify_decode_mgpu(
        jnp.asarray(ckpt, state_dtype), jnp.asarray(x_c, state_dtype), jnp.asarray(b_c, state_dtype),
        jnp.asarray(dt_c), *(jnp.asarray(a) for a in (x, B, C, dt, A, D, dt_bias)),
        jnp.asarray(slots), jnp.asarray(cursors), jnp.asarray(np.where(PAD, T, LENGTHS).astype(np.int32)),
        jnp.asarray(_ancestors(parents)), z=None if z is None else jnp.asarray(z), dt_softplus=dt_softplus,
        dt_limit=dt_limit, params=MosaicMamba2Params(window_side=window_side), interpret=True)
    # the kernel resets the folding rows' cursors in place
    np.testing.assert_array_equal(got_cursors, np.where(np.isin(np.arange(NUM_SLOTS), SLOTS[FOLD]), 0, cursors))
    want = _model(ckpt, x_c, b_c, dt_c, x, B, C, _gated(dt, dt_bias, dt_softplus, dt_limit), z, A, D, parents,
                  state_dtype=state_dtype)
    # fp32: float64 sums vs fp32 FMAs in another order (~1e-6 of the largest entry).
    # bf16 state: the inputs are the rounded values in both and the folded state's rounding
    # is modelled; a folded entry near a rounding boundary may round the other way (one
    # bf16 ulp, 2^-8 of the value).
    tol = 2e-5 if state_dtype == jnp.float32 else 1e-2
    for name, got, ref in zip(("y", "checkpoint", "x_cache", "b_cache", "dt_cache"), out, want):
        got = np.asarray(jnp.asarray(got).astype(jnp.float32), np.float64)
        stale = ~np.isfinite(ref)
        np.testing.assert_array_equal(~np.isfinite(got), stale, err_msg=f"{name}: a non-finite value moved")
        scale = np.max(np.abs(np.where(stale, 0.0, ref))) + 1e-30
        np.testing.assert_allclose(np.where(stale, 0.0, got) / scale, np.where(stale, 0.0, ref) / scale,
                                   atol=tol, err_msg=name)
    y = np.asarray(out[0], np.float32)
    assert not np.any(y[PAD]), "padding rows must output zeros"
    assert not np.any(y[np.arange(T)[None, :] >= LENGTHS[:, None]]), "positions past a row's length output zeros"


def _lower_for_h200(state_dtype, *, heads=128, head_dim=64, state_size=128, groups=8, cache_len=16, width=4,
                    with_z=True):
    """The jitted, donated verify at Nemotron-H-8B shapes, lowered for CUDA on CPU: the
    Mosaic GPU module text."""
    S = jax.ShapeDtypeStruct
    n, b, i32, f32, bf16 = 16, 8, jnp.int32, jnp.float32, jnp.bfloat16
    args = [S((n, heads, head_dim, state_size), state_dtype), S((n, heads, cache_len, head_dim), state_dtype),
            S((n, groups, cache_len, state_size), state_dtype), S((n, heads, cache_len), f32),
            S((b, width, heads, head_dim), bf16), S((b, width, groups, state_size), bf16),
            S((b, width, groups, state_size), bf16), S((b, width, heads), f32), S((heads,), f32), S((heads,), f32),
            S((heads,), f32), S((b,), i32), S((n,), i32), S((b,), i32), S((b, width, width), jnp.bool_)]
    if with_z:
        args.append(S((b, width, heads, head_dim), bf16))

    def step(*a):
        return mamba2_verify_decode_mgpu(*a[:15], z=a[15] if with_z else None, interpret=False)

    # the pool's cursors (argument 12) donated as the state arrays
    return jax.jit(step, donate_argnums=(0, 1, 2, 3, 12)).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("state_dtype,with_z", [(jnp.float32, True), (jnp.bfloat16, False)])
def test_lowers_for_an_abstract_h200(state_dtype, with_z):
    """Nemotron-H-8B: H = 128, P = 64, N = 128, G = 8, L = 16, T = 4 (the window's scalars
    from their Triton kernel: `test_verify_coefficients`)."""
    assert "mosaic_gpu" in _lower_for_h200(state_dtype, with_z=with_z)


def test_refuses_shapes_it_cannot_take():
    z = lambda *s, dtype=jnp.float32: jnp.zeros(s, dtype)
    state = lambda length=8, groups=1: [z(2, 2, 64, 64), z(2, 2, length, 64), z(2, groups, length, 64),
                                        z(2, 2, length)]
    window = lambda t, groups=1, p=64: [z(1, t, 2, p), z(1, t, groups, 64), z(1, t, groups, 64), z(1, t, 2),
                                        z(2), z(2), z(2)]
    rows = [jnp.zeros((1,), jnp.int32), jnp.zeros((2,), jnp.int32), jnp.zeros((1,), jnp.int32)]
    anc = lambda t: jnp.zeros((1, t, t), bool)
    with pytest.raises(ValueError, match="window width T"):
        mamba2_verify_decode_mgpu(*state(), *window(9), *rows, anc(9))
    with pytest.raises(ValueError, match="window width T"):
        mamba2_verify_decode_mgpu(*state(), *window(17), *rows, anc(17))
    with pytest.raises(ValueError, match="anc must have shape"):
        mamba2_verify_decode_mgpu(*state(), *window(2), *rows, jnp.zeros((1, 2, 3), bool))
    with pytest.raises(ValueError, match="z must have x's shape"):
        mamba2_verify_decode_mgpu(*state(), *window(2), *rows, anc(2), z=z(1, 2, 2, 32))
    with pytest.raises(ValueError, match=r"dt must be \[B, T, H\]"):
        mamba2_verify_decode_mgpu(*state(), *window(2)[:6], z(3), *rows, anc(2))
    with pytest.raises(ValueError, match=r"dt must be \[B, T, H\]"):
        mamba2_verify_decode_mgpu(*state(), *window(2)[:3], z(1, 2, 3), *window(2)[4:], *rows, anc(2))
    with pytest.raises(ValueError, match="multiple of the group count"):
        mamba2_verify_decode_mgpu(*state(groups=3), *window(2, groups=3), *rows, anc(2))
    with pytest.raises(ValueError, match="head dim P a multiple of 64"):
        mamba2_verify_decode_mgpu(*state(), *window(2, p=32), *rows, anc(2))
    with pytest.raises(ValueError, match="dt_cache must be float32"):
        mamba2_verify_decode_mgpu(*state()[:3], z(2, 2, 8, dtype=jnp.bfloat16), *window(2), *rows, anc(2))
    with pytest.raises(ValueError, match="programs must be 0"):
        mamba2_verify_decode_mgpu(*state(), *window(2), *rows, anc(2), params=MosaicMamba2Params(programs=4))
    with pytest.raises(ValueError, match="auto_barriers must be True"):
        mamba2_verify_decode_mgpu(*state(), *window(2), *rows, anc(2), params=MosaicMamba2Params(auto_barriers=False))
    with pytest.raises(ValueError, match="chunk must be 0"):
        mamba2_verify_decode_mgpu(*state(), *window(2), *rows, anc(2), params=MosaicMamba2Params(chunk=4))


def _poison_stale(state):
    """NaN / Inf in every cache entry at or past each slot's cursor (never read)."""
    stale = np.arange(L)[None, :] >= np.asarray(state.write_pos)[:, None]  # [N_slots, L]
    at = lambda a: jnp.asarray(stale[:, None, :].reshape(*stale.shape[:1], 1, L, *[1] * (a.ndim - 3)))
    return dataclasses.replace(state, u_cache=jnp.where(at(state.u_cache), jnp.nan, state.u_cache),
                               k_cache=jnp.where(at(state.k_cache), jnp.inf, state.k_cache),
                               g_cache=jnp.where(at(state.g_cache), jnp.nan, state.g_cache))


@pytest.mark.parametrize("groups,state_dtype,with_z,width", [
    (1, jnp.float32, True, 3), (2, jnp.bfloat16, False, 2),
])
def test_backend_verify_and_accept_match_xla(rng, groups, state_dtype, with_z, width):
    """`verify_step(backend="mosaic_gpu")` against the xla backend through rounds of verify
    and accept (0..length tokens per row, chains and trees), with a padding row, rows that
    fold by the capacity rule and NaN in the stale cache entries, each backend on its own
    state."""
    from replayssm_jax import (Mamba2Params, Mamba2Tokens, ReplayConfig, accept, init_state, materialize_state,
                               verify_step)

    cfg = ReplayConfig.mamba2(H, P, N, groups, L, state_dtype=state_dtype, cache_dtype=state_dtype)
    params = Mamba2Params(A=jnp.asarray(-rng.uniform(0.5, 4.0, H), jnp.float32),
                          D=jnp.asarray(rng.standard_normal(H), jnp.float32),
                          dt_bias=jnp.asarray(rng.uniform(-3.0, -1.0, H), jnp.float32))
    start = jnp.asarray(rng.standard_normal((4, H, P, N)) * 0.3, state_dtype)
    states = {b: init_state(cfg, 4, checkpoint=start) for b in ("xla", "mosaic_gpu")}
    slots = jnp.asarray([2, -1, 0, 3], jnp.int32)
    verify = jax.jit(verify_step, static_argnames=("backend",))
    # fp32: two summation orders (~1e-7 relative). bf16: both backends round the stores to
    # bf16, and an entry that rounds differently differs by one bf16 ulp.
    tol = 1e-5 if state_dtype == jnp.float32 else 2e-2
    folds = 0
    for round_ in range(8):
        f = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)
        window = Mamba2Tokens(f(4, width, H, P), f(4, width, groups, N) * 0.3, f(4, width, groups, N),
                              f(4, width, H), f(4, width, H, P) if with_z else None)
        lengths = rng.integers(0, width + 1, 4).astype(np.int32)
        lengths[0] = width  # row 0 takes whole windows and accepts them: it must fold
        parents = (np.stack([rng.integers(-1, np.arange(width)) for _ in range(4)]).astype(np.int32)
                   if round_ % 2 else None)
        extra = dict(lengths=jnp.asarray(lengths), parents=None if parents is None else jnp.asarray(parents),
                     gate_params=params)
        cursors = np.asarray(states["xla"].write_pos)[np.asarray(slots)]
        folds += int(np.sum((np.asarray(slots) >= 0) & (cursors + lengths > cfg.cache_len)))
        ys = {}
        for b in states:
            ys[b], states[b] = verify(_poison_stale(states[b]), window, slots, backend=b, **extra)
        np.testing.assert_allclose(np.asarray(ys["mosaic_gpu"], np.float32), np.asarray(ys["xla"], np.float32),
                                   atol=tol, rtol=tol, err_msg=f"y in round {round_}")
        counts = rng.integers(0, lengths + 1).astype(np.int32)
        counts[0] = lengths[0]
        counts = jnp.asarray(counts)
        # A tree's accepted path: the branch to the last accepted position (a chain: 0..n-1).
        path = None
        if parents is not None:
            branches = [_branch(parents[r], int(lengths[r]) - 1) if lengths[r] else [] for r in range(4)]
            counts = jnp.asarray([len(p) for p in branches], jnp.int32)
            path = jnp.asarray([(p + [0] * width)[:width] for p in branches], jnp.int32)
        for b in states:
            states[b] = accept(states[b], slots, counts, path=path)
        np.testing.assert_array_equal(np.asarray(states["mosaic_gpu"].write_pos), np.asarray(states["xla"].write_pos))
        live = {b: materialize_state(s, jnp.arange(4, dtype=jnp.int32), params) for b, s in states.items()}
        np.testing.assert_allclose(np.asarray(live["mosaic_gpu"]), np.asarray(live["xla"]), atol=tol, rtol=tol,
                                   err_msg=f"live states after round {round_}")
    assert folds, "the schedule must cross the capacity rule"
