"""`python -m replayssm_jax check`: replay decode against the plain recurrence.

Runs a few hundred `decode_step` calls (jitted, state donated) for a batch of sequences on
shuffled slots of a pool twice the batch, with occasional forced flushes, next to
`recurrent_reference` advanced one token at a time. Prints the worst normwise relative
error of the outputs and of the live state (`materialize_state`) over all steps and rows,
and the state bytes read and written per row per step against plain decode.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import sys

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from replayssm_jax.backends import BACKENDS
from replayssm_jax.config import ReplayConfig
from replayssm_jax.decode import decode_step, materialize_state
from replayssm_jax.gates import GATES
from replayssm_jax.plan import default_flush_policy, plan_step
from replayssm_jax.reference import recurrent_reference
from replayssm_jax.state import init_state
from replayssm_jax.tokens import Tokens

# Built-in config: GQA 2:1, d_k = d_v = 64, fp32 state and caches.
NUM_K_HEADS, NUM_V_HEADS, HEAD_DIM = 4, 8, 64
FORCE_FLUSH_PROB = 0.02
# fp32 replay only reorders sums of the recurrence; agreement is ~1e-7, anything above
# 1e-5 (the test-suite bound) is a bug.
TOLERANCE = 1e-5


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m replayssm_jax check", description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--steps", type=int, default=300, help="decode steps")
    parser.add_argument("--cache-len", type=int, default=16, help="L, the replay window")
    # the delta-rule gates; Mamba-2 is checked by tests/test_mamba2.py and the benchmark
    delta_gates = tuple(name for name, kind in GATES.items() if not kind.additive)
    parser.add_argument("--gate", choices=delta_gates, default="gdn", help="gdn (per head) or kda (per channel)")
    parser.add_argument("--batch", type=int, default=8, help="rows per step; the slot pool is twice this")
    parser.add_argument("--backend", choices=BACKENDS, default="xla")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    for name in ("steps", "cache_len", "batch"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    return args


@dataclasses.dataclass(frozen=True)
class Traffic:
    """State bytes (checkpoint + caches) moved by one row in one step."""

    read: int
    written: int


def replay_traffic(config: ReplayConfig, pos: int, flush: bool) -> Traffic:
    """Checkpoint read every step plus the `pos` valid cache entries; a flush writes the
    checkpoint, any other step appends one entry. k entries count once per key head (the
    stored layout)."""
    ckpt = config.state_bytes_per_slot()
    g_entry = config.num_v_heads * (config.head_k_dim if config.per_channel_gate else 1) * 4
    entry = (
        config.num_v_heads * config.head_v_dim + config.num_k_heads * config.head_k_dim
    ) * config.cache_dtype.itemsize + g_entry
    return Traffic(read=ckpt + pos * entry, written=ckpt if flush else entry)


def plain_traffic(config: ReplayConfig) -> Traffic:
    """Plain decode reads and writes the full state every step."""
    ckpt = config.state_bytes_per_slot()
    return Traffic(read=ckpt, written=ckpt)


def normwise_rel_err(got: jax.Array, want: jax.Array) -> float:
    """Worst per-row `||got - want|| / ||want||`."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    axes = tuple(range(1, want.ndim))
    return float(np.sqrt(np.sum((got - want) ** 2, axis=axes) / np.sum(want**2, axis=axes)).max())


def random_step_inputs(rng: np.random.Generator, config: ReplayConfig, batch: int) -> Tokens:
    """One token per row: normal q, k, v; g = -softplus(N(-1.5, 1)); beta in (0.05, 0.95)."""
    hk, hv, dk, dv = config.num_k_heads, config.num_v_heads, config.head_k_dim, config.head_v_dim
    normal = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.float32)
    g = -np.logaddexp(0.0, rng.normal(-1.5, 1.0, config.g_shape(batch)))
    beta = rng.uniform(0.05, 0.95, (batch, hv))
    return Tokens(normal(batch, hk, dk), normal(batch, hk, dk), normal(batch, hv, dv),
                  jnp.asarray(g, jnp.float32), jnp.asarray(beta, jnp.float32))


def reference_step(state: jax.Array, tokens: Tokens) -> tuple[jax.Array, jax.Array]:
    """The scan reference over a single token: `(y [B,H_v,d_v], next state)`."""
    one_step = jax.tree.map(lambda x: x[:, None], tokens)
    y, final = recurrent_reference(one_step, state, use_qk_l2norm=True)
    return y[:, 0], final


@dataclasses.dataclass(frozen=True)
class CheckResult:
    y_err: float
    state_err: float
    natural_flushes: int
    forced_flushes: int
    every_step_flushes: int  # under the fold-every-step policy (the default at small batch)
    replay_bytes: Traffic  # summed over rows and steps
    plain_bytes: Traffic
    row_steps: int


def run_check(args: argparse.Namespace) -> CheckResult:
    """Decode `args.steps` tokens per row with replay and with the reference, side by side."""
    config = ReplayConfig(
        num_k_heads=NUM_K_HEADS, num_v_heads=NUM_V_HEADS, head_k_dim=HEAD_DIM,
        head_v_dim=HEAD_DIM, cache_len=args.cache_len, gate=args.gate,
    )
    rng = np.random.default_rng(args.seed)
    num_slots = 2 * args.batch
    slots = jnp.asarray(rng.permutation(num_slots)[: args.batch], jnp.int32)
    shape = (num_slots, config.num_v_heads, config.head_v_dim, config.head_k_dim)
    checkpoint0 = jnp.asarray(0.3 * rng.normal(size=shape), config.state_dtype)
    ref_state = checkpoint0[slots].astype(jnp.float32)
    state = init_state(config, num_slots, checkpoint0)

    policy = default_flush_policy(config, args.batch)
    step = jax.jit(
        functools.partial(decode_step, backend=args.backend, policy=policy, use_qk_l2norm=True),
        donate_argnums=0,
    )
    ref_step, materialize = jax.jit(reference_step), jax.jit(materialize_state)
    y_err = state_err = 0.0
    natural = forced = every_step = read = written = 0
    for _ in tqdm(range(args.steps), desc="check", file=sys.stderr, disable=None, leave=False):
        inputs = random_step_inputs(rng, config, args.batch)
        force = jnp.asarray(rng.random(args.batch) < FORCE_FLUSH_PROB)
        plan = plan_step(state.write_pos, slots, force, config.cache_len, policy)
        pos, flush = np.asarray(plan.pos), np.asarray(plan.flush)
        is_natural = pos == config.cache_len - 1
        natural += int(is_natural.sum())
        extra, asked = flush & ~is_natural, np.asarray(force)
        forced += int((extra & asked).sum())
        every_step += int((extra & ~asked).sum())
        for p, f in zip(pos, flush):
            traffic = replay_traffic(config, int(p), bool(f))
            read, written = read + traffic.read, written + traffic.written

        y, state = step(state, inputs, slots, force)
        ref_y, ref_state = ref_step(ref_state, inputs)
        y_err = max(y_err, normwise_rel_err(y, ref_y))
        state_err = max(state_err, normwise_rel_err(materialize(state, slots), ref_state))

    row_steps = args.steps * args.batch
    plain = plain_traffic(config)
    return CheckResult(
        y_err=y_err, state_err=state_err, natural_flushes=natural, forced_flushes=forced,
        every_step_flushes=every_step,
        replay_bytes=Traffic(read, written),
        plain_bytes=Traffic(plain.read * row_steps, plain.written * row_steps),
        row_steps=row_steps,
    )


def report(args: argparse.Namespace, result: CheckResult) -> str:
    """Human-readable summary of a check run."""
    per = lambda x: x / result.row_steps / 1024
    replay_total = result.replay_bytes.read + result.replay_bytes.written
    plain_total = result.plain_bytes.read + result.plain_bytes.written
    ok = max(result.y_err, result.state_err) <= TOLERANCE
    L = args.cache_len
    return "\n".join([
        f"replayssm check: gate={args.gate} H_k={NUM_K_HEADS} H_v={NUM_V_HEADS} "
        f"d_k=d_v={HEAD_DIM} L={L} fp32, batch {args.batch} on {2 * args.batch} shuffled "
        f"slots, {args.steps} steps, backend={args.backend}, seed={args.seed}",
        f"  flushes: {result.natural_flushes} natural, {result.forced_flushes} forced "
        f"(p={FORCE_FLUSH_PROB} per row per step)"
        + (f", {result.every_step_flushes} under the fold-every-step policy (the default "
           f"at this batch)" if result.every_step_flushes else ""),
        f"  max normwise relative error vs recurrent_reference: outputs {result.y_err:.2e}, "
        f"live state {result.state_err:.2e} (tolerance {TOLERANCE:.0e})",
        f"  state KiB per row per step: replay read {per(result.replay_bytes.read):.1f} + "
        f"written {per(result.replay_bytes.written):.1f} = {per(replay_total):.1f}; plain "
        f"decode read {per(result.plain_bytes.read):.1f} + written "
        f"{per(result.plain_bytes.written):.1f} = {per(plain_total):.1f}",
        f"  replay / plain bytes: {replay_total / plain_total:.3f} (checkpoint-only ideal "
        f"(1 + 1/L) / 2 = {(1 + 1 / L) / 2:.3f})",
        f"agreement: {'OK' if ok else 'FAILED'}",
    ])


def main(argv: list[str] | None = None) -> int:
    """Run the check; exit status 0 when replay agrees with the reference."""
    args = parse_args(argv)
    result = run_check(args)
    print(report(args, result))
    return 0 if max(result.y_err, result.state_err) <= TOLERANCE else 1
