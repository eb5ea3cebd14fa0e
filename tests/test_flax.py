"""The Flax NNX decoder (replay state in NNX variables) against the package's own decoder."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

nnx = pytest.importorskip("flax.nnx", reason="needs the `flax` extra")

from replayssm_jax import flax as rflax  # noqa: E402
from replayssm_jax.model import decoder  # noqa: E402

# Both sides run the same fp32 operations on the same weights; only XLA's fusion of the
# per-layer loop (NNX: unrolled, decoder: lax.scan) differs: ~1e-6 relative.
LOGIT_BOUND = 1e-5


def _err(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


@pytest.mark.parametrize("layers", [None, ("mamba2", "gdn")])
def test_two_layer_nnx_model_prefills_and_decodes_like_the_decoder(rng, layers):
    """Prefill, decode steps through two natural flushes, then a second prefill that
    continues the slots from their live state (checkpoint and cache): a GDN stack and a
    hybrid one (`Mamba2DecodeLayer`)."""
    config = decoder.DecoderConfig(num_layers=2, layers=layers)
    params = decoder.init_params(config, int(rng.integers(1 << 30)))
    num_slots, cache_len = 5, 3
    # the NNX model owns copies: its jitted step donates them
    model = rflax.Decoder(jax.tree.map(jnp.copy, params), config, num_slots=num_slots, cache_len=cache_len)
    state = config.init_state(num_slots, cache_len)
    slots = jnp.asarray(rng.permutation(num_slots)[:3], jnp.int32).at[1].set(-1)  # row 1: padding
    prompt = jnp.asarray(rng.integers(0, config.vocab_size, (3, 6)), jnp.int32)
    lengths = jnp.asarray([6, 2, 4])
    got = model.prefill(prompt, lengths, slots)
    want, state = decoder.prefill(params, state, prompt, lengths, slots)
    live = np.asarray(slots) >= 0
    assert _err(np.asarray(got)[live], np.asarray(want)[live]) < LOGIT_BOUND

    traces = []

    def step(model, tokens, slots):
        traces.append(1)
        return model.decode_step(tokens, slots, policy="natural")

    step = nnx.jit(step, donate_argnums=0)
    for t in range(2 * cache_len + 1):  # through two natural flushes
        tokens = jnp.asarray(rng.integers(0, config.vocab_size, 3), jnp.int32)
        got = step(model, tokens, slots)
        want, state, _ = decoder.decode_step(params, state, tokens, slots, policy="natural")
        assert _err(np.asarray(got)[live], np.asarray(want)[live]) < LOGIT_BOUND, t
        np.testing.assert_array_equal(model.layers[1].replay.get_value().write_pos, state.write_pos)
    assert len(traces) == 1, "one compilation for every step"
    assert np.any(np.asarray(state.write_pos) > 0)  # the second prefill starts from cached entries
    prompt = jnp.asarray(rng.integers(0, config.vocab_size, (3, 4)), jnp.int32)
    got = model.prefill(prompt, jnp.asarray([4, 1, 3]), slots)
    want, state = decoder.prefill(params, state, prompt, jnp.asarray([4, 1, 3]), slots)
    assert _err(np.asarray(got)[live], np.asarray(want)[live]) < LOGIT_BOUND


@pytest.mark.parametrize("layers", [None, ("gdn", "mamba2")])
def test_nnx_speculative_rounds_match_the_decoder(rng, layers):
    """Verify-and-accept rounds (T = 3 on rings of 4, so rows fold; 0..T kept per row, a
    padding row; odd rounds a draft tree and a path in it) give the logits, folded rows,
    cursors and conv states of `model.decoder.verify_window` / `accept_window`, then a
    decode step agrees."""
    config = decoder.DecoderConfig(num_layers=2, layers=layers)
    params = decoder.init_params(config, int(rng.integers(1 << 30)))
    num_slots, cache_len, width = 5, 4, 3
    model = rflax.Decoder(jax.tree.map(jnp.copy, params), config, num_slots=num_slots, cache_len=cache_len)
    state = config.init_state(num_slots, cache_len)
    slots = jnp.asarray(rng.permutation(num_slots)[:3], jnp.int32).at[2].set(-1)
    live = np.asarray(slots) >= 0
    folds = 0
    for round_ in range(4):
        window = jnp.asarray(rng.integers(0, config.vocab_size, (3, width)), jnp.int32)
        # a tree whose positions 1 and 2 are both children of 0; the path 0 -> 2
        parents, path = (jnp.asarray([[-1, 0, 0]] * 3), jnp.asarray([[0, 2, 0]] * 3)) if round_ % 2 else (None, None)
        got, conv_got, folded_got = model.verify_window(window, slots, parents)
        want, state, conv_want, folded = decoder.verify_window(params, state, window, slots, parents=parents)
        assert _err(np.asarray(got)[live], np.asarray(want)[live]) < LOGIT_BOUND
        np.testing.assert_array_equal(folded_got, folded)
        folds += int(np.sum(folded))
        kept = jnp.asarray(rng.integers(0, width + 1 if path is None else 3, 3), jnp.int32)
        model.accept_window(slots, kept, conv_got, path)
        state = decoder.accept_window(state, slots, kept, conv_want, path=path)
        for index, layer in enumerate(model.layers):
            np.testing.assert_array_equal(layer.replay.get_value().write_pos, state.write_pos)
            conv = state.layers[index].conv_state if config.hybrid else state.conv_state[index]
            np.testing.assert_allclose(layer.conv.get_value(), conv, rtol=1e-5, atol=1e-6)
    assert folds > 0
    tokens = jnp.asarray(rng.integers(0, config.vocab_size, 3), jnp.int32)
    got = model.decode_step(tokens, slots, policy="natural")
    want, _, _ = decoder.decode_step(params, state, tokens, slots, policy="natural")
    assert _err(np.asarray(got)[live], np.asarray(want)[live]) < LOGIT_BOUND
    with pytest.raises(ValueError, match=r"num_accepted must lie in \[0, 3\]"):
        model.accept_window(slots, jnp.full((3,), 4, jnp.int32), conv_got)


def test_decode_state_is_not_a_parameter():
    config = decoder.DecoderConfig(num_layers=2)
    model = rflax.Decoder(decoder.init_params(config, 0), config, num_slots=2, cache_len=4)
    params = jax.tree.leaves(nnx.state(model, nnx.Param))
    caches = jax.tree.leaves(nnx.state(model, rflax.ReplayCache))
    assert params and caches
    assert not {id(x) for x in params} & {id(x) for x in caches}
    assert sum(x.size for x in params) == decoder.num_params(decoder.init_params(config, 0))


def test_layer_checks_its_config():
    config = decoder.DecoderConfig()
    params = decoder.init_params(config, 0)
    gdn = jax.tree.map(lambda a: a[0], params.blocks.gdn)
    wrong = decoder.DecoderConfig(head_v_dim=16).replay_config(4)
    with pytest.raises(ValueError, match="do not match"):
        rflax.GDNDecodeLayer(gdn, config.gdn, wrong, 2)
    hybrid = decoder.DecoderConfig(num_layers=2, layers=("mamba2", "gdn"))
    mamba2 = decoder.init_params(hybrid, 0).blocks[0].mixer
    with pytest.raises(ValueError, match="not a Mamba-2 config"):
        rflax.Mamba2DecodeLayer(mamba2, hybrid.mamba2, hybrid.replay_config(4), 2)
