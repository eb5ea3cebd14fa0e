"""Slot operations on a `ModelState`: pure functions, usable under `jit` (donate the state).

A slot is one physical row of every layer's state pool. Slot arrays are int `[B]`; a
negative entry is a padding entry and is ignored, so a fixed-size array serves any number
of live entries without recompiling.

Validation happens twice:

* at the Python boundary, when the slot values are concrete (eager calls): a clear
  `ValueError` for a slot >= N, a duplicate where it matters, or mismatched lengths;
* inside `jit` the values are tracers: run the op (or your step) through
  `replayssm_jax.checked` to get the in-jit checks, e.g. `checked(reset_slots)(state,
  slots)` raises `checkify.JaxRuntimeError`. The checks are traced only there
  (`validation.debug_check`), so plain traces carry none.

Without the checks, under `jit`, a slot >= N is padding everywhere: its writes are dropped
and its reads give zeros (live state, checkpoint, conv state), never another slot's data.

Every op takes a `ModelState` or a `HybridState` (a stack of layers of different kinds,
`model.state`): on a hybrid state it runs layer by layer on one-layer views, and the
per-layer arrays it takes or returns (checkpoints, conv states, live states, `Snapshot`
fields) are tuples with one `[B, ...]` array per layer instead of `[Y, B, ...]` stacks.
Ops that rebuild a live state (`flush_slots`, `copy_slots`, `live_states`) need each Mamba-2
layer's decay rates: `gate_params`, see `live_states`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from replayssm_jax.backends.xla import mamba2_replay_state, replay_state
from replayssm_jax.model.state import (
    HybridState,
    ModelState,
    Snapshot,
    check_hybrid_state,
    check_model_state,
    from_layer_views,
    layer_views,
)
from replayssm_jax.plan import plan_step
from replayssm_jax.state import ReplayState
from replayssm_jax.tokens import Mamba2Params
from replayssm_jax.validation import check_array, check_positive_int, concrete_or_none, debug_check, debug_check_slots


def check_slots_arg(name: str, slots: Array, num_slots: int, *, unique: bool) -> Int[Array, " B"]:
    """`slots` as int32 `[B]` after the boundary checks; adds the in-jit checkify checks."""
    check_array(name, slots, (None,), int, layout="a 1-D [B] array")
    values = concrete_or_none(slots)
    if values is not None:
        if (values >= num_slots).any():
            raise ValueError(
                f"{name} holds slot {int(values.max())}, but the state has {num_slots} slots "
                f"(valid: 0..{num_slots - 1}, negative = padding)"
            )
        live = values[values >= 0]
        if unique and len(set(live.tolist())) != live.size:
            raise ValueError(f"{name} names a slot more than once: {values.tolist()}")
    slots = jnp.asarray(slots, jnp.int32)
    debug_check_slots(name, slots, num_slots, unique=unique)
    return slots


def _target(slots: Int[Array, " B"], num_slots: int) -> Int[Array, " B"]:
    """Scatter index: padding entries point past the end (dropped by mode="drop")."""
    return jnp.where(slots >= 0, slots, num_slots)


def live_entries(slots: Int[Array, " B"], num_slots: int) -> tuple[Bool[Array, " B"], Int[Array, " B"]]:
    """`(valid, gather index)`: valid = 0 <= slot < N; the index is 0 on the others, whose
    gathered values must then be zeroed (a gather clamps an index >= N to slot N - 1)."""
    valid = (slots >= 0) & (slots < num_slots)
    return valid, jnp.where(valid, slots, 0)


def keep_rows(valid: Bool[Array, " B"], x: Array) -> Array:
    """`x [Y, B, ...]` with the rows of invalid entries zeroed."""
    return jnp.where(valid.reshape(1, -1, *([1] * (x.ndim - 2))), x, 0)


def check_gate_params(state: ModelState | HybridState, gate_params) -> None:
    """`gate_params` of the ops that rebuild live states (see `live_states`)."""
    if isinstance(state, HybridState):
        if not isinstance(gate_params, tuple) or len(gate_params) != state.num_layers:
            raise ValueError(f"gate_params must be a tuple with one entry per layer ({state.num_layers}: None for "
                             f"the delta-rule layers, Mamba2Params for the Mamba-2 layers) for a hybrid state, "
                             f"got {type(gate_params).__name__}")
        for i, (view, params) in enumerate(zip(layer_views(state), gate_params)):
            _check_layer_gate_params(f"gate_params[{i}]", view, params, ())
        return
    _check_layer_gate_params("gate_params", state, gate_params, (state.num_layers,))


def _check_layer_gate_params(name: str, state: ModelState, params, lead: tuple[int, ...]) -> None:
    if not state.config.gate_kind.additive:
        if params is not None:
            raise ValueError(f"{name} must be None for a layer of gate {state.config.gate!r}")
        return
    if not isinstance(params, Mamba2Params):
        raise ValueError(f"{name} must be the Mamba-2 layer's Mamba2Params (its A sets the replay weights), got "
                         f"{type(params).__name__}")
    want = (*lead, state.config.num_v_heads)
    if tuple(jnp.shape(params.A)) != want:
        raise ValueError(f"{name}.A must have shape {want}, got {tuple(jnp.shape(params.A))}")


def live_states(state: ModelState | HybridState, slots: Int[Array, " B"], gate_params=None):
    """Every layer's live state of each slot (checkpoint replayed with its valid cache), float32:
    `[Y, B, H_v, d_v, d_k]`, or for a `HybridState` a tuple of one `[B, ...]` per layer.

    `gate_params`: None for GDN/KDA layers. A Mamba-2 `ModelState` needs its layers'
    `Mamba2Params` stacked over layers (`A [Y, H]`); a `HybridState` a tuple with one entry
    per layer (None, or that Mamba-2 layer's `Mamba2Params`, `A [H]`).

    Padding entries give zeros. Slots and params are not validated here (see the public ops).
    """
    if isinstance(state, HybridState):
        return tuple(live_states(view, slots, _stacked_params(params))[0]
                     for view, params in zip(layer_views(state), gate_params))
    plan = plan_step(state.write_pos, slots, None, state.config.cache_len)

    def one_layer(checkpoint, u_cache, k_cache, g_cache, *decay_rates):
        layer = ReplayState(
            checkpoint, u_cache, k_cache, g_cache, state.write_pos, config=state.config
        )
        return mamba2_replay_state(layer, plan, *decay_rates) if decay_rates else replay_state(layer, plan)

    decay_rates = (gate_params.A,) if state.config.gate_kind.additive else ()
    return jax.vmap(one_layer)(state.checkpoint, state.u_cache, state.k_cache, state.g_cache, *decay_rates)


def _per_layer(state: HybridState, op, layer_args) -> HybridState:
    """`op(view, *args)` on each layer's one-layer view; the cursor from the first result
    (every layer's op moves it the same way)."""
    views = [op(view, *args) for view, args in zip(layer_views(state), layer_args)]
    return from_layer_views(state, views, views[0].write_pos)


def _stacked(x) -> Array | None:
    """One layer's `[B, ...]` array (or None) as a one-layer stack `[1, B, ...]`."""
    return None if x is None else jnp.asarray(x)[None]


def _stacked_params(params):
    return None if params is None else jax.tree.map(lambda a: a[None], params)


def _per_layer_arrays(name: str, state: HybridState, arrays) -> tuple:
    """A hybrid op's per-layer argument: None (every layer None) or a tuple of one per layer."""
    if arrays is None:
        return (None,) * state.num_layers
    if not isinstance(arrays, (tuple, list)) or len(arrays) != state.num_layers:
        raise ValueError(f"{name} must be a tuple with one [B, ...] array per layer ({state.num_layers}) for a "
                         f"hybrid state, got {type(arrays).__name__}")
    return tuple(arrays)


def reset_slots(
    state: ModelState | HybridState,
    slots: Int[Array, " B"],
    checkpoint: Float[Array, "Y B Hv Dv Dk"] | tuple | None = None,
    conv_state: Float[Array, "Y B Km1 C"] | tuple | None = None,
) -> ModelState | HybridState:
    """Start `slots` afresh: zero (or given) checkpoint and conv state, empty cache (cursor 0).

    Restoring a prefix snapshot is `reset_slots(state, slots, snap.checkpoint,
    snap.conv_state)`. Cache entries are not zeroed: cursor 0 makes them stale (never read).

    Raises:
      ValueError: slot >= N, a slot named twice, or a checkpoint / conv state whose shape
        is not `[Y, B, ...]` for this state (per layer `[B, ...]` for a hybrid state).
    """
    if isinstance(state, HybridState):
        check_hybrid_state(state)
        checkpoints = _per_layer_arrays("checkpoint", state, checkpoint)
        convs = _per_layer_arrays("conv_state", state, conv_state)
        return _per_layer(state, reset_slots, [(slots, _stacked(c), _stacked(v)) for c, v in zip(checkpoints, convs)])
    check_model_state(state)
    slots = check_slots_arg("slots", slots, state.num_slots, unique=True)
    rows = (state.num_layers, slots.shape[0])
    if checkpoint is None:
        checkpoint = jnp.zeros((*rows, *state.checkpoint.shape[2:]), state.checkpoint.dtype)
    check_array("checkpoint", checkpoint, (*rows, *state.checkpoint.shape[2:]), float)
    if conv_state is None:
        conv_state = jnp.zeros((*rows, *state.conv_state.shape[2:]), state.conv_state.dtype)
    check_array("conv_state", conv_state, (*rows, *state.conv_state.shape[2:]), float)
    target = _target(slots, state.num_slots)
    return dataclasses.replace(
        state,
        checkpoint=state.checkpoint.at[:, target].set(
            checkpoint.astype(state.checkpoint.dtype), mode="drop"
        ),
        conv_state=state.conv_state.at[:, target].set(
            conv_state.astype(state.conv_state.dtype), mode="drop"
        ),
        write_pos=state.write_pos.at[target].set(0, mode="drop"),
    )


def flush_slots(state: ModelState | HybridState, slots: Int[Array, " B"], gate_params=None) -> ModelState | HybridState:
    """Write each slot's live state into its checkpoint in every layer; cursor 0, no token.
    `gate_params`: as in `live_states` (Mamba-2 layers only).

    Raises:
      ValueError: slot >= N, a slot named twice, or gate_params missing or not matching.
    """
    if isinstance(state, HybridState):
        check_hybrid_state(state)
        check_gate_params(state, gate_params)
        return _per_layer(state, flush_slots, [(slots, _stacked_params(p)) for p in gate_params])
    check_model_state(state)
    check_gate_params(state, gate_params)
    slots = check_slots_arg("slots", slots, state.num_slots, unique=True)
    live = live_states(state, slots, gate_params).astype(state.checkpoint.dtype)
    target = _target(slots, state.num_slots)
    return dataclasses.replace(
        state,
        checkpoint=state.checkpoint.at[:, target].set(live, mode="drop"),
        write_pos=state.write_pos.at[target].set(0, mode="drop"),
    )


def copy_slots(
    state: ModelState | HybridState, src: Int[Array, " B"], dst: Int[Array, " B"], gate_params=None
) -> ModelState | HybridState:
    """`dst[i]` gets `src[i]`'s LIVE state (its cache replayed) and conv state, empty cache.

    Works whatever the source's cursor; the source is left as it is. All sources are read
    before any destination is written. A pair with `dst[i] < 0` is padding. Under `jit`
    (values unchecked) a `src[i] >= N` reads as zeros: `dst[i]` gets a zero checkpoint and
    conv state. `gate_params`: as in `live_states` (Mamba-2 layers only).

    Raises:
      ValueError: src and dst of different lengths, a slot >= N, a dst named twice, a
        padding src paired with a live dst, or gate_params missing or not matching.
    """
    if isinstance(state, HybridState):
        check_hybrid_state(state)
        check_gate_params(state, gate_params)
        return _per_layer(state, copy_slots, [(src, dst, _stacked_params(p)) for p in gate_params])
    check_model_state(state)
    check_gate_params(state, gate_params)
    if jnp.shape(src) != jnp.shape(dst):
        raise ValueError(
            f"src and dst must have the same shape, got {tuple(jnp.shape(src))} and "
            f"{tuple(jnp.shape(dst))}"
        )
    src = check_slots_arg("src", src, state.num_slots, unique=False)
    dst = check_slots_arg("dst", dst, state.num_slots, unique=True)
    src_values, dst_values = concrete_or_none(src), concrete_or_none(dst)
    if src_values is not None and dst_values is not None:
        if ((src_values < 0) & (dst_values >= 0)).any():
            raise ValueError(f"src has padding where dst names a slot: {src.tolist()} -> {dst.tolist()}")
    debug_check(
        jnp.all((src >= 0) | (dst < 0)), "src has padding where dst names a slot: {s}", s=src
    )
    live = live_states(state, src, gate_params).astype(state.checkpoint.dtype)
    valid, index = live_entries(src, state.num_slots)
    conv = keep_rows(valid, state.conv_state[:, index])
    target = _target(dst, state.num_slots)
    return dataclasses.replace(
        state,
        checkpoint=state.checkpoint.at[:, target].set(live, mode="drop"),
        conv_state=state.conv_state.at[:, target].set(conv, mode="drop"),
        write_pos=state.write_pos.at[target].set(0, mode="drop"),
    )


def track_flush(seq_lens: Int[Array, " B"], track_interval: int) -> Bool[Array, " B"]:
    """Per-row `force_flush` that lands the checkpoint exactly on prefix-cache track positions.

    `seq_lens[i]` is row i's sequence length INCLUDING this step's input token (SGLang's
    decode `seq_lens`): the step's input is token number `seq_lens` (1-based), so a flush
    on this step writes the state after exactly `seq_lens` tokens. Flushing where
    `seq_lens % track_interval == 0` therefore writes the state at each track position.
    Rows with `seq_lens <= 0` (padding) never flush.
    """
    track_interval = check_positive_int("track_interval", track_interval)
    seq_lens = jnp.asarray(seq_lens)
    check_array("seq_lens", seq_lens, (None,), int, layout="a 1-D [B] array")
    return (seq_lens > 0) & (seq_lens % track_interval == 0)


def snapshot(state: ModelState | HybridState, slots: Int[Array, " B"]) -> Snapshot:
    """Read the checkpoint and conv state of flushed slots (cursor 0); zeros for padding
    (and, under `jit` where the values are unchecked, for a slot >= N).

    Between flushes the checkpoint is not the live state, so a slot with cached entries
    is an error: `ValueError` when `state.write_pos` is concrete, a `checkify` error
    under `jit` through `replayssm_jax.checked`. Without the checks, under `jit`, such a
    slot's snapshot is its checkpoint as stored (the state at its last flush, not the
    live one). Flush it first (`flush_slots`) or force the flush at the track position
    (`track_flush`). A hybrid state's snapshot holds tuples (one `[B, ...]` per layer).
    """
    if isinstance(state, HybridState):
        check_hybrid_state(state)
        parts = [snapshot(view, slots) for view in layer_views(state)]
        return Snapshot(checkpoint=tuple(p.checkpoint[0] for p in parts),
                        conv_state=tuple(p.conv_state[0] for p in parts))
    check_model_state(state)
    slots = check_slots_arg("slots", slots, state.num_slots, unique=False)
    valid, slot = live_entries(slots, state.num_slots)
    cursors = jnp.where(valid, state.write_pos[slot], 0)
    values = concrete_or_none(cursors)
    if values is not None and values.any():
        raise ValueError(
            f"snapshot of unflushed slots: cursors {values.tolist()} for slots "
            f"{slots.tolist()} (must be 0; flush first)"
        )
    debug_check(
        jnp.all(cursors == 0), "snapshot of unflushed slots, cursors {c}", c=cursors
    )
    return Snapshot(
        checkpoint=keep_rows(valid, state.checkpoint[:, slot]),
        conv_state=keep_rows(valid, state.conv_state[:, slot]),
    )
