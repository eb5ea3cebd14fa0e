"""Argument checks shared by the package's public functions (`ValueError`s that name the
bad argument, its shape or its value).

Shapes and dtypes are matched by chex (`chex.assert_shape` / `assert_type`) on the static
shapes, so under `jit` they run once, at trace time; the messages are the package's own,
naming the argument. `chex.disable_asserts()` turns these shape and dtype checks off too.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator, Sequence
from types import EllipsisType

import chex
import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import checkify
from jaxtyping import Array

# What a message says a dtype kind must be.
_KINDS = {float: "a floating array", int: "an integer array", bool: "bool"}


def concrete_or_none(x) -> np.ndarray | None:
    """The value of `x` when it is known at trace time, else None (a jit tracer)."""
    try:
        return np.asarray(x)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        return None


def _shaped(x):
    """`x` itself when it has a shape and dtype (arrays, tracers, `ShapeDtypeStruct`s), else
    as a numpy array (lists, scalars)."""
    return x if hasattr(x, "shape") and hasattr(x, "dtype") else np.asarray(x)


def check_array(
    name: str,
    x: Array,
    shape: Sequence[int | None | EllipsisType],
    dtype: type | jnp.dtype | None = None,
    *,
    layout: str | None = None,
) -> None:
    """Raise ValueError naming `name` unless `x` has `shape` and `dtype`.

    Args:
      name: the argument as the caller knows it (e.g. "tokens.q").
      x: an array, tracer or array-like.
      shape: a chex shape spec: an int per axis, None for an axis of any size, `...` for any
        number of axes.
      dtype: None (any), `float` or `int` (any floating / integer dtype), `bool`, or a dtype.
      layout: how the message states the expected shape (e.g. "[B, H_k, d_k]"), for specs
        with free axes; default: `shape` itself.
    """
    x = _shaped(x)
    try:
        chex.assert_shape(x, tuple(shape))
    except AssertionError:
        if layout is None:
            raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(x.shape)}") from None
        raise ValueError(f"{name} must be {layout}, got shape {tuple(x.shape)}") from None
    if dtype is None:
        return
    try:
        chex.assert_type(x, dtype)
    except AssertionError:
        want = _KINDS.get(dtype) or f"of dtype {jnp.dtype(dtype)}"
        raise ValueError(f"{name} must be {want}, got dtype {x.dtype}") from None


def check_like(name: str, x: Array, want: jax.ShapeDtypeStruct, *, context: str = "") -> None:
    """Raise ValueError unless `x` has exactly `want`'s shape and dtype (a state field);
    `context` ends the expectation in the message (e.g. " for <config>")."""
    x = _shaped(x)
    try:
        chex.assert_shape(x, want.shape)
        chex.assert_type(x, want.dtype)
    except AssertionError:
        raise ValueError(
            f"{name} must have shape {tuple(want.shape)} and dtype {want.dtype}{context}, got "
            f"{tuple(x.shape)} {x.dtype}"
        ) from None


def check_positive_int(name: str, value: object) -> int:
    """`value` as an int, if it is a positive integer (a bool is not one)."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


def check_slots(name: str, slots: Array, batch: int, num_slots: int) -> None:
    """Validate a row -> slot map: int `[B]`; when concrete, each slot < N and used once.

    Negative slots are padding. Under `jit` the values cannot be read: out-of-range slots
    are then treated as padding rows by the step itself, and a slot named twice loses all
    but one row's update; `replayssm_jax.checked` raises on both (`debug_check`s).
    """
    check_array(name, slots, (batch,), int)
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
    check_array(name, flags, (batch,), bool)


# Set while `replayssm_jax.checked` traces a function (see `debug_check`).
_TRACING_CHECKS = contextvars.ContextVar("replayssm_tracing_checks", default=False)


@contextlib.contextmanager
def tracing_checks() -> Iterator[None]:
    """Emit the package's in-jit checks while tracing inside this context."""
    token = _TRACING_CHECKS.set(True)
    try:
        yield
    finally:
        _TRACING_CHECKS.reset(token)


def debug_check(pred: Array, message: str, **fmt_args) -> None:
    """`checkify.debug_check(pred, message, **fmt_args)`, emitted only while
    `replayssm_jax.checked` traces. A check in a jaxpr gives it an effect, and JAX sends
    every call of a jitted function with effects down its slow Python dispatch path, so
    the checks stay out of plain traces altogether."""
    if _TRACING_CHECKS.get():
        checkify.debug_check(pred, message, **fmt_args)


def debug_check_slots(name: str, slots: Array, num_slots: int, *, unique: bool) -> None:
    """In-jit checks (traced under `replayssm_jax.checked` only): every slot < N; with
    `unique`, no live slot named twice."""
    slots = jnp.asarray(slots, jnp.int32)
    debug_check(
        jnp.all(slots < num_slots), f"{name} holds a slot >= {num_slots}: {{s}}", s=slots
    )
    if unique and slots.shape[0] > 1:
        # Padding entries become distinct negatives so that only live duplicates count.
        keyed = jnp.sort(jnp.where(slots >= 0, slots, -1 - jnp.arange(slots.shape[0])))
        debug_check(
            jnp.all(keyed[1:] != keyed[:-1]), f"{name} names a slot twice: {{s}}", s=slots
        )
