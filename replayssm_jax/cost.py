"""Byte model of one decode step: plain recurrence vs ReplaySSM (method note §10).

Pure Python arithmetic (no jax computation): the numbers are HBM bytes a kernel must move
at least, per layer, for the state and the replay cache. Inputs and outputs (q, k, v, g,
beta, y) are the same for both paths and are left out. For one slot with `pos` valid cache
entries (0 <= pos < L):

  non-flush step   read checkpoint  + read `pos` cache entries + append one entry
  flush step       read checkpoint  + read `pos` cache entries + write checkpoint
                   (+ a second checkpoint read if the kernel re-reads it to write back)

A natural flush happens at `pos == L - 1`, so over one cycle of L steps a slot reads the
checkpoint L times, writes it once, reads 0 + 1 + ... + (L-1) entries and appends L - 1:

  per-step average = S (1 + 1/L) + E (L - 1)/2 + E (L - 1)/L

with S the checkpoint bytes of a slot and E the bytes of one cache entry (u, k, g; for
Mamba-2 x, B, dt, C never cached). The
plain recurrence reads and writes S every step (2 S). With L = 1 every step flushes and
nothing is cached, so ReplaySSM moves exactly the plain bytes; for the state alone the ratio
is (1 + 1/L)/2.

`rebuild_flops` counts the on-chip work that a larger L buys: the rebuild of the live state
from `pos` entries is a `[d_v, pos] x [pos, d_k]` product per value head.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from replayssm_jax.config import ReplayConfig

G_CACHE_ITEMSIZE = 4  # the g cache is always float32


@dataclasses.dataclass(frozen=True)
class StepBytes:
    """HBM bytes of one decode step (or an average over steps), by component.

    Attributes:
      checkpoint_read: bytes of checkpoint (or plain state) read.
      checkpoint_write: bytes of checkpoint (or plain state) written.
      cache_read: bytes of valid (u, k, g) cache entries read for the rebuild.
      cache_append: bytes of (u, k, g) entries appended.
    """

    checkpoint_read: float = 0.0
    checkpoint_write: float = 0.0
    cache_read: float = 0.0
    cache_append: float = 0.0

    @property
    def state(self) -> float:
        """Checkpoint / state bytes only (read + write)."""
        return self.checkpoint_read + self.checkpoint_write

    @property
    def cache(self) -> float:
        """Cache bytes only (reads + appends)."""
        return self.cache_read + self.cache_append

    @property
    def total(self) -> float:
        return self.state + self.cache

    def __add__(self, other: StepBytes) -> StepBytes:
        return StepBytes(*(a + b for a, b in zip(_values(self), _values(other))))

    def scaled(self, factor: float) -> StepBytes:
        """Every component multiplied by `factor`."""
        return StepBytes(*(a * factor for a in _values(self)))


def _values(b: StepBytes) -> tuple[float, ...]:
    return tuple(getattr(b, f.name) for f in dataclasses.fields(StepBytes))


def state_bytes(config: ReplayConfig) -> int:
    """S: checkpoint bytes of one slot, `H_v d_v d_k` elements of the state dtype."""
    return config.state_bytes_per_slot()


def entry_bytes(config: ReplayConfig) -> int:
    """E: bytes of one cache entry of one slot: u `[H_v, d_v]` and k `[H_k, d_k]` in the
    cache dtype, g `[H_v]` (GDN) or `[H_v, d_k]` (KDA) in float32. Mamba-2 caches x `[H, P]`,
    B `[G, N]` and dt `[H]` in the same fields (`replayssm_jax.gates`), so the same count."""
    item = config.cache_dtype.itemsize
    g_per_head = config.head_k_dim if config.per_channel_gate else 1
    return (
        config.num_v_heads * config.head_v_dim * item
        + config.num_k_heads * config.head_k_dim * item
        + config.num_v_heads * g_per_head * G_CACHE_ITEMSIZE
    )


def slot_memory_bytes(config: ReplayConfig) -> int:
    """Memory of one slot of one layer: the checkpoint S plus the ring of L entries, S + L E
    (the plain recurrence keeps S alone)."""
    return state_bytes(config) + config.cache_len * entry_bytes(config)


def plain_step_bytes(config: ReplayConfig, batch: int) -> StepBytes:
    """Plain decode: every row reads and writes its full state (state dtype of `config`)."""
    s = batch * state_bytes(config)
    return StepBytes(checkpoint_read=s, checkpoint_write=s)


def _check_pos(config: ReplayConfig, pos: int) -> None:
    if not 0 <= pos < config.cache_len:
        raise ValueError(f"pos must be in [0, {config.cache_len}), got {pos}")


def replay_row_bytes(
    config: ReplayConfig,
    pos: int,
    *,
    force_flush: bool = False,
    flush_rereads_checkpoint: bool = False,
    read_all_entries: bool = False,
) -> StepBytes:
    """Bytes of one row whose slot holds `pos` valid entries before the step.

    Args:
      config: the layer.
      pos: the slot's cursor, 0 <= pos < L.
      force_flush: the caller forces a flush (a natural one happens at pos == L - 1).
      flush_rereads_checkpoint: the flush reads the checkpoint a second time to write the
        new state (as the SGLang Triton peer does, §10).
      read_all_entries: the rebuild loads all L cache positions of the slot (an unmasked
        kernel) instead of only the `pos` valid entries.
    """
    _check_pos(config, pos)
    s, e = state_bytes(config), entry_bytes(config)
    flush = force_flush or pos == config.cache_len - 1
    entries_read = config.cache_len if read_all_entries else pos
    reads = 2 if flush and flush_rereads_checkpoint else 1
    return StepBytes(
        checkpoint_read=reads * s,
        checkpoint_write=s if flush else 0,
        cache_read=entries_read * e,
        cache_append=0 if flush else e,
    )


def replay_step_bytes(config: ReplayConfig, cursors: Iterable[int], **row_options) -> StepBytes:
    """Bytes of one step of a batch whose rows sit at `cursors` (one cursor per row).

    `row_options` are passed to `replay_row_bytes` (not `force_flush`).
    """
    total = StepBytes()
    for pos in cursors:
        total = total + replay_row_bytes(config, int(pos), **row_options)
    return total


def replay_cycle_bytes(config: ReplayConfig, batch: int, **row_options) -> StepBytes:
    """Per-step bytes of `batch` rows averaged over a full cycle of L steps (cursor 0..L-1).

    This is also the per-step bytes of a batch whose cursors are evenly staggered over the
    cycle. `row_options` are passed to `replay_row_bytes` (not `force_flush`).
    """
    length = config.cache_len
    one_row = replay_step_bytes(config, range(length), **row_options)
    return one_row.scaled(batch / length)


def sync_cursors(step: int, batch: int, cache_len: int) -> list[int]:
    """Cursors of `batch` rows that all started together: every row at `step mod L`."""
    return [step % cache_len] * batch


def staggered_cursors(step: int, batch: int, cache_len: int) -> list[int]:
    """Cursors of `batch` rows spread over the cycle: row i at `(step + i) mod L`."""
    return [(step + i) % cache_len for i in range(batch)]


def rebuild_flops(config: ReplayConfig, pos: int) -> int:
    """Multiply-add FLOPs (2 per MAC) to rebuild one slot's live state from `pos` entries:
    `H_v` products `[d_v, pos] x [pos, d_k]` plus the decay of the checkpoint."""
    _check_pos(config, pos)
    elements = config.num_v_heads * config.head_v_dim * config.head_k_dim
    return 2 * elements * pos + elements


def floor_us(num_bytes: float, bandwidth_GBps: float) -> float:
    """Time to move `num_bytes` at `bandwidth_GBps` (1 GB/s = 1e9 B/s), in microseconds."""
    if bandwidth_GBps <= 0:
        raise ValueError(f"bandwidth_GBps must be positive, got {bandwidth_GBps}")
    return num_bytes / (bandwidth_GBps * 1e3)


def verify_fold_interval(cache_len: int, width: int, accepted: float) -> int:
    """Verify steps per fold of a row that keeps `accepted` tokens (bonus included) of
    every window of `width` tokens, in steady state.

    Capacity rule of `speculative.verify_step`: a row whose `write_pos + width > L` folds
    its history first and its cursor restarts at 0, so after a fold the cursor reads
    `accepted`, `2 accepted`, ... and the j-th step after the fold folds again at the first
    j with `j accepted + width > L`: every `floor((L - width) / accepted) + 1` steps.
    """
    if not 1 <= width <= cache_len:
        raise ValueError(f"width must be in [1, cache_len = {cache_len}], got {width}")
    if not 1 <= accepted <= width:
        raise ValueError(f"accepted must be in [1, width = {width}], got {accepted}")
    return int((cache_len - width) // accepted) + 1


def verify_written_per_token(config: ReplayConfig, width: int, accepted: float) -> float:
    """ReplaySSM verify: state bytes written per accepted token of one row and layer.

    Every verify step appends `width` records (`width * E`); every `verify_fold_interval`
    steps it also writes the checkpoint (S). Rejected records cost their append only.
    """
    folds = 1 / verify_fold_interval(config.cache_len, width, accepted)
    return (width * entry_bytes(config) + folds * state_bytes(config)) / accepted


def conventional_written_per_token(config: ReplayConfig, width: int, accepted: float) -> float:
    """Conventional speculative verify: one full state per window position is written (so
    any prefix can be rolled back), `width * S` per step, per accepted token."""
    if not 1 <= accepted <= width:
        raise ValueError(f"accepted must be in [1, width = {width}], got {accepted}")
    return width * state_bytes(config) / accepted
