"""Speculative decoding in the model and the serving engine: verify a window, keep a ragged
prefix per row, and get exactly the greedy tokens of non-speculative decoding."""

from __future__ import annotations

import dataclasses
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import checkify

from replayssm_jax import checked
from replayssm_jax.model import decoder, demo, serving

from .conftest import LOGIT_ATOL, TINY

CACHE_LEN, WIDTH = 5, 3  # L = 5, T = 3: a window fits after 0..2 history records only
plain_kept = jax.jit(decoder.plain_forward)  # the plain recurrence over each row's kept tokens


def test_ngram_drafter_proposes_what_followed_the_last_occurrence():
    drafter = serving.NgramDrafter(n=3)
    # The final 3-gram (1, 2, 3) last occurred at 4..6, followed by 8, 1, 2.
    assert drafter.propose_one([1, 2, 3, 9, 1, 2, 3, 8, 1, 2, 3], 3) == [8, 1, 2]
    # Only a 1-gram recurs (7); what followed it runs out: the last token found is repeated.
    assert drafter.propose_one([5, 7, 4, 6, 7], 3) == [4, 6, 7]
    # Nothing recurs: the last token repeated.
    assert drafter.propose_one([5, 6, 7], 2) == [7, 7]
    # The occurrence before the latest: (1, 2, 3) at 0..2, followed by 9, 1, 2.
    assert drafter.propose_one([1, 2, 3, 9, 1, 2, 3, 8, 1, 2, 3], 3, occurrence=1) == [9, 1, 2]
    # The tree drafter: the two continuations as sibling chains under the row's next input.
    engine = types.SimpleNamespace(rows=[types.SimpleNamespace(sequence=[1, 2, 3, 9, 1, 2, 3, 8, 1, 2, 3]), None])
    drafts, parents = serving.NgramTreeDrafter(n=3).propose(engine, None, None, 4)
    assert drafts[0].tolist() == [8, 1, 9, 1] and parents.tolist() == [[0, 1, 0, 3]] * 2


def test_greedy_accept_keeps_the_agreeing_prefix_and_the_bonus():
    drafts = np.array([[5, 6, 7], [5, 6, 7], [1, 2, 3]])
    argmax = np.array([[5, 6, 7, 0], [5, 0, 7, 0], [0, 2, 3, 0]])
    assert serving.greedy_accept(drafts, argmax).tolist() == [4, 2, 1]


def test_verify_window_with_ragged_accepts_matches_plain_decode(params, rng):
    """Five windows of random tokens (teacher forcing) on three rows and a padding row, each
    row keeping its own 0..T tokens per window: the logits of every window position equal
    the plain recurrence's over the same tokens, the cursors follow the capacity rule (fold
    when write_pos + T > L, then the kept count), and the padding row's slot is untouched."""
    slots = np.array([2, -1, 0, 3], np.int32)
    live = slots >= 0
    state = TINY.init_state(num_slots=4, cache_len=CACHE_LEN)
    plain = decoder.init_plain_state(TINY, 4)
    cursor = np.zeros(4, int)  # the independent cursor schedule, per row
    untouched = np.asarray(state.checkpoint[:, 1]), np.asarray(state.conv_state[:, 1])
    folds = 0
    for _ in range(5):
        window = rng.integers(0, TINY.vocab_size, (4, WIDTH)).astype(np.int32)
        logits, state, conv_inputs, folded = decoder.jitted_verify_window(
            params, state, jnp.asarray(window), jnp.asarray(slots)
        )
        ref, _ = decoder.plain_step(params, jnp.asarray(window), plain)
        np.testing.assert_allclose(np.asarray(logits)[live], np.asarray(ref)[live], atol=LOGIT_ATOL, rtol=0)
        fold = live & (cursor + WIDTH > CACHE_LEN)
        assert np.asarray(folded).tolist() == fold.tolist()
        folds += fold.sum()
        kept = rng.integers(0, WIDTH + 1, 4).astype(np.int32)
        state = decoder.jitted_accept_window(state, jnp.asarray(slots), jnp.asarray(kept), conv_inputs)
        cursor = np.where(live, np.where(fold, 0, cursor) + kept, 0)
        assert np.asarray(state.write_pos)[slots[live]].tolist() == cursor[live].tolist()
        _, plain = plain_kept(params, jnp.asarray(window), plain, jnp.asarray(kept))
    assert folds > 0  # the schedule exercised the capacity rule
    np.testing.assert_array_equal(np.asarray(state.checkpoint[:, 1]), untouched[0])
    np.testing.assert_array_equal(np.asarray(state.conv_state[:, 1]), untouched[1])
    # One plain decode step after the last accept: the kept tokens only are in the state.
    token = rng.integers(0, TINY.vocab_size, 4).astype(np.int32)
    after, _, _ = decoder.jitted_decode_step(params, state, jnp.asarray(token), jnp.asarray(slots),
                                             policy="natural")
    ref, _ = decoder.plain_step(params, jnp.asarray(token)[:, None], plain)
    np.testing.assert_allclose(np.asarray(after)[live], np.asarray(ref)[live, 0], atol=LOGIT_ATOL, rtol=0)


class NoisySelfDrafter(serving.SelfDrafter):
    """The model's own greedy drafts with some tokens replaced by wrong ones, so rows keep
    different prefixes (0..T-1 drafts) in the same step."""

    def __init__(self, rng: np.random.Generator, p_wrong: float = 0.35):
        self.rng, self.p_wrong = rng, p_wrong

    def propose(self, engine, tokens, slots, count):
        drafts = super().propose(engine, tokens, slots, count)
        wrong = self.rng.random(drafts.shape) < self.p_wrong
        return np.where(wrong, (drafts + 1) % TINY.vocab_size, drafts)


class SiblingTreeDrafter(serving.SelfDrafter):
    """A tree of two sibling drafts under each row's next input: the model's own greedy token
    on a random one of them, a wrong token on the other, so rows keep a path through
    either branch (the second: its record moves next to the root's)."""

    def __init__(self, rng: np.random.Generator):
        self.rng = rng

    def propose(self, engine, tokens, slots, count):
        assert count == 2, "two siblings: a window of T = 3"
        right = super().propose(engine, tokens, slots, 1)[:, 0]
        wrong = (right + 1) % TINY.vocab_size
        second = self.rng.random(right.shape) < 0.5
        drafts = np.stack([np.where(second, wrong, right), np.where(second, right, wrong)], axis=1)
        return drafts, np.zeros_like(drafts)  # both under window position 0


def _serve(params, drafter, rng, steps=10, config=TINY, backend="xla"):
    engine = serving.Engine(params, config, max_batch=3, num_slots=6, cache_len=CACHE_LEN,
                            track_interval=4, speculate=WIDTH, drafter=drafter, backend=backend)
    engine.warm_up()
    workload = demo.Workload(rng, config.vocab_size, 4, CACHE_LEN)
    demo.serve(engine, workload, steps)
    return [r for r in workload.issued if r.generated]


@pytest.mark.parametrize("drafter", ["ngram", "ngram-tree", "self", "noisy", "sibling-tree"])
def test_speculative_serving_gives_the_tokens_of_plain_decoding(params, rng, drafter):
    """Continuous batching with speculative steps: every request's greedy tokens equal its
    plain-recurrence decode alone, logits within LOGIT_ATOL; the self drafter (fp32) has
    every draft accepted, the noisy one some but not all, the sibling tree one of its two
    drafts per step."""
    made = {"noisy": NoisySelfDrafter, "sibling-tree": SiblingTreeDrafter}.get(drafter)
    made = made(rng) if made else serving.DRAFTERS[drafter]()
    requests = _serve(params, made, rng)
    ref_tokens, ref_logits = serving.reference_decode(params, TINY, requests)
    for request, tokens, logits in zip(requests, ref_tokens, ref_logits):
        assert request.generated == tokens
        np.testing.assert_allclose(np.stack(request.logits), logits, atol=LOGIT_ATOL, rtol=0)
    accepted = sum(r.accepted_drafts for r in requests)
    drafted = sum(r.drafted for r in requests)
    assert drafted > 0
    if drafter == "self":
        assert accepted == drafted
    if drafter == "noisy":
        assert 0 < accepted < drafted
    if drafter == "sibling-tree":
        assert 2 * accepted == drafted


def test_speculative_serving_on_the_kernel_backend(rng):
    """The engine's verify windows through the Pallas kernels (interpret mode on CPU; the
    kernels take head dims >= 16): the greedy tokens of plain decoding, some drafts kept."""
    config = dataclasses.replace(TINY, head_k_dim=16, head_v_dim=16)
    params = decoder.init_params(config, seed=2)
    requests = _serve(params, NoisySelfDrafter(rng), rng, steps=6, config=config, backend="pallas_triton")
    ref_tokens, ref_logits = serving.reference_decode(params, config, requests)
    for request, tokens, logits in zip(requests, ref_tokens, ref_logits):
        assert request.generated == tokens
        np.testing.assert_allclose(np.stack(request.logits), logits, atol=LOGIT_ATOL, rtol=0)
    assert 0 < sum(r.accepted_drafts for r in requests) < sum(r.drafted for r in requests)


def test_demo_speculate_exits_zero(capsys):
    assert demo.main(["--speculate", "3", "--drafter", "self", "--steps", "6", "--batch", "2"]) == 0
    out = capsys.readouterr().out
    assert "greedy tokens equal to non-speculative plain decode: all" in out
    assert "tokens per verify step" in out


def test_engine_refuses_a_window_wider_than_the_ring(params):
    with pytest.raises(ValueError, match="speculate"):
        serving.Engine(params, TINY, max_batch=2, num_slots=2, cache_len=3, track_interval=4, speculate=4)


def test_accept_window_refuses_counts_outside_the_window(params):
    """A count past T would roll a row's conv state forward by inputs its window never had
    (the ring would still take it: T + 1 <= L here): refused at the boundary, and by a
    checkify check inside `checked` where the counts are traced."""
    state = TINY.init_state(num_slots=2, cache_len=CACHE_LEN)
    slots = jnp.array([0, 1], jnp.int32)
    _, state, conv_inputs, _ = decoder.verify_window(params, state, jnp.zeros((2, WIDTH), jnp.int32), slots)
    for counts in ([1, WIDTH + 1], [-1, 0]):
        with pytest.raises(ValueError, match=rf"num_accepted must lie in \[0, {WIDTH}\]"):
            decoder.accept_window(state, slots, jnp.array(counts, jnp.int32), conv_inputs)
    accept = checked(decoder.accept_window)
    with pytest.raises(checkify.JaxRuntimeError, match="the window width"):
        accept(state, slots, jnp.array([0, WIDTH + 1], jnp.int32), conv_inputs)
    moved = accept(state, slots, jnp.array([WIDTH, 0], jnp.int32), conv_inputs)
    assert np.asarray(moved.write_pos).tolist() == [WIDTH, 0]


def _ancestry(parents: np.ndarray, row: int, position: int) -> list[int]:
    """Window positions from the root down to `position` (its ancestors, then itself)."""
    path = [position]
    while parents[row, path[0]] >= 0:
        path.insert(0, int(parents[row, path[0]]))
    return path


@pytest.mark.parametrize("layers", [None, ("mamba2", "gdn")])
def test_tree_window_matches_every_path_and_keeps_the_accepted_one(rng, layers):
    """Two rounds of a random draft tree (T = 4) per row on rings of 6 (the second round
    folds rows), from slots with cached entries: the logits at every position equal the
    plain recurrence over its root-to-position path; after keeping a prefix of a random
    root-to-leaf path (0..depth tokens), a decode step equals the plain recurrence over the
    kept tokens and its own token; a padding row stays untouched."""
    config = TINY if layers is None else dataclasses.replace(TINY, layers=layers, num_layers=len(layers))
    params = decoder.init_params(config, int(rng.integers(1 << 30)))
    width, batch = 4, 4
    slots = np.array([2, -1, 0, 3], np.int32)
    live = slots >= 0
    state = config.init_state(num_slots=4, cache_len=6)
    plain = decoder.init_plain_state(config, batch)
    warm = jnp.asarray(rng.integers(0, config.vocab_size, (batch, 2)), jnp.int32)
    for step in range(2):
        _, state, _ = decoder.decode_step(params, state, warm[:, step], jnp.asarray(slots), policy="natural")
    _, plain = plain_kept(params, warm, plain, jnp.full((batch,), 2, jnp.int32))
    folds = 0
    for _ in range(2):
        parents = np.stack([[-1] + [int(rng.integers(-1, i)) for i in range(1, width)] for _ in range(batch)])
        window = rng.integers(0, config.vocab_size, (batch, width)).astype(np.int32)
        logits, state, conv_inputs, folded = decoder.verify_window(params, state, jnp.asarray(window),
                                                                   jnp.asarray(slots), parents=jnp.asarray(parents))
        folds += int(np.sum(folded))
        for position in range(width):
            paths = [_ancestry(parents, row, position) for row in range(batch)]
            tokens = np.zeros((batch, width), np.int32)
            for row, path in enumerate(paths):
                tokens[row, :len(path)] = window[row, path]
            depth = np.array([len(path) for path in paths])
            ref, _ = plain_kept(params, jnp.asarray(tokens), plain, jnp.asarray(depth, jnp.int32))
            want = np.asarray(ref)[np.arange(batch), depth - 1]
            np.testing.assert_allclose(np.asarray(logits)[live, position], want[live], atol=LOGIT_ATOL, rtol=0)
        leaves = [_ancestry(parents, row, int(rng.integers(0, width))) for row in range(batch)]
        kept = np.array([int(rng.integers(0, len(path) + 1)) for path in leaves], np.int32)
        path = np.zeros((batch, width), np.int32)
        for row, leaf in enumerate(leaves):
            path[row, :len(leaf)] = leaf
        state = decoder.accept_window(state, jnp.asarray(slots), jnp.asarray(kept), conv_inputs,
                                      path=jnp.asarray(path))
        token = rng.integers(0, config.vocab_size, batch).astype(np.int32)
        after, state, _ = decoder.decode_step(params, state, jnp.asarray(token), jnp.asarray(slots), policy="natural")
        sequence = np.zeros((batch, width + 1), np.int32)
        for row in range(batch):
            sequence[row, :kept[row] + 1] = [*window[row, path[row, :kept[row]]], token[row]]
        ref, plain = plain_kept(params, jnp.asarray(sequence), plain, jnp.asarray(kept + 1))
        np.testing.assert_allclose(np.asarray(after)[live], np.asarray(ref)[np.arange(batch), kept][live],
                                   atol=LOGIT_ATOL, rtol=0)
    assert folds > 0
