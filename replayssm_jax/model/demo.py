"""`python -m replayssm_jax demo`: continuous batching of a small GDN decoder with ReplaySSM.

`--layers gdn,mamba2,gdn` makes it a hybrid stack (GDN and Mamba-2 layers in that order);
the default is two GDN layers.

Requests with different prompt lengths join and leave a fixed batch, slots are reused, and
about half of the requests continue an earlier request's conversation: their prompt
starts with that request's sequence, and serving restores the longest tracked prefix from
its snapshot instead of re-running it. Afterwards every request is decoded alone with the
plain recurrence (fp32) and compared: greedy tokens, largest logit difference, flushes, state
traffic per token and step time.

With `--speculate T` every step is a speculative one instead: a drafter (`--drafter
ngram`: prompt lookup in the request's own sequence; `ngram-tree`: the two latest
continuations as sibling chains of a draft tree; `self`: the model drafting greedily for
itself) proposes T - 1 tokens, the model verifies the window in one pass, and greedy
acceptance keeps 1..T tokens (a tree: along the path the verifier agrees with). The report
then gives, per request, the acceptance rate, tokens per verify step, and the state bytes
written per accepted token by ReplaySSM verify (T small records, a checkpoint only when the
ring is full) against conventional speculation (T full states per verify step).

CPU defaults finish in well under a minute; on a GPU pass larger ones, e.g.
`--batch 64 --steps 400 --cache-len 16`.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from replayssm_jax import sharding
from replayssm_jax.backends import BACKENDS
from replayssm_jax.model import decoder, serving


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m replayssm_jax demo", description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--batch", type=int, default=4, help="rows per decode step (max batch)")
    parser.add_argument("--steps", type=int, default=64, help="batched decode steps to run")
    parser.add_argument("--cache-len", type=int, default=6, help="L, the replay window")
    parser.add_argument(
        "--track-interval", type=int, default=8, help="prefix-cache snapshot every this many tokens"
    )
    parser.add_argument("--backend", choices=BACKENDS, default="xla")
    parser.add_argument(
        "--policy", choices=("natural", "every_step", "default"), default="natural",
        help="flush policy: natural (replay, flush every L steps), every_step (fold every step), "
             "default (default_flush_policy: folds at small batch, where that measured faster on the H200)",
    )
    parser.add_argument(
        "--dtype", choices=("float32", "bfloat16"), default="float32", help="state and cache dtype"
    )
    parser.add_argument(
        "--speculate", type=int, default=0, metavar="T",
        help="speculative decoding with a window of T tokens (2 <= T <= cache-len; 0: off)",
    )
    parser.add_argument("--drafter", choices=tuple(serving.DRAFTERS), default="ngram",
                        help="draft source with --speculate")
    parser.add_argument(
        "--layers", type=parse_layers, default=None,
        help="comma-separated layer kinds of a hybrid stack, e.g. gdn,mamba2,gdn (default: 2 GDN layers)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--mesh", type=sharding.parse_mesh, default=None,
        help="shard over a device mesh, e.g. tp=2,dp=2: heads over tp, slots and rows over dp "
             "(CPU: XLA_FLAGS=--xla_force_host_platform_device_count=4)",
    )
    args = parser.parse_args(argv)
    for name in ("batch", "steps", "cache_len", "track_interval"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be positive")
    if args.speculate and not 2 <= args.speculate <= args.cache_len:
        parser.error("--speculate must be 0 or in [2, --cache-len]")
    return args


def parse_layers(text: str) -> tuple[str, ...]:
    """`"gdn,mamba2"` -> `("gdn", "mamba2")`; argparse reports the ValueError."""
    kinds = tuple(part.strip() for part in text.split(","))
    if not kinds or any(kind not in decoder.LAYER_KINDS for kind in kinds):
        raise argparse.ArgumentTypeError(f"layer kinds must be among {decoder.LAYER_KINDS}, got {text!r}")
    return kinds


def model_config(layers: tuple[str, ...] | None) -> decoder.DecoderConfig:
    """The demo's model: the default decoder, with `layers` as its layer kinds when given."""
    config = decoder.DecoderConfig()
    return config if layers is None else dataclasses.replace(config, layers=layers, num_layers=len(layers))


# A bf16 state rounds every checkpoint write (2^-8 relative) and the replay sums in another
# order than the reference, so greedy tokens can flip where two logits are that close; a
# logit further off than this fraction of the largest reference logit is a real disagreement.
BF16_LOGIT_BOUND = 0.1


def progress(iterable, label: str, total: int | None = None):
    """A progress bar on stderr (tqdm), quiet when stderr is not a terminal."""
    return tqdm(iterable, desc=label, total=total, file=sys.stderr, disable=None, leave=False)


class Workload:
    """Seeded request generator: fresh prompts, or continuations of earlier requests."""

    def __init__(self, rng: np.random.Generator, vocab: int, interval: int, cache_len: int):
        self.rng, self.vocab, self.interval, self.cache_len = rng, vocab, interval, cache_len
        self.issued: list[serving.Request] = []

    def next(self) -> serving.Request:
        rng = self.rng
        fresh = lambda n: rng.integers(0, self.vocab, n).tolist()
        parents = [r for r in self.issued if r.processed > self.interval]
        parent = None
        if parents and rng.random() < 0.5:
            parent = parents[rng.integers(len(parents))]
            cut = int(rng.integers(self.interval, parent.processed + 1))
            prompt = parent.sequence[:cut] + fresh(int(rng.integers(1, 6)))
        else:
            prompt = fresh(int(rng.integers(2, 3 * self.interval)))
        request = serving.Request(
            rid=len(self.issued),
            prompt=prompt,
            max_new_tokens=int(rng.integers(2, 3 * self.cache_len + 3)),
            parent=None if parent is None else parent.rid,
        )
        self.issued.append(request)
        return request


def serve(engine: serving.Engine, workload: Workload, steps: int) -> list[float]:
    """Run `steps` decode steps, admitting requests into free rows (sometimes a step late)."""
    step_times = []
    for step in progress(range(steps), "serving"):
        while engine.has_free_row() and (step == 0 or workload.rng.random() < 0.7):
            engine.admit(workload.next())
        if engine.active:
            step_times.append(engine.step())
    return step_times


def compare(request: serving.Request, tokens: list[int], logits) -> tuple[bool, float]:
    """`(greedy tokens equal the reference's, largest logit difference)`: logits are
    comparable up to and including the first differing token (same inputs until then)."""
    agree = next((i for i, (a, b) in enumerate(zip(tokens, request.generated)) if a != b), None)
    upto = len(tokens) if agree is None else agree + 1
    return tokens == request.generated, float(np.max(np.abs(np.stack(request.logits)[:upto] - logits[:upto])))


def report(
    engine: serving.Engine, requests: list[serving.Request], ref_tokens, ref_logits
) -> tuple[bool, float]:
    """Print one line per request; returns (every request matches, largest logit difference)."""
    plain = engine.traffic.plain
    print(
        f"{'req':>4} {'slot':>4} {'prompt':>6} {'restored':>8} {'new':>4} {'same':>5} "
        f"{'max|dlogit|':>11} {'flush nat/forced':>16} {'read B/tok':>10} {'write B/tok':>11} "
        f"{'plain r=w':>9} {'ratio':>6} {'med step ms':>11}"
    )
    all_same, worst = True, 0.0
    for request, tokens, logits in zip(requests, ref_tokens, ref_logits):
        same, diff = compare(request, tokens, logits)
        all_same &= same
        worst = max(worst, diff)
        n = max(request.decode_steps, 1)
        read, written = request.replay_read / n, request.replay_written / n
        origin = f"{request.restored}<{request.parent}" if request.restored else "0"
        print(
            f"{request.rid:>4} {request.slot:>4} {len(request.prompt):>6} {origin:>8} "
            f"{len(request.generated):>4} {'yes' if same else 'NO':>5} {diff:>11.2e} "
            f"{f"{request.natural_flushes}/{request.forced_flushes}":>16} {read:>10.0f} "
            f"{written:>11.0f} {plain:>9} {(read + written) / (2 * plain):>6.2f} "
            f"{1e3 * np.median(request.step_seconds or [0.0]):>11.2f}"
        )
    print("(max|dlogit|: over the generated tokens up to the first one that differs)")
    return all_same, worst


def report_speculative(
    engine: serving.Engine, requests: list[serving.Request], ref_tokens, ref_logits
) -> tuple[bool, float]:
    """Per request: tokens equal to non-speculative decoding, acceptance, tokens per verify
    step, state bytes written per accepted token (ReplaySSM vs conventional); returns (every
    request matches, largest logit difference)."""
    print(
        f"{'req':>4} {'slot':>4} {'prompt':>6} {'new':>4} {'same':>5} {'max|dlogit|':>11} "
        f"{'verifies':>8} {'accept':>6} {'tok/verify':>10} {'folds':>5} {'write B/tok':>11} "
        f"{'conv. B/tok':>11} {'ratio':>6}"
    )
    all_same, worst = True, 0.0
    for request, tokens, logits in zip(requests, ref_tokens, ref_logits):
        same, diff = compare(request, tokens, logits)
        all_same &= same
        worst = max(worst, diff)
        steps = request.verify_steps
        emitted = max(len(request.generated) - 1, 1)  # the first token came from the prefill
        rate = request.accepted_drafts / max(request.drafted, 1)
        ours, conventional = request.spec_written / emitted, request.conventional_written / emitted
        print(
            f"{request.rid:>4} {request.slot:>4} {len(request.prompt):>6} {len(request.generated):>4} "
            f"{'yes' if same else 'NO':>5} {diff:>11.2e} {steps:>8} {rate:>6.0%} "
            f"{emitted / max(steps, 1) if steps else 0.0:>10.2f} {request.natural_flushes:>5} "
            f"{ours:>11.0f} {conventional:>11.0f} {ours / max(conventional, 1):>6.3f}"
        )
    print("(accept: draft tokens accepted / proposed; tok/verify and B/tok count the decoded "
          "tokens, bonus included; conv.: conventional verify writing T full states per step)")
    return all_same, worst


def main(argv: Sequence[str] | None = None) -> int:
    """Run the demo; returns 0, or 1 on a real disagreement with plain decode: any greedy
    token with an fp32 state; with a bf16 state, a logit off by more than BF16_LOGIT_BOUND of
    the largest reference logit before the first differing token."""
    args = parse_args(argv)
    started = time.perf_counter()
    config = model_config(args.layers)
    params = decoder.init_params(config, args.seed)
    state_dtype = jnp.dtype(args.dtype)
    engine = serving.Engine(
        params, config, max_batch=args.batch, num_slots=2 * args.batch,
        cache_len=args.cache_len, track_interval=args.track_interval,
        state_dtype=state_dtype, backend=args.backend,
        policy=None if args.policy == "default" else args.policy,
        mesh=args.mesh, speculate=args.speculate,
        drafter=serving.DRAFTERS[args.drafter]() if args.speculate else None,
    )
    rng = np.random.default_rng(args.seed)
    workload = Workload(rng, config.vocab_size, args.track_interval, args.cache_len)
    mamba2 = config.mamba2
    layers = ("GDN decoder" if not config.hybrid else
              f"hybrid decoder ({', '.join(config.kinds)}; Mamba-2 H={mamba2.num_heads} P={mamba2.head_dim} "
              f"N={mamba2.state_size} G={mamba2.num_groups})")
    print(
        f"ReplaySSM demo on {jax.devices()[0].platform}: {config.num_layers}-layer {layers} "
        f"({decoder.num_params(params):,} params, H_k={config.num_k_heads} H_v={config.num_v_heads} "
        f"d_k=d_v={config.head_k_dim}), batch {args.batch}, {2 * args.batch} slots, "
        f"L={args.cache_len}, track every {args.track_interval} tokens, {args.dtype} state, "
        f"backend {args.backend}, policy {args.policy}"
        + ("" if engine.mesh is None else f", mesh {dict(engine.mesh.shape)} over {engine.mesh.size} devices")
        + ("" if not args.speculate else f", speculative window T={args.speculate} ({args.drafter} drafter)"),
        flush=True,
    )
    print("reference: each request decoded alone by the same model with the plain recurrence "
          "(the lax.scan oracle, fp32 state)"
          + ("" if args.dtype == "float32" else
             f"; a {args.dtype} state rounds every flush, so expect near-tied greedy tokens to differ "
             f"and logits within {BF16_LOGIT_BOUND:g} of the largest one"), flush=True)
    engine.warm_up()
    step_times = serve(engine, workload, args.steps)
    requests = [r for r in workload.issued if r.generated]
    ref_tokens, ref_logits = [], []
    for first in progress(range(0, len(requests), 16), "plain reference"):
        tokens, logits = serving.reference_decode(params, config, requests[first : first + 16])
        ref_tokens += tokens
        ref_logits += logits
    if args.speculate:
        all_same, worst = report_speculative(engine, requests, ref_tokens, ref_logits)
        summarize_speculative(engine, requests, step_times, all_same, worst)
    else:
        all_same, worst = report(engine, requests, ref_tokens, ref_logits)
        summarize(engine, requests, step_times, all_same, worst)
    print(f"total {time.perf_counter() - started:.1f} s")
    if args.dtype == "float32":
        return 0 if all_same else 1
    scale = max(float(np.max(np.abs(logits))) for logits in ref_logits)
    print(f"largest logit difference / largest reference logit: {worst / scale:.2e} "
          f"(bound {BF16_LOGIT_BOUND:g})")
    return 0 if worst <= BF16_LOGIT_BOUND * scale else 1


def summarize(engine, requests, step_times, all_same, worst) -> None:
    """The totals of a plain (non-speculative) run."""
    restored = [r for r in requests if r.restored]
    flushes = sum(r.natural_flushes + r.forced_flushes for r in requests)
    steps = sum(r.decode_steps for r in requests)
    ratio = sum(r.replay_read + r.replay_written for r in requests) / max(
        2 * engine.traffic.plain * steps, 1
    )
    print(
        f"\n{len(requests)} requests, {len(step_times)} batched steps ({steps} request-tokens), "
        f"slots reused {len(requests) - len(set(r.slot for r in requests))} times, "
        f"{len(restored)} started from a prefix snapshot "
        f"({sum(r.restored for r in restored)} prompt tokens not re-run), "
        f"{len(engine.prefix_cache)} snapshots cached"
    )
    print(
        f"greedy tokens equal to plain decode alone: {'all' if all_same else 'NOT all'}; "
        f"largest logit difference {worst:.2e}; {flushes} flushes in {steps} request-steps; "
        f"state bytes (read+write) {ratio:.2f}x plain decode; decode step compiled "
        f"{serving.step_traces()}x, median step {1e3 * np.median(step_times):.2f} ms"
    )


def summarize_speculative(engine, requests, step_times, all_same, worst) -> None:
    """The totals of a speculative run: tokens per verify step, acceptance, bytes written."""
    verifies = sum(r.verify_steps for r in requests)
    emitted = sum(len(r.generated) - 1 for r in requests)
    drafted = sum(r.drafted for r in requests)
    ours = sum(r.spec_written for r in requests) / max(emitted, 1)
    conventional = sum(r.conventional_written for r in requests) / max(emitted, 1)
    print(
        f"\n{len(requests)} requests, {len(step_times)} batched verify steps ({verifies} request-windows of "
        f"T={engine.speculate}), {emitted} tokens decoded after the prefills: "
        f"{emitted / max(verifies, 1):.2f} tokens per verify step, acceptance "
        f"{sum(r.accepted_drafts for r in requests) / max(drafted, 1):.0%} of {drafted} drafts"
    )
    print(
        f"greedy tokens equal to non-speculative plain decode: {'all' if all_same else 'NOT all'}; "
        f"largest logit difference {worst:.2e}; state bytes written per decoded token: ReplaySSM "
        f"verify {ours:,.0f}, conventional verify {conventional:,.0f} ({ours / max(conventional, 1):.3f}x); "
        f"median step {1e3 * np.median(step_times):.2f} ms"
    )
