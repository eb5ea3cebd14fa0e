"""`ReplayConfig`: validation, derived shapes, immutability, hashing."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from replayssm_jax import ReplayConfig, gates
from replayssm_jax.state import state_shapes

VALID = dict(num_k_heads=2, num_v_heads=4, head_k_dim=32, head_v_dim=16, cache_len=4)


def test_defaults_and_derived_values():
    config = ReplayConfig(**VALID)
    assert config.gate == "gdn"
    assert config.state_dtype == np.float32 and config.cache_dtype == np.float32
    assert config.group_size == 2
    assert config.g_shape(3) == (3, 4)
    assert ReplayConfig(**VALID, gate="kda").g_shape(3) == (3, 4, 32)
    assert config.state_bytes_per_slot() == 4 * 16 * 32 * 4
    bf16 = ReplayConfig(**VALID, state_dtype=jnp.bfloat16)
    assert bf16.state_dtype == jnp.bfloat16 and bf16.state_bytes_per_slot() == 4 * 16 * 32 * 2


def test_frozen_and_hashable():
    config = ReplayConfig(**VALID)
    assert hash(config) == hash(ReplayConfig(**VALID))
    assert config == ReplayConfig(**VALID, state_dtype="float32")
    assert config != ReplayConfig(**{**VALID, "cache_len": 5})
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.cache_len = 8


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(cache_len=0), r"cache_len must be a positive integer, got 0"),
        (dict(cache_len=-3), r"cache_len must be a positive integer, got -3"),
        (dict(cache_len=2.0), r"cache_len must be a positive integer, got 2.0"),
        (dict(cache_len=True), r"cache_len must be a positive integer, got True"),
        (dict(num_k_heads=0), r"num_k_heads must be a positive integer, got 0"),
        (dict(head_k_dim=0), r"head_k_dim must be a positive integer"),
        (dict(head_v_dim=-1), r"head_v_dim must be a positive integer"),
        (dict(num_v_heads=3), r"num_v_heads \(3\) must be a multiple of num_k_heads \(2\)"),
        (dict(num_k_heads=4, num_v_heads=2), r"num_v_heads \(2\) must be a multiple of num_k_heads \(4\)"),
        (dict(gate="mamba"), r"gate must be one of \('gdn', 'kda', 'mamba2'\), got 'mamba'"),
        (dict(state_dtype=jnp.int32), r"state_dtype must be one of .*, got int32"),
        (dict(cache_dtype="float64"), r"cache_dtype must be one of .*, got float64"),
        (dict(state_dtype=object()), r"state_dtype must be a floating dtype"),
    ],
)
def test_invalid_config_raises(change, match):
    with pytest.raises(ValueError, match=match):
        ReplayConfig(**{**VALID, **change})


def test_numpy_integers_are_accepted():
    config = ReplayConfig(**{**VALID, "cache_len": np.int64(16)})
    assert config.cache_len == 16 and type(config.cache_len) is int


@pytest.mark.parametrize("gate", ["gdn", "kda"])
def test_gate_kind_gives_the_decay_and_the_schemas(gate):
    """`ReplayConfig.gate_kind`: the registered kind, its decay and update rule, and the
    cache, token and gate-parameter shapes (written out here for VALID's sizes)."""
    config = ReplayConfig(**VALID, gate=gate, cache_dtype=jnp.bfloat16)
    kind = config.gate_kind
    assert kind is gates.GATES[gate] is gates.gate_kind(gate)
    assert kind.decay is (gates.Decay.PER_CHANNEL if gate == "kda" else gates.Decay.PER_HEAD)
    assert kind.update is gates.UpdateRule.DELTA
    assert config.per_channel_gate == (gate == "kda")
    tail = (32,) if gate == "kda" else ()
    caches = {name: (x.shape, x.dtype) for name, x in kind.cache_shapes(config, 3).items()}
    assert caches == dict(
        u_cache=((3, 4, 4, 16), jnp.bfloat16), k_cache=((3, 2, 4, 32), jnp.bfloat16),
        g_cache=((3, 4, 4, *tail), jnp.float32),
    )
    assert kind.token_shapes(config, 5) == dict(
        q=(5, 2, 32), k=(5, 2, 32), v=(5, 4, 16), g=(5, 4, *tail), beta=(5, 4))
    assert kind.gate_param_shapes(config) == ((4,), (4, *tail))


def test_gate_registry():
    assert tuple(gates.GATES) == ("gdn", "kda", "mamba2")
    assert gates.GATES["mamba2"].update is gates.UpdateRule.ADDITIVE
    assert [g.name for g in gates.GATES.values() if g.additive] == ["mamba2"]
    for bad in ("mamba", None, ["gdn"]):
        with pytest.raises(ValueError, match=r"gate must be one of \('gdn', 'kda', 'mamba2'\)"):
            gates.gate_kind(bad)


def test_mamba2_config_maps_onto_the_gdn_layout():
    """Heads H -> H_v, head dim P -> d_v, state size N -> d_k, groups G -> H_k; the caches
    hold x [N, H, L, P], B [N, G, L, N] and float32 dt [N, H, L]."""
    config = ReplayConfig.mamba2(8, 16, 32, 2, 4, state_dtype=jnp.bfloat16, cache_dtype=jnp.bfloat16)
    assert (config.num_v_heads, config.head_v_dim, config.head_k_dim, config.num_k_heads) == (8, 16, 32, 2)
    shapes = {k: (v.shape, v.dtype) for k, v in state_shapes(config, 3).items()}
    assert shapes["checkpoint"] == ((3, 8, 16, 32), jnp.bfloat16)
    assert shapes["u_cache"] == ((3, 8, 4, 16), jnp.bfloat16)
    assert shapes["k_cache"] == ((3, 2, 4, 32), jnp.bfloat16)
    assert shapes["g_cache"] == ((3, 8, 4), jnp.float32)
    assert config.gate_kind.token_shapes(config, 5) == dict(x=(5, 8, 16), B=(5, 2, 32), C=(5, 2, 32), dt=(5, 8))
    with pytest.raises(ValueError, match="multiple of num_k_heads"):
        ReplayConfig.mamba2(6, 16, 32, 4, 4)
