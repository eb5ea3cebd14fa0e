"""Sharding over a Mesh (`replayssm_jax.sharding`) on 8 fake CPU devices.

The device count is fixed when jax initialises, so these tests run in a child pytest
process started with `--xla_force_host_platform_device_count=8`
(`test_sharded_tests_pass_on_eight_devices`); in this process they are skipped, and the
rest of the suite keeps its single device.

Numerics: sharded layer steps are compared with the single-device ones bit for bit. Each
device runs the single-device step on its rows, slots and heads; every sum in a step runs
within one row and one head (over d_k, d_v or the cache), so no reduction changes order.
The model step's projections are replicated over tp and its only collective is the
all-gather of y, which moves values without arithmetic; but each device projects B/dp rows
where the single device projects B, and XLA:CPU picks its dot kernel by shape (the
`[d_model, H_v]` gate projections round differently for 2 and 8 rows on an AMD EPYC), so
the model test allows `MODEL_TOL`.
"""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import replayssm_jax as R
from replayssm_jax import FlushPolicy, ReplayConfig, decode_step, init_state, sharding
from replayssm_jax.backends import pallas_triton
from replayssm_jax.model import decoder, demo
from replayssm_jax.model import slots as slot_ops

from helpers import random_checkpoint, random_tokens, to_device

DEVICES = 8
CHILD = os.environ.get("REPLAYSSM_SHARDING_CHILD") == "1"
child_only = pytest.mark.skipif(not CHILD, reason="runs in the 8-device child process")
TP, DP = 2, 4
N, B = 8, 8  # 2 slots and 2 rows per dp shard
# One key head and its two value heads per tp shard.
# Per-shard projections differ from full-batch ones by an ulp or so (see above); seven steps
# through two layers grow that to ~1e-6. A wrong slot, row or head is off by O(1).
MODEL_TOL = dict(atol=1e-5, rtol=1e-5)
TINY = decoder.DecoderConfig(vocab_size=48, d_model=32, num_layers=2, num_k_heads=2, num_v_heads=4,
                             head_k_dim=8, head_v_dim=8, mlp_hidden=32)


@pytest.mark.heavy
def test_sharded_tests_pass_on_eight_devices():
    if CHILD:
        pytest.skip("this is the child")
    env = dict(os.environ, REPLAYSSM_SHARDING_CHILD="1",
               XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={DEVICES}",
               JAX_PLATFORMS="cpu")
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-p", "no:xdist", __file__],
        capture_output=True, text=True, env=env, timeout=600,
    )
    tail = out.stdout[-3000:] + out.stderr[-2000:]
    assert out.returncode == 0, tail
    assert re.search(r"\b\d+ passed", out.stdout) and "failed" not in out.stdout, tail
    assert "1 skipped" in out.stdout, tail  # only the launcher test itself


def _mesh():
    return sharding.make_mesh(tp=TP, dp=DP)


def _config(gate: str = "gdn", cache_len: int = 3) -> ReplayConfig:
    # Two key heads per device, each with its two value heads; d_k != d_v.
    return ReplayConfig(num_k_heads=4, num_v_heads=8, head_k_dim=32, head_v_dim=16, cache_len=cache_len,
                        gate=gate)


def _row_slots(rng: np.random.Generator, padding: float = 0.25) -> np.ndarray:
    """`[B]` global slot ids: row block i holds a permutation of dp shard i's slots, some padding."""
    rows, per = B // DP, N // DP
    slots = np.concatenate([i * per + rng.permutation(per)[:rows] for i in range(DP)])
    return np.where(rng.random(B) < padding, -1, slots).astype(np.int32)


@child_only
def test_placement_puts_each_group_and_slot_block_on_its_device(rng):
    config, mesh = _config(), _mesh()
    state = init_state(config, N, jnp.asarray(random_checkpoint(rng, config, N)))
    placed = sharding.place_state(state, mesh)
    assert placed.checkpoint.sharding.spec == jax.sharding.PartitionSpec("dp", "tp")
    assert placed.write_pos.sharding.spec == jax.sharding.PartitionSpec("dp")
    hk, hv, per = config.num_k_heads // TP, config.num_v_heads // TP, N // DP
    coords = {d: tuple(int(c) for c in np.argwhere(mesh.devices == d)[0]) for d in mesh.devices.flat}
    for shard in placed.checkpoint.addressable_shards:
        i, j = coords[shard.device]
        np.testing.assert_array_equal(shard.data, state.checkpoint[i * per:(i + 1) * per, j * hv:(j + 1) * hv])
    for shard in placed.k_cache.addressable_shards:
        i, j = coords[shard.device]
        assert shard.index[:2] == (slice(i * per, (i + 1) * per), slice(j * hk, (j + 1) * hk))
        # The device's key heads are exactly those its value heads use (h // group size).
        value_heads = np.arange(j * hv, (j + 1) * hv)
        assert set(value_heads // config.group_size) == set(range(j * hk, (j + 1) * hk))
    for shard in placed.write_pos.addressable_shards:  # replicated over tp
        i, _ = coords[shard.device]
        assert shard.index == (slice(i * per, (i + 1) * per),)


@child_only
def test_model_state_placement():
    state = sharding.place_state(TINY.init_state(N, 3), _mesh())
    spec = jax.sharding.PartitionSpec
    assert state.checkpoint.sharding.spec == spec(None, "dp", "tp")
    assert state.k_cache.sharding.spec == spec(None, "dp", "tp")
    assert state.conv_state.sharding.spec == spec(None, "dp")
    assert state.write_pos.sharding.spec == spec("dp")
    assert state.checkpoint.addressable_shards[0].data.shape == (TINY.num_layers, N // DP, TINY.num_v_heads // TP,
                                                                 TINY.head_v_dim, TINY.head_k_dim)


@child_only
def test_sizes_that_do_not_divide_the_mesh_raise(rng):
    mesh = _mesh()
    with pytest.raises(ValueError, match="num_k_heads"):
        sharding.place_state(init_state(ReplayConfig(1, 2, 16, 16, 3), N), mesh)
    with pytest.raises(ValueError, match=r"B / C groups \(3\) too, or 1"):
        sharding.check_fits(ReplayConfig.mamba2(6, 8, 8, 3, 3), N, mesh)
    with pytest.raises(ValueError, match="num_slots"):
        sharding.place_state(init_state(_config(), 6), mesh)
    with pytest.raises(ValueError, match="batch"):
        sharding.check_fits(_config(), N, mesh, batch=6)
    state = sharding.place_state(init_state(_config(), N), mesh)
    tokens = to_device(random_tokens(rng, _config(), (B,)))
    wrong = np.array([2, -1, 0, -1, -1, -1, -1, -1], np.int32)  # row 0 (dp shard 0) names shard 1's slot
    with pytest.raises(ValueError, match=r"slots\[0\] = 2 lies in dp shard 1"):
        sharding.decode_step(state, tokens, jnp.asarray(wrong), mesh=mesh)
    with pytest.raises(ValueError, match="mesh must look like"):
        sharding.parse_mesh("tp=2,pp=2")
    with pytest.raises(ValueError, match="devices"):
        sharding.make_mesh(tp=4, dp=4)
    assert dict(sharding.parse_mesh("dp=2").shape) == {"dp": 2, "tp": 1}


@child_only
@pytest.mark.parametrize("gate, policy", [("gdn", "natural"), ("kda", "natural"), ("gdn", "every_step")])
def test_decode_equals_single_device_bit_for_bit(rng, gate, policy):
    """Steps with moving rows, padding and forced flushes (and, under natural, flushes at L)."""
    config, mesh = _config(gate), _mesh()
    state = init_state(config, N, jnp.asarray(random_checkpoint(rng, config, N)))
    sharded = sharding.place_state(state, mesh)
    options = dict(backend="xla", policy=policy, use_qk_l2norm=True)
    one = jax.jit(lambda s, t, sl, f: decode_step(s, t, sl, f, **options))
    many = jax.jit(lambda s, t, sl, f: sharding.decode_step(s, t, sl, f, mesh=mesh, **options))
    flushes = 0
    for _ in range(2 * config.cache_len + 1):
        tokens = to_device(random_tokens(rng, config, (B,)))
        slots = jnp.asarray(_row_slots(rng))
        force = jnp.asarray(rng.random(B) < 0.2)
        y, state = one(state, tokens, slots, force)
        y_sharded, sharded = many(sharded, tokens, slots, force)
        chex.assert_trees_all_equal((y_sharded, sharded), (y, state))
        flushes += int((state.write_pos == 0).sum())
    assert flushes > 0
    assert sharded.checkpoint.sharding.spec == jax.sharding.PartitionSpec("dp", "tp")
    assert sharded.write_pos.sharding.spec == jax.sharding.PartitionSpec("dp")


@child_only
@pytest.mark.parametrize("gate,backend", [("gdn", "xla"), ("kda", "xla"), ("gdn", "pallas_triton")])
def test_verify_and_accept_equal_single_device(rng, gate, backend):
    """Windows of T = 2 with ragged lengths, then mixed accepts: the sharded verify and accept
    end with the same outputs and state bits as one device (each head's window solve is
    local to its device), on the xla backend and on the Triton kernels (interpret mode)."""
    config, mesh = _config(gate, cache_len=4), _mesh()
    state = init_state(config, N, jnp.asarray(random_checkpoint(rng, config, N)))
    sharded = sharding.place_state(state, mesh)
    width = 2
    for _ in range(4):  # enough rounds for the capacity rule to fold rows
        window = to_device(random_tokens(rng, config, (B, width)))
        slots = jnp.asarray(_row_slots(rng))
        lengths = jnp.asarray(rng.integers(0, width + 1, B), jnp.int32)
        y, state = jax.jit(lambda s, w, sl, n: R.verify_step(s, w, sl, backend=backend, lengths=n,
                                                             use_qk_l2norm=True))(state, window, slots, lengths)
        y_s, sharded = jax.jit(lambda s, w, sl, n: sharding.verify_step(
            s, w, sl, mesh=mesh, backend=backend, lengths=n, use_qk_l2norm=True))(sharded, window, slots, lengths)
        chex.assert_trees_all_equal((y_s, sharded), (y, state))
        accepted = jnp.minimum(jnp.asarray(rng.integers(0, width + 1, B), jnp.int32), lengths)
        state = jax.jit(R.accept)(state, slots, accepted)
        sharded = jax.jit(lambda s, sl, n: sharding.accept(s, sl, n, mesh=mesh))(sharded, slots, accepted)
        chex.assert_trees_all_equal(sharded, state)
    assert sharded.checkpoint.sharding.spec == jax.sharding.PartitionSpec("dp", "tp")


def _mamba2_inputs(rng, config: ReplayConfig, lead: tuple[int, ...]) -> R.Mamba2Tokens:
    normal = lambda *shape: jnp.asarray(rng.normal(size=(*lead, *shape)), jnp.float32)
    heads, groups, size = config.num_v_heads, config.num_k_heads, config.head_k_dim
    return R.Mamba2Tokens(x=normal(heads, config.head_v_dim), B=normal(groups, size), C=normal(groups, size),
                          dt=normal(heads), z=normal(heads, config.head_v_dim))


@child_only
@pytest.mark.parametrize("groups", [1, 4])
def test_mamba2_layer_equals_single_device_bit_for_bit(rng, groups):
    """A Mamba-2 layer (its per-head A, D, dt_bias split over tp with the heads) through
    decode steps with forced flushes, then T = 2 windows with ragged lengths and mixed
    accepts: the sharded calls end with one device's outputs and state bits, its B records
    split over tp with their groups (G = 4) or replicated (G = 1)."""
    config, mesh = ReplayConfig.mamba2(8, 16, 32, groups, 4), _mesh()
    params = R.Mamba2Params(A=jnp.asarray(-rng.uniform(0.5, 8.0, 8), jnp.float32),
                            D=jnp.asarray(rng.normal(size=8), jnp.float32),
                            dt_bias=jnp.asarray(rng.uniform(-4.5, -2.0, 8), jnp.float32))
    state = init_state(config, N, jnp.asarray(random_checkpoint(rng, config, N)))
    sharded = sharding.place_state(state, mesh)
    keys = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("dp", "tp" if groups % TP == 0 else None))
    assert sharded.k_cache.sharding.is_equivalent_to(keys, 4)
    one = jax.jit(lambda s, t, sl, f: decode_step(s, t, sl, f, policy="natural", gate_params=params))
    many = jax.jit(lambda s, t, sl, f: sharding.decode_step(s, t, sl, f, mesh=mesh, policy="natural",
                                                            gate_params=params))
    for _ in range(5):
        tokens, slots = _mamba2_inputs(rng, config, (B,)), jnp.asarray(_row_slots(rng))
        force = jnp.asarray(rng.random(B) < 0.2)
        y, state = one(state, tokens, slots, force)
        y_sharded, sharded = many(sharded, tokens, slots, force)
        chex.assert_trees_all_equal((y_sharded, sharded), (y, state))
    width = 2
    for _ in range(3):
        window, slots = _mamba2_inputs(rng, config, (B, width)), jnp.asarray(_row_slots(rng))
        lengths = jnp.asarray(rng.integers(0, width + 1, B), jnp.int32)
        y, state = jax.jit(lambda s, w, sl, n: R.verify_step(s, w, sl, lengths=n, gate_params=params))(
            state, window, slots, lengths)
        y_s, sharded = jax.jit(lambda s, w, sl, n: sharding.verify_step(
            s, w, sl, mesh=mesh, lengths=n, gate_params=params))(sharded, window, slots, lengths)
        chex.assert_trees_all_equal((y_s, sharded), (y, state))
        accepted = jnp.minimum(jnp.asarray(rng.integers(0, width + 1, B), jnp.int32), lengths)
        state = jax.jit(R.accept)(state, slots, accepted)
        sharded = jax.jit(lambda s, sl, n: sharding.accept(s, sl, n, mesh=mesh))(sharded, slots, accepted)
        chex.assert_trees_all_equal(sharded, state)
    assert sharded.k_cache.sharding.is_equivalent_to(keys, 4)


@child_only
def test_under_jit_a_row_naming_another_shards_slot_is_padding(rng):
    config, mesh = _config(), _mesh()
    state = sharding.place_state(init_state(config, N, jnp.asarray(random_checkpoint(rng, config, N))), mesh)
    slots = np.array([2, 1, -1, 3, 4, 5, 6, 7], np.int32)  # row 0 (dp shard 0) names shard 1's slot 2
    step = jax.jit(lambda s, t, sl: sharding.decode_step(s, t, sl, mesh=mesh, policy="every_step"))
    y, new = step(state, to_device(random_tokens(rng, config, (B,))), jnp.asarray(slots))
    assert not np.asarray(y[0]).any() and np.asarray(y[1]).any()
    np.testing.assert_array_equal(new.checkpoint[2], state.checkpoint[2])  # slot 2's own row is padding
    assert (np.asarray(new.checkpoint[1]) != np.asarray(state.checkpoint[1])).any()


@child_only
def test_the_replay_step_has_no_collectives(rng):
    config, mesh = _config(), _mesh()
    state = sharding.place_state(init_state(config, N), mesh)
    step = jax.jit(lambda s, t, sl: sharding.decode_step(s, t, sl, mesh=mesh, policy="natural"))
    hlo = step.lower(state, to_device(random_tokens(rng, config, (B,))), jnp.zeros(B, jnp.int32)).compile().as_text()
    assert not re.findall(r"all-gather|all-reduce|reduce-scatter|collective-permute|all-to-all", hlo)


def _model_inputs(rng, steps: int):
    tokens = rng.integers(0, TINY.vocab_size, (steps, B)).astype(np.int32)
    slots = np.stack([_row_slots(rng) for _ in range(steps)])
    force = rng.random((steps, B)) < 0.2
    return tokens, slots, force


@child_only
def test_model_step_and_slot_ops_match_single_device(rng):
    """Decode, forced flushes, reset / flush / copy, snapshots and their restore, all layers."""
    params, mesh = decoder.init_params(TINY, seed=3), _mesh()
    state = TINY.init_state(N, 3)
    sharded = sharding.place_state(state, mesh)
    one = jax.jit(lambda s, t, sl, f: decoder.decode_step(params, s, t, sl, f, policy="natural"))
    many = jax.jit(lambda s, t, sl, f: sharding.model_decode_step(params, s, t, sl, f, mesh=mesh, policy="natural"))

    def both(op, *args):
        nonlocal state, sharded
        state, sharded = jax.jit(op)(state, *args), sharding.place_state(jax.jit(op)(sharded, *args), mesh)
        chex.assert_trees_all_close(sharded, state, **MODEL_TOL)

    for tokens, slots, force in zip(*_model_inputs(rng, 7)):
        args = jnp.asarray(tokens), jnp.asarray(slots), jnp.asarray(force)
        logits, state, plan = one(state, *args)
        logits_sharded, sharded, plan_sharded = many(sharded, *args)
        chex.assert_trees_all_close((logits_sharded, sharded), (logits, state), **MODEL_TOL)
        for name in ("slot", "valid", "pos", "flush"):
            np.testing.assert_array_equal(getattr(plan_sharded, name), getattr(plan, name), err_msg=name)
        assert sorted(np.asarray(plan_sharded.launch_order).tolist()) == list(range(B))
    assert sharded.checkpoint.sharding.spec == jax.sharding.PartitionSpec(None, "dp", "tp")

    both(slot_ops.flush_slots, jnp.array([1, 6, -1], jnp.int32))
    both(slot_ops.copy_slots, jnp.array([0, 5], jnp.int32), jnp.array([7, 2], jnp.int32))
    flushed = jnp.array([1, 7, 2], jnp.int32)
    snap, snap_sharded = jax.jit(slot_ops.snapshot)(state, flushed), jax.jit(slot_ops.snapshot)(sharded, flushed)
    chex.assert_trees_all_close(snap_sharded, snap, **MODEL_TOL)
    both(slot_ops.reset_slots, jnp.array([4, 3, 0], jnp.int32), snap.checkpoint, snap.conv_state)
    both(slot_ops.reset_slots, jnp.array([5, -1], jnp.int32))
    for tokens, slots, force in zip(*_model_inputs(rng, 3)):  # decoding on from the restored slots
        args = jnp.asarray(tokens), jnp.asarray(slots), jnp.asarray(force)
        logits, state, _ = one(state, *args)
        logits_sharded, sharded, _ = many(sharded, *args)
        np.testing.assert_allclose(np.asarray(logits_sharded), np.asarray(logits), **MODEL_TOL)
    chex.assert_trees_all_close(sharded, state, **MODEL_TOL)


@child_only
def test_model_verify_and_accept_match_single_device(rng):
    """Speculative rounds of the model on the mesh (T = 3 windows on rings of 3, so rows
    fold, and mixed accepts of 0..T tokens, padding rows among them; chains and draft
    trees with an accepted path, alternately) end with the logits,
    conv inputs, folded rows and state of one device; the verify step's only collective is
    the all-gather of the layer outputs."""
    params, mesh = decoder.init_params(TINY, seed=4), _mesh()
    state = TINY.init_state(N, 3)
    sharded = sharding.place_state(state, mesh)
    width = 3
    one_verify = jax.jit(lambda s, t, sl, p: decoder.verify_window(params, s, t, sl, parents=p))
    one_accept = jax.jit(lambda s, sl, n, c, p: decoder.accept_window(s, sl, n, c, path=p))
    many_verify = jax.jit(lambda s, t, sl, p: sharding.model_verify_step(params, s, t, sl, mesh=mesh, parents=p))
    many_accept = jax.jit(lambda s, sl, n, c, p: sharding.model_accept_step(s, sl, n, c, mesh=mesh, path=p))
    folded_rows = 0
    for round_ in range(5):  # odd rounds: a draft tree and an accepted path in it
        tokens = jnp.asarray(rng.integers(0, TINY.vocab_size, (B, width)), jnp.int32)
        slots = jnp.asarray(_row_slots(rng))
        parents, path, accepted = _tree_round(rng, width)
        if round_ % 2 == 0:
            parents = path = None
            accepted = jnp.asarray(rng.integers(0, width + 1, B), jnp.int32)
        logits, state, conv_inputs, folded = one_verify(state, tokens, slots, parents)
        logits_s, sharded, conv_inputs_s, folded_s = many_verify(sharded, tokens, slots, parents)
        chex.assert_trees_all_close((logits_s, sharded, conv_inputs_s), (logits, state, conv_inputs), **MODEL_TOL)
        np.testing.assert_array_equal(folded_s, folded)
        folded_rows += int(np.sum(folded))
        state = one_accept(state, slots, accepted, conv_inputs, path)
        sharded = many_accept(sharded, slots, accepted, conv_inputs_s, path)
        chex.assert_trees_all_close(sharded, state, **MODEL_TOL)
    assert folded_rows > 0
    assert sharded.checkpoint.sharding.spec == jax.sharding.PartitionSpec(None, "dp", "tp")
    hlo = sharding.jitted_model_verify_step.lower(params, sharded, tokens, slots, mesh=mesh).compile().as_text()
    found = _collectives(hlo)
    assert found and {(op, dtype) for op, dtype, _ in found} == {("all-gather", "f32")}, found


def _tree_round(rng, width: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """A random draft tree `parents [B, T]`, a root-to-leaf `path [B, T]` in it (zero padded)
    and a count per row of at most its length."""
    parents = np.stack([[-1] + [int(rng.integers(-1, i)) for i in range(1, width)] for _ in range(B)])
    path, kept = np.zeros((B, width), np.int32), np.zeros(B, np.int32)
    for row in range(B):
        chain = [int(rng.integers(0, width))]
        while parents[row, chain[0]] >= 0:
            chain.insert(0, int(parents[row, chain[0]]))
        path[row, :len(chain)], kept[row] = chain, rng.integers(0, len(chain) + 1)
    return jnp.asarray(parents, jnp.int32), jnp.asarray(path), jnp.asarray(kept)


def _collectives(hlo: str) -> list[tuple[str, str, tuple[int, ...]]]:
    """(op, dtype, result shape) of every collective in an HLO module's text."""
    found = re.findall(r"= (\w+)\[([\d,]*)\][^=]*? (all-gather|all-reduce|reduce-scatter|collective-permute|"
                       r"all-to-all)(?:-start)?\(", hlo)
    return [(op, dtype, tuple(int(d) for d in dims.split(",") if d)) for dtype, dims, op in found]


@child_only
@pytest.mark.parametrize("groups", [1, 2])
def test_hybrid_stack_matches_single_device(rng, groups):
    """A Mamba-2 + GDN stack on the mesh: decode steps with forced flushes, then verify and
    accept rounds of draft trees on rings of 3 (rows fold, accepted paths of mixed
    lengths, padding rows) end with the
    logits, plans, conv inputs and state of one device. The Mamba-2 layer's B / C groups
    split over tp (G = 2) or, a single group, are replicated on both tp devices (G = 1);
    the verify step's only collective is the all-gather of the layer outputs."""
    config = dataclasses.replace(TINY, layers=("mamba2", "gdn"), mamba2_heads=4, mamba2_head_dim=8,
                                 mamba2_state_size=8, mamba2_groups=groups)
    params, mesh = decoder.init_params(config, seed=5), _mesh()
    state = config.init_state(N, 3)
    sharded = sharding.place_state(state, mesh)
    keys = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("dp", "tp" if groups % TP == 0 else None))
    assert sharded.layers[0].k_cache.sharding.is_equivalent_to(keys, 4)
    one = jax.jit(lambda s, t, sl, f: decoder.decode_step(params, s, t, sl, f, policy="natural"))
    many = jax.jit(lambda s, t, sl, f: sharding.model_decode_step(params, s, t, sl, f, mesh=mesh, policy="natural"))
    for tokens, slots, force in zip(*_model_inputs(rng, 4)):
        args = jnp.asarray(tokens), jnp.asarray(slots), jnp.asarray(force)
        logits, state, plan = one(state, *args)
        logits_sharded, sharded, plan_sharded = many(sharded, *args)
        chex.assert_trees_all_close((logits_sharded, sharded), (logits, state), **MODEL_TOL)
        np.testing.assert_array_equal(plan_sharded.flush, plan.flush)
    one_verify = jax.jit(lambda s, t, sl, p: decoder.verify_window(params, s, t, sl, parents=p))
    many_verify = jax.jit(lambda s, t, sl, p: sharding.model_verify_step(params, s, t, sl, mesh=mesh, parents=p))
    many_accept = jax.jit(lambda s, sl, n, c, p: sharding.model_accept_step(s, sl, n, c, mesh=mesh, path=p))
    folded_rows = 0
    for _ in range(3):  # draft trees, an accepted path in each
        tokens = jnp.asarray(rng.integers(0, config.vocab_size, (B, 3)), jnp.int32)
        slots = jnp.asarray(_row_slots(rng))
        parents, path, accepted = _tree_round(rng, 3)
        logits, state, conv_inputs, folded = one_verify(state, tokens, slots, parents)
        logits_s, sharded, conv_inputs_s, folded_s = many_verify(sharded, tokens, slots, parents)
        chex.assert_trees_all_close((logits_s, sharded, conv_inputs_s), (logits, state, conv_inputs), **MODEL_TOL)
        np.testing.assert_array_equal(folded_s, folded)
        folded_rows += int(np.sum(folded))
        state = jax.jit(lambda s, sl, n, c, p: decoder.accept_window(s, sl, n, c, path=p))(
            state, slots, accepted, conv_inputs, path)
        sharded = many_accept(sharded, slots, accepted, conv_inputs_s, path)
        chex.assert_trees_all_close(sharded, state, **MODEL_TOL)
    assert folded_rows > 0
    assert sharded.layers[0].k_cache.sharding.is_equivalent_to(keys, 4)
    hlo = sharding.jitted_model_verify_step.lower(params, sharded, tokens, slots, mesh=mesh).compile().as_text()
    found = _collectives(hlo)
    assert found and {(op, dtype) for op, dtype, _ in found} == {("all-gather", "f32")}, found


@child_only
def test_the_model_step_gathers_only_the_layer_outputs():
    params, mesh = decoder.init_params(TINY, seed=0), _mesh()
    state = sharding.place_state(TINY.init_state(N, 3), mesh)
    zeros = jnp.zeros(B, jnp.int32)
    hlo = sharding.jitted_model_decode_step.lower(params, state, zeros, zeros, mesh=mesh).compile().as_text()
    found = _collectives(hlo)
    y_gathered = (B // DP, TINY.num_v_heads, TINY.head_v_dim)
    assert found, "the all-gather of y is missing: the test would not see a collective"
    assert {(op, dtype) for op, dtype, _ in found} == {("all-gather", "f32")}, found
    assert all(int(np.prod(shape)) == int(np.prod(y_gathered)) for _, _, shape in found), found


@child_only
def test_sharded_pallas_step_picks_the_row_of_its_local_batch(rng, monkeypatch):
    """Inside shard_map the kernel sees B/dp rows and H/tp heads; the launch row follows them."""
    config = ReplayConfig(num_k_heads=2, num_v_heads=4, head_k_dim=32, head_v_dim=16, cache_len=3)
    mesh = _mesh()
    batch = 16  # 4 rows per device: a different launch-table row from the global 16
    local, whole = (pallas_triton.launch_row("replay", "gdn", 4, n, config.cache_len) for n in (batch // DP, batch))
    assert local != whole
    seen = []
    real = pallas_triton.launch_row
    monkeypatch.setattr(pallas_triton, "launch_row", lambda *a: seen.append(a) or real(*a))
    num_slots = 2 * batch
    state = init_state(config, num_slots, jnp.asarray(random_checkpoint(rng, config, num_slots)))
    per, rows = num_slots // DP, batch // DP
    slots = jnp.asarray(np.concatenate([i * per + rng.permutation(per)[:rows] for i in range(DP)]).astype(np.int32))
    tokens = to_device(random_tokens(rng, config, (batch,)))
    options = dict(backend="pallas_triton", policy="natural", use_qk_l2norm=True)
    y, new = sharding.decode_step(sharding.place_state(state, mesh), tokens, slots, mesh=mesh, **options)
    assert seen == [("replay", "gdn", 4, batch // DP, config.cache_len)]
    assert pallas_triton.launch_params(sharding.local_config(config, TP), batch // DP,
                                       FlushPolicy.NATURAL) == local.params
    # Same step on one device with the kernel parameters the local row chose.
    y_one, one = decode_step(state, tokens, slots, kernel_params=local.params, **options)
    chex.assert_trees_all_equal((y, new), (y_one, one))


@child_only
def test_demo_runs_sharded_and_agrees(capsys):
    code = demo.main(["--batch", "4", "--steps", "12", "--cache-len", "2", "--track-interval", "4",
                      "--mesh", "tp=2,dp=2"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "mesh {'dp': 2, 'tp': 2} over 4 devices" in out
    assert "greedy tokens equal to plain decode alone: all" in out


@child_only
def test_demo_speculates_sharded_and_agrees(capsys):
    """The engine's speculative step on a 2 x 2 mesh with a hybrid stack (the self drafter:
    every draft of an fp32 state accepted, full windows), rings of 3 so windows fold."""
    code = demo.main(["--batch", "4", "--steps", "8", "--cache-len", "3", "--track-interval", "4",
                      "--mesh", "tp=2,dp=2", "--speculate", "3", "--drafter", "self", "--layers", "gdn,mamba2"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "mesh {'dp': 2, 'tp': 2} over 4 devices" in out
    assert "greedy tokens equal to non-speculative plain decode: all" in out


@child_only
def test_model_accept_refuses_counts_past_the_window(rng):
    params, mesh = decoder.init_params(TINY, seed=0), _mesh()
    state = sharding.place_state(TINY.init_state(N, 3), mesh)
    slots = jnp.asarray(_row_slots(rng))
    channels = 2 * TINY.num_k_heads * TINY.head_k_dim + TINY.num_v_heads * TINY.head_v_dim  # q, k, v
    conv_inputs = jnp.zeros((TINY.num_layers, B, 2, channels))  # a window of T = 2
    with pytest.raises(ValueError, match=r"num_accepted must lie in \[0, 2\]"):
        sharding.model_accept_step(state, slots, jnp.full((B,), 3, jnp.int32), conv_inputs, mesh=mesh)
    with pytest.raises(ValueError, match="window width T = 4 exceeds"):
        sharding.model_verify_step(params, state, jnp.zeros((B, 4), jnp.int32), slots, mesh=mesh)
