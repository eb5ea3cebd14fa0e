"""The Pallas kernels against the xla backend (the readable specification), per layout.

Every kernel layout (per-tile replay, key-head-grouped replay, plain) and rebuild
precision runs here in interpret mode on random steps with padding rows, shuffled slots,
forced flushes and cursors at different phases. A separate test lowers every launch
configuration the package exposes for an abstract H200, so a power-of-two or dot-shape
violation fails CI without a GPU.
"""

from __future__ import annotations

import dataclasses
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import common, ops
from pallas_kernels.common import KernelConfig
from pallas_kernels.replay_decode import replay_decode
from pallas_kernels.replay_decode_grouped import replay_decode_grouped
from replayssm_jax import decode, replay
from replayssm_jax.config import ReplayConfig
from replayssm_jax.state import init_state

from helpers import exposed_kernel_configs, random_checkpoint, random_tokens, table_launches

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


def _compare_backends(rng, cfg: ReplayConfig, kernel_config: KernelConfig, bound: float,
                      *, raw_gates: bool = False) -> float:
    """Run 2L + 3 random steps through both backends from one state; return the worst error
    of y and of every state array (whole arrays: both write the same positions)."""
    state0 = init_state(cfg, NUM_SLOTS, jnp.asarray(random_checkpoint(rng, cfg, NUM_SLOTS)))
    gate_params = None
    if raw_gates:
        dt_shape = (cfg.num_v_heads, cfg.head_k_dim) if cfg.per_channel_gate else (cfg.num_v_heads,)
        gate_params = (jnp.asarray(rng.normal(size=cfg.num_v_heads), jnp.float32) * 0.5,
                       jnp.asarray(rng.normal(size=dt_shape), jnp.float32))

    @jax.jit
    def both(pallas_state, xla_state, q, k, v, g, beta, slots, force):
        plan = replay.plan_step(pallas_state.write_pos, slots, force, cfg.cache_len)
        y_p, new_p = decode.layer_step(
            pallas_state, q, k, v, g, beta, plan, backend="pallas", use_qk_l2norm=True,
            gate_params=gate_params, kernel_config=kernel_config,
        )
        y_x, new_x = decode.layer_step(
            xla_state, q, k, v, g, beta, plan, backend="xla", use_qk_l2norm=True,
            gate_params=gate_params,
        )
        write_pos = replay.advance_write_pos(pallas_state.write_pos, plan)
        return (y_p, dataclasses.replace(new_p, write_pos=write_pos),
                y_x, dataclasses.replace(new_x, write_pos=write_pos))

    pallas_state = xla_state = state0
    worst = 0.0
    for _ in range(2 * cfg.cache_len + 3):
        slots = rng.permutation(NUM_SLOTS)[:BATCH].astype(np.int32)
        slots[rng.integers(BATCH)] = -1  # one padding row per step
        force = rng.random(BATCH) < 0.15
        tok = random_tokens(rng, cfg, (BATCH,))
        g, beta = tok.g, tok.beta
        if raw_gates:  # raw model inputs a, b instead of log-decay and beta
            g, beta = rng.normal(size=g.shape).astype(np.float32), tok.beta * 4 - 2
        y_p, pallas_state, y_x, xla_state = both(
            pallas_state, xla_state, tok.q, tok.k, tok.v, g, beta, slots, force
        )
        assert np.all(np.asarray(y_p)[slots < 0] == 0), "padding rows must output exactly 0"
        pairs = [(y_p, y_x)] + [(getattr(pallas_state, name), getattr(xla_state, name))
                                for name in ("checkpoint", "u_cache", "k_cache", "g_cache")]
        worst = max(worst, *(_normwise_err(got, want) for got, want in pairs))
        assert worst <= bound, f"pallas vs xla: {worst:.3g} > {bound:.1g}"
        xla_state = pallas_state  # next step starts both from the kernel's state
    return worst


LAYOUTS = {
    # multi-chunk walk; exact rebuild 3 entries per round trip (13 = 4 * 3 + 1: a partial last load)
    "tile_bv8_chunk4": KernelConfig(block_v=8, num_warps=1, cache_chunk=4, rebuild_unroll=3),
    "tile_bv16": KernelConfig(block_v=16, num_warps=2, cache_chunk=16),
    "grouped_t1": KernelConfig(block_v=16, num_warps=2, tiles_per_program=1),
    "grouped_t4": KernelConfig(block_v=16, num_warps=4, tiles_per_program=4, rebuild_unroll=4),
    "grouped_bv32_t2": KernelConfig(block_v=32, num_warps=4, tiles_per_program=2),
    # the folding kernel under the natural plan: appends and flushes at every cursor
    "fold_bv8": KernelConfig(block_v=8, num_warps=1, flush_every_step=True),
    # ... with rows at cursor 0 on a branch of their own
    "fold_bv8_empty_cache_branch": KernelConfig(block_v=8, num_warps=1, flush_every_step=True,
                                                empty_cache_branch=True),
    # column chunks (d_k = 32: four of 8, two of 16) and grids launched rows outermost; the
    # per-tile kernel works on whole rows whatever column_chunk says
    "grouped_t1_w8": KernelConfig(block_v=16, num_warps=2, tiles_per_program=1, rebuild_unroll=2,
                                  column_chunk=8),
    "grouped_t2_w8_outer": KernelConfig(block_v=8, num_warps=1, tiles_per_program=2, rebuild_unroll=2,
                                        column_chunk=8, rows_outermost=True),
    "fold_bv8_w16_outer": KernelConfig(block_v=8, num_warps=1, flush_every_step=True, column_chunk=16,
                                       rows_outermost=True),
    "tile_bv8_w8_outer": KernelConfig(block_v=8, num_warps=1, cache_chunk=8, column_chunk=8,
                                      rows_outermost=True),
    # rows served in the plan's launch order (flush rows first): the padding row and forced
    # flushes make it a different permutation from step to step
    "grouped_t2_w8_outer_launch_order": KernelConfig(block_v=8, num_warps=1, tiles_per_program=2,
                                                     column_chunk=8, rows_outermost=True, launch_order=True),
    "tile_bv16_launch_order": KernelConfig(block_v=16, num_warps=2, cache_chunk=8, launch_order=True),
    "grouped_t2_outer_launch_order_reload_row": KernelConfig(
        block_v=8, num_warps=1, tiles_per_program=2, rows_outermost=True, launch_order=True, reload_row=True),
}


@pytest.mark.parametrize("gate", ["gdn", "kda"])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_replay_kernel_layouts_match_spec(rng, gate, layout):
    # L = 13: not a power of two, and more entries than a 4-entry chunk.
    _compare_backends(rng, _config(gate, 13), LAYOUTS[layout], FP32_BOUND)


# Every launch the package's table makes (helpers.table_launches), per kernel, gate and
# state dtype. The table's column chunks are for d_k = 128; at the tests' d_k = 32 they are
# scaled by 32/128 so that the chunked entries run on chunks here too (W = 64 -> 16).
TABLE_LAUNCHES = sorted(
    ((dtype.name, kernel, gate, dataclasses.replace(kc, column_chunk=kc.column_chunk * 32 // 128))
     for kc, kernel, gate, dtype in table_launches()),
    key=repr,
)


@pytest.mark.parametrize("dtype,kernel,gate,kernel_config", TABLE_LAUNCHES, ids=str)
def test_every_table_launch_matches_spec(rng, dtype, kernel, gate, kernel_config):
    # padding rows, forced flushes and scattered slots as in every _compare_backends run;
    # the plain kernel at L = 1 (what the table's plain entries serve)
    bound = FP32_BOUND if dtype == "float32" else BF16_STATE_BOUND
    _compare_backends(rng, _config(gate, 1 if kernel == "plain" else 7, jnp.dtype(dtype)), kernel_config, bound)


@pytest.mark.parametrize("gate", ["gdn", "kda"])
@pytest.mark.parametrize("precision,bound", [("tf32", FP32_BOUND), ("bf16", BF16_REBUILD_BOUND)])
@pytest.mark.parametrize("per_program,column_chunk", [(0, 0), (2, 0), (2, 16)])
def test_rebuild_precisions(rng, gate, precision, bound, per_program, column_chunk):
    # On the CPU interpreter a "tf32" dot is computed in full fp32, so it meets the fp32
    # bound here; on an H200 it measured 2e-4 (benchmarks/results, "checks"). "bf16"
    # rounds its operands on any device. Column chunks: one rebuild dot per chunk.
    kc = KernelConfig(block_v=16, rebuild_precision=precision, tiles_per_program=per_program,
                      column_chunk=column_chunk)
    worst = _compare_backends(rng, _config(gate, 16), kc, bound)
    if precision == "bf16":
        assert worst > 1e-6, "bf16 rebuild operands should differ from the fp32 spec"


@pytest.mark.parametrize("gate", ["gdn", "kda"])
@pytest.mark.parametrize("layout", ["tile", "grouped", "grouped_w8", "fold", "fold_w8"])
def test_in_kernel_gating_matches_xla_gates(rng, gate, layout):
    # Column chunks: KDA's dt_bias and per-channel gates are read chunk by chunk.
    kc = {"tile": KernelConfig(block_v=16), "grouped": KernelConfig(block_v=16, tiles_per_program=2),
          "grouped_w8": KernelConfig(block_v=16, tiles_per_program=2, column_chunk=8),
          "fold": KernelConfig(block_v=16, flush_every_step=True),
          "fold_w8": KernelConfig(block_v=16, flush_every_step=True, column_chunk=8)}[layout]
    _compare_backends(rng, _config(gate, 4), kc, FP32_BOUND, raw_gates=True)


@pytest.mark.parametrize("gate", ["gdn", "kda"])
def test_plain_kernel_and_bf16_state(rng, gate):
    # L = 1 runs the plain kernel; bf16 state and caches through both replay layouts, with
    # the exact rebuild unrolled as in the tile table (L = 7: a partial last load), and
    # through the folding kernel.
    for plain in (KernelConfig(block_v=16), KernelConfig(block_v=8, column_chunk=8, rows_outermost=True)):
        _compare_backends(rng, _config(gate, 1), plain, FP32_BOUND)
        _compare_backends(rng, _config(gate, 1, jnp.bfloat16), plain, BF16_STATE_BOUND)
    for kernel_config in (KernelConfig(block_v=16, tiles_per_program=2, rebuild_unroll=4),
                          KernelConfig(block_v=8, num_warps=1, cache_chunk=8, rebuild_unroll=8),
                          KernelConfig(block_v=16, num_warps=1, flush_every_step=True),
                          # column chunks stored back into bf16 refs (the table keeps bf16
                          # states on whole rows; a user's config may not)
                          KernelConfig(block_v=16, tiles_per_program=2, rebuild_unroll=4, column_chunk=16,
                                       rows_outermost=True),
                          KernelConfig(block_v=16, num_warps=1, flush_every_step=True, column_chunk=8),
                          KernelConfig(block_v=16, num_warps=1, flush_every_step=True, empty_cache_branch=True)):
        _compare_backends(rng, _config(gate, 7, jnp.bfloat16), kernel_config, BF16_STATE_BOUND)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(block_v=24), "block_v must be a power of two"),
        (dict(cache_chunk=12), "cache_chunk must be a power of two"),
        (dict(num_warps=3), "num_warps"),
        (dict(num_stages=0), "num_stages"),
        (dict(rebuild_precision="fp64"), "rebuild_precision must be one of"),
        (dict(block_v=8, rebuild_precision="tf32"), "needs block_v and cache_chunk >= 16"),
        (dict(tiles_per_program=-1), "tiles_per_program"),
        (dict(rebuild_unroll=0), "rebuild_unroll must be in 1..16"),
        (dict(rebuild_unroll=17), "rebuild_unroll must be in 1..16"),
        (dict(flush_every_step=1), "flush_every_step must be a bool"),
        (dict(flush_every_step=True, tiles_per_program=2), "tiles_per_program must be 0"),
        (dict(column_chunk=12), "column_chunk must be 0 or a power of two"),
        (dict(column_chunk=-2), "column_chunk must be 0 or a power of two"),
        (dict(rows_outermost=1), "rows_outermost must be a bool"),
        (dict(launch_order=1), "launch_order must be a bool"),
        (dict(launch_order=True, reload_row=1), "reload_row must be a bool"),
        (dict(reload_row=True), "reload_row reads the row of the launch order: it needs launch_order=True"),
        (dict(flush_every_step=True, empty_cache_branch=1), "empty_cache_branch must be a bool"),
        (dict(column_chunk=8, rebuild_precision="bf16"), "needs column_chunk 0 or >= 16"),
    ],
)
def test_kernel_config_rejects_bad_values(kwargs, match):
    with pytest.raises(ValueError, match=match):
        KernelConfig(**kwargs)


@pytest.mark.parametrize("kernel,per_program,reload_row", [("grouped", 2, False), ("grouped", 2, True),
                                                          ("tile", 0, False)])
def test_any_row_order_gives_the_row_order_results(rng, kernel, per_program, reload_row):
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
    kernel_fn = replay_decode_grouped if per_program else replay_decode
    base = KernelConfig(block_v=8, num_warps=1, cache_chunk=4, tiles_per_program=per_program,
                        rows_outermost=True)
    token = tuple(jnp.asarray(x) for x in (tok.q, tok.k, tok.v, tok.g, tok.beta))
    run = lambda kc, order: kernel_fn(state.checkpoint, *caches, *token, slot, pos, mode,
                                      row_order=order, use_qk_l2norm=True, config=kc)
    want = run(base, None)
    ordered = dataclasses.replace(base, launch_order=True, reload_row=reload_row)
    for order in (rng.permutation(batch), np.arange(batch)[::-1]):
        got = run(ordered, jnp.asarray(order, jnp.int32))
        for g, w in zip(got, want):
            np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    with pytest.raises(ValueError, match=r"row_order is only read with KernelConfig\(launch_order=True\)"):
        run(base, jnp.arange(batch))
    with pytest.raises(ValueError, match=r"row_order must have shape \(6,\), got \(5,\)"):
        run(ordered, jnp.arange(5))
    with pytest.raises(ValueError, match="row_order must be an integer array"):
        run(ordered, jnp.arange(batch, dtype=jnp.float32))
    with pytest.raises(ValueError, match=r"row_order must be a permutation of range\(6\), got \[0, 0, 1, 2, 3, 4\]"):
        run(ordered, jnp.asarray([0, 0, 1, 2, 3, 4]))


def test_with_rebuild_precision_raises_tiles_only_for_tensor_cores():
    small = KernelConfig(block_v=8, cache_chunk=4, tiles_per_program=2)
    assert small.with_rebuild_precision("ieee") == dataclasses.replace(small, rebuild_precision="ieee")
    for precision in ("tf32", "bf16"):
        kc = small.with_rebuild_precision(precision)
        assert (kc.block_v, kc.cache_chunk, kc.rebuild_precision) == (16, 16, precision)
        assert kc.tiles_per_program == 2
    wide = KernelConfig(block_v=64, cache_chunk=32).with_rebuild_precision("tf32")
    assert (wide.block_v, wide.cache_chunk) == (64, 32)
    chunked = [KernelConfig(column_chunk=w).with_rebuild_precision("bf16").column_chunk for w in (0, 8, 32)]
    assert chunked == [0, 16, 32]


def test_kernel_shape_and_option_errors():
    cfg = ReplayConfig(1, 1, 24, 16, 4)
    state = init_state(cfg, 2)
    z = jnp.zeros
    args = (z((1, 1, 24)), z((1, 1, 24)), z((1, 1, 16)), z((1, 1)), z((1, 1)), jnp.array([0]))
    with pytest.raises(ValueError, match="head_k_dim to be a power of two"):
        decode.decode_step(state, *args, backend="pallas")
    with pytest.raises(ValueError, match="kernel_config applies to backend='pallas' only"):
        decode.decode_step(state, *args, kernel_config=KernelConfig())
    with pytest.raises(ValueError, match=r"gate_params\[1\] \(dt_bias\) must have shape \(1,\)"):
        decode.decode_step(state, *args, gate_params=(z((1,)), z((1, 24))))


def test_tile_tables_cover_every_batch():
    for kernel in ("plain", "replay"):
        for batch in (1, 2, 3, 4, 5, 8, 9, 10, 16, 17, 28, 29, 64, 65, 256, 257, 512, 1 << 20):
            kc = ops.default_kernel_config(batch, kernel)
            assert isinstance(kc, KernelConfig)
            if kernel == "plain":
                assert kc.tiles_per_program == 0
            # Only the replay kernel at batch <= 5 flushes every step (measured, ops._TILES),
            # at batch <= 2 with the empty-cache branch (GDN with a 4-byte state only).
            assert kc.flush_every_step == (kernel == "replay" and batch <= 5)
            assert kc.empty_cache_branch == (kernel == "replay" and batch <= 2)
            # The grouped replay entries run rows outermost in the plan's launch order from
            # batch 10, reading the row again per tile up to batch 64 (measured with staggered
            # cursors, ops._TILES); one `[64, d_k]` tile per program from batch 6 to 28.
            if kernel == "replay":
                assert kc.rows_outermost == kc.launch_order == (batch > 9)
                assert kc.reload_row == (9 < batch <= 64)
                if 6 <= batch <= 64:
                    assert (kc.block_v, kc.tiles_per_program) == ((64, 1) if batch <= 28 else (32, 4))
            else:
                assert not kc.launch_order
            whole = lambda c: dataclasses.replace(c, column_chunk=0)
            long_cache = ops.default_kernel_config(batch, kernel, cache_len=ops.SHORT_CACHE_MAX_LEN + 1)
            # KDA (4-byte state): the plain kernel's BV 8 on whole rows up to batch 8, then the
            # GDN entries (ops._KDA_PLAIN_FIRST); the replay kernel flushes every step at every
            # batch through the folding kernel (ops._KDA_REPLAY): BV 8 on whole rows up to
            # batch 8, above on the plain kernel's large-batch tile with the empty-cache branch.
            kda = ops.default_kernel_config(batch, kernel, "kda")
            if kernel == "plain":
                assert not kda.flush_every_step
                assert kda == (KernelConfig(block_v=8, num_warps=1, cache_chunk=8) if batch <= 8 else kc)
            else:
                assert kda.flush_every_step and kda.tiles_per_program == 0
                plain_tile = ops.default_kernel_config(1 << 20, "plain")
                assert (kda.block_v, kda.column_chunk, kda.rows_outermost, kda.empty_cache_branch) == (
                    (8, 0, False, False) if batch <= 8 else
                    (plain_tile.block_v, plain_tile.column_chunk, plain_tile.rows_outermost, True))
            # bf16 state: whole rows everywhere; the replay kernel takes its own entries (the
            # folding kernel at BV 4 at batch 1, without the empty-cache branch, which measured
            # slower for a bf16 state; BV 8 up to batch 8; rows outermost in launch order at
            # 9-64: GDN (32, 4 warps, T = 2), KDA (32, 2 warps, T = 2) to 16 and T = 4 above;
            # T = 4, rows outermost alone, at 65-256); from batch 257 fp32's entry for a long
            # cache without the launch order (GDN fp32 rebuilds at U = 1 for L <= 16, bf16
            # states at U = 2 whatever L: test_rebuild_unroll_follows_the_cache_length).
            for gate in ("gdn", "kda"):
                bf16 = ops.default_kernel_config(batch, kernel, gate, jnp.bfloat16)
                assert bf16.column_chunk == 0 and not bf16.empty_cache_branch
                if kernel == "plain":
                    assert whole(bf16) == whole(kda if gate == "kda" else kc)
                elif batch <= 8:
                    assert bf16.flush_every_step and not bf16.launch_order and not bf16.rows_outermost
                    assert (bf16.block_v, bf16.tiles_per_program) == ((4, 0) if batch == 1 else (8, 0))
                elif batch <= 64:
                    assert bf16.rows_outermost and bf16.launch_order and not bf16.flush_every_step
                    assert (bf16.block_v, bf16.num_warps, bf16.tiles_per_program) == (
                        (32, 4, 2) if gate == "gdn" else (32, 2, 2) if batch <= 16 else (32, 4, 4))
                elif batch <= 256:  # their own T = 4 entries, rows outermost alone
                    assert (bf16.tiles_per_program, bf16.rows_outermost, bf16.launch_order) == (4, True, False)
                else:  # the 4-byte entry without the launch order
                    assert bf16 == dataclasses.replace(whole(long_cache), launch_order=False)
    with pytest.raises(ValueError, match="kernel must be 'plain' or 'replay', got 'fold'"):
        ops.default_kernel_config(1, "fold")
    with pytest.raises(ValueError, match="gate must be one of"):
        ops.default_kernel_config(1, "replay", "mamba")


@pytest.mark.parametrize("gate", ["gdn", "kda"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("kernel", ["plain", "replay"])
def test_table_entries_list_every_launch_once(kernel, gate, dtype):
    # What the CI compile test and kernel_registers.py iterate: every configuration some
    # batch and cache length reach, each once, with the smallest batch that reaches it.
    entries = ops.table_entries(kernel, gate, dtype)
    configs = [kc for *_, kc in entries]
    assert len(set(configs)) == len(configs)
    for cache_len in (2, 4, ops.SHORT_CACHE_MAX_LEN, ops.SHORT_CACHE_MAX_LEN + 1, 64):
        for batch in range(1, 600):
            assert ops.default_kernel_config(batch, kernel, gate, dtype, cache_len) in configs
    for batch, cache_len, kc in entries:
        assert ops.default_kernel_config(batch, kernel, gate, dtype, cache_len) == kc
        assert batch == 1 or ops.default_kernel_config(batch - 1, kernel, gate, dtype, cache_len) != kc


def test_rebuild_unroll_follows_the_cache_length():
    # From batch 257 GDN with a 4-byte state rebuilds one entry per round trip (U = 1) when
    # L <= 16 and two above; bf16 states keep U = 2 (measured, ops.SHORT_CACHE_MAX_LEN), and
    # KDA with a 4-byte state, which flushes every step (no rebuild), ignores L. Below batch
    # 257, and in the plain kernel, L plays no part.
    short, long = ops.SHORT_CACHE_MAX_LEN, ops.SHORT_CACHE_MAX_LEN + 1
    config = ops.default_kernel_config
    for batch in (257, 512, 1 << 20):
        assert config(batch, cache_len=2).rebuild_unroll == config(batch, cache_len=short).rebuild_unroll == 1
        assert config(batch, cache_len=long).rebuild_unroll == config(batch, cache_len=64).rebuild_unroll == 2
        assert dataclasses.replace(config(batch, cache_len=short), rebuild_unroll=2) == config(batch, cache_len=long)
        for gate, dtype in (("kda", jnp.float32), ("gdn", jnp.bfloat16), ("kda", jnp.bfloat16)):
            assert config(batch, "replay", gate, dtype, short) == config(batch, "replay", gate, dtype, long)
            kc = config(batch, "replay", gate, dtype, short)
            assert kc.flush_every_step if dtype == jnp.float32 else kc.rebuild_unroll == 2
    for batch in (1, 6, 8, 9, 65, 256):
        assert config(batch, cache_len=short) == config(batch, cache_len=long)
    for batch in (1, 512):
        assert config(batch, "plain", cache_len=1) == config(batch, "plain", cache_len=long)
    layer = ReplayConfig(16, 32, 128, 128, 16)
    assert ops.layer_kernel_config(layer, 512, None) == config(512, cache_len=16)
    assert ops.layer_kernel_config(dataclasses.replace(layer, cache_len=32), 512, None) == config(512, cache_len=32)
    for bad in (0, -1, 2.0, True, None):
        with pytest.raises(ValueError, match="cache_len must be an int >= 1"):
            config(8, cache_len=bad)


def test_long_caches_take_the_one_tile_entry_up_to_batch_64():
    # GDN with L > 16 flushes programs that replay up to L - 1 entries, which a staggered step
    # ends on (v29e): the one-`[64, d_k]`-tile entry in launch order serves every batch from
    # the first launch-order row (10 for a 4-byte state, 9 for a 2-byte one, on whole rows)
    # to ops.LONG_CACHE_ONE_TILE_MAX_BATCH; L <= 16 takes it only up to batch 28 (4-byte) or
    # not at all (2-byte). KDA's rows do not depend on L below batch 257.
    short, long = ops.SHORT_CACHE_MAX_LEN, ops.SHORT_CACHE_MAX_LEN + 1
    config = ops.default_kernel_config
    one_tile = config(10)
    assert (one_tile.block_v, one_tile.tiles_per_program, one_tile.launch_order, one_tile.reload_row) == (
        64, 1, True, True)
    assert ops.LONG_CACHE_ONE_TILE_MAX_BATCH == 64
    for batch in (9, 10, 28, 29, 48, 64, 65):
        for dtype, first in ((jnp.float32, 10), (jnp.bfloat16, 9)):
            whole = jnp.dtype(dtype).itemsize < 4
            expected = dataclasses.replace(one_tile, column_chunk=0) if whole else one_tile
            long_kc = config(batch, "replay", "gdn", dtype, long)
            assert (long_kc == expected) == (first <= batch <= 64), (batch, dtype)
            short_kc = config(batch, "replay", "gdn", dtype, short)
            assert (short_kc == expected) == (not whole and first <= batch <= 28), (batch, dtype)
            if batch > 64:
                assert long_kc == short_kc
        assert config(batch, "replay", "kda", jnp.bfloat16, long) == config(batch, "replay", "kda", jnp.bfloat16, short)
    assert config(64, "replay", "gdn", jnp.float32, 64) == one_tile  # any L > 16


def test_layer_kernel_config_rejects_other_types():
    cfg = ReplayConfig(1, 1, 16, 16, 4)
    with pytest.raises(ValueError, match="kernel_config must be a KernelConfig, got dict"):
        ops.layer_kernel_config(cfg, 1, {"block_v": 16})
    assert ops.layer_kernel_config(dataclasses.replace(cfg, cache_len=1), 1, None) == (
        ops.default_kernel_config(1, "plain"))


def test_layer_kernel_config_follows_the_gate():
    gdn, kda = ReplayConfig(1, 2, 16, 16, 4), ReplayConfig(2, 2, 16, 16, 4, gate="kda")
    assert not ops.layer_kernel_config(gdn, 8, None).flush_every_step
    assert ops.layer_kernel_config(kda, 8, None) == ops.default_kernel_config(8, "replay", "kda")
    assert ops.layer_kernel_config(kda, 8, None).flush_every_step
    bf16 = ReplayConfig(1, 2, 16, 16, 4, state_dtype=jnp.bfloat16, cache_dtype=jnp.bfloat16)
    assert ops.layer_kernel_config(gdn, 128, None).column_chunk == 64
    assert ops.layer_kernel_config(bf16, 128, None).column_chunk == 0


# ---------------------------------------------------------------- lowering for an H200

_H200 = jax.sharding.AbstractMesh(
    (1,), ("x",),
    abstract_device=jax.sharding.AbstractDevice(
        device_kind="NVIDIA H200", num_cores=None, platform="gpu"
    ),
)


@pytest.mark.parametrize("kernel_config", exposed_kernel_configs(), ids=repr)
@pytest.mark.parametrize("gate", ["gdn", "kda"])
def test_every_exposed_config_lowers_for_h200(kernel_config, gate):
    batch = 8
    for cache_len, dtype, raw in itertools.product((1, 13, 32), (jnp.float32, jnp.bfloat16), (False, True)):
        cfg = ReplayConfig(16, 32, 128, 128, cache_len, gate=gate, state_dtype=dtype, cache_dtype=dtype)
        state = jax.eval_shape(lambda: init_state(cfg, 16))
        sds = jax.ShapeDtypeStruct
        token = (
            sds((batch, 16, 128), jnp.bfloat16), sds((batch, 16, 128), jnp.bfloat16),
            sds((batch, 32, 128), jnp.bfloat16), sds(cfg.g_shape(batch), jnp.float32),
            sds((batch, 32), jnp.float32),
        )
        dt_shape = (32, 128) if gate == "kda" else (32,)
        gates = (sds((32,), jnp.float32), sds(dt_shape, jnp.float32)) if raw else None

        def step(state, q, k, v, g, beta, slots, gates):
            plan = replay.plan_step(state.write_pos, slots, None, cache_len)
            return ops.pallas_layer_step(
                state, q, k, v, g, beta, plan, use_qk_l2norm=True, scale=None,
                gate_params=gates, kernel_config=kernel_config, interpret=False,
            )

        with jax.sharding.use_abstract_mesh(_H200):
            lowered = jax.jit(step, donate_argnums=0).trace(
                state, *token, sds((batch,), jnp.int32), gates
            ).lower(lowering_platforms=("cuda",))
        assert "__gpu$xla.gpu.triton" in lowered.as_text()


_FIRST_USE_SCRIPT = """
import jax, jax.numpy as jnp
import replayssm_jax as R
traces = []
def step(state, *args):
    traces.append(1)
    return R.decode_step(state, *args, backend="pallas")
step = jax.jit(step, donate_argnums=0)
cfg = R.ReplayConfig(2, 4, 16, 16, 4)
state = R.init_state(cfg, 4)
args = (jnp.ones((2, 2, 16)),) * 2 + (jnp.ones((2, 4, 16)), -jnp.ones((2, 4)),
        0.5 * jnp.ones((2, 4)), jnp.array([0, 1], jnp.int32))
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
