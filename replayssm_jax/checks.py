"""Debug mode: the package's in-jit argument checks, raised through `jax.experimental.checkify`.

Under `jit` slot maps, token ids and lengths are tracers, so the `ValueError` checks at the
Python boundary cannot read them. The public functions also state those checks with
`checkify.debug_check`, which is a no-op unless the function runs under `checkify`: the
checks are off by default and cost nothing then. `checked(fn)` turns them on:

    step = checked(decode_step, static_argnames=("backend",))
    y, state = step(state, tokens, slots)   # raises checkify.JaxRuntimeError on a bad slot

What is checked (each names the argument and its values):

* the slot map of `decode_step` (layer and model decoder) and `materialize_state`: a
  slot >= N, a slot named twice in one batch;
* slot operations (`reset_slots`, `flush_slots`, `copy_slots`, `snapshot`): a slot >= N,
  a destination named twice, a padding source paired with a live destination, a snapshot
  of a slot with cached entries (not flushed);
* speculative verify (`verify_step`, `accept`): a slot >= N or named twice, lengths outside
  `[0, T]`, a parent that does not precede its child, a negative accept count, a count that
  moves a cursor past the ring (the window would outgrow it), an accepted path that is not
  increasing or reaches past the ring;
* the model decoder (`decode_step`, `prefill`): a token id outside `[0, vocab)` on a live
  row (live positions only in `prefill`), a prefill length outside `[0, T]`, a slot >= N.

A copy onto a slot that another row of the same step uses cannot happen: copies and steps
are separate calls, each reading its whole input state.

The checks are traced only inside `checked` (`validation.debug_check`): a plain trace has
none, so its jaxpr has no effects and jitted calls keep JAX's fast C++ dispatch (a check in
a jaxpr, even one that lowers to nothing, sends every call down the Python dispatch path).
Wrap the function itself, not an already-jitted one: a `jax.jit` function traced before
keeps the trace it cached, without the checks; and `jax.experimental.checkify.checkify`
applied directly sees none of them: use `checked`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
from jax.experimental import checkify

from replayssm_jax.validation import tracing_checks


def checked(fn: Callable, **jit_kwargs) -> Callable:
    """`fn` jitted (with `jit_kwargs`, e.g. `donate_argnums`) with its debug checks on.

    The returned function raises `checkify.JaxRuntimeError` when a check fails, after the
    jitted call returns (the state arguments are then donated and gone, as for a
    successful call), and returns `fn`'s result otherwise.
    """
    @functools.wraps(fn)
    def traced_with_checks(*args, **kwargs):
        with tracing_checks():
            return fn(*args, **kwargs)

    run = jax.jit(checkify.checkify(traced_with_checks, errors=checkify.user_checks), **jit_kwargs)

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        err, out = run(*args, **kwargs)
        err.throw()
        return out

    return wrapper
