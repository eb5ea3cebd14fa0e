"""A Gated DeltaNet layer (Qwen3-Next layout) with a ReplaySSM decode path and a plain one.

Per token, from the block input x `[D]`:

  q, k, v = SiLU(causal depthwise conv1d(x W_qkv))     kernel K = 4, per-slot conv state
  z       = x W_z                                       output gate
  g       = gdn_gate(x W_a, A_log, dt_bias)             log-decay per value head
  beta    = beta_gate(x W_b)
  y       = gated delta rule (q, k L2-normalised in the recurrence, q * d_k^-1/2)
  out     = (RMSNorm(y) * norm_weight * SiLU(z)) W_out  RMSNorm per value head over d_v

`gdn_replay` decodes one token per row through a ReplaySSM state (`decode.layer_step`);
`gdn_verify` scores a speculative window of T tokens per row (`speculative.verify_step`);
`gdn_plain` runs the plain recurrence (`recurrent_reference`) over T tokens from an explicit
state: it is both the prefill and the plain-decode reference (T = 1).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from pallas_kernels.common import set_rows
from replayssm_jax import gating
from replayssm_jax.chunked import chunked_gated_delta_rule
from replayssm_jax.decode import layer_step
from replayssm_jax.plan import StepPlan
from replayssm_jax.reference import recurrent_reference
from replayssm_jax.speculative import verify_step
from replayssm_jax.state import ReplayState
from replayssm_jax.tokens import Mamba2Tokens, Tokens

RMS_EPS = 1e-6
_HIGHEST = jax.lax.Precision.HIGHEST


@dataclasses.dataclass(frozen=True)
class GDNDims:
    """Static sizes of one GDN layer."""

    d_model: int
    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    conv_kernel: int = 4

    @property
    def key_dim(self) -> int:
        return self.num_k_heads * self.head_k_dim

    @property
    def value_dim(self) -> int:
        return self.num_v_heads * self.head_v_dim

    @property
    def conv_channels(self) -> int:
        """C: q, k and v channels, all through the causal conv."""
        return 2 * self.key_dim + self.value_dim


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class GDNParams:
    """Weights of one GDN layer (C = conv channels, D = d_model, K = conv kernel)."""

    w_qkv: Float[Array, "D C"]
    conv_weight: Float[Array, "K C"]  # tap K-1 multiplies the current token
    w_z: Float[Array, "D HvDv"]
    w_a: Float[Array, "D Hv"]
    w_b: Float[Array, "D Hv"]
    A_log: Float[Array, " Hv"]
    dt_bias: Float[Array, " Hv"]
    norm_weight: Float[Array, " Dv"]
    w_out: Float[Array, "HvDv D"]


def init_gdn_params(rng: np.random.Generator, dims: GDNDims) -> GDNParams:
    """Random weights: fan-in scaled normals; A and dt initialised as in Qwen3-Next / Mamba."""
    d, hv = dims.d_model, dims.num_v_heads
    normal = lambda shape, fan_in: jnp.asarray(rng.standard_normal(shape) * fan_in**-0.5, jnp.float32)
    dt = np.exp(rng.uniform(np.log(1e-3), np.log(1e-1), hv))
    return GDNParams(
        w_qkv=normal((d, dims.conv_channels), d),
        conv_weight=normal((dims.conv_kernel, dims.conv_channels), dims.conv_kernel),
        w_z=normal((d, dims.value_dim), d),
        w_a=normal((d, hv), d),
        w_b=normal((d, hv), d),
        A_log=jnp.asarray(np.log(rng.uniform(1.0, 16.0, hv)), jnp.float32),
        dt_bias=jnp.asarray(dt + np.log(-np.expm1(-dt)), jnp.float32),  # softplus(dt_bias) = dt
        norm_weight=jnp.ones((dims.head_v_dim,), jnp.float32),
        w_out=normal((dims.value_dim, d), dims.value_dim),
    )


def matmul(x: Float[Array, "... I"], w: Float[Array, "I O"]) -> Float[Array, "... O"]:
    """`x @ w` in full fp32 (no TF32 on GPU: replay and plain paths must see equal inputs)."""
    return jnp.matmul(x, w, precision=_HIGHEST)


def rms_norm(x: Float[Array, "... D"], weight: Float[Array, " D"]) -> Float[Array, "... D"]:
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + RMS_EPS) * weight


def causal_conv(
    conv_state: Float[Array, "B Km1 C"],
    x: Float[Array, "B T C"],
    weight: Float[Array, "K C"],
    lengths: Int[Array, " B"] | None = None,
    parents: Int[Array, "B T"] | None = None,
) -> tuple[Float[Array, "B T C"], Float[Array, "B Km1 C"]]:
    """Causal depthwise conv1d continuing from `conv_state` (the previous K-1 inputs).

    Returns the conv output (before SiLU) and the new conv state: the last K-1 inputs up
    to each row's `lengths` (default T; later positions are padding). Over a draft tree
    (`parents`, see `tree_conv`) the conv state is returned as given: which inputs follow
    it is known only once a path is accepted (`accept_conv`).
    """
    if parents is not None:
        return tree_conv(conv_state, x, weight, parents), conv_state
    taps, steps = weight.shape[0], x.shape[1]
    window = jnp.concatenate([conv_state.astype(jnp.float32), x], axis=1)  # [B, K-1+T, C]
    out = sum(weight[j] * window[:, j : j + steps] for j in range(taps))
    if lengths is None:
        return out, window[:, steps:]
    last = jax.vmap(lambda w, n: jax.lax.dynamic_slice_in_dim(w, n, taps - 1, axis=0))
    return out, last(window, lengths)


def tree_conv(
    conv_state: Float[Array, "B Km1 C"],
    x: Float[Array, "B T C"],
    weight: Float[Array, "K C"],
    parents: Int[Array, "B T"],
) -> Float[Array, "B T C"]:
    """`causal_conv`'s output over a draft tree (`parents[b, i]` in [-1, i)): position i's taps
    are its own input, then its ancestors' in the window, then the conv state's newest
    first; a chain (`parents[b, i] = i - 1`) gives `causal_conv`'s output."""
    taps, steps = weight.shape[0], x.shape[1]
    history = jnp.concatenate([conv_state.astype(jnp.float32), x], axis=1)  # window position a at K-1+a
    index = jnp.broadcast_to(taps - 1 + jnp.arange(steps), parents.shape)
    out = weight[taps - 1] * x
    for tap in range(taps - 2, -1, -1):
        position = index - (taps - 1)
        parent = jnp.take_along_axis(parents, jnp.maximum(position, 0), axis=1)
        # in the window: the parent's input (a root's: the newest conv input); else one older
        index = jnp.where(position >= 0, jnp.where(parent >= 0, taps - 1 + parent, taps - 2), index - 1)
        out = out + weight[tap] * jnp.take_along_axis(history, index[..., None], axis=1)
    return out


def _project(params: GDNParams, dims: GDNDims, x: Float[Array, "B T D"], conv_state, lengths, parents=None):
    """Layer inputs of T tokens: q, k `[B,T,Hk,Dk]`, v, z `[B,T,Hv,Dv]`, g, beta `[B,T,Hv]`
    (a draft tree's with `parents`: its conv over each position's ancestors; the conv state
    is then returned as given)."""
    batch, steps = x.shape[:2]
    mixed, conv_state = causal_conv(conv_state, matmul(x, params.w_qkv), params.conv_weight, lengths, parents)
    mixed = jax.nn.silu(mixed)
    q, k, v = jnp.split(mixed, [dims.key_dim, 2 * dims.key_dim], axis=-1)
    heads_k = (batch, steps, dims.num_k_heads, dims.head_k_dim)
    heads_v = (batch, steps, dims.num_v_heads, dims.head_v_dim)
    g = gating.gdn_gate(matmul(x, params.w_a), params.A_log, params.dt_bias)
    beta = gating.beta_gate(matmul(x, params.w_b))
    z = matmul(x, params.w_z).reshape(heads_v)
    return q.reshape(heads_k), k.reshape(heads_k), v.reshape(heads_v), g, beta, z, conv_state


def _output(params: GDNParams, y: Float[Array, "... Hv Dv"], z: Float[Array, "... Hv Dv"]):
    """Gated RMSNorm per value head, then the output projection: `[..., D]`."""
    gated = rms_norm(y.astype(jnp.float32), params.norm_weight) * jax.nn.silu(z)
    return matmul(gated.reshape(*gated.shape[:-2], -1), params.w_out)


def gdn_plain(
    params: GDNParams,
    dims: GDNDims,
    x: Float[Array, "B T D"],
    ssm: Float[Array, "B Hv Dv Dk"],
    conv_state: Float[Array, "B Km1 C"],
    lengths: Int[Array, " B"] | None = None,
    *,
    chunked: bool = False,
) -> tuple[Float[Array, "B T D"], Float[Array, "B Hv Dv Dk"], Float[Array, "B Km1 C"]]:
    """The layer over T tokens with the plain recurrence, from an explicit state: the token
    scan, or with `chunked` the chunked form (`replayssm_jax.chunked`, for prefill).

    Positions `t >= lengths[b]` are padding: their decay is 1 and their write strength 0,
    so they leave the state exactly unchanged (and the conv state stops at `lengths`).

    Returns:
      `(out [B,T,D], final ssm state float32 [B,Hv,Dv,Dk], conv state [B,K-1,C])`.
    """
    q, k, v, g, beta, z, conv_state = _project(params, dims, x, conv_state, lengths)
    if lengths is not None:
        live = jnp.arange(x.shape[1])[None, :, None] < lengths[:, None, None]
        g, beta = jnp.where(live, g, 0.0), jnp.where(live, beta, 0.0)
    tokens = Tokens(q, k, v, g, beta)
    if chunked:
        y, ssm = chunked_gated_delta_rule(tokens, ssm, use_qk_l2norm=True)
    else:
        y, ssm = recurrent_reference(tokens, ssm, use_qk_l2norm=True)
    return _output(params, y, z), ssm, conv_state


def gdn_replay(
    params: GDNParams,
    dims: GDNDims,
    x: Float[Array, "B D"],
    state: ReplayState,
    conv_pool: Float[Array, "N Km1 C"],
    plan: StepPlan,
    *,
    backend: str = "xla",
    tp_axis: str | None = None,
) -> tuple[Float[Array, "B D"], ReplayState, Float[Array, "N Km1 C"]]:
    """One token per row through the ReplaySSM state under `plan` (cursor left to the caller).

    `state` and `conv_pool` are indexed by `plan.slot` (a model passes its flat view and a
    per-layer plan); padding rows write nothing. With `tp_axis` (inside `shard_map`) the
    state holds this device's contiguous block of key heads and of value heads: the
    projections run for every head, the step on the local ones, and y is all-gathered over
    `tp_axis` before the output projection.
    """
    conv_rows = conv_pool[plan.slot]
    q, k, v, g, beta, z, conv_rows = _project(params, dims, x[:, None], conv_rows, None)
    tokens = Tokens(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0])
    step = lambda state, tokens: layer_step(state, tokens, plan, backend=backend, use_qk_l2norm=True)
    y, state = step(state, tokens) if tp_axis is None else on_local_heads(state, tokens, step, tp_axis, 1)
    conv_pool = set_rows(conv_pool, plan.slot, conv_rows, plan.valid)
    return _output(params, y, z[:, 0]), state, conv_pool


def gdn_verify(
    params: GDNParams,
    dims: GDNDims,
    x: Float[Array, "B T D"],
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
    tree (`parents`, as `verify_step`'s; the conv runs over each position's ancestors). With
    `tp_axis` (inside `shard_map`) as `gdn_replay`: the window runs on the local heads and y
    is all-gathered over `tp_axis`.

    The conv pool is not written: the conv state after accepting n tokens is the last K-1
    of (conv state, the window's first n conv inputs), so the window's conv inputs are
    returned for `accept_conv` to roll it forward by the accepted count only.

    Returns:
      `(out [B, T, D], state with the window's records appended, conv inputs [B, T, C])`.
    """
    conv_rows = conv_pool[jnp.where(slots >= 0, slots, 0)]
    q, k, v, g, beta, z, _ = _project(params, dims, x, conv_rows, None, parents)
    step = lambda state, window: verify_step(state, window, slots, backend=backend, use_qk_l2norm=True,
                                             parents=parents)
    window = Tokens(q, k, v, g, beta)
    y, state = step(state, window) if tp_axis is None else on_local_heads(state, window, step, tp_axis, 2)
    return _output(params, y, z), state, matmul(x, params.w_qkv)


def accept_conv(
    conv_rows: Float[Array, "B Km1 C"],
    conv_inputs: Float[Array, "B T C"],
    num_accepted: Int[Array, " B"],
) -> Float[Array, "B Km1 C"]:
    """The conv state after the first `num_accepted[b]` window tokens of each row."""
    taps = conv_rows.shape[1]
    window = jnp.concatenate([conv_rows.astype(jnp.float32), conv_inputs], axis=1)
    last = jax.vmap(lambda w, n: jax.lax.dynamic_slice_in_dim(w, n, taps, axis=0))
    return last(window, num_accepted).astype(conv_rows.dtype)


def local_heads(x: Array, count: int, tp_axis: str, axis: int) -> Array:
    """This device's contiguous block of `count` heads of `x` along `axis` (inside `shard_map`)."""
    return jax.lax.dynamic_slice_in_dim(x, jax.lax.axis_index(tp_axis) * count, count, axis=axis)


def on_local_heads(state: ReplayState, tokens: Tokens | Mamba2Tokens, step, tp_axis: str, axis: int):
    """`step(state, tokens) -> (y, state)` on this device's heads (the state's): the tokens'
    heads (their `axis`: 1 for a decode step's, 2 for a window's) sliced to the local block,
    y all-gathered back to every head along the same axis. Key heads (GDN's q, k; Mamba-2's
    B, C groups) by the state's H_k (all of them where the state holds them all: a single
    Mamba-2 group, replicated), value heads (v, g, beta; x, dt) by its H_v."""
    hk, hv = state.k_cache.shape[1], state.checkpoint.shape[1]
    keys = (lambda x: x) if hk == state.config.num_k_heads else (lambda x: local_heads(x, hk, tp_axis, axis))
    values = lambda x: local_heads(x, hv, tp_axis, axis)
    if isinstance(tokens, Mamba2Tokens):
        local = tokens.replace(x=values(tokens.x), B=keys(tokens.B), C=keys(tokens.C), dt=values(tokens.dt))
    else:
        local = Tokens(keys(tokens.q), keys(tokens.k), values(tokens.v), values(tokens.g), values(tokens.beta))
    config = state.config
    y, state = step(dataclasses.replace(state, config=dataclasses.replace(config, num_k_heads=hk, num_v_heads=hv)),
                    local)
    return jax.lax.all_gather(y, tp_axis, axis=axis, tiled=True), dataclasses.replace(state, config=config)
