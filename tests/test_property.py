"""Stateful property tests (issue 24, point 4): random schedules of decode steps, speculative
verify + accept and slot operations against an independent float64 NumPy model of the
recurrence (the gated delta rule for GDN / KDA, the selective-state update for Mamba-2).

A hypothesis `RuleBasedStateMachine` drives one single-layer `ModelState`: decode steps on
random row subsets with random slot maps, padding rows (negative and >= N slots, their
inputs non-finite at times), forced flushes and a per-step flush policy; `verify_step` on a
window of T tokens (T drawn per schedule in 1..L; verify_step refuses L = 1, where the op
decodes instead) with ragged per-row lengths (positions past them non-finite at times), a
chain or a random tree, then `accept` of a random count per row (0..length; for a tree, a
root-down prefix of one branch); `reset_slots`, `flush_slots`, `copy_slots` and
snapshot-and-restore (each, with padding entries, as the gate supports it).
The NumPy model holds each slot's live state S in float64 and its cursor, and knows nothing
of checkpoints, caches or replay: a window's position i is the token step applied to its
parent's state, and accept keeps the state after the last accepted token. After every
operation every slot's live state (`materialize_state`), every cursor and every output are
compared with it; after a verify (before its accept) too: the window must not move any slot's
live state.

Machines: GDN and KDA on the xla and pallas_triton backends (decode and verify on the same
backend, Pallas in interpret mode off GPU); Mamba-2 (G in {1, 2}) decoding on either backend
and verifying on xla (its only verify backend). Each schedule draws its cache length L in
1..4 and GQA ratio in {1, 2} (Mamba-2: heads per group). CI runs a few schedules per machine;
`RS_PROPERTY_EXAMPLES=N` runs N per machine (randomized, longer schedules), e.g. for a long
soak; with `RS_PROPERTY_STATS=path` each finished schedule appends a line with its
operation counts.
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

from replayssm_jax import (
    Mamba2Params,
    Mamba2Tokens,
    ReplayConfig,
    Tokens,
    accept,
    decode_step,
    materialize_state,
    verify_step,
)
from replayssm_jax.model import copy_slots, flush_slots, init_model_state, layer_state, reset_slots, snapshot
from replayssm_jax.model.state import flat_view, from_flat_view

N, B, PAIRS = 5, 4, 2  # slots, rows per step, entries per slot op (fixed: one compile each)
HK, DK, DV = 1, 16, 16  # the pallas_triton backend needs powers of two >= 16
M2_HEAD_DIM, M2_STATE = 16, 32  # Mamba-2 P, N: P != N, so a transposed state cannot pass
SOAK = "RS_PROPERTY_EXAMPLES" in os.environ
EXAMPLES = int(os.environ.get("RS_PROPERTY_EXAMPLES", "4"))
STEPS = 30 if SOAK else 14
# fp32 against float64 (delta rule): each step rounds at ~1e-7 relative, the replay sums
# <= L terms, a window's solve <= T <= 4, and a schedule runs <= 30 operations with
# |k| = |q| = 1 (L2 norm), beta < 1 and states O(1), so the fp32 error stays below ~1e-5; a
# dropped, stale or misplaced entry, a rejected token kept or a leaked slot is O(1e-1).
# 1e-4 absolute keeps a 10x margin (measured worst over 45 randomized schedules: 5e-7).
ATOL = 1e-4
# Mamba-2, relative to the largest magnitude compared (states reach O(1 / |A|) ~ 2, outputs
# sum N = 32 terms of them): fp32 sums of <= N + L + T terms at ~6e-8 each stay below ~3e-6;
# the smallest wrong contribution, one entry dt x B^T with dt >= ~2e-3 (softplus of the
# drawn raw dt + bias) against outputs O(10), is ~1e-3 relative. 2e-5 sits between
# (measured worst over 30 randomized schedules: 4e-7).
MAMBA2_RTOL = 2e-5
# Steps are drawn more often than slot ops; every "verify" is a verify and its accept. The
# first entry is the simplest draw: a CI run's first schedule (all draws simplest) verifies
# full windows on every row and accepts them all at L = T = 4, folding every row from the
# second window on.
OPERATIONS = ("verify", "step_natural", "step_every_step", "step_natural", "reset", "step_natural", "flush",
              "verify", "step_every_step", "copy", "step_natural", "snapshot_and_restore", "verify")

_step = functools.lru_cache(None)(
    lambda backend, policy, l2norm: jax.jit(functools.partial(
        decode_step, backend=backend, policy=policy, use_qk_l2norm=l2norm)))
_verify = functools.lru_cache(None)(
    lambda backend, l2norm: jax.jit(functools.partial(verify_step, backend=backend, use_qk_l2norm=l2norm)))
_accept, _materialize = jax.jit(accept), jax.jit(materialize_state)
_reset, _flush, _copy, _snapshot = map(jax.jit, (reset_slots, flush_slots, copy_slots, snapshot))


def l2norm64(x):
    return x / np.sqrt(np.sum(x * x, axis=-1, keepdims=True) + 1e-6)


def row(x: dict, index) -> dict:
    """One row's (or window position's) float64 inputs."""
    return {name: None if a is None else a[index] for name, a in x.items()}


class DeltaRule:
    """GDN / KDA in float64: the gated delta rule written from the method, not from the package.

    `prepare` turns `Tokens` with any leading axes into float64 per value head (q, k normed
    and expanded, q scaled, the decay per key channel); `advance` is one token on one state
    `[H_v, d_v, d_k]`."""

    l2norm = True

    def __init__(self, config: ReplayConfig):
        self.config = config
        self.gate_params = None  # g and beta are given gated

    @property
    def state_shape(self) -> tuple[int, ...]:
        return (self.config.num_v_heads, DV, DK)

    def tokens(self, rng: np.random.Generator, lead: tuple[int, ...]) -> Tokens:
        cfg = self.config
        g_tail = (cfg.num_v_heads, DK) if cfg.per_channel_gate else (cfg.num_v_heads,)
        normal = lambda *s: rng.normal(size=(*lead, *s)).astype(np.float32)
        g = -np.logaddexp(0.0, rng.normal(-1.5, 1.0, (*lead, *g_tail)))
        return Tokens(q=normal(HK, DK), k=normal(HK, DK), v=normal(cfg.num_v_heads, DV), g=g.astype(np.float32),
                      beta=rng.uniform(0.05, 0.95, (*lead, cfg.num_v_heads)).astype(np.float32))

    def prepare(self, tokens: Tokens) -> dict:
        group = self.config.group_size
        f64 = lambda a: np.asarray(a, np.float64)
        g = f64(tokens.g)
        return dict(q=np.repeat(l2norm64(f64(tokens.q)), group, axis=-2) * DK ** -0.5,
                    k=np.repeat(l2norm64(f64(tokens.k)), group, axis=-2), v=f64(tokens.v),
                    alpha=np.exp(g if self.config.per_channel_gate else g[..., None]) * np.ones(DK),
                    beta=f64(tokens.beta))

    @staticmethod
    def assert_close(got, want, what: str):
        np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=0.0, atol=ATOL, err_msg=what)

    def advance(self, S, x: dict):
        """`(y [H_v, d_v], S')`: S' = a S + u k^T with u = beta (v - (a S) k), y = S' q."""
        decayed = S * x["alpha"][:, None, :]
        u = x["beta"][:, None] * (x["v"] - np.einsum("hvk,hk->hv", decayed, x["k"]))
        new = decayed + u[:, :, None] * x["k"][:, None, :]
        return np.einsum("hvk,hk->hv", new, x["q"]), new


# Mamba-2 dt options (softplus, dt_limit) and the raw dt they are fed: the default; the
# softplus clamped on both sides (the drawn dt crosses 0.01 and 0.1 often); no softplus,
# dt = raw + bias clipped to [0, 0.25] (raw dt near the bias, so a few are clipped at 0).
MAMBA2_DT = (
    dict(dt_softplus=True, dt_limit=(0.0, float("inf")), raw=(0.0, 1.5), bias=(-4.5, -2.0)),
    dict(dt_softplus=True, dt_limit=(0.01, 0.1), raw=(0.0, 1.5), bias=(-4.5, -2.0)),
    dict(dt_softplus=False, dt_limit=(0.0, 0.25), raw=(0.0, 0.1), bias=(0.02, 0.2)),
)


class Mamba2Rule:
    """Mamba-2 in float64: S' = exp(A dt) S + dt x B^T, y = S' C + D x (times silu(z)), dt =
    clip(softplus(dt_raw + dt_bias), lo, hi), head h reading group h // (H / G)."""

    l2norm = False

    def __init__(self, config: ReplayConfig, rng: np.random.Generator, dt_option: int, with_z: bool):
        self.config, self.with_z = config, with_z
        heads = config.num_v_heads
        option = MAMBA2_DT[dt_option]
        self.raw = option["raw"]
        self.gate_params = Mamba2Params(  # A in [-8, -0.5] as exp(A_log) in Mamba-2 inits
            A=jnp.asarray(-rng.uniform(0.5, 8.0, heads), jnp.float32),
            D=jnp.asarray(rng.normal(size=heads), jnp.float32),
            dt_bias=jnp.asarray(rng.uniform(*option["bias"], heads), jnp.float32),
            dt_softplus=option["dt_softplus"], dt_limit=option["dt_limit"])

    @property
    def state_shape(self) -> tuple[int, ...]:
        return (self.config.num_v_heads, M2_HEAD_DIM, M2_STATE)

    @property
    def slot_params(self) -> Mamba2Params:
        """The params as the slot ops take them for a one-layer ModelState (stacked over layers)."""
        return jax.tree.map(lambda a: a[None], self.gate_params)

    def tokens(self, rng: np.random.Generator, lead: tuple[int, ...]) -> Mamba2Tokens:
        cfg = self.config
        normal = lambda *s: rng.normal(size=(*lead, *s)).astype(np.float32)
        return Mamba2Tokens(x=normal(cfg.num_v_heads, M2_HEAD_DIM), B=normal(cfg.num_k_heads, M2_STATE),
                            C=normal(cfg.num_k_heads, M2_STATE),
                            dt=rng.normal(*self.raw, (*lead, cfg.num_v_heads)).astype(np.float32),
                            z=normal(cfg.num_v_heads, M2_HEAD_DIM) if self.with_z else None)

    def prepare(self, tokens: Mamba2Tokens) -> dict:
        p = self.gate_params
        group = self.config.group_size
        f64 = lambda a: None if a is None else np.asarray(a, np.float64)
        dt = f64(tokens.dt) + f64(p.dt_bias)
        dt = np.clip(np.logaddexp(0.0, dt) if p.dt_softplus else dt, *p.dt_limit)
        return dict(x=f64(tokens.x), B=np.repeat(f64(tokens.B), group, axis=-2),
                    C=np.repeat(f64(tokens.C), group, axis=-2), dt=dt, z=f64(tokens.z))

    @staticmethod
    def assert_close(got, want, what: str):
        """Within MAMBA2_RTOL of the largest magnitude compared."""
        atol = MAMBA2_RTOL * max(1.0, float(np.max(np.abs(want), initial=0.0)))
        np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=0.0, atol=atol, err_msg=what)

    def advance(self, S, x: dict):
        """`(y [H, P], S')` of one token on one state `[H, P, N]`."""
        A, D = (np.asarray(a, np.float64) for a in (self.gate_params.A, self.gate_params.D))
        dt = x["dt"][:, None, None]
        new = np.exp(A[:, None, None] * dt) * S + dt * x["x"][:, :, None] * x["B"][:, None, :]
        y = np.einsum("hpn,hn->hp", new, x["C"]) + D[:, None] * x["x"]
        if x["z"] is not None:
            y = y * x["z"] / (1.0 + np.exp(-x["z"]))
        return y, new


def draw_slots(data, order=None):
    """A row -> slot map: distinct live slots (in `order` when given, else shuffled), padding
    as -1 or an out-of-range slot."""
    perm = data.draw(st.permutations(range(N))) if order is None else [int(s) for s in order]
    kinds = data.draw(st.lists(st.sampled_from(["live", "live", "pad", "over"]), min_size=B, max_size=B))
    return [perm[i] if kind == "live" else (-1 if kind == "pad" else N + i) for i, kind in enumerate(kinds)]


def poisoned(tokens, keep: np.ndarray):
    """`tokens` with NaN / +-Inf wherever `keep [B] or [B, T]` is False: padding rows' and
    padding positions' inputs must reach nothing."""
    poison = np.resize(np.asarray([np.nan, np.inf, -np.inf], np.float32), keep.shape)
    mask = lambda a: np.where(keep.reshape(*keep.shape, *([1] * (a.ndim - keep.ndim))),
                              a, poison.reshape(*keep.shape, *([1] * (a.ndim - keep.ndim))))
    return jax.tree.map(mask, tokens)


def branch(parents: list[int], i: int) -> list[int]:
    """Window positions from the root down to i."""
    out = [i]
    while parents[out[-1]] >= 0:
        out.append(parents[out[-1]])
    return out[::-1]


class ReplayMachine(RuleBasedStateMachine):
    gate: str
    backend: str

    @initialize(data=st.data(), shorter=st.integers(0, 3), group=st.sampled_from([1, 2]),
                seed=st.integers(0, 2**31 - 1))
    def setup(self, data, shorter, group, seed):
        self.rng = np.random.default_rng(seed)
        # L = 4 - k, T = L - k, lengths T - k (below): the simplest schedules (the first of a
        # CI run, and the shrinks) then run the longest ring and verify full windows, which
        # fold whenever a row has history, rather than L = 1 (no verify) and empty windows.
        cache_len = 4 - shorter
        self.width = cache_len - data.draw(st.integers(0, cache_len - 1), label="L - T")
        self.counts = collections.Counter(cache_len=cache_len, group=group, T=self.width)
        if self.gate == "mamba2":
            groups = data.draw(st.sampled_from([1, 2]), label="G")
            dt_option, with_z = data.draw(st.integers(0, len(MAMBA2_DT) - 1)), data.draw(st.booleans())
            self.config = ReplayConfig.mamba2(groups * group, M2_HEAD_DIM, M2_STATE, groups, cache_len)
            self.rule = Mamba2Rule(self.config, self.rng, dt_option, with_z)
            self.slot_params = self.rule.slot_params
            self.counts.update(G=groups, dt_option=dt_option, z=int(with_z))
        else:
            self.config = ReplayConfig(HK, HK * group, DK, DV, cache_len, gate=self.gate)
            self.rule = DeltaRule(self.config)
            self.slot_params = None
        self.verify_backend = "xla" if self.gate == "mamba2" else self.backend
        self.state = init_model_state(self.config, 1, N, 2)
        self.S = np.zeros((N, *self.rule.state_shape))
        self.cursor = np.zeros(N, np.int64)

    def teardown(self):
        path = os.environ.get("RS_PROPERTY_STATS")
        if path and hasattr(self, "counts"):
            with open(path, "a") as f:
                f.write(json.dumps({"gate": self.gate, "backend": self.backend, **self.counts}) + "\n")

    @rule(data=st.data(), op=st.sampled_from(OPERATIONS))
    def operate(self, data, op):
        """One operation (a rule per op would make them equally likely and leave short
        schedules with few steps)."""
        if op == "snapshot_and_restore" and not (self.cursor == 0).any():
            op = "flush"
        if op == "verify" and self.config.cache_len == 1:  # refused there (tests/test_speculative.py)
            op = "step_natural"
        if op.startswith("step_"):
            self.step(data, op[len("step_"):])
        else:
            getattr(self, op)(data)

    def live_states(self, state) -> np.ndarray:
        """Every slot's live state `[N, ...]` from a one-layer `ReplayState`."""
        return np.asarray(_materialize(state, jnp.arange(N, dtype=jnp.int32), self.rule.gate_params))

    def step(self, data, policy):
        slots = draw_slots(data)
        force = data.draw(st.lists(st.booleans(), min_size=B, max_size=B))
        live = np.array([0 <= s < N for s in slots])
        tokens = self.rule.tokens(self.rng, (B,))
        given = poisoned(tokens, live) if data.draw(st.booleans(), label="poison padding rows") else tokens
        view, conv = flat_view(self.state)
        y, view = _step(self.backend, policy, self.rule.l2norm)(
            view, jax.tree.map(jnp.asarray, given), jnp.asarray(slots, jnp.int32), jnp.asarray(force),
            gate_params=self.rule.gate_params)
        self.state = from_flat_view(self.state, view, conv, view.write_pos)
        self.counts[f"step_{policy}"] += 1

        x = self.rule.prepare(tokens)
        want = np.zeros(y.shape)
        for r in np.flatnonzero(live):
            slot = slots[r]
            want[r], self.S[slot] = self.rule.advance(self.S[slot], row(x, r))
            full = self.cursor[slot] >= self.config.cache_len - 1
            self.cursor[slot] = 0 if (policy == "every_step" or force[r] or full) else self.cursor[slot] + 1
        np.testing.assert_array_equal(np.asarray(y)[~live], 0.0)
        self.rule.assert_close(y, want, f"y, slots {slots}")

    def verify(self, data):
        """`verify_step` on a window of T tokens (ragged lengths, padding, chain or tree), the
        window checked against the model token by token along each position's branch, then
        `accept` of a random count per row."""
        width, cache_len = self.width, self.config.cache_len
        # Half the windows go to the slots with the most history first, so that rows fold
        # (write_pos + length > L) in short schedules too.
        fullest = data.draw(st.booleans(), label="fullest slots first")
        slots = draw_slots(data, np.argsort(-self.cursor, kind="stable") if fullest else None)
        live = np.array([0 <= s < N for s in slots])
        lengths = width - np.array(data.draw(st.lists(st.integers(0, width), min_size=B, max_size=B),
                                             label="T - lengths"))
        tree = data.draw(st.booleans(), label="tree")
        parents = ([[data.draw(st.integers(-1, i - 1)) for i in range(width)] for _ in range(B)] if tree
                   else [list(range(-1, width - 1))] * B)
        window = self.rule.tokens(self.rng, (B, width))
        in_window = live[:, None] & (np.arange(width)[None, :] < lengths[:, None])
        given = poisoned(window, in_window) if data.draw(st.booleans(), label="poison padding") else window
        slots_j = jnp.asarray(slots, jnp.int32)
        view, conv = flat_view(self.state)
        y, view = _verify(self.verify_backend, self.rule.l2norm)(
            view, jax.tree.map(jnp.asarray, given), slots_j, lengths=jnp.asarray(lengths, jnp.int32),
            parents=jnp.asarray(parents, jnp.int32) if tree else None, gate_params=self.rule.gate_params)
        self.counts["verify_tree" if tree else "verify_chain"] += 1

        # Every window position against the model along its branch from the row's live state.
        x = self.rule.prepare(window)
        want = np.zeros(y.shape)
        states = {}
        for r in np.flatnonzero(live):
            for i in range(lengths[r]):
                p = parents[r][i]
                want[r, i], states[r, i] = self.rule.advance(self.S[slots[r]] if p < 0 else states[r, p],
                                                             row(x, (r, i)))
        np.testing.assert_array_equal(np.asarray(y)[~in_window], 0.0)
        self.rule.assert_close(y, want, f"verify y, slots {slots}, lengths {lengths}, parents {parents}")

        # Before accept no slot's live state has moved; a row whose window does not fit
        # behind its history folds it and its cursor is 0.
        fold = live & (self.cursor[np.where(live, slots, 0)] + lengths > cache_len)
        cursor = self.cursor.copy()
        cursor[np.asarray(slots)[fold]] = 0
        np.testing.assert_array_equal(np.asarray(view.write_pos), cursor, err_msg="cursors after verify")
        self.rule.assert_close(self.live_states(view), self.S, "live states after verify, before accept")

        # Accept a prefix of the chain, or of one root-to-node branch of the tree; padding
        # rows get any count (ignored), unused path entries any position. Drawn from the end,
        # as above: the simplest schedules accept everything, filling the ring for a fold.
        counts, path = np.zeros(B, np.int32), np.zeros((B, width), np.int32)
        for r in range(B):
            if live[r] and lengths[r]:
                end = lengths[r] - 1 - (data.draw(st.integers(0, lengths[r] - 1)) if tree else 0)
                kept = branch(parents[r], end)
                counts[r] = len(kept) - data.draw(st.integers(0, len(kept)))
                path[r] = kept + [int(p) for p in self.rng.integers(0, width, width - len(kept))]
                if counts[r]:
                    self.S[slots[r]] = states[r, kept[counts[r] - 1]]
                self.counts["accepted"] += int(counts[r])
                self.counts["rejected"] += int(lengths[r] - counts[r])
            elif not live[r]:
                counts[r], path[r] = self.rng.integers(0, width + 1), self.rng.integers(0, width, width)
        view = _accept(view, slots_j, jnp.asarray(counts), path=jnp.asarray(path) if tree else None)
        self.state = from_flat_view(self.state, view, conv, view.write_pos)
        self.cursor[np.asarray(slots)[live]] = cursor[np.asarray(slots)[live]] + counts[live]
        self.counts["accept"] += 1
        self.counts["fold_rows"] += int(fold.sum())

    def pairs(self, data):
        """PAIRS slot entries, distinct live ones, padding as -1."""
        return [s if data.draw(st.booleans()) else -1 for s in data.draw(st.permutations(range(N)))[:PAIRS]]

    def reset(self, data):
        slots = self.pairs(data)
        self.state = _reset(self.state, jnp.asarray(slots, jnp.int32))
        self.counts["reset"] += 1
        for s in slots:
            if s >= 0:
                self.S[s], self.cursor[s] = 0.0, 0

    def flush(self, data):
        slots = self.pairs(data)
        self.state = _flush(self.state, jnp.asarray(slots, jnp.int32), self.slot_params)
        self.counts["flush"] += 1
        for s in slots:
            if s >= 0:
                self.cursor[s] = 0

    def copy(self, data):
        dst = self.pairs(data)
        src = [data.draw(st.integers(0, N - 1)) if d >= 0 else -1 for d in dst]
        self.state = _copy(self.state, jnp.asarray(src, jnp.int32), jnp.asarray(dst, jnp.int32), self.slot_params)
        self.counts["copy"] += 1
        live = self.S.copy()  # every source is read before any destination is written
        for s, d in zip(src, dst):
            if d >= 0:
                self.S[d], self.cursor[d] = live[s], 0

    def snapshot_and_restore(self, data):
        flushed = np.flatnonzero(self.cursor == 0)
        src = [int(data.draw(st.sampled_from(flushed))) for _ in range(PAIRS)]
        dst = self.pairs(data)
        snap = _snapshot(self.state, jnp.asarray(src, jnp.int32))
        self.state = _reset(self.state, jnp.asarray(dst, jnp.int32), snap.checkpoint, snap.conv_state)
        self.counts["snapshot_restore"] += 1
        live = self.S.copy()
        for s, d in zip(src, dst):
            if d >= 0:
                self.S[d], self.cursor[d] = live[s], 0

    @invariant()
    def every_slot_matches_the_model(self):
        if not hasattr(self, "S"):
            return
        np.testing.assert_array_equal(np.asarray(self.state.write_pos), self.cursor)
        self.rule.assert_close(self.live_states(layer_state(self.state, 0)), self.S, "live states")


@pytest.mark.parametrize("backend", ["xla", "pallas_triton"])
@pytest.mark.parametrize("gate", ["gdn", "kda", "mamba2"])
def test_schedules_match_the_float64_model(gate, backend):
    machine = type(f"Machine_{gate}_{backend}", (ReplayMachine,), {"gate": gate, "backend": backend})
    machine.TestCase.settings = settings(
        max_examples=EXAMPLES, stateful_step_count=STEPS, deadline=None, derandomize=not SOAK,
        suppress_health_check=list(HealthCheck), database=None,
    )
    machine.TestCase().runTest()
