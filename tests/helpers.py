"""Test helpers: random inputs, batch schedules, and a step-loop driver that checks
`decode_step` against `recurrent_reference` at every step.

Vocabulary: a *sequence* is one request decoding token by token; it lives in one physical
slot for the whole run. At every step a sequence that has joined occupies some *row* of the
batch (the row may change from step to step); the other rows are padding (slot -1).
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import common
from pallas_kernels.replay_decode import ReplayTileParams
from replayssm_jax import (
    FlushPolicy,
    ReplayConfig,
    ReplayState,
    Tokens,
    decode_step,
    default_flush_policy,
    init_state,
    materialize_state,
    recurrent_reference,
)
from replayssm_jax.backends import pallas_triton
from replayssm_jax.plan import as_policy

STATE_FIELDS = ("checkpoint", "u_cache", "k_cache", "g_cache", "write_pos")


def exposed_kernel_params() -> list:
    """Every launch parameter set the pallas_triton backend's layer step reaches for the
    delta-rule gates: each of their decode rows of its launch table (Mamba-2's rows:
    tests/test_mamba2.py; verify rows: tests/test_verify_kernel.py), each replay row under
    every rebuild precision (`common.with_rebuild_precision`, which raises its dot sizes where
    the tensor cores need it), and the per-tile replay kernel's defaults."""
    rows = [row for row in pallas_triton.LAUNCH_TABLE if row.gate != "mamba2" and row.step != "verify"]
    out = {row.params for row in rows} | {ReplayTileParams()}
    for row in rows:
        if row.step == "replay" and hasattr(row.params, "rebuild_precision"):
            out |= {common.with_rebuild_precision(row.params, p) for p in common.PRECISIONS}
    return sorted(out, key=repr)


def small_config(gate: str, cache_len: int, dtype: jnp.dtype = jnp.float32) -> ReplayConfig:
    """GQA (H_v = 2 H_k) with d_k != d_v so a transposed state cannot pass; tiny on purpose."""
    return ReplayConfig(
        num_k_heads=2, num_v_heads=4, head_k_dim=32, head_v_dim=16, cache_len=cache_len,
        gate=gate, state_dtype=dtype, cache_dtype=dtype,
    )


def softplus(x: np.ndarray) -> np.ndarray:
    """float64 `log(1 + exp(x))` (no threshold)."""
    return np.logaddexp(0.0, np.asarray(x, np.float64))


def random_log_decay(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    """Realistic log-decays: g = -softplus(N(-1.5, 1)), so alpha = exp(g) is mostly 0.6-0.95."""
    return (-softplus(rng.normal(-1.5, 1.0, shape))).astype(np.float32)


# The tests hold inputs as `replayssm_jax.Tokens` with float32 numpy leaves (any leading
# axes: `[B]` for one step, `[S, T]` for runs); these act on every field at once.


def astuple(tokens: Tokens) -> tuple:
    """`(q, k, v, g, beta)`."""
    return (tokens.q, tokens.k, tokens.v, tokens.g, tokens.beta)


def take(tokens: Tokens, index) -> Tokens:
    """The same (numpy) index applied to every field."""
    return jax.tree.map(lambda x: x[index], tokens)


def to_device(tokens: Tokens) -> Tokens:
    """Every field as a jax array."""
    return jax.tree.map(jnp.asarray, tokens)


def random_tokens(
    rng: np.random.Generator, config: ReplayConfig, lead: tuple[int, ...], v_scale: float = 1.0
) -> Tokens:
    """Random inputs with leading shape `lead` (e.g. `(B,)` for one step, `(S, T)` for runs)."""
    hk, hv, dk, dv = config.num_k_heads, config.num_v_heads, config.head_k_dim, config.head_v_dim
    g_tail = (hv, dk) if config.per_channel_gate else (hv,)
    normal = lambda *shape: rng.normal(size=(*lead, *shape)).astype(np.float32)
    return Tokens(
        q=normal(hk, dk),
        k=normal(hk, dk),
        v=(v_scale * normal(hv, dv)).astype(np.float32),
        g=random_log_decay(rng, (*lead, *g_tail)),
        beta=rng.uniform(0.05, 0.95, (*lead, hv)).astype(np.float32),
    )


def random_checkpoint(rng: np.random.Generator, config: ReplayConfig, num_slots: int) -> np.ndarray:
    """A nonzero initial checkpoint `[N, H_v, d_v, d_k]` in the state dtype, of the size the
    delta rule keeps a state at (entries ~ 0.3), so the decay of S_c is exercised."""
    shape = (num_slots, config.num_v_heads, config.head_v_dim, config.head_k_dim)
    return (0.3 * rng.normal(size=shape)).astype(config.state_dtype)


@dataclasses.dataclass(frozen=True)
class Schedule:
    """Which sequence sits in which row at every step.

    Attributes:
      seq_slots: `[S]` physical slot of each sequence (distinct, from a pool of N > B).
      rows: `[T, B]` sequence index held by each row, -1 for a padding row.
      force: `[T, B]` force_flush flags passed to the step (also set on padding rows, where
        they must be ignored).
      num_slots: N.
    """

    seq_slots: np.ndarray
    rows: np.ndarray
    force: np.ndarray
    num_slots: int

    @property
    def steps(self) -> int:
        return self.rows.shape[0]


def make_schedule(
    rng: np.random.Generator,
    *,
    num_seqs: int,
    batch: int,
    num_slots: int,
    steps: int,
    max_join: int,
    force_prob: float,
) -> Schedule:
    """Sequences on random slots, joining at random steps in `[0, max_join]` (sequence 0 at
    step 0), placed on freshly shuffled rows every step. Sequence 0 is never forced, so it
    runs full natural windows; the others are forced with probability `force_prob`."""
    if num_seqs > batch or num_slots <= batch:
        raise ValueError(f"need num_seqs <= batch < num_slots, got {num_seqs}, {batch}, {num_slots}")
    seq_slots = rng.choice(num_slots, size=num_seqs, replace=False)
    join = rng.integers(0, max_join + 1, size=num_seqs)
    join[0] = 0
    rows = np.full((steps, batch), -1)
    for t in range(steps):
        present = np.flatnonzero(join <= t)
        rows[t, rng.permutation(batch)[: present.size]] = present
    force = (rng.random((steps, batch)) < force_prob) & (rows != 0)
    return Schedule(seq_slots=seq_slots, rows=rows, force=force, num_slots=num_slots)


@functools.cache
def donated_step(backend: str, **kwargs) -> Callable:
    """`decode_step` jitted with the state (argument 0) donated; one jit object per
    (backend, options), so tests with equal shapes share executables."""
    return jax.jit(functools.partial(decode_step, backend=backend, **kwargs), donate_argnums=0)


reference = jax.jit(
    recurrent_reference, static_argnames=("use_qk_l2norm", "scale", "return_all_states")
)
materialize = jax.jit(materialize_state)


def snapshot(state: ReplayState) -> dict[str, np.ndarray]:
    """Host copies of every array field (copies: the device buffers are donated next)."""
    return {name: np.array(getattr(state, name), copy=True) for name in STATE_FIELDS}


def bits(x: np.ndarray) -> np.ndarray:
    """The raw bytes of `x`, for bit-for-bit comparison of any dtype."""
    return np.ascontiguousarray(x).view(np.uint8)


def rel_err(got: np.ndarray, want: np.ndarray) -> np.ndarray:
    """Normwise relative error `||got - want|| / ||want||` per leading index."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    axes = tuple(range(1, want.ndim))
    return np.sqrt(np.sum((got - want) ** 2, axis=axes) / np.sum(want**2, axis=axes))


@dataclasses.dataclass
class RunReport:
    """Worst errors seen over a run, and how many flushes of each kind happened."""

    y_err: float = 0.0
    state_err: float = 0.0
    checkpoint_err: float = 0.0
    natural_flushes: int = 0
    forced_flushes: int = 0
    tokens: int = 0
    flush_every_step: bool = False  # the run's policy was EVERY_STEP: every live row flushed


def _row_inputs(
    rng: np.random.Generator, config: ReplayConfig, tokens: Tokens, rows: np.ndarray, done: np.ndarray
) -> Tokens:
    """This step's `[B, ...]` inputs: each sequence's next token; padding rows get large
    garbage that must not leak anywhere."""
    garbage = random_tokens(rng, config, (rows.size,), v_scale=50.0)
    active = rows >= 0
    seqs = np.where(active, rows, 0)
    picked = take(tokens, (seqs, done[seqs]))
    pick = lambda a, b: np.where(active.reshape(-1, *([1] * (a.ndim - 1))), a, b)
    return jax.tree.map(pick, picked, garbage)


def _check_writes(
    before: dict[str, np.ndarray],
    after: dict[str, np.ndarray],
    touched: np.ndarray,
    appended: np.ndarray,
    pos: np.ndarray,
) -> None:
    """Slots no row named are identical bit for bit; appending (non-flush) rows keep their
    checkpoint and their valid cache entries (positions < pos) bit for bit."""
    untouched = np.setdiff1d(np.arange(before["write_pos"].size), touched)
    for name in STATE_FIELDS:
        np.testing.assert_array_equal(
            bits(after[name][untouched]), bits(before[name][untouched]),
            err_msg=f"{name} changed on slots {untouched.tolist()} that no row named",
        )
    np.testing.assert_array_equal(
        bits(after["checkpoint"][appended]), bits(before["checkpoint"][appended]),
        err_msg=f"checkpoint written on non-flushing slots {appended.tolist()}",
    )
    for slot, p in zip(appended, pos):
        for name in ("u_cache", "k_cache", "g_cache"):
            np.testing.assert_array_equal(
                bits(after[name][slot][:, :p]), bits(before[name][slot][:, :p]),
                err_msg=f"{name} valid entries (< {p}) of slot {slot} changed",
            )


def run_schedule(
    config: ReplayConfig,
    schedule: Schedule,
    tokens: Tokens,
    checkpoint0: np.ndarray,
    rng: np.random.Generator,
    *,
    backend: str,
    policy: FlushPolicy | str | None = None,
    use_qk_l2norm: bool = True,
    scale: float | None = None,
    kernel_params=None,
) -> RunReport:
    """Drive `decode_step` (jitted, state donated) through `schedule`, checking every step.

    `policy` goes to `decode_step` as given; None there means
    `default_flush_policy(config, B)`, which the host model below uses then.

    Exact invariants are asserted here: padding rows output exactly 0; `write_pos` follows
    the host model (flush when the cursor is L-1 or forced, or at every step under the
    EVERY_STEP policy, then 0, else +1); slots no row names are unchanged bit for bit;
    non-flushing rows keep their checkpoint and valid cache entries. Errors against
    `recurrent_reference` (run per sequence on `tokens [S, T, ...]` from
    `checkpoint0[seq_slots]`) are returned for the caller to bound: each active row's
    output, each flushed checkpoint against the state right after that token, and
    `materialize_state` of every sequence against its reference state after every step.
    """
    ref_y, _, ref_states = reference(
        to_device(tokens), jnp.asarray(checkpoint0[schedule.seq_slots]),
        use_qk_l2norm=use_qk_l2norm, scale=scale, return_all_states=True,
    )
    ref_y, ref_states = np.asarray(ref_y), np.asarray(ref_states)
    init = checkpoint0[schedule.seq_slots].astype(np.float32)
    step = donated_step(backend, policy=policy, use_qk_l2norm=use_qk_l2norm, scale=scale,
                        kernel_params=kernel_params)
    state = init_state(config, schedule.num_slots, jnp.asarray(checkpoint0))
    num_seqs, length = schedule.seq_slots.size, config.cache_len
    done = np.zeros(num_seqs, int)
    write_pos = np.zeros(schedule.num_slots, int)
    host_policy = default_flush_policy(config, schedule.rows.shape[1]) if policy is None else as_policy(policy)
    report = RunReport(flush_every_step=host_policy is FlushPolicy.EVERY_STEP)
    for t in range(schedule.steps):
        rows, force = schedule.rows[t], schedule.force[t]
        active = rows >= 0
        seqs = rows[active]
        slots = np.where(active, schedule.seq_slots[np.maximum(rows, 0)], -1)
        inputs = _row_inputs(rng, config, tokens, rows, done)
        pos = write_pos[slots[active]]
        natural = pos == length - 1
        flush = natural | force[active] | report.flush_every_step
        before = snapshot(state)
        y, state = step(state, to_device(inputs), jnp.asarray(slots, jnp.int32), jnp.asarray(force))
        after, y = snapshot(state), np.asarray(y, np.float32)

        assert np.all(y[~active] == 0), f"step {t}: padding rows output {y[~active]}"
        write_pos[slots[active]] = np.where(flush, 0, pos + 1)
        np.testing.assert_array_equal(after["write_pos"], write_pos, err_msg=f"step {t}: write_pos")
        _check_writes(before, after, slots[active], slots[active][~flush], pos[~flush])

        n = done[seqs]
        report.y_err = max(report.y_err, rel_err(y[active], ref_y[seqs, n]).max())
        if flush.any():
            ckpt = after["checkpoint"][slots[active][flush]]
            err = rel_err(ckpt, ref_states[seqs[flush], n[flush]]).max()
            report.checkpoint_err = max(report.checkpoint_err, err)
        done[seqs] += 1
        live = np.asarray(materialize(state, jnp.asarray(schedule.seq_slots, jnp.int32)))
        ref_live = np.where(
            (done > 0)[:, None, None, None],
            ref_states[np.arange(num_seqs), np.maximum(done - 1, 0)], init,
        )
        report.state_err = max(report.state_err, rel_err(live, ref_live).max())
        report.natural_flushes += int(natural.sum())
        report.forced_flushes += int((flush & ~natural).sum())
        report.tokens += int(active.sum())
    return report


def aliased_parameters(hlo_text: str) -> set[int]:
    """Parameter numbers named in the HLO module's input_output_alias map."""
    header = next(line for line in hlo_text.splitlines() if line.startswith("HloModule"))
    entries = re.findall(r"\{\d+\}: \((\d+), \{\}, (?:may|must)-alias\)", header)
    return {int(p) for p in entries}


def state_sized_copies(hlo_text: str, state) -> list[str]:
    """HLO `copy` instructions whose result has the shape of a state field (a pool copy)."""
    shapes = {tuple(leaf.shape) for leaf in jax.tree.leaves(state)}
    found = []
    for line in hlo_text.splitlines():
        match = re.search(r"= \w+\[([\d,]*)\]\S* copy\(", line)
        if match and tuple(int(d) for d in match.group(1).split(",") if d) in shapes:
            found.append(line.strip())
    return found
