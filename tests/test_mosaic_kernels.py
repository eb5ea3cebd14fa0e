"""The Mosaic GPU decode kernels (GDN, and KDA's per-channel decay) against a float64 NumPy
model of one step.

Runs in Mosaic GPU interpret mode on CPU (tiny batch, the kernels' smallest tile shapes),
with padding, append and flush rows in one call, slots != rows, and NaN / Inf planted in
every stale cache entry (g records included) and in a padding row's inputs. Other tests
lower the kernels for an abstract H200 at the benchmark shapes (layout inference and
shared-memory transforms run there), so a layout the hardware cannot take fails CI without
a GPU, and run the backend against xla over steps that cross natural and forced flushes.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import common
from pallas_kernels.mosaic_gpu import build
from pallas_kernels.mosaic_gpu.readout import pair_box, vector_pairs
from pallas_kernels.mosaic_gpu.rebuild import keys_exact, operand_entries, operand_parts, tf32_split
from pallas_kernels.mosaic_gpu.replay_decode import (MosaicReplayParams, check_own_layout, check_shapes,
                                                     replay_decode_mgpu)
from pallas_kernels.mosaic_gpu.replay_decode_kda import check_kda_shapes, replay_decode_kda_mgpu

NUM_SLOTS, H_K, H_V, D, L = 6, 1, 2, 64, 8
BLOCK = 64  # the kernels' state tile rows
SLOTS = np.array([4, 0, 2, 5, 1], np.int32)
MODES = np.array([common.MODE_APPEND, common.MODE_PAD, common.MODE_FLUSH, common.MODE_APPEND, common.MODE_FLUSH],
                 np.int32)
POS = np.array([5, 3, 7, 0, 0], np.int32)
EPS = 1e-6


def _softplus(x):
    return np.where(x > 20.0, x, np.log1p(np.exp(np.minimum(x, 20.0))))


def _model_step(ckpt, u_c, k_c, g_c, q, k, v, g, beta, a_log, dt_bias, *, l2norm, raw):
    """Float64 step: `(y, checkpoint, u_cache, k_cache, g_cache)` after the step. A GDN
    log-decay (g_c `[N, H_v, L]`, g `[B, H_v]`) is the per-channel one with every channel
    equal, so one model serves both gates."""
    ckpt, u_c, k_c, g_c = (np.array(x, np.float64) for x in (ckpt, u_c, k_c, g_c))
    per_channel = g_c.ndim == 4
    channels = (lambda x: x) if per_channel else (lambda x: np.asarray(x)[..., None])  # [.., d_k] or [.., 1]
    y = np.zeros(v.shape)
    for b, (slot, pos, mode) in enumerate(zip(SLOTS, POS, MODES)):
        if mode == common.MODE_PAD:
            continue
        for h in range(H_V):
            hk = h // (H_V // H_K)
            qh, kh = q[b, hk].astype(np.float64), k[b, hk].astype(np.float64)
            if l2norm:
                qh, kh = qh / np.sqrt(qh @ qh + EPS), kh / np.sqrt(kh @ kh + EPS)
            qh = qh * D ** -0.5
            gh, bh = g[b, h].astype(np.float64), float(beta[b, h])
            if raw:
                gh = -np.exp(a_log[h]) * _softplus(gh + dt_bias[h])
                bh = 1.0 / (1.0 + np.exp(-bh))
            g_rec = channels(g_c[slot, h])  # [L, d_k] or [L, 1]
            live = ckpt[slot, h] * np.exp(g_rec[:pos].sum(0))
            for j in range(pos):
                w = np.exp(g_rec[j + 1:pos].sum(0))
                live = live + np.outer(u_c[slot, h, j], w * k_c[slot, hk, j])
            alpha = np.exp(channels(gh))
            u = bh * (v[b, h] - live @ (alpha * kh))
            y[b, h] = live @ (alpha * qh) + u * (kh @ qh)
            if mode == common.MODE_FLUSH:
                ckpt[slot, h] = live * alpha + np.outer(u, kh)
            else:
                u_c[slot, h, pos] = u
                g_c[slot, h, pos] = gh
                k_c[slot, hk, pos] = kh
    return y, ckpt, u_c, k_c, g_c


def _inputs(rng, state_dtype, cache_dtype, per_channel, d_v=D):
    f = lambda *s: rng.standard_normal(s).astype(np.float32)
    channels = (D,) if per_channel else ()
    ckpt = f(NUM_SLOTS, H_V, d_v, D)
    u_c, k_c = f(NUM_SLOTS, H_V, L, d_v), f(NUM_SLOTS, H_K, L, D) * 0.2
    g_c = -np.abs(f(NUM_SLOTS, H_V, L, *channels)) * 0.2
    # Stale entries (at and past each row's cursor) hold NaN / Inf: they must never be read.
    for slot, pos in zip(SLOTS, POS):
        u_c[slot, :, pos:], k_c[slot, :, pos:], g_c[slot, :, pos:] = np.nan, np.inf, np.nan
    ckpt, u_c, k_c = (np.asarray(jnp.asarray(x).astype(dt).astype(jnp.float32))
                      for x, dt in ((ckpt, state_dtype), (u_c, cache_dtype), (k_c, cache_dtype)))
    batch = len(SLOTS)
    q, k, v = f(batch, H_K, D), f(batch, H_K, D), f(batch, H_V, d_v)
    g, beta = -np.abs(f(batch, H_V, *channels)) * 0.3, rng.random((batch, H_V)).astype(np.float32)
    pad = MODES == common.MODE_PAD
    q[pad], v[pad], g[pad] = np.nan, np.inf, np.nan  # a padding row's inputs reach nothing
    return ckpt, u_c, k_c, g_c, q, k, v, g, beta


_STEP_CONFIGS = [
    ("gdn", 0, D, "fma", None, {}), ("gdn", 3, D, "fma", None, {}), ("gdn", 3, D, "fma", True, {}),
    ("gdn", 4, D, "fma", None, dict(chunk=1)), ("gdn", 3, D, "fma", None, dict(key_side="xla")),
    ("gdn", 0, D, "mma", None, dict(key_side="xla")), ("gdn", 0, D, "mma", True, {}), ("gdn", 3, D, "mma", None, {}),
    ("gdn", 3, D, "fma", True, dict(per_tile_addresses=True)),
    ("gdn", 3, D, "mma", None, dict(key_side="xla", per_tile_addresses=True)),
    ("gdn", 3, D, "mma", True, {}),
    ("gdn", 6, D, "fma", None, dict(warpgroups=3, auto_barriers=False, key_side="xla")),
    ("gdn", 6, D, "mma", None, dict(warpgroups=3, auto_barriers=False, key_side="xla")),
    ("gdn", 3, D, "mma", None, dict(key_side="xla", per_tile_addresses=True, warpgroups=3, auto_barriers=False)),
    ("gdn", 8, D, "mma", None, dict(key_side="xla", per_tile_addresses=True, warpgroups=4, auto_barriers=False)),
    ("gdn", 0, D, "fma", None, dict(launch_order=True)),
    ("gdn", 3, D, "mma", None, dict(key_side="xla", warpgroups=3, auto_barriers=False, launch_order=True)),
    ("gdn", 0, D, "mma", None, dict(key_side="mma")),
    ("gdn", 6, D, "mma", True, dict(key_side="mma", warpgroups=3, auto_barriers=False)),
    ("kda", 0, D, "fma", None, {}), ("kda", 3, D, "fma", None, {}),
    ("kda", 3, 2 * D, "fma", None, {}), ("kda", 7, 2 * D, "fma", None, {}),
    ("kda", 3, 2 * D, "fma", None, dict(chunk=1)), ("kda", 7, 2 * D, "fma", None, dict(launch_order=True))]
# Each configuration runs once per state dtype, with q/k L2-normalised and activated gates
# on one and raw gates (the kernel's own gating) without the norm on the other, alternating
# which dtype gets which: every configuration and every dtype sees both prologues, at half
# the cases of their full product.
_DTYPES = [(jnp.float32, jnp.float32), (jnp.bfloat16, jnp.bfloat16)]
_PROLOGUES = [(True, False), (False, True)]
_STEP_CASES = [(*config, *_DTYPES[d], *_PROLOGUES[(i + d) % 2])
               for i, config in enumerate(_STEP_CONFIGS) for d in range(2)]


@pytest.mark.parametrize("gate,programs,d_v,readout,grouped,more,state_dtype,cache_dtype,l2norm,raw", _STEP_CASES)
def test_step_matches_the_float64_model(rng, gate, programs, d_v, readout, grouped, more, state_dtype, cache_dtype,
                                        l2norm, raw):
    """programs = 3: persistent CTAs over the 10 tiles (4, 3 and 3 each, in chunks of 3:
    both stages, an odd and an even count, chunks that cross rows, padding and flush tiles
    among them); chunk = 1: every tile its own chunk, dealt round robin over 4 CTAs (a
    group's tiles on different CTAs, each computing the group's values itself); the key
    side from XLA (`key_side="xla"`): every tile reads its group's values from a copy;
    `per_tile_addresses`: every buffer (grouped keys, shared values, the exact rebuild's
    record copies among them) through its unit axis at the tile's opaque zero. KDA at
    d_v = 64: every tile its own value head, so every tile fresh, each
    one's key and decay records copied while the tile before it is computed; at d_v = 128
    a value head's second tile reads the head's values its first tile computed (20 tiles in
    chunks of two; 7 programs: two or three chunks each, stages out of step with chunks;
    chunk = 1: a head's two tiles on different CTAs, each computing the head's values).
    GDN copies its key records with every tile (the default at these shapes) or once per
    group (`group_records=True`, as at fp32 rings of 32).
    GDN's "mma" readout takes bf16 q and k (the model gets the same rounded values): its
    `wgmma`s run in interpret mode as dots of the same bf16 parts (a bf16 tile from its
    buffer), so the staging, the product's columns and the flush's tile load are tested.
    `warpgroups`: three or four programs per CTA (four: the 512-thread CTA of
    `MAX_WARPGROUPS`, two CTAs of 8 programs over the 10 tiles, some with none).
    `launch_order`: the rows served in a random order (`row_order`), by persistent programs
    (a row's tiles then follow another row's in a chunk) or one CTA per tile. The key side on
    tensor cores (`key_side="mma"`) runs its `wgmma`s as dots of the same bf16 operands and
    shares its `[2, BV, L]` products through shared memory; with fp32 key records it is
    refused."""
    per_channel = gate == "kda"
    kernel = functools.partial(replay_decode_kda_mgpu if per_channel else replay_decode_mgpu,
                               params=MosaicReplayParams(programs=programs, readout=readout, group_records=grouped,
                                                         **more))
    ckpt, u_c, k_c, g_c, q, k, v, g, beta = _inputs(rng, state_dtype, cache_dtype, per_channel, d_v)
    qk_dtype = jnp.bfloat16 if readout == "mma" else jnp.float32
    q, k = (np.asarray(jnp.asarray(x, qk_dtype).astype(jnp.float32)) for x in (q, k))
    a_log = rng.standard_normal(H_V).astype(np.float32) * 0.3
    dt_bias = rng.standard_normal((H_V, D) if per_channel else H_V).astype(np.float32)
    if raw:
        g = rng.standard_normal(g.shape).astype(np.float32)
        g[MODES == common.MODE_PAD] = np.nan
    step = lambda: kernel(
        jnp.asarray(ckpt, state_dtype), jnp.asarray(u_c, cache_dtype), jnp.asarray(k_c, cache_dtype),
        jnp.asarray(g_c), jnp.asarray(q, qk_dtype), jnp.asarray(k, qk_dtype), jnp.asarray(v), jnp.asarray(g),
        jnp.asarray(beta), jnp.asarray(SLOTS), jnp.asarray(POS), jnp.asarray(MODES), use_qk_l2norm=l2norm,
        gate_params=(jnp.asarray(a_log), jnp.asarray(dt_bias)) if raw else None,
        row_order=jnp.asarray(rng.permutation(len(SLOTS)), jnp.int32) if more.get("launch_order") else None,
        interpret=True)
    if more.get("key_side") == "mma" and cache_dtype != jnp.bfloat16:
        with pytest.raises(ValueError, match="needs bf16 q, k and cache, got q bfloat16 and cache float32"):
            step()
        return
    out = step()
    want = _model_step(ckpt, u_c, k_c, g_c, q, k, v, g, beta, a_log, dt_bias, l2norm=l2norm, raw=raw)
    # fp32: the model's float64 sums vs fp32 FMAs in another order, relative ~1e-6 of the
    # largest entry. bf16 state/caches: the inputs are the rounded values in both, and the
    # stores round the new entries (unit roundoff 2^-9 of each value).
    tol = 2e-5 if state_dtype == jnp.float32 else 1e-2
    names = ("y", "checkpoint", "u_cache", "k_cache", "g_cache")
    for name, got, ref in zip(names, out, want):
        got = np.asarray(jnp.asarray(got).astype(jnp.float32), np.float64)
        stale = ~np.isfinite(ref)
        np.testing.assert_array_equal(np.isnan(got), np.isnan(ref), err_msg=f"{name}: NaN moved")
        scale = np.max(np.abs(np.where(stale, 0.0, ref))) + 1e-30
        np.testing.assert_allclose(np.where(stale, 0.0, got) / scale, np.where(stale, 0.0, ref) / scale,
                                   atol=tol, err_msg=name)
    assert not np.any(np.asarray(out[0])[MODES == common.MODE_PAD]), "padding rows must output zeros"


def test_each_pair_lies_in_one_aligned_box(rng):
    """`vector_pairs` and `pair_box`: (b, hk)'s q and k are rows j and j + 1 of the 8-row box
    at an aligned start, for every row and key head (three key heads: pairs at every even
    offset of a box, boxes crossing rows), and the rows past the last pair are zeros."""
    batch, num_k_heads = 5, 3
    q, k = (rng.standard_normal((batch, num_k_heads, D)).astype(np.float32) for _ in range(2))
    pairs = np.asarray(vector_pairs(jnp.asarray(q), jnp.asarray(k)))
    assert pairs.shape == (32, D)  # 30 rows padded to a multiple of 8
    columns = set()
    for b in range(batch):
        for hk in range(num_k_heads):
            start, j = (int(x) for x in pair_box(b, hk, num_k_heads))
            assert start % 8 == 0 and 0 <= j < j + 1 < 8
            np.testing.assert_array_equal(pairs[start + j], q[b, hk])
            np.testing.assert_array_equal(pairs[start + j + 1], k[b, hk])
            columns.add(j)
    assert columns == {0, 2, 4, 6}
    assert not pairs[30:].any()


def _lower_for_h200(kernel, state_dtype, cache_dtype, cache_len, raw, *, per_channel, head_dim=128,
                    params=MosaicReplayParams()):
    """The jitted, donated step at H_k = 16, H_v = 32 (the benchmark shapes), lowered for
    CUDA on CPU: the Mosaic GPU module text."""
    S = jax.ShapeDtypeStruct
    n, b, hk, hv, d = 16, 8, 16, 32, head_dim
    channels = (d,) if per_channel else ()
    args = [S((n, hv, d, d), state_dtype), S((n, hv, cache_len, d), cache_dtype),
            S((n, hk, cache_len, d), cache_dtype), S((n, hv, cache_len, *channels), jnp.float32),
            S((b, hk, d), jnp.bfloat16), S((b, hk, d), jnp.bfloat16), S((b, hv, d), jnp.bfloat16),
            S((b, hv, *channels), jnp.float32), S((b, hv), jnp.float32), S((b,), jnp.int32), S((b,), jnp.int32),
            S((b,), jnp.int32)] + [S((b,), jnp.int32)] * params.launch_order
    gate_params = (jnp.zeros((hv,)), jnp.zeros((hv, *channels))) if raw else None
    step = lambda *a, row_order=None: kernel(*a, use_qk_l2norm=True, gate_params=gate_params, params=params,
                                             row_order=row_order, interpret=False)
    if params.launch_order:  # the row order as the step's last argument
        step = lambda *a, step=step: step(*a[:-1], row_order=a[-1])
    return jax.jit(step, donate_argnums=(0, 1, 2, 3)).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


SLOW = pytest.mark.slow  # a second shape or option of a path that a faster lowering here also reaches


@pytest.mark.parametrize("state_dtype,cache_dtype,cache_len,raw", [
    (jnp.float32, jnp.float32, 16, False), (jnp.bfloat16, jnp.bfloat16, 16, True),
    (jnp.float32, jnp.bfloat16, 32, True), (jnp.float32, jnp.float32, 8, False), (jnp.float32, jnp.float32, 64, False),
])
@pytest.mark.parametrize("programs", [0, 264])
def test_lowers_for_an_abstract_h200(state_dtype, cache_dtype, cache_len, raw, programs):
    """GDN at the benchmark shapes (d = 128), one CTA per tile or persistent (264 CTAs for
    the 512 tiles of B = 8)."""
    text = _lower_for_h200(replay_decode_mgpu, state_dtype, cache_dtype, cache_len, raw, per_channel=False,
                           params=MosaicReplayParams(programs=programs))
    assert "mosaic_gpu" in text


@pytest.mark.parametrize("state_dtype,cache_len,params", [
    (jnp.float32, 16, MosaicReplayParams(readout="mma")),
    (jnp.float32, 16, MosaicReplayParams(programs=264, auto_barriers=False, rebuild="3xtf32", readout="mma")),
    (jnp.bfloat16, 16, MosaicReplayParams(programs=264, auto_barriers=False, rebuild="3xtf32", readout="mma")),
    # The key side from XLA: a flushing tile copies its key records for the tensor-core rebuild.
    (jnp.bfloat16, 16, MosaicReplayParams(programs=264, auto_barriers=False, rebuild="3xtf32", readout="mma",
                                          key_side="xla")),
    # Per-tile addresses: the tile's union with the tensor-core operands through its unit axis.
    (jnp.bfloat16, 16, MosaicReplayParams(programs=396, auto_barriers=False, rebuild="3xtf32", readout="mma",
                                          key_side="xla", per_tile_addresses=True)),
    (jnp.float32, 16, MosaicReplayParams(programs=264, auto_barriers=False, rebuild="3xtf32",
                                         per_tile_addresses=True)),
    (jnp.bfloat16, 32, MosaicReplayParams(readout="mma")),
    (jnp.float32, 32, MosaicReplayParams(programs=264, auto_barriers=False, rebuild="3xtf32", readout="mma")),
    # Three warpgroups per CTA, each a program with its own buffers and rebuild operands;
    # rows served in a launch order (the order read per tile).
    (jnp.bfloat16, 16, MosaicReplayParams(programs=396, auto_barriers=False, rebuild="3xtf32", readout="mma",
                                          key_side="xla", per_tile_addresses=True, warpgroups=3, launch_order=True)),
    (jnp.bfloat16, 16, MosaicReplayParams(programs=396, auto_barriers=False, rebuild="3xtf32", readout="mma",
                                          key_side="xla", warpgroups=3)),
    # Four warpgroups: buffers that fit four programs per SM (`persistent_programs`), with the
    # key side from XLA and exact folds, or with the default's (key side and 3xTF32 folds on
    # tensor cores) once the fold operands share each program's tile (`operands_in_tile`).
    (jnp.bfloat16, 16, MosaicReplayParams(programs=528, auto_barriers=False, rebuild="exact", readout="mma",
                                          key_side="xla", per_tile_addresses=True, warpgroups=4)),
    (jnp.bfloat16, 16, MosaicReplayParams(programs=528, auto_barriers=False, rebuild="3xtf32", readout="mma",
                                          key_side="mma", warpgroups=4, operands_in_tile=True)),
    # The key side on tensor cores: register A operands against the key records, its
    # products shared through shared memory, by one warpgroup per CTA or three.
    pytest.param(jnp.bfloat16, 16, MosaicReplayParams(programs=396, auto_barriers=False, rebuild="3xtf32",
                                                      readout="mma", key_side="mma", warpgroups=3), marks=SLOW),
    (jnp.bfloat16, 16, MosaicReplayParams(programs=264, auto_barriers=False, rebuild="3xtf32", readout="mma",
                                          key_side="mma", per_tile_addresses=True)),
])
def test_the_tensor_core_readout_lowers_for_an_abstract_h200(state_dtype, cache_len, params):
    """GDN's "mma" readout: `wgmma`s from the tile's three bf16 register parts (fp32 state)
    or from its swizzled buffer (bf16 state) against the staged raw q and k."""
    text = _lower_for_h200(replay_decode_mgpu, state_dtype, state_dtype, cache_len, True, per_channel=False,
                           params=params)
    assert "wgmma" in text


@pytest.mark.parametrize("state_dtype,cache_dtype,cache_len,raw,head_dim,params", [
    (jnp.float32, jnp.float32, 8, False, 128, MosaicReplayParams()),
    (jnp.float32, jnp.float32, 16, True, 128, MosaicReplayParams(programs=264, auto_barriers=False)),
    pytest.param(jnp.float32, jnp.float32, 16, False, 128,
                 MosaicReplayParams(programs=264, auto_barriers=False, rebuild="3xtf32"), marks=SLOW),
    (jnp.bfloat16, jnp.bfloat16, 16, False, 128, MosaicReplayParams(programs=264, rebuild="3xtf32")),
    pytest.param(jnp.float32, jnp.bfloat16, 32, True, 128, MosaicReplayParams(rebuild="tf32"), marks=SLOW),
    pytest.param(jnp.bfloat16, jnp.bfloat16, 32, True, 128, MosaicReplayParams(programs=132), marks=SLOW),
    (jnp.float32, jnp.float32, 16, False, 64, MosaicReplayParams(programs=264, rebuild="bf16")),
])
def test_kda_lowers_for_an_abstract_h200(state_dtype, cache_dtype, cache_len, raw, head_dim, params):
    """KDA at the benchmark shapes (d = 128; and d = 64, where two warps hold each channel),
    one CTA per tile or persistent, each flush rebuild."""
    text = _lower_for_h200(replay_decode_kda_mgpu, state_dtype, cache_dtype, cache_len, raw, per_channel=True,
                           head_dim=head_dim, params=params)
    assert "mosaic_gpu" in text
    assert ("wgmma" in text) == (params.rebuild != "exact")


@pytest.mark.parametrize("dims,match", [
    ((64, 96, 16, 4), "d_v a multiple of 64"), ((96, 64, 16, 4), "d_k a multiple of 64"),
    ((64, 64, 12, 4), "cache_len a multiple of 8"), ((64, 64, 4, 4), "cache_len a multiple of 8"),
])
def test_shape_checks_name_the_bad_size(dims, match):
    with pytest.raises(ValueError, match=match):
        check_shapes(*dims)
    with pytest.raises(ValueError, match="swizzle"):
        MosaicReplayParams(swizzle=48)


@pytest.mark.parametrize("rebuild,state_dtype,cache_len", [
    ("tf32", jnp.float32, 16), ("tf32", jnp.float32, 8), ("bf16", jnp.float32, 16), ("bf16", jnp.bfloat16, 32),
    ("tf32", jnp.bfloat16, 64), ("3xtf32", jnp.float32, 16), ("3xtf32", jnp.bfloat16, 32), ("3xtf32", jnp.float32, 8),
    ("3xtf32", jnp.float32, 24), ("3xtf32", jnp.bfloat16, 16),
])
def test_tensor_core_rebuilds_lower_for_an_abstract_h200(rebuild, state_dtype, cache_len):
    """The opt-in rebuilds (wgmma from swizzled K-major operands in a union with the tile
    buffer; three for "3xtf32"; a ring of 24 in chunks of 8, a bf16 tile's in chunks of 8)
    lower for the H200;
    interpret mode cannot run wgmma, so their numbers come from the GPU check
    (`benchmarks/mosaic_bench.py`, check section)."""
    text = _lower_for_h200(replay_decode_mgpu, state_dtype, state_dtype, cache_len, False, per_channel=False,
                           params=MosaicReplayParams(rebuild=rebuild))
    assert "wgmma" in text


@pytest.mark.parametrize("cache_len,rebuild,tile_bytes,entries", [
    (16, "3xtf32", 64 * 128 * 4, 16), (32, "3xtf32", 64 * 128 * 4, 16),  # 24 KiB in a 32 KiB fp32 tile
    (16, "3xtf32", 64 * 128 * 2, 8), (32, "tf32", 64 * 128 * 2, 16),  # a bf16 tile's 16 KiB
    (24, "3xtf32", 64 * 128 * 4, 8), (8, "3xtf32", 64 * 128 * 2, 8), (48, "bf16", 64 * 128 * 2, 16),
])
def test_rebuild_operand_chunks_fit_the_tile_and_divide_the_ring(cache_len, rebuild, tile_bytes, entries):
    """A `[64, d_k = 128]` tile's operands: the most entries up to 16 that divide the ring
    and fit the tile's buffer, but one 32-byte row at least."""
    assert operand_entries(cache_len, 64, 128, rebuild, tile_bytes) == entries


def _as_tf32(x):
    """fp32 as `wgmma` reads it for a tf32 operand: the low 13 mantissa bits dropped."""
    return (np.asarray(x, np.float32).view(np.uint32) & np.uint32(0xFFFFE000)).view(np.float32)


@pytest.mark.parametrize("rebuild", ["tf32", "bf16", "3xtf32"])
def test_tensor_core_rebuild_algebra_on_cpu(rng, rebuild):
    """The `wgmma` rebuild's algebra (interpret mode cannot run wgmma) in NumPy, as
    `rebuild_mma` forms it: `e^G S_c + (U^T diag(W)) K` with `U^T` and `W` zero past `pos`,
    stale keys replaced by 0, both operands rounded to the mode's type and the product
    accumulated in fp32, against the float64 rebuild. A stale key left in (here Inf) would
    reach every element through the product: zeroing it is what keeps other entries clean."""
    L, pos = 16, 11
    s_c = rng.standard_normal((BLOCK, 128)).astype(np.float32)
    u, k = rng.standard_normal((L, BLOCK)), rng.standard_normal((L, 128)) * 0.2
    g = -np.abs(rng.standard_normal(L)) * 0.2
    u[pos:], k[pos:], g[pos:] = np.nan, np.inf, np.nan
    history = sum(np.exp(g[j + 1:pos].sum()) * np.outer(u[j], k[j]) for j in range(pos))
    exact = s_c * np.exp(g[:pos].sum()) + history
    live = np.arange(L) < pos
    weights = np.where(live, np.exp([g[j + 1:pos].sum() for j in range(L)]), 0.0)
    a = np.where(live, u.T, 0.0) * weights  # [BV, L]: U^T diag(W)
    b = np.where(live, k.T, 0.0)  # [d_k, L]: K^T, stale keys 0
    rounded = _as_tf32 if rebuild != "bf16" else (lambda x: np.asarray(jnp.asarray(x, jnp.bfloat16), np.float32))
    decayed = np.float32(np.exp(g[:pos].sum())) * s_c
    if rebuild == "3xtf32":  # rebuild_mma's split: hi exact in tf32, lo truncated by the hardware
        (a_hi, a_lo), (b_hi, b_lo) = (map(np.asarray, tf32_split(jnp.asarray(x, jnp.float32))) for x in (a, b))
        assert np.array_equal(_as_tf32(a_hi), a_hi) and np.array_equal(a_hi + a_lo, a.astype(np.float32))
        product = sum(rounded(x) @ rounded(y).T for x, y in ((a_lo, b_hi), (a_hi, b_lo), (a_hi, b_hi)))
    else:
        product = rounded(a) @ rounded(b).T
    got = (decayed + product).astype(np.float32)
    # Each product of two rounded operands is off by at most ~2 units of the type's precision
    # (tf32 truncates 2^-10, bf16 rounds 2^-9; 3xtf32 keeps ~2^-21) relative to itself; summed
    # over pos entries of mixed signs that stays a few units of the history's largest element.
    unit = {"tf32": 2.0 ** -10, "bf16": 2.0 ** -9, "3xtf32": 2.0 ** -21}[rebuild]
    err = np.max(np.abs(got - exact)) / np.max(np.abs(history))
    assert err < 8 * unit, err
    if rebuild == "3xtf32":  # the bound: 1e-6 normwise of the fp32 (IEEE) rebuild
        ieee = (decayed + (a.astype(np.float32) @ b.astype(np.float32).T)).astype(np.float32)
        assert np.linalg.norm(got - ieee) / np.linalg.norm(ieee) < 1e-6
    else:
        assert err > 2.0 ** -20, "the operands were not rounded"
    with np.errstate(invalid="ignore"):
        assert np.all(np.isnan(rounded(a) @ rounded(k.T).T)), "a stale key reaches every element"


@pytest.mark.parametrize("keys_dtype", [jnp.bfloat16, jnp.float16])
def test_two_byte_keys_take_two_tensor_core_products(rng, keys_dtype):
    """"3xtf32" with 2-byte key records (`rebuild.keys_exact`): their tf32 split leaves a
    zero low part, so `rebuild_mma`'s two products (`lo hi + hi hi`, B's one buffer) are
    bit for bit its three (`lo hi + hi lo + hi hi`), summed in the same order; fp32 keys
    keep both parts. The smaller operands take a whole ring of 16 in a bf16 tile's bytes."""
    a = rng.standard_normal((BLOCK, 16)).astype(np.float32)
    keys = np.asarray(jnp.asarray(rng.standard_normal((128, 16)), keys_dtype).astype(jnp.float32))
    (a_hi, a_lo), (b_hi, b_lo) = (map(np.asarray, tf32_split(jnp.asarray(x))) for x in (a, keys))
    assert np.array_equal(b_hi, keys) and not np.any(b_lo)
    three = (a_lo @ b_hi.T + a_hi @ b_lo.T) + a_hi @ b_hi.T
    two = a_lo @ keys.T + a_hi @ keys.T
    np.testing.assert_array_equal(two, three)
    assert keys_exact("3xtf32", keys_dtype) and not keys_exact("3xtf32", jnp.float32)
    assert not keys_exact("tf32", keys_dtype)
    assert operand_parts("3xtf32", keys_dtype) == (2, 1) and operand_parts("3xtf32", jnp.float32) == (2, 2)
    assert operand_entries(16, 64, 128, "3xtf32", 64 * 128 * 2, keys_dtype) == 16
    assert operand_entries(16, 64, 128, "3xtf32", 64 * 128 * 2, jnp.float32) == 8


def test_tensor_core_rebuild_refusals(rng):
    with pytest.raises(ValueError, match="rebuild must be one of"):
        MosaicReplayParams(rebuild="fp16")
    with pytest.raises(ValueError, match="needs cache_len a multiple of 16"):
        _lower_for_h200(replay_decode_mgpu, jnp.float32, jnp.float32, 8, False, per_channel=False,
                        params=MosaicReplayParams(rebuild="bf16"))
    with pytest.raises(ValueError, match="interpret mode does not run"):
        arrays = [jnp.asarray(x) for x in _inputs(rng, jnp.float32, jnp.float32, False)]
        replay_decode_mgpu(*arrays, jnp.asarray(SLOTS), jnp.asarray(POS), jnp.asarray(MODES),
                           params=MosaicReplayParams(rebuild="tf32"), interpret=True)
    with pytest.raises(ValueError, match="interpret mode does not run"):
        arrays = [jnp.asarray(x) for x in _inputs(rng, jnp.float32, jnp.float32, True)]
        replay_decode_kda_mgpu(*arrays, jnp.asarray(SLOTS), jnp.asarray(POS), jnp.asarray(MODES),
                               params=MosaicReplayParams(rebuild="3xtf32"), interpret=True)
    with pytest.raises(ValueError, match="group_records must be None"):  # KDA lays out its records itself
        arrays = [jnp.asarray(x) for x in _inputs(rng, jnp.float32, jnp.float32, True)]
        replay_decode_kda_mgpu(*arrays, jnp.asarray(SLOTS), jnp.asarray(POS), jnp.asarray(MODES),
                               params=MosaicReplayParams(group_records=True), interpret=True)
    with pytest.raises(ValueError, match="group_records must be None, True or False"):
        MosaicReplayParams(group_records=1)
    for kernel, per_channel in ((replay_decode_mgpu, False), (replay_decode_kda_mgpu, True)):
        with pytest.raises(ValueError, match="no verify window: window_side must be 'xla'"):
            arrays = [jnp.asarray(x) for x in _inputs(rng, jnp.float32, jnp.float32, per_channel)]
            kernel(*arrays, jnp.asarray(SLOTS), jnp.asarray(POS), jnp.asarray(MODES),
                   params=MosaicReplayParams(window_side="kernel"), interpret=True)
        with pytest.raises(ValueError, match="no verify folds: prefetch_folds must be False"):
            kernel(*arrays, jnp.asarray(SLOTS), jnp.asarray(POS), jnp.asarray(MODES),
                   params=MosaicReplayParams(programs=4, prefetch_folds=True), interpret=True)
    # The GDN decode kernel's own options: the KDA kernel refuses them rather than ignore them.
    for own, match in ((dict(key_side="xla"), "computes its key side itself"),
                       (dict(per_tile_addresses=True), "per_tile_addresses must be False"),
                       (dict(programs=6, auto_barriers=False, warpgroups=3, key_side="xla"), "warpgroups must be 1")):
        with pytest.raises(ValueError, match=match):
            arrays = [jnp.asarray(x) for x in _inputs(rng, jnp.float32, jnp.float32, True)]
            replay_decode_kda_mgpu(*arrays, jnp.asarray(SLOTS), jnp.asarray(POS), jnp.asarray(MODES),
                                   params=MosaicReplayParams(**own), interpret=True)
    with pytest.raises(ValueError, match="operands_in_tile must be False"):  # the other kernels' checks
        check_own_layout(MosaicReplayParams(programs=6, auto_barriers=False, warpgroups=3, key_side="xla",
                                            rebuild="3xtf32", operands_in_tile=True), "replay_decode_kda_mgpu",
                         warpgroups=True, key_side=True)
    for bad, match in ((dict(warpgroups=0), r"warpgroups must be an int in \[1, 4\]"),
                       (dict(warpgroups=5), r"warpgroups must be an int in \[1, 4\]"),
                       (dict(warpgroups=True), r"warpgroups must be an int in \[1, 4\]"),
                       (dict(warpgroups=3, auto_barriers=False), "programs must be a positive multiple"),
                       (dict(warpgroups=3, programs=10, auto_barriers=False), "programs must be a positive multiple"),
                       (dict(warpgroups=3, programs=9, key_side="xla"), "auto_barriers must be False"),
                       # Its own key side would share the CTA's one cross-warp reduction scratch.
                       (dict(warpgroups=3, programs=9, auto_barriers=False), "key_side must be 'xla' or 'mma'"),
                       (dict(key_side="tensor"), "key_side must be one of"),
                       # Stacked operands share several programs' tiles: a tensor-core rebuild's, w > 1.
                       (dict(operands_in_tile=True, rebuild="3xtf32"), "needs warpgroups > 1"),
                       (dict(warpgroups=3, programs=9, auto_barriers=False, key_side="xla", operands_in_tile=True),
                        "needs warpgroups > 1 and a tensor-core rebuild"),
                       (dict(operands_in_tile=1), "operands_in_tile must be a bool")):
        with pytest.raises(ValueError, match=match):
            MosaicReplayParams(**bad)
    with pytest.raises(ValueError, match="per_tile_addresses must be a bool"):
        MosaicReplayParams(per_tile_addresses=1)
    # The tensor-core readout and key side: GDN's need bf16 q and k (the key side bf16 key
    # records too); the KDA kernel refuses them.
    for kernel, per_channel, option, match in (
            (replay_decode_mgpu, False, dict(readout="mma"), "needs bf16 q and k"),
            (replay_decode_kda_mgpu, True, dict(readout="mma"), "readout='fma' only"),
            (replay_decode_mgpu, False, dict(key_side="mma"), "needs bf16 q, k and cache, got q float32"),
            (replay_decode_kda_mgpu, True, dict(key_side="mma"), "computes its key side itself")):
        with pytest.raises(ValueError, match=match):
            arrays = [jnp.asarray(x) for x in _inputs(rng, jnp.float32, jnp.float32, per_channel)]
            kernel(*arrays, jnp.asarray(SLOTS), jnp.asarray(POS), jnp.asarray(MODES),
                   params=MosaicReplayParams(**option), interpret=True)


@pytest.mark.parametrize("kernel,per_channel,cache_len", [
    (replay_decode_mgpu, False, 128), (replay_decode_kda_mgpu, True, 128),
])
def test_a_ring_past_shared_memory_is_refused(kernel, per_channel, cache_len):
    """fp32 records of the whole ring at d = 128 outgrow a CTA's 227 KiB (GDN: ~1.8 KiB per
    entry, from L ~ 120; KDA: u records, and key, decay and weighted-key records once per
    CTA, also ~1.8 KiB, from L ~ 110): a ValueError naming the size, not a failed compile."""
    with pytest.raises(ValueError, match="bytes of shared memory per CTA"):
        _lower_for_h200(kernel, jnp.float32, jnp.float32, cache_len, False, per_channel=per_channel)
    _lower_for_h200(kernel, jnp.float32, jnp.float32, cache_len // 2, False, per_channel=per_channel)


@pytest.mark.parametrize("gate,state_dtype,raw,ordered", [
    ("gdn", jnp.float32, False, False), ("gdn", jnp.bfloat16, False, False), ("kda", jnp.float32, True, False),
    ("gdn", jnp.float32, False, True),
])
def test_backend_steps_match_xla(rng, gate, state_dtype, raw, ordered):
    """`decode_step(backend="mosaic_gpu")` against the xla backend over a schedule that
    crosses natural flushes, with a forced flush and a padding row, on its own state
    (jitted: interpret mode runs a compiled step in a fraction of the eager time);
    `ordered`: two persistent programs serve the rows in the plan's launch order."""
    from replayssm_jax import ReplayConfig, Tokens, decode_step, init_state, materialize_state

    cfg = ReplayConfig(1, 2, 64, 64, 8, gate=gate, state_dtype=state_dtype, cache_dtype=state_dtype)
    channels = (64,) if gate == "kda" else ()
    start = jnp.asarray(rng.standard_normal((4, 2, 64, 64)) * 0.1, state_dtype)
    states = {b: init_state(cfg, 4, checkpoint=start) for b in ("xla", "mosaic_gpu")}
    f = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)
    gate_params = (f(2) * 0.3, f(2, *channels)) if raw else None
    kernel_params = {"mosaic_gpu": MosaicReplayParams(programs=2, launch_order=True) if ordered else None}
    steps = {b: jax.jit(functools.partial(decode_step, backend=b, policy="natural", use_qk_l2norm=True,
                                          kernel_params=kernel_params.get(b)))
             for b in states}
    slots = jnp.asarray([2, -1, 0], jnp.int32)
    for step in range(cfg.cache_len + 3):
        g = f(3, 2, *channels) if raw else -jnp.abs(f(3, 2, *channels)) * 0.2
        tokens = Tokens(f(3, 1, 64), f(3, 1, 64), f(3, 2, 64), g, f(3, 2) if raw else jax.nn.sigmoid(f(3, 2)))
        force = jnp.asarray([False, False, step == 3])
        ys = {}
        for b in states:
            ys[b], states[b] = steps[b](states[b], tokens, slots, force, gate_params=gate_params)
        # fp32: two summation orders (~1e-7 relative). bf16: the stores round to bf16 on
        # both backends, and an entry that rounds differently differs by one bf16 ulp.
        tol = 1e-5 if state_dtype == jnp.float32 else 2e-2
        np.testing.assert_allclose(np.asarray(ys["mosaic_gpu"], np.float32), np.asarray(ys["xla"], np.float32),
                                   atol=tol, rtol=tol, err_msg=f"y at step {step}")
        np.testing.assert_array_equal(np.asarray(states["mosaic_gpu"].write_pos), np.asarray(states["xla"].write_pos))
    live = {b: materialize_state(s, jnp.arange(4, dtype=jnp.int32)) for b, s in states.items()}
    np.testing.assert_allclose(np.asarray(live["mosaic_gpu"]), np.asarray(live["xla"]), atol=tol, rtol=tol)


def test_backend_refuses_other_gates_and_shapes():
    from replayssm_jax import ReplayConfig
    from replayssm_jax.backends import mosaic_gpu

    with pytest.raises(ValueError, match="cache_len a multiple of 8"):
        mosaic_gpu.check_config(ReplayConfig(1, 2, 64, 64, 4))
    with pytest.raises(ValueError, match="d_k = 64 or a multiple of 128"):
        mosaic_gpu.check_config(ReplayConfig(1, 2, 192, 64, 8, gate="kda"))
    mosaic_gpu.check_config(ReplayConfig(1, 2, 192, 64, 8))  # GDN takes any multiple of 64
    mosaic_gpu.check_config(ReplayConfig.mamba2(2, 64, 128, 1, 16))
    with pytest.raises(ValueError, match="head dim P a multiple of 64"):  # P and N are not swapped
        mosaic_gpu.check_config(ReplayConfig.mamba2(2, 32, 128, 1, 16))


def test_row_order_goes_with_launch_order(rng):
    """A row order is given exactly when `launch_order` asks for one, and must be a
    permutation of the rows; the one-CTA-per-tile verify kernels (KDA, Mamba-2) refuse it."""
    from pallas_kernels.mosaic_gpu.verify_decode import check_params

    ckpt, u_c, k_c, g_c, q, k, v, g, beta = _inputs(rng, jnp.float32, jnp.float32, False)
    step = functools.partial(replay_decode_mgpu, *map(jnp.asarray, (ckpt, u_c, k_c, g_c, q, k, v, g, beta)),
                             jnp.asarray(SLOTS), jnp.asarray(POS), jnp.asarray(MODES), interpret=True)
    rows = len(SLOTS)
    with pytest.raises(ValueError, match="row_order is given iff params.launch_order"):
        step(params=MosaicReplayParams(programs=3, launch_order=True))
    with pytest.raises(ValueError, match="row_order is given iff params.launch_order"):
        step(params=MosaicReplayParams(programs=3), row_order=jnp.arange(rows))
    with pytest.raises(ValueError, match="permutation"):
        step(params=MosaicReplayParams(programs=3, launch_order=True), row_order=jnp.zeros(rows, jnp.int32))
    with pytest.raises(ValueError, match=r"shape \(5,\)"):
        step(params=MosaicReplayParams(programs=3, launch_order=True), row_order=jnp.arange(rows + 1))
    with pytest.raises(ValueError, match="launch_order must be a bool"):
        MosaicReplayParams(launch_order=1)
    check_params(MosaicReplayParams(programs=4, launch_order=True), "gdn", pipelined=True)
    with pytest.raises(ValueError, match="launch_order must be False"):
        check_params(MosaicReplayParams(launch_order=True), "kda")


def test_kda_shape_checks_name_the_bad_size():
    check_kda_shapes(128, 128, 64, 4, 4)
    with pytest.raises(ValueError, match="needs .* bytes of shared memory per CTA"):
        check_kda_shapes(128, 128, 128, 4, 4)
    with pytest.raises(ValueError, match="cache_len a multiple of 8"):
        check_kda_shapes(128, 128, 12, 4, 4)
    with pytest.raises(ValueError, match=r"g_cache \[N, H_v, L, d_k\]"):
        replay_decode_kda_mgpu(*(jnp.zeros(s) for s in ((2, 2, 64, 64), (2, 2, 8, 64), (2, 1, 8, 64), (2, 2, 8),
                                                        (1, 1, 64), (1, 1, 64), (1, 2, 64), (1, 2), (1, 2))),
                               *(jnp.zeros((1,), jnp.int32),) * 3)


def test_persistent_programs_are_validated_and_fit_shared_memory():
    from pallas_kernels.mosaic_gpu.pipeline import programs_that_fit
    from pallas_kernels.mosaic_gpu.replay_decode import persistent_programs

    for bad in (-1, 2.0, True):
        with pytest.raises(ValueError, match="programs must be an int >= 0"):
            MosaicReplayParams(programs=bad)
        with pytest.raises(ValueError, match="chunk must be an int >= 0"):
            MosaicReplayParams(chunk=bad)
    # Two stages of ~48 KiB (fp32, L = 16, d = 128) plus the rebuild's 12 KiB copies: two CTAs
    # per SM; a bf16 state's buffers fit three, its registers two (`RESIDENT_CTAS`); never
    # more CTAs than tiles, never none.
    f32, bf16 = jnp.float32, jnp.bfloat16
    assert persistent_programs(512, 32, 128, 128, 16, f32, f32, bf16, 132) == 264
    assert persistent_programs(512, 32, 128, 128, 16, bf16, bf16, bf16, 132) == 264
    assert persistent_programs(512, 32, 128, 128, 16, bf16, bf16, bf16, 132, max_ctas=None) == 396
    assert persistent_programs(1, 2, 128, 128, 16, f32, f32, bf16, 132) == 4
    assert programs_that_fit(300 * 1024, 132, 10_000) == 132
    assert programs_that_fit(50 * 1024, 132, 10_000) == 4 * 132
    assert programs_that_fit(50 * 1024, 132, 10_000, max_ctas=3) == 3 * 132


@pytest.mark.parametrize("num_tiles,num_programs,chunk", [
    (10, 3, 4), (7, 7, 4), (32768, 264, 4), (5, 1, 4), (30, 4, 4), (64, 64, 4), (4096, 64, 16), (100, 3, 16),
])
def test_persistent_programs_serve_every_tile_once(num_tiles, num_programs, chunk):
    """`program_tiles`: every tile served once, no program idle, chunks of consecutive
    tiles dealt round robin (so one row's tiles spread over programs), counts balanced to
    within one chunk."""
    from pallas_kernels.mosaic_gpu.pipeline import chunk_size, program_tiles

    chunk = chunk_size(num_tiles, num_programs, chunk)
    served = {}
    for p in range(num_programs):
        tile_of, count = program_tiles(jnp.int32(p), num_tiles, num_programs, chunk)
        served[p] = [int(tile_of(jnp.int32(n))) for n in range(int(count))]
        assert served[p], f"program {p} idle"
        assert all(t // chunk % num_programs == p for t in served[p])
    assert sorted(t for tiles in served.values() for t in tiles) == list(range(num_tiles))
    counts = [len(tiles) for tiles in served.values()]
    assert max(counts) - min(counts) <= chunk


def test_launch_order_spreads_flushing_rows_over_the_programs(rng):
    """`serve_tiles` with the plan's launch order (flushing rows first) at the shapes of a
    staggered GDN step with three warpgroups (B = 512, H_v = 32, two tiles per head: 32,768
    tiles in chunks of 4 over 396 programs; about B / L = 32 rows flush, each tile of them
    about twice an appending tile's work): every program gets at most one chunk more of
    flushing tiles than another, and starts with them; served in row order, the busiest
    programs get several times their share."""
    from pallas_kernels.mosaic_gpu.pipeline import chunk_size, program_tiles, tile_location
    from replayssm_jax.plan import launch_order

    batch, heads, tiles, programs, cache_len = 512, 32, 2, 396, 16
    pos = rng.integers(0, cache_len, batch)
    flush = pos == cache_len - 1
    order = np.asarray(launch_order(jnp.ones(batch, bool), jnp.asarray(pos), jnp.asarray(flush), cache_len))
    num_tiles = batch * heads * tiles
    chunk = chunk_size(num_tiles, programs, 4)

    def flush_tiles(row_order):
        counts = []
        for p in range(programs):
            tile_of, count = program_tiles(p, num_tiles, programs, chunk)
            rows = [tile_location(tile_of(n), heads, tiles, row_order)[0] for n in range(count)]
            flags = [bool(flush[r]) for r in rows]
            counts.append(sum(flags))
            if row_order is not None:  # a program's flushing tiles come first
                assert flags == sorted(flags, reverse=True)
        return np.asarray(counts)

    ordered, unordered = flush_tiles(order), flush_tiles(None)
    assert ordered.sum() == unordered.sum() == flush.sum() * heads * tiles
    assert ordered.max() - ordered.min() <= chunk
    assert unordered.max() - unordered.min() > 2 * chunk


@pytest.mark.parametrize("rebuild,xla_side,programs", [("exact", False, 1), ("3xtf32", True, 1), ("exact", False, 3),
                                                         ("3xtf32", True, 3)])
def test_program_axis_keeps_the_layout(rebuild, xla_side, programs):
    """`with_program_axis` adds a leading axis of `programs` to every buffer (a union's
    members each, with one program) and multiplies the bytes by exactly that, so per-tile
    addresses fit the CTAs the plain layout does and three warpgroups take three programs'
    bytes; with several programs every program's slice of a buffer starts 128-byte aligned
    (TMA's destinations; its first axis padded where needed, e.g. the `[16]` fp32 decays),
    every barrier array gets their barriers end to end and a union is refused (a
    tensor-core rebuild's operands then have buffers of their own); `opaque_zero` is 0 for
    every row of the batch."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    from pallas_kernels.mosaic_gpu.layouts import smem_bytes
    from pallas_kernels.mosaic_gpu.pipeline import opaque_zero, with_program_axis
    from pallas_kernels.mosaic_gpu.replay_decode import _scratch

    scratch = _scratch(128, 16, jnp.bfloat16, jnp.bfloat16, jnp.bfloat16, jnp.bfloat16, 128, rebuild, 2, "mma",
                       xla_side=xla_side, own_operands=programs > 1)
    stacked = with_program_axis(scratch, programs)

    def shapes(tree, count=1):
        if isinstance(tree, (list, tuple)):
            return [shapes(item, count) for item in tree]
        if isinstance(tree, plgpu.RefUnion):
            return ("union", shapes(list(tree.refs), count))
        if isinstance(tree, plgpu.Barrier):
            return ("barrier", tree.num_barriers)
        return tree.shape

    def with_axis(tree):
        if isinstance(tree, list):
            return [with_axis(item) for item in tree]
        if isinstance(tree, tuple) and tree and tree[0] == "union":
            return ("union", with_axis(tree[1]))
        if isinstance(tree, tuple) and tree and tree[0] == "barrier":
            return tree if programs == 1 else ("barrier", (programs * int(np.prod(tree[1])),))
        return (programs, "rows", *tree[1:])

    def rows_free(tree):  # the padded first axis checked below
        if isinstance(tree, list):
            return [rows_free(item) for item in tree]
        if isinstance(tree, tuple) and tree and tree[0] in ("union", "barrier"):
            return (tree[0], rows_free(tree[1])) if tree[0] == "union" else tree
        return (tree[0], "rows", *tree[2:])

    assert rows_free(shapes(stacked)) == with_axis(shapes(scratch))
    def leaves(tree):
        if isinstance(tree, (list, tuple)):
            return [x for item in tree for x in leaves(item)]
        if isinstance(tree, plgpu.RefUnion):
            return leaves(list(tree.refs))
        return [] if isinstance(tree, plgpu.Barrier) else [tree]

    for one, stacked_buffer in zip(leaves(scratch), leaves(stacked)):
        assert stacked_buffer.shape[1] >= one.shape[0]
        if programs == 1:
            assert stacked_buffer.shape[1:] == one.shape
        else:
            assert (np.prod(stacked_buffer.shape[1:]) * jnp.dtype(one.dtype).itemsize) % 128 == 0, one.shape
    # Within a buffer's alignment: the bytes of `programs` programs, no more.
    assert programs * smem_bytes(scratch) - 1024 * len(jax.tree.leaves(shapes(scratch))) <= smem_bytes(stacked)
    assert smem_bytes(stacked) <= programs * smem_bytes(scratch)
    if programs == 1:
        assert smem_bytes(stacked) == smem_bytes(scratch)
    unions = any(isinstance(stage[0], plgpu.RefUnion) for stage in stacked[0])
    assert unions == (rebuild != "exact" and programs == 1)
    if programs > 1 and rebuild != "exact":  # the operands in the rebuild buffers' place
        assert len(scratch[3]) == 3  # A's hi and lo parts, the bf16 keys' one (`rebuild.keys_exact`)
        with pytest.raises(ValueError, match="RefUnion"):
            with_program_axis(_scratch(128, 16, jnp.bfloat16, jnp.bfloat16, jnp.bfloat16, jnp.bfloat16, 128, rebuild,
                                       2, "mma", xla_side=xla_side), programs)
    rows = jnp.arange(512)
    assert not np.any(np.asarray(opaque_zero(rows, 512)))


def test_stacked_operands_share_each_programs_tile():
    """`operands_in_tile`: a fold's operands stacked into one buffer of the bf16 tile's
    bytes, their row ranges the shapes of the buffers of their own (`rebuild_operands`),
    disjoint and inside it; `with_program_axis` gives the union (two members of equal bytes)
    a program axis, so four programs' stages take one tile's bytes each and four programs
    fit per SM with the key side on tensor cores (without it, none); a union of unequal
    members, or of a group, is refused."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    from pallas_kernels.mosaic_gpu.layouts import smem_bytes
    from pallas_kernels.mosaic_gpu.pipeline import with_program_axis
    from pallas_kernels.mosaic_gpu.rebuild import operand_views, rebuild_operands, stacked_operands
    from pallas_kernels.mosaic_gpu.replay_decode import _scratch, persistent_programs

    bf16 = jnp.bfloat16
    tile = plgpu.SMEM((64, 128), bf16)
    own = rebuild_operands(tile, 64, 128, 16, "3xtf32", bf16)
    stack = stacked_operands(tile, 64, 128, 16, "3xtf32", bf16)
    assert math.prod(stack.shape) * 4 == 64 * 128 * 2 and stack.dtype == jnp.float32
    assert stack.transforms == own[0].transforms

    class Rows:  # stands in for a ref: `.at[pl.ds(start, n)]` gives the row range
        at = property(lambda self: self)
        __getitem__ = lambda self, rows: (rows.start, rows.size)

    ranges = operand_views(Rows(), 64, 128, "3xtf32", bf16)
    assert [n for _, n in ranges] == [b.shape[0] for b in own] and all(b.shape[1] == stack.shape[1] for b in own)
    starts = [start for start, _ in ranges]
    assert starts == sorted(starts) and all(a + n <= b for (a, n), b in zip(ranges, starts[1:] + [stack.shape[0]]))
    scratch = _scratch(128, 16, bf16, bf16, bf16, bf16, 128, "3xtf32", 2, "mma", grouped=True, mma_side=True,
                       operands_in_tile=True)
    stacked = with_program_axis(scratch, 4)
    union = stacked[0][0][0]
    assert isinstance(union, plgpu.RefUnion) and [m.shape for m in union.refs] == [(4, 64, 128), (4, *stack.shape)]
    assert smem_bytes(stacked) < smem_bytes(with_program_axis(
        _scratch(128, 16, bf16, bf16, bf16, bf16, 128, "3xtf32", 2, "mma", grouped=True, mma_side=True,
                 own_operands=True), 4))
    fits = lambda operands_in_tile: persistent_programs(512, 32, 128, 128, 16, bf16, bf16, bf16, 132,
                                                        rebuild="3xtf32", readout="mma", key_side="mma",
                                                        max_ctas=None, warpgroups=4, operands_in_tile=operands_in_tile)
    assert (fits(False), fits(True)) == (0, 528)
    with pytest.raises(ValueError, match="members of equal bytes"):
        with_program_axis(plgpu.RefUnion(tile, plgpu.SMEM((64, 64), bf16)), 4)
    with pytest.raises(ValueError, match="single buffers, not groups"):
        with_program_axis(plgpu.RefUnion(tile, own), 4)


@pytest.mark.parametrize("kernel,per_channel,params", [
    (replay_decode_mgpu, False, MosaicReplayParams(auto_barriers=False)),
    (replay_decode_mgpu, False, MosaicReplayParams(auto_barriers=False, programs=264)),
    (replay_decode_mgpu, False, MosaicReplayParams(auto_barriers=False, rebuild="tf32")),
    (replay_decode_kda_mgpu, True, MosaicReplayParams(auto_barriers=False)),
])
def test_without_auto_barriers_the_kernels_lower(kernel, per_channel, params):
    """`auto_barriers=False` (the kernel's own barriers only) lowers for an abstract H200;
    its GPU results are checked against xla by `benchmarks/mosaic_bench.py --variants`."""
    text = _lower_for_h200(kernel, jnp.float32, jnp.float32, 16, False, per_channel=per_channel, params=params)
    assert "mosaic_gpu" in text


def test_backend_default_params_per_gate(monkeypatch):
    """Every gate gets persistent CTAs that fit and the kernels' own barriers; the device's SM
    count sets the CTAs."""
    from pallas_kernels.mosaic_gpu.mamba2_decode import MosaicMamba2Params
    from replayssm_jax import ReplayConfig
    from replayssm_jax.backends import mosaic_gpu

    gdn = ReplayConfig(16, 32, 128, 128, 16)
    assert mosaic_gpu.default_params(gdn, 512, jnp.bfloat16) == MosaicReplayParams(programs=264, auto_barriers=False)
    assert mosaic_gpu.default_params(gdn, 1, jnp.bfloat16).programs == 64  # one row's 64 tiles
    # KDA: its two stages plus the head's key and decay records (one copy per CTA) fit two CTAs per SM.
    kda = ReplayConfig(32, 32, 128, 128, 16, gate="kda")
    assert mosaic_gpu.default_params(kda, 512, jnp.bfloat16) == MosaicReplayParams(programs=264, auto_barriers=False)
    assert mosaic_gpu.default_params(kda, 512, jnp.bfloat16, interpret=False).rebuild == "3xtf32"
    nemotron = ReplayConfig.mamba2(128, 64, 128, 8, 16)
    mamba2 = mosaic_gpu.default_params(nemotron, 512, jnp.bfloat16)
    assert isinstance(mamba2, MosaicMamba2Params) and not mamba2.auto_barriers
    assert mamba2.programs == mosaic_gpu.fitting_programs(nemotron, 512, jnp.bfloat16, sm_count=132) >= 132

    # On a GPU GDN's flush rebuild is 3xTF32 where its operands cost no CTAs per SM: fp32 at
    # L = 16 and 32, where its operands in chunks of 16 entries fit two CTAs per SM and the
    # exact rebuild's record copies one at L = 32; bf16 states, whose 16 KiB tile takes
    # chunks of 8, at two CTAs per SM (their registers' bound; the buffers fit four at
    # L = 16 and three at L = 32).
    assert mosaic_gpu.default_params(gdn, 512, jnp.bfloat16, interpret=False) == MosaicReplayParams(
        programs=264, auto_barriers=False, rebuild="3xtf32")
    gdn_l32 = ReplayConfig(16, 32, 128, 128, 32)
    assert mosaic_gpu.default_params(gdn_l32, 512, jnp.bfloat16, interpret=False) == MosaicReplayParams(
        programs=264, auto_barriers=False, rebuild="3xtf32")
    assert mosaic_gpu.default_params(gdn_l32, 512, jnp.bfloat16).programs == 132  # exact off GPU: one per SM
    bf16 = lambda L: ReplayConfig(16, 32, 128, 128, L, state_dtype=jnp.bfloat16, cache_dtype=jnp.bfloat16)
    for L in (16, 32):
        on_gpu = mosaic_gpu.default_params(bf16(L), 128, jnp.bfloat16, interpret=False)
        assert (on_gpu.rebuild, on_gpu.programs, on_gpu.warpgroups) == ("3xtf32", 264, 1)
    # From B = 256 at L = 16 (measured faster there) three warpgroups per CTA, each a
    # program with its own buffers: one CTA per SM, three programs; addresses held; the key
    # side on tensor cores (column sums would share the CTA's reduction scratch), from XLA
    # with fp32 key records.
    wide = mosaic_gpu.default_params(bf16(16), 512, jnp.bfloat16, interpret=False)
    assert (wide.programs, wide.warpgroups, wide.per_tile_addresses, wide.key_side) == (396, 3, False, "mma")
    fp32_keys = ReplayConfig(16, 32, 128, 128, 16, state_dtype=jnp.bfloat16, cache_dtype=jnp.float32)
    assert mosaic_gpu.default_params(fp32_keys, 512, jnp.bfloat16, interpret=False).key_side == "xla"
    assert mosaic_gpu.default_params(bf16(16), 256, jnp.bfloat16, interpret=False).warpgroups == 3
    assert mosaic_gpu.default_params(bf16(32), 512, jnp.bfloat16, interpret=False).warpgroups == 1  # not measured
    assert mosaic_gpu.fitting_programs(gdn, 512, jnp.bfloat16, rebuild="3xtf32", warpgroups=3, sm_count=132) == 0
    assert mosaic_gpu.default_params(gdn, 512, jnp.bfloat16, interpret=True).rebuild == "exact"
    # GDN 2-byte states read the tile out on tensor cores (bf16 q and k only) and, with one
    # warpgroup per CTA, take their key side from XLA and recompute addresses per tile;
    # fp32 ones and KDA do none of it.
    sides = lambda p: (p.readout, p.key_side, p.per_tile_addresses)
    assert sides(mosaic_gpu.default_params(bf16(16), 128, jnp.bfloat16)) == ("mma", "xla", True)
    assert sides(mosaic_gpu.default_params(bf16(16), 512, jnp.float32)) == ("fma", "kernel", False)
    assert sides(mosaic_gpu.default_params(gdn, 512, jnp.bfloat16)) == ("fma", "kernel", False)
    kda_bf16 = ReplayConfig(32, 32, 128, 128, 16, gate="kda", state_dtype=jnp.bfloat16, cache_dtype=jnp.bfloat16)
    assert sides(mosaic_gpu.default_params(kda_bf16, 512, jnp.bfloat16)) == ("fma", "kernel", False)
    # The key side from XLA copies no key records per stage: bf16 L = 32's buffers fit three
    # CTAs per SM on shared memory, registers hold two.
    assert mosaic_gpu.default_params(bf16(32), 512, jnp.bfloat16, interpret=False).programs == 264
    # Mamba-2 likewise (same tile and operand shapes: P = 64 rows, N = 128 columns).
    assert mosaic_gpu.default_params(nemotron, 512, jnp.bfloat16, interpret=False).rebuild == "3xtf32"
    assert mosaic_gpu.default_params(nemotron, 512, jnp.bfloat16, interpret=True).rebuild == "exact"
    bf16_mamba2 = ReplayConfig.mamba2(128, 64, 128, 8, 32, state_dtype=jnp.bfloat16, cache_dtype=jnp.bfloat16)
    assert mosaic_gpu.default_params(bf16_mamba2, 512, jnp.bfloat16, interpret=False).rebuild == "3xtf32"
    nemotron_l32 = ReplayConfig.mamba2(128, 64, 128, 8, 32)
    assert mosaic_gpu.default_params(nemotron_l32, 512, jnp.bfloat16, interpret=False).programs == 264

    class Device:
        core_count = 66
    monkeypatch.setattr(jax, "devices", lambda *a: [Device()])
    assert mosaic_gpu.default_params(gdn, 512, jnp.bfloat16).programs == 132


def test_mamba2_decode_ctas_per_sm_follow_the_device_kind(monkeypatch):
    """Mamba-2 decode's persistent CTAs per SM: two on an H100 (measured faster there), the
    kernel's bound of three elsewhere (the H200's measurement), shared memory permitting."""
    from pallas_kernels.mosaic_gpu import mamba2_decode
    from replayssm_jax import ReplayConfig
    from replayssm_jax.backends import mosaic_gpu

    assert mosaic_gpu.mamba2_ctas_per_sm("NVIDIA H100 80GB HBM3") == 2
    assert mosaic_gpu.mamba2_ctas_per_sm("NVIDIA H200") == mosaic_gpu.mamba2_ctas_per_sm("cpu") == 3
    bf16 = ReplayConfig.mamba2(128, 64, 128, 8, 16, state_dtype=jnp.bfloat16, cache_dtype=jnp.bfloat16)
    fp32 = ReplayConfig.mamba2(128, 64, 128, 8, 16)
    for kind, ctas in (("NVIDIA H200", 3), ("NVIDIA H100 80GB HBM3", 2)):
        monkeypatch.setattr(mosaic_gpu, "device_kind", lambda: kind)
        assert mosaic_gpu.default_params(bf16, 512, jnp.bfloat16, interpret=False).programs == ctas * 132
        assert mosaic_gpu.default_params(fp32, 512, jnp.float32, interpret=False).programs == 2 * 132  # its buffers
    for bad in (0, mamba2_decode.RESIDENT_CTAS + 1):
        with pytest.raises(ValueError, match="max_ctas"):
            mamba2_decode.persistent_programs(512, 128, 64, 128, 16, jnp.bfloat16, jnp.bfloat16, jnp.bfloat16, 132,
                                              max_ctas=bad)


def test_the_profiler_is_on_only_where_the_environment_names_a_folder(monkeypatch):
    monkeypatch.delenv(build.PROFILE_DIR_ENV, raising=False)
    params = build.compiler_params(auto_barriers=False)
    assert (params.profile_space, params.profile_dir, params.unsafe_no_auto_barriers) == (0, "", True)
    monkeypatch.setenv(build.PROFILE_DIR_ENV, "/tmp/traces")
    assert build.compiler_params().profile_space == build.DEFAULT_PROFILE_SPACE
    monkeypatch.setenv(build.PROFILE_SPACE_ENV, "64")
    params = build.compiler_params()
    assert (params.profile_space, params.profile_dir, params.profile_bounds_check) == (64, "/tmp/traces", True)
    assert not params.unsafe_no_auto_barriers
    monkeypatch.setenv(build.PROFILE_SPACE_ENV, "0")
    with pytest.raises(ValueError, match="positive count"):
        build.compiler_params()


@pytest.mark.parametrize("field,bad,message", [
    ("swizzle", 48, "swizzle must be 32, 64 or 128"), ("rebuild", "fp16", "rebuild must be one of"),
    ("programs", -1, "programs must be an int >= 0"), ("chunk", 2.0, "chunk must be an int >= 0"),
    ("programs", True, "programs must be an int >= 0"),
    ("readout", "tma", "readout must be one of"), ("group_records", 1, "group_records must be None, True or False"),
    ("launch_order", 1, "launch_order must be a bool")])
def test_both_params_classes_refuse_a_bad_shared_field(field, bad, message):
    from pallas_kernels.mosaic_gpu.mamba2_decode import MosaicMamba2Params

    for params_class in (MosaicReplayParams, MosaicMamba2Params):
        with pytest.raises(ValueError, match=message):
            params_class(**{field: bad})
