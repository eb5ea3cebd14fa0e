"""Public single-layer API: `decode_step`, `layer_step` and `materialize_state`, with input
validation and backend dispatch."""

from __future__ import annotations

import dataclasses

import numpy as np
from jaxtyping import Array, Bool, Float, Int

# Imported eagerly, not on first use: importing Pallas registers jax config options, and a
# first import during a trace would change the tracing context and cost one recompile.
from replayssm_jax.backends import BACKENDS, auto, mosaic_gpu, pallas_triton, xla
from replayssm_jax.plan import FlushPolicy, StepPlan, advance_write_pos, as_policy, default_flush_policy, plan_step
from replayssm_jax.state import ReplayState, check_state
from replayssm_jax.tokens import Tokens, check_gate_params, check_tokens
from replayssm_jax.validation import check_array, check_flags, check_slots


def check_backend(backend: str) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")


def layer_step(
    state: ReplayState,
    tokens: Tokens,
    plan: StepPlan,
    *,
    backend: str = "xla",
    use_qk_l2norm: bool = False,
    scale: float | None = None,
    gate_params: tuple[Array, Array] | None = None,
    kernel_params: pallas_triton.KernelParams | None = None,
) -> tuple[Float[Array, "B Hv Dv"], ReplayState]:
    """One layer's step under a precomputed plan; `write_pos` is left for the caller.

    Arguments as in `decode_step`; `plan` comes from `plan_step` (once per forward pass).
    """
    check_backend(backend)
    if backend == "auto":
        backend = auto.decode_backend(state.config, plan.slot.shape[0])
    if state.config.gate_kind.additive:
        return _mamba2_layer_step(state, tokens, plan, backend=backend, use_qk_l2norm=use_qk_l2norm,
                                  scale=scale, gate_params=gate_params, kernel_params=kernel_params)
    if backend == "xla":
        if kernel_params is not None:
            raise ValueError("kernel_params applies to the kernel backends ('pallas_triton', 'mosaic_gpu') only")
        return xla.layer_step(state, tokens, plan, use_qk_l2norm=use_qk_l2norm, scale=scale,
                              gate_params=gate_params)
    if backend == "mosaic_gpu":
        return mosaic_gpu.layer_step(state, tokens, plan, use_qk_l2norm=use_qk_l2norm, scale=scale,
                                     gate_params=gate_params, kernel_params=kernel_params)
    return pallas_triton.layer_step(state, tokens, plan, use_qk_l2norm=use_qk_l2norm, scale=scale,
                                    gate_params=gate_params, kernel_params=kernel_params)


def _mamba2_layer_step(state, tokens, plan, *, backend, use_qk_l2norm, scale, gate_params, kernel_params):
    """The Mamba-2 (additive rule) step: `gate_params` is the layer's `Mamba2Params`."""
    if use_qk_l2norm or scale is not None:
        raise ValueError("use_qk_l2norm and scale apply to the delta-rule gates, not to gate 'mamba2'")
    if backend == "xla":
        if kernel_params is not None:
            raise ValueError("kernel_params applies to the kernel backends ('pallas_triton', 'mosaic_gpu') only")
        return xla.mamba2_layer_step(state, tokens, plan, params=gate_params)
    if backend == "mosaic_gpu":
        return mosaic_gpu.mamba2_layer_step(state, tokens, plan, params=gate_params, kernel_params=kernel_params)
    return pallas_triton.mamba2_layer_step(state, tokens, plan, params=gate_params, kernel_params=kernel_params)


def decode_step(
    state: ReplayState,
    tokens: Tokens,
    slots: Int[Array, " B"],
    force_flush: Bool[Array, " B"] | None = None,
    *,
    backend: str = "xla",
    policy: FlushPolicy | str | None = None,
    use_qk_l2norm: bool = False,
    scale: float | None = None,
    gate_params: tuple[Array, Array] | None = None,
    kernel_params: pallas_triton.KernelParams | None = None,
) -> tuple[Float[Array, "B Hv Dv"], ReplayState]:
    """Decode one token per row through a ReplaySSM layer.

    Args:
      state: the layer's `ReplayState` (donate it under `jit` to update in place).
      tokens: `Tokens(q, k, v, g, beta)` with leading axis B (shapes in `Tokens`); for
        gate "mamba2" a `Mamba2Tokens(x, B, C, dt, z)`.
      slots: `[B]` int, the physical slot of each row; negative = padding row.
      force_flush: optional `[B]` bool, flush these rows now whatever their cursor.
      backend: "xla" (pure jax, the specification), "pallas_triton" (fused kernels;
        interpret mode off-GPU), "mosaic_gpu" (GDN, KDA and Mamba-2 on the Mosaic GPU
        kernels; interpret mode off-GPU) or "auto" (`backends.auto.decode_backend`: the
        one measured fastest for the layer and batch on this device; xla off GPU).
      policy: a `FlushPolicy` (or its value): NATURAL flushes a row when its slot holds
        L - 1 cached entries or when forced; EVERY_STEP flushes every live row. Default:
        `default_flush_policy(state.config, B, backend)`.
      use_qk_l2norm: L2-normalise q and k (`x / sqrt(sum x^2 + 1e-6)`).
      scale: multiplies q after the norm; default `d_k ** -0.5`.
      gate_params: optional `(A_log [H_v], dt_bias [H_v] or [H_v, d_k])`: `tokens.g` and
        `tokens.beta` then hold the raw model inputs `a` and `b`, and the step computes
        `g = -exp(A_log) softplus(a + dt_bias)`, `beta = sigmoid(b)` itself (inside the
        kernel on the pallas_triton backend). Gate "mamba2": a `Mamba2Params(A, D, dt_bias)`,
        required (tokens.dt is the raw dt).
      kernel_params: the pallas_triton backend's launch parameters (a kernel's parameter
        class, e.g. `ReplayGroupedParams`; default: the launch table's row), or a
        `MosaicReplayParams` (GDN) or `MosaicMamba2Params` (Mamba-2) for mosaic_gpu; with
        "auto", for the backend it resolves to.

    Returns:
      `(y, new_state)`: y `[B, H_v, d_v]` in v's dtype (Mamba-2: `[B, H, P]` in x's dtype),
      exactly 0 on padding rows.

    Raises:
      ValueError: on a wrong shape or dtype, an unknown backend or policy, or (when slots
        are concrete) a slot out of range or named twice.
    """
    check_state(state)
    batch = check_tokens(state.config, tokens)
    check_slots("slots", slots, batch, state.num_slots)
    check_flags("force_flush", force_flush, batch)
    check_gate_params(state.config, gate_params)
    check_backend(backend)
    policy = default_flush_policy(state.config, batch, backend) if policy is None else as_policy(policy)
    plan = plan_step(state.write_pos, slots, force_flush, state.config.cache_len, policy)
    y, new_state = layer_step(
        state, tokens, plan, backend=backend, use_qk_l2norm=use_qk_l2norm, scale=scale,
        gate_params=gate_params, kernel_params=kernel_params,
    )
    return y, dataclasses.replace(new_state, write_pos=advance_write_pos(state.write_pos, plan))


def materialize_state(state: ReplayState, slots: Int[Array, " B"], gate_params=None) -> Float[Array, "B Hv Dv Dk"]:
    """The live state of each row's slot, float32 `[B, H_v, d_v, d_k]` (0 for padding rows).

    This is the checkpoint replayed with the slot's valid cache entries: the state the next
    token would see. Gate "mamba2" needs `gate_params` (its `Mamba2Params`: the replay
    weights come from A); the delta-rule gates take none.
    """
    check_state(state)
    check_array("slots", slots, (None,), layout="a 1-D [B] array")
    check_slots("slots", slots, np.shape(slots)[0], state.num_slots)
    plan = plan_step(state.write_pos, slots, None, state.config.cache_len)
    if state.config.gate_kind.additive:
        check_gate_params(state.config, gate_params)
        return xla.mamba2_replay_state(state, plan, gate_params.A)
    if gate_params is not None:
        raise ValueError("materialize_state takes gate_params for gate 'mamba2' only")
    return xla.replay_state(state, plan)
