"""The Mosaic GPU verify kernels (GDN, and KDA's per-channel decay) against a float64 NumPy
model that decodes each window position along its branch, token by token, from the row's
live state.

Interpret mode on CPU (tiny batch, the kernel's smallest tile shapes): appending, folding
and padding rows in one call, slots != rows, ragged window lengths (0 included), tree
windows, NaN / Inf in every stale cache entry, in positions past a row's length and in a
padding row's inputs. A second test lowers the kernels for an abstract H200 at the
benchmark shapes; a third runs `verify_step(backend="mosaic_gpu")` against the xla backend
through verify / accept rounds.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.common import VerifyRows
from pallas_kernels.mosaic_gpu.mamba2_decode import MosaicMamba2Params
from pallas_kernels.mosaic_gpu.readout import split_bf16, tile_parts
from pallas_kernels.mosaic_gpu.replay_decode import MosaicReplayParams
from pallas_kernels.mosaic_gpu.pipeline import ctas_per_sm
from pallas_kernels.mosaic_gpu.verify_decode import (HISTORY_PAD, check_params, history_weights, key_block_heads,
                                                     persistent_programs, persistent_smem_bytes, verify_decode_mgpu,
                                                     window_key_values, window_rows, window_vectors)
from pallas_kernels.mosaic_gpu.verify_decode_kda import verify_decode_kda_mgpu

NUM_SLOTS, H_K, H_V, D, L, T = 6, 1, 2, 64, 8, 3
SLOTS = np.array([4, 0, 2, 5, 1, 3], np.int32)
POS = np.array([5, 3, 7, 0, 6, 2], np.int32)
# Row 1 pads (length 0: the kernels derive each row's mode from its cursor and length),
# row 3 verifies nothing; row 5 reads history on the CTA that served row 0.
LENGTHS = np.array([3, 0, 2, 0, 3, 2], np.int32)
PAD = np.array([False, True, False, False, False, False])
FOLD = ~PAD & (POS + LENGTHS > L)
EPS = 1e-6


def _branch(parents, i):
    """Window positions from the root to i (i's ancestors, then i)."""
    path = [i]
    while parents[path[-1]] >= 0:
        path.append(parents[path[-1]])
    return path[::-1]


def _model(ckpt, u_c, k_c, g_c, q, k, v, g, beta, parents, *, state_dtype):
    """Float64 verify: `(y, checkpoint, u_cache, k_cache, g_cache)` with every live row's
    records at `base .. base + length - 1` (a folding row's from 0).
    A GDN log-decay (g_c `[N, H_v, L]`, g `[B, T, H_v]`) is the per-channel one with every
    channel equal, so one model serves both gates."""
    ckpt, u_c, k_c, g_c = (np.array(x, np.float64) for x in (ckpt, u_c, k_c, g_c))
    k_in, g_in = k_c.copy(), g_c.copy()  # the history every head reads, before any record lands
    channels = (lambda x: np.asarray(x)) if g_c.ndim == 4 else (lambda x: np.asarray(x)[..., None])
    y = np.zeros(v.shape)
    group = H_V // H_K
    for b, (slot, pos, length) in enumerate(zip(SLOTS, POS, LENGTHS)):
        if PAD[b]:
            continue
        base = 0 if FOLD[b] else pos
        for h in range(H_V):
            hk = h // group
            g_rec = channels(g_in[slot, h])  # [L, d_k] or [L, 1]
            live = ckpt[slot, h] * np.exp(g_rec[:pos].sum(0))
            for j in range(pos):
                live = live + np.outer(u_c[slot, h, j], np.exp(g_rec[j + 1:pos].sum(0)) * k_in[slot, hk, j])
            if FOLD[b]:  # the folded checkpoint as stored, and the window read from it
                live = np.asarray(jnp.asarray(live, jnp.float32).astype(state_dtype).astype(jnp.float32), np.float64)
                ckpt[slot, h] = live
            for i in range(length):
                state = live
                for t in _branch(parents[b], i):
                    qt, kt = q[b, t, hk].astype(np.float64), k[b, t, hk].astype(np.float64)
                    qt, kt = qt / np.sqrt(qt @ qt + EPS) * D ** -0.5, kt / np.sqrt(kt @ kt + EPS)
                    gt, bt = g[b, t, h].astype(np.float64), float(beta[b, t, h])
                    alpha = np.exp(channels(gt))
                    u = bt * (v[b, t, h] - state @ (alpha * kt))
                    state = state * alpha + np.outer(u, kt)
                y[b, i, h] = state @ qt
                u_c[slot, h, base + i] = u
                g_c[slot, h, base + i] = gt
                k_c[slot, hk, base + i] = kt
    return y, ckpt, u_c, k_c, g_c


def _inputs(rng, state_dtype, cache_dtype, per_channel=False):
    f = lambda *s: rng.standard_normal(s).astype(np.float32)
    channels = (D,) if per_channel else ()
    ckpt = f(NUM_SLOTS, H_V, D, D) * 0.3
    u_c, k_c = f(NUM_SLOTS, H_V, L, D), f(NUM_SLOTS, H_K, L, D) * 0.2
    g_c = -np.abs(f(NUM_SLOTS, H_V, L, *channels)) * 0.2
    for slot, pos in zip(SLOTS, POS):  # stale entries: never read
        u_c[slot, :, pos:], k_c[slot, :, pos:], g_c[slot, :, pos:] = np.nan, np.inf, np.nan
    ckpt, u_c, k_c = (np.asarray(jnp.asarray(x).astype(dt).astype(jnp.float32))
                      for x, dt in ((ckpt, state_dtype), (u_c, cache_dtype), (k_c, cache_dtype)))
    batch = len(SLOTS)
    q, k, v = f(batch, T, H_K, D), f(batch, T, H_K, D), f(batch, T, H_V, D)
    g, beta = -np.abs(f(batch, T, H_V, *channels)) * 0.3, rng.random((batch, T, H_V)).astype(np.float32)
    past = np.arange(T)[None, :] >= np.where(PAD, 0, LENGTHS)[:, None]  # padding rows and positions
    for x in (q, k, v, g, beta):
        x[past] = np.nan
    parents = np.stack([rng.integers(-1, np.arange(T)) for _ in range(batch)]).astype(np.int32)
    return ckpt, u_c, k_c, g_c, q, k, v, g, beta, parents


def _rows(rng):
    """`(slots, cursors, lengths)` as a verify step's caller holds them: the padding row's
    slot out of range (negative or >= N, drawn) with a full requested length and NaN
    inputs (`_inputs`), which the kernels must not read; the live rows' cursors at `POS`,
    the unused slot's drawn."""
    slots = np.where(PAD, rng.choice([-1, NUM_SLOTS]), SLOTS).astype(np.int32)
    cursors = np.full(NUM_SLOTS, rng.integers(0, L + 1), np.int32)
    cursors[SLOTS[~PAD]] = POS[~PAD]
    return slots, cursors, np.where(PAD, T, LENGTHS).astype(np.int32)


def _ancestors(parents):
    anc = np.zeros((len(parents), T, T), np.int32)
    for b, row in enumerate(parents):
        for i in range(T):
            for j in _branch(row, i)[:-1]:
                anc[b, i, j] = 1
    return anc


@pytest.mark.parametrize("state_dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("gate,params", [
    ("gdn", MosaicReplayParams()), ("kda", MosaicReplayParams()),
    ("gdn", MosaicReplayParams(programs=5, auto_barriers=False)),  # 12 tiles: 4 / 4 / 4 / 0 ... chunks of 2
    ("gdn", MosaicReplayParams(programs=5, chunk=1)),  # 12 chunks of one tile: 3 / 3 / 2 / 2 / 2
    ("gdn", MosaicReplayParams(readout="mma")), ("gdn", MosaicReplayParams(programs=5, auto_barriers=False,
                                                                           readout="mma")),
    ("gdn", MosaicReplayParams(programs=5, auto_barriers=False, per_tile_addresses=True)),
    ("gdn", MosaicReplayParams(key_side="xla")),
    ("gdn", MosaicReplayParams(programs=5, auto_barriers=False, readout="mma", key_side="xla",
                               per_tile_addresses=True)),
    ("gdn", MosaicReplayParams(programs=6, auto_barriers=False, warpgroups=3, key_side="xla")),  # 2 CTAs of 3
    ("gdn", MosaicReplayParams(programs=3, auto_barriers=False, readout="mma", per_tile_addresses=True,
                               warpgroups=3, key_side="xla")),
    ("gdn", MosaicReplayParams(programs=5, auto_barriers=False, launch_order=True)),
    # Folding rows' record copies started with their tile, into buffers of each stage's own.
    ("gdn", MosaicReplayParams(programs=5, auto_barriers=False, readout="mma", key_side="xla", prefetch_folds=True)),
    # Folding rows' value records with their tile, their key records once per group: two
    # programs serve rows 0, 2, 4 and 1, 3, 5 (rows 2 and 4 fold, their keys copied by the
    # previous row's tile); chunks of one tile, each fresh; the kernel's own key side.
    ("gdn", MosaicReplayParams(programs=2, auto_barriers=False, readout="mma", key_side="xla", group_folds=True)),
    ("gdn", MosaicReplayParams(programs=3, chunk=1, auto_barriers=False, group_folds=True, launch_order=True)),
    ("gdn", MosaicReplayParams(programs=2, auto_barriers=False, readout="mma", key_side="xla", group_folds=True,
                               per_tile_addresses=True)),  # the value-record union through its unit axis
    # The window's records and staged vectors from their Pallas Triton kernel.
    ("gdn", MosaicReplayParams(programs=5, auto_barriers=False, readout="mma", key_side="xla",
                               window_side="kernel", window_warps=1)),
    ("kda", MosaicReplayParams(window_side="kernel")),
])
def test_verify_matches_the_float64_model(rng, gate, params, state_dtype):
    """GDN also as persistent CTAs without Mosaic's barriers: each CTA serves several tiles
    of different rows and modes from two stages of buffers; and with the tensor-core
    readout, whose `wgmma`s interpret mode replaces by dots of the same bf16 parts (bf16 q
    and k, as it requires); and with every buffer through its unit axis at the tile's
    opaque zero (`per_tile_addresses`); and with the window's key sums from XLA
    (`key_side="xla"`: the stale ring entries' Inf reach those sums, and the kernel must
    mask them); and as three programs per CTA, one per warpgroup, each on its own slice of
    the buffers and barriers (`warpgroups=3`); and serving the rows in a random order
    (`launch_order`)."""
    kernel = verify_decode_kda_mgpu if gate == "kda" else verify_decode_mgpu
    ckpt, u_c, k_c, g_c, q, k, v, g, beta, parents = _inputs(rng, state_dtype, state_dtype, gate == "kda")
    qk_dtype = jnp.bfloat16 if params.readout == "mma" else jnp.float32
    q, k = (np.asarray(jnp.asarray(x, qk_dtype).astype(jnp.float32)) for x in (q, k))  # the model sees the rounding
    slots, cursors, lengths = _rows(rng)
    out = kernel(
        jnp.asarray(ckpt, state_dtype), jnp.asarray(u_c, state_dtype), jnp.asarray(k_c, state_dtype),
        jnp.asarray(g_c), jnp.asarray(q, qk_dtype), jnp.asarray(k, qk_dtype), *(jnp.asarray(x) for x in (v, g, beta)),
        jnp.asarray(slots), jnp.asarray(cursors), jnp.asarray(lengths),
        jnp.asarray(_ancestors(parents), bool), use_qk_l2norm=True, params=params, interpret=True,
        **(dict(row_order=jnp.asarray(rng.permutation(len(SLOTS)), jnp.int32)) if params.launch_order else {}))
    out, got_cursors = out[:5], out[5]
    # The kernel resets the folding rows' cursors in place, and no other.
    np.testing.assert_array_equal(got_cursors, np.where(np.isin(np.arange(NUM_SLOTS), SLOTS[FOLD]), 0, cursors))
    want = _model(ckpt, u_c, k_c, g_c, q, k, v, g, beta, parents, state_dtype=state_dtype)
    # fp32: float64 sums vs fp32 FMAs in another order (~1e-6 of the largest entry).
    # bf16 state and caches: the inputs are the rounded values in both, the stores round
    # the new records (2^-9 of each value) and the folded state's rounding is modelled.
    tol = 2e-5 if state_dtype == jnp.float32 else 1e-2
    for name, got, ref in zip(("y", "checkpoint", "u_cache", "k_cache", "g_cache"), out, want):
        got = np.asarray(jnp.asarray(got).astype(jnp.float32), np.float64)
        stale = ~np.isfinite(ref)
        np.testing.assert_array_equal(~np.isfinite(got), stale, err_msg=f"{name}: a non-finite value moved")
        scale = np.max(np.abs(np.where(stale, 0.0, ref))) + 1e-30
        np.testing.assert_allclose(np.where(stale, 0.0, got) / scale, np.where(stale, 0.0, ref) / scale,
                                   atol=tol, err_msg=name)
    y = np.asarray(out[0], np.float32)
    assert not np.any(y[PAD]), "padding rows must output zeros"
    assert not np.any(y[np.arange(T)[None, :] >= LENGTHS[:, None]]), "positions past a row's length output zeros"


def _lower_for_h200(gate, state_dtype, cache_len, width, head_dim=128, params=MosaicReplayParams()):
    """The jitted, donated verify at H_k = 16, H_v = 32 (the benchmark shapes), lowered for
    CUDA on CPU: the Mosaic GPU module text."""
    S = jax.ShapeDtypeStruct
    n, b, hk, hv, d = 16, 8, 16, 32, head_dim
    i32 = jnp.int32
    channels = (d,) if gate == "kda" else ()
    args = [S((n, hv, d, d), state_dtype), S((n, hv, cache_len, d), state_dtype),
            S((n, hk, cache_len, d), state_dtype), S((n, hv, cache_len, *channels), jnp.float32),
            S((b, width, hk, d), jnp.bfloat16), S((b, width, hk, d), jnp.bfloat16), S((b, width, hv, d), jnp.bfloat16),
            S((b, width, hv, *channels), jnp.float32), S((b, width, hv), jnp.float32),
            S((b,), i32), S((n,), i32), S((b,), i32), S((b, width, width), jnp.bool_)]
    kernel = verify_decode_kda_mgpu if gate == "kda" else verify_decode_mgpu
    step = lambda *a: kernel(*a, use_qk_l2norm=True, params=params, interpret=False)
    # the pool's cursors donated as the state arrays
    return jax.jit(step, donate_argnums=(0, 1, 2, 3, 10)).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


SLOW = pytest.mark.slow  # a second shape or option of a path that a faster lowering here also reaches


@pytest.mark.parametrize("gate,state_dtype,cache_len,width,head_dim", [
    ("gdn", jnp.float32, 16, 4, 128), pytest.param("gdn", jnp.float32, 32, 8, 128, marks=SLOW),
    ("gdn", jnp.bfloat16, 16, 2, 128), ("gdn", jnp.float32, 32, 1, 128), ("gdn", jnp.float32, 16, 11, 128),
    pytest.param("kda", jnp.float32, 16, 4, 128, marks=SLOW), pytest.param("kda", jnp.float32, 32, 8, 128, marks=SLOW),
    ("kda", jnp.bfloat16, 16, 2, 128), pytest.param("kda", jnp.bfloat16, 32, 4, 128, marks=SLOW),
    ("kda", jnp.float32, 16, 4, 64),
])
def test_lowers_for_an_abstract_h200(gate, state_dtype, cache_len, width, head_dim):
    """d = 128 (the benchmark shapes; KDA also d = 64, where two warps hold each channel),
    and a window whose coefficient record passes a TMA box's 256 elements unless copied in
    rows (GDN at T = 11: 304; the KDA record, shaped by the same `coefficient_shape`, too;
    T = 16, the widest, lowers the same way at twice the CPU time)."""
    assert "mosaic_gpu" in _lower_for_h200(gate, state_dtype, cache_len, width, head_dim)


@pytest.mark.parametrize("state_dtype,cache_len,width,readout", [
    (jnp.float32, 16, 4, "fma"), pytest.param(jnp.bfloat16, 32, 4, "fma", marks=SLOW),
    pytest.param(jnp.float32, 16, 4, "mma", marks=SLOW), pytest.param(jnp.bfloat16, 32, 4, "mma", marks=SLOW)])
def test_persistent_gdn_verify_lowers_for_an_abstract_h200(state_dtype, cache_len, width, readout):
    """As many persistent CTAs as fit (132 SMs), without Mosaic's barriers (as every
    persistent default; the float64-model tests run them with the barriers too), and with
    the tensor-core readout (which interpret mode cannot run: the GPU check of
    `benchmarks/verify_bench.py` compares it with xla)."""
    programs = persistent_programs(8, width, 32, 128, 128, cache_len, state_dtype, state_dtype, jnp.bfloat16, 132,
                                   readout=readout)
    assert 1 <= programs <= 8 * 32 * 2
    params = MosaicReplayParams(programs=programs, auto_barriers=False, readout=readout)
    assert "mosaic_gpu" in _lower_for_h200("gdn", state_dtype, cache_len, width, params=params)


@pytest.mark.parametrize("state_dtype,cache_len,rebuild,programs,readout,per_tile_addresses", [
    # (the bf16 row's defaults, with their records taken with the tile, lower below)
    pytest.param(jnp.bfloat16, 16, "3xtf32", 264, "mma", True, marks=SLOW),
    pytest.param(jnp.float32, 24, "3xtf32", 0, "fma", False, marks=SLOW),
    (jnp.float32, 24, "3xtf32", 0, "fma", True), (jnp.float32, 16, "tf32", 0, "fma", False)])
def test_tensor_core_fold_lowers_for_an_abstract_h200(state_dtype, cache_len, rebuild, programs, readout,
                                                      per_tile_addresses):
    """Folds rebuilt on tensor cores (`rebuild.rebuild_mma`, operands in the stage's tile
    buffer, in chunks of 8 entries for a bf16 tile and for a ring of 24), persistent or one
    CTA per tile, and with the buffers' addresses per tile (the union through its unit
    axis): interpret mode cannot run the `wgmma`s, so the GPU check of
    `benchmarks/verify_bench.py` compares the folded checkpoints with xla."""
    params = MosaicReplayParams(programs=programs, auto_barriers=not programs, readout=readout, rebuild=rebuild,
                                per_tile_addresses=per_tile_addresses)
    assert "mosaic_gpu" in _lower_for_h200("gdn", state_dtype, cache_len, 4, params=params)


@pytest.mark.parametrize("cache_dtype,qk_dtype,cache_len,num_k_heads,heads,d", [
    (jnp.float32, jnp.float32, 16, 4, 4, 128), (jnp.bfloat16, jnp.bfloat16, 16, 4, 4, 64),
    (jnp.float32, jnp.bfloat16, 32, 4, 2, 128), (jnp.bfloat16, jnp.float32, 24, 3, 1, 64)])
def test_window_key_values_are_the_key_sums(rng, cache_dtype, qk_dtype, cache_len, num_k_heads, heads, d):
    """`window_key_values` (its own kernel, interpret mode: the same bf16 parts and products
    as dots) against the sums written out in NumPy: `K q_j` in row j and `K k_j` in row
    T + j of each key head's block columns, over each slot's whole ring, of the raw
    vectors, zeros at and past a row's length (NaN there stays out). Blocks of 4 rings of
    16 (the 64 rows of the product), of 2 rings of 32, and of one ring of 24 (24 of the 64
    rows: three rings of H_k = 3 would take 72); d_k of one copy chunk and of two
    (`KEY_CHUNK`), whose products add up."""
    batch, width, n = 3, 3, 4
    hk, L = num_k_heads, cache_len
    k_cache = rng.standard_normal((n, hk, L, d)).astype(np.float32)
    q, k = (rng.standard_normal((batch, width, hk, d)).astype(np.float32) for _ in range(2))
    slot, length = np.array([2, 0, 0], np.int32), np.array([3, 1, 0], np.int32)
    for b in range(batch):
        q[b, length[b]:], k[b, length[b]:] = np.nan, np.nan
    k_cache, q, k = (np.asarray(jnp.asarray(x, dt).astype(jnp.float32)) for x, dt in
                     ((k_cache, cache_dtype), (q, qk_dtype), (k, qk_dtype)))
    got = np.asarray(window_key_values(jnp.asarray(q, qk_dtype), jnp.asarray(k, qk_dtype),
                                       jnp.asarray(k_cache, cache_dtype),
                                       VerifyRows(jnp.asarray(slot), jnp.zeros((batch,), jnp.int32),
                                                  jnp.asarray(length)), interpret=True))
    assert key_block_heads(hk, L, window_rows(width) * tile_parts(qk_dtype)) == heads
    assert got.shape == (batch, hk // heads, window_rows(width), 64)
    for b in range(batch):
        keys = k_cache[slot[b]].astype(np.float64)  # [hk, L, d]
        want = np.zeros((hk, 2 * width, L))
        for i in range(length[b]):
            want[:, i] = np.einsum("hld,hd->hl", keys, q[b, i])
            want[:, width + i] = np.einsum("hld,hd->hl", keys, k[b, i])
        for h in range(hk):
            block = got[b, h // heads, :2 * width, h % heads * L:(h % heads + 1) * L]
            # Exact products summed in fp32 in another order than the float64 ones.
            np.testing.assert_allclose(block, want[h], rtol=1e-5, atol=1e-5, err_msg=f"row {b}, key head {h}")
        assert not np.any(got[b, :, 2 * width:]), "the zero rows past 2T sum to zero"
    # Only appending rows read their rings: a padding row (length 0) and a folding row (row
    # 2, slot 0: pos + length > L) get zeros, even where slot 0's ring holds NaN and the
    # folding row's vectors are NaN (a read would show either).
    poisoned = k_cache.copy()
    poisoned[0] = np.nan
    pos, length = jnp.asarray([0, 0, L - 1], jnp.int32), jnp.asarray([3, 0, 2], jnp.int32)
    skipped = np.asarray(window_key_values(jnp.asarray(q, qk_dtype), jnp.asarray(k, qk_dtype),
                                           jnp.asarray(poisoned, cache_dtype),
                                           VerifyRows(jnp.asarray(slot), pos, length), interpret=True))
    np.testing.assert_array_equal(skipped[0], got[0])
    assert not np.any(skipped[1:]), "rows that do not append get zeros without reading their rings"


@pytest.mark.parametrize("cache_dtype,qk_dtype,cache_len,width", [
    (jnp.float32, jnp.float32, 32, 4), (jnp.bfloat16, jnp.float32, 24, 8), (jnp.bfloat16, jnp.bfloat16, 16, 4)])
def test_window_key_values_lower_for_an_abstract_h200(cache_dtype, qk_dtype, cache_len, width):
    """The key-sum kernel at the benchmark's H_k = 16, d = 128: fp32 q and k (three bf16
    parts per vector), blocks of two rings of 24 (48 of the product's 64 rows) and of four
    rings of 16; its transposed store is what interpret mode cannot check."""
    S, i32 = jax.ShapeDtypeStruct, jnp.int32
    b, hk, d = 8, 16, 128
    args = [S((b, width, hk, d), qk_dtype)] * 2 + [S((16, hk, cache_len, d), cache_dtype)] + [S((b,), i32)] * 3
    step = lambda q, k, keys, *rows: window_key_values(q, k, keys, VerifyRows(*rows), interpret=False)
    assert "mosaic_gpu" in jax.jit(step).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def test_verify_kernels_take_only_their_options():
    """The GDN verify kernel takes per-tile addresses, the key side from XLA and several
    warpgroups per CTA; the one-CTA-per-tile verify kernels (KDA, Mamba-2) refuse them, and
    every verify kernel refuses decode's key side on tensor cores."""
    check_params(MosaicReplayParams(programs=4, per_tile_addresses=True, key_side="xla"), "gdn", pipelined=True)
    with pytest.raises(ValueError, match="per_tile_addresses must be False"):
        check_params(MosaicReplayParams(per_tile_addresses=True), "kda")
    with pytest.raises(ValueError, match="key_side must be 'kernel'"):
        check_params(MosaicReplayParams(key_side="xla"), "kda")
    three = MosaicReplayParams(programs=6, auto_barriers=False, warpgroups=3, key_side="xla")
    check_params(three, "gdn", pipelined=True)
    with pytest.raises(ValueError, match="warpgroups must be 1"):
        check_params(three, "kda")
    # Only the GDN and KDA verify kernels have a window formed by a kernel before their launch.
    check_params(MosaicReplayParams(window_side="kernel"), "gdn", pipelined=True)
    check_params(MosaicReplayParams(window_side="kernel"), "kda", window_side=True)
    with pytest.raises(ValueError, match="window_side must be 'xla'"):
        check_params(MosaicReplayParams(window_side="kernel"), "kda")
    with pytest.raises(ValueError, match="window_side must be one of"):
        MosaicReplayParams(window_side="triton")
    with pytest.raises(ValueError, match="window_warps applies to window_side='kernel'"):
        MosaicReplayParams(window_warps=1)
    with pytest.raises(ValueError, match="window_warps must be 1, 2, 4 or 8"):
        MosaicReplayParams(window_side="kernel", window_warps=3)
    # Prefetched folds: the GDN verify kernel's persistent programs only.
    check_params(MosaicReplayParams(programs=4, prefetch_folds=True), "gdn", pipelined=True)
    with pytest.raises(ValueError, match="prefetch_folds must be False"):
        check_params(MosaicReplayParams(prefetch_folds=True), "kda", window_side=True)
    with pytest.raises(ValueError, match="prefetch_folds must be a bool"):
        MosaicReplayParams(prefetch_folds=1)
    check_params(MosaicReplayParams(programs=4, group_folds=True), "gdn", pipelined=True)
    with pytest.raises(ValueError, match="group_folds must be False"):
        check_params(MosaicReplayParams(group_folds=True), "kda", window_side=True)
    with pytest.raises(ValueError, match="group_folds must be a bool"):
        MosaicReplayParams(group_folds="yes")
    with pytest.raises(ValueError, match="set one"):
        MosaicReplayParams(programs=4, prefetch_folds=True, group_folds=True)
    # Decode's key side on tensor cores is not verify's (its window sums are its own).
    for params in (MosaicReplayParams(key_side="mma"),
                   MosaicReplayParams(programs=6, auto_barriers=False, warpgroups=3, key_side="mma")):
        with pytest.raises(ValueError, match="key_side must be 'kernel' or 'xla', got 'mma'"):
            check_params(params, "gdn", pipelined=True)


@pytest.mark.parametrize("state_dtype,cache_len,rebuild,readout", [
    (jnp.float32, 32, "exact", "mma"), (jnp.bfloat16, 16, "3xtf32", "mma")])
def test_xla_key_side_lowers_for_an_abstract_h200(state_dtype, cache_len, rebuild, readout):
    """The window's key sums from XLA, persistent at the CTAs that fit: the stage copies the
    sums `[2T, L]` in place of the key records, so at fp32, L = 32 two CTAs fit per SM
    (one with the key records); a tensor-core fold copies the records into the CTA's
    buffer."""
    fits = lambda side: persistent_programs(512, 4, 32, 128, 128, cache_len, state_dtype, state_dtype, jnp.bfloat16,
                                            132, readout=readout, rebuild=rebuild, key_side=side)
    assert fits("xla") >= fits("kernel")
    if (state_dtype, cache_len, rebuild) == (jnp.float32, 32, "exact"):
        assert (fits("kernel"), fits("xla")) == (132, 264)
    params = MosaicReplayParams(programs=fits("xla"), auto_barriers=False, readout=readout, rebuild=rebuild,
                                key_side="xla", per_tile_addresses=state_dtype == jnp.bfloat16)
    assert "mosaic_gpu" in _lower_for_h200("gdn", state_dtype, cache_len, 4, params=params)


def test_prefetched_folds_lower_for_an_abstract_h200():
    """fp32 L = 16, T = 4 with the key sums before the launch (the defaults from B = 128):
    record copies of each stage's own still fit two persistent CTAs per SM."""
    fits = lambda prefetch: persistent_smem_bytes(4, 128, 16, jnp.float32, jnp.float32, jnp.bfloat16, readout="mma",
                                                  key_side="xla", prefetch_folds=prefetch)
    assert ctas_per_sm(fits(False)) == ctas_per_sm(fits(True)) == 2
    params = MosaicReplayParams(programs=264, auto_barriers=False, readout="mma", key_side="xla", prefetch_folds=True)
    assert "mosaic_gpu" in _lower_for_h200("gdn", jnp.float32, 16, 4, params=params)


def test_grouped_fold_keys_lower_for_an_abstract_h200():
    """fp32 L = 32, T = 4 with the key sums before the launch (the defaults at B >= 128):
    per-stage record copies (`prefetch_folds`) leave one CTA per SM, a fold's value
    records with its tile and its key records once per group (`group_folds`) two."""
    smem = lambda **kw: persistent_smem_bytes(4, 128, 32, jnp.float32, jnp.float32, jnp.bfloat16, readout="mma",
                                              key_side="xla", **kw)
    assert (ctas_per_sm(smem()), ctas_per_sm(smem(prefetch_folds=True)), ctas_per_sm(smem(group_folds=True))) == (
        2, 1, 2)
    params = MosaicReplayParams(programs=264, auto_barriers=False, readout="mma", key_side="xla", group_folds=True)
    assert "mosaic_gpu" in _lower_for_h200("gdn", jnp.float32, 32, 4, params=params)
    with pytest.raises(ValueError, match="group_folds copies an exact fold's key records"):
        _lower_for_h200("gdn", jnp.float32, 32, 4, params=MosaicReplayParams(group_folds=True))


@pytest.mark.parametrize("warpgroups", [1, 3])
def test_prefetched_key_records_lower_for_an_abstract_h200(warpgroups):
    """A bf16 state's tensor-core folds with the key sums before the launch (the defaults)
    take the key records with the tile, one buffer per stage (and per program), which
    interpret mode cannot run (the folds' `wgmma`s): the GPU check of `verify_bench.py`
    compares them with xla."""
    params = MosaicReplayParams(programs=132 * warpgroups, auto_barriers=False, readout="mma", rebuild="3xtf32",
                                key_side="xla", per_tile_addresses=True, warpgroups=warpgroups, prefetch_folds=True)
    assert "mosaic_gpu" in _lower_for_h200("gdn", jnp.bfloat16, 16, 4, params=params)


@pytest.mark.parametrize("cache_len,width", [(16, 4), (32, 4), pytest.param(16, 8, marks=SLOW)])  # the defaults' rows
def test_three_warpgroups_lower_for_an_abstract_h200(cache_len, width):
    """bf16 state: one CTA of three programs per SM (their buffers fit, the fold's operands
    in buffers of their own; the exact fold's record copies run in the float64-model test),
    as `persistent_programs` counts them; an fp32 tile's three programs do not fit."""
    rebuild, per_tile_addresses = "3xtf32", True
    shape = (512, width, 32, 128, 128, cache_len)
    programs = persistent_programs(*shape, jnp.bfloat16, jnp.bfloat16, jnp.bfloat16, 132,
                                   readout="mma", rebuild=rebuild, key_side="xla", warpgroups=3)
    assert programs == 396
    assert persistent_programs(*shape, jnp.float32, jnp.float32, jnp.bfloat16, 132,
                               readout="mma", rebuild=rebuild, key_side="xla", warpgroups=3) == 0
    params = MosaicReplayParams(programs=programs, auto_barriers=False, readout="mma", rebuild=rebuild,
                                per_tile_addresses=per_tile_addresses, key_side="xla", warpgroups=3)
    assert "mosaic_gpu" in _lower_for_h200("gdn", jnp.bfloat16, cache_len, width, params=params)


def test_tensor_core_fold_needs_a_gpu():
    z = lambda *s: jnp.zeros(s)
    args = [z(2, 2, 64, 64), z(2, 2, 8, 64), z(2, 1, 8, 64), z(2, 2, 8)]
    window = [z(1, 2, 1, 64), z(1, 2, 1, 64), z(1, 2, 2, 64), z(1, 2, 2), z(1, 2, 2)]
    rows = [jnp.zeros((1,), jnp.int32), jnp.zeros((2,), jnp.int32), jnp.zeros((1,), jnp.int32)]
    with pytest.raises(ValueError, match="Mosaic GPU interpret"):
        verify_decode_mgpu(*args, *window, *rows, jnp.zeros((1, 2, 2), bool),
                           params=MosaicReplayParams(rebuild="3xtf32"), interpret=True)


@pytest.mark.parametrize("state_dtype,cache_len,width", [(jnp.float32, 32, 2),
                                                        pytest.param(jnp.bfloat16, 16, 11, marks=SLOW)])
def test_mma_readout_lowers_for_an_abstract_h200(state_dtype, cache_len, width):
    """One CTA per tile; T = 2 (2T < 8: zero rows pad the window) and T = 11 (N = 24)."""
    params = MosaicReplayParams(readout="mma")
    assert "mosaic_gpu" in _lower_for_h200("gdn", state_dtype, cache_len, width, params=params)


@pytest.mark.parametrize("dtype,parts", [(jnp.float32, 3), (jnp.float16, 2), (jnp.bfloat16, 1)])
def test_bf16_parts_hold_the_tile_exactly(rng, dtype, parts):
    """The "mma" readout's algebra (the kernel's `wgmma`s run on a GPU only): a state value
    is the exact sum of `tile_parts` bf16 parts, so each part times a raw bf16 vector is
    exact in fp32 and `S x` keeps the accuracy of fp32 sums; one part fewer loses it."""
    assert tile_parts(dtype) == parts
    s = (rng.standard_normal((64, 128)) * np.exp2(rng.integers(-8, 8, (64, 128)))).astype(np.float32)
    s = np.asarray(jnp.asarray(s).astype(dtype).astype(jnp.float32), np.float64)
    x = np.asarray(jnp.asarray(rng.standard_normal((128, 8)), jnp.bfloat16).astype(jnp.float32), np.float64)
    split = [np.asarray(p.astype(jnp.float32), np.float64) for p in split_bf16(jnp.asarray(s, jnp.float32), parts)]
    np.testing.assert_array_equal(sum(split), s)
    # The parts' products against the tile's, both summed in float64: the same up to
    # float64 rounding of the sums (2^-50 of the magnitudes summed).
    scale = np.abs(s) @ np.abs(x)
    assert np.max(np.abs(sum(p @ x for p in split) - s @ x) / scale) < 2.0 ** -50
    if parts > 1:
        short = sum(split[:-1])
        assert np.max(np.abs(short - s) / np.abs(s)) > 2.0 ** -20, "the last part carries bits"


def test_history_weights_are_the_decays_of_each_entry(rng):
    """`history_weights`: per (row, value head) the product of `e^{g_i}` over the entries
    after j and before the row's cursor for each entry j < pos, 0 past it, then the product
    over all of them (1 for an empty history), then zeros; float64 products of the gate
    records (NaN in every stale one, which must reach nothing). fp32 sums of at most L
    log-decays against float64 products: ~1e-6 relative."""
    num_slots, hv, cache_len = 5, 3, 8
    slot = np.array([3, -1, 0, 4], np.int32)  # row 1 a padding row (reads slot 0's, unused)
    pos = np.array([5, 2, 0, 8], np.int32)
    g_c = -rng.uniform(0.0, 2.0, (num_slots, hv, cache_len))
    stale = np.arange(cache_len)[None, :] >= pos[:, None]
    g_in = g_c.copy()
    for b, s in enumerate(slot):
        if s >= 0:
            g_in[s][:, stale[b]] = np.nan
    got = np.asarray(history_weights(jnp.asarray(g_in, jnp.float32), jnp.asarray(slot), jnp.asarray(pos)))
    assert got.shape == (4, hv, cache_len + HISTORY_PAD)
    for b, (s, p) in enumerate(zip(slot, pos)):
        if s < 0:
            continue
        decays = np.exp(g_c[s])  # [Hv, L]
        want = np.zeros((hv, cache_len + HISTORY_PAD))
        for j in range(p):
            want[:, j] = np.prod(decays[:, j + 1:p], axis=1)
        want[:, cache_len] = np.prod(decays[:, :p], axis=1)
        np.testing.assert_allclose(got[b], want, rtol=2e-6, atol=0, err_msg=f"row {b}")


def test_window_vectors_are_the_raw_rows_padded():
    """Rows q_0 .. q_{T-1}, k_0 .. k_{T-1}, then zeros to a multiple of 8; positions at and
    past a row's length are zeros (NaN there included)."""
    B, width, hk, d = 2, 3, 2, 64
    q = jnp.arange(B * width * hk * d, dtype=jnp.float32).reshape(B, width, hk, d).astype(jnp.bfloat16)
    k = -q
    q = q.at[1, 2].set(jnp.nan)
    x = np.asarray(window_vectors(q, k, jnp.array([3, 2])).astype(jnp.float32))
    assert x.shape == (B, hk, window_rows(width), d) == (2, 2, 8, 64)
    np.testing.assert_array_equal(x[0, :, :3], np.moveaxis(np.asarray(q[0].astype(jnp.float32)), 0, 1))
    np.testing.assert_array_equal(x[0, :, 3:6], np.moveaxis(np.asarray(k[0].astype(jnp.float32)), 0, 1))
    np.testing.assert_array_equal(x[1, :, 2], 0.0)  # past row 1's length: its NaN dropped
    np.testing.assert_array_equal(x[1, :, 5], 0.0)
    np.testing.assert_array_equal(x[:, :, 6:], 0.0)
    assert window_rows(11) == 24


def test_persistent_verify_fits_shared_memory():
    """Two stages of the fp32 L = 16, T = 4 buffers (~46 KiB each) and the fold's record
    copies: two CTAs per SM; at L = 32 one; never more CTAs than tiles."""
    f32, bf16 = jnp.float32, jnp.bfloat16
    assert persistent_programs(512, 4, 32, 128, 128, 16, f32, f32, bf16, 132) == 264
    assert persistent_programs(512, 4, 32, 128, 128, 32, f32, f32, bf16, 132) == 132
    assert persistent_programs(1, 4, 2, 128, 128, 16, f32, f32, bf16, 132) == 4


def test_backend_verify_defaults():
    """GDN verifies with the tensor-core readout where q and k are bf16 (measured faster at
    fp32 and bf16 states), on persistent CTAs where two fit per SM (fp32 L = 16, T = 4; at
    L = 32 with the window's key sums before the launch, which make the room), folds
    rebuilt exactly off GPU, per-tile addresses with a bf16 state (measured faster), three
    warpgroups per CTA with a bf16 state at large batches, one CTA per tile with an fp32 state
    at B = 16 (8 at T = 4) to 127; KDA and Mamba-2 one CTA per tile on CUDA cores (KDA with the window
    kernel)."""
    from replayssm_jax import ReplayConfig
    from replayssm_jax.backends import mosaic_gpu

    gdn = lambda L: ReplayConfig(16, 32, 128, 128, L)
    window = dict(window_side="kernel", window_warps=1)
    persistent = lambda **kw: MosaicReplayParams(programs=264, auto_barriers=False, readout="mma", key_side="xla",
                                                 **window, **kw)
    # An fp32 state takes the window's key sums from their own kernel from B = 128 (measured
    # faster at L = 16 and 32); at B = 16 to 127 (L = 16, T <= 4; from B = 8 at T = 4) one CTA
    # per tile with them (measured faster at 16, 32 and 64); below it the kernel sums them itself.
    # Their exact folds take the records with the tile where that fits two CTAs per SM (L = 16).
    assert mosaic_gpu.verify_default_params(gdn(16), 512, 4, jnp.bfloat16) == persistent(prefetch_folds=True)
    assert mosaic_gpu.verify_default_params(gdn(16), 64, 4, jnp.bfloat16) == MosaicReplayParams(
        readout="mma", key_side="xla", **window)
    assert mosaic_gpu.verify_default_params(gdn(16), 64, 4, jnp.bfloat16, interpret=False).rebuild == "3xtf32"
    assert mosaic_gpu.verify_default_params(gdn(16), 128, 4, jnp.bfloat16).programs == 264
    assert mosaic_gpu.verify_default_params(gdn(16), 64, 8, jnp.bfloat16).programs == 264  # T = 8 not measured
    one_cta = MosaicReplayParams(readout="mma", key_side="xla", **window)
    assert mosaic_gpu.verify_default_params(gdn(16), 16, 2, jnp.bfloat16) == one_cta
    assert mosaic_gpu.verify_default_params(gdn(16), 8, 4, jnp.bfloat16) == one_cta
    assert mosaic_gpu.verify_default_params(gdn(16), 8, 2, jnp.bfloat16).key_side == "kernel"
    assert mosaic_gpu.verify_default_params(gdn(16), 4, 4, jnp.bfloat16).key_side == "kernel"
    assert mosaic_gpu.verify_default_params(gdn(16), 64, 8, jnp.bfloat16).window_warps == 1  # two from T = 9
    assert mosaic_gpu.verify_default_params(gdn(16), 64, 9, jnp.bfloat16).window_warps == 2
    # fp32 L = 32: two persistent CTAs fit per SM only with the key sums from XLA.
    assert mosaic_gpu.verify_default_params(gdn(32), 512, 4, jnp.bfloat16) == persistent()
    assert mosaic_gpu.verify_default_params(gdn(16), 512, 4, jnp.float32).readout == "fma"  # mma needs bf16 q, k
    # On a GPU folds rebuild by 3xTF32 where its operands cost no CTAs per SM (all these),
    # but for an fp32 tile on persistent CTAs (measured slower there).
    on_gpu = lambda cfg, width=4: mosaic_gpu.verify_default_params(cfg, 512, width, jnp.bfloat16, interpret=False)
    assert on_gpu(gdn(16)) == persistent(prefetch_folds=True)
    assert on_gpu(gdn(32)) == persistent()
    bf16_cfg = lambda L: ReplayConfig(16, 32, 128, 128, L, state_dtype=jnp.bfloat16, cache_dtype=jnp.bfloat16)
    # Rings of 32: the key sums before the launch from B = 8 (measured faster at 8 and 32) and
    # three warpgroups from B = 128 (measured at 128 and 256); below B = 8 the kernel's own.
    assert on_gpu(bf16_cfg(32)) == MosaicReplayParams(programs=396, auto_barriers=False, readout="mma",
                                                      rebuild="3xtf32", key_side="xla", per_tile_addresses=True,
                                                      warpgroups=3, **window)
    bf16_32 = lambda batch: mosaic_gpu.verify_default_params(bf16_cfg(32), batch, 4, jnp.bfloat16, interpret=False)
    assert (bf16_32(128).warpgroups, bf16_32(64).key_side, bf16_32(64).warpgroups) == (3, "xla", 1)
    assert (bf16_32(8).key_side, bf16_32(4).key_side) == ("xla", "kernel")
    assert on_gpu(bf16_cfg(64)).warpgroups == 1  # rings of 64 not measured with three
    # A bf16 state on rings of 16: the key sums before the launch from B = 8 and, at T <= 8,
    # three warpgroups per CTA, one CTA per SM, from B = 128.
    # Their tensor-core folds take the key records with the tile where those buffers fit
    # (T <= 4 on rings of 16; only on a GPU, where folds run on tensor cores).
    bf16 = on_gpu(bf16_cfg(16))
    assert bf16 == MosaicReplayParams(programs=396, auto_barriers=False, readout="mma", rebuild="3xtf32",
                                      key_side="xla", per_tile_addresses=True, warpgroups=3, prefetch_folds=True,
                                      **window)
    assert mosaic_gpu.verify_default_params(bf16_cfg(16), 512, 4, jnp.bfloat16).prefetch_folds is False
    at = lambda batch, width=4: mosaic_gpu.verify_default_params(bf16_cfg(16), batch, width, jnp.bfloat16,
                                                                 interpret=False)
    assert (at(128).warpgroups, at(64).warpgroups, at(64).key_side, at(64).programs) == (3, 1, "xla", 264)
    assert (at(8).key_side, at(4).key_side, at(512, 8).warpgroups, at(512, 2).warpgroups) == ("xla", "kernel", 3, 3)
    assert (at(512, 2).prefetch_folds, at(512, 8).prefetch_folds, bf16_32(128).prefetch_folds) == (True, False, False)
    # T >= 8 on rings of 32: one CTA per tile with the key sums before the launch (measured
    # faster than persistent CTAs at the register cap), as the measured configurations.
    assert on_gpu(gdn(32), 8) == MosaicReplayParams(readout="mma", key_side="xla", **window)
    assert on_gpu(bf16_cfg(32), 8) == MosaicReplayParams(readout="mma", rebuild="3xtf32", key_side="xla",
                                                         per_tile_addresses=True, **window)
    assert on_gpu(gdn(16), 8).programs == 264 and on_gpu(gdn(32), 4).programs == 264
    # The window kernel's Triton blocks take a power-of-two d_k only; the key sums before
    # the launch a ring of at most 64.
    assert on_gpu(ReplayConfig(16, 32, 192, 128, 16)).window_side == "xla"
    assert on_gpu(ReplayConfig(16, 32, 128, 128, 128)).key_side == "kernel"
    assert mosaic_gpu.verify_default_params(ReplayConfig(32, 32, 128, 128, 16, gate="kda"), 512, 4,
                                            jnp.bfloat16) == MosaicReplayParams(window_side="kernel")
    assert mosaic_gpu.verify_default_params(ReplayConfig(32, 32, 96, 128, 16, gate="kda"), 512, 4,
                                            jnp.bfloat16).window_side == "xla"
    assert mosaic_gpu.verify_default_params(ReplayConfig.mamba2(128, 64, 128, 8, 16), 512, 4,
                                            jnp.bfloat16) == MosaicMamba2Params(window_side="kernel")
    assert mosaic_gpu.verify_default_params(ReplayConfig.mamba2(128, 64, 192, 8, 16), 512, 4,
                                            jnp.bfloat16) == MosaicMamba2Params()


def test_refuses_shapes_it_cannot_take():
    z = lambda *s: jnp.zeros(s)
    args = [z(2, 2, 64, 64), z(2, 2, 8, 64), z(2, 1, 8, 64), z(2, 2, 8)]
    window = lambda t: [z(1, t, 1, 64), z(1, t, 1, 64), z(1, t, 2, 64), z(1, t, 2), z(1, t, 2)]
    rows = [jnp.zeros((1,), jnp.int32), jnp.zeros((2,), jnp.int32), jnp.zeros((1,), jnp.int32)]
    with pytest.raises(ValueError, match="window width T"):
        verify_decode_mgpu(*args, *window(9), *rows, jnp.zeros((1, 9, 9), bool))
    with pytest.raises(ValueError, match="anc must have shape"):
        verify_decode_mgpu(*args, *window(2), *rows, jnp.zeros((1, 2, 3), bool))
    with pytest.raises(ValueError, match="per-head"):
        verify_decode_mgpu(*args[:3], z(2, 2, 8, 64), *window(2), *rows, jnp.zeros((1, 2, 2), bool))
    with pytest.raises(ValueError, match="needs bf16 q and k"):  # fp32 q and k, and interpret mode
        verify_decode_mgpu(*args, *window(2), *rows, jnp.zeros((1, 2, 2), bool),
                           params=MosaicReplayParams(readout="mma"), interpret=True)
    with pytest.raises(ValueError, match="readout must be one of"):
        MosaicReplayParams(readout="wgmma")
    # one int32 cursor per slot, one slot and one length per row
    for i, x, name in ((1, jnp.zeros((3,), jnp.int32), "cursors must be integer of shape"),
                       (1, jnp.zeros((2,), jnp.float32), "cursors must be integer of shape"),
                       (1, jnp.zeros((2,), jnp.int16), "cursors must be int32"),
                       (0, jnp.zeros((2,), jnp.int32), "slots must be integer of shape"),
                       (2, jnp.zeros((1,), jnp.float32), "lengths must be integer of shape")):
        bad = list(rows)
        bad[i] = x
        with pytest.raises(ValueError, match=name):
            verify_decode_mgpu(*args, *window(2), *bad, jnp.zeros((1, 2, 2), bool))
    for params in (MosaicReplayParams(prefetch_folds=True),  # one CTA per tile
                   MosaicReplayParams(programs=2, rebuild="3xtf32", prefetch_folds=True),  # fetches no keys
                   MosaicReplayParams(programs=3, auto_barriers=False, warpgroups=3, key_side="xla",
                                      prefetch_folds=True)):  # the exact rebuild on three warpgroups
        with pytest.raises(ValueError, match="prefetch_folds copies a fold's records one tile ahead"):
            verify_decode_mgpu(*args, *window(2), *rows, jnp.zeros((1, 2, 2), bool), params=params)


def test_kda_refuses_shapes_it_cannot_take():
    z = lambda *s: jnp.zeros(s)
    state = lambda d, length=8: [z(2, 2, 64, d), z(2, 2, length, 64), z(2, 1, length, d), z(2, 2, length, d)]
    window = lambda t, d=64: [z(1, t, 1, d), z(1, t, 1, d), z(1, t, 2, 64), z(1, t, 2, d), z(1, t, 2)]
    rows = [jnp.zeros((1,), jnp.int32), jnp.zeros((2,), jnp.int32), jnp.zeros((1,), jnp.int32)]
    anc = lambda t: jnp.zeros((1, t, t), bool)
    with pytest.raises(ValueError, match="window width T"):
        verify_decode_kda_mgpu(*state(64), *window(9), *rows, anc(9))
    with pytest.raises(ValueError, match="anc must have shape"):
        verify_decode_kda_mgpu(*state(64), *window(2), *rows, jnp.zeros((1, 2, 3), bool))
    with pytest.raises(ValueError, match=r"g_cache \[N, H_v, L, d_k\] and g \[B, T, H_v, d_k\]"):
        verify_decode_kda_mgpu(*state(64)[:3], z(2, 2, 8), *window(2), *rows, anc(2))
    with pytest.raises(ValueError, match=r"g_cache \[N, H_v, L, d_k\] and g \[B, T, H_v, d_k\]"):
        verify_decode_kda_mgpu(*state(64), *window(2)[:3], z(1, 2, 2), z(1, 2, 2), *rows, anc(2))
    with pytest.raises(ValueError, match="d_k = 64 or a multiple of 128"):
        verify_decode_kda_mgpu(*state(192), *window(2, 192), *rows, anc(2))
    with pytest.raises(ValueError, match="exact fp32 only"):
        verify_decode_kda_mgpu(*state(64), *window(2), *rows, anc(2), params=MosaicReplayParams(rebuild="tf32"))
    with pytest.raises(ValueError, match="programs must be 0"):
        verify_decode_kda_mgpu(*state(64), *window(2), *rows, anc(2), params=MosaicReplayParams(programs=4))
    with pytest.raises(ValueError, match="readout='fma' only"):
        verify_decode_kda_mgpu(*state(64), *window(2), *rows, anc(2), params=MosaicReplayParams(readout="mma"))
    # fp32 records of a 96-entry ring at d = 128 (with the weights W and the window) outgrow
    # a CTA's shared memory: a ValueError naming the size, not a failed compile.
    with pytest.raises(ValueError, match="bytes of shared memory per CTA"):
        _lower_for_h200("kda", jnp.float32, 96, 4)


@pytest.mark.parametrize("gate,state_dtype,raw,params", [
    ("gdn", jnp.float32, True, None), ("gdn", jnp.bfloat16, False, None), ("kda", jnp.float32, True, None),
    ("kda", jnp.bfloat16, False, None),
    # (the launch order's rows are the float64-model test's too)
    pytest.param("gdn", jnp.float32, False, MosaicReplayParams(programs=2, auto_barriers=False, launch_order=True),
                 marks=SLOW),
    ("gdn", jnp.bfloat16, True, MosaicReplayParams(programs=2, auto_barriers=False, window_side="kernel")),
    # KDA's defaults at d_k = 64 are these params (the case above): slow-marked, it keeps
    # them tested should the defaults change.
    pytest.param("kda", jnp.float32, True, MosaicReplayParams(window_side="kernel"), marks=SLOW),
])
def test_backend_verify_and_accept_match_xla(rng, gate, state_dtype, raw, params):
    """`verify_step(backend="mosaic_gpu")` against the xla backend through rounds of
    verify and accept (0..length tokens per row, chains and trees), with a padding row and
    rows that fold by the capacity rule, each backend on its own state; raw gates (gated
    by the backend) or activated ones; `params`: the kernel's (two persistent programs
    serving the rows folding ones first) or its defaults."""
    from replayssm_jax import ReplayConfig, Tokens, accept, init_state, materialize_state, verify_step

    cfg = ReplayConfig(1, 2, 64, 64, 8, gate=gate, state_dtype=state_dtype, cache_dtype=state_dtype)
    channels = (64,) if gate == "kda" else ()
    start = jnp.asarray(rng.standard_normal((4, 2, 64, 64)) * 0.1, state_dtype)
    states = {b: init_state(cfg, 4, checkpoint=start) for b in ("xla", "mosaic_gpu")}
    slots = jnp.asarray([2, -1, 0, 3], jnp.int32)
    verify = jax.jit(verify_step, static_argnames=("backend", "use_qk_l2norm", "kernel_params"))
    # fp32: two summation orders (~1e-7 relative). bf16: both backends round the stores to
    # bf16, and an entry that rounds differently differs by one bf16 ulp.
    tol = 1e-5 if state_dtype == jnp.float32 else 2e-2
    folds = 0
    dt_bias = jnp.broadcast_to(jnp.asarray([0.5, -1.0]).reshape(2, *(1,) * len(channels)), (2, *channels))
    for round_ in range(24):  # at least 5 rounds (chains and trees), then until a row has folded
        if round_ >= 5 and folds:
            break
        f = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)
        g = f(4, T, 2, *channels) if raw else -jnp.abs(f(4, T, 2, *channels)) * 0.2
        window = Tokens(f(4, T, 1, 64), f(4, T, 1, 64), f(4, T, 2, 64), g,
                        f(4, T, 2) if raw else jax.nn.sigmoid(f(4, T, 2)))
        lengths = rng.integers(0, T + 1, 4).astype(np.int32)
        parents = (np.stack([rng.integers(-1, np.arange(T)) for _ in range(4)]).astype(np.int32)
                   if round_ % 2 else None)
        extra = dict(lengths=jnp.asarray(lengths), parents=None if parents is None else jnp.asarray(parents),
                     gate_params=(jnp.asarray([0.1, -0.4]), dt_bias) if raw else None)
        cursors = np.asarray(states["xla"].write_pos)[np.asarray(slots)]
        folds += int(np.sum((np.asarray(slots) >= 0) & (cursors + lengths > cfg.cache_len)))
        ys = {}
        for b in states:
            ys[b], states[b] = verify(states[b], window, slots, backend=b, use_qk_l2norm=True,
                                      kernel_params=params if b == "mosaic_gpu" else None, **extra)
        np.testing.assert_allclose(np.asarray(ys["mosaic_gpu"], np.float32), np.asarray(ys["xla"], np.float32),
                                   atol=tol, rtol=tol, err_msg=f"y in round {round_}")
        counts = jnp.asarray(rng.integers(0, lengths + 1), jnp.int32)
        # A tree's accepted path: the branch to the last accepted position (a chain: 0..n-1).
        path = None
        if parents is not None:
            counts = jnp.asarray([len(_branch(parents[r], int(lengths[r]) - 1)) if lengths[r] else 0
                                  for r in range(4)], jnp.int32)
            path = jnp.asarray([((_branch(parents[r], int(lengths[r]) - 1) if lengths[r] else []) + [0] * T)[:T]
                                for r in range(4)], jnp.int32)
        for b in states:
            states[b] = accept(states[b], slots, counts, path=path)
        np.testing.assert_array_equal(np.asarray(states["mosaic_gpu"].write_pos), np.asarray(states["xla"].write_pos))
        live = {b: materialize_state(s, jnp.arange(4, dtype=jnp.int32)) for b, s in states.items()}
        np.testing.assert_allclose(np.asarray(live["mosaic_gpu"]), np.asarray(live["xla"]), atol=tol, rtol=tol,
                                   err_msg=f"live states after round {round_}")
    assert folds, "the schedule must cross the capacity rule"


def test_verify_step_refuses_what_the_kernel_cannot_take(rng):
    from replayssm_jax import ReplayConfig, Tokens, init_state, verify_step
    from pallas_kernels.verify_readout import VerifyReadoutParams

    f = lambda *s: jnp.zeros(s)
    window = lambda g_shape: Tokens(f(1, 2, 1, 64), f(1, 2, 1, 64), f(1, 2, 2, 64), f(1, 2, *g_shape), f(1, 2, 2))
    slots = jnp.zeros((1,), jnp.int32)
    kda = ReplayConfig(1, 2, 192, 64, 8, gate="kda")
    window_192 = Tokens(f(1, 2, 1, 192), f(1, 2, 1, 192), f(1, 2, 2, 64), f(1, 2, 2, 192), f(1, 2, 2))
    with pytest.raises(ValueError, match="d_k = 64 or a multiple of 128"):
        verify_step(init_state(kda, 2), window_192, slots, backend="mosaic_gpu")
    gdn = ReplayConfig(1, 2, 64, 64, 8)
    with pytest.raises(ValueError, match="must be a MosaicReplayParams"):
        verify_step(init_state(gdn, 2), window((2,)), slots, backend="mosaic_gpu", kernel_params=VerifyReadoutParams())
