"""A Mamba-2 layer with a ReplaySSM decode path and a plain one.

Per token, from the block input u `[D]` (d_inner = H P, C = d_inner + 2 G N conv channels):

  z, xBC, dt_raw = u W_in                                  split d_inner | C | H
  x, B, C        = SiLU(causal depthwise conv1d(xBC))      kernel K = 4, per-slot conv state
  dt             = softplus(dt_raw + dt_bias)
  y              = Mamba-2 SSM step (A = -exp(A_log)) + D x
  out            = RMSNorm(y * SiLU(z)) * norm_weight W_out   gated RMSNorm over d_inner

`mamba2_replay` decodes one token per row through a ReplaySSM state (`decode.layer_step`,
gate "mamba2"); `mamba2_verify` scores a speculative window of T tokens per row
(`speculative.verify_step`); `mamba2_plain` runs the plain recurrence (`mamba2_reference`)
over T tokens from an explicit state: the prefill and the plain-decode reference.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from pallas_kernels.common import set_rows
from replayssm_jax import gating
from replayssm_jax.config import ReplayConfig
from replayssm_jax.decode import layer_step
from replayssm_jax.model.layer import causal_conv, local_heads, matmul, on_local_heads, rms_norm
from replayssm_jax.plan import StepPlan
from replayssm_jax.reference import mamba2_reference
from replayssm_jax.speculative import verify_step
from replayssm_jax.state import ReplayState
from replayssm_jax.tokens import Mamba2Params, Mamba2Tokens


@dataclasses.dataclass(frozen=True)
class Mamba2Dims:
    """Static sizes of one Mamba-2 layer."""

    d_model: int
    num_heads: int
    head_dim: int
    state_size: int
    num_groups: int = 1
    conv_kernel: int = 4

    @property
    def d_inner(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def conv_channels(self) -> int:
        """C: x, B and C channels, all through the causal conv."""
        return self.d_inner + 2 * self.num_groups * self.state_size

    def replay_config(self, cache_len: int, **dtypes) -> ReplayConfig:
        return ReplayConfig.mamba2(self.num_heads, self.head_dim, self.state_size, self.num_groups,
                                   cache_len, **dtypes)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Mamba2LayerParams:
    """Weights of one Mamba-2 layer (D = d_model, C = conv channels, K = conv kernel)."""

    w_in: Float[Array, "D Z"]  # Z = d_inner + C + H: z, xBC, dt
    conv_weight: Float[Array, "K C"]  # tap K-1 multiplies the current token
    A_log: Float[Array, " H"]
    D: Float[Array, " H"]
    dt_bias: Float[Array, " H"]
    norm_weight: Float[Array, " I"]
    w_out: Float[Array, "I D"]


def init_mamba2_params(rng: np.random.Generator, dims: Mamba2Dims) -> Mamba2LayerParams:
    """Random weights: fan-in scaled normals; A in [1, 16] and dt in [1e-3, 0.1] as in Mamba-2."""
    d, h = dims.d_model, dims.num_heads
    normal = lambda shape, fan_in: jnp.asarray(rng.standard_normal(shape) * fan_in**-0.5, jnp.float32)
    dt = np.exp(rng.uniform(np.log(1e-3), np.log(1e-1), h))
    return Mamba2LayerParams(
        w_in=normal((d, dims.d_inner + dims.conv_channels + h), d),
        conv_weight=normal((dims.conv_kernel, dims.conv_channels), dims.conv_kernel),
        A_log=jnp.asarray(np.log(rng.uniform(1.0, 16.0, h)), jnp.float32),
        D=jnp.ones((h,), jnp.float32),
        dt_bias=jnp.asarray(dt + np.log(-np.expm1(-dt)), jnp.float32),  # softplus(dt_bias) = dt
        norm_weight=jnp.ones((dims.d_inner,), jnp.float32),
        w_out=normal((dims.d_inner, d), dims.d_inner),
    )


def ssm_params(params: Mamba2LayerParams) -> Mamba2Params:
    """The SSM step's parameters: `A = -exp(A_log)`."""
    return Mamba2Params(A=-jnp.exp(params.A_log), D=params.D, dt_bias=params.dt_bias)


def _split_in(params: Mamba2LayerParams, dims: Mamba2Dims, u: Float[Array, "B T D"]):
    """`u W_in` split into `(z [.., d_inner], xBC [.., C] (the conv inputs), dt_raw [.., H])`."""
    return jnp.split(matmul(u, params.w_in), [dims.d_inner, dims.d_inner + dims.conv_channels], axis=-1)


def _project(params: Mamba2LayerParams, dims: Mamba2Dims, u: Float[Array, "B T D"], conv_state, lengths,
             parents=None):
    """Layer inputs of T tokens: `Mamba2Tokens` (raw dt) `[B, T, ...]`, z `[B,T,H,P]`, conv state
    (a draft tree's with `parents`, as `layer._project`)."""
    batch, steps = u.shape[:2]
    z, xbc, dt = _split_in(params, dims, u)
    xbc, conv_state = causal_conv(conv_state, xbc, params.conv_weight, lengths, parents)
    x, b, c = jnp.split(jax.nn.silu(xbc), [dims.d_inner, dims.d_inner + dims.num_groups * dims.state_size],
                        axis=-1)
    groups = (batch, steps, dims.num_groups, dims.state_size)
    heads = (batch, steps, dims.num_heads, dims.head_dim)
    tokens = Mamba2Tokens(x=x.reshape(heads), B=b.reshape(groups), C=c.reshape(groups), dt=dt)
    return tokens, z.reshape(heads), conv_state


def _output(params: Mamba2LayerParams, y: Float[Array, "... H P"], z: Float[Array, "... H P"]):
    """Gated RMSNorm over d_inner (`norm(y * SiLU(z))`), then the output projection."""
    gated = (y.astype(jnp.float32) * gating.silu(z)).reshape(*y.shape[:-2], -1)
    return matmul(rms_norm(gated, params.norm_weight), params.w_out)


def mamba2_plain(
    params: Mamba2LayerParams,
    dims: Mamba2Dims,
    u: Float[Array, "B T D"],
    ssm: Float[Array, "B H P N"],
    conv_state: Float[Array, "B Km1 C"],
    lengths: Int[Array, " B"] | None = None,
) -> tuple[Float[Array, "B T D"], Float[Array, "B H P N"], Float[Array, "B Km1 C"]]:
    """The layer over T tokens with the plain recurrence, from an explicit state.

    Positions `t >= lengths[b]` are padding: their dt is 0 (decay 1, no update), so they
    leave the state exactly unchanged (and the conv state stops at `lengths`).

    Returns:
      `(out [B,T,D], final ssm state float32 [B,H,P,N], conv state [B,K-1,C])`.
    """
    tokens, z, conv_state = _project(params, dims, u, conv_state, lengths)
    step_params = ssm_params(params)
    dt = gating.mamba2_dt(tokens.dt, step_params.dt_bias)
    if lengths is not None:
        dt = jnp.where(jnp.arange(u.shape[1])[None, :, None] < lengths[:, None, None], dt, 0.0)
    given_dt = Mamba2Params(step_params.A, step_params.D, jnp.zeros_like(step_params.dt_bias), dt_softplus=False)
    y, ssm = mamba2_reference(tokens.replace(dt=dt), ssm, given_dt)
    return _output(params, y, z), ssm, conv_state


def _local_ssm_params(params: Mamba2LayerParams, state: ReplayState, tp_axis: str | None) -> Mamba2Params:
    """`ssm_params` of the state's heads: all of them, or with `tp_axis` this device's block."""
    step_params = ssm_params(params)
    if tp_axis is None:
        return step_params
    return jax.tree.map(lambda a: local_heads(a, state.checkpoint.shape[1], tp_axis, 0), step_params)


def mamba2_replay(
    params: Mamba2LayerParams,
    dims: Mamba2Dims,
    u: Float[Array, "B D"],
    state: ReplayState,
    conv_pool: Float[Array, "N Km1 C"],
    plan: StepPlan,
    *,
    backend: str = "xla",
    tp_axis: str | None = None,
) -> tuple[Float[Array, "B D"], ReplayState, Float[Array, "N Km1 C"]]:
    """One token per row through the ReplaySSM state under `plan` (cursor left to the caller).

    `state` and `conv_pool` are indexed by `plan.slot`; padding rows write nothing. With
    `tp_axis` (inside `shard_map`) as `layer.gdn_replay`: the state holds this device's block
    of heads (and of their B / C groups); the projections and the conv run for every head,
    the SSM step on the local ones, and y is all-gathered over `tp_axis`.
    """
    tokens, z, conv_rows = _project(params, dims, u[:, None], conv_pool[plan.slot], None)
    step_params = _local_ssm_params(params, state, tp_axis)
    step = lambda state, tokens: layer_step(state, tokens, plan, backend=backend, gate_params=step_params)
    tokens = jax.tree.map(lambda a: a[:, 0], tokens)
    y, state = step(state, tokens) if tp_axis is None else on_local_heads(state, tokens, step, tp_axis, 1)
    conv_pool = set_rows(conv_pool, plan.slot, conv_rows, plan.valid)
    return _output(params, y, z[:, 0]), state, conv_pool


def mamba2_verify(
    params: Mamba2LayerParams,
    dims: Mamba2Dims,
    u: Float[Array, "B T D"],
    state: ReplayState,
    conv_pool: Float[Array, "N Km1 C"],
    slots: Int[Array, " B"],
    *,
    backend: str = "xla",
    tp_axis: str | None = None,
    parents: Int[Array, "B T"] | None = None,
) -> tuple[Float[Array, "B T D"], ReplayState, Float[Array, "B T C"]]:
    """A draft window of T tokens per row through `speculative.verify_step` on `backend`
    (slots index `state` and `conv_pool`; negative: padding row, output 0), a chain or a
    tree (`parents`). As `layer.gdn_verify`: the conv pool is not written, the window's conv
    inputs are returned for `accept_conv`; with `tp_axis` the window runs on the local heads
    and y is all-gathered over `tp_axis`.

    Returns:
      `(out [B, T, D], state with the window's records appended, conv inputs [B, T, C])`.
    """
    tokens, z, _ = _project(params, dims, u, conv_pool[jnp.where(slots >= 0, slots, 0)], None, parents)
    step_params = _local_ssm_params(params, state, tp_axis)
    step = lambda state, window: verify_step(state, window, slots, backend=backend, gate_params=step_params,
                                             parents=parents)
    y, state = step(state, tokens) if tp_axis is None else on_local_heads(state, tokens, step, tp_axis, 2)
    return _output(params, y, z), state, _split_in(params, dims, u)[1]
