"""A small decoder: embedding, pre-norm blocks of (GDN layer + SwiGLU MLP), final norm, LM head.

Three entry points over the same params:

* `decode_step(params, state, tokens, slots, force_flush)`: one token per row through the
  ReplaySSM `ModelState`. One flush plan per step, a `lax.scan` over layers carrying the
  state's flat view (every layer scatters into the same buffers), one cursor advance.
  `jitted_decode_step` is it under `jit` with the state donated: fixed shapes (padding rows
  have slot -1), so cursors, joins and leaves never recompile, and the state pool is
  updated in place.
* `prefill(params, state, tokens, lengths, slots)`: continue each slot's sequence by a prompt
  chunk with the plain recurrence; leaves a flushed checkpoint (cursor 0) and the conv state.
* `plain_forward(params, tokens, plain)`: the plain recurrence from an explicit per-row
  `PlainState` (state read and written every token): the reference decode (T = 1).
* `verify_window(params, state, tokens, slots)` + `accept_window(...)`: speculative decode.
  Every GDN layer verifies a window of T tokens per row (`speculative.verify_step`: records
  appended, no checkpoint written except by rows the capacity rule folds); the MLP, norms
  and LM head are per token, so the logits of all T positions come out of one pass.
  `accept_window` then keeps each row's first n tokens: it moves the shared cursor by n and
  rolls the conv state forward by those n conv inputs only.

Hybrid stacks: `DecoderConfig(layers=("gdn", "mamba2", "gdn"), num_layers=3)` mixes GDN
layers with Mamba-2 layers (`model.mamba2_layer`), each in a pre-norm block with the same
MLP. Their state is a `HybridState` (every layer its own `ReplayState` arrays and conv
state, one shared cursor), their params hold one `HybridBlock` per layer, and every entry
point above takes them: the layers run one after the other (a Python loop, unrolled under
`jit`: the layers' shapes differ, so there is no stacked scan), under one flush plan per
step. The plain state of a hybrid stack (`PlainState`) holds tuples, one array per layer.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int

from pallas_kernels.common import set_rows
from replayssm_jax.config import ReplayConfig
from replayssm_jax.decode import check_backend
from replayssm_jax.plan import FlushPolicy, StepPlan, advance_write_pos, as_policy, default_flush_policy, plan_step
from replayssm_jax import speculative
from replayssm_jax.validation import check_array, check_positive_int, check_slots, concrete_or_none, debug_check
from replayssm_jax.model import slots as slot_ops
from replayssm_jax.model.layer import (
    GDNDims,
    GDNParams,
    accept_conv,
    gdn_plain,
    gdn_replay,
    gdn_verify,
    init_gdn_params,
    matmul,
    rms_norm,
)
from replayssm_jax.model.mamba2_layer import (
    Mamba2Dims,
    Mamba2LayerParams,
    init_mamba2_params,
    mamba2_plain,
    mamba2_replay,
    mamba2_verify,
    ssm_params,
)
from replayssm_jax.model.state import (
    HybridState,
    ModelState,
    check_any_model_state,
    flat_view,
    from_flat_view,
    init_hybrid_state,
    init_model_state,
    layer_configs,
    layer_plan,
    layer_state,
    with_layer,
)

LAYER_KINDS = ("gdn", "mamba2")


@dataclasses.dataclass(frozen=True)
class DecoderConfig:
    """Model sizes (small CPU defaults). Validated: every size a positive int.

    `layers`: the kind of every layer, "gdn" or "mamba2" (e.g. `("gdn", "mamba2", "gdn")`,
    its length `num_layers`); None: `num_layers` GDN layers. The GDN layers take the
    `num_k_heads` .. `head_v_dim` sizes, the Mamba-2 layers the `mamba2_*` ones (H heads of
    dim P, state size N, G groups of B/C).
    """

    vocab_size: int = 256
    d_model: int = 64
    num_layers: int = 2
    num_k_heads: int = 2
    num_v_heads: int = 4
    head_k_dim: int = 32
    head_v_dim: int = 32
    mlp_hidden: int = 128
    conv_kernel: int = 4
    layers: tuple[str, ...] | None = None
    mamba2_heads: int = 4
    mamba2_head_dim: int = 16
    mamba2_state_size: int = 16
    mamba2_groups: int = 1

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.name == "layers":
                continue
            check_positive_int(field.name, value)
        if self.num_v_heads % self.num_k_heads:
            raise ValueError(
                f"num_v_heads ({self.num_v_heads}) must be a multiple of num_k_heads "
                f"({self.num_k_heads})"
            )
        if self.mamba2_heads % self.mamba2_groups:
            raise ValueError(f"mamba2_heads ({self.mamba2_heads}) must be a multiple of mamba2_groups "
                             f"({self.mamba2_groups})")
        if self.conv_kernel < 2:
            raise ValueError(f"conv_kernel must be >= 2, got {self.conv_kernel}")
        if self.layers is not None:
            layers = tuple(self.layers) if isinstance(self.layers, (tuple, list)) else None
            if layers is None or any(kind not in LAYER_KINDS for kind in layers):
                raise ValueError(f"layers must be a sequence of {LAYER_KINDS}, got {self.layers!r}")
            if len(layers) != self.num_layers:
                raise ValueError(f"layers names {len(layers)} layers, num_layers is {self.num_layers}")
            object.__setattr__(self, "layers", layers)

    @property
    def kinds(self) -> tuple[str, ...]:
        """Every layer's kind."""
        return ("gdn",) * self.num_layers if self.layers is None else self.layers

    @property
    def hybrid(self) -> bool:
        """Some layer is not GDN: the state is a `HybridState`, the params hold `HybridBlock`s."""
        return any(kind != "gdn" for kind in self.kinds)

    @property
    def mamba2(self) -> Mamba2Dims:
        return Mamba2Dims(self.d_model, self.mamba2_heads, self.mamba2_head_dim, self.mamba2_state_size,
                          self.mamba2_groups, self.conv_kernel)

    def layer_replay_config(self, kind: str, cache_len: int, state_dtype=jnp.float32, cache_dtype=None) -> ReplayConfig:
        """The `ReplayConfig` of a layer of `kind`; caches default to the state dtype."""
        if kind == "gdn":
            return self.replay_config(cache_len, state_dtype, cache_dtype)
        return self.mamba2.replay_config(cache_len, state_dtype=state_dtype,
                                         cache_dtype=state_dtype if cache_dtype is None else cache_dtype)

    @property
    def gdn(self) -> GDNDims:
        return GDNDims(
            self.d_model, self.num_k_heads, self.num_v_heads, self.head_k_dim, self.head_v_dim,
            self.conv_kernel,
        )

    def replay_config(
        self, cache_len: int, state_dtype=jnp.float32, cache_dtype=None
    ) -> ReplayConfig:
        """The GDN layers' `ReplayConfig`; caches default to the state dtype."""
        return ReplayConfig(
            self.num_k_heads, self.num_v_heads, self.head_k_dim, self.head_v_dim, cache_len,
            state_dtype=state_dtype,
            cache_dtype=state_dtype if cache_dtype is None else cache_dtype,
        )

    def init_state(
        self, num_slots: int, cache_len: int, state_dtype=jnp.float32, cache_dtype=None
    ) -> ModelState | HybridState:
        """An empty `ModelState` for this model (a `HybridState` for a hybrid stack; conv
        state in float32)."""
        if self.hybrid:
            configs = tuple(self.layer_replay_config(kind, cache_len, state_dtype, cache_dtype) for kind in self.kinds)
            channels = tuple(self.mamba2.conv_channels if kind == "mamba2" else self.gdn.conv_channels
                             for kind in self.kinds)
            return init_hybrid_state(configs, num_slots, channels, self.conv_kernel)
        return init_model_state(
            self.replay_config(cache_len, state_dtype, cache_dtype),
            self.num_layers, num_slots, self.gdn.conv_channels, self.conv_kernel,
        )


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class BlockParams:
    """One pre-norm block (stacked over layers in `DecoderParams.blocks`)."""

    attn_norm: Float[Array, " D"]
    gdn: GDNParams
    mlp_norm: Float[Array, " D"]
    w_gate: Float[Array, "D F"]
    w_up: Float[Array, "D F"]
    w_down: Float[Array, "F D"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class HybridBlock:
    """One pre-norm block of a hybrid stack: its mixer (a GDN or a Mamba-2 layer) and the MLP."""

    attn_norm: Float[Array, " D"]
    mixer: GDNParams | Mamba2LayerParams
    mlp_norm: Float[Array, " D"]
    w_gate: Float[Array, "D F"]
    w_up: Float[Array, "D F"]
    w_down: Float[Array, "F D"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DecoderParams:
    """All weights; every leaf of `blocks` has a leading layer axis Y (a hybrid stack: a
    tuple of one `HybridBlock` per layer)."""

    embed: Float[Array, "V D"]
    blocks: BlockParams | tuple[HybridBlock, ...]
    final_norm: Float[Array, " D"]
    lm_head: Float[Array, "D V"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PlainState:
    """Per-row state of the plain recurrence: ssm float32 `[Y,B,Hv,Dv,Dk]`, conv `[Y,B,K-1,C]`
    (a hybrid stack: tuples of one `[B, ...]` per layer)."""

    ssm: Float[Array, "Y B Hv Dv Dk"] | tuple
    conv: Float[Array, "Y B Km1 C"] | tuple


def init_params(config: DecoderConfig, seed: int) -> DecoderParams:
    """Seeded random weights (fan-in scaled normals, unit norms), drawn with numpy (no compile)."""
    rng = np.random.default_rng(seed)
    d, f = config.d_model, config.mlp_hidden
    normal = lambda shape, fan_in: jnp.asarray(rng.standard_normal(shape) * fan_in**-0.5, jnp.float32)

    def block(kind="gdn"):
        mixer = init_gdn_params(rng, config.gdn) if kind == "gdn" else init_mamba2_params(rng, config.mamba2)
        kind_fields = dict(mixer=mixer) if config.hybrid else dict(gdn=mixer)
        return (HybridBlock if config.hybrid else BlockParams)(
            attn_norm=jnp.ones((d,), jnp.float32),
            **kind_fields,
            mlp_norm=jnp.ones((d,), jnp.float32),
            w_gate=normal((d, f), d),
            w_up=normal((d, f), d),
            w_down=normal((f, d), f),
        )

    if config.hybrid:
        blocks = tuple(block(kind) for kind in config.kinds)
    else:
        blocks = jax.tree.map(lambda *xs: jnp.stack(xs), *[block() for _ in range(config.num_layers)])
    return DecoderParams(
        embed=normal((config.vocab_size, d), 1),
        blocks=blocks,
        final_norm=jnp.ones((d,), jnp.float32),
        lm_head=normal((d, config.vocab_size), d),
    )


def init_plain_state(config: DecoderConfig, batch: int) -> PlainState:
    """Zero plain state for `batch` independent rows."""
    if config.hybrid:
        shapes = [(config.gdn.num_v_heads, config.gdn.head_v_dim, config.gdn.head_k_dim, config.gdn.conv_channels)
                  if kind == "gdn" else
                  (config.mamba2.num_heads, config.mamba2.head_dim, config.mamba2.state_size,
                   config.mamba2.conv_channels) for kind in config.kinds]
        return PlainState(ssm=tuple(jnp.zeros((batch, hv, dv, dk), jnp.float32) for hv, dv, dk, _ in shapes),
                          conv=tuple(jnp.zeros((batch, config.conv_kernel - 1, c), jnp.float32)
                                     for *_, c in shapes))
    g = config.gdn
    return PlainState(
        ssm=jnp.zeros(
            (config.num_layers, batch, g.num_v_heads, g.head_v_dim, g.head_k_dim), jnp.float32
        ),
        conv=jnp.zeros((config.num_layers, batch, config.conv_kernel - 1, g.conv_channels)),
    )


def _mlp(block: BlockParams, x: Float[Array, "... D"]) -> Float[Array, "... D"]:
    h = rms_norm(x, block.mlp_norm)
    return matmul(jax.nn.silu(matmul(h, block.w_gate)) * matmul(h, block.w_up), block.w_down)


def _embed(params: DecoderParams, tokens: Int[Array, "..."]) -> Float[Array, "... D"]:
    return params.embed[jnp.clip(tokens, 0, params.embed.shape[0] - 1)]


def _logits(params: DecoderParams, x: Float[Array, "... D"]) -> Float[Array, "... V"]:
    return matmul(rms_norm(x, params.final_norm), params.lm_head)


def _dims(params: DecoderParams, state_config: ReplayConfig) -> GDNDims:
    return GDNDims(
        params.embed.shape[1], state_config.num_k_heads, state_config.num_v_heads,
        state_config.head_k_dim, state_config.head_v_dim, params.blocks.gdn.conv_weight.shape[1],
    )


def _hybrid_dims(block: HybridBlock, d_model: int, ssm_shape: tuple[int, ...]) -> GDNDims | Mamba2Dims:
    """A hybrid block's layer sizes from its weights and its state's trailing `[H_v, d_v, d_k]`
    (both kinds have C = 2 H_k d_k + H_v d_v conv channels: GDN's q, k, v; Mamba-2's x, B, C
    with H_k = G groups)."""
    heads, head_v, head_k = ssm_shape[-3:]
    kernel, channels = block.mixer.conv_weight.shape
    key_heads = (channels - heads * head_v) // (2 * head_k)
    if isinstance(block.mixer, Mamba2LayerParams):
        return Mamba2Dims(d_model, heads, head_v, head_k, key_heads, kernel)
    return GDNDims(d_model, key_heads, heads, head_k, head_v, kernel)


@dataclasses.dataclass(frozen=True)
class _Mixer:
    """One layer kind's entry points in the model package (the same arguments per role:
    `layer.gdn_replay`, `gdn_verify`, `gdn_plain` and their Mamba-2 counterparts)."""

    replay: Callable
    verify: Callable
    plain: Callable


_MIXERS = {
    GDNParams: _Mixer(gdn_replay, gdn_verify, gdn_plain),
    Mamba2LayerParams: _Mixer(mamba2_replay, mamba2_verify, mamba2_plain),
}


def layer_gate_params(params: DecoderParams) -> tuple | None:
    """The `gate_params` the slot operations that rebuild live states take for this model
    (`slots.live_states`): None for a GDN stack; for a hybrid stack one entry per layer,
    None for a GDN layer, the layer's `Mamba2Params` for a Mamba-2 layer."""
    if not isinstance(params.blocks, tuple):
        return None
    return tuple(ssm_params(b.mixer) if isinstance(b.mixer, Mamba2LayerParams) else None for b in params.blocks)


def model_flush_policy(state: ModelState | HybridState, batch: int, backend: str | None = None) -> FlushPolicy:
    """The default policy of a model step on `backend`: `layers_flush_policy` of its layers."""
    return layers_flush_policy(layer_configs(state), batch, backend)


def layers_flush_policy(configs: tuple[ReplayConfig, ...], batch: int, backend: str | None = None) -> FlushPolicy:
    """`default_flush_policy` of layers with these configs under one cursor: a hybrid stack
    folds every step only where every layer's default does."""
    policies = {default_flush_policy(config, batch, backend) for config in configs}
    return FlushPolicy.EVERY_STEP if policies == {FlushPolicy.EVERY_STEP} else FlushPolicy.NATURAL


def _check_params_fit(params: DecoderParams, state: ModelState | HybridState) -> None:
    """A hybrid state takes a hybrid model's params (one block per layer, of the layer's kind)."""
    hybrid_params = isinstance(params.blocks, tuple)
    if hybrid_params != isinstance(state, HybridState):
        raise ValueError("params and state must both be a hybrid stack's (HybridBlock per layer, HybridState) "
                         "or both a GDN stack's (stacked BlockParams, ModelState)")
    if hybrid_params:
        kinds = tuple("mamba2" if isinstance(b.mixer, Mamba2LayerParams) else "gdn" for b in params.blocks)
        if kinds != state.kinds:
            raise ValueError(f"params have layers {kinds}, the state {state.kinds}")


def check_token_ids(name: str, tokens: Array, ndim: int) -> None:
    """Token ids: an integer array of rank `ndim` (`[B]` for a step, `[B, T]` for a window)."""
    check_array(name, tokens, (None,) * ndim, int, layout=f"an array with {ndim} dims")


def _debug_check_token_ids(name: str, tokens: Array, live: Array, vocab_size: int) -> None:
    """In-jit check (traced under `replayssm_jax.checked` only): live tokens are ids in
    `[0, vocab)`; without it an id outside is clipped to the nearest end of the table."""
    inside = (tokens >= 0) & (tokens < vocab_size)
    debug_check(
        jnp.all(inside | ~live), f"{name} holds a token id outside [0, {vocab_size}): {{t}}", t=tokens
    )


def decode_step(
    params: DecoderParams,
    state: ModelState | HybridState,
    tokens: Int[Array, " B"],
    slots: Int[Array, " B"],
    force_flush: Bool[Array, " B"] | None = None,
    *,
    backend: str = "xla",
    policy: FlushPolicy | str | None = None,
) -> tuple[Float[Array, "B V"], ModelState, StepPlan]:
    """One token per row through every layer with ReplaySSM.

    Args:
      tokens: `[B]` input token of each row (ignored on padding rows).
      slots: `[B]` slot of each row; negative = padding row (writes nothing).
      force_flush: optional `[B]` bool, e.g. `slots.track_flush(seq_lens, interval)`.
      backend: the layer steps' backend ("xla", "pallas_triton", "mosaic_gpu" or "auto"; any layer
        shape the backend cannot take raises ValueError).
      policy: the step's `FlushPolicy`; default `model_flush_policy(state, B, backend)` (a
        GDN stack: `default_flush_policy(config, B, backend)`).

    Returns:
      `(logits [B, V], new_state, plan)`; `plan` says which rows flushed and their cursor
      before the step (for statistics).
    """
    check_any_model_state(state)
    _check_params_fit(params, state)
    check_token_ids("tokens", tokens, 1)
    check_slots("slots", slots, jnp.shape(tokens)[0], state.num_slots)
    check_backend(backend)
    _debug_check_token_ids("tokens", tokens, slots >= 0, params.embed.shape[0])
    return decode_core(params, state, tokens, slots, force_flush, backend=backend, policy=policy)


def _ssm_shape(config: ReplayConfig) -> tuple[int, int, int]:
    """A layer's trailing state shape `[H_v, d_v, d_k]` by its (global) config: inside
    `shard_map` its arrays hold only this device's heads."""
    return config.num_v_heads, config.head_v_dim, config.head_k_dim


def _hybrid_decode(params, state: HybridState, tokens, slots, force_flush, *, backend, policy, tp_axis=None):
    """`decode_core` for a hybrid stack: the layers one after the other under one plan."""
    policy = model_flush_policy(state, jnp.shape(tokens)[0], backend) if policy is None else as_policy(policy)
    plan = plan_step(state.write_pos, slots, force_flush, state.cache_len, policy)
    x = _embed(params, tokens)
    for index, block in enumerate(params.blocks):
        replay = layer_state(state, index)
        dims = _hybrid_dims(block, x.shape[-1], _ssm_shape(replay.config))
        mixed, replay, conv = _MIXERS[type(block.mixer)].replay(
            block.mixer, dims, rms_norm(x, block.attn_norm), replay, state.layers[index].conv_state, plan,
            backend=backend, tp_axis=tp_axis)
        state = with_layer(state, index, replay, conv)
        x = x + mixed
        x = x + _mlp(block, x)
    state = dataclasses.replace(state, write_pos=advance_write_pos(state.write_pos, plan))
    return _logits(params, x), state, plan


def decode_core(
    params: DecoderParams,
    state: ModelState | HybridState,
    tokens: Int[Array, " B"],
    slots: Int[Array, " B"],
    force_flush: Bool[Array, " B"] | None = None,
    *,
    backend: str = "xla",
    policy: FlushPolicy | str | None = None,
    tp_axis: str | None = None,
) -> tuple[Float[Array, "B V"], ModelState, StepPlan]:
    """`decode_step` without the argument checks. With `tp_axis` (inside `shard_map`, see
    `replayssm_jax.sharding`) the state's arrays hold this device's heads only and its
    config stays the global one."""
    if isinstance(state, HybridState):
        return _hybrid_decode(params, state, tokens, slots, force_flush, backend=backend, policy=policy,
                              tp_axis=tp_axis)
    batch = jnp.shape(tokens)[0]
    policy = default_flush_policy(state.config, batch, backend) if policy is None else as_policy(policy)
    plan = plan_step(state.write_pos, slots, force_flush, state.config.cache_len, policy)
    dims = _dims(params, state.config)
    view, conv_pool = flat_view(state)

    def layer(carry, xs):
        x, view, conv_pool = carry
        block, index = xs
        mixed, view, conv_pool = gdn_replay(
            block.gdn, dims, rms_norm(x, block.attn_norm), view, conv_pool,
            layer_plan(plan, index, state.num_slots), backend=backend, tp_axis=tp_axis,
        )
        x = x + mixed
        return (x + _mlp(block, x), view, conv_pool), None

    init = (_embed(params, tokens), view, conv_pool)
    (x, view, conv_pool), _ = jax.lax.scan(
        layer, init, (params.blocks, jnp.arange(state.num_layers))
    )
    write_pos = advance_write_pos(state.write_pos, plan)
    return _logits(params, x), from_flat_view(state, view, conv_pool, write_pos), plan


jitted_decode_step = jax.jit(decode_step, static_argnames=("backend", "policy"), donate_argnames=("state",))


def verify_window(
    params: DecoderParams,
    state: ModelState | HybridState,
    tokens: Int[Array, "B T"],
    slots: Int[Array, " B"],
    *,
    backend: str = "xla",
    parents: Int[Array, "B T"] | None = None,
) -> tuple[Float[Array, "B T V"], ModelState, Float[Array, "Y B T C"], Bool[Array, " B"]]:
    """Score a window of T tokens per row (the row's next input, then T - 1 drafts), each
    layer through `speculative.verify_step` on `backend`.

    logits[b, i] are the logits after window tokens 0..i, as T decode steps over them would
    give. The cursor does not move and the conv state is not written: call `accept_window`.
    A tree of drafts: `parents [B, T]` (`parents[b, i]` in [-1, i), -1 for the root's
    position 0 and any other child of the current state); logits[b, i] are then those after
    the path from the root to i (its conv and state see its ancestors only), and
    `accept_window(..., path=...)` keeps an accepted root-to-leaf path.

    Returns:
      `(logits [B, T, V], state, conv inputs [Y, B, T, C] for accept_window (a hybrid stack:
      a tuple of one `[B, T, C_layer]` per layer), folded [B]: the rows the capacity rule
      folded, whose cursor is now 0)`.

    Raises:
      ValueError: on bad token ids or slots, T > cache_len, or a backend verify_step does
        not take for a layer (Mamba-2: "xla", "mosaic_gpu" or "auto").
    """
    check_any_model_state(state)
    _check_params_fit(params, state)
    check_token_ids("tokens", tokens, 2)
    batch, width = jnp.shape(tokens)
    check_slots("slots", slots, batch, state.num_slots)
    cache_len = layer_configs(state)[0].cache_len
    if width > cache_len:
        raise ValueError(f"window width T = {width} exceeds cache_len = {cache_len}")
    speculative.check_parents(parents, batch, width)
    return verify_core(params, state, tokens, slots, backend=backend,
                       parents=None if parents is None else jnp.asarray(parents, jnp.int32))


def verify_core(
    params: DecoderParams,
    state: ModelState | HybridState,
    tokens: Int[Array, "B T"],
    slots: Int[Array, " B"],
    *,
    backend: str = "xla",
    tp_axis: str | None = None,
    parents: Int[Array, "B T"] | None = None,
) -> tuple[Float[Array, "B T V"], ModelState, Float[Array, "Y B T C"], Bool[Array, " B"]]:
    """`verify_window` without the argument checks. With `tp_axis` (inside `shard_map`, see
    `replayssm_jax.sharding`) as `decode_core`: the state's arrays hold this device's heads
    only and its config stays the global one."""
    if isinstance(state, HybridState):
        return _hybrid_verify(params, state, tokens, slots, backend, tp_axis, parents)
    dims = _dims(params, state.config)
    view, conv_pool = flat_view(state)
    valid = slots >= 0

    def layer(carry, xs):
        x, view = carry
        block, index = xs
        flat_slots = jnp.where(valid, slots + index * state.num_slots, -1)
        mixed, view, conv_inputs = gdn_verify(
            block.gdn, dims, rms_norm(x, block.attn_norm), view, conv_pool, flat_slots, backend=backend,
            tp_axis=tp_axis, parents=parents,
        )
        x = x + mixed
        return (x + _mlp(block, x), view), conv_inputs

    (x, view), conv_inputs = jax.lax.scan(
        layer, (_embed(params, tokens), view), (params.blocks, jnp.arange(state.num_layers))
    )
    write_pos = view.write_pos[: state.num_slots]  # layer 0's flat slots: the shared cursor
    folded = folded_rows(slots, state.write_pos, write_pos)
    state = from_flat_view(state, view, conv_pool, write_pos)
    return _logits(params, x), state, conv_inputs, folded


def folded_rows(slots: Int[Array, " B"], before: Int[Array, " N"], after: Int[Array, " N"]) -> Bool[Array, " B"]:
    """The rows whose verify step folded (their slot's cursor moved from `before` to
    `after`: to 0); padding rows never."""
    slot = jnp.where(slots >= 0, slots, 0)
    return (slots >= 0) & (after[slot] != before[slot])


def _hybrid_verify(params, state: HybridState, tokens, slots, backend, tp_axis=None, parents=None):
    """`verify_window` for a hybrid stack: each layer verifies the window from the cursor
    before the step (every layer folds the same rows)."""
    x, conv_inputs, write_pos = _embed(params, tokens), [], None
    for index, block in enumerate(params.blocks):
        replay = layer_state(state, index)
        dims = _hybrid_dims(block, x.shape[-1], _ssm_shape(replay.config))
        mixed, replay, inputs = _MIXERS[type(block.mixer)].verify(
            block.mixer, dims, rms_norm(x, block.attn_norm), replay, state.layers[index].conv_state, slots,
            backend=backend, tp_axis=tp_axis, parents=parents)
        write_pos = replay.write_pos if write_pos is None else write_pos
        state = with_layer(state, index, replay, state.layers[index].conv_state)
        conv_inputs.append(inputs)
        x = x + mixed
        x = x + _mlp(block, x)
    folded = folded_rows(slots, state.write_pos, write_pos)
    return _logits(params, x), dataclasses.replace(state, write_pos=write_pos), tuple(conv_inputs), folded


def accept_window(
    state: ModelState | HybridState,
    slots: Int[Array, " B"],
    num_accepted: Int[Array, " B"],
    conv_inputs: Float[Array, "Y B T C"] | tuple,
    *,
    path: Int[Array, "B P"] | None = None,
) -> ModelState | HybridState:
    """Keep the first `num_accepted[b]` (0..T) tokens of each row's verified window: the
    cursor moves by that count (`speculative.accept`) and the conv state advances by those
    tokens' conv inputs; padding rows are untouched. A hybrid stack's `conv_inputs` is the
    tuple `verify_window` returned. A tree window's accepted tokens are `path[b, :n]` (window
    positions from the root down, as `speculative.accept`'s): every layer's records of the
    path move to the ring's next entries and the conv state advances by the path's inputs.

    Raises:
      ValueError: if a (concrete) count lies outside [0, T], T the window's width, or moves a
        cursor past the ring, or a path is not increasing (`speculative.accept`); under
        `checked` the same as checks.
    """
    hybrid = isinstance(state, HybridState)
    width = (conv_inputs[0] if hybrid else conv_inputs).shape[-2]
    check_window_counts(num_accepted, width)
    if path is not None:
        check_array("path", path, (jnp.shape(slots)[0], None), int, layout="a [B, P] int array")
        path = jnp.asarray(path, jnp.int32)
    roll = lambda pool, inputs: accept_conv_pool(pool, slots, num_accepted, inputs, path)
    if hybrid:
        for index, inputs in enumerate(conv_inputs):
            replay = speculative.accept(layer_state(state, index), slots, num_accepted, path=path)
            state = with_layer(state, index, replay, roll(state.layers[index].conv_state, inputs))
        return dataclasses.replace(state, write_pos=replay.write_pos)
    if path is None:
        write_pos = speculative.accept(layer_state(state, 0), slots, num_accepted).write_pos
    else:  # every layer's path records compacted: one accept on the flat view of all layers
        view, conv_pool = flat_view(state)
        tile = lambda a: jnp.concatenate([a] * state.num_layers)
        flat_slots = jnp.concatenate([jnp.where(slots >= 0, slots + i * state.num_slots, -1)
                                      for i in range(state.num_layers)])
        view = speculative.accept(view, flat_slots, tile(num_accepted), path=tile(path))
        write_pos = view.write_pos[: state.num_slots]
        state = from_flat_view(state, view, conv_pool, write_pos)
    conv = jax.vmap(roll, in_axes=(0, 0))(state.conv_state, conv_inputs)
    return dataclasses.replace(state, conv_state=conv, write_pos=write_pos)


def accept_conv_pool(
    conv_pool: Float[Array, "N Km1 C"],
    slots: Int[Array, " B"],
    num_accepted: Int[Array, " B"],
    conv_inputs: Float[Array, "B T C"],
    path: Int[Array, "B P"] | None = None,
) -> Float[Array, "N Km1 C"]:
    """One layer's conv pool with each row's slot rolled forward by its first
    `num_accepted[b]` window conv inputs (`layer.accept_conv`), a tree's along `path[b]`;
    padding rows write nothing."""
    valid = slots >= 0
    n = jnp.where(valid, num_accepted, 0).astype(jnp.int32)
    if path is not None:
        conv_inputs = jnp.take_along_axis(conv_inputs, jnp.clip(path, 0, conv_inputs.shape[1] - 1)[..., None],
                                          axis=1)
    rolled = accept_conv(conv_pool[jnp.where(valid, slots, 0)], conv_inputs, n)
    return set_rows(conv_pool, slots, rolled, valid)


def check_window_counts(num_accepted: Int[Array, " B"], width: int) -> None:
    """Raise ValueError unless every (concrete) count lies in [0, width]; inside `checked` a
    checkify check does the same for traced counts (past T the conv state would roll forward
    by inputs the window never had)."""
    counts = concrete_or_none(num_accepted)
    if counts is not None and np.any((counts < 0) | (counts > width)):
        raise ValueError(f"num_accepted must lie in [0, {width}] (the window width), got {counts.tolist()}")
    debug_check(jnp.all((num_accepted >= 0) & (num_accepted <= width)),
                f"num_accepted must lie in [0, {width}] (the window width): {{n}}", n=num_accepted)


jitted_verify_window = jax.jit(verify_window, static_argnames=("backend",), donate_argnames=("state",))
jitted_accept_window = jax.jit(accept_window, donate_argnames=("state",))


def plain_forward(
    params: DecoderParams,
    tokens: Int[Array, "B T"],
    plain: PlainState,
    lengths: Int[Array, " B"] | None = None,
    *,
    chunked: bool = False,
) -> tuple[Float[Array, "B T V"], PlainState]:
    """T tokens per row with the plain recurrence from `plain` (the token scan, or chunks of
    64 with `chunked`); positions >= lengths are padding."""
    check_token_ids("tokens", tokens, 2)
    if isinstance(params.blocks, tuple):
        return _hybrid_plain(params, tokens, plain, lengths, chunked=chunked)
    dims = _plain_dims(params, plain)

    def layer(x, xs):
        block, ssm, conv = xs
        mixed, ssm, conv = gdn_plain(
            block.gdn, dims, rms_norm(x, block.attn_norm), ssm, conv, lengths, chunked=chunked
        )
        x = x + mixed
        return x + _mlp(block, x), (ssm, conv)

    x, (ssm, conv) = jax.lax.scan(layer, _embed(params, tokens), (params.blocks, plain.ssm, plain.conv))
    return _logits(params, x), PlainState(ssm=ssm, conv=conv)


def _hybrid_plain(params, tokens, plain: PlainState, lengths, *, chunked: bool):
    """`plain_forward` for a hybrid stack (its GDN layers take `chunked`; the Mamba-2 layers
    run their token scan)."""
    x, ssm_out, conv_out = _embed(params, tokens), [], []
    for block, ssm, conv in zip(params.blocks, plain.ssm, plain.conv):
        dims = _hybrid_dims(block, x.shape[-1], ssm.shape)
        options = dict(chunked=chunked) if isinstance(block.mixer, GDNParams) else {}
        mixed, ssm, conv = _MIXERS[type(block.mixer)].plain(
            block.mixer, dims, rms_norm(x, block.attn_norm), ssm, conv, lengths, **options)
        ssm_out.append(ssm)
        conv_out.append(conv)
        x = x + mixed
        x = x + _mlp(block, x)
    return _logits(params, x), PlainState(ssm=tuple(ssm_out), conv=tuple(conv_out))


def _plain_dims(params: DecoderParams, plain: PlainState) -> GDNDims:
    """Layer sizes from the weights and the plain state (H_k from C = 2 H_k d_k + H_v d_v)."""
    _, _, hv, dv, dk = plain.ssm.shape
    hk = (params.blocks.gdn.w_qkv.shape[-1] - hv * dv) // (2 * dk)
    return GDNDims(params.embed.shape[1], hk, hv, dk, dv, params.blocks.gdn.conv_weight.shape[1])


def prefill(
    params: DecoderParams,
    state: ModelState,
    tokens: Int[Array, "B T"],
    lengths: Int[Array, " B"],
    slots: Int[Array, " B"],
) -> tuple[Float[Array, "B V"], ModelState]:
    """Continue each row's slot by `lengths[b]` tokens (right-padded to T) with the chunked
    form of the plain recurrence (`replayssm_jax.chunked`).

    Starts from the slot's live state and conv state (a fresh `reset_slots` slot, or a
    restored prefix snapshot), runs the recurrence over the chunk, and leaves the final state
    as a flushed checkpoint (cursor 0) with the new conv state.

    Returns:
      `(logits of each row's last token [B, V], new_state)`.

    Raises:
      ValueError: a slot >= N or named twice, or a length outside `[0, T]` (when concrete;
        under `jit` through `replayssm_jax.checked`, with token ids outside the vocabulary).
    """
    check_any_model_state(state)
    _check_params_fit(params, state)
    check_token_ids("tokens", tokens, 2)
    check_array("lengths", lengths, jnp.shape(tokens)[:1])
    slots = slot_ops.check_slots_arg("slots", slots, state.num_slots, unique=True)
    chunk = jnp.shape(tokens)[1]
    values = concrete_or_none(lengths)
    if values is not None and ((values < 0) | (values > chunk)).any():
        raise ValueError(f"lengths must be in [0, {chunk}] (the chunk length T), got {values.tolist()}")
    debug_check(
        jnp.all((lengths >= 0) & (lengths <= chunk)),
        f"lengths must be in [0, {chunk}] (the chunk length T): {{n}}", n=lengths,
    )
    live_tokens = (slots >= 0)[:, None] & (jnp.arange(chunk)[None, :] < lengths[:, None])
    _debug_check_token_ids("tokens", tokens, live_tokens, params.embed.shape[0])
    valid, slot = slot_ops.live_entries(slots, state.num_slots)
    target = jnp.where(valid, slots, state.num_slots)
    logits, end = plain_forward(params, tokens, plain_from_slots(params, state, slots), lengths, chunked=True)
    if isinstance(state, HybridState):
        layers = tuple(
            dataclasses.replace(
                layer,
                checkpoint=layer.checkpoint.at[target].set(ssm.astype(layer.checkpoint.dtype), mode="drop"),
                conv_state=layer.conv_state.at[target].set(conv.astype(layer.conv_state.dtype), mode="drop"))
            for layer, ssm, conv in zip(state.layers, end.ssm, end.conv))
        state = HybridState(layers=layers, write_pos=state.write_pos.at[target].set(0, mode="drop"))
    else:
        state = dataclasses.replace(
            state,
            checkpoint=state.checkpoint.at[:, target].set(end.ssm.astype(state.checkpoint.dtype), mode="drop"),
            conv_state=state.conv_state.at[:, target].set(end.conv, mode="drop"),
            write_pos=state.write_pos.at[target].set(0, mode="drop"),
        )
    last = jnp.take_along_axis(logits, jnp.maximum(lengths - 1, 0)[:, None, None], axis=1)
    return last[:, 0], state


def plain_from_slots(params: DecoderParams, state: ModelState | HybridState, slots: Int[Array, " B"]) -> PlainState:
    """Each slot's live state and conv state as a `PlainState` of B rows (zeros for padding
    entries and, unchecked under `jit`, a slot >= N)."""
    valid, slot = slot_ops.live_entries(slots, state.num_slots)
    ssm = slot_ops.live_states(state, slots, layer_gate_params(params))
    if isinstance(state, HybridState):  # zeros past N, not slot N-1's
        conv = tuple(jnp.where(valid[:, None, None], layer.conv_state[slot], 0) for layer in state.layers)
        return PlainState(ssm=ssm, conv=conv)
    return PlainState(ssm=ssm, conv=slot_ops.keep_rows(valid, state.conv_state[:, slot]))


jitted_prefill = jax.jit(prefill, donate_argnames=("state",))
plain_step = jax.jit(plain_forward)


def num_params(params: DecoderParams) -> int:
    return int(sum(np.prod(x.shape) for x in jax.tree.leaves(params)))
