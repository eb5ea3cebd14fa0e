"""The "pallas_triton" backend: `ReplayState` + `StepPlan` in, Pallas-Triton kernels, state out.

Which kernel runs follows from the plan: L = 1 runs the plain kernel on the checkpoint
(every step flushes), a fold-every-step plan the folding kernel, a natural plan the
grouped replay kernel. Its launch parameters come from `LAUNCH_TABLE`, a flat list of rows
looked up first match by (step, gate, state bytes, batch, cache length); each row names the
results file that justifies it (under `benchmarks/results/raw/`, H200). A caller's
`kernel_params` replaces the table's choice (any kernel's parameter class the step admits).
"""

from __future__ import annotations

import dataclasses
from typing import Literal

from jaxtyping import Array, Float

from pallas_kernels import common
from pallas_kernels.common import GridOrder
from pallas_kernels.fold_decode import FoldParams, fold_decode
from pallas_kernels.mamba2_decode import Mamba2PlainParams, Mamba2ReplayParams, mamba2_plain_decode, mamba2_replay_decode
from pallas_kernels.plain_decode import PlainParams, plain_decode
from pallas_kernels.replay_decode import ReplayTileParams, replay_decode
from pallas_kernels.replay_decode_grouped import ReplayGroupedParams, replay_decode_grouped
from pallas_kernels.verify_readout import VerifyReadoutParams
from replayssm_jax.config import ReplayConfig
from replayssm_jax.plan import FlushPolicy, StepPlan
from replayssm_jax.state import ReplayState
from replayssm_jax.tokens import Tokens

Step = Literal["plain", "fold", "replay", "verify"]
KernelParams = (PlainParams | FoldParams | ReplayTileParams | ReplayGroupedParams | Mamba2PlainParams
                | Mamba2ReplayParams | VerifyReadoutParams)
# The parameter classes each step accepts from a caller (the table's rows use the first).
STEP_PARAMS: dict[str, tuple[type, ...]] = {
    "plain": (PlainParams,),
    "fold": (FoldParams,),
    "replay": (ReplayGroupedParams, ReplayTileParams, FoldParams),
    "verify": (VerifyReadoutParams,),
}
# Mamba-2 (the additive rule) has its own kernels; a fold-every-step plan runs the replay
# kernel with every live row flushing.
MAMBA2_STEP_PARAMS: dict[str, tuple[type, ...]] = {
    "plain": (Mamba2PlainParams,),
    "fold": (Mamba2ReplayParams,),
    "replay": (Mamba2ReplayParams,),
}
ANY = None  # a row's gate or state bytes that matches every value


@dataclasses.dataclass(frozen=True)
class LaunchRow:
    """One row of the launch table: `params` for `step` on these layers and batches.

    `batch` and `cache_len` are inclusive ranges (`None` as the upper end: unbounded);
    `gate` and `state_bytes` are a value or ANY; `source` is the results file behind it
    (relative to `benchmarks/results/raw/`), or says that the row only covers its range.
    """

    step: Step
    gate: str | None
    state_bytes: int | None
    batch: tuple[int, int | None]
    cache_len: tuple[int, int | None]
    params: KernelParams
    source: str

    def matches(self, step: str, gate: str, state_bytes: int, batch: int, cache_len: int) -> bool:
        within = lambda x, lo_hi: lo_hi[0] <= x and (lo_hi[1] is None or x <= lo_hi[1])
        return (self.step == step and self.gate in (ANY, gate) and self.state_bytes in (ANY, state_bytes)
                and within(batch, self.batch) and within(cache_len, self.cache_len))


_ALL, _SHORT, _LONG = (1, None), (2, 16), (17, None)  # cache lengths: a long cache flushes longer programs
_ROWS, _LO, _LOR = GridOrder.ROW_SLOWEST, GridOrder.LAUNCH_ORDER, GridOrder.LAUNCH_ORDER_RELOAD
_UNTUNED = "untuned: covers the range with a measured entry's shape"
# The plain kernel's large-batch tile with the folding kernel's empty-cache branch.
_FOLD_WIDE = FoldParams(16, 1, column_chunk=16, grid_order=GridOrder.ROW_SLOWEST, empty_cache_branch=True)
_MAMBA2_UNTUNED = "untuned: Mamba-2 tile shape not yet measured on the H200"

LAUNCH_TABLE: tuple[LaunchRow, ...] = (
    # Mamba-2 first: the rows for any gate below name the delta-rule kernels
    LaunchRow("plain", "mamba2", ANY, (1, 16), _ALL, Mamba2PlainParams(16, 1), _MAMBA2_UNTUNED),
    LaunchRow("plain", "mamba2", 4, (17, None), _ALL, Mamba2PlainParams(16, 1, grid_order=_ROWS),
              "h200_2026-12-02_mamba2_tiles.json"),
    LaunchRow("plain", "mamba2", 2, (17, None), _ALL, Mamba2PlainParams(16, 2, grid_order=_ROWS),
              "h200_2026-12-02_mamba2_tiles.json"),
    LaunchRow("fold", "mamba2", ANY, (1, 16), _ALL, Mamba2ReplayParams(16, 1, grid_order=_ROWS), _MAMBA2_UNTUNED),
    LaunchRow("fold", "mamba2", ANY, (17, None), _ALL, Mamba2ReplayParams(8, 1, grid_order=_ROWS),
              "h200_2026-12-02_mamba2_fold_tiles.json"),
    LaunchRow("replay", "mamba2", ANY, (1, 16), _ALL, Mamba2ReplayParams(16, 1), _MAMBA2_UNTUNED),
    LaunchRow("replay", "mamba2", ANY, (17, None), _ALL, Mamba2ReplayParams(32, 1, grid_order=_ROWS),
              "h200_2026-12-02_mamba2_tiles.json"),
    # plain decode (the baseline, and every step at L = 1)
    LaunchRow("plain", "gdn", 4, (1, 2), _ALL, PlainParams(4, 1, column_chunk=32), "h200_2026-11-29_v21_small_batch.json"),
    LaunchRow("plain", "gdn", 2, (1, 2), _ALL, PlainParams(4, 1), "h200_2026-11-29_v23c_one_row.json"),
    LaunchRow("plain", "gdn", ANY, (3, 4), _ALL, PlainParams(8, 1), "h200_2026-11-29_v11_final.json"),
    LaunchRow("plain", "gdn", ANY, (5, 16), _ALL, PlainParams(16, 1), "h200_2026-11-29_v15_grid_order.json"),
    LaunchRow("plain", "kda", ANY, (1, 8), _ALL, PlainParams(8, 1), "h200_2026-11-29_v11_kda8.json"),
    LaunchRow("plain", "kda", ANY, (9, 16), _ALL, PlainParams(16, 1), "h200_2026-11-29_v15_grid_order.json"),
    LaunchRow("plain", ANY, 4, (17, None), _ALL, PlainParams(16, 1, column_chunk=16, grid_order=_ROWS),
              "h200_2026-11-29_v15_grid_order.json"),
    LaunchRow("plain", ANY, 2, (17, None), _ALL, PlainParams(16, 1, grid_order=_ROWS), "h200_2026-11-29_v15_grid_order.json"),
    # fold every step (FlushPolicy.EVERY_STEP)
    LaunchRow("fold", "gdn", 4, (1, 2), _ALL, FoldParams(4, 1, empty_cache_branch=True), "h200_2026-11-29_v25c_final.json"),
    LaunchRow("fold", "gdn", 4, (3, 5), _ALL, FoldParams(8, 1), "h200_2026-11-29_v23b_fold_boundary.json"),
    LaunchRow("fold", ANY, 2, (1, 1), _ALL, FoldParams(4, 1), "h200_2026-11-29_v23c_one_row.json"),
    LaunchRow("fold", ANY, 2, (2, 8), _ALL, FoldParams(8, 1), "h200_2026-11-29_v22b_load_order_new1.json"),
    LaunchRow("fold", "kda", 4, (1, 8), _ALL, FoldParams(8, 1), "h200_2026-11-29_v11_kda8.json"),
    LaunchRow("fold", "kda", 4, (9, None), _ALL, _FOLD_WIDE, "h200_2026-11-29_v27b_kda_fold.json"),
    LaunchRow("fold", "gdn", 4, (6, None), _ALL, _FOLD_WIDE, _UNTUNED),
    LaunchRow("fold", ANY, 2, (9, None), _ALL, FoldParams(16, 1, grid_order=_ROWS, empty_cache_branch=True), _UNTUNED),
    # replay (FlushPolicy.NATURAL), GDN with a 4-byte state
    LaunchRow("replay", "gdn", 4, (1, 9), _ALL, ReplayGroupedParams(64, 4, 1, rebuild_unroll=2, column_chunk=32),
              "h200_2026-11-29_v21b_candidates.json"),
    LaunchRow("replay", "gdn", 4, (10, 28), _SHORT,
              ReplayGroupedParams(64, 4, 1, rebuild_unroll=2, column_chunk=32, grid_order=_LOR),
              "h200_2026-12-01_v29c_boundary.json"),
    LaunchRow("replay", "gdn", 4, (10, 64), _LONG,
              ReplayGroupedParams(64, 4, 1, rebuild_unroll=2, column_chunk=32, grid_order=_LOR),
              "h200_2026-12-01_v29e_long_flush.json"),
    LaunchRow("replay", "gdn", 4, (29, 64), _SHORT,
              ReplayGroupedParams(32, 4, 4, rebuild_unroll=2, column_chunk=32, grid_order=_LOR),
              "h200_2026-11-30_v28h_reload_row.json"),
    LaunchRow("replay", "gdn", 4, (65, 256), _ALL,
              ReplayGroupedParams(32, 4, 4, rebuild_unroll=2, column_chunk=64, grid_order=_LO),
              "h200_2026-11-30_v28_launch_order.json"),
    LaunchRow("replay", "gdn", 4, (257, None), _SHORT,
              ReplayGroupedParams(32, 4, 8, rebuild_unroll=1, column_chunk=64, grid_order=_LO),
              "h200_2026-11-29_v24d_final.json"),
    LaunchRow("replay", "gdn", 4, (257, None), _LONG,
              ReplayGroupedParams(32, 4, 8, rebuild_unroll=2, column_chunk=64, grid_order=_LO),
              "h200_2026-11-29_v24d_final.json"),
    # replay, GDN with a 2-byte state (whole rows: chunks measured slower there)
    LaunchRow("replay", "gdn", 2, (1, 64), _SHORT, ReplayGroupedParams(32, 4, 2, rebuild_unroll=2, grid_order=_LO),
              "h200_2026-12-01_v29e_long_flush.json"),
    LaunchRow("replay", "gdn", 2, (1, 64), _LONG, ReplayGroupedParams(64, 4, 1, rebuild_unroll=2, grid_order=_LOR),
              "h200_2026-12-01_v29e_long_flush.json"),
    # replay, KDA (whole rows: chunked per-channel weights cost registers)
    LaunchRow("replay", "kda", ANY, (1, 16), _ALL, ReplayGroupedParams(32, 2, 2, rebuild_unroll=4, grid_order=_LO),
              "h200_2026-11-30_v28_launch_order.json"),
    LaunchRow("replay", "kda", ANY, (17, 64), _ALL, ReplayGroupedParams(32, 4, 4, rebuild_unroll=2, grid_order=_LO),
              "h200_2026-11-30_v28_launch_order.json"),
    # replay, larger batches of 2-byte states and of KDA
    LaunchRow("replay", ANY, ANY, (65, 256), _ALL, ReplayGroupedParams(32, 4, 4, rebuild_unroll=2, grid_order=_ROWS),
              "h200_2026-11-30_v28_launch_order.json"),
    LaunchRow("replay", ANY, ANY, (257, None), _ALL, ReplayGroupedParams(32, 4, 8, rebuild_unroll=2, grid_order=_ROWS),
              "h200_2026-11-30_v28d_hv64.json"),
    # speculative verify readouts (`speculative.verify_step`)
    *(LaunchRow("verify", gate, ANY, (1, None), _ALL, VerifyReadoutParams(),
                "untuned: the grouped replay rows' tile (BV = 32, 4 warps), before any verify measurement")
      for gate in ("gdn", "kda")),
)


def step_kind(config: ReplayConfig, policy: FlushPolicy) -> Step:
    """The kernel step a layer runs under a plan made with `policy`."""
    if config.cache_len == 1:
        return "plain"
    return "fold" if policy is FlushPolicy.EVERY_STEP else "replay"


def launch_row(step: Step, gate: str, state_bytes: int, batch: int, cache_len: int) -> LaunchRow:
    """The first row of `LAUNCH_TABLE` that matches."""
    for row in LAUNCH_TABLE:
        if row.matches(step, gate, state_bytes, batch, cache_len):
            return row
    raise LookupError(f"no launch row for step={step!r}, gate={gate!r}, state_bytes={state_bytes}, "
                      f"batch={batch}, cache_len={cache_len}")


def launch_params(config: ReplayConfig, batch: int, policy: FlushPolicy,
                  kernel_params: KernelParams | None = None) -> KernelParams:
    """`kernel_params`, checked against the step the plan needs, or the table's choice.

    `config` and `batch` are one device's: under `replayssm_jax.sharding` the step runs in
    `shard_map`, so `batch` is the plan's B/dp rows and `config` has H/tp heads. Heads do not
    enter the key: the rows were measured at H_v = 32 and 64 per device, where one entry
    (bf16, B = 512, benchmarks/NOTES.md v28d) changed with the head count; fewer heads per
    device (H_v / tp < 32) are unmeasured.
    """
    step = step_kind(config, policy)
    if kernel_params is None:
        return launch_row(step, config.gate, config.state_dtype.itemsize, batch, config.cache_len).params
    allowed = (MAMBA2_STEP_PARAMS if config.gate_kind.additive else STEP_PARAMS)[step]
    if not isinstance(kernel_params, allowed):
        names = " or ".join(t.__name__ for t in allowed)
        raise ValueError(f"this step runs the {step!r} kernel step (L = {config.cache_len}, policy "
                         f"{policy.name}): kernel_params must be {names}, got {type(kernel_params).__name__}")
    return kernel_params


def verify_params(config: ReplayConfig, batch: int,
                  kernel_params: VerifyReadoutParams | None = None) -> VerifyReadoutParams:
    """`kernel_params` (checked) or the table's row for a verify step of `batch` rows."""
    if kernel_params is None:
        return launch_row("verify", config.gate, config.state_dtype.itemsize, batch, config.cache_len).params
    if not isinstance(kernel_params, VerifyReadoutParams):
        raise ValueError(f"a verify step runs the verify_readout kernel: kernel_params must be "
                         f"VerifyReadoutParams, got {type(kernel_params).__name__}")
    return kernel_params


def check_kernel_shapes(head_k_dim: int, head_v_dim: int) -> None:
    """The kernels load whole key rows and BV-row tiles: d_k and d_v powers of two >= 16."""
    for name, dim in (("head_k_dim", head_k_dim), ("head_v_dim", head_v_dim)):
        if dim < common.MIN_DOT_DIM or dim & (dim - 1):
            raise ValueError(f"the pallas_triton backend needs {name} to be a power of two >= 16, got {dim}")


def layer_step(
    state: ReplayState,
    tokens: Tokens,
    plan: StepPlan,
    *,
    use_qk_l2norm: bool,
    scale: float | None,
    gate_params: tuple[Array, Array] | None = None,
    kernel_params: KernelParams | None = None,
    interpret: bool | None = None,
) -> tuple[Float[Array, "B Hv Dv"], ReplayState]:
    """`backends.xla.layer_step` on the Pallas kernels; same arguments and results, plus
    `kernel_params` (default: the table's row) and `interpret` (default: off GPU)."""
    cfg = state.config
    check_kernel_shapes(cfg.head_k_dim, cfg.head_v_dim)
    params = launch_params(cfg, plan.batch, plan.policy, kernel_params)
    q, k, v, g, beta = tokens.q, tokens.k, tokens.v, tokens.g, tokens.beta
    options = dict(use_qk_l2norm=use_qk_l2norm, scale=scale, gate_params=gate_params,
                   params=params, interpret=interpret)
    if isinstance(params, PlainParams):
        y, checkpoint = plain_decode(state.checkpoint, q, k, v, g, beta, plan.slot, plan.valid, **options)
        return y, dataclasses.replace(state, checkpoint=checkpoint)
    kernel = {FoldParams: fold_decode, ReplayTileParams: replay_decode,
              ReplayGroupedParams: replay_decode_grouped}[type(params)]
    if params.grid_order.reorders:
        options["row_order"] = plan.launch_order
    y, checkpoint, u_cache, k_cache, g_cache = kernel(
        state.checkpoint, state.u_cache, state.k_cache, state.g_cache,
        q, k, v, g, beta, plan.slot, plan.pos, common.row_modes(plan.valid, plan.flush),
        **options,
    )
    return y, dataclasses.replace(
        state, checkpoint=checkpoint, u_cache=u_cache, k_cache=k_cache, g_cache=g_cache
    )


def mamba2_layer_step(
    state: ReplayState,
    tokens,
    plan: StepPlan,
    *,
    params,
    kernel_params: Mamba2PlainParams | Mamba2ReplayParams | None = None,
    interpret: bool | None = None,
) -> tuple[Float[Array, "B H P"], ReplayState]:
    """`backends.xla.mamba2_layer_step` on the Mamba-2 kernels (`tokens: Mamba2Tokens`,
    `params: Mamba2Params`); plus `kernel_params` (default: the table's row) and
    `interpret` (default: off GPU)."""
    cfg = state.config
    check_kernel_shapes(cfg.head_k_dim, cfg.head_v_dim)
    launch = launch_params(cfg, plan.batch, plan.policy, kernel_params)
    options = dict(z=tokens.z, dt_softplus=params.dt_softplus, dt_limit=params.dt_limit,
                   params=launch, interpret=interpret)
    token = (tokens.x, tokens.B, tokens.C, tokens.dt, params.A, params.D, params.dt_bias)
    if isinstance(launch, Mamba2PlainParams):
        y, checkpoint = mamba2_plain_decode(state.checkpoint, *token, plan.slot, plan.valid, **options)
        return y, dataclasses.replace(state, checkpoint=checkpoint)
    y, checkpoint, x_cache, b_cache, dt_cache = mamba2_replay_decode(
        state.checkpoint, state.u_cache, state.k_cache, state.g_cache, *token,
        plan.slot, plan.pos, common.row_modes(plan.valid, plan.flush), **options,
    )
    return y, dataclasses.replace(state, checkpoint=checkpoint, u_cache=x_cache, k_cache=b_cache, g_cache=dt_cache)
