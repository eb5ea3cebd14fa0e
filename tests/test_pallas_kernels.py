"""The Pallas kernels against the xla backend (the readable specification), per layout.

Every kernel layout (per-tile replay, key-head-grouped replay, folding, plain) and rebuild
precision runs here in interpret mode on random steps with padding rows, shuffled slots,
forced flushes and cursors at different phases, both backends under one plan. The kernels'
parameter classes and their checks are tested here too. A separate test lowers every
launch parameter set the package exposes for an abstract H200, so a power-of-two or
dot-shape violation fails CI without a GPU.
"""

from __future__ import annotations

import dataclasses
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import common
from pallas_kernels.common import GridOrder
from pallas_kernels.fold_decode import FoldParams
from pallas_kernels.plain_decode import PlainParams
from pallas_kernels.replay_decode import ReplayTileParams, replay_decode
from pallas_kernels.replay_decode_grouped import ReplayGroupedParams, replay_decode_grouped
from replayssm_jax import FlushPolicy, Tokens, decode, plan
from replayssm_jax.backends import pallas_triton
from replayssm_jax.config import ReplayConfig
from replayssm_jax.state import init_state

from helpers import exposed_kernel_params, random_checkpoint, random_tokens, to_device

_ROWS, _LO, _LOR = GridOrder.ROW_SLOWEST, GridOrder.LAUNCH_ORDER, GridOrder.LAUNCH_ORDER_RELOAD

NUM_SLOTS, BATCH = 7, 4
# fp32 through both backends: the same algebra summed in a different order, ~1e-7 apart.
FP32_BOUND = 1e-5
# "bf16" rounds the rebuild operands (u, W*k) to bf16 (unit roundoff 2^-9) on flush rows
# only; the rebuilt part is a fraction of the state, so the step stays within ~2^-9 * a few.
BF16_REBUILD_BOUND = 2e-2
# bf16 state and caches: both backends round the same values to bf16, but a sum in a
# different order can land on the other side of a rounding boundary: one bf16 ulp, 2^-8.
BF16_STATE_BOUND = 1e-2


def _config(gate: str, cache_len: int, dtype=jnp.float32) -> ReplayConfig:
    """d_v = 32 so BV = 16 gives two tiles per head; GQA r = 2."""
    return ReplayConfig(2, 4, 32, 32, cache_len, gate=gate, state_dtype=dtype, cache_dtype=dtype)


def _normwise_err(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))


def _compare_backends(rng, cfg: ReplayConfig, kernel_params, bound: float, *, raw_gates: bool = False) -> float:
    """Run 2L + 3 random steps through both backends from one state, both under the
    natural plan of `plan.plan_step` (cursors at every phase; a folding kernel then appends
    and flushes), the pallas_triton backend with `kernel_params`; return the worst error of
    y and of every state array (whole arrays: both write the same positions)."""
    state0 = init_state(cfg, NUM_SLOTS, jnp.asarray(random_checkpoint(rng, cfg, NUM_SLOTS)))
    gate_params = None
    if raw_gates:
        dt_shape = (cfg.num_v_heads, cfg.head_k_dim) if cfg.per_channel_gate else (cfg.num_v_heads,)
        gate_params = (jnp.asarray(rng.normal(size=cfg.num_v_heads), jnp.float32) * 0.5,
                       jnp.asarray(rng.normal(size=dt_shape), jnp.float32))

    @jax.jit
    def both(pallas_state, xla_state, tokens, slots, force):
        step_plan = plan.plan_step(pallas_state.write_pos, slots, force, cfg.cache_len)
        y_p, new_p = decode.layer_step(
            pallas_state, tokens, step_plan, backend="pallas_triton", use_qk_l2norm=True,
            gate_params=gate_params, kernel_params=kernel_params,
        )
        y_x, new_x = decode.layer_step(
            xla_state, tokens, step_plan, backend="xla", use_qk_l2norm=True,
            gate_params=gate_params,
        )
        write_pos = plan.advance_write_pos(pallas_state.write_pos, step_plan)
        return (y_p, dataclasses.replace(new_p, write_pos=write_pos),
                y_x, dataclasses.replace(new_x, write_pos=write_pos))

    pallas_state = xla_state = state0
    worst = 0.0
    for _ in range(2 * cfg.cache_len + 3):
        slots = rng.permutation(NUM_SLOTS)[:BATCH].astype(np.int32)
        slots[rng.integers(BATCH)] = -1  # one padding row per step
        force = rng.random(BATCH) < 0.15
        tok = random_tokens(rng, cfg, (BATCH,))
        if raw_gates:  # raw model inputs a, b instead of log-decay and beta
            tok = tok.replace(g=rng.normal(size=tok.g.shape).astype(np.float32), beta=tok.beta * 4 - 2)
        y_p, pallas_state, y_x, xla_state = both(pallas_state, xla_state, to_device(tok), slots, force)
        assert np.all(np.asarray(y_p)[slots < 0] == 0), "padding rows must output exactly 0"
        pairs = [(y_p, y_x)] + [(getattr(pallas_state, name), getattr(xla_state, name))
                                for name in ("checkpoint", "u_cache", "k_cache", "g_cache")]
        worst = max(worst, *(_normwise_err(got, want) for got, want in pairs))
        assert worst <= bound, f"pallas vs xla: {worst:.3g} > {bound:.1g}"
        xla_state = pallas_state  # next step starts both from the kernel's state
    return worst


LAYOUTS = {
    # multi-chunk walk; exact rebuild 3 entries per round trip (13 = 4 * 3 + 1: a partial last load)
    "tile_bv8_chunk4": ReplayTileParams(block_v=8, num_warps=1, cache_chunk=4, rebuild_unroll=3),
    "tile_bv16": ReplayTileParams(block_v=16, num_warps=2, cache_chunk=16),
    "grouped_t1": ReplayGroupedParams(block_v=16, num_warps=2, tiles_per_program=1, rebuild_unroll=1),
    "grouped_t4": ReplayGroupedParams(block_v=16, num_warps=4, tiles_per_program=4, rebuild_unroll=4),
    "grouped_bv32_t2": ReplayGroupedParams(block_v=32, num_warps=4, tiles_per_program=2, rebuild_unroll=1),
    # the folding kernel under the natural plan: appends and flushes at every cursor
    "fold_bv8": FoldParams(block_v=8, num_warps=1),
    # ... with rows at cursor 0 on a branch of their own
    "fold_bv8_empty_cache_branch": FoldParams(block_v=8, num_warps=1, empty_cache_branch=True),
    # column chunks (d_k = 32: four of 8, two of 16) and grids launched row slowest (the
    # per-tile kernel works on whole rows: it has no column chunks)
    "grouped_t1_w8": ReplayGroupedParams(block_v=16, num_warps=2, tiles_per_program=1, rebuild_unroll=2,
                                         column_chunk=8),
    "grouped_t2_w8_row_slowest": ReplayGroupedParams(block_v=8, num_warps=1, tiles_per_program=2,
                                                     rebuild_unroll=2, column_chunk=8, grid_order=_ROWS),
    "fold_bv8_w16_row_slowest": FoldParams(block_v=8, num_warps=1, column_chunk=16, grid_order=_ROWS),
    "tile_bv8_row_slowest": ReplayTileParams(block_v=8, num_warps=1, cache_chunk=8, grid_order=_ROWS),
    # rows served in the plan's launch order (flush rows first): the padding row and forced
    # flushes make it a different permutation from step to step
    "grouped_t2_w8_launch_order": ReplayGroupedParams(block_v=8, num_warps=1, tiles_per_program=2,
                                                      rebuild_unroll=1, column_chunk=8, grid_order=_LO),
    "tile_bv16_launch_order": ReplayTileParams(block_v=16, num_warps=2, cache_chunk=8, grid_order=_LO),
    "grouped_t2_launch_order_reload": ReplayGroupedParams(block_v=8, num_warps=1, tiles_per_program=2,
                                                          rebuild_unroll=1, grid_order=_LOR),
}


@pytest.mark.parametrize("gate", ["gdn", "kda"])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_replay_kernel_layouts_match_spec(rng, gate, layout):
    # L = 13: not a power of two, and more entries than a 4-entry chunk.
    _compare_backends(rng, _config(gate, 13), LAYOUTS[layout], FP32_BOUND)


def _reached(row, gate: str, state_bytes: int) -> bool:
    """Some batch and cache length of the row's ranges (probed at their ends and across
    the table's boundaries) looks this row up first for `gate` and `state_bytes`: the
    row is not shadowed there by an earlier one. Plain steps run at L = 1 only, the others
    at L >= 2."""
    lo, hi = row.batch
    batches = {lo, hi or 4 * lo, *(b for b in (9, 10, 16, 17, 28, 29, 64, 65, 256, 257) if b >= lo and
                                   (hi is None or b <= hi))}
    cache_lens = (1,) if row.step == "plain" else (2, 16, 17, 64)
    return any(row.matches(row.step, gate, state_bytes, b, length) and
               pallas_triton.launch_row(row.step, gate, state_bytes, b, length) is row
               for b in batches for length in cache_lens)


def _table_launches() -> list:
    """`(state dtype, gate, params)` of every launch `pallas_triton.LAUNCH_TABLE` makes
    (ANY gate or state size expanded to each one a row serves: fp32 for 4 bytes, bf16 for
    2), one of each.

    The table's column chunks are for d_k = 128; at the tests' d_k = 32 they are scaled by
    32/128 so that the chunked rows run on chunks here too (W = 64 -> 16)."""
    dtypes = {4: "float32", 2: "bfloat16"}
    out = set()
    for row in pallas_triton.LAUNCH_TABLE:
        if row.step == "verify" or row.gate == "mamba2":  # tests/test_verify_kernel.py, tests/test_mamba2.py
            continue
        params = row.params
        if getattr(params, "column_chunk", 0):
            params = dataclasses.replace(params, column_chunk=params.column_chunk * 32 // 128)
        for gate in ("gdn", "kda") if row.gate is pallas_triton.ANY else (row.gate,):
            for size in dtypes if row.state_bytes is pallas_triton.ANY else (row.state_bytes,):
                if _reached(row, gate, size):
                    out.add((dtypes[size], gate, params))
    return sorted(out, key=repr)


@pytest.mark.parametrize("dtype,gate,kernel_params", _table_launches(), ids=str)
def test_every_table_launch_matches_spec(rng, dtype, gate, kernel_params):
    # padding rows, forced flushes and scattered slots as in every _compare_backends run;
    # the plain kernel at L = 1 (what the table's plain rows serve), the folding rows under
    # the natural plan (appends and flushes at every cursor: the fold-every-step plan would
    # keep every cursor at 0)
    bound = FP32_BOUND if dtype == "float32" else BF16_STATE_BOUND
    cache_len = 1 if isinstance(kernel_params, PlainParams) else 7
    _compare_backends(rng, _config(gate, cache_len, jnp.dtype(dtype)), kernel_params, bound)


@pytest.mark.parametrize("gate", ["gdn", "kda"])
@pytest.mark.parametrize("precision,bound", [("tf32", FP32_BOUND), ("bf16", BF16_REBUILD_BOUND)])
@pytest.mark.parametrize("kernel,column_chunk", [("tile", 0), ("grouped", 0), ("grouped", 16)])
def test_rebuild_precisions(rng, gate, precision, bound, kernel, column_chunk):
    # On the CPU interpreter a "tf32" dot is computed in full fp32, so it meets the fp32
    # bound here; on an H200 it measured 2e-4 (benchmarks/results, "checks"). "bf16"
    # rounds its operands on any device. Column chunks: one rebuild dot per chunk.
    if kernel == "tile":
        params = ReplayTileParams(block_v=16, num_warps=2, cache_chunk=16, rebuild_precision=precision)
    else:
        params = ReplayGroupedParams(block_v=16, num_warps=2, tiles_per_program=2, rebuild_unroll=1,
                                     rebuild_precision=precision, column_chunk=column_chunk)
    worst = _compare_backends(rng, _config(gate, 16), params, bound)
    if precision == "bf16":
        assert worst > 1e-6, "bf16 rebuild operands should differ from the fp32 spec"


@pytest.mark.parametrize("gate", ["gdn", "kda"])
@pytest.mark.parametrize("layout", ["tile", "grouped", "grouped_w8", "fold", "fold_w8"])
def test_in_kernel_gating_matches_xla_gates(rng, gate, layout):
    # Column chunks: KDA's dt_bias and per-channel gates are read chunk by chunk.
    params = {"tile": ReplayTileParams(block_v=16, num_warps=2),
              "grouped": ReplayGroupedParams(block_v=16, num_warps=2, tiles_per_program=2, rebuild_unroll=1),
              "grouped_w8": ReplayGroupedParams(block_v=16, num_warps=2, tiles_per_program=2, rebuild_unroll=1,
                                                column_chunk=8),
              "fold": FoldParams(block_v=16, num_warps=2),
              "fold_w8": FoldParams(block_v=16, num_warps=2, column_chunk=8)}[layout]
    _compare_backends(rng, _config(gate, 4), params, FP32_BOUND, raw_gates=True)


@pytest.mark.parametrize("gate", ["gdn", "kda"])
def test_plain_kernel_and_bf16_state(rng, gate):
    # L = 1 runs the plain kernel; bf16 state and caches through both replay layouts, with
    # the exact rebuild unrolled as in the tile table (L = 7: a partial last load), and
    # through the folding kernel.
    for plain in (PlainParams(block_v=16, num_warps=2),
                  PlainParams(block_v=8, num_warps=2, column_chunk=8, grid_order=_ROWS)):
        _compare_backends(rng, _config(gate, 1), plain, FP32_BOUND)
        _compare_backends(rng, _config(gate, 1, jnp.bfloat16), plain, BF16_STATE_BOUND)
    for params in (ReplayGroupedParams(block_v=16, num_warps=2, tiles_per_program=2, rebuild_unroll=4),
                   ReplayTileParams(block_v=8, num_warps=1, cache_chunk=8, rebuild_unroll=8),
                   FoldParams(block_v=16, num_warps=1),
                   # column chunks stored back into bf16 refs (the table keeps bf16 states
                   # on whole rows; a user's parameters may not)
                   ReplayGroupedParams(block_v=16, num_warps=2, tiles_per_program=2, rebuild_unroll=4,
                                       column_chunk=16, grid_order=_ROWS),
                   FoldParams(block_v=16, num_warps=1, column_chunk=8),
                   FoldParams(block_v=16, num_warps=1, empty_cache_branch=True)):
        _compare_backends(rng, _config(gate, 7, jnp.bfloat16), params, BF16_STATE_BOUND)


_TILE, _GROUPED = ReplayTileParams, ReplayGroupedParams


@pytest.mark.parametrize(
    "cls,kwargs,match",
    [
        (PlainParams, dict(block_v=24), "block_v must be a power of two, got 24"),
        (FoldParams, dict(block_v=0), "block_v must be a power of two, got 0"),
        (_TILE, dict(block_v=True), "block_v must be a power of two, got True"),
        (_GROUPED, dict(block_v=-8), "block_v must be a power of two"),
        (PlainParams, dict(num_warps=3), "num_warps must be 1, 2, 4, 8 or 16, got 3"),
        (FoldParams, dict(num_warps=32), "num_warps must be 1, 2, 4, 8 or 16"),
        (_TILE, dict(num_warps=0), "num_warps must be 1, 2, 4, 8 or 16"),
        (_GROUPED, dict(num_warps=6), "num_warps must be 1, 2, 4, 8 or 16"),
        # grid orders a kernel does not implement (and a string for the enum)
        (PlainParams, dict(grid_order=_LO), "grid_order must be one of ROW_FASTEST, ROW_SLOWEST for PlainParams"),
        (FoldParams, dict(grid_order=_LOR), "grid_order must be one of ROW_FASTEST, ROW_SLOWEST for FoldParams"),
        (_TILE, dict(grid_order=_LOR),
         "grid_order must be one of ROW_FASTEST, ROW_SLOWEST, LAUNCH_ORDER for ReplayTileParams"),
        (_GROUPED, dict(grid_order="row_slowest"), "grid_order must be one of ROW_FASTEST, ROW_SLOWEST, "
                                                   "LAUNCH_ORDER, LAUNCH_ORDER_RELOAD for ReplayGroupedParams"),
        (PlainParams, dict(column_chunk=12), "column_chunk must be 0 or a power of two, got 12"),
        (FoldParams, dict(column_chunk=-2), "column_chunk must be 0 or a power of two, got -2"),
        (_GROUPED, dict(column_chunk=24), "column_chunk must be 0 or a power of two, got 24"),
        (_GROUPED, dict(column_chunk=8.0), "column_chunk must be 0 or a power of two, got 8.0"),
        (FoldParams, dict(empty_cache_branch=1), "empty_cache_branch must be a bool, got 1"),
        (_TILE, dict(cache_chunk=12), "cache_chunk must be a power of two, got 12"),
        (_TILE, dict(cache_chunk=0), "cache_chunk must be a power of two, got 0"),
        (_TILE, dict(num_stages=0), "num_stages must be an int >= 1, got 0"),
        (_TILE, dict(num_stages=True), "num_stages must be an int >= 1, got True"),
        (_GROUPED, dict(tiles_per_program=0), "tiles_per_program must be an int >= 1, got 0"),
        (_GROUPED, dict(tiles_per_program=-1), "tiles_per_program must be an int >= 1, got -1"),
        (_GROUPED, dict(tiles_per_program=True), "tiles_per_program must be an int >= 1, got True"),
        (_GROUPED, dict(tiles_per_program=2.0), "tiles_per_program must be an int >= 1, got 2.0"),
        (_TILE, dict(rebuild_precision="fp64"), r"rebuild_precision must be one of \('ieee', 'tf32', 'bf16'\)"),
        (_GROUPED, dict(rebuild_precision=None), "rebuild_precision must be one of"),
        (_TILE, dict(rebuild_unroll=0), "rebuild_unroll must be in 1..16, got 0"),
        (_GROUPED, dict(rebuild_unroll=17), "rebuild_unroll must be in 1..16, got 17"),
        (_GROUPED, dict(rebuild_unroll=True), "rebuild_unroll must be in 1..16, got True"),
        # the tensor-core rebuilds need every dot dimension >= 16
        (_TILE, dict(block_v=8, rebuild_precision="tf32"), "rebuild_precision='tf32' runs tensor-core dots "
                                                           "and needs block_v >= 16, got 8"),
        (_TILE, dict(cache_chunk=8, rebuild_precision="bf16"), "needs cache_chunk >= 16, got 8"),
        (_GROUPED, dict(block_v=8, rebuild_precision="bf16"), "needs block_v >= 16, got 8"),
        (_GROUPED, dict(column_chunk=8, rebuild_precision="tf32"), "needs column_chunk >= 16, got 8"),
    ],
    ids=repr,
)
def test_kernel_params_reject_bad_values(cls, kwargs, match):
    with pytest.raises(ValueError, match=match):
        cls(**kwargs)


def test_kernel_params_accept_their_grid_orders_and_edge_values():
    for cls, orders in ((PlainParams, 2), (FoldParams, 2), (_TILE, 3), (_GROUPED, 4)):
        for order in tuple(GridOrder)[:orders]:
            assert cls(grid_order=order).grid_order is order
    _GROUPED(tiles_per_program=1, column_chunk=16, rebuild_precision="bf16")  # whole rows and W >= 16
    _GROUPED(block_v=16, column_chunk=0, rebuild_precision="tf32")
    _TILE(block_v=16, cache_chunk=16, rebuild_precision="bf16", rebuild_unroll=16, num_stages=3)
    _GROUPED(block_v=8, column_chunk=8, rebuild_unroll=1)  # small dots are fine for "ieee"
    FoldParams(empty_cache_branch=True, column_chunk=0)
    assert [o.row_slowest for o in GridOrder] == [False, True, True, True]
    assert [o.reorders for o in GridOrder] == [False, False, True, True]


@pytest.mark.parametrize("pool_dtype", [jnp.float32, jnp.bfloat16])
def test_set_records_writes_kept_records_only(rng, pool_dtype):
    # Against a loop over the records: kept ones land at (slot, :, pos) rounded to the pool's
    # dtype, skipped ones (padding slots, masked positions) leave the pool as it was, also
    # under jit where the skipped records' indices are traced.
    num_slots, heads, ring, dim, batch, width = 9, 3, 8, 5, 4, 3
    pool = jnp.asarray(rng.standard_normal((num_slots, heads, ring, dim)), pool_dtype)
    slot = rng.permutation(num_slots)[:batch].copy()
    slot[rng.integers(batch)] = -1  # a padding row: never kept
    pos = rng.integers(0, ring - width + 1, batch)[:, None] + np.arange(width)[None, :]
    keep = (rng.random((batch, width)) < 0.6) & (slot >= 0)[:, None]
    records = rng.standard_normal((batch, width, heads, dim)).astype(np.float32)
    want = np.array(pool.astype(jnp.float32))
    for b, t in zip(*np.nonzero(keep)):
        want[slot[b], :, pos[b, t]] = np.asarray(jnp.asarray(records[b, t]).astype(pool_dtype), np.float32)
    args = (pool, jnp.asarray(slot, jnp.int32), jnp.asarray(pos, jnp.int32), jnp.asarray(records), jnp.asarray(keep))
    for got in (common.set_records(*args), jax.jit(common.set_records)(*args)):
        assert got.dtype == pool_dtype
        np.testing.assert_array_equal(np.asarray(got.astype(jnp.float32)), want)


@pytest.mark.parametrize("pool_dtype", [jnp.float32, jnp.bfloat16])
def test_set_rows_writes_kept_rows_only(rng, pool_dtype):
    # Against a loop: kept rows replace their slot's whole entry, rounded to the pool's dtype;
    # skipped rows (padding, unkept) change nothing, eager and under jit.
    num_slots, batch = 7, 5
    pool = jnp.asarray(rng.standard_normal((num_slots, 3, 4)), pool_dtype)
    slot = rng.permutation(num_slots)[:batch].copy()
    slot[rng.integers(batch)] = -1
    keep = slot >= 0
    keep[rng.choice(np.nonzero(keep)[0])] = False  # a live row not kept
    rows = rng.standard_normal((batch, 3, 4)).astype(np.float32)
    want = np.array(pool.astype(jnp.float32))
    for b in np.nonzero(keep)[0]:
        want[slot[b]] = np.asarray(jnp.asarray(rows[b]).astype(pool_dtype), np.float32)
    args = (pool, jnp.asarray(slot, jnp.int32), jnp.asarray(rows), jnp.asarray(keep))
    for got in (common.set_rows(*args), jax.jit(common.set_rows)(*args)):
        assert got.dtype == pool_dtype
        np.testing.assert_array_equal(np.asarray(got.astype(jnp.float32)), want)


@pytest.mark.parametrize("grid_order", list(GridOrder), ids=lambda o: o.name)
def test_launch_rows_requires_row_order_exactly_for_launch_order_grids(grid_order, rng):
    batch = 6
    slot = jnp.asarray(rng.permutation(10)[:batch], jnp.int32)
    pos = jnp.asarray(rng.integers(0, 8, batch), jnp.int32)
    mode = jnp.asarray(rng.integers(0, 3, batch), jnp.int32)
    order = rng.permutation(batch)
    if grid_order.reorders:
        with pytest.raises(ValueError, match=f"grid_order {grid_order.name} needs a row_order"):
            common.launch_rows(slot, pos, mode, None, grid_order)
        rows, *gathered = common.launch_rows(slot, pos, mode, jnp.asarray(order), grid_order)
        np.testing.assert_array_equal(rows, order)
        assert rows.dtype == jnp.int32
        for got, x in zip(gathered, (slot, pos, mode)):
            np.testing.assert_array_equal(got, np.asarray(x)[order])
        with pytest.raises(ValueError, match=r"row_order must have shape \(6,\), got \(5,\)"):
            common.launch_rows(slot, pos, mode, jnp.arange(5), grid_order)
        with pytest.raises(ValueError, match="row_order must be an integer array"):
            common.launch_rows(slot, pos, mode, jnp.arange(batch, dtype=jnp.float32), grid_order)
        with pytest.raises(ValueError,
                           match=r"row_order must be a permutation of range\(6\), got \[0, 0, 1, 2, 3, 4\]"):
            common.launch_rows(slot, pos, mode, jnp.asarray([0, 0, 1, 2, 3, 4]), grid_order)
        traced = jax.jit(lambda o: common.launch_rows(slot, pos, mode, o, grid_order)[0])(jnp.asarray(order))
        np.testing.assert_array_equal(traced, order)
    else:
        rows, *same = common.launch_rows(slot, pos, mode, None, grid_order)
        np.testing.assert_array_equal(rows, np.arange(batch))
        for got, x in zip(same, (slot, pos, mode)):
            np.testing.assert_array_equal(got, x)
        with pytest.raises(ValueError, match=f"row_order is only read with a launch-order grid, not {grid_order.name}"):
            common.launch_rows(slot, pos, mode, jnp.asarray(order), grid_order)


@pytest.mark.parametrize("kernel,ordered", [("grouped", _LO), ("grouped", _LOR), ("tile", _LO)])
def test_any_row_order_gives_the_row_order_results(rng, kernel, ordered):
    """The launch order only says which rows' programs the grid issues first: serving the
    rows in any permutation writes the same bits as serving them in order."""
    cfg = _config("gdn", 5)
    batch, num_slots = 6, 9
    state = init_state(cfg, num_slots, jnp.asarray(random_checkpoint(rng, cfg, num_slots)))
    fill = lambda x, scale: jnp.asarray(scale * rng.normal(size=x.shape), x.dtype)
    caches = (fill(state.u_cache, 0.1), fill(state.k_cache, 0.2), -jnp.abs(fill(state.g_cache, 0.1)))
    tok = random_tokens(rng, cfg, (batch,))
    slot = jnp.asarray(rng.permutation(num_slots)[:batch], jnp.int32)
    pos = jnp.asarray(rng.integers(0, cfg.cache_len, batch), jnp.int32)
    mode = jnp.asarray([common.MODE_FLUSH, common.MODE_APPEND, common.MODE_PAD] * 2, jnp.int32)
    if kernel == "grouped":
        kernel_fn, base = replay_decode_grouped, _GROUPED(block_v=8, num_warps=1, tiles_per_program=2,
                                                          rebuild_unroll=1, grid_order=_ROWS)
    else:
        kernel_fn, base = replay_decode, _TILE(block_v=8, num_warps=1, cache_chunk=4, grid_order=_ROWS)
    token = tuple(jnp.asarray(x) for x in (tok.q, tok.k, tok.v, tok.g, tok.beta))
    run = lambda params, order: kernel_fn(state.checkpoint, *caches, *token, slot, pos, mode,
                                          row_order=order, use_qk_l2norm=True, params=params)
    want = run(base, None)
    launch_ordered = dataclasses.replace(base, grid_order=ordered)
    for order in (rng.permutation(batch), np.arange(batch)[::-1]):
        got = run(launch_ordered, jnp.asarray(order, jnp.int32))
        for g, w in zip(got, want):
            np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    with pytest.raises(ValueError, match=r"row_order is only read with a launch-order grid, not ROW_SLOWEST"):
        run(base, jnp.arange(batch))
    with pytest.raises(ValueError, match=f"grid_order {ordered.name} needs a row_order"):
        run(launch_ordered, None)
    with pytest.raises(ValueError, match=r"row_order must be a permutation of range\(6\)"):
        run(launch_ordered, jnp.asarray([0, 0, 1, 2, 3, 4]))


def test_with_rebuild_precision_raises_tiles_only_for_tensor_cores():
    for small in (_TILE(block_v=8, cache_chunk=4), _GROUPED(block_v=8, tiles_per_program=2)):
        assert common.with_rebuild_precision(small, "ieee") == dataclasses.replace(small, rebuild_precision="ieee")
        for precision in ("tf32", "bf16"):
            params = common.with_rebuild_precision(small, precision)
            assert type(params) is type(small) and params.rebuild_precision == precision
            assert params.block_v == 16 and getattr(params, "cache_chunk", 16) == 16
            assert dataclasses.replace(params, block_v=8, rebuild_precision="ieee",
                                       **({"cache_chunk": 4} if hasattr(small, "cache_chunk") else {})) == small
    wide = common.with_rebuild_precision(_TILE(block_v=64, cache_chunk=32), "tf32")
    assert (wide.block_v, wide.cache_chunk) == (64, 32)
    chunked = [common.with_rebuild_precision(_GROUPED(column_chunk=w), "bf16").column_chunk for w in (0, 8, 32)]
    assert chunked == [0, 16, 32]


def test_for_head_dim_and_column_slices():
    assert common.for_head_dim(_GROUPED(block_v=64), 32) == _GROUPED(block_v=32)
    assert common.for_head_dim(FoldParams(block_v=8), 32) == FoldParams(block_v=8)
    starts = lambda chunk, dk: [(s.start, s.size) for s in common.column_slices(chunk, dk)]
    assert starts(0, 32) == [(0, 32)]
    assert starts(8, 32) == [(0, 8), (8, 8), (16, 8), (24, 8)]
    assert starts(32, 32) == starts(64, 32) == [(0, 32)]


def test_kernel_shape_and_option_errors():
    cfg = ReplayConfig(1, 1, 24, 16, 4)
    state = init_state(cfg, 2)
    z = jnp.zeros
    args = (Tokens(z((1, 1, 24)), z((1, 1, 24)), z((1, 1, 16)), z((1, 1)), z((1, 1))), jnp.array([0]))
    with pytest.raises(ValueError,
                       match="the pallas_triton backend needs head_k_dim to be a power of two >= 16, got 24"):
        decode.decode_step(state, *args, backend="pallas_triton")
    with pytest.raises(ValueError, match="kernel_params applies to the kernel backends"):
        decode.decode_step(state, *args, kernel_params=_GROUPED())
    with pytest.raises(ValueError, match=r"gate_params\[1\] \(dt_bias\) must have shape \(1,\)"):
        decode.decode_step(state, *args, gate_params=(z((1,)), z((1, 24))))
    with pytest.raises(ValueError, match="head_v_dim to be a power of two >= 16, got 8"):
        pallas_triton.check_kernel_shapes(16, 8)


def test_kernel_params_must_fit_the_step():
    """A caller's kernel_params must be a class the plan's kernel step runs (the plain
    kernel at L = 1, the folding kernel under EVERY_STEP, a replay or folding kernel under
    NATURAL); None takes the launch table's row."""
    cfg = ReplayConfig(1, 2, 16, 16, 4)
    every, natural = FlushPolicy.EVERY_STEP, FlushPolicy.NATURAL
    one = dataclasses.replace(cfg, cache_len=1)
    assert [pallas_triton.step_kind(c, p) for c in (one, cfg) for p in (natural, every)] == [
        "plain", "plain", "replay", "fold"]
    fits = {(one, natural): (PlainParams,), (one, every): (PlainParams,), (cfg, every): (FoldParams,),
            (cfg, natural): (_GROUPED, _TILE, FoldParams)}
    for (config, policy), allowed in fits.items():
        for cls in (PlainParams, FoldParams, _TILE, _GROUPED):
            if cls in allowed:
                assert pallas_triton.launch_params(config, 4, policy, cls()) == cls()
            else:
                names = " or ".join(c.__name__ for c in allowed)
                with pytest.raises(ValueError, match=rf"kernel_params must be {names}, got {cls.__name__}"):
                    pallas_triton.launch_params(config, 4, policy, cls())
        step = pallas_triton.step_kind(config, policy)
        row = pallas_triton.launch_row(step, "gdn", 4, 4, config.cache_len)
        assert pallas_triton.launch_params(config, 4, policy) is row.params
        assert isinstance(row.params, pallas_triton.STEP_PARAMS[step][0])
    state = init_state(cfg, 4)
    tokens = Tokens(*(jnp.zeros(s) for s in ((2, 1, 16), (2, 1, 16), (2, 2, 16), (2, 2), (2, 2))))
    with pytest.raises(ValueError, match="kernel_params must be FoldParams, got ReplayGroupedParams"):
        decode.decode_step(state, tokens, jnp.array([0, 1]), backend="pallas_triton", policy="every_step",
                           kernel_params=_GROUPED())
    with pytest.raises(ValueError, match=r"kernel_params must be ReplayGroupedParams or ReplayTileParams or "
                                         r"FoldParams, got dict"):
        decode.decode_step(state, tokens, jnp.array([0, 1]), backend="pallas_triton", policy="natural",
                           kernel_params={"block_v": 16})


# ---------------------------------------------------------------- lowering for an H200

_H200 = jax.sharding.AbstractMesh(
    (1,), ("x",),
    abstract_device=jax.sharding.AbstractDevice(
        device_kind="NVIDIA H200", num_cores=None, platform="gpu"
    ),
)


@pytest.mark.parametrize("kernel_params", exposed_kernel_params(), ids=repr)
@pytest.mark.parametrize("gate", ["gdn", "kda"])
def test_every_exposed_config_lowers_for_h200(kernel_params, gate):
    # The step the parameters serve: the plain kernel at L = 1; the folding kernel under
    # the fold-every-step plan; the replay kernels under the natural one. Block shapes follow
    # the ring and the state dtype; the raw gates' prologue is lowered once per dtype pairing
    # (fp32 with activated gates, bf16 with raw ones), so each set of parameters lowers both.
    batch = 8
    plain = isinstance(kernel_params, PlainParams)
    policy = FlushPolicy.EVERY_STEP if isinstance(kernel_params, FoldParams) else FlushPolicy.NATURAL
    cache_lens = (1,) if plain else (13, 32)
    for cache_len, (dtype, raw) in itertools.product(cache_lens, ((jnp.float32, False), (jnp.bfloat16, True))):
        cfg = ReplayConfig(16, 32, 128, 128, cache_len, gate=gate, state_dtype=dtype, cache_dtype=dtype)
        state = jax.eval_shape(lambda: init_state(cfg, 16))
        sds = jax.ShapeDtypeStruct
        tokens = Tokens(
            sds((batch, 16, 128), jnp.bfloat16), sds((batch, 16, 128), jnp.bfloat16),
            sds((batch, 32, 128), jnp.bfloat16), sds(cfg.g_shape(batch), jnp.float32),
            sds((batch, 32), jnp.float32),
        )
        dt_shape = (32, 128) if gate == "kda" else (32,)
        gates = (sds((32,), jnp.float32), sds(dt_shape, jnp.float32)) if raw else None

        def step(state, tokens, slots, gates):
            step_plan = plan.plan_step(state.write_pos, slots, None, cache_len, policy)
            return pallas_triton.layer_step(
                state, tokens, step_plan, use_qk_l2norm=True, scale=None,
                gate_params=gates, kernel_params=kernel_params, interpret=False,
            )

        with jax.sharding.use_abstract_mesh(_H200):
            lowered = jax.jit(step, donate_argnums=0).trace(
                state, tokens, sds((batch,), jnp.int32), gates
            ).lower(lowering_platforms=("cuda",))
        assert "__gpu$xla.gpu.triton" in lowered.as_text()


_FIRST_USE_SCRIPT = """
import jax, jax.numpy as jnp
import replayssm_jax as R
traces = []
def step(state, *args):
    traces.append(1)
    return R.decode_step(state, *args, backend="pallas_triton")
step = jax.jit(step, donate_argnums=0)
cfg = R.ReplayConfig(2, 4, 16, 16, 4)
state = R.init_state(cfg, 4)
args = (R.Tokens(jnp.ones((2, 2, 16)), jnp.ones((2, 2, 16)), jnp.ones((2, 4, 16)), -jnp.ones((2, 4)),
                 0.5 * jnp.ones((2, 4))), jnp.array([0, 1], jnp.int32))
for _ in range(3):
    _, state = step(state, *args)
print(len(traces))
"""


def test_first_pallas_step_in_a_fresh_process_traces_once():
    # In a fresh interpreter the first lowering of a kernel must not change the tracing
    # context (Pallas registers config options on import), or step 2 would recompile.
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _FIRST_USE_SCRIPT], capture_output=True,
                         text=True, check=True, timeout=300)
    assert out.stdout.strip().splitlines()[-1] == "1", out.stdout + out.stderr
