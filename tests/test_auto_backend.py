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
NEMOTRON_L32 = ReplayConfig.mamba2(128, 64, 128, 8, 32)
NEMOTRON_BF16 = ReplayConfig.mamba2(128, 64, 128, 8, 16, state_dtype=jnp.bfloat16, cache_dtype=jnp.bfloat16)
GDN_L32 = ReplayConfig(16, 32, 128, 128, 32)


@pytest.mark.parametrize("config,batch,platform,want", [
    (GDN, 512, "cpu", "xla"), (GDN, 512, "hopper", "mosaic_gpu"), (GDN, 32, "hopper", "mosaic_gpu"),
    (GDN, 31, "hopper", "pallas_triton"), (GDN, 8, "hopper", "pallas_triton"), (GDN, 512, "gpu", "pallas_triton"),
    (KDA, 512, "hopper", "mosaic_gpu"), (KDA, 127, "hopper", "pallas_triton"),
    (GDN_BF16, 512, "hopper", "mosaic_gpu"), (GDN_BF16, 32, "hopper", "mosaic_gpu"),
    # below B = 32 the Mosaic kernel's lead is within what XLA's pass before it may cost
    (GDN_BF16, 31, "hopper", "pallas_triton"), (GDN_BF16, 8, "hopper", "pallas_triton"),
    (NEMOTRON, 512, "hopper", "mosaic_gpu"), (NEMOTRON, 1, "hopper", "mosaic_gpu"), (NEMOTRON, 8, "cpu", "xla"),
    (NEMOTRON, 8, "gpu", "pallas_triton"),
    (NEMOTRON_BF16, 512, "hopper", "mosaic_gpu"), (NEMOTRON_BF16, 128, "hopper", "mosaic_gpu"),
    (NEMOTRON_BF16, 127, "hopper", "pallas_triton"),
    # Mamba-2 bf16 rings of 32: 0.83x plain on Mosaic at B = 512 (Triton folds).
    (ReplayConfig.mamba2(128, 64, 128, 8, 32, state_dtype=jnp.bfloat16, cache_dtype=jnp.bfloat16), 512, "hopper",
     "pallas_triton"),
    # fp32 rings of 32: two CTAs per SM since the chunked 3xTF32 rebuild and grouped key-side
    # records (Mamba-2 B = 128 187 µs against Triton 248; GDN B = 512 387 against 410).
    (NEMOTRON_L32, 512, "hopper", "mosaic_gpu"), (GDN_L32, 512, "hopper", "mosaic_gpu"),
    (GDN_L32, 31, "hopper", "pallas_triton"),
])
def test_decode_backend_per_device_layer_and_batch(config, batch, platform, want):
    assert auto.decode_backend(config, batch, platform, "NVIDIA H200") == want


def test_ring_bounds_follow_the_device_kind():
    """A 2-byte Mamba-2 step on rings of 32 goes to Mosaic on an H100 (measured faster there
    with two CTAs per SM) and to Triton elsewhere; longer rings stay on Triton everywhere."""
    ring = lambda L: ReplayConfig.mamba2(128, 64, 128, 8, L, state_dtype=jnp.bfloat16, cache_dtype=jnp.bfloat16)
    h100, h200 = "NVIDIA H100 80GB HBM3", "NVIDIA H200"
    assert auto.decode_backend(ring(32), 512, "hopper", h100) == "mosaic_gpu"
    assert auto.decode_backend(ring(32), 512, "hopper", h200) == "pallas_triton"
    assert auto.decode_backend(ring(64), 512, "hopper", h100) == "pallas_triton"
    assert auto.decode_backend(ring(32), 64, "hopper", h100) == "pallas_triton"  # below B = 128: not measured
    assert auto.max_cache_len("cpu") == auto.MOSAIC_MAX_CACHE_LEN


def test_mosaic_ctas_per_sm_of_the_measured_layers(monkeypatch):
    """Two or three persistent CTAs per SM for every layer `auto` sends to Mosaic (on a GPU:
    fp32 rings of 32 fit two with the 3xTF32 rebuild's chunked operands, one with the exact
    rebuild's record copies); an H200's bounds."""
    from replayssm_jax.backends import mosaic_gpu

    monkeypatch.setattr(mosaic_gpu, "device_kind", lambda: "NVIDIA H200")
    assert [auto.mosaic_ctas_per_sm(c) for c in (GDN, KDA, NEMOTRON, NEMOTRON_BF16)] == [2, 2, 2, 3]
    assert [auto.mosaic_ctas_per_sm(c) for c in (GDN_L32, NEMOTRON_L32)] == [2, 2]
    # A layer whose kernel fits one CTA per SM stays on Triton.
    kda_l64 = ReplayConfig(32, 32, 128, 128, 64, gate="kda")
    assert auto.mosaic_ctas_per_sm(kda_l64) == 1
    assert auto.decode_backend(kda_l64, 512, "hopper") == "pallas_triton"


def test_verify_backend_per_device():
    assert [auto.verify_backend(GDN, p) for p in ("hopper", "gpu", "cpu")] == ["mosaic_gpu", "xla", "xla"]


@pytest.mark.parametrize("config", [GDN, KDA, GDN_BF16, NEMOTRON])
def test_default_policy_follows_the_backend(config, monkeypatch):
    """The Mosaic kernels' fold is their flush step, slower than their replay cycle: NATURAL
    at every batch there; "auto" takes the policy of the backend it resolves to."""
    batches = (1, 4, 8, 16, 31, 32, 128, 512)
    assert all(default_flush_policy(config, b, "mosaic_gpu") is FlushPolicy.NATURAL for b in batches)
    monkeypatch.setattr(auto, "_platform", lambda: "hopper")
    for b in batches:
        resolved = auto.decode_backend(config, b)
        assert default_flush_policy(config, b, "auto") is default_flush_policy(config, b, resolved), b
    # The Triton measurements fold small batches (GDN fp32 to B = 5, Mamba-2 fp32 to B = 16).
    assert default_flush_policy(NEMOTRON, 8, "auto") is FlushPolicy.NATURAL
    assert default_flush_policy(NEMOTRON, 8, "pallas_triton") is FlushPolicy.EVERY_STEP
    assert default_flush_policy(GDN, 4, "auto") is default_flush_policy(GDN, 4) is FlushPolicy.EVERY_STEP


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
