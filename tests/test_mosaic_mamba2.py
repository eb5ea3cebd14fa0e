"""The Mosaic GPU Mamba-2 decode kernel against a float64 NumPy model of one step.

Runs in Mosaic GPU interpret mode on CPU (tiny batch, the kernel's smallest tile shapes),
with padding, append and flush rows in one call, slots != rows, two tiles per head, and
NaN / Inf planted in every stale cache entry and in a padding row's inputs. A second test
lowers the kernel for an abstract H200 at the Nemotron-H-8B and Mamba-2 2.7B shapes
(layout inference and shared-memory transforms run there), so a layout the hardware
cannot take fails CI without a GPU; a third runs the backend against xla over steps.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import replayssm_jax as R
from helpers import aliased_parameters, state_sized_copies
from pallas_kernels import common
from pallas_kernels.mosaic_gpu.mamba2_decode import MosaicMamba2Params, check_shapes, mamba2_replay_decode_mgpu
from pallas_kernels.mosaic_gpu.replay_decode import MosaicReplayParams

NUM_SLOTS, P, N, L = 6, 128, 64, 8  # P = 128: two 64-row tiles per head
SLOTS = np.array([4, 0, 2, 5, 1], np.int32)
MODES = np.array([common.MODE_APPEND, common.MODE_PAD, common.MODE_FLUSH, common.MODE_APPEND, common.MODE_FLUSH],
                 np.int32)
POS = np.array([5, 3, 7, 0, 0], np.int32)
DT_LIMIT = (0.01, 0.5)


def _dt(raw, bias):
    x = raw.astype(np.float64) + bias
    return np.clip(np.where(x > 20.0, x, np.log1p(np.exp(np.minimum(x, 20.0)))), *DT_LIMIT)


def _model_step(state, x_c, b_c, dt_c, x, B, C, dt_raw, z, A, D, dt_bias):
    """Float64 selective-state step on the live state rebuilt from checkpoint + records:
    `(y, state, x_cache, b_cache, dt_cache)` after the step."""
    state, x_c, b_c, dt_c = (np.array(a, np.float64) for a in (state, x_c, b_c, dt_c))
    heads, groups = x.shape[1], B.shape[1]
    y = np.zeros(x.shape)
    for row, (slot, pos, mode) in enumerate(zip(SLOTS, POS, MODES)):
        if mode == common.MODE_PAD:
            continue
        for h in range(heads):
            g = h // (heads // groups)
            live = state[slot, h]
            for j in range(pos):  # the plain recurrence over the cached window
                dt_j = dt_c[slot, h, j]
                live = np.exp(A[h] * dt_j) * live + dt_j * np.outer(x_c[slot, h, j], b_c[slot, g, j])
            dt = _dt(dt_raw[row, h], dt_bias[h])
            new = np.exp(A[h] * dt) * live + dt * np.outer(x[row, h], B[row, g])
            out = new @ C[row, g].astype(np.float64) + D[h] * x[row, h]
            y[row, h] = out if z is None else out * z[row, h] / (1.0 + np.exp(-z[row, h].astype(np.float64)))
            if mode == common.MODE_FLUSH:
                state[slot, h] = new
            else:
                x_c[slot, h, pos] = x[row, h]
                dt_c[slot, h, pos] = dt
                b_c[slot, g, pos] = B[row, g]
    return y, state, x_c, b_c, dt_c


def _round(a, dtype):
    return np.array(jnp.asarray(a).astype(dtype).astype(jnp.float32))


def _inputs(rng, heads, groups, state_dtype, use_z):
    f = lambda *s: rng.standard_normal(s).astype(np.float32)
    state = _round(f(NUM_SLOTS, heads, P, N), state_dtype)
    x_c, b_c = _round(f(NUM_SLOTS, heads, L, P), state_dtype), _round(f(NUM_SLOTS, groups, L, N) * 0.3, state_dtype)
    dt_c = (rng.random((NUM_SLOTS, heads, L)) * 0.3 + 0.01).astype(np.float32)
    # Stale entries (at and past each row's cursor) hold NaN / Inf: they must never be read.
    for slot, pos in zip(SLOTS, POS):
        x_c[slot, :, pos:], b_c[slot, :, pos:], dt_c[slot, :, pos:] = np.nan, np.inf, np.nan
    batch = len(SLOTS)
    x, B, C = f(batch, heads, P), f(batch, groups, N), f(batch, groups, N)
    dt_raw, z = f(batch, heads) - 2.0, f(batch, heads, P) if use_z else None
    pad = MODES == common.MODE_PAD
    x[pad], C[pad], dt_raw[pad] = np.nan, np.inf, np.nan  # a padding row's inputs reach nothing
    if use_z:
        z[pad] = np.nan
    return (state, x_c, b_c, dt_c), (x, B, C, dt_raw, z)


@pytest.mark.parametrize("state_dtype,heads,groups,use_z,programs,chunk,readout,grouped,ordered", [
    (jnp.float32, 2, 1, True, 0, 0, "fma", None, False), (jnp.float32, 2, 2, False, 0, 0, "fma", None, False),
    (jnp.bfloat16, 2, 2, True, 0, 0, "fma", None, False), (jnp.bfloat16, 2, 1, False, 0, 0, "fma", True, False),
    (jnp.float32, 2, 2, True, 3, 0, "fma", None, False), (jnp.float32, 2, 2, True, 3, 0, "fma", True, False),
    (jnp.bfloat16, 2, 1, False, 7, 0, "fma", True, False), (jnp.float32, 2, 1, True, 3, 3, "fma", True, False),
    (jnp.float32, 2, 2, True, 3, 0, "mma", None, False), (jnp.bfloat16, 2, 1, False, 0, 0, "mma", None, False),
    (jnp.bfloat16, 2, 2, True, 7, 0, "mma", True, False), (jnp.float32, 2, 2, True, 3, 3, "fma", None, True),
])
def test_step_matches_the_float64_model(rng, state_dtype, heads, groups, use_z, programs, chunk, readout, grouped,
                                        ordered):
    """programs > 0: persistent CTAs over the 20 tiles (3: 7, 7 and 6 each; 7: two or three),
    in chunks of one head group's tiles, or of 3 tiles that cut across the groups; the B
    records copied with every tile (the default at these shapes) or once per group
    (`group_records=True`, as at fp32 rings of 32). The "mma"
    readout takes bf16 B and C (the model gets the same rounded values); interpret mode
    runs its `wgmma` as a dot of the same bf16 parts (a bf16 tile from its buffer).
    `ordered`: the rows served in a random `row_order` (`launch_order=True`)."""
    pools, (x, B, C, dt_raw, z) = _inputs(rng, heads, groups, state_dtype, use_z)
    bc_dtype = jnp.bfloat16 if readout == "mma" else jnp.float32
    B, C = _round(B, bc_dtype), _round(C, bc_dtype)
    A = -rng.random(heads).astype(np.float32) * 4.0 - 0.5
    D, dt_bias = rng.standard_normal(heads).astype(np.float32), rng.standard_normal(heads).astype(np.float32) * 0.5
    state, x_c, b_c, dt_c = pools
    out = mamba2_replay_decode_mgpu(
        jnp.asarray(state, state_dtype), jnp.asarray(x_c, state_dtype), jnp.asarray(b_c, state_dtype),
        jnp.asarray(dt_c), jnp.asarray(x), jnp.asarray(B, bc_dtype), jnp.asarray(C, bc_dtype), jnp.asarray(dt_raw),
        jnp.asarray(A), jnp.asarray(D), jnp.asarray(dt_bias), jnp.asarray(SLOTS), jnp.asarray(POS),
        jnp.asarray(MODES), z=None if z is None else jnp.asarray(z), dt_limit=DT_LIMIT,
        params=MosaicMamba2Params(programs=programs, chunk=chunk, readout=readout, group_records=grouped,
                                  launch_order=ordered),
        row_order=jnp.asarray(rng.permutation(len(SLOTS)), jnp.int32) if ordered else None, interpret=True)
    want = _model_step(*pools, x, B, C, dt_raw, z, A, D, dt_bias)
    # fp32: the model's float64 sums vs fp32 FMAs in another order, relative ~1e-6 of the
    # largest entry. bf16 state/caches: the inputs are the rounded values in both, and the
    # stores round the new entries (unit roundoff 2^-9 of each value).
    tol = 2e-5 if state_dtype == jnp.float32 else 1e-2
    for name, got, ref in zip(("y", "state", "x_cache", "b_cache", "dt_cache"), out, want):
        got = np.asarray(jnp.asarray(got).astype(jnp.float32), np.float64)
        stale = ~np.isfinite(ref)
        np.testing.assert_array_equal(np.isnan(got), np.isnan(ref), err_msg=f"{name}: NaN moved")
        np.testing.assert_array_equal(np.isinf(got), np.isinf(ref), err_msg=f"{name}: Inf moved")
        scale = np.max(np.abs(np.where(stale, 0.0, ref))) + 1e-30
        np.testing.assert_allclose(np.where(stale, 0.0, got) / scale, np.where(stale, 0.0, ref) / scale,
                                   atol=tol, err_msg=name)
    y = np.asarray(out[0])
    assert not np.any(y[MODES == common.MODE_PAD]), "padding rows must output zeros"
    assert np.all(np.isfinite(y)), "a stale entry or a padding input reached an output"


def test_tokens_of_mixed_dtypes_are_promoted(rng):
    """x and B in bf16 with C and z in fp32: the kernel stages each pair in the promoted dtype
    (lossless), so it matches the all-fp32 step on the same rounded values; y comes back in
    x's dtype (bf16: one rounding, 2^-8 relative)."""
    pools, (x, B, C, dt_raw, z) = _inputs(rng, 2, 2, jnp.float32, True)
    A = -rng.random(2).astype(np.float32) - 0.5
    D, dt_bias = rng.standard_normal(2).astype(np.float32), np.zeros(2, np.float32)
    bf16 = lambda a: jnp.asarray(a, jnp.bfloat16)

    def step(x, B, C, z):
        return mamba2_replay_decode_mgpu(*map(jnp.asarray, pools), x, B, C, jnp.asarray(dt_raw), jnp.asarray(A),
                                         jnp.asarray(D), jnp.asarray(dt_bias), jnp.asarray(SLOTS), jnp.asarray(POS),
                                         jnp.asarray(MODES), z=z, params=MosaicMamba2Params(programs=3),
                                         interpret=True)

    mixed = step(bf16(x), bf16(B), jnp.asarray(C), jnp.asarray(z))
    wide = step(*(jnp.asarray(bf16(a), jnp.float32) for a in (x, B)), jnp.asarray(C), jnp.asarray(z))
    assert mixed[0].dtype == jnp.bfloat16
    live = MODES != common.MODE_PAD
    got, want = (np.asarray(jnp.asarray(o[0], jnp.float32))[live] for o in (mixed, wide))
    np.testing.assert_allclose(got, want, rtol=2 ** -8, atol=2 ** -8 * np.abs(want).max())
    for name, a, b in zip(("state", "x_cache", "b_cache", "dt_cache"), mixed[1:], wide[1:]):
        np.testing.assert_allclose(np.nan_to_num(np.asarray(a)), np.nan_to_num(np.asarray(b)), rtol=1e-6, atol=1e-6,
                                   err_msg=name)


# (H, G, z gate, dt clamp); P = 64, N = 128. The two option sets lower both ways of each option.
NEMOTRON_H_8B, MAMBA2_2_7B = (128, 8, True, (0.0, float("inf"))), (80, 1, False, (1e-4, 0.1))


@pytest.mark.parametrize("programs", [0, 264])
@pytest.mark.parametrize("cache_len", [8, 16, 32])
@pytest.mark.parametrize("state_dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("heads,groups,use_z,dt_limit", [NEMOTRON_H_8B, MAMBA2_2_7B])
def test_lowers_for_an_abstract_h200(heads, groups, use_z, dt_limit, state_dtype, cache_len, programs):
    """The benchmark shapes (caches in the state dtype, bf16 token), lowered for CUDA on CPU,
    one CTA per tile or persistent."""
    S = jax.ShapeDtypeStruct
    n, b, p, ns = 16, 8, 64, 128
    f32, bf16 = jnp.float32, jnp.bfloat16
    args = [S((n, heads, p, ns), state_dtype), S((n, heads, cache_len, p), state_dtype),
            S((n, groups, cache_len, ns), state_dtype), S((n, heads, cache_len), f32),
            S((b, heads, p), bf16), S((b, groups, ns), bf16), S((b, groups, ns), bf16), S((b, heads), f32),
            S((heads,), f32), S((heads,), f32), S((heads,), f32), S((b,), jnp.int32), S((b,), jnp.int32),
            S((b,), jnp.int32), S((b, heads, p), bf16)]
    step = lambda *a: mamba2_replay_decode_mgpu(*a[:-1], z=a[-1] if use_z else None, dt_limit=dt_limit,
                                                params=MosaicMamba2Params(programs=programs), interpret=False)
    text = jax.jit(step, donate_argnums=(0, 1, 2, 3)).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "replayssm_mamba2_decode_mgpu" in text


@pytest.mark.parametrize("rebuild,state_dtype,cache_len,programs,readout", [
    ("3xtf32", jnp.float32, 16, 264, "fma"), ("3xtf32", jnp.bfloat16, 32, 0, "fma"),
    ("tf32", jnp.float32, 8, 264, "fma"), ("bf16", jnp.float32, 16, 0, "fma"), ("3xtf32", jnp.float32, 32, 264, "fma"),
    ("3xtf32", jnp.bfloat16, 16, 264, "mma"), ("3xtf32", jnp.float32, 16, 264, "mma"),
    ("exact", jnp.bfloat16, 32, 0, "mma"),
])
def test_tensor_core_rebuilds_lower_for_an_abstract_h200(rebuild, state_dtype, cache_len, programs, readout):
    """The tensor-core flush rebuilds (`rebuild.rebuild_mma`, shared with GDN: its algebra is
    tested on CPU in `test_mosaic_kernels.py`) lower for the H200 at the Nemotron-H shapes;
    interpret mode cannot run wgmma, so their numbers come from the GPU check
    (`benchmarks/mosaic_bench.py`, mamba2-check section). With them the "mma" readout:
    a `wgmma` of the tile (registers for fp32, its buffer for bf16) by the staged raw C;
    a ring of 32 takes the rebuild's operands in two chunks."""
    S = jax.ShapeDtypeStruct
    heads, groups, n, b, p, ns = 128, 8, 16, 8, 64, 128
    f32, bf16 = jnp.float32, jnp.bfloat16
    args = [S((n, heads, p, ns), state_dtype), S((n, heads, cache_len, p), state_dtype),
            S((n, groups, cache_len, ns), state_dtype), S((n, heads, cache_len), f32),
            S((b, heads, p), bf16), S((b, groups, ns), bf16), S((b, groups, ns), bf16), S((b, heads), f32),
            S((heads,), f32), S((heads,), f32), S((heads,), f32), S((b,), jnp.int32), S((b,), jnp.int32),
            S((b,), jnp.int32)]
    params = MosaicMamba2Params(programs=programs, auto_barriers=not programs, rebuild=rebuild, readout=readout)
    step = lambda *a: mamba2_replay_decode_mgpu(*a, params=params, interpret=False)
    text = jax.jit(step, donate_argnums=(0, 1, 2, 3)).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "wgmma" in text


def test_tensor_core_rebuild_refusals():
    with pytest.raises(ValueError, match="rebuild must be one of"):
        MosaicMamba2Params(rebuild="fp8")
    cfg = R.ReplayConfig.mamba2(2, 64, 64, 1, 8)
    tokens = R.Mamba2Tokens(jnp.zeros((1, 2, 64)), jnp.zeros((1, 1, 64)), jnp.zeros((1, 1, 64)), jnp.zeros((1, 2)))
    params = R.Mamba2Params(jnp.full((2,), -1.0), jnp.ones((2,)), jnp.zeros((2,)))
    step = functools.partial(R.decode_step, R.init_state(cfg, 2), tokens, jnp.zeros((1,), jnp.int32),
                             backend="mosaic_gpu", gate_params=params)
    with pytest.raises(ValueError, match="interpret mode does not run"):
        step(kernel_params=MosaicMamba2Params(rebuild="3xtf32"))
    with pytest.raises(ValueError, match="needs cache_len a multiple of 16"):
        step(kernel_params=MosaicMamba2Params(rebuild="bf16"))
    with pytest.raises(ValueError, match="has no verify window: window_side must be 'xla'"):
        step(kernel_params=MosaicMamba2Params(window_side="kernel"))
    with pytest.raises(ValueError, match="window_side must be one of"):
        MosaicMamba2Params(window_side="triton")


@pytest.mark.parametrize("dims,match", [
    ((96, 128, 16, 4, 4), "head dim P a multiple of 64"), ((64, 96, 16, 4, 4), "state size N a multiple of 64"),
    ((64, 128, 12, 4, 4), "cache_len a multiple of 8"), ((64, 128, 4, 4, 4), "cache_len a multiple of 8"),
    ((64, 128, 256, 4, 4), "shared memory"),
])
def test_shape_checks_name_the_bad_size(dims, match):
    with pytest.raises(ValueError, match=match):
        check_shapes(*dims)
    with pytest.raises(ValueError, match="swizzle"):
        MosaicMamba2Params(swizzle=48)


@pytest.mark.parametrize("ordered", [False, True])
def test_backend_steps_match_xla(rng, ordered):
    """`decode_step(backend="mosaic_gpu")` against the xla backend over a schedule that
    crosses natural flushes, with a forced flush and a padding row, on its own state, and
    the donated step's HLO (bf16 and G = 1 are the kernel test's); `ordered`: two
    persistent programs serve the rows in the plan's launch order."""
    heads, groups, p, n, L = 2, 2, 64, 64, 8
    cfg = R.ReplayConfig.mamba2(heads, p, n, groups, L)
    params = R.Mamba2Params(A=jnp.asarray(-rng.uniform(0.5, 8.0, heads), jnp.float32),
                            D=jnp.asarray(rng.normal(size=heads), jnp.float32),
                            dt_bias=jnp.asarray(rng.uniform(-4.5, -2.0, heads), jnp.float32))
    start = jnp.asarray(rng.standard_normal((4, heads, p, n)) * 0.3, jnp.float32)
    states = {b: R.init_state(cfg, 4, checkpoint=jnp.copy(start)) for b in ("xla", "mosaic_gpu")}  # donated
    kernel_params = {"mosaic_gpu": MosaicMamba2Params(programs=2, launch_order=True) if ordered else None}
    steps = {b: jax.jit(functools.partial(R.decode_step, backend=b, policy="natural",
                                          kernel_params=kernel_params.get(b)), donate_argnums=0)
             for b in states}
    slots = jnp.asarray([2, -1, 0], jnp.int32)
    tol = 1e-5  # fp32: two summation orders (~1e-7 relative)
    relative = lambda got, ref, what: np.testing.assert_allclose(got / np.max(np.abs(ref)), ref / np.max(np.abs(ref)),
                                                                 atol=tol, err_msg=what)
    for step in range(L + 3):
        f = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)
        tokens = R.Mamba2Tokens(f(3, heads, p), f(3, groups, n), f(3, groups, n), f(3, heads), f(3, heads, p))
        force = jnp.asarray([False, False, step == 3])
        ys = {}
        for b in states:
            ys[b], states[b] = steps[b](states[b], tokens, slots, force, gate_params=params)
        relative(np.asarray(ys["mosaic_gpu"], np.float32), np.asarray(ys["xla"], np.float32), f"y at step {step}")
        np.testing.assert_array_equal(np.asarray(states["mosaic_gpu"].write_pos), np.asarray(states["xla"].write_pos))
    relative(np.asarray(states["mosaic_gpu"].checkpoint), np.asarray(states["xla"].checkpoint),
             "checkpoints (two flushes)")
    # In place: the donated state is aliased to the outputs and never copied (the kernel's
    # state refs hold in interpret mode too).
    hlo = steps["mosaic_gpu"].lower(states["mosaic_gpu"], tokens, slots, force, gate_params=params).compile().as_text()
    assert len(aliased_parameters(hlo)) == len(jax.tree.leaves(states["mosaic_gpu"]))  # only the state is donated
    assert not state_sized_copies(hlo, states["mosaic_gpu"]), state_sized_copies(hlo, states["mosaic_gpu"])
    live = {b: np.asarray(R.materialize_state(s, jnp.arange(4, dtype=jnp.int32), params)) for b, s in states.items()}
    relative(live["mosaic_gpu"], live["xla"], "live states")


def test_backend_refuses_the_gdn_kernel_params():
    cfg = R.ReplayConfig.mamba2(2, 64, 64, 1, 8)
    tokens = R.Mamba2Tokens(jnp.zeros((1, 2, 64)), jnp.zeros((1, 1, 64)), jnp.zeros((1, 1, 64)), jnp.zeros((1, 2)))
    params = R.Mamba2Params(jnp.full((2,), -1.0), jnp.ones((2,)), jnp.zeros((2,)))
    with pytest.raises(ValueError, match="kernel_params must be a MosaicMamba2Params"):
        R.decode_step(R.init_state(cfg, 2), tokens, jnp.zeros((1,), jnp.int32), backend="mosaic_gpu",
                      gate_params=params, kernel_params=MosaicReplayParams())
