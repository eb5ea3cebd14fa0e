"""Stateful property tests (issue 24, point 4): random schedules of decode steps and slot
operations against an independent float64 NumPy model of the delta-rule recurrence.

A hypothesis `RuleBasedStateMachine` drives one single-layer `ModelState`: decode steps on
random row subsets with random slot maps, padding rows (negative and >= N slots), forced
flushes and a per-step flush policy; `reset_slots`, `flush_slots`, `copy_slots` and
snapshot-and-restore. The NumPy model holds each slot's live state S in float64 and its
cursor, and knows nothing of checkpoints, caches or replay. After every operation every
slot's live state (`materialize_state`), every cursor and every output are compared with it.

CI runs a few schedules per (gate, backend); `RS_PROPERTY_EXAMPLES=N` runs N per machine
(the cache length and GQA ratio are drawn per schedule), e.g. for a long soak; with
`RS_PROPERTY_STATS=path` each finished schedule appends a line with its operation counts.
"""

from __future__ import annotations

import collections
import functools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from replayssm_jax import ReplayConfig, Tokens, decode_step, materialize_state
from replayssm_jax.model import copy_slots, flush_slots, init_model_state, layer_state, reset_slots, snapshot
from replayssm_jax.model.state import flat_view, from_flat_view

N, B, PAIRS = 5, 4, 2  # slots, rows per step, entries per slot op (fixed: one compile each)
HK, DK, DV = 1, 16, 16  # the pallas_triton backend needs powers of two >= 16
EXAMPLES = int(os.environ.get("RS_PROPERTY_EXAMPLES", "4"))
STEPS = 10 if "RS_PROPERTY_EXAMPLES" not in os.environ else 25
# fp32 against float64: each step rounds at ~1e-7 relative, the replay sums <= L terms and
# a schedule runs <= 25 steps with |k| = |q| = 1 (L2 norm), beta < 1 and states O(1), so the
# fp32 error stays below ~1e-5; a dropped, stale or misplaced entry or a leaked slot is
# O(1e-1). 1e-4 absolute keeps a 10x margin.
ATOL = 1e-4
OPERATIONS = ("step_natural", "step_every_step", "step_natural", "reset", "step_natural", "flush",
              "step_every_step", "copy", "step_natural", "snapshot_and_restore")

_step = functools.lru_cache(None)(
    lambda backend, policy: jax.jit(functools.partial(
        decode_step, backend=backend, policy=policy, use_qk_l2norm=True)))
_materialize = jax.jit(materialize_state)
_reset, _flush, _copy, _snapshot = map(jax.jit, (reset_slots, flush_slots, copy_slots, snapshot))


def l2norm64(x):
    return x / np.sqrt(np.sum(x * x, axis=-1, keepdims=True) + 1e-6)


class NumpyModel:
    """Each slot's live state `S [N, H_v, d_v, d_k]` in float64 and its cursor; the step
    is the gated delta rule written from the method, not from the package."""

    def __init__(self, config: ReplayConfig):
        self.config = config
        self.S = np.zeros((N, config.num_v_heads, DV, DK))
        self.cursor = np.zeros(N, np.int64)

    def step(self, tokens, slots, force, every_step: bool) -> np.ndarray:
        cfg = self.config
        group = cfg.num_v_heads // cfg.num_k_heads
        q = l2norm64(np.asarray(tokens.q, np.float64)) * DK ** -0.5
        k = l2norm64(np.asarray(tokens.k, np.float64))
        v, g, beta = (np.asarray(x, np.float64) for x in (tokens.v, tokens.g, tokens.beta))
        y = np.zeros((B, cfg.num_v_heads, DV))
        for row, slot in enumerate(slots):
            if not 0 <= slot < N:
                continue
            for h in range(cfg.num_v_heads):
                kh, qh = k[row, h // group], q[row, h // group]
                decayed = self.S[slot, h] * np.exp(g[row, h])  # per head scalar or per column
                u = beta[row, h] * (v[row, h] - decayed @ kh)
                y[row, h] = decayed @ qh + u * (kh @ qh)
                self.S[slot, h] = decayed + np.outer(u, kh)
            full = self.cursor[slot] >= cfg.cache_len - 1
            self.cursor[slot] = 0 if (every_step or force[row] or full) else self.cursor[slot] + 1
        return y


def draw_slots(data):
    """A row -> slot map: distinct live slots, padding as -1 or an out-of-range slot."""
    perm = data.draw(st.permutations(range(N)))
    kinds = data.draw(st.lists(st.sampled_from(["live", "live", "pad", "over"]), min_size=B, max_size=B))
    return [perm[i] if kind == "live" else (-1 if kind == "pad" else N + i) for i, kind in enumerate(kinds)]


class ReplayMachine(RuleBasedStateMachine):
    gate: str
    backend: str

    @initialize(cache_len=st.integers(1, 4), group=st.sampled_from([1, 2]), seed=st.integers(0, 2**31 - 1))
    def setup(self, cache_len, group, seed):
        self.config = ReplayConfig(HK, HK * group, DK, DV, cache_len, gate=self.gate)
        self.state = init_model_state(self.config, 1, N, 2)
        self.model = NumpyModel(self.config)
        self.rng = np.random.default_rng(seed)
        self.counts = collections.Counter(cache_len=cache_len, group=group)

    def teardown(self):
        path = os.environ.get("RS_PROPERTY_STATS")
        if path and hasattr(self, "counts"):
            with open(path, "a") as f:
                f.write(json.dumps({"gate": self.gate, "backend": self.backend, **self.counts}) + "\n")

    def tokens(self) -> Tokens:
        cfg, rng = self.config, self.rng
        g_tail = (cfg.num_v_heads, DK) if cfg.per_channel_gate else (cfg.num_v_heads,)
        normal = lambda *s: jnp.asarray(rng.normal(size=(B, *s)), jnp.float32)
        g = -np.logaddexp(0.0, rng.normal(-1.5, 1.0, (B, *g_tail)))
        return Tokens(q=normal(HK, DK), k=normal(HK, DK), v=normal(cfg.num_v_heads, DV),
                      g=jnp.asarray(g, jnp.float32),
                      beta=jnp.asarray(rng.uniform(0.05, 0.95, (B, cfg.num_v_heads)), jnp.float32))

    @rule(data=st.data(), op=st.sampled_from(OPERATIONS))
    def operate(self, data, op):
        """One operation; steps are drawn more often than slot ops (a rule per op would
        make them equally likely and leave short schedules with few steps)."""
        if op == "snapshot_and_restore" and not (self.model.cursor == 0).any():
            op = "flush"
        if op.startswith("step_"):
            self.step(data, op[len("step_"):])
        else:
            getattr(self, op)(data)

    def step(self, data, policy):
        slots = draw_slots(data)
        force = data.draw(st.lists(st.booleans(), min_size=B, max_size=B))
        tokens = self.tokens()
        view, conv = flat_view(self.state)
        y, view = _step(self.backend, policy)(view, tokens, jnp.asarray(slots, jnp.int32), jnp.asarray(force))
        self.state = from_flat_view(self.state, view, conv, view.write_pos)
        self.counts[f"step_{policy}"] += 1
        want = self.model.step(tokens, slots, force, policy == "every_step")
        pad = [not 0 <= s < N for s in slots]
        np.testing.assert_array_equal(np.asarray(y)[pad], 0.0)
        np.testing.assert_allclose(np.asarray(y, np.float64), want, atol=ATOL, err_msg=f"y, slots {slots}")

    def pairs(self, data):
        """PAIRS slot entries, distinct live ones, padding as -1."""
        return [s if data.draw(st.booleans()) else -1 for s in data.draw(st.permutations(range(N)))[:PAIRS]]

    def reset(self, data):
        slots = self.pairs(data)
        self.state = _reset(self.state, jnp.asarray(slots, jnp.int32))
        self.counts["reset"] += 1
        for s in slots:
            if s >= 0:
                self.model.S[s], self.model.cursor[s] = 0.0, 0

    def flush(self, data):
        slots = self.pairs(data)
        self.state = _flush(self.state, jnp.asarray(slots, jnp.int32))
        self.counts["flush"] += 1
        for s in slots:
            if s >= 0:
                self.model.cursor[s] = 0

    def copy(self, data):
        dst = self.pairs(data)
        src = [data.draw(st.integers(0, N - 1)) if d >= 0 else -1 for d in dst]
        self.state = _copy(self.state, jnp.asarray(src, jnp.int32), jnp.asarray(dst, jnp.int32))
        self.counts["copy"] += 1
        live = self.model.S.copy()  # every source is read before any destination is written
        for s, d in zip(src, dst):
            if d >= 0:
                self.model.S[d], self.model.cursor[d] = live[s], 0

    def snapshot_and_restore(self, data):
        flushed = np.flatnonzero(self.model.cursor == 0)
        src = [int(data.draw(st.sampled_from(flushed))) for _ in range(PAIRS)]
        dst = self.pairs(data)
        snap = _snapshot(self.state, jnp.asarray(src, jnp.int32))
        self.state = _reset(self.state, jnp.asarray(dst, jnp.int32), snap.checkpoint, snap.conv_state)
        self.counts["snapshot_restore"] += 1
        live = self.model.S.copy()
        for s, d in zip(src, dst):
            if d >= 0:
                self.model.S[d], self.model.cursor[d] = live[s], 0

    @invariant()
    def every_slot_matches_the_model(self):
        if not hasattr(self, "model"):
            return
        np.testing.assert_array_equal(np.asarray(self.state.write_pos), self.model.cursor)
        live = _materialize(layer_state(self.state, 0), jnp.arange(N, dtype=jnp.int32))
        np.testing.assert_allclose(np.asarray(live, np.float64), self.model.S, atol=ATOL)


@pytest.mark.parametrize("backend", ["xla", "pallas_triton"])
@pytest.mark.parametrize("gate", ["gdn", "kda"])
def test_schedules_match_the_float64_model(gate, backend):
    machine = type(f"Machine_{gate}_{backend}", (ReplayMachine,), {"gate": gate, "backend": backend})
    machine.TestCase.settings = settings(
        max_examples=EXAMPLES, stateful_step_count=STEPS, deadline=None, derandomize="RS_PROPERTY_EXAMPLES" not in os.environ,
        suppress_health_check=list(HealthCheck), database=None,
    )
    machine.TestCase().runTest()
