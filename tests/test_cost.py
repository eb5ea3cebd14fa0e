"""The byte model of `replayssm_jax.cost` against hand counts and the §10 formulas."""

import numpy as np
import pytest

from replayssm_jax import ReplayConfig, cost

# The §10 shapes: GDN, H_k = 16, H_v = 32, d_k = d_v = 128.
SHAPES = dict(num_k_heads=16, num_v_heads=32, head_k_dim=128, head_v_dim=128)


def _cfg(cache_len=16, gate="gdn", state_dtype="float32", cache_dtype="bfloat16"):
    return ReplayConfig(
        **SHAPES, cache_len=cache_len, gate=gate, state_dtype=state_dtype, cache_dtype=cache_dtype
    )


def test_state_and_entry_bytes_by_hand():
    cfg = _cfg()
    assert cost.state_bytes(cfg) == 32 * 128 * 128 * 4
    assert cost.entry_bytes(cfg) == 32 * 128 * 2 + 16 * 128 * 2 + 32 * 4
    kda = _cfg(gate="kda", cache_dtype="float32")
    assert cost.entry_bytes(kda) == 32 * 128 * 4 + 16 * 128 * 4 + 32 * 128 * 4


def test_plain_is_read_plus_write_of_the_state():
    cfg = _cfg(state_dtype="bfloat16")
    b = cost.plain_step_bytes(cfg, batch=8)
    assert b.checkpoint_read == b.checkpoint_write == 8 * 32 * 128 * 128 * 2
    assert b.cache == 0
    assert b.total == 2 * 8 * 32 * 128 * 128 * 2


@pytest.mark.parametrize("state_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("gate", ["gdn", "kda"])
def test_cache_len_one_equals_plain_decode(state_dtype, gate):
    cfg = _cfg(cache_len=1, gate=gate, state_dtype=state_dtype)
    for batch in (1, 7, 512):
        assert cost.replay_cycle_bytes(cfg, batch) == cost.plain_step_bytes(cfg, batch)


@pytest.mark.parametrize("cache_len", [1, 2, 4, 16, 32, 100])
def test_state_bytes_ratio_is_one_plus_one_over_L_halved(cache_len):
    cfg = _cfg(cache_len=cache_len)
    replay = cost.replay_cycle_bytes(cfg, batch=4)
    plain = cost.plain_step_bytes(cfg, batch=4)
    np.testing.assert_allclose(replay.state / plain.total, (1 + 1 / cache_len) / 2)


@pytest.mark.parametrize("cache_len", [1, 3, 16])
def test_cycle_average_closed_form(cache_len):
    cfg = _cfg(cache_len=cache_len)
    s, e = cost.state_bytes(cfg), cost.entry_bytes(cfg)
    L = cache_len
    want = s * (1 + 1 / L) + e * (L - 1) / 2 + e * (L - 1) / L
    np.testing.assert_allclose(cost.replay_cycle_bytes(cfg, batch=1).total, want)


def test_cache_bytes_are_counted_per_row():
    cfg = _cfg(cache_len=8)
    s, e = cost.state_bytes(cfg), cost.entry_bytes(cfg)
    # pos 3: read the checkpoint and 3 entries, append one.
    assert cost.replay_row_bytes(cfg, 3) == cost.StepBytes(s, 0, 3 * e, e)
    # pos L-1 = 7: natural flush, read 7 entries, write the checkpoint, no append.
    assert cost.replay_row_bytes(cfg, 7) == cost.StepBytes(s, s, 7 * e, 0)
    # a forced flush at pos 2; a peer that re-reads the checkpoint on the flush.
    assert cost.replay_row_bytes(cfg, 2, force_flush=True) == cost.StepBytes(s, s, 2 * e, 0)
    assert cost.replay_row_bytes(cfg, 7, flush_rereads_checkpoint=True).checkpoint_read == 2 * s
    # an unmasked kernel loads all L positions.
    assert cost.replay_row_bytes(cfg, 0, read_all_entries=True).cache_read == 8 * e


def test_bf16_caches_are_cheaper_than_fp32_caches():
    fp32 = cost.replay_cycle_bytes(_cfg(cache_dtype="float32"), 4)
    bf16 = cost.replay_cycle_bytes(_cfg(cache_dtype="bfloat16"), 4)
    assert bf16.state == fp32.state
    assert bf16.cache < fp32.cache


def test_staggered_cursors_spread_the_flush_and_match_the_cycle_average():
    cfg = _cfg(cache_len=4)
    batch = 8
    sync = [cost.replay_step_bytes(cfg, cost.sync_cursors(t, batch, 4)).total for t in range(4)]
    stag = [
        cost.replay_step_bytes(cfg, cost.staggered_cursors(t, batch, 4)).total for t in range(4)
    ]
    cycle = cost.replay_cycle_bytes(cfg, batch).total
    np.testing.assert_allclose(np.mean(sync), cycle)
    np.testing.assert_allclose(stag, [cycle] * 4)
    assert max(sync) == sync[3] > cycle  # every row flushes on the same step


def test_rebuild_flops_and_floor():
    cfg = _cfg()
    n = 32 * 128 * 128
    assert cost.rebuild_flops(cfg, 0) == n
    assert cost.rebuild_flops(cfg, 5) == 11 * n
    assert cost.floor_us(4.27e9, 4270.0) == pytest.approx(1000.0)
    with pytest.raises(ValueError):
        cost.floor_us(1.0, 0.0)


def test_pos_out_of_range_is_rejected():
    with pytest.raises(ValueError, match="pos"):
        cost.replay_row_bytes(_cfg(cache_len=4), 4)


@pytest.mark.parametrize("gate,dtype,cache_len", [("gdn", "float32", 16), ("kda", "bfloat16", 3), ("gdn", "bfloat16", 1)])
def test_slot_memory_is_what_a_state_allocates_per_slot(gate, dtype, cache_len):
    import jax
    from replayssm_jax import init_state

    config = ReplayConfig(2, 4, 32, 16, cache_len, gate=gate, state_dtype=dtype, cache_dtype=dtype)
    state = jax.eval_shape(lambda: init_state(config, 3))
    allocated = sum(x.size * x.dtype.itemsize for x in (state.checkpoint, state.u_cache, state.k_cache, state.g_cache))
    assert cost.slot_memory_bytes(config) * 3 == allocated


def _simulated_fold_interval(cache_len, width, accepted, steps=200):
    """Steps between the last two folds of a row under the capacity rule, step by step."""
    pos, folds = 0, []
    for step in range(steps):
        if pos + width > cache_len:  # verify_step's rule: fold, the window goes to 0..T-1
            folds.append(step)
            pos = 0
        pos += accepted
    return folds[-1] - folds[-2]


@pytest.mark.parametrize("cache_len, width", [(4, 4), (8, 4), (16, 4), (32, 8), (16, 2)])
def test_verify_fold_interval_matches_the_capacity_rule(cache_len, width):
    for accepted in range(1, width + 1):
        assert cost.verify_fold_interval(cache_len, width, accepted) == _simulated_fold_interval(
            cache_len, width, accepted
        )


def test_verify_bytes_written_per_token_by_hand():
    cfg = _cfg(cache_len=16)
    s, e = 32 * 128 * 128 * 4, 32 * 128 * 2 + 16 * 128 * 2 + 32 * 4
    # T = 4, 3 kept per step: folds at cursor 12 + 4 > 16, i.e. every 5 steps.
    assert cost.verify_written_per_token(cfg, 4, 3) == pytest.approx((4 * e + s / 5) / 3)
    assert cost.conventional_written_per_token(cfg, 4, 3) == pytest.approx(4 * s / 3)
    with pytest.raises(ValueError, match="accepted"):
        cost.verify_written_per_token(cfg, 4, 5)
    with pytest.raises(ValueError, match="width"):
        cost.verify_fold_interval(16, 17, 1)
