"""Hybrid stacks (GDN and Mamba-2 layers in one decoder): ReplaySSM decode, prefill, slot
operations, prefix snapshots, speculative windows and serving against the plain recurrence
of the same layers, and the plain forward against the layers' plain references composed here."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from replayssm_jax import FlushPolicy
from replayssm_jax.model import decoder, demo, serving
from replayssm_jax.model import slots as slot_ops
from replayssm_jax.model.layer import gdn_plain, matmul, rms_norm
from replayssm_jax.model.mamba2_layer import mamba2_plain
from replayssm_jax.model.slots import track_flush
from replayssm_jax.model.state import HybridState, layer_state

from helpers import aliased_parameters, state_sized_copies

from .conftest import LOGIT_ATOL, STATE_ATOL, TINY, decode_both, run_plain

KINDS = ("gdn", "mamba2", "gdn")
# Mamba-2 with P != N and two groups, so a transposed state or a wrong group cannot pass.
HYBRID = dataclasses.replace(TINY, layers=KINDS, num_layers=3, mamba2_heads=4, mamba2_head_dim=8,
                             mamba2_state_size=16, mamba2_groups=2)
L, N = 3, 5
jreset, jflush, jcopy = jax.jit(slot_ops.reset_slots), jax.jit(slot_ops.flush_slots), jax.jit(slot_ops.copy_slots)
jsnapshot, jlive = jax.jit(slot_ops.snapshot), jax.jit(slot_ops.live_states)


@pytest.fixture(scope="module")
def hparams() -> decoder.DecoderParams:
    return decoder.init_params(HYBRID, seed=4)


def _prefill(params, state, prompt, slot, chunk=6):
    tokens = np.zeros((1, chunk), np.int32)
    tokens[0, : len(prompt)] = prompt
    return decoder.jitted_prefill(params, state, jnp.asarray(tokens), jnp.array([len(prompt)], jnp.int32),
                                  jnp.array([slot], jnp.int32))


def _busy(params, rng, steps, slots=(2, 0, 1)):
    """Slots `slots` decoded for `steps` random tokens (the others idle); plain rows alongside."""
    state = HYBRID.init_state(N, L)
    plain = decoder.init_plain_state(HYBRID, len(slots))
    tokens = rng.integers(0, HYBRID.vocab_size, (steps, len(slots)))
    state, plain, _, _ = decode_both(params, state, plain, list(slots), tokens)
    return state, plain


def test_config_state_and_params_follow_the_layer_kinds(hparams):
    state = HYBRID.init_state(N, L)
    assert isinstance(state, HybridState) and state.kinds == KINDS and state.cache_len == L
    mamba2 = layer_state(state, 1)
    assert mamba2.config.gate == "mamba2"
    assert mamba2.checkpoint.shape == (N, 4, 8, 16) and mamba2.k_cache.shape == (N, 2, L, 16)
    assert state.layers[1].conv_state.shape == (N, 3, HYBRID.mamba2.conv_channels)
    assert layer_state(state, 0).checkpoint.shape == (N, TINY.num_v_heads, TINY.head_v_dim, TINY.head_k_dim)
    assert [type(b.mixer).__name__ for b in hparams.blocks] == ["GDNParams", "Mamba2LayerParams", "GDNParams"]
    assert not dataclasses.replace(TINY, layers=("gdn", "gdn")).hybrid  # GDN only: the stacked layout
    with pytest.raises(ValueError, match="layers must be a sequence of"):
        dataclasses.replace(TINY, layers=("gdn", "attention"))
    with pytest.raises(ValueError, match="layers names 3 layers, num_layers is 2"):
        dataclasses.replace(TINY, layers=KINDS)
    with pytest.raises(ValueError, match="num_layers must be a positive integer, got True"):
        dataclasses.replace(TINY, num_layers=True)
    with pytest.raises(ValueError, match="vocab_size must be a positive integer, got 0"):
        dataclasses.replace(TINY, vocab_size=0)
    with pytest.raises(ValueError, match="params and state must both be"):
        decoder.decode_step(decoder.init_params(TINY, 0), state, jnp.zeros(1, jnp.int32), jnp.zeros(1, jnp.int32))
    other = decoder.init_params(dataclasses.replace(HYBRID, layers=("mamba2", "gdn", "gdn")), 0)
    with pytest.raises(ValueError, match="params have layers"):
        decoder.decode_step(other, state, jnp.zeros(1, jnp.int32), jnp.zeros(1, jnp.int32))


def test_plain_forward_composes_each_layers_plain_reference(hparams, rng):
    """The hybrid plain forward equals the layers' own plain references (the GDN scan and
    the Mamba-2 scan) composed here with the blocks' norms and MLP, states included."""
    tokens = jnp.asarray(rng.integers(0, HYBRID.vocab_size, (2, 5)), jnp.int32)
    plain = decoder.init_plain_state(HYBRID, 2)
    plain = decoder.PlainState(ssm=tuple(0.1 * jnp.ones_like(s) for s in plain.ssm), conv=plain.conv)
    got, end = decoder.plain_forward(hparams, tokens, plain)
    x = hparams.embed[tokens]
    for i, block in enumerate(hparams.blocks):
        h = rms_norm(x, block.attn_norm)
        if KINDS[i] == "gdn":
            mixed, ssm, conv = gdn_plain(block.mixer, HYBRID.gdn, h, plain.ssm[i], plain.conv[i])
        else:
            mixed, ssm, conv = mamba2_plain(block.mixer, HYBRID.mamba2, h, plain.ssm[i], plain.conv[i])
        np.testing.assert_allclose(np.asarray(end.ssm[i]), np.asarray(ssm), rtol=0, atol=1e-6)
        np.testing.assert_array_equal(np.asarray(end.conv[i]), np.asarray(conv))
        x = x + mixed
        g = rms_norm(x, block.mlp_norm)
        x = x + matmul(jax.nn.silu(matmul(g, block.w_gate)) * matmul(g, block.w_up), block.w_down)
    want = matmul(rms_norm(x, hparams.final_norm), hparams.lm_head)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0, atol=1e-6)


def test_hybrid_replay_decode_matches_plain_decode(hparams, rng):
    """Greedy tokens identical and logits within LOGIT_ATOL over 3L+1 steps: prefills of
    different lengths on permuted slots, a padding row, track-position forced flushes on top
    of the natural ones (NATURAL policy), every layer's flushed checkpoints against the
    plain states."""
    steps = 3 * L + 1
    prompts = [rng.integers(0, HYBRID.vocab_size, n).tolist() for n in (4, 2, 3)]
    slots = np.array([3, 1, -1, 4], np.int32)
    state = HYBRID.init_state(N, L)
    tokens, logits = [[] for _ in prompts], [[] for _ in prompts]
    for i, (prompt, slot) in enumerate(zip(prompts, slots[[0, 1, 3]])):
        last, state = _prefill(hparams, state, prompt, slot)
        logits[i].append(np.asarray(last[0]))
        tokens[i].append(int(np.argmax(last[0])))
    rows = [0, 1, 3]
    for _ in range(steps - 1):
        feed, seq_lens = np.zeros(4, np.int32), np.zeros(4, np.int32)
        for i, row in enumerate(rows):
            feed[row] = tokens[i][-1]
            seq_lens[row] = len(prompts[i]) + len(tokens[i])
        out, state, _ = decoder.jitted_decode_step(hparams, state, jnp.asarray(feed), jnp.asarray(slots),
                                                   track_flush(jnp.asarray(seq_lens), 3), policy="natural")
        out = np.asarray(out)
        for i, row in enumerate(rows):
            logits[i].append(out[row])
            tokens[i].append(int(np.argmax(out[row])))
    ref_tokens, ref_logits = run_plain(hparams, prompts, steps, config=HYBRID)
    assert tokens == ref_tokens
    np.testing.assert_allclose(np.stack(logits), np.stack(ref_logits), atol=LOGIT_ATOL, rtol=0)


def test_teacher_forced_decode_and_flushed_checkpoints_every_layer(hparams, rng):
    state, plain = _busy(hparams, rng, steps=L)  # the L-th step flushed every busy slot
    np.testing.assert_array_equal(np.asarray(state.write_pos)[[2, 0, 1]], 0)
    for i in range(3):
        np.testing.assert_allclose(np.asarray(state.layers[i].checkpoint[np.array([2, 0, 1])]),
                                   np.asarray(plain.ssm[i]), atol=STATE_ATOL, rtol=0)
        np.testing.assert_allclose(np.asarray(state.layers[i].conv_state[np.array([2, 0, 1])]),
                                   np.asarray(plain.conv[i]), atol=STATE_ATOL, rtol=0)


def test_donated_decode_updates_every_layer_in_place(hparams):
    """Under `jit` with the state donated every layer's buffers are aliased to the outputs
    and none is copied (one compiled step for the whole stack)."""
    state = HYBRID.init_state(N, L)
    lowered = decoder.jitted_decode_step.lower(hparams, state, jnp.zeros(3, jnp.int32), jnp.array([1, -1, 3]),
                                               jnp.zeros(3, bool), policy="natural")
    hlo = lowered.compile().as_text()
    first = len(jax.tree.leaves(hparams))
    assert aliased_parameters(hlo) >= set(range(first, first + len(jax.tree.leaves(state))))
    assert not state_sized_copies(hlo, state), state_sized_copies(hlo, state)


@pytest.mark.parametrize("policy", [None, "natural"])
def test_pallas_backend_matches_xla(policy, rng):
    """The kernels (interpret mode) on a hybrid stack at their smallest dims, under the
    default policy (batch 2 folds every step: both kinds' defaults do) and the natural one."""
    model = dataclasses.replace(HYBRID, head_k_dim=16, head_v_dim=16, mamba2_head_dim=16)
    params = decoder.init_params(model, seed=5)
    slots = jnp.array([2, 0], jnp.int32)
    feed = rng.integers(0, model.vocab_size, (4, 2))
    outs = {}
    for backend in ("xla", "pallas_triton"):
        state, out = model.init_state(4, L), []
        for t in feed:
            logits, state, plan = decoder.jitted_decode_step(params, state, jnp.asarray(t, jnp.int32), slots,
                                                             backend=backend, policy=policy)
            out.append(np.asarray(logits))
        outs[backend] = np.stack(out)
    assert plan.policy is (FlushPolicy.EVERY_STEP if policy is None else FlushPolicy.NATURAL)
    np.testing.assert_allclose(outs["pallas_triton"], outs["xla"], atol=LOGIT_ATOL, rtol=0)


def test_mosaic_backend_matches_xla(rng):
    """The Mosaic GPU kernels (interpret mode) on a GDN + Mamba-2 stack at their smallest
    dims (64-row tiles, L = 8), natural policy with a forced flush: logits against xla."""
    model = dataclasses.replace(HYBRID, layers=("gdn", "mamba2"), num_layers=2, head_k_dim=64, head_v_dim=64,
                                mamba2_heads=2, mamba2_head_dim=64, mamba2_state_size=64)
    params = decoder.init_params(model, seed=6)
    slots = jnp.array([2, 0], jnp.int32)
    feed = rng.integers(0, model.vocab_size, (3, 2))
    outs = {}
    for backend in ("xla", "mosaic_gpu"):
        state, out = model.init_state(4, 8), []
        for t, row_tokens in enumerate(feed):
            force = jnp.array([t == 1, False])
            logits, state, plan = decoder.jitted_decode_step(params, state, jnp.asarray(row_tokens, jnp.int32), slots,
                                                             force, backend=backend, policy="natural")
            out.append(np.asarray(logits))
        outs[backend] = np.stack(out)
    assert np.asarray(plan.pos).tolist() == [0, 2]  # row 0 flushed at step 1 (forced)
    np.testing.assert_allclose(outs["mosaic_gpu"], outs["xla"], atol=LOGIT_ATOL, rtol=0)


def test_default_policy_folds_only_where_every_layer_kind_does():
    for dtype, batch, want in ((jnp.float32, 2, "every_step"), (jnp.float32, 8, "natural"),
                               (jnp.bfloat16, 8, "every_step"), (jnp.bfloat16, 9, "natural")):
        state = HYBRID.init_state(2, L, dtype)
        assert decoder.model_flush_policy(state, batch) is FlushPolicy(want), (dtype, batch)


def test_flush_slots_keeps_every_layers_live_state(hparams, rng):
    state, plain = _busy(hparams, rng, steps=L + 1)  # cursor 1 on the busy slots
    gate_params = decoder.layer_gate_params(hparams)
    busy = jnp.array([0, 1, 2])
    before = jlive(state, busy, gate_params)
    flushed = jflush(state, jnp.array([0, 2, -1], jnp.int32), gate_params)
    assert np.asarray(flushed.write_pos).tolist() == [0, int(state.write_pos[1]), 0, 0, 0]
    after = jlive(flushed, busy, gate_params)
    for i in range(3):
        np.testing.assert_allclose(np.asarray(after[i]), np.asarray(before[i]), atol=1e-6, rtol=0)
        np.testing.assert_allclose(np.asarray(flushed.layers[i].checkpoint[0]), np.asarray(plain.ssm[i][1]),
                                   atol=STATE_ATOL, rtol=0)
        for name in ("checkpoint", "u_cache", "k_cache", "g_cache", "conv_state"):  # slot 1 untouched
            np.testing.assert_array_equal(np.asarray(getattr(flushed.layers[i], name)[1]),
                                          np.asarray(getattr(state.layers[i], name)[1]))
    with pytest.raises(ValueError, match="gate_params must be a tuple with one entry per layer"):
        slot_ops.flush_slots(state, jnp.array([0], jnp.int32))
    with pytest.raises(ValueError, match=r"gate_params\[1\] must be the Mamba-2 layer's Mamba2Params"):
        slot_ops.flush_slots(state, jnp.array([0], jnp.int32), (None, None, None))


def test_copy_and_snapshot_restore_continue_like_the_source(hparams, rng):
    """copy_slots from an unflushed source and a snapshot restored into a fresh slot both
    continue exactly like the source slot, against the plain recurrence."""
    state, plain = _busy(hparams, rng, steps=L + 2)  # slot 0 (plain row 1) holds 2 cache entries
    assert int(state.write_pos[0]) == 2
    gate_params = decoder.layer_gate_params(hparams)
    copied = jcopy(state, jnp.array([0, -1], jnp.int32), jnp.array([3, -1], jnp.int32), gate_params)
    assert int(copied.write_pos[3]) == 0 and int(copied.write_pos[0]) == 2
    with pytest.raises(ValueError, match="unflushed"):
        slot_ops.snapshot(copied, jnp.array([0], jnp.int32))
    snap = jsnapshot(copied, jnp.array([3], jnp.int32))  # the copy is flushed (cursor 0)
    assert isinstance(snap.checkpoint, tuple) and len(snap.checkpoint) == 3
    restored = jreset(copied, jnp.array([4], jnp.int32), snap.checkpoint, snap.conv_state)
    row = lambda x: jnp.concatenate([x[1:2]] * 3, axis=0)
    plain3 = decoder.PlainState(ssm=tuple(row(s) for s in plain.ssm), conv=tuple(row(c) for c in plain.conv))
    tokens = np.repeat(rng.integers(0, HYBRID.vocab_size, (L + 1, 1)), 3, axis=1)
    _, _, replay, ref = decode_both(hparams, restored, plain3, [0, 3, 4], tokens)
    np.testing.assert_allclose(replay, ref, atol=LOGIT_ATOL, rtol=0)
    np.testing.assert_allclose(replay[:, 1], replay[:, 0], atol=LOGIT_ATOL, rtol=0)
    with pytest.raises(ValueError, match="checkpoint must be a tuple with one"):
        slot_ops.reset_slots(copied, jnp.array([4], jnp.int32), snap.checkpoint[:2])
    with pytest.raises(ValueError, match="checkpoint must have shape"):
        slot_ops.reset_slots(copied, jnp.array([4], jnp.int32), (snap.checkpoint[1],) * 3)


def test_reset_gives_a_fresh_slot(hparams, rng):
    state, _ = _busy(hparams, rng, steps=2)
    fresh = jreset(state, jnp.array([0, -1], jnp.int32))
    assert int(fresh.write_pos[0]) == 0
    for layer, old in zip(fresh.layers, state.layers):
        assert not np.any(np.asarray(layer.checkpoint[0])) and not np.any(np.asarray(layer.conv_state[0]))
        np.testing.assert_array_equal(np.asarray(layer.checkpoint[2]), np.asarray(old.checkpoint[2]))


def test_verify_window_with_ragged_accepts_matches_plain_decode(hparams, rng):
    """Windows of T = 3 on a ring of L = 5 (folds), rows keeping 0..T tokens each: logits of
    every position equal the plain recurrence's, cursors follow the capacity rule, and a
    decode step afterwards sees exactly the kept tokens."""
    cache_len, width = 5, 3
    slots = np.array([2, -1, 0, 3], np.int32)
    live = slots >= 0
    state = HYBRID.init_state(4, cache_len)
    plain = decoder.init_plain_state(HYBRID, 4)
    cursor, folds = np.zeros(4, int), 0
    plain_kept = jax.jit(decoder.plain_forward)
    for _ in range(4):
        window = rng.integers(0, HYBRID.vocab_size, (4, width)).astype(np.int32)
        logits, state, conv_inputs, folded = decoder.jitted_verify_window(hparams, state, jnp.asarray(window),
                                                                          jnp.asarray(slots))
        ref, _ = decoder.plain_step(hparams, jnp.asarray(window), plain)
        np.testing.assert_allclose(np.asarray(logits)[live], np.asarray(ref)[live], atol=LOGIT_ATOL, rtol=0)
        fold = live & (cursor + width > cache_len)
        assert np.asarray(folded).tolist() == fold.tolist()
        folds += fold.sum()
        kept = rng.integers(0, width + 1, 4).astype(np.int32)
        state = decoder.jitted_accept_window(state, jnp.asarray(slots), jnp.asarray(kept), conv_inputs)
        cursor = np.where(live, np.where(fold, 0, cursor) + kept, 0)
        assert np.asarray(state.write_pos)[slots[live]].tolist() == cursor[live].tolist()
        _, plain = plain_kept(hparams, jnp.asarray(window), plain, jnp.asarray(kept))
    assert folds > 0
    token = rng.integers(0, HYBRID.vocab_size, 4).astype(np.int32)
    after, _, _ = decoder.jitted_decode_step(hparams, state, jnp.asarray(token), jnp.asarray(slots), policy="natural")
    ref, _ = decoder.plain_step(hparams, jnp.asarray(token)[:, None], plain)
    np.testing.assert_allclose(np.asarray(after)[live], np.asarray(ref)[live, 0], atol=LOGIT_ATOL, rtol=0)


@pytest.mark.parametrize("speculate", [0, 3])
def test_engine_serves_a_hybrid_stack_like_plain_decoding(hparams, rng, speculate):
    """Continuous batching with prefix snapshots (and speculative steps): every request's
    greedy tokens equal its plain decode alone."""
    engine = serving.Engine(hparams, HYBRID, max_batch=3, num_slots=6, cache_len=5, track_interval=4,
                            policy="natural", speculate=speculate,
                            drafter=serving.SelfDrafter() if speculate else None)
    engine.warm_up()
    workload = demo.Workload(rng, HYBRID.vocab_size, 4, 5)
    demo.serve(engine, workload, 10)
    requests = [r for r in workload.issued if r.generated]
    assert speculate or any(r.restored for r in requests)  # a prefix snapshot was restored
    ref_tokens, ref_logits = serving.reference_decode(hparams, HYBRID, requests)
    for request, tokens, logits in zip(requests, ref_tokens, ref_logits):
        assert request.generated == tokens
        np.testing.assert_allclose(np.stack(request.logits), logits, atol=LOGIT_ATOL, rtol=0)


def test_demo_with_layers_agrees_with_plain_decode(capsys):
    code = demo.main(["--batch", "2", "--steps", "8", "--cache-len", "3", "--track-interval", "4",
                      "--layers", "gdn,mamba2,gdn"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "3-layer hybrid decoder (gdn, mamba2, gdn" in out
    assert "greedy tokens equal to plain decode alone: all" in out


def test_demo_rejects_unknown_layer_kinds(capsys):
    with pytest.raises(SystemExit):
        demo.main(["--layers", "gdn,attention"])
    assert "layer kinds must be among" in capsys.readouterr().err
