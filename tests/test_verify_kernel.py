"""`verify_step(backend="pallas_triton")` (the `verify_readout` kernel, interpret mode)
against the xla backend's verify and an independent float64 model of the recurrence (tree
windows: each position continues from its parent); stale cache entries holding NaN; the
kernel's lowering for an abstract H200.

Setup: a pool of slots with random checkpoints and histories decoded with `decode_step`,
rows on shuffled slots with a padding row, ragged window lengths, and rows whose history
plus window overflows the ring (they fold first, in the kernel).
"""

from __future__ import annotations

import dataclasses
import pathlib
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import (
    aliased_parameters,
    bits,
    random_tokens,
    rel_err,
    small_config,
    snapshot,
    state_sized_copies,
    to_device,
)
from replayssm_jax import accept, materialize_state, verify_step
from test_speculative import BF16_TOL, FP32_TOL, model_window, random_rows, with_history

ROOT = pathlib.Path(__file__).resolve().parents[1]
T = 3
DTYPES = {"fp32": (jnp.float32, FP32_TOL), "bf16": (jnp.bfloat16, BF16_TOL)}
STATE_FIELDS = ("checkpoint", "u_cache", "k_cache", "g_cache", "write_pos")

verify = jax.jit(verify_step, static_argnames=("backend", "use_qk_l2norm", "scale", "interpret"))


def _setup(rng, gate, state_dtype):
    """State on L = 2T with row 0 folding (full history), row 1 folding through its ragged
    length, row 2 empty, row 3 appending, row 4 padding."""
    config = small_config(gate, 2 * T, state_dtype)
    slots = random_rows(rng)
    history = np.array([2 * T - 1, T + 2, 0, 2, 0])
    lengths = np.array([T, 2, 1, T, T], np.int32)
    state = with_history(rng, config, slots, history)
    return config, slots, lengths, state


def random_tree(rng, batch: int) -> np.ndarray:
    """`[B, T]` parents: position i's parent drawn from -1 .. i-1 (chains and branches)."""
    return np.stack([rng.integers(-1, np.arange(T)) for _ in range(batch)]).astype(np.int32)


def _both(state, window, slots, lengths, parents=None):
    args = dict(lengths=jnp.asarray(lengths), use_qk_l2norm=True,
                parents=None if parents is None else jnp.asarray(parents))
    xla_out = verify(state, window, jnp.asarray(slots), backend="xla", **args)
    pallas_out = verify(state, window, jnp.asarray(slots), backend="pallas_triton", interpret=True, **args)
    return xla_out, pallas_out


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("gate", ["gdn", "kda"])
def test_pallas_verify_matches_xla_and_the_model(gate, dtype, rng):
    state_dtype, tol = DTYPES[dtype]
    config, slots, lengths, state = _setup(rng, gate, state_dtype)
    pos = np.asarray(state.write_pos)[np.maximum(slots, 0)]
    fold = (slots >= 0) & (pos + lengths > config.cache_len)
    np.testing.assert_array_equal(fold, [True, True, False, False, False])
    window = random_tokens(rng, config, (slots.size, T))
    parents = random_tree(rng, slots.size)  # tree windows: each position sees its ancestors
    live = np.asarray(jax.jit(materialize_state)(state, jnp.asarray(slots)))
    (y_x, s_x), (y_p, s_p) = _both(state, to_device(window), slots, lengths, parents)
    y_x, y_p = np.asarray(y_x, np.float32), np.asarray(y_p, np.float32)
    after_x, after_p = snapshot(s_x), snapshot(s_p)

    # Padding row and padding positions: exactly zero, as in the xla backend.
    for r in range(slots.size):
        n = lengths[r] if slots[r] >= 0 else 0
        assert np.all(y_p[r, n:] == 0), f"row {r}"
    # Against the xla verify: the same records and checkpoints (fp32: the kernel reorders
    # fp32 sums, FP32_TOL as in test_speculative; bf16: the stored values are rounded once
    # from fp32 values that differ by reordering, so they may differ by one bf16 ulp).
    active = slots >= 0
    in_window = active[:, None] & (np.arange(T)[None, :] < lengths[:, None])
    assert rel_err(y_p[in_window], y_x[in_window]).max() < tol
    for name in STATE_FIELDS:
        a, b = after_p[name].astype(np.float32), after_x[name].astype(np.float32)
        if name == "write_pos":
            np.testing.assert_array_equal(a, b)
        else:
            assert rel_err(a.reshape(1, -1), b.reshape(1, -1)).max() < tol, name
    # Slots no row names are untouched bit for bit (the kernel writes only folding rows).
    others = np.setdiff1d(np.arange(after_p["checkpoint"].shape[0]), slots[active])
    for name in STATE_FIELDS:
        np.testing.assert_array_equal(bits(after_p[name][others]), bits(snapshot(state)[name][others]))
    # Against the float64 model from the live state, per row and position.
    for r in np.flatnonzero(active):
        ys, _ = model_window(config, live[r], jax.tree.map(lambda x: x[r], window), parents[r], lengths[r])
        for i, want in enumerate(ys):
            assert rel_err(y_p[r, i][None], want[None]).max() < tol, (r, i)


@pytest.mark.parametrize("gate", ["gdn", "kda"])
def test_stale_nan_entries_never_reach_the_kernel(gate, rng):
    config, slots, lengths, state = _setup(rng, gate, jnp.float32)
    window = to_device(random_tokens(rng, config, (slots.size, T)))
    # NaN in every cache entry at or past each slot's cursor (never written or rejected).
    stale = np.arange(config.cache_len)[None, :] >= np.asarray(state.write_pos)[:, None]  # [N, L]
    poison = lambda c: jnp.where(stale.reshape(stale.shape[0], 1, stale.shape[1], *([1] * (c.ndim - 3))),
                                 jnp.nan, c)
    poisoned = dataclasses.replace(state, u_cache=poison(state.u_cache), k_cache=poison(state.k_cache),
                                   g_cache=poison(state.g_cache))
    args = dict(lengths=jnp.asarray(lengths), use_qk_l2norm=True, backend="pallas_triton", interpret=True)
    y_clean, s_clean = verify(state, window, jnp.asarray(slots), **args)
    y_nan, s_nan = verify(poisoned, window, jnp.asarray(slots), **args)
    # A masked entry is loaded as 0 whatever it holds: results equal bit for bit.
    assert np.all(np.isfinite(np.asarray(y_nan)))
    np.testing.assert_array_equal(bits(np.asarray(y_nan)), bits(np.asarray(y_clean)))
    np.testing.assert_array_equal(bits(np.asarray(s_nan.checkpoint)), bits(np.asarray(s_clean.checkpoint)))


sys.path.insert(0, str(ROOT / "benchmarks"))
import kernel_registers  # noqa: E402
from pallas_kernels.common import GridOrder  # noqa: E402
from pallas_kernels.verify_readout import VerifyReadoutParams  # noqa: E402
from replayssm_jax import ReplayConfig  # noqa: E402


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("gate", ["gdn", "kda"])
def test_verify_readout_lowers_for_h200(gate, dtype):
    # H200 shapes (H_k = 16, H_v = 32, d = 128), one kernel launch per verify step.
    cfg = ReplayConfig(16, 32, 128, 128, 16, gate=gate, state_dtype=dtype, cache_dtype=dtype)
    ir = kernel_registers.kernel_ir(cfg, VerifyReadoutParams(), 8)
    assert re.findall(r"tt\.func \w* ?@(\w+)", ir) == ["replayssm_verify_readout"]


def test_donated_pallas_verify_updates_the_state_in_place(rng):
    """Donated, the kernel's checkpoint and XLA's appends to the caches alias the input
    buffers and nothing copies the pool (a copy would move every slot's state per step)."""
    config, slots, lengths, state = _setup(rng, "gdn", jnp.float32)
    window = to_device(random_tokens(rng, config, (slots.size, T)))
    step = jax.jit(lambda s, w, sl: verify_step(s, w, sl, backend="pallas_triton", use_qk_l2norm=True,
                                                interpret=True), donate_argnums=0)
    hlo = step.lower(state, window, jnp.asarray(slots)).compile().as_text()
    assert aliased_parameters(hlo) >= set(range(len(jax.tree.leaves(state))))
    assert not state_sized_copies(hlo, state), state_sized_copies(hlo, state)


@pytest.mark.parametrize("gate", ["gdn", "kda"])
def test_rollback_schedule_matches_xla(gate, rng):
    """Verify, accept a random 0..T per row, verify again, ...: both backends keep the same
    outputs and live states, folds included (L = 2T: cursors cross the capacity rule)."""
    config, slots, lengths, state = _setup(rng, gate, jnp.float32)
    jslots = jnp.asarray(slots)
    states = {"xla": state, "pallas_triton": state}
    for _ in range(4):
        window = to_device(random_tokens(rng, config, (slots.size, T)))
        counts = jnp.asarray(rng.integers(0, T + 1, slots.size), jnp.int32)
        ys = {}
        for backend, st in states.items():
            extra = dict(interpret=True) if backend == "pallas_triton" else {}
            y, st = verify(st, window, jslots, backend=backend, use_qk_l2norm=True, **extra)
            ys[backend], states[backend] = np.asarray(y), jax.jit(accept)(st, jslots, counts)
        active = slots >= 0
        assert rel_err(ys["pallas_triton"][active], ys["xla"][active]).max() < FP32_TOL
        np.testing.assert_array_equal(states["pallas_triton"].write_pos, states["xla"].write_pos)
        live = {b: np.asarray(jax.jit(materialize_state)(s, jslots)) for b, s in states.items()}
        assert rel_err(live["pallas_triton"][active], live["xla"][active]).max() < FP32_TOL


@pytest.mark.parametrize("kwargs,match", [
    (dict(block_v=24), "block_v must be a power of two, got 24"),
    (dict(num_warps=3), "num_warps must be 1, 2, 4, 8 or 16, got 3"),
    (dict(rebuild_unroll=0), "rebuild_unroll must be in 1..16, got 0"),
    (dict(rebuild_unroll=True), "rebuild_unroll must be in 1..16, got True"),
    (dict(grid_order=GridOrder.LAUNCH_ORDER), "grid_order must be one of ROW_FASTEST, ROW_SLOWEST"),
], ids=repr)
def test_verify_readout_params_reject_bad_values(kwargs, match):
    with pytest.raises(ValueError, match=match):
        VerifyReadoutParams(**kwargs)
