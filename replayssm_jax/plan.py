"""The flush plan of one decode step: which rows flush, decided on the device.

`plan_step` is computed once per forward pass (the cursors are shared by every layer of a
model), every layer's step runs under it, and `advance_write_pos` moves the cursors once.
Every backend given the same plan ends with the same cursors and, within the documented
tolerance, the same checkpoint and caches.

Flush policies:
  NATURAL     a row flushes when its slot already holds L - 1 cached entries
              (`write_pos == L-1`: L-1 entries + this token = a full window), or when the
              caller forces it (`force_flush`).
  EVERY_STEP  every live row flushes at every step ("fold every step"): a row's cached
              entries are folded into its checkpoint on its first such step, and from then
              on each step is the plain recurrence on the checkpoint. Same outputs, no
              cache traffic; the cursor returns to 0 every step.

`default_flush_policy` picks EVERY_STEP where it measured faster on the H200 than the
replay cycle on the Pallas-Triton kernels, whose fold is the plain kernel's step (small
batches; KDA with a 4-byte state; Mamba-2 up to B = 16 with a 4-byte state and at every
batch with a 2-byte one: benchmarks/NOTES.md), and NATURAL on the Mosaic GPU kernels,
whose fold is their flush step (slower than their replay cycle at every batch measured).
Given the same plan, every backend ends in the same state.
"""

from __future__ import annotations

import dataclasses
import enum

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Int

from replayssm_jax.backends import auto

from replayssm_jax.config import ReplayConfig


class FlushPolicy(enum.Enum):
    NATURAL = "natural"
    EVERY_STEP = "every_step"


# Largest batch at which the default policy folds every step, per state dtype size, for
# GDN; KDA with a 4-byte state folds at every batch. Measured on the H200 with the
# pallas_triton backend (benchmarks/NOTES.md: the folding kernel against the replay cycle).
_FOLD_MAX_BATCH = {4: 5, 2: 8}
# Mamba-2 on the Pallas-Triton kernels (NOTES: "mamba2 policy", "mamba2 fold tiles"):
# * 4-byte state: up to B = 16 the replay cycle on the replay row's narrow tile is slower
#   than the plain kernel, while folding every step runs at its speed; from B = 17 the
#   wider tile's replay cycle is faster than plain, so it takes over.
# * 2-byte state: the replay cycle is slower than plain at every batch measured, folding
#   every step at or above plain's speed: every batch folds.
_MAMBA2_FOLD_MAX_BATCH = {4: 16, 2: None}  # None: every batch


def default_flush_policy(config: ReplayConfig, batch: int, backend: str | None = None) -> FlushPolicy:
    """The policy `decode_step` uses when none is given, for `batch` rows of `config` on
    `backend` ("auto" as the step resolves it; None or any other: the Pallas-Triton
    measurements). "mosaic_gpu": NATURAL (a fold there is its flush step, which measured
    slower than its replay cycle at every batch, B = 1 and 8 included; NOTES: "backend
    "auto", policy per backend")."""
    if backend == "auto":
        backend = auto.decode_backend(config, batch)
    if backend == "mosaic_gpu":
        return FlushPolicy.NATURAL
    state_bytes = config.state_dtype.itemsize
    if config.gate == "mamba2":
        limit = _MAMBA2_FOLD_MAX_BATCH[state_bytes]
        return FlushPolicy.EVERY_STEP if limit is None or batch <= limit else FlushPolicy.NATURAL
    if config.gate == "kda" and state_bytes == 4:
        return FlushPolicy.EVERY_STEP
    if batch <= _FOLD_MAX_BATCH.get(state_bytes, 0):
        return FlushPolicy.EVERY_STEP
    return FlushPolicy.NATURAL


def as_policy(policy: FlushPolicy | str) -> FlushPolicy:
    try:
        return FlushPolicy(policy)
    except ValueError:
        names = tuple(p.value for p in FlushPolicy)
        raise ValueError(f"policy must be a FlushPolicy or one of {names}, got {policy!r}") from None


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StepPlan:
    """Per-row decisions of one decode step, computed once per forward pass.

    Attributes:
      slot: `[B]` int32, the row's slot, 0 for padding rows (safe to gather with).
      valid: `[B]` bool, False for padding rows (slot < 0 or slot >= N).
      pos: `[B]` int32, cached entries before this token (the write position).
      flush: `[B]` bool, the row writes its checkpoint this step (False on padding rows).
      launch_order: `[B]` int32, a permutation of the rows, costliest step first: flushing
        rows, then appending rows, each by descending `pos`, then padding rows. Kernels
        launched in this order start the long flush programs first instead of leaving some
        of them at the end of the launch; where nothing reads it, jit drops the sort.
      policy: the flush policy the plan was made under (static).
    """

    slot: Int[Array, " B"]
    valid: Bool[Array, " B"]
    pos: Int[Array, " B"]
    flush: Bool[Array, " B"]
    launch_order: Int[Array, " B"]
    policy: FlushPolicy = dataclasses.field(default=FlushPolicy.NATURAL, metadata=dict(static=True))

    @property
    def batch(self) -> int:
        return self.slot.shape[0]


def plan_step(
    write_pos: Int[Array, " N"],
    slots: Int[Array, " B"],
    force_flush: Bool[Array, " B"] | None,
    cache_len: int,
    policy: FlushPolicy | str = FlushPolicy.NATURAL,
) -> StepPlan:
    """The step's plan for `slots` (negative or >= N: padding) under `policy`; `slots` and
    `force_flush` may be any array-likes (lists, NumPy arrays)."""
    policy = as_policy(policy)
    num_slots = write_pos.shape[0]
    slots = jnp.asarray(slots, jnp.int32)
    valid = (slots >= 0) & (slots < num_slots)
    slot = jnp.where(valid, slots, 0)
    pos = jnp.where(valid, write_pos[slot], 0)
    flush = (pos >= cache_len - 1) | (policy is FlushPolicy.EVERY_STEP)
    if force_flush is not None:
        flush = flush | jnp.asarray(force_flush, bool)
    flush = flush & valid
    return StepPlan(slot=slot, valid=valid, pos=pos, flush=flush,
                    launch_order=launch_order(valid, pos, flush, cache_len), policy=policy)


def launch_order(
    valid: Bool[Array, " B"], pos: Int[Array, " B"], flush: Bool[Array, " B"], cache_len: int
) -> Int[Array, " B"]:
    """Rows by descending cost of their step (see `StepPlan.launch_order`); stable, so a
    step whose rows all cost the same keeps the rows in order."""
    cost = jnp.where(valid, jnp.where(flush, cache_len + pos, pos), -1)
    return jnp.argsort(-cost, stable=True).astype(jnp.int32)


def advance_write_pos(write_pos: Int[Array, " N"], plan: StepPlan) -> Int[Array, " N"]:
    """Cursor after the step: 0 for flushed slots, pos + 1 otherwise; padding rows untouched."""
    num_slots = write_pos.shape[0]
    target = jnp.where(plan.valid, plan.slot, num_slots)  # out of range: dropped
    new_pos = jnp.where(plan.flush, 0, plan.pos + 1).astype(jnp.int32)
    return write_pos.at[target].set(new_pos, mode="drop")
