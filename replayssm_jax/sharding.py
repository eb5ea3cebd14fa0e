"""Sharding over a `jax.sharding.Mesh`: heads over the `tp` axis, slots and rows over `dp`.

Layout (every array of a `ReplayState` / `ModelState`, every layer of a `HybridState`):

  checkpoint, u_cache, g_cache   slots over dp, value heads over tp (Mamba-2: its H heads)
  k_cache                        slots over dp, key heads over tp (Mamba-2: its G groups)
  conv_state                     slots over dp, replicated over tp (the projections are)
  write_pos                      slots over dp, replicated over tp

Device (dp = i, tp = j) holds slots [i N/dp, (i+1) N/dp), key heads [j H_k/tp, ...) and value
heads [j H_v/tp, ...): value head h uses key head h // (H_v/H_k), so a GQA group's key head and
its value heads are on the same device and a step needs no head from another device (a
Mamba-2 layer's head h uses group h // (H/G) alike, so tp must divide G, or G = 1: the one
group of B records is then replicated over tp, each device appending the same records).

Rows: the B rows of a step are split over dp in blocks of B/dp, and row block i may only name
slots of dp shard i (global slot ids; negative = padding). Eager calls check this
(`ValueError`); under `jit` a row naming another shard's slot is a padding row of its shard
(y = 0, nothing written). Inside `shard_map` each device runs the single-device step on its
local rows, slots and heads, so the step has no collective on the state; the model's step
all-gathers only the layer outputs y `[B/dp, H_v, d_v]` over tp before its output projection
(the projections run replicated over tp: the simplest correct split).

Several hosts: call `jax.distributed.initialize()` first; `make_mesh` then spans every
host's devices and the same code runs on each.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from jaxtyping import Array, Bool, Float, Int

from replayssm_jax.config import ReplayConfig
from replayssm_jax.decode import check_backend, layer_step
from replayssm_jax import speculative
from replayssm_jax.model import decoder
from replayssm_jax.model.state import (
    HybridLayer,
    HybridState,
    ModelState,
    check_any_model_state,
    layer_configs,
)
from replayssm_jax.plan import (
    FlushPolicy,
    StepPlan,
    advance_write_pos,
    as_policy,
    plan_step,
)
from replayssm_jax.state import ReplayState, check_state
from replayssm_jax.tokens import Mamba2Params, Mamba2Tokens, Tokens, check_gate_params, check_tokens
from replayssm_jax.validation import check_array, check_flags, check_positive_int, check_slots, concrete_or_none

TP, DP = "tp", "dp"
AXES = (DP, TP)


def make_mesh(tp: int = 1, dp: int = 1, devices=None) -> Mesh:
    """A `(dp, tp)` mesh over the first dp * tp devices (default: `jax.devices()`, every host's)."""
    tp, dp = check_positive_int("tp", tp), check_positive_int("dp", dp)
    devices = jax.devices() if devices is None else list(devices)
    if len(devices) < tp * dp:
        raise ValueError(f"a tp={tp}, dp={dp} mesh needs {tp * dp} devices, {len(devices)} available")
    return Mesh(np.array(devices[: tp * dp]).reshape(dp, tp), AXES)


def parse_mesh(text: str) -> Mesh:
    """`"tp=2,dp=2"` (either axis may be left out: size 1) -> `make_mesh(tp=2, dp=2)`."""
    sizes = {}
    for part in filter(None, text.replace(" ", "").split(",")):
        name, _, value = part.partition("=")
        if name not in AXES or name in sizes or not value.isdigit():
            raise ValueError(f"mesh must look like 'tp=2,dp=2' (axes {AXES}, each once), got {text!r}")
        sizes[name] = int(value)
    return make_mesh(**sizes)


def axis_sizes(mesh: Mesh) -> tuple[int, int]:
    """(tp, dp) of a mesh made by `make_mesh`."""
    if tuple(mesh.axis_names) != AXES:
        raise ValueError(f"mesh axes must be {AXES}, got {tuple(mesh.axis_names)}")
    return mesh.shape[TP], mesh.shape[DP]


def check_fits(config: ReplayConfig | tuple[ReplayConfig, ...], num_slots: int, mesh: Mesh,
               batch: int | None = None) -> None:
    """ValueError unless the heads of `config` (or of every layer's, a tuple) divide over tp
    and the slots (and rows) over dp."""
    tp, dp = axis_sizes(mesh)
    for layer in (config,) if isinstance(config, ReplayConfig) else config:
        if layer.gate == "mamba2" and (layer.num_k_heads % tp and layer.num_k_heads != 1 or layer.num_v_heads % tp):
            raise ValueError(f"a Mamba-2 layer's heads ({layer.num_v_heads}) must be a multiple of the tp axis "
                             f"({tp}) and its B / C groups ({layer.num_k_heads}) too, or 1 (replicated)")
        if layer.gate != "mamba2" and layer.num_k_heads % tp:
            raise ValueError(f"num_k_heads ({layer.num_k_heads}) must be a multiple of the tp axis ({tp}): "
                             "a key head and its value heads stay on one device")
    if num_slots % dp:
        raise ValueError(f"num_slots ({num_slots}) must be a multiple of the dp axis ({dp})")
    if batch is not None and batch % dp:
        raise ValueError(f"the batch ({batch}) must be a multiple of the dp axis ({dp}): rows split over dp")


def replicated_keys(config: ReplayConfig, tp: int) -> bool:
    """Whether the layer's key heads stay whole on every tp device (a Mamba-2 layer's single
    B / C group where tp > 1) instead of split over tp."""
    return config.num_k_heads % tp != 0


def local_config(config: ReplayConfig, tp: int) -> ReplayConfig:
    """The config of one tp shard: H_k / tp key heads (all of them where `replicated_keys`),
    H_v / tp value heads."""
    key_heads = config.num_k_heads if replicated_keys(config, tp) else config.num_k_heads // tp
    return dataclasses.replace(config, num_k_heads=key_heads, num_v_heads=config.num_v_heads // tp)


def _key_records_spec(config: ReplayConfig, tp: int) -> P:
    """The key records' spec: key heads over tp, or over dp only where `replicated_keys`."""
    return P(DP) if replicated_keys(config, tp) else P(DP, TP)


def replay_state_specs(config: ReplayConfig, tp: int = 1) -> ReplayState:
    """`PartitionSpec`s of a `ReplayState` (a ReplayState whose leaves are specs) on a mesh of
    `tp` (the key records over dp only where `replicated_keys`)."""
    heads = P(DP, TP)
    return ReplayState(checkpoint=heads, u_cache=heads, g_cache=heads, write_pos=P(DP), config=config,
                       k_cache=_key_records_spec(config, tp))


def model_state_specs(config: ReplayConfig) -> ModelState:
    """`PartitionSpec`s of a `ModelState`: the replay arrays' layer axis is not sharded."""
    heads = P(None, DP, TP)
    return ModelState(checkpoint=heads, u_cache=heads, k_cache=heads, g_cache=heads,
                      conv_state=P(None, DP), write_pos=P(DP), config=config)


def hybrid_state_specs(configs: tuple[ReplayConfig, ...], tp: int) -> HybridState:
    """`PartitionSpec`s of a `HybridState` with these layer configs on a mesh of `tp`: each
    layer's replay arrays as a `ReplayState`'s (key records replicated over tp where
    `replicated_keys`), its conv state over dp only."""
    heads = P(DP, TP)
    layers = tuple(HybridLayer(checkpoint=heads, u_cache=heads, g_cache=heads, conv_state=P(DP), config=config,
                               k_cache=_key_records_spec(config, tp)) for config in configs)
    return HybridState(layers=layers, write_pos=P(DP))


def _specs(state: ReplayState | ModelState | HybridState, mesh: Mesh):
    if isinstance(state, HybridState):
        return hybrid_state_specs(layer_configs(state), axis_sizes(mesh)[0])
    if isinstance(state, ModelState):
        return model_state_specs(state.config)
    return replay_state_specs(state.config, axis_sizes(mesh)[0])


def _configs(state: ReplayState | ModelState | HybridState) -> tuple[ReplayConfig, ...]:
    return layer_configs(state) if isinstance(state, (ModelState, HybridState)) else (state.config,)


def _with_configs(state: ModelState | HybridState, configs: tuple[ReplayConfig, ...]) -> ModelState | HybridState:
    """`state` with its layers' configs replaced (a `ModelState`'s one config: `configs[0]`)."""
    if isinstance(state, HybridState):
        return dataclasses.replace(state, layers=tuple(dataclasses.replace(layer, config=config)
                                                       for layer, config in zip(state.layers, configs)))
    return dataclasses.replace(state, config=configs[0])


def state_sharding(state: ReplayState | ModelState | HybridState, mesh: Mesh):
    """The state's pytree of `NamedSharding`s on `mesh`."""
    return jax.tree.map(lambda spec: NamedSharding(mesh, spec), _specs(state, mesh))


def place_state(state: ReplayState | ModelState | HybridState, mesh: Mesh):
    """`state` on `mesh` (a copy, or the same arrays where they are placed so already).

    Raises:
      ValueError: if some layer's heads do not divide over tp or the slots over dp.
    """
    (check_any_model_state if isinstance(state, (ModelState, HybridState)) else check_state)(state)
    check_fits(_configs(state), state.num_slots, mesh)
    return jax.device_put(state, state_sharding(state, mesh))


def check_row_slots(name: str, slots: Array, num_slots: int, dp: int) -> None:
    """When concrete: each row block i (B/dp rows) names only slots of dp shard i (or padding)."""
    values = concrete_or_none(slots)
    if values is None:
        return
    per_shard, rows = num_slots // dp, values.shape[0] // dp
    shard = np.where(values >= 0, values // per_shard, np.arange(values.shape[0]) // rows)
    wrong = np.flatnonzero(shard != np.arange(values.shape[0]) // rows)
    if wrong.size:
        row = int(wrong[0])
        raise ValueError(f"{name}[{row}] = {int(values[row])} lies in dp shard {int(shard[row])}, but row {row} "
                         f"is in dp shard {row // rows} (rows split over dp in blocks of {rows}, slots in "
                         f"blocks of {per_shard})")


def _check_mesh_slots(slots: Array, batch: int, config: ReplayConfig | tuple[ReplayConfig, ...], num_slots: int,
                      mesh: Mesh) -> None:
    """The slot checks of a sharded call: ids in range, the sizes fit the mesh and each dp
    block of rows names its own shard's slots."""
    check_slots("slots", slots, batch, num_slots)
    check_fits(config, num_slots, mesh, batch)
    check_row_slots("slots", slots, num_slots, axis_sizes(mesh)[1])


def _local_slots(slots: Int[Array, " b"], num_local: int) -> Int[Array, " b"]:
    """Global slot ids -> this dp shard's slot indices; another shard's slot becomes padding."""
    local = slots - jax.lax.axis_index(DP) * num_local
    return jnp.where((slots >= 0) & (local >= 0) & (local < num_local), local, -1)


def _global_plan(plan: StepPlan, num_local: int) -> StepPlan:
    """A local plan with global slot ids (0 on padding rows) and rows (launch order:
    costliest first within each dp shard's rows)."""
    shard = jax.lax.axis_index(DP)
    return dataclasses.replace(plan, slot=jnp.where(plan.valid, plan.slot + shard * num_local, 0),
                               launch_order=plan.launch_order + shard * plan.batch)


def _plan_specs(policy: FlushPolicy) -> StepPlan:
    rows = P(DP)
    return StepPlan(slot=rows, valid=rows, pos=rows, flush=rows, launch_order=rows, policy=policy)


def _sharded_policy(state: ReplayState | ModelState | HybridState, mesh: Mesh, batch: int, policy,
                    backend) -> FlushPolicy:
    """A sharded step's policy: `policy`, by default that of its layers at the per-device
    batch B/dp (`decoder.layers_flush_policy`)."""
    if policy is not None:
        return as_policy(policy)
    return decoder.layers_flush_policy(_configs(state), batch // axis_sizes(mesh)[1], backend)


def _token_specs(config: ReplayConfig, tokens: Tokens | Mamba2Tokens, tp: int, window: bool):
    """Specs of a step's (`[B, ...]`) or a window's (`[B, T, ...]`) tokens: rows over dp,
    heads over tp (a Mamba-2 layer's replicated single group of B, C: over dp only)."""
    heads = P(DP, None, TP) if window else P(DP, TP)
    specs = jax.tree.map(lambda _: heads, tokens)
    if isinstance(tokens, Mamba2Tokens) and replicated_keys(config, tp):
        specs = specs.replace(B=P(DP), C=P(DP))
    return specs


def _gate_param_specs(gate_params):
    """Every gate parameter (GDN / KDA `(A_log, dt_bias)`, a `Mamba2Params`) is per value head
    on its leading axis: split over tp."""
    return jax.tree.map(lambda _: P(TP), gate_params)


def decode_step(
    state: ReplayState,
    tokens: Tokens | Mamba2Tokens,
    slots: Int[Array, " B"],
    force_flush: Bool[Array, " B"] | None = None,
    *,
    mesh: Mesh,
    backend: str = "xla",
    policy: FlushPolicy | str | None = None,
    use_qk_l2norm: bool = False,
    scale: float | None = None,
    gate_params: tuple[Array, Array] | Mamba2Params | None = None,
) -> tuple[Float[Array, "B Hv Dv"], ReplayState]:
    """`replayssm_jax.decode_step` sharded over `mesh` (rows and slots as in the module docstring).

    Each device runs the single-device step on its B/dp rows, N/dp slots and H/tp heads
    (with its heads' `gate_params`); the default policy is `default_flush_policy` of the
    per-device batch B/dp, and the pallas_triton backend's launch table is looked up with
    the per-device shapes. Any gate: GDN / KDA `Tokens` or a Mamba-2 layer's `Mamba2Tokens`.

    Returns:
      `(y [B, H_v, d_v], new_state)`, y split over dp (rows) and tp (heads).
    """
    check_state(state)
    batch = check_tokens(state.config, tokens)
    check_gate_params(state.config, gate_params)
    _check_mesh_slots(slots, batch, state.config, state.num_slots, mesh)
    check_flags("force_flush", force_flush, batch)
    check_backend(backend)
    policy = _sharded_policy(state, mesh, batch, policy, backend)
    tp, _ = axis_sizes(mesh)
    config = state.config
    force = jnp.zeros((batch,), bool) if force_flush is None else force_flush

    def local(state, tokens, slots, force, gate_params):
        state = dataclasses.replace(state, config=local_config(config, tp))
        plan = plan_step(state.write_pos, _local_slots(slots, state.num_slots), force, config.cache_len, policy)
        y, new = layer_step(state, tokens, plan, backend=backend, use_qk_l2norm=use_qk_l2norm, scale=scale,
                            gate_params=gate_params)
        return y, dataclasses.replace(new, write_pos=advance_write_pos(state.write_pos, plan), config=config)

    specs = _specs(state, mesh)
    # check_vma off: write_pos is declared replicated over tp, and every tp shard computes
    # it from the same (replicated) cursors and slots.
    step = jax.shard_map(local, mesh=mesh, in_specs=(specs, _token_specs(config, tokens, tp, False), P(DP), P(DP),
                                                     _gate_param_specs(gate_params)),
                         out_specs=(P(DP, TP), specs), check_vma=False)
    return step(state, tokens, jnp.asarray(slots, jnp.int32), force, gate_params)


def verify_step(
    state: ReplayState,
    window: Tokens | Mamba2Tokens,
    slots: Int[Array, " B"],
    *,
    mesh: Mesh,
    backend: str = "xla",
    lengths: Int[Array, " B"] | None = None,
    parents: Int[Array, "B T"] | None = None,
    use_qk_l2norm: bool = False,
    scale: float | None = None,
    gate_params: tuple[Array, Array] | Mamba2Params | None = None,
) -> tuple[Float[Array, "B T Hv Dv"], ReplayState]:
    """`replayssm_jax.verify_step` on `backend` sharded over `mesh` (rows and slots as in the
    module docstring): each device verifies its B/dp rows' windows on its H/tp heads (with
    its heads' `gate_params`); the window solve is per head, so no device needs another's
    heads. Any gate, as `decode_step`.

    Returns:
      `(y [B, T, H_v, d_v], new_state)`, y split over dp (rows) and tp (heads).
    """
    check_state(state)
    batch, _ = speculative.check_window(state.config, window)
    check_gate_params(state.config, gate_params)
    _check_mesh_slots(slots, batch, state.config, state.num_slots, mesh)
    check_backend(backend)
    tp, _ = axis_sizes(mesh)
    config = state.config
    # optional per-row arguments travel only when given, so the local call is the caller's
    options = {name: (jnp.asarray(value, jnp.int32), spec) for name, value, spec in
               (("lengths", lengths, P(DP)), ("parents", parents, P(DP, None))) if value is not None}

    def local(state, window, slots, options, gate_params):
        state = dataclasses.replace(state, config=local_config(config, tp))
        y, new = speculative.verify_step(state, window, _local_slots(slots, state.num_slots), backend=backend,
                                         use_qk_l2norm=use_qk_l2norm, scale=scale, gate_params=gate_params,
                                         **options)
        return y, dataclasses.replace(new, config=config)

    specs = _specs(state, mesh)
    option_specs = {name: spec for name, (_, spec) in options.items()}
    step = jax.shard_map(local, mesh=mesh, in_specs=(specs, _token_specs(config, window, tp, True), P(DP),
                                                     option_specs, _gate_param_specs(gate_params)),
                         out_specs=(P(DP, None, TP), specs), check_vma=False)
    return step(state, window, jnp.asarray(slots, jnp.int32), {name: v for name, (v, _) in options.items()},
                gate_params)


def accept(
    state: ReplayState,
    slots: Int[Array, " B"],
    num_accepted: Int[Array, " B"],
    *,
    mesh: Mesh,
    path: Int[Array, "B P"] | None = None,
) -> ReplayState:
    """`replayssm_jax.accept` sharded over `mesh`: each device moves its slots' cursors (and,
    for a tree's `path`, moves its heads' records)."""
    check_state(state)
    check_array("slots", slots, (None,), layout="a 1-D [B] array")
    batch = jnp.shape(slots)[0]
    _check_mesh_slots(slots, batch, state.config, state.num_slots, mesh)
    tp, _ = axis_sizes(mesh)
    config = state.config
    num_accepted = jnp.asarray(num_accepted, jnp.int32)

    def local(state, slots, num_accepted, *path):
        state = dataclasses.replace(state, config=local_config(config, tp))
        new = speculative.accept(state, _local_slots(slots, state.num_slots), num_accepted,
                                 path=path[0] if path else None)
        return dataclasses.replace(new, config=config)

    specs = _specs(state, mesh)
    extra = () if path is None else (jnp.asarray(path, jnp.int32),)
    step = jax.shard_map(local, mesh=mesh, in_specs=(specs, P(DP), P(DP)) + (P(DP, None),) * len(extra),
                         out_specs=specs, check_vma=False)
    return step(state, jnp.asarray(slots, jnp.int32), num_accepted, *extra)


def model_decode_step(
    params: decoder.DecoderParams,
    state: ModelState | HybridState,
    tokens: Int[Array, " B"],
    slots: Int[Array, " B"],
    force_flush: Bool[Array, " B"] | None = None,
    *,
    mesh: Mesh,
    backend: str = "xla",
    policy: FlushPolicy | str | None = None,
) -> tuple[Float[Array, "B V"], ModelState | HybridState, StepPlan]:
    """`model.decoder.decode_step` sharded over `mesh`: returns `(logits, new_state, plan)`.

    Weights are replicated; each device projects its rows for every head, steps its own
    heads' state, and all-gathers the layer outputs y over tp for the output projection
    (a hybrid stack: every layer, GDN or Mamba-2, so). The plan holds global rows and slot
    ids; the default policy is `decoder.model_flush_policy` of the per-device batch.
    """
    check_any_model_state(state)
    decoder.check_token_ids("tokens", tokens, 1)
    batch = jnp.shape(tokens)[0]
    _check_mesh_slots(slots, batch, layer_configs(state), state.num_slots, mesh)
    check_flags("force_flush", force_flush, batch)
    check_backend(backend)
    policy = _sharded_policy(state, mesh, batch, policy, backend)
    force = jnp.zeros((batch,), bool) if force_flush is None else force_flush

    def local(params, state, tokens, slots, force):
        num_local = state.num_slots
        logits, state, plan = decoder.decode_core(
            params, state, tokens, _local_slots(slots, num_local), force,
            backend=backend, policy=policy, tp_axis=TP,
        )
        return logits, state, _global_plan(plan, num_local)

    specs = _specs(state, mesh)
    # check_vma off: logits, conv state, cursors and plan are declared replicated over tp;
    # every tp shard computes them from the same inputs and the all-gathered y.
    step = jax.shard_map(
        local, mesh=mesh, in_specs=(P(), specs, P(DP), P(DP), P(DP)),
        out_specs=(P(DP), specs, _plan_specs(policy)), check_vma=False,
    )
    return step(params, state, jnp.asarray(tokens), jnp.asarray(slots, jnp.int32), force)


jitted_model_decode_step = jax.jit(model_decode_step, static_argnames=("mesh", "backend", "policy"),
                                   donate_argnames=("state",))


def _conv_input_specs(state: ModelState | HybridState):
    """Specs of a verify window's conv inputs: `[Y, B, T, C]` rows over dp, or a hybrid
    stack's one `[B, T, C]` per layer."""
    if isinstance(state, HybridState):
        return tuple(P(DP) for _ in state.layers)
    return P(None, DP)


def model_verify_step(
    params: decoder.DecoderParams,
    state: ModelState | HybridState,
    tokens: Int[Array, "B T"],
    slots: Int[Array, " B"],
    *,
    mesh: Mesh,
    backend: str = "xla",
    parents: Int[Array, "B T"] | None = None,
) -> tuple[Float[Array, "B T V"], ModelState | HybridState, Float[Array, "Y B T C"] | tuple, Bool[Array, " B"]]:
    """`model.decoder.verify_window` sharded over `mesh` (a chain, or a tree by `parents`):
    returns `(logits, new_state, conv_inputs, folded)` as it does (a hybrid stack's conv
    inputs: one `[B, T, C]` per layer), for `model_accept_step`.

    As `model_decode_step`: weights replicated, each device verifies its B/dp rows' windows
    on its own heads and all-gathers the layer outputs over tp for the output projection.
    """
    check_any_model_state(state)
    decoder.check_token_ids("tokens", tokens, 2)
    batch, width = jnp.shape(tokens)
    configs = layer_configs(state)
    _check_mesh_slots(slots, batch, configs, state.num_slots, mesh)
    check_backend(backend)
    if width > configs[0].cache_len:
        raise ValueError(f"window width T = {width} exceeds cache_len = {configs[0].cache_len}")
    speculative.check_parents(parents, batch, width)
    tree = () if parents is None else (jnp.asarray(parents, jnp.int32),)

    def local(params, state, tokens, slots, *tree):
        return decoder.verify_core(params, state, tokens, _local_slots(slots, state.num_slots), backend=backend,
                                   tp_axis=TP, parents=tree[0] if tree else None)

    specs = _specs(state, mesh)
    # check_vma off: logits, conv inputs, cursors and folded rows are declared replicated
    # over tp; every tp shard computes them from the same inputs and the all-gathered y.
    step = jax.shard_map(local, mesh=mesh, in_specs=(P(), specs, P(DP), P(DP)) + (P(DP, None),) * len(tree),
                         out_specs=(P(DP), specs, _conv_input_specs(state), P(DP)), check_vma=False)
    return step(params, state, jnp.asarray(tokens), jnp.asarray(slots, jnp.int32), *tree)


def model_accept_step(
    state: ModelState | HybridState,
    slots: Int[Array, " B"],
    num_accepted: Int[Array, " B"],
    conv_inputs: Float[Array, "Y B T C"] | tuple,
    *,
    mesh: Mesh,
    path: Int[Array, "B P"] | None = None,
) -> ModelState | HybridState:
    """`model.decoder.accept_window` sharded over `mesh`: each device moves its slots'
    cursors (a tree's accepted `path`: and its heads' records of the path) and rolls their
    conv states forward by the accepted tokens."""
    check_any_model_state(state)
    check_array("slots", slots, (None,), layout="a 1-D [B] array")
    batch = jnp.shape(slots)[0]
    configs = layer_configs(state)
    _check_mesh_slots(slots, batch, configs, state.num_slots, mesh)
    check_array("num_accepted", num_accepted, (batch,), layout="a 1-D [B] array")
    hybrid = isinstance(state, HybridState)
    decoder.check_window_counts(num_accepted, jnp.shape(conv_inputs[0] if hybrid else conv_inputs)[-2])
    tp, _ = axis_sizes(mesh)
    local_configs = tuple(local_config(config, tp) for config in configs)
    if path is not None:
        check_array("path", path, (batch, None), int, layout="a [B, P] int array")
    extra = () if path is None else (jnp.asarray(path, jnp.int32),)

    def local(state, slots, num_accepted, conv_inputs, *path):
        state = _with_configs(state, local_configs)
        new = decoder.accept_window(state, _local_slots(slots, state.num_slots), num_accepted, conv_inputs,
                                    path=path[0] if path else None)
        return _with_configs(new, configs)

    specs = _specs(state, mesh)
    step = jax.shard_map(local, mesh=mesh, in_specs=(specs, P(DP), P(DP), _conv_input_specs(state))
                         + (P(DP, None),) * len(extra), out_specs=specs, check_vma=False)
    return step(state, jnp.asarray(slots, jnp.int32), jnp.asarray(num_accepted, jnp.int32), conv_inputs, *extra)


jitted_model_verify_step = jax.jit(model_verify_step, static_argnames=("mesh", "backend"),
                                   donate_argnames=("state",))
jitted_model_accept_step = jax.jit(model_accept_step, static_argnames=("mesh",), donate_argnames=("state",))

