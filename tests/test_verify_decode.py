"""The `verify_decode` kernel on its own (interpret mode), arrays in and out, against an
independent float64 model: the live state replayed entry by entry from the checkpoint and
the valid cache entries (`S <- S diag(alpha_j) + u_j k_j^T`), then the delta rule token by
token along each window position's branch.

Every case has folding rows (one full ring, one overflowing through its length), a row that
fills the ring exactly, an empty history, a row with no window (length 0), a padding row,
rows on shuffled slots, and NaN in every stale cache entry (at and past each slot's cursor);
chains and trees, GDN and KDA, fp32 and bf16 state and caches, and launch variants (column
chunks, several tiles per program, the dot fold, ieee dots).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import bits, random_log_decay, rel_err
from pallas_kernels import common
from pallas_kernels.verify_decode import VerifyDecodeParams, verify_decode, window_rows
from test_speculative import BF16_TOL, FP32_TOL

NUM_SLOTS, HK, HV, DK, DV, L, T = 8, 1, 2, 32, 32, 8, 3
# Per row: cursor, window length; the last row is padding.
CURSORS = np.array([L, L - 2, L - T, 0, 2, 0])
LENGTHS = np.array([T, T, T, 2, 0, T])

kernel = jax.jit(verify_decode, static_argnames=("use_qk_l2norm", "scale", "params", "interpret"))


def random_inputs(rng, per_channel: bool, state_dtype, tree: bool):
    """Slots, state arrays (stale entries NaN) and a window; returns a dict of numpy arrays."""
    batch = CURSORS.size
    slots = rng.choice(NUM_SLOTS, size=batch, replace=False).astype(np.int32)
    write_pos = rng.integers(0, L + 1, NUM_SLOTS)
    write_pos[slots] = CURSORS
    g_tail = (DK,) if per_channel else ()
    stale = np.arange(L)[None, :] >= write_pos[:, None]  # [N, L]
    poison = lambda x: np.where(stale.reshape(NUM_SLOTS, 1, L, *([1] * (x.ndim - 3))), np.nan, x)
    normal = lambda *shape: rng.normal(size=shape).astype(np.float32)
    keys = normal(NUM_SLOTS, HK, L, DK)
    keys /= np.linalg.norm(keys, axis=-1, keepdims=True)  # cached keys are normalised
    state = dict(
        checkpoint=(0.3 * normal(NUM_SLOTS, HV, DV, DK)).astype(state_dtype),
        u_cache=poison(0.3 * normal(NUM_SLOTS, HV, L, DV)).astype(state_dtype),
        k_cache=poison(keys).astype(state_dtype),
        g_cache=poison(random_log_decay(rng, (NUM_SLOTS, HV, L, *g_tail))),
    )
    if tree:
        parents = np.stack([rng.integers(-1, np.arange(T)) for _ in range(batch)])
    else:
        parents = np.tile(np.arange(T) - 1, (batch, 1))
    window = dict(q=normal(batch, T, HK, DK), k=normal(batch, T, HK, DK), v=normal(batch, T, HV, DV),
                  g=random_log_decay(rng, (batch, T, HV, *g_tail)),
                  beta=rng.uniform(0.05, 0.95, (batch, T, HV)).astype(np.float32))
    return dict(slots=slots, write_pos=write_pos, parents=parents.astype(np.int32), **state, **window)


def ancestors(parents: np.ndarray) -> np.ndarray:
    """`[B, T, T]` int32: j is a strict ancestor of i."""
    anc = np.zeros((*parents.shape, parents.shape[1]), np.int32)
    for b, row in enumerate(parents):
        for i in range(row.size):
            j = row[i]
            while j >= 0:
                anc[b, i, j] = 1
                j = row[j]
    return anc


def model_row(x: dict, r: int, per_channel: bool, state_dtype):
    """float64 `(y [T, HV, DV] (zeros past the length), u [T, HV, DV], live state before
    the window as the window's computation starts from it)` of row r."""
    f64 = lambda a: np.asarray(a, np.float64)
    slot, pos, length = x["slots"][r], CURSORS[r], LENGTHS[r]
    group = HV // HK
    alpha = lambda g: np.exp(g if per_channel else np.repeat(g[..., None], DK, -1))  # [HV, DK]
    live = f64(x["checkpoint"][slot])
    for j in range(pos):
        k_j = np.repeat(f64(x["k_cache"][slot][:, j]), group, axis=0)
        live = live * alpha(f64(x["g_cache"][slot][:, j]))[:, None, :] + \
            f64(x["u_cache"][slot][:, j])[:, :, None] * k_j[:, None, :]
    if pos + length > L:  # a folding row reads out from its checkpoint as stored
        live = f64(live.astype(state_dtype))
    norm = lambda a: a / np.sqrt(np.sum(a * a, axis=-1, keepdims=True) + 1e-6)
    q = np.repeat(norm(f64(x["q"][r])), group, axis=1) * DK**-0.5
    k = np.repeat(norm(f64(x["k"][r])), group, axis=1)
    ys, us, states = np.zeros((T, HV, DV)), np.zeros((T, HV, DV)), []
    for i in range(length):
        p = x["parents"][r, i]
        decayed = (live if p < 0 else states[p]) * alpha(f64(x["g"][r, i]))[:, None, :]
        u = f64(x["beta"][r, i])[:, None] * (f64(x["v"][r, i]) - np.einsum("hvk,hk->hv", decayed, k[i]))
        states.append(decayed + u[:, :, None] * k[i][:, None, :])
        ys[i], us[i] = np.einsum("hvk,hk->hv", states[-1], q[i]), u
    return ys, us, live


CASES = {
    "gdn-fp32-chain": ("gdn", jnp.float32, False, VerifyDecodeParams()),
    "gdn-fp32-tree-dotfold-chunks-tiles": (
        "gdn", jnp.float32, True, VerifyDecodeParams(block_v=16, tiles_per_program=2, fold_by_dot=True)),
    "gdn-bf16-tree": ("gdn", jnp.bfloat16, True, VerifyDecodeParams(column_chunk=0)),
    "kda-fp32-tree": ("kda", jnp.float32, True, VerifyDecodeParams(dot_precision="ieee")),
    "kda-fp32-chain-dotfold": ("kda", jnp.float32, False, VerifyDecodeParams(fold_by_dot=True, block_v=16)),
    "kda-bf16-chain": ("kda", jnp.bfloat16, False, VerifyDecodeParams(tiles_per_program=2, block_v=16)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_kernel_matches_the_float64_model(case, rng):
    gate, state_dtype, tree, params = CASES[case]
    per_channel = gate == "kda"
    tol = FP32_TOL if state_dtype == jnp.float32 else BF16_TOL
    x = random_inputs(rng, per_channel, state_dtype, tree)
    fold = CURSORS + LENGTHS > L
    live_rows = np.arange(CURSORS.size) < CURSORS.size - 1
    mode = common.row_modes(jnp.asarray(live_rows), jnp.asarray(fold & live_rows))
    state = tuple(jnp.asarray(x[name]) for name in ("checkpoint", "u_cache", "k_cache", "g_cache"))
    window = tuple(jnp.asarray(x[name]) for name in ("q", "k", "v", "g", "beta"))
    y, *after = kernel(*state, *window, jnp.asarray(ancestors(x["parents"])), jnp.asarray(x["slots"]),
                       jnp.asarray(CURSORS, jnp.int32), mode, jnp.asarray(LENGTHS, jnp.int32),
                       use_qk_l2norm=True, params=params, interpret=True)
    y = np.asarray(y)
    ckpt, u_cache, k_cache, g_cache = (np.asarray(a) for a in after)

    # The kernel only reads the k and g caches; a stale NaN never reaches an output.
    np.testing.assert_array_equal(bits(k_cache), bits(x["k_cache"]))
    np.testing.assert_array_equal(bits(g_cache), bits(x["g_cache"]))
    assert np.all(np.isfinite(y))
    assert np.all(y[~live_rows] == 0)
    written = np.zeros((NUM_SLOTS, L), bool)  # records the window wrote
    for r in np.flatnonzero(live_rows):
        slot, n = x["slots"][r], LENGTHS[r]
        base = 0 if fold[r] else CURSORS[r]
        want_y, want_u, live = model_row(x, r, per_channel, state_dtype)
        assert np.all(y[r, n:] == 0), f"row {r}: output past its length"
        for i in range(n):
            assert rel_err(y[r, i][None], want_y[i][None]).max() < tol, (r, i)
            assert rel_err(u_cache[slot][:, base + i][None], want_u[i][None]).max() < tol, (r, i)
        written[slot, base:base + n] = True
        if fold[r]:  # the folded checkpoint is the live state before the window
            assert rel_err(ckpt[slot][None], live[None]).max() < tol, r
    # Everything else is untouched bit for bit: other records (NaN included) and checkpoints.
    keep = np.broadcast_to(~written[:, None, :, None], u_cache.shape)
    np.testing.assert_array_equal(bits(u_cache[keep]), bits(x["u_cache"][keep]))
    unfolded = np.setdiff1d(np.arange(NUM_SLOTS), x["slots"][fold & live_rows])
    np.testing.assert_array_equal(bits(ckpt[unfolded]), bits(x["checkpoint"][unfolded]))


@pytest.mark.parametrize("width,rows", [(1, 16), (3, 16), (8, 16), (9, 32), (16, 32)])
def test_window_rows_hold_keys_and_queries(width, rows):
    # 2T stacked vectors, padded to a power of two >= 16 (the dots' minimum).
    assert window_rows(width) == rows
