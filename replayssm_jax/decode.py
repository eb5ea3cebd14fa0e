"""Public single-layer API: `decode_step` and `materialize_state`, with input validation."""

from __future__ import annotations

import dataclasses
from typing import Literal

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int

# Imported eagerly, not on first use: importing Pallas registers jax config options, and a
# first import during a trace would change the tracing context and cost one recompile.
from pallas_kernels import ops as pallas_ops
from pallas_kernels.common import KernelConfig, concrete_or_none
from replayssm_jax import gating, replay
from replayssm_jax.config import ReplayConfig
from replayssm_jax.state import ReplayState, check_state

Backend = Literal["xla", "pallas"]
BACKENDS: tuple[str, ...] = ("xla", "pallas")


def _shape_error(name: str, want: tuple[int, ...], got: Array) -> ValueError:
    return ValueError(f"{name} must have shape {want}, got {tuple(jnp.shape(got))}")


def _check_float(name: str, x: Array, want: tuple[int, ...]) -> None:
    if tuple(jnp.shape(x)) != want:
        raise _shape_error(name, want, x)
    if not jnp.issubdtype(jnp.result_type(x), jnp.floating):
        raise ValueError(f"{name} must be a floating array, got dtype {jnp.result_type(x)}")


def check_slots(name: str, slots: Array, batch: int, num_slots: int) -> None:
    """Validate a row -> slot map: int `[B]`; when concrete, each slot < N and used once.

    Negative slots are padding. Under `jit` the values cannot be read: out-of-range slots
    are then treated as padding rows by the step itself.
    """
    if tuple(jnp.shape(slots)) != (batch,):
        raise ValueError(f"{name} must have shape ({batch},) (one per row), got {tuple(jnp.shape(slots))}")
    if not jnp.issubdtype(jnp.result_type(slots), jnp.integer):
        raise ValueError(f"{name} must be an integer array, got dtype {jnp.result_type(slots)}")
    values = concrete_or_none(slots)
    if values is None:
        return
    if np.any(values >= num_slots):
        raise ValueError(f"{name} holds slot {int(values.max())}, but the state has {num_slots} slots")
    live = values[values >= 0]
    if np.unique(live).size != live.size:
        raise ValueError(f"{name} names a slot more than once: {values.tolist()}")


def check_step_inputs(
    config: ReplayConfig,
    num_slots: int,
    q: Array,
    k: Array,
    v: Array,
    g: Array,
    beta: Array,
    slots: Array,
    force_flush: Array | None,
) -> None:
    """Raise ValueError naming the argument whose shape or dtype is wrong."""
    if jnp.ndim(q) != 3:
        raise ValueError(f"q must be [B, H_k, d_k], got shape {tuple(jnp.shape(q))}")
    batch = jnp.shape(q)[0]
    hk, hv, dk, dv = config.num_k_heads, config.num_v_heads, config.head_k_dim, config.head_v_dim
    _check_float("q", q, (batch, hk, dk))
    _check_float("k", k, (batch, hk, dk))
    _check_float("v", v, (batch, hv, dv))
    _check_float("g", g, config.g_shape(batch))
    _check_float("beta", beta, (batch, hv))
    check_slots("slots", slots, batch, num_slots)
    if force_flush is not None:
        if tuple(jnp.shape(force_flush)) != (batch,):
            raise _shape_error("force_flush", (batch,), force_flush)
        if jnp.result_type(force_flush) != jnp.bool_:
            raise ValueError(f"force_flush must be bool, got dtype {jnp.result_type(force_flush)}")


def check_gate_params(config: ReplayConfig, gate_params) -> None:
    """`gate_params = (A_log [H_v], dt_bias [H_v] (GDN) or [H_v, d_k] (KDA))`."""
    if gate_params is None:
        return
    if not isinstance(gate_params, (tuple, list)) or len(gate_params) != 2:
        raise ValueError("gate_params must be a pair (A_log, dt_bias)")
    a_log, dt_bias = gate_params
    hv = config.num_v_heads
    _check_float("gate_params[0] (A_log)", a_log, (hv,))
    want = (hv, config.head_k_dim) if config.per_channel_gate else (hv,)
    _check_float("gate_params[1] (dt_bias)", dt_bias, want)


def step_plan(
    config: ReplayConfig,
    write_pos: Int[Array, " N"],
    slots: Int[Array, " B"],
    force_flush: Bool[Array, " B"] | None,
    *,
    backend: Backend,
    kernel_config=None,
) -> tuple[replay.StepPlan, KernelConfig | None]:
    """The step's flush plan and the pallas backend's launch configuration (None for xla).

    The pallas backend's configuration can ask for a flush of every live row
    (`KernelConfig.flush_every_step`, set by the package's table at batch <= 5, <= 8 for
    2-byte states, and at every batch for KDA with a 4-byte state); the plan then says
    so, and `advance_write_pos` keeps the cursors consistent.
    """
    if backend == "pallas":
        kernel_config = pallas_ops.layer_kernel_config(config, jnp.shape(slots)[0], kernel_config)
    every_step = backend == "pallas" and kernel_config.flush_every_step
    plan = replay.plan_step(write_pos, slots, force_flush, config.cache_len, every_step)
    return plan, kernel_config


def layer_step(
    state: ReplayState,
    q: Float[Array, "B Hk Dk"],
    k: Float[Array, "B Hk Dk"],
    v: Float[Array, "B Hv Dv"],
    g: Float[Array, "B Hv *Dk"],
    beta: Float[Array, "B Hv"],
    plan: replay.StepPlan,
    *,
    backend: Backend = "xla",
    use_qk_l2norm: bool = False,
    scale: float | None = None,
    gate_params: tuple[Array, Array] | None = None,
    kernel_config=None,
) -> tuple[Float[Array, "B Hv Dv"], ReplayState]:
    """One layer's step under a precomputed plan; `write_pos` is left for the caller.

    With `gate_params`, `g` and `beta` hold the raw gate inputs `a` and `b` (see
    `decode_step`).
    """
    if backend == "xla":
        if kernel_config is not None:
            raise ValueError("kernel_config applies to backend='pallas' only")
        if gate_params is not None:
            gate = gating.kda_gate if state.config.per_channel_gate else gating.gdn_gate
            g, beta = gate(g, *gate_params), gating.beta_gate(beta)
        return replay.xla_layer_step(
            state, q, k, v, g, beta, plan, use_qk_l2norm=use_qk_l2norm, scale=scale
        )
    if backend == "pallas":
        return pallas_ops.pallas_layer_step(
            state, q, k, v, g, beta, plan, use_qk_l2norm=use_qk_l2norm, scale=scale,
            gate_params=gate_params, kernel_config=kernel_config,
        )
    raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")


def decode_step(
    state: ReplayState,
    q: Float[Array, "B Hk Dk"],
    k: Float[Array, "B Hk Dk"],
    v: Float[Array, "B Hv Dv"],
    g: Float[Array, "B Hv *Dk"],
    beta: Float[Array, "B Hv"],
    slots: Int[Array, " B"],
    force_flush: Bool[Array, " B"] | None = None,
    *,
    backend: Backend = "xla",
    use_qk_l2norm: bool = False,
    scale: float | None = None,
    gate_params: tuple[Array, Array] | None = None,
    kernel_config=None,
) -> tuple[Float[Array, "B Hv Dv"], ReplayState]:
    """Decode one token per row through a ReplaySSM layer.

    Args:
      state: the layer's `ReplayState` (donate it under `jit` to update in place).
      q, k: `[B, H_k, d_k]`.
      v: `[B, H_v, d_v]`.
      g: log-decay (`log alpha`), `[B, H_v]` for GDN or `[B, H_v, d_k]` for KDA.
      beta: `[B, H_v]`, write strength in (0, 1).
      slots: `[B]` int, the physical slot of each row; negative = padding row.
      force_flush: optional `[B]` bool, flush these rows now whatever their cursor.
      backend: "xla" (pure jax, the specification) or "pallas" (fused kernels; interpret
        mode off-GPU).
      use_qk_l2norm: L2-normalise q and k (`x / sqrt(sum x^2 + 1e-6)`).
      scale: multiplies q after the norm; default `d_k ** -0.5`.
      gate_params: optional `(A_log [H_v], dt_bias [H_v] or [H_v, d_k])`: `g` and `beta`
        then hold the raw model inputs `a` and `b`, and the step computes
        `g = -exp(A_log) softplus(a + dt_bias)`, `beta = sigmoid(b)` itself (inside the
        kernel on the pallas backend).
      kernel_config: a `pallas_kernels.common.KernelConfig` (tiles, warps, rebuild
        precision) for the pallas backend; default: the table in `pallas_kernels.ops`
        (per batch size, gate, state dtype and cache length), which flushes every live
        row at every step at batch <= 5 (<= 8 for 2-byte states, every batch for KDA with
        a 4-byte state) through the folding kernel (faster there than replay and than the
        plain kernel; see `KernelConfig`).

    Returns:
      `(y, new_state)`: y `[B, H_v, d_v]` in v's dtype, exactly 0 on padding rows.

    Raises:
      ValueError: on a wrong shape or dtype, or (when slots are concrete) a slot out of
        range or named twice.
    """
    check_state(state)
    check_step_inputs(state.config, state.num_slots, q, k, v, g, beta, slots, force_flush)
    check_gate_params(state.config, gate_params)
    plan, kernel_config = step_plan(
        state.config, state.write_pos, slots, force_flush, backend=backend,
        kernel_config=kernel_config,
    )
    y, new_state = layer_step(
        state, q, k, v, g, beta, plan,
        backend=backend, use_qk_l2norm=use_qk_l2norm, scale=scale,
        gate_params=gate_params, kernel_config=kernel_config,
    )
    write_pos = replay.advance_write_pos(state.write_pos, plan)
    return y, dataclasses.replace(new_state, write_pos=write_pos)


def materialize_state(state: ReplayState, slots: Int[Array, " B"]) -> Float[Array, "B Hv Dv Dk"]:
    """The live state of each row's slot, float32 `[B, H_v, d_v, d_k]` (0 for padding rows).

    This is the checkpoint replayed with the slot's valid cache entries: the state the next
    token would see.
    """
    check_state(state)
    if jnp.ndim(slots) != 1:
        raise ValueError(f"slots must be a 1-D [B] array, got shape {tuple(jnp.shape(slots))}")
    check_slots("slots", slots, jnp.shape(slots)[0], state.num_slots)
    plan = replay.plan_step(state.write_pos, slots, None, state.config.cache_len)
    return replay.replay_state(state, plan)
