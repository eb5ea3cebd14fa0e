"""The decoder: ReplaySSM decode vs plain decode, one compilation, in-place state updates."""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from replayssm_jax import FlushPolicy
from replayssm_jax.model import decoder
from replayssm_jax.model.slots import track_flush

from .conftest import LOGIT_ATOL, TINY, run_plain

CHUNK = 4  # prefill chunk (prompts are padded to it)


def _prefill(params, state, prompt, slot):
    tokens = np.zeros((1, CHUNK), np.int32)
    tokens[0, : len(prompt)] = prompt
    return decoder.jitted_prefill(
        params, state, jnp.asarray(tokens), jnp.array([len(prompt)], jnp.int32),
        jnp.array([slot], jnp.int32),
    )


def test_replay_model_matches_plain_model(params, rng):
    """Greedy tokens identical and logits within LOGIT_ATOL over 3L+1 (>= 8) decode steps.

    Three rows on permuted slots plus a padding row, prompts of different lengths (so the
    rows' cursors differ), track-position forced flushes on top of the natural ones (the
    NATURAL policy: the default folds every step at batch 4).
    (L = 1, the plain recurrence, is covered by the single-layer foundation tests.)
    """
    cache_len = 3
    steps = 3 * cache_len + 1
    prompts = [rng.integers(0, TINY.vocab_size, n).tolist() for n in (4, 2, 3)]
    slots = np.array([3, 1, -1, 2], np.int32)  # row 2 is padding
    state = TINY.init_state(num_slots=4, cache_len=cache_len)
    tokens, logits = [[] for _ in prompts], [[] for _ in prompts]
    for i, (prompt, slot) in enumerate(zip(prompts, slots[[0, 1, 3]])):
        last, state = _prefill(params, state, prompt, slot)
        logits[i].append(np.asarray(last[0]))
        tokens[i].append(int(np.argmax(last[0])))
    rows = [0, 1, 3]
    for _ in range(steps - 1):
        feed = np.zeros(4, np.int32)
        seq_lens = np.zeros(4, np.int32)
        for i, row in enumerate(rows):
            feed[row] = tokens[i][-1]
            seq_lens[row] = len(prompts[i]) + len(tokens[i])
        out, state, _ = decoder.jitted_decode_step(
            params, state, jnp.asarray(feed), jnp.asarray(slots), track_flush(jnp.asarray(seq_lens), 3),
            policy="natural",
        )
        out = np.asarray(out)
        for i, row in enumerate(rows):
            logits[i].append(out[row])
            tokens[i].append(int(np.argmax(out[row])))
    ref_tokens, ref_logits = run_plain(params, prompts, steps)
    assert tokens == ref_tokens
    np.testing.assert_allclose(np.stack(logits), np.stack(ref_logits), atol=LOGIT_ATOL, rtol=0)


def test_decoder_at_batch_one_folds_every_step_by_default(rng):
    """At batch 1 the default policy flushes every step on both backends (on pallas_triton
    the folding kernel, interpret mode here): cursors stay 0 and the logits equal the xla
    backend's under the NATURAL policy, which replays the cache."""
    cache_len, steps = 3, 5
    model = dataclasses.replace(TINY, head_k_dim=16, head_v_dim=16)  # the kernels' smallest dims
    params = decoder.init_params(model, seed=2)
    prompt = rng.integers(0, model.vocab_size, 3).tolist()
    slots = jnp.array([2], jnp.int32)
    runs = {}
    for backend, policy in (("xla", "natural"), ("xla", None), ("pallas_triton", None)):
        _, state = _prefill(params, model.init_state(num_slots=4, cache_len=cache_len), prompt, 2)
        token, outs = jnp.asarray([prompt[-1]], jnp.int32), []
        for _ in range(steps):
            out, state, plan = decoder.jitted_decode_step(params, state, token, slots, backend=backend,
                                                          policy=policy)
            outs.append(np.asarray(out[0]))
            token = jnp.argmax(out, axis=-1).astype(jnp.int32)
            if policy is None:
                assert plan.policy is FlushPolicy.EVERY_STEP
                assert bool(plan.flush[0]) and int(state.write_pos[2]) == 0
        runs[backend, policy] = (np.stack(outs), state)
    assert int(runs["xla", "natural"][1].write_pos[2]) != 0  # the natural policy did replay
    for backend in ("xla", "pallas_triton"):
        np.testing.assert_allclose(runs[backend, None][0], runs["xla", "natural"][0], atol=LOGIT_ATOL, rtol=0)


def test_one_compilation_as_cursors_joins_and_leaves_change(params, rng):
    traces = []

    def counted(*args, **kwargs):
        traces.append(1)
        return decoder.decode_step(*args, **kwargs, policy="natural")

    step = jax.jit(counted, donate_argnames=("state",))
    state = TINY.init_state(num_slots=4, cache_len=3)
    schedules = [
        ([0, -1, -1], None),
        ([0, 3, -1], [False, True, False]),  # slot 3 joins with a forced flush
        ([2, 3, 0], [False, False, False]),  # rows permuted, another join
        ([-1, 3, -1], [True, False, False]),  # leaves; force on a padding row is ignored
        ([-1, -1, -1], None),
    ]
    for slots, force in schedules * 2:
        tokens = jnp.asarray(rng.integers(0, TINY.vocab_size, 3), jnp.int32)
        force = None if force is None else jnp.asarray(force)
        if force is None:
            force = jnp.zeros(3, bool)
        _, state, _ = step(params, state, tokens, jnp.asarray(slots, jnp.int32), force)
    assert len(traces) == 1


def test_decode_step_updates_the_donated_state_in_place(params):
    state = TINY.init_state(num_slots=4, cache_len=3)
    tokens = jnp.zeros(3, jnp.int32)
    slots = jnp.array([1, -1, 3], jnp.int32)
    force = jnp.zeros(3, bool)
    hlo = decoder.jitted_decode_step.lower(params, state, tokens, slots, force, policy="natural").compile().as_text()
    header = hlo.splitlines()[0]
    aliases = dict(re.findall(r"\{(\d+)\}: \((\d+), \{\}, may-alias\)", header))
    num_params = len(jax.tree.leaves(params))
    state_leaves = jax.tree.leaves(state)
    # Every state buffer (output 1..6) is aliased to its donated input parameter.
    outputs = {int(o) - 1: int(p) for o, p in aliases.items()}
    for i in range(len(state_leaves)):
        assert outputs.get(i) == num_params + i, header[:400]
    # ...and no state-sized buffer (stacked or flat view) is copied inside the step.
    shapes = set()
    for leaf in state_leaves:
        dims = list(leaf.shape)
        shapes.add(",".join(map(str, dims)))
        if len(dims) > 2:
            shapes.add(",".join(map(str, [dims[0] * dims[1], *dims[2:]])))
    copied = re.findall(r"= \w+\[([\d,]*)\]\{[\d,]*\} copy\(", hlo)
    assert not shapes & set(copied), copied


def test_bad_decode_inputs_raise(params):
    state = TINY.init_state(num_slots=2, cache_len=2)
    with pytest.raises(ValueError, match="slots holds slot 2"):
        decoder.decode_step(params, state, jnp.zeros(2, jnp.int32), jnp.array([0, 2], jnp.int32))
    with pytest.raises(ValueError, match="tokens must be an integer"):
        decoder.decode_step(params, state, jnp.zeros(2), jnp.array([0, 1], jnp.int32))
    with pytest.raises(ValueError, match=r"backend must be one of \('xla', 'pallas_triton', 'mosaic_gpu', 'auto'\), got 'pallas'"):
        decoder.decode_step(params, state, jnp.zeros(2, jnp.int32), jnp.array([0, 1], jnp.int32), backend="pallas")
    with pytest.raises(ValueError, match="policy must be a FlushPolicy or one of"):
        decoder.decode_step(params, state, jnp.zeros(2, jnp.int32), jnp.array([0, 1], jnp.int32), policy="often")
    with pytest.raises(ValueError, match="lengths must have shape"):
        decoder.prefill(params, state, jnp.zeros((1, 4), jnp.int32), jnp.array([1, 2]), jnp.array([0]))
