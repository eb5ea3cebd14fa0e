"""`backend="auto"`: which backend it resolves to, per device, layer and batch, and that its
steps are that backend's steps."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import random_checkpoint, random_tokens, small_config, to_device
from replayssm_jax import FlushPolicy, ReplayConfig, accept, decode_step, default_flush_policy, init_state, verify_step
from replayssm_jax.backends import auto

GDN = ReplayConfig(16, 32, 128, 128, 16)
KDA = ReplayConfig(32, 32, 128, 128, 16, gate="kda")
GDN_BF16 = ReplayConfig(16, 32, 128, 128, 16, state_dtype=jnp.bfloat16, cache_dtype=jnp.bfloat16)
NEMOTRON = ReplayConfig.mamba2(128, 64, 128, 8, 16)


@pytest.mark.parametrize("config,batch,platform,want", [
    (GDN, 512, "cpu", "xla"), (GDN, 512, "hopper", "mosaic_gpu"), (GDN, 128, "hopper", "mosaic_gpu"),
    (GDN, 127, "hopper", "pallas_triton"), (GDN, 8, "hopper", "pallas_triton"), (GDN, 512, "gpu", "pallas_triton"),
    (KDA, 512, "hopper", "pallas_triton"), (GDN_BF16, 512, "hopper", "pallas_triton"),
    (NEMOTRON, 512, "hopper", "mosaic_gpu"), (NEMOTRON, 8, "hopper", "pallas_triton"), (NEMOTRON, 8, "cpu", "xla"),
])
def test_decode_backend_per_device_layer_and_batch(config, batch, platform, want):
    assert auto.decode_backend(config, batch, platform) == want


def test_verify_backend_per_device():
    assert [auto.verify_backend(GDN, p) for p in ("hopper", "gpu", "cpu")] == ["mosaic_gpu", "xla", "xla"]


@pytest.mark.parametrize("key", sorted(auto.MOSAIC_FROM_BATCH))
def test_mosaic_rows_start_where_the_default_policy_replays(key):
    """The Mosaic kernels' fold-every-step path is slower than the Triton fold kernel at
    small batches, so a row must start where `default_flush_policy` is NATURAL."""
    gate, itemsize = key
    dtype = {4: jnp.float32, 2: jnp.bfloat16}[itemsize]
    config = (ReplayConfig.mamba2(128, 64, 128, 8, 16, state_dtype=dtype, cache_dtype=dtype) if gate == "mamba2"
              else ReplayConfig(16, 32, 128, 128, 16, gate=gate, state_dtype=dtype, cache_dtype=dtype))
    start = auto.MOSAIC_FROM_BATCH[key]
    assert all(default_flush_policy(config, b) == FlushPolicy.NATURAL for b in range(start, start + 512))


def test_auto_steps_are_the_resolved_backends_steps(rng):
    """Off GPU "auto" is xla: decode and verify steps equal xla's bit for bit."""
    cfg = small_config("gdn", 8)
    slots = jnp.asarray([3, -1, 0], jnp.int32)
    start = random_checkpoint(rng, cfg, 4)
    states = {b: init_state(cfg, 4, checkpoint=jnp.asarray(start)) for b in ("xla", "auto")}
    for step in range(10):
        tokens = to_device(random_tokens(rng, cfg, (3,)))
        force = jnp.asarray([step == 4, False, False])
        ys = {}
        for b in states:
            ys[b], states[b] = jax.jit(decode_step, static_argnames="backend")(states[b], tokens, slots, force,
                                                                               backend=b)
        np.testing.assert_array_equal(np.asarray(ys["auto"]), np.asarray(ys["xla"]))
    window = to_device(random_tokens(rng, cfg, (3, 2)))
    verified = {b: verify_step(s, window, slots, backend=b) for b, s in states.items()}
    np.testing.assert_array_equal(np.asarray(verified["auto"][0]), np.asarray(verified["xla"][0]))
    counts = jnp.asarray([1, 0, 2], jnp.int32)
    after = {b: accept(v[1], slots, counts) for b, v in verified.items()}
    for leaf_auto, leaf_xla in zip(jax.tree.leaves(after["auto"]), jax.tree.leaves(after["xla"])):
        np.testing.assert_array_equal(np.asarray(leaf_auto), np.asarray(leaf_xla))


def test_unknown_backends_are_refused(rng):
    cfg = small_config("gdn", 8)
    tokens = to_device(random_tokens(rng, cfg, (1,)))
    with pytest.raises(ValueError, match="backend must be one of"):
        decode_step(init_state(cfg, 2), tokens, jnp.zeros((1,), jnp.int32), backend="automatic")
