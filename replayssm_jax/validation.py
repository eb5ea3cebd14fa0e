"""Argument checks shared by the package's public functions (`ValueError`s that name the
bad argument, its shape or its value)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import checkify
from jaxtyping import Array


def concrete_or_none(x) -> np.ndarray | None:
    """The value of `x` when it is known at trace time, else None (a jit tracer)."""
    try:
        return np.asarray(x)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        return None


def shape_error(name: str, want: tuple[int, ...], got: Array) -> ValueError:
    return ValueError(f"{name} must have shape {want}, got {tuple(jnp.shape(got))}")


def check_float(name: str, x: Array, want: tuple[int, ...]) -> None:
    """`x` is a floating array of shape `want`."""
    if tuple(jnp.shape(x)) != want:
        raise shape_error(name, want, x)
    if not jnp.issubdtype(jnp.result_type(x), jnp.floating):
        raise ValueError(f"{name} must be a floating array, got dtype {jnp.result_type(x)}")


def check_positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


def check_slots(name: str, slots: Array, batch: int, num_slots: int) -> None:
    """Validate a row -> slot map: int `[B]`; when concrete, each slot < N and used once.

    Negative slots are padding. Under `jit` the values cannot be read: out-of-range slots
    are then treated as padding rows by the step itself, and a slot named twice loses all
    but one row's update; `replayssm_jax.checked` raises on both (`debug_check`s).
    """
    if tuple(jnp.shape(slots)) != (batch,):
        raise ValueError(f"{name} must have shape ({batch},) (one per row), got {tuple(jnp.shape(slots))}")
    if not jnp.issubdtype(jnp.result_type(slots), jnp.integer):
        raise ValueError(f"{name} must be an integer array, got dtype {jnp.result_type(slots)}")
    debug_check_slots(name, slots, num_slots, unique=True)
    values = concrete_or_none(slots)
    if values is None:
        return
    if np.any(values >= num_slots):
        raise ValueError(f"{name} holds slot {int(values.max())}, but the state has {num_slots} slots")
    live = values[values >= 0]
    if np.unique(live).size != live.size:
        raise ValueError(f"{name} names a slot more than once: {values.tolist()}")


def check_flags(name: str, flags: Array | None, batch: int) -> None:
    """An optional per-row bool `[B]` array (e.g. `force_flush`)."""
    if flags is None:
        return
    if tuple(jnp.shape(flags)) != (batch,):
        raise shape_error(name, (batch,), flags)
    if jnp.result_type(flags) != jnp.bool_:
        raise ValueError(f"{name} must be bool, got dtype {jnp.result_type(flags)}")


def debug_check_slots(name: str, slots: Array, num_slots: int, *, unique: bool) -> None:
    """In-jit checks (active under `checkify` only): every slot < N; with `unique`, no
    live slot named twice."""
    slots = jnp.asarray(slots, jnp.int32)
    checkify.debug_check(
        jnp.all(slots < num_slots), f"{name} holds a slot >= {num_slots}: {{s}}", s=slots
    )
    if unique and slots.shape[0] > 1:
        # Padding entries become distinct negatives so that only live duplicates count.
        keyed = jnp.sort(jnp.where(slots >= 0, slots, -1 - jnp.arange(slots.shape[0])))
        checkify.debug_check(
            jnp.all(keyed[1:] != keyed[:-1]), f"{name} names a slot twice: {{s}}", s=slots
        )
