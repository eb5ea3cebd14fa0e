"""Model-level ReplaySSM state: every linear-attention layer of a model in one pytree.

Layout (Y layers, N physical slots, L = cache_len, C = conv channels, K = conv kernel):

  checkpoint  [Y, N, H_v, d_v, d_k]   state_dtype   per layer, as in `ReplayState`
  u_cache     [Y, N, H_v, L, d_v]     cache_dtype
  k_cache     [Y, N, H_k, L, d_k]     cache_dtype
  g_cache     [Y, N, H_v, L]          float32
  conv_state  [Y, N, K - 1, C]        conv_dtype    last K - 1 inputs of the causal conv
  write_pos   [N]                     int32         ONE cursor per slot, shared by all layers

Per forward pass the flush plan is computed once (`plan.plan_step` on `write_pos`), every
layer applies it, and the cursor advances once (`plan.advance_write_pos`).

Two per-layer views of the same arrays:

* `layer_state(state, i)`: layer i's `ReplayState` (slices + the shared `write_pos`), for
  inspection (`materialize_state`) and tests. Slicing copies, so a step never uses it.
* `flat_view(state)` + `layer_plan(plan, i, N)`: the stacked arrays reshaped (a free
  bitcast) to one pool of Y * N slots, layer i's slot s at index i * N + s. A decode step
  carries this view through a `lax.scan` over layers and `layer_step` scatters straight
  into the donated buffers: no per-layer slice, no copy of the pool.

A hybrid stack (layers of different kinds, e.g. GDN and Mamba-2: shapes differ per layer)
is a `HybridState`: one `HybridLayer` per layer, each with its own `ReplayState` arrays (its
config: the layer's gate kind and sizes) and its own conv state `[N, K - 1, C_layer]`, and
the same ONE cursor per slot. `layer_state(state, i)` is layer i's `ReplayState` (no copy
here); `layer_views(state)` gives each layer as a one-layer `ModelState`, so that slot
operations written for a `ModelState` run layer by layer, and `from_layer_views` puts the
results back.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from replayssm_jax.config import ReplayConfig
from replayssm_jax.plan import StepPlan
from replayssm_jax.state import ReplayState, state_shapes
from replayssm_jax.validation import check_array, check_like, check_positive_int

_REPLAY_FIELDS = ("checkpoint", "u_cache", "k_cache", "g_cache")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ModelState:
    """Pytree of a model's ReplaySSM state (see the module docstring); `config` is static."""

    checkpoint: Float[Array, "Y N Hv Dv Dk"]
    u_cache: Float[Array, "Y N Hv L Dv"]
    k_cache: Float[Array, "Y N Hk L Dk"]
    g_cache: Float[Array, "Y N Hv L *Dk"]
    conv_state: Float[Array, "Y N Km1 C"]
    write_pos: Int[Array, " N"]
    config: ReplayConfig = dataclasses.field(metadata=dict(static=True))

    @property
    def num_layers(self) -> int:
        return self.checkpoint.shape[0]

    @property
    def num_slots(self) -> int:
        return self.checkpoint.shape[1]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Snapshot:
    """The state of B flushed slots, all layers: what a prefix cache stores.

    Attributes:
      checkpoint: `[Y, B, H_v, d_v, d_k]` in the state dtype (a hybrid state's: a tuple of
        one `[B, ...]` per layer).
      conv_state: `[Y, B, K - 1, C]` (hybrid: a tuple of one `[B, K - 1, C_layer]` per layer).
    """

    checkpoint: Float[Array, "Y B Hv Dv Dk"]
    conv_state: Float[Array, "Y B Km1 C"]


def init_model_state(
    config: ReplayConfig,
    num_layers: int,
    num_slots: int,
    conv_channels: int,
    conv_kernel: int = 4,
    conv_dtype: jnp.dtype = jnp.float32,
) -> ModelState:
    """Zero checkpoints, empty caches, zero conv state for `num_layers` x `num_slots`.

    Raises:
      ValueError: on a non-positive size or a conv kernel < 2.
    """
    num_layers = check_positive_int("num_layers", num_layers)
    num_slots = check_positive_int("num_slots", num_slots)
    conv_channels = check_positive_int("conv_channels", conv_channels)
    if check_positive_int("conv_kernel", conv_kernel) < 2:
        raise ValueError(f"conv_kernel must be >= 2, got {conv_kernel}")
    shapes = state_shapes(config, num_slots)
    arrays = {
        name: jnp.zeros((num_layers, *shapes[name].shape), shapes[name].dtype)
        for name in _REPLAY_FIELDS
    }
    return ModelState(
        **arrays,
        conv_state=jnp.zeros((num_layers, num_slots, conv_kernel - 1, conv_channels), conv_dtype),
        write_pos=jnp.zeros((num_slots,), jnp.int32),
        config=config,
    )


def check_model_state(state: ModelState) -> None:
    """Raise ValueError unless every field matches the state's config and sizes."""
    if not isinstance(state, ModelState):
        raise ValueError(f"state must be a ModelState, got {type(state).__name__}")
    y, n = state.checkpoint.shape[:2]
    shapes = state_shapes(state.config, n)
    for name in _REPLAY_FIELDS:
        want = shapes[name]
        check_like(f"state.{name}", getattr(state, name), jax.ShapeDtypeStruct((y, *want.shape), want.dtype))
    check_array("state.conv_state", state.conv_state, (y, n, None, None), layout=f"[{y}, {n}, K-1, C]")
    check_like("state.write_pos", state.write_pos, jax.ShapeDtypeStruct((n,), jnp.int32))


def layer_state(state: ModelState | HybridState, layer: int) -> ReplayState:
    """Layer `layer`'s `ReplayState` (sliced arrays of a `ModelState`, a `HybridState`'s own
    arrays; the shared `write_pos`)."""
    if isinstance(state, HybridState):
        one = state.layers[layer]
        return ReplayState(**{name: getattr(one, name) for name in _REPLAY_FIELDS}, write_pos=state.write_pos,
                           config=one.config)
    return ReplayState(
        **{name: getattr(state, name)[layer] for name in _REPLAY_FIELDS},
        write_pos=state.write_pos,
        config=state.config,
    )


def flat_view(state: ModelState) -> tuple[ReplayState, Float[Array, "YN Km1 C"]]:
    """All layers as one `ReplayState` pool of Y * N slots, plus the conv pool `[Y*N, K-1, C]`.

    Layer i's slot s is flat slot `i * N + s`; `write_pos` is tiled so every flat slot
    carries its slot's shared cursor. The reshapes are bitcasts (no copy).
    """
    flat = {name: _merge(getattr(state, name)) for name in _REPLAY_FIELDS}
    write_pos = jnp.tile(state.write_pos, state.num_layers)
    view = ReplayState(**flat, write_pos=write_pos, config=state.config)
    return view, _merge(state.conv_state)


def from_flat_view(
    state: ModelState,
    view: ReplayState,
    conv_pool: Float[Array, "YN Km1 C"],
    write_pos: Int[Array, " N"],
) -> ModelState:
    """Fold a flat view (after layer steps) back into `state`'s layout with a new cursor."""
    y = state.num_layers
    return dataclasses.replace(
        state,
        **{name: _split(getattr(view, name), y) for name in _REPLAY_FIELDS},
        conv_state=_split(conv_pool, y),
        write_pos=write_pos,
    )


def layer_plan(plan: StepPlan, layer: Int[Array, ""] | int, num_slots: int) -> StepPlan:
    """`plan` addressed to layer `layer` of a flat view (slot s -> layer * N + s)."""
    return dataclasses.replace(plan, slot=plan.slot + layer * num_slots)


def _merge(x: Array) -> Array:
    """`[Y, N, ...]` -> `[Y * N, ...]`."""
    return x.reshape(x.shape[0] * x.shape[1], *x.shape[2:])


def _split(x: Array, num_layers: int) -> Array:
    """`[Y * N, ...]` -> `[Y, N, ...]`."""
    return x.reshape(num_layers, x.shape[0] // num_layers, *x.shape[1:])


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class HybridLayer:
    """One layer of a `HybridState`: its `ReplayState` arrays (shapes by `config`, see
    `replayssm_jax.state`) and its conv state `[N, K - 1, C]`; `config` is static."""

    checkpoint: Float[Array, "N Hv Dv Dk"]
    u_cache: Float[Array, "N Hv L Dv"]
    k_cache: Float[Array, "N Hk L Dk"]
    g_cache: Float[Array, "N Hv L *Dk"]
    conv_state: Float[Array, "N Km1 C"]
    config: ReplayConfig = dataclasses.field(metadata=dict(static=True))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class HybridState:
    """Pytree of a hybrid stack's state: one `HybridLayer` per layer, one shared cursor
    `write_pos [N]` (see the module docstring)."""

    layers: tuple[HybridLayer, ...]
    write_pos: Int[Array, " N"]

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def num_slots(self) -> int:
        return self.write_pos.shape[0]

    @property
    def kinds(self) -> tuple[str, ...]:
        """Each layer's gate kind, e.g. `("gdn", "mamba2", "gdn")`."""
        return tuple(layer.config.gate for layer in self.layers)

    @property
    def cache_len(self) -> int:
        """L, shared by every layer (one cursor per slot)."""
        return self.layers[0].config.cache_len


def init_hybrid_state(
    configs: tuple[ReplayConfig, ...],
    num_slots: int,
    conv_channels: tuple[int, ...],
    conv_kernel: int = 4,
    conv_dtype: jnp.dtype = jnp.float32,
) -> HybridState:
    """Zero checkpoints, empty caches, zero conv states: layer i by `configs[i]` with
    `conv_channels[i]` conv channels.

    Raises:
      ValueError: on no layers, configs of different cache lengths, a conv channel count per
        layer missing, a non-positive size or a conv kernel < 2.
    """
    configs, conv_channels = tuple(configs), tuple(conv_channels)
    if not configs or not all(isinstance(c, ReplayConfig) for c in configs):
        raise ValueError(f"configs must be a non-empty sequence of ReplayConfig, got {configs!r}")
    if len({c.cache_len for c in configs}) != 1:
        raise ValueError(f"every layer needs the same cache_len (one cursor per slot), got "
                         f"{[c.cache_len for c in configs]}")
    if len(conv_channels) != len(configs):
        raise ValueError(f"conv_channels needs one entry per layer ({len(configs)}), got {conv_channels}")
    num_slots = check_positive_int("num_slots", num_slots)
    if check_positive_int("conv_kernel", conv_kernel) < 2:
        raise ValueError(f"conv_kernel must be >= 2, got {conv_kernel}")
    layers = []
    for config, channels in zip(configs, conv_channels):
        shapes = state_shapes(config, num_slots)
        layers.append(HybridLayer(
            **{name: jnp.zeros(shapes[name].shape, shapes[name].dtype) for name in _REPLAY_FIELDS},
            conv_state=jnp.zeros((num_slots, conv_kernel - 1, check_positive_int("conv_channels", channels)), conv_dtype),
            config=config,
        ))
    return HybridState(layers=tuple(layers), write_pos=jnp.zeros((num_slots,), jnp.int32))


def check_hybrid_state(state: HybridState) -> None:
    """Raise ValueError unless every layer's arrays match its config and the slot count."""
    if not isinstance(state, HybridState):
        raise ValueError(f"state must be a HybridState, got {type(state).__name__}")
    n = state.num_slots
    for i, layer in enumerate(state.layers):
        shapes = state_shapes(layer.config, n)
        for name in _REPLAY_FIELDS:
            want, got = shapes[name], getattr(layer, name)
            if tuple(got.shape) != want.shape or got.dtype != want.dtype:
                raise ValueError(f"state.layers[{i}].{name} must have shape {want.shape} and dtype {want.dtype}, "
                                 f"got {tuple(got.shape)} {got.dtype}")
        if layer.conv_state.ndim != 3 or layer.conv_state.shape[0] != n:
            raise ValueError(f"state.layers[{i}].conv_state must be [{n}, K-1, C], got "
                             f"{tuple(layer.conv_state.shape)}")
        if layer.config.cache_len != state.cache_len:
            raise ValueError(f"state.layers[{i}] has cache_len {layer.config.cache_len}, layer 0 "
                             f"{state.cache_len}: one cursor needs one cache length")
    if tuple(state.write_pos.shape) != (n,) or state.write_pos.dtype != jnp.int32:
        raise ValueError(f"state.write_pos must be int32 [{n}], got {tuple(state.write_pos.shape)} "
                         f"{state.write_pos.dtype}")


def check_any_model_state(state: ModelState | HybridState) -> None:
    """`check_model_state` or `check_hybrid_state`, by the state's type."""
    (check_hybrid_state if isinstance(state, HybridState) else check_model_state)(state)


def layer_configs(state: ModelState | HybridState) -> tuple[ReplayConfig, ...]:
    """Every layer's `ReplayConfig`, in order."""
    if isinstance(state, HybridState):
        return tuple(layer.config for layer in state.layers)
    return (state.config,) * state.num_layers


def layer_views(state: HybridState) -> list[ModelState]:
    """Each layer of a hybrid state as a one-layer `ModelState` with the shared cursor (the
    leading axis added by a reshape: no copy under `jit`)."""
    return [
        ModelState(**{name: getattr(layer, name)[None] for name in (*_REPLAY_FIELDS, "conv_state")},
                   write_pos=state.write_pos, config=layer.config)
        for layer in state.layers
    ]


def from_layer_views(state: HybridState, views: list[ModelState], write_pos: Int[Array, " N"]) -> HybridState:
    """`state` with each layer's arrays taken from its one-layer view, and `write_pos`."""
    layers = tuple(
        dataclasses.replace(layer, **{name: getattr(view, name)[0] for name in (*_REPLAY_FIELDS, "conv_state")})
        for layer, view in zip(state.layers, views)
    )
    return HybridState(layers=layers, write_pos=write_pos)


def with_layer(state: HybridState, index: int, replay: ReplayState, conv_state: Float[Array, "N Km1 C"]) -> HybridState:
    """`state` with layer `index`'s arrays from `replay` (its `write_pos` is ignored: the
    cursor moves once per forward pass) and its conv state."""
    layer = dataclasses.replace(state.layers[index], **{name: getattr(replay, name) for name in _REPLAY_FIELDS},
                                conv_state=conv_state)
    return dataclasses.replace(state, layers=state.layers[:index] + (layer,) + state.layers[index + 1:])
