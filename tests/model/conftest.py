"""Shared tiny model for the model tests (small sizes: CPU compile time dominates)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from replayssm_jax.model import decoder

TINY = decoder.DecoderConfig(
    vocab_size=48, d_model=32, num_layers=2, num_k_heads=2, num_v_heads=4,
    head_k_dim=8, head_v_dim=8, mlp_hidden=32,
)

# Replay vs plain fp32: the per-layer outputs agree to ~1e-6 relative (same algebra, other
# summation order; the foundation tests bound it by 1e-5 normwise). Two layers, RMSNorms and
# an LM head with O(1) gains keep that at the 1e-6 level on O(1..10) logits; 1e-4 absolute
# leaves a 10x margin while a wrong state (a dropped cache entry, a stale checkpoint, a
# leaked slot) moves logits by > 1e-2.
LOGIT_ATOL = 1e-4
# fp32 states after a flush vs the reference state: same argument, states are O(1).
STATE_ATOL = 1e-5


@pytest.fixture(scope="session")
def params() -> decoder.DecoderParams:
    return decoder.init_params(TINY, seed=1)


def run_plain(params, prompts: list[list[int]], num_new: int, config: decoder.DecoderConfig = TINY):
    """Greedy decode of each prompt on its own plain state: (tokens [R, num_new], logits)."""
    tokens, logits = [], []
    for prompt in prompts:
        plain = decoder.init_plain_state(config, 1)
        out, row_logits = [], []
        for t in prompt:
            lg, plain = decoder.plain_step(params, jnp.array([[t]], jnp.int32), plain)
        for i in range(num_new):
            row_logits.append(np.asarray(lg[0, 0]))
            out.append(int(np.argmax(lg[0, 0])))
            if i < num_new - 1:
                lg, plain = decoder.plain_step(params, jnp.array([[out[-1]]], jnp.int32), plain)
        tokens.append(out)
        logits.append(np.stack(row_logits))
    return tokens, logits


def decode_both(params, state, plain, slots, tokens, force=None, policy="natural"):
    """Feed `tokens [T, B]` (teacher forcing) to the ReplaySSM model and the plain one.

    Row b uses slot `slots[b]` in `state` and row b of `plain`. Returns (state, plain,
    replay logits [T, B, V], plain logits [T, B, V]); `force` is an optional [T, B] bool.
    `policy` defaults to NATURAL, so the model replays its caches (the default policy
    folds every step at these small batches).
    """
    slots = jnp.asarray(slots, jnp.int32)
    replay_logits, plain_logits = [], []
    for t, row_tokens in enumerate(np.asarray(tokens)):
        row_tokens = jnp.asarray(row_tokens, jnp.int32)
        flush = None if force is None else jnp.asarray(force[t])
        lg, state, _ = decoder.jitted_decode_step(params, state, row_tokens, slots, flush, policy=policy)
        lp, plain = decoder.plain_step(params, row_tokens[:, None], plain)
        replay_logits.append(np.asarray(lg))
        plain_logits.append(np.asarray(lp[:, 0]))
    return state, plain, np.stack(replay_logits), np.stack(plain_logits)
