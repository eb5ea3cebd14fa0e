"""Continuous batching with ReplaySSM: a host-side scheduler over three jitted device calls.

* `Engine.step`: one decode step for a fixed batch of rows (padding rows have slot -1): the
  decoder's `decode_step` with `force_flush = track_flush(seq_lens, track_interval)`, state
  donated, greedy next token on the device. One compilation for the whole run.
* `Engine.admit`: a joining request gets a free slot (slots are reused), starts from the
  longest cached prefix snapshot of its prompt (`reset_slots(checkpoint=..., conv_state=...)`)
  or from zero, and prefills the rest of its prompt in chunks that end on track positions.
* Prefix cache: a dict from token prefix (length a multiple of `track_interval`) to a
  `Snapshot`; filled after prefill chunks that end on a track position and after decode
  steps whose forced flush landed on one (`snapshot` of the flushed slot).

Each request records its tokens, logits, flushes and replay state traffic; `reference_decode`
decodes requests on their own plain-recurrence states for comparison. The model may be a
hybrid stack (`DecoderConfig(layers=...)`: GDN and Mamba-2 layers).

Speculative decoding (`Engine(speculate=T, drafter=...)`, `Engine.speculative_step`): a
drafter proposes T - 1 tokens per row, the model verifies the window (the row's next input
and the drafts) in one pass (`decoder.verify_window`), and greedy acceptance keeps the
longest prefix of drafts equal to the verifier's argmax plus the verifier's next token (the
bonus): 1..T tokens per step, the same greedy tokens as plain decoding; on a mesh the
window and the accept run under `shard_map` (`sharding.model_verify_step`,
`model_accept_step`). A drafter may propose a tree (drafts and each one's parent window
position): the window is verified as a tree and acceptance follows the path the verifier
agrees with (`greedy_accept_tree`), its records moved next to each other by the accept.
Drafters: `NgramDrafter` (prompt lookup in the request's own sequence), `NgramTreeDrafter`
(its two latest continuations as sibling chains) and `SelfDrafter` (the model drafting
greedily for itself from a scratch copy of its live state, plain recurrence). The
speculative step has no forced flushes, so decode steps add no prefix snapshots (prefill
chunks still do).
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Protocol

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jaxtyping import Array, Float, Int

from replayssm_jax import cost, sharding
from replayssm_jax.model import decoder, slots as slot_ops
from replayssm_jax.model.state import HybridState, ModelState, Snapshot, layer_configs
from replayssm_jax.plan import FlushPolicy, as_policy


@dataclasses.dataclass
class Request:
    """One generation request and what serving it produced.

    `prompt` tokens are fed first; `max_new_tokens` greedy tokens are generated (the first
    one from the prefill logits). `parent` is the request whose sequence the prompt extends.
    """

    rid: int
    prompt: list[int]
    max_new_tokens: int
    parent: int | None = None
    slot: int = -1
    restored: int = 0  # prompt tokens restored from a prefix snapshot, not re-run
    generated: list[int] = dataclasses.field(default_factory=list)
    logits: list[np.ndarray] = dataclasses.field(default_factory=list)
    natural_flushes: int = 0
    forced_flushes: int = 0
    decode_steps: int = 0
    replay_read: int = 0  # bytes of recurrent state read by this request's decode steps
    replay_written: int = 0
    step_seconds: list[float] = dataclasses.field(default_factory=list)
    verify_steps: int = 0  # speculative decoding: windows verified,
    drafted: int = 0  # draft tokens proposed,
    accepted_drafts: int = 0  # draft tokens accepted (the bonus tokens not counted),
    spec_written: int = 0  # state bytes written by ReplaySSM verify (records + folds),
    conventional_written: int = 0  # and by conventional verify (T full states per step)

    @property
    def sequence(self) -> list[int]:
        return self.prompt + self.generated

    @property
    def processed(self) -> int:
        """Tokens whose effect is in the slot's state (the last generated one is not fed yet)."""
        return len(self.prompt) + max(len(self.generated) - 1, 0)

    @property
    def done(self) -> bool:
        return len(self.generated) >= self.max_new_tokens


@dataclasses.dataclass(frozen=True)
class StateTraffic:
    """Bytes of recurrent (SSM) state moved per token, summed over the model's layers.

    `checkpoint`: one slot's checkpoints; `entry`: one cache record (u, k, g; Mamba-2: x, B,
    dt) of one slot, every layer. Plain decode reads and writes the full state every token:
    `2 * checkpoint`.
    """

    checkpoint: int
    entry: int

    @classmethod
    def of(cls, state: ModelState | HybridState) -> StateTraffic:
        configs = layer_configs(state)
        return cls(sum(cost.state_bytes(c) for c in configs), sum(cost.entry_bytes(c) for c in configs))

    def replay(self, pos: int, flush: bool) -> tuple[int, int]:
        """(read, written) by one ReplaySSM step with `pos` cached entries."""
        read = self.checkpoint + pos * self.entry
        return read, self.checkpoint if flush else self.entry

    @property
    def plain(self) -> int:
        """Read (= written) by one plain-decode step."""
        return self.checkpoint


_traces = {"step": 0}


def step_traces() -> int:
    """How many times the serving decode step has been traced (compiled) in this process."""
    return _traces["step"]


@functools.partial(jax.jit, static_argnames=("track_interval", "backend", "policy", "mesh"), donate_argnums=1)
def _serve_step(params, state, tokens, slots, seq_lens, *, track_interval: int, backend: str, policy, mesh):
    """Decode step with track-position forced flushes and greedy next tokens (state donated);
    sharded over `mesh` when one is given."""
    _traces["step"] += 1  # runs only while tracing
    force = slot_ops.track_flush(seq_lens, track_interval)
    if mesh is None:
        logits, state, plan = decoder.decode_step(params, state, tokens, slots, force, backend=backend,
                                                  policy=policy)
    else:
        logits, state, plan = sharding.model_decode_step(params, state, tokens, slots, force, mesh=mesh,
                                                         backend=backend, policy=policy)
    return jnp.argmax(logits, axis=-1), logits, state, plan.pos, plan.flush


def greedy_accept(drafts: Int[np.ndarray, "B Tm1"], argmax: Int[np.ndarray, "B T"]) -> Int[np.ndarray, " B"]:
    """Tokens kept per row: the longest prefix of drafts with `drafts[:, i] == argmax[:, i]`
    (the verifier's choice after window token i), plus one (the verifier's next token)."""
    agree = drafts == argmax[:, :-1]
    return 1 + np.cumprod(agree, axis=1).sum(axis=1)


def greedy_accept_tree(window: Int[np.ndarray, "B T"], parents: Int[np.ndarray, "B T"],
                       argmax: Int[np.ndarray, "B T"]) -> tuple[Int[np.ndarray, " B"], Int[np.ndarray, "B T"]]:
    """A draft tree's greedy acceptance per row: from the root (window position 0, the
    row's next input) follow the child whose token is the verifier's choice after its
    parent, while one is. Returns `(kept [B]: the path's length, path [B, T]: its window
    positions from the root down, zero padded)`; the tokens generated are `argmax` along it."""
    batch, width = window.shape
    kept, path = np.ones(batch, np.int32), np.zeros((batch, width), np.int32)
    for row in range(batch):
        node = 0
        while True:
            child = next((c for c in range(node + 1, width)
                          if parents[row, c] == node and window[row, c] == argmax[row, node]), None)
            if child is None:
                break
            path[row, kept[row]], node = child, child
            kept[row] += 1
    return kept, path


class Drafter(Protocol):
    """Proposes draft tokens for every row of the engine's batch: a chain `[B, count]`, or a
    tree `(drafts [B, count], parents [B, count])` where the draft at window position i + 1
    hangs under window position `parents[b, i]` in [0, i] (0: the row's next input)."""

    def propose(
        self, engine: Engine, tokens: Int[Array, " B"], slots: Int[Array, " B"], count: int
    ) -> Int[np.ndarray, "B count"] | tuple[Int[np.ndarray, "B count"], Int[np.ndarray, "B count"]]:
        """`count` drafts to follow each row's next input `tokens` (rows with slot -1: any)."""
        ...


class NgramDrafter:
    """Prompt lookup: the tokens that followed the last earlier occurrence of the sequence's
    final `n`-gram (shorter n-grams when none occurs), else the last token repeated."""

    def __init__(self, n: int = 3):
        if n < 1:
            raise ValueError(f"n must be positive, got {n}")
        self.n = n

    def propose_one(self, sequence: list[int], count: int, occurrence: int = 0) -> list[int]:
        """`count` draft tokens to follow `sequence`: what followed the `occurrence`-th latest
        earlier occurrence (0: the latest) of its longest final n-gram that has one."""
        for n in range(min(self.n, len(sequence) - 1), 0, -1):
            suffix = sequence[-n:]
            starts = [start for start in range(len(sequence) - n - 1, -1, -1) if sequence[start:start + n] == suffix]
            if len(starts) > occurrence:
                follow = sequence[starts[occurrence] + n : starts[occurrence] + n + count]
                return follow + [follow[-1]] * (count - len(follow))
        return [sequence[-1]] * count

    def propose(self, engine: Engine, tokens, slots, count: int) -> np.ndarray:
        drafts = np.zeros((len(engine.rows), count), np.int32)
        for row, request in enumerate(engine.rows):
            if request is not None:
                drafts[row] = self.propose_one(request.sequence, count)
        return drafts


class NgramTreeDrafter(NgramDrafter):
    """Prompt lookup as a tree of two chains under the row's next input: what followed the
    latest earlier occurrence of the final n-gram (the first `count - count // 2` drafts)
    and what followed the one before it (the rest), so a row whose latest continuation is
    wrong may keep the other."""

    def propose(self, engine: Engine, tokens, slots, count: int) -> tuple[np.ndarray, np.ndarray]:
        first = count - count // 2
        parents = np.arange(count, dtype=np.int32)  # the draft at window position i + 1 under i ...
        if count > first:
            parents[first] = 0  # ... but the second chain's first draft under the row's next input
        drafts = np.zeros((len(engine.rows), count), np.int32)
        for row, request in enumerate(engine.rows):
            if request is not None:
                drafts[row] = (self.propose_one(request.sequence, first)
                               + self.propose_one(request.sequence, count - first, occurrence=1))
        return drafts, np.broadcast_to(parents, drafts.shape).copy()


@functools.partial(jax.jit, static_argnames=("count",))
def _self_draft(params, state, tokens, slots, *, count: int):
    """Greedy plain decode of `count` tokens per row from a copy of each slot's live state."""
    plain = decoder.plain_from_slots(params, state, slots)

    def one(carry, _):
        token, plain = carry
        logits, plain = decoder.plain_forward(params, token[:, None], plain)
        token = jnp.argmax(logits[:, 0], axis=-1).astype(jnp.int32)
        return (token, plain), token

    _, drafts = jax.lax.scan(one, (tokens, plain), None, length=count)
    return drafts.T


class SelfDrafter:
    """The model drafts for itself: greedy plain-recurrence decode from its own live state
    (a scratch copy: the served state is not touched). With an fp32 state every draft is
    accepted: an upper bound on acceptance that exercises the full window."""

    def propose(self, engine: Engine, tokens, slots, count: int) -> np.ndarray:
        return np.asarray(_self_draft(engine.params, engine.state, tokens, slots, count=count))


DRAFTERS = {"ngram": NgramDrafter, "ngram-tree": NgramTreeDrafter, "self": SelfDrafter}


_reset = jax.jit(slot_ops.reset_slots, donate_argnums=0)
_snapshot = jax.jit(slot_ops.snapshot)


class Engine:
    """Continuous-batching server over one `ModelState` pool (a `HybridState` for a hybrid
    stack; see the module docstring).

    With a `mesh` (`replayssm_jax.sharding`) the pool is sharded (heads over tp, slots over
    dp), the decode step runs under `shard_map`, and a request in row r gets a slot of row
    r's dp shard. Prefill and the slot operations run under `jit` on the sharded arrays
    (the compiler partitions them); their results are put back on the pool's layout. The
    decode step is bit-identical to one device; the partitioned prefill is not with tp > 1
    (its output projection sums partial products over tp: another summation order).

    With `speculate = T` (2 <= T <= cache_len; any backend, on a mesh too) `step` is
    `speculative_step`: `drafter` (default `NgramDrafter()`) proposes T - 1 tokens per row.
    """

    def __init__(
        self,
        params: decoder.DecoderParams,
        config: decoder.DecoderConfig,
        *,
        max_batch: int,
        num_slots: int,
        cache_len: int,
        track_interval: int,
        state_dtype=jnp.float32,
        backend: str = "xla",
        policy: FlushPolicy | str | None = None,
        mesh: Mesh | None = None,
        speculate: int = 0,
        drafter: Drafter | None = None,
    ):
        if num_slots < max_batch:
            raise ValueError(f"num_slots ({num_slots}) must be >= max_batch ({max_batch})")
        if track_interval < 1:
            raise ValueError(f"track_interval must be positive, got {track_interval}")
        self.params, self.config = params, config
        self.max_batch, self.track_interval = max_batch, track_interval
        self.mesh = mesh
        self.cache_len = cache_len
        state = config.init_state(num_slots, cache_len, state_dtype)
        if mesh is not None:
            sharding.check_fits(layer_configs(state), num_slots, mesh, max_batch)
        self.state = self._placed(state)
        self.traffic = StateTraffic.of(self.state)
        self.rows: list[Request | None] = [None] * max_batch
        self.free_slots = list(range(num_slots))
        self.prefix_cache: dict[tuple[int, ...], Snapshot] = {}
        self._backend = backend
        self._policy = None if policy is None else as_policy(policy)
        if speculate and not 2 <= speculate <= cache_len:
            raise ValueError(f"speculate (the window T) must be 0 or in [2, cache_len = {cache_len}], got {speculate}")
        self.speculate = speculate
        self.drafter = NgramDrafter() if drafter is None else drafter

    def _placed(self, state: ModelState) -> ModelState:
        return state if self.mesh is None else sharding.place_state(state, self.mesh)

    def _free_slot(self, row: int) -> int:
        """The most recently freed slot (LIFO) that row `row` may use: one of its dp shard's."""
        dp = 1 if self.mesh is None else sharding.axis_sizes(self.mesh)[1]
        shard = row // (self.max_batch // dp)
        per_shard = self.state.num_slots // dp
        index = max(i for i, s in enumerate(self.free_slots) if s // per_shard == shard)
        return self.free_slots.pop(index)

    @property
    def active(self) -> list[Request]:
        return [r for r in self.rows if r is not None]

    def has_free_row(self) -> bool:
        return any(r is None for r in self.rows)

    def longest_prefix(self, prompt: list[int]) -> int:
        """Longest cached track position P <= len(prompt) - 1 (one token is left to prefill)."""
        interval = self.track_interval
        for length in range((len(prompt) - 1) // interval * interval, 0, -interval):
            if tuple(prompt[:length]) in self.prefix_cache:
                return length
        return 0

    def admit(self, request: Request) -> None:
        """Give `request` a free row and slot, restore its longest cached prefix, prefill the rest."""
        row = self.rows.index(None)
        request.slot = self._free_slot(row)
        slots = jnp.array([request.slot], jnp.int32)
        request.restored = self.longest_prefix(request.prompt)
        if request.restored:
            snap = self.prefix_cache[tuple(request.prompt[: request.restored])]
            self.state = self._placed(_reset(self.state, slots, snap.checkpoint, snap.conv_state))
        else:
            self.state = self._placed(_reset(self.state, slots))
        logits = self._prefill(request, slots)
        request.generated.append(int(np.argmax(logits)))
        request.logits.append(logits)
        self.rows[row] = request
        self._retire(row)

    def _prefill(self, request: Request, slots: Int[Array, " 1"]) -> np.ndarray:
        """Run the prompt after the restored prefix in chunks ending on track positions.

        Every chunk is padded to `track_interval` tokens (one compilation); a chunk that ends
        on a track position is snapshotted into the prefix cache.
        """
        interval, start, end = self.track_interval, request.restored, len(request.prompt)
        while start < end:
            stop = min((start // interval + 1) * interval, end)
            chunk = np.zeros((1, interval), np.int32)
            chunk[0, : stop - start] = request.prompt[start:stop]
            logits, self.state = decoder.jitted_prefill(
                self.params, self.state, jnp.asarray(chunk),
                jnp.array([stop - start], jnp.int32), slots,
            )
            self.state = self._placed(self.state)
            if stop % interval == 0:
                self._remember(request.prompt[:stop], slots)
            start = stop
        return np.asarray(logits[0])

    def _remember(self, prefix: list[int], slots: Int[Array, " 1"]) -> None:
        key = tuple(prefix)
        if key not in self.prefix_cache:
            self.prefix_cache[key] = _snapshot(self.state, slots)

    def _retire(self, row: int) -> None:
        request = self.rows[row]
        if request is not None and request.done:
            self.rows[row] = None
            self.free_slots.append(request.slot)

    def warm_up(self) -> None:
        """Compile the decode step with padding rows only (writes nothing), so timings exclude it."""
        padding = jnp.full((self.max_batch,), -1, jnp.int32)
        zeros = jnp.zeros((self.max_batch,), jnp.int32)
        if self.speculate:
            drafts = self.drafter.propose(self, zeros, padding, self.speculate - 1)
            window = jnp.zeros((self.max_batch, self.speculate), jnp.int32)
            tree = isinstance(drafts, tuple)  # a tree drafter's windows compile with parents and a path
            parents = jnp.full(window.shape, -1, jnp.int32) if tree else None
            _, self.state, conv_inputs, _ = self._verify(window, padding, parents)
            self.state = self._accept(padding, zeros, conv_inputs, jnp.zeros_like(window) if tree else None)
            return
        _, _, self.state, _, _ = _serve_step(
            self.params, self.state, zeros, padding, zeros,
            track_interval=self.track_interval, backend=self._backend, policy=self._policy,
            mesh=self.mesh,
        )

    def step(self) -> float:
        """One decode step of every active row (a speculative one when `speculate`); returns
        its wall time in seconds."""
        if self.speculate:
            return self.speculative_step()
        tokens = np.zeros(self.max_batch, np.int32)
        slots = np.full(self.max_batch, -1, np.int32)
        seq_lens = np.zeros(self.max_batch, np.int32)
        for row, request in enumerate(self.rows):
            if request is not None:
                tokens[row] = request.generated[-1]
                slots[row] = request.slot
                seq_lens[row] = request.processed + 1  # including this step's token
        jax.block_until_ready(self.state)  # time this step, not queued prefills
        start = time.perf_counter()
        next_tokens, logits, self.state, pos, flush = _serve_step(
            self.params, self.state, jnp.asarray(tokens), jnp.asarray(slots),
            jnp.asarray(seq_lens), track_interval=self.track_interval, backend=self._backend, policy=self._policy,
            mesh=self.mesh,
        )
        next_tokens, logits, pos, flush = jax.device_get((next_tokens, logits, pos, flush))
        seconds = time.perf_counter() - start
        for row, request in enumerate(self.rows):
            if request is None:
                continue
            natural = bool(flush[row]) and pos[row] >= self.cache_len - 1
            request.natural_flushes += natural
            request.forced_flushes += bool(flush[row]) and not natural
            read, written = self.traffic.replay(int(pos[row]), bool(flush[row]))
            request.replay_read += read
            request.replay_written += written
            request.decode_steps += 1
            request.step_seconds.append(seconds)
            if seq_lens[row] % self.track_interval == 0:
                self._remember(request.sequence[: seq_lens[row]], jnp.array([request.slot]))
            request.generated.append(int(next_tokens[row]))
            request.logits.append(logits[row])
            self._retire(row)
        return seconds


    def _verify(self, window: Int[Array, "B T"], slots: Int[Array, " B"], parents=None) -> tuple:
        """`decoder.verify_window` of the pool (donated; a tree by `parents`), on its mesh when
        it has one."""
        if self.mesh is None:
            return decoder.jitted_verify_window(self.params, self.state, window, slots, backend=self._backend,
                                                parents=parents)
        return sharding.jitted_model_verify_step(self.params, self.state, window, slots, mesh=self.mesh,
                                                 backend=self._backend, parents=parents)

    def _accept(self, slots: Int[Array, " B"], num_accepted: Int[Array, " B"], conv_inputs, path=None) -> ModelState:
        """`decoder.accept_window` of the pool (donated; a tree's accepted `path`), on its mesh
        when it has one."""
        if self.mesh is None:
            return decoder.jitted_accept_window(self.state, slots, num_accepted, conv_inputs, path=path)
        return sharding.jitted_model_accept_step(self.state, slots, num_accepted, conv_inputs, mesh=self.mesh,
                                                 path=path)

    def speculative_step(self) -> float:
        """Draft T - 1 tokens per active row, verify the windows, keep the greedy prefix;
        returns the wall time (drafting included) in seconds."""
        width = self.speculate
        tokens = np.zeros(self.max_batch, np.int32)
        slots = np.full(self.max_batch, -1, np.int32)
        for row, request in enumerate(self.rows):
            if request is not None:
                tokens[row], slots[row] = request.generated[-1], request.slot
        jax.block_until_ready(self.state)
        start = time.perf_counter()
        tokens_d, slots_d = jnp.asarray(tokens), jnp.asarray(slots)
        drafts = self.drafter.propose(self, tokens_d, slots_d, width - 1)
        drafts, parents = drafts if isinstance(drafts, tuple) else (drafts, None)
        window = np.concatenate([tokens[:, None], drafts], axis=1)
        if parents is not None:  # window positions: -1 for the root, then the drafts' parents
            parents = np.concatenate([np.full((len(window), 1), -1, np.int32), parents], axis=1)
        logits, self.state, conv_inputs, folded = self._verify(
            jnp.asarray(window), slots_d, None if parents is None else jnp.asarray(parents))
        argmax = np.asarray(jnp.argmax(logits, axis=-1))
        if parents is None:
            kept, path, chosen = greedy_accept(drafts, argmax), None, argmax
        else:
            kept, path = greedy_accept_tree(window, parents, argmax)
            chosen = np.take_along_axis(argmax, path, axis=1)  # the verifier's token after each kept node
        kept = np.where(slots >= 0, kept, 0).astype(np.int32)
        self.state = self._accept(slots_d, jnp.asarray(kept), conv_inputs, None if path is None else jnp.asarray(path))
        logits, folded = jax.device_get((logits, folded))
        seconds = time.perf_counter() - start
        records, checkpoint = width * self.traffic.entry, self.traffic.checkpoint
        for row, request in enumerate(self.rows):
            if request is None:
                continue
            n = int(min(kept[row], request.max_new_tokens - len(request.generated)))
            request.verify_steps += 1
            request.drafted += width - 1
            request.accepted_drafts += int(kept[row]) - 1
            request.spec_written += records + checkpoint * bool(folded[row])
            request.conventional_written += width * checkpoint
            request.natural_flushes += bool(folded[row])  # a verify step folds only when the ring is full
            request.step_seconds.append(seconds)
            request.generated.extend(int(t) for t in chosen[row, :n])
            request.logits.extend(logits[row, :n] if path is None else logits[row, path[row, :n]])
            self._retire(row)
        return seconds


def reference_decode(
    params: decoder.DecoderParams,
    config: decoder.DecoderConfig,
    requests: list[Request],
    batch: int = 16,
) -> tuple[list[list[int]], list[Float[np.ndarray, "T V"]]]:
    """Greedy-decode each request on its own plain-recurrence state (fp32, no replay).

    Requests run `batch` at a time as independent rows (rows never interact: each has its own
    state); row r feeds its prompt, then its own greedy tokens, until it has as many new
    tokens as the request generated. Returns tokens and logits per request.
    """
    tokens_out: list[list[int]] = []
    logits_out: list[np.ndarray] = []
    for first in range(0, len(requests), batch):
        group = requests[first : first + batch]
        plain = decoder.init_plain_state(config, batch)
        prompts = [r.prompt for r in group]
        wanted = [len(r.generated) for r in group]
        total = max(len(p) + n - 1 for p, n in zip(prompts, wanted))
        got: list[list[np.ndarray]] = [[] for _ in group]
        feed = np.zeros(batch, np.int32)
        for t in range(total):
            for i, p in enumerate(prompts):
                if t < len(p):
                    feed[i] = p[t]
            logits, plain = decoder.plain_step(params, jnp.asarray(feed)[:, None], plain)
            logits = np.asarray(logits[:, 0])
            for i, p in enumerate(prompts):
                if len(p) - 1 <= t and len(got[i]) < wanted[i]:
                    got[i].append(logits[i])
                    feed[i] = int(np.argmax(logits[i]))
        for rows in got:
            stacked = np.stack(rows)
            tokens_out.append([int(t) for t in stacked.argmax(-1)])
            logits_out.append(stacked)
    return tokens_out, logits_out
