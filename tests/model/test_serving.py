"""Continuous batching: each request as if alone, prefix restore, slot reuse, the demo."""

from __future__ import annotations

import numpy as np

from replayssm_jax.model import demo, serving
from replayssm_jax.model.serving import Engine, Request

from .conftest import LOGIT_ATOL, TINY, run_plain

INTERVAL = 4


def _engine(params):
    # NATURAL: the engine replays its caches (the default policy folds every step at batch 2)
    return Engine(
        params, TINY, max_batch=2, num_slots=3, cache_len=3,
        track_interval=INTERVAL, policy="natural",
    )


def _serve(engine, requests, join_at):
    """Admit request i at step join_at[i] (or when a row frees up), run until all are done."""
    pending, step = list(zip(join_at, requests)), 0
    while pending or engine.active:
        while pending and pending[0][0] <= step and engine.has_free_row():
            engine.admit(pending.pop(0)[1])
        if engine.active:
            engine.step()
        step += 1


def _assert_alone(params, requests):
    for request in requests:
        tokens, logits = run_plain(params, [request.prompt], request.max_new_tokens)
        assert request.generated == tokens[0], request.rid
        np.testing.assert_allclose(np.stack(request.logits), logits[0], atol=LOGIT_ATOL, rtol=0)


def test_continuous_batching_matches_each_request_alone(params, rng):
    """Joins, leaves, slot reuse and a prefix restore; every request equals its solo run."""
    engine = _engine(params)
    prompt = lambda n: rng.integers(0, TINY.vocab_size, n).tolist()
    requests = [
        Request(0, prompt(6), max_new_tokens=11),
        Request(1, prompt(2), max_new_tokens=4),
        Request(2, prompt(9), max_new_tokens=5),
        Request(3, prompt(3), max_new_tokens=10),
    ]
    _serve(engine, requests, join_at=[0, 0, 1, 3])
    # A follow-up of request 0: its whole sequence so far plus new tokens.
    follow = Request(4, requests[0].sequence[:13] + prompt(2), max_new_tokens=4, parent=0)
    _serve(engine, [follow], join_at=[0])
    assert follow.restored == 12  # track positions 4, 8 (prompt) and 12 (a forced flush)
    assert len({r.slot for r in requests + [follow]}) < len(requests) + 1  # slots reused
    assert sum(r.forced_flushes for r in requests) > 0
    _assert_alone(params, requests + [follow])


def test_prefix_restore_equals_rerunning_the_prefix(params, rng):
    base = rng.integers(0, TINY.vocab_size, 10).tolist()
    tail = rng.integers(0, TINY.vocab_size, 3).tolist()
    warm = _engine(params)
    _serve(warm, [Request(0, base, max_new_tokens=2)], join_at=[0])
    restored = Request(1, base[:8] + tail, max_new_tokens=3 * 3 + 1)
    _serve(warm, [restored], join_at=[0])
    rerun = Request(1, base[:8] + tail, max_new_tokens=3 * 3 + 1)
    _serve(_engine(params), [rerun], join_at=[0])
    assert restored.restored == 8 and rerun.restored == 0
    assert restored.generated == rerun.generated
    np.testing.assert_allclose(np.stack(restored.logits), np.stack(rerun.logits), atol=LOGIT_ATOL, rtol=0)


def test_slot_reuse_leaks_nothing(params, rng):
    """A request in a reused slot (stale cache and conv of the last occupant) == a fresh slot."""
    prompt = rng.integers(0, TINY.vocab_size, 5).tolist()
    reused = _engine(params)
    first = Request(0, rng.integers(0, TINY.vocab_size, 7).tolist(), max_new_tokens=6)
    second = Request(1, prompt, max_new_tokens=8)
    _serve(reused, [first], join_at=[0])
    _serve(reused, [second], join_at=[0])
    assert first.slot == second.slot
    fresh = Request(1, prompt, max_new_tokens=8)
    _serve(_engine(params), [fresh], join_at=[0])
    assert second.generated == fresh.generated
    np.testing.assert_array_equal(np.stack(second.logits), np.stack(fresh.logits))


def test_demo_runs_and_agrees(capsys):
    code = demo.main(["--batch", "2", "--steps", "12", "--cache-len", "2", "--track-interval", "4"])
    out = capsys.readouterr()
    assert code == 0, out.out
    assert "greedy tokens equal to plain decode alone: all" in out.out
    assert "serving" not in out.err  # no progress bar when stderr is not a terminal
    assert "reference: each request decoded alone" in out.out
    assert serving.step_traces() >= 1


def test_demo_shows_progress_on_a_terminal(capsys, monkeypatch):
    import sys

    monkeypatch.setattr(sys.stderr, "isatty", lambda: True, raising=False)
    assert demo.main(["--batch", "2", "--steps", "3", "--cache-len", "2"]) == 0
    assert "serving" in capsys.readouterr().err
