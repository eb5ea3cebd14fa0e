"""The "pallas" backend of `decode_step`: ReplayState in, kernels, ReplayState out.

Tile choice per batch size (and gate) lives here (`default_kernel_config`), measured on an H200
(benchmarks/results/). With cache_len == 1 every step flushes, so the step runs the plain
kernel on the checkpoint: same semantics, no cache traffic.
"""

from __future__ import annotations

import dataclasses

from jaxtyping import Array, Float

from pallas_kernels import common
from pallas_kernels.common import KernelConfig
from pallas_kernels.fold_decode import fold_decode
from pallas_kernels.plain_decode import plain_decode
from pallas_kernels.replay_decode import replay_decode
from pallas_kernels.replay_decode_grouped import replay_decode_grouped
from replayssm_jax.config import GATES, ReplayConfig
from replayssm_jax.replay import StepPlan
from replayssm_jax.state import ReplayState

# Batch size -> launch configuration per kernel:
#   (max batch, block_v, num_warps, cache_chunk, tiles_per_program, rebuild_unroll,
#    flush_every_step)
# tiles_per_program = 0 selects the per-tile replay kernel, T >= 1 the key-head-grouped one;
# flush_every_step runs the folding kernel (`fold_decode`: block_v and num_warps only).
# Measured on an H200 (benchmarks/results/raw/*v6*, *v8*, *v11*: GDN H_v = 32, L = 16; each
# batch takes the entry of the nearest measured one). The plain kernel wants narrow tiles
# (occupancy); the grouped kernel at large batch wants one program per (row, key head);
# unrolling the exact rebuild costs registers (U = 4 -> 2 in the grouped kernel: 146 -> 128
# registers at T = 4, 3 -> 4 programs per SM; v8). At batch <= 4 flushing every step through
# the folding kernel beat both the replay cycle and the plain kernel (v11: 3.3 vs 3.8 us at
# B = 1, 6.1 vs 6.3 at B = 4; replay cycle 8.0); at B = 8 it lost to both (11.6 vs 9.9,
# replay 10.6). The plain kernel keeps BV 8 up to B = 4 (v11: 6.3 vs 6.6 us at B = 4).
_Tile = tuple[int, int, int, int, int, int, bool]
_TILES: dict[str, tuple[_Tile, ...]] = {
    "plain": ((4, 8, 1, 8, 0, 1, False), (1 << 30, 16, 1, 16, 0, 1, False)),
    "replay": (
        (4, 8, 1, 16, 0, 1, True),
        (16, 32, 2, 16, 2, 4, False),
        (256, 32, 4, 16, 4, 2, False),
        (1 << 30, 32, 4, 16, 8, 2, False),
    ),
}
# KDA (per-channel decay) puts the replay's key-side work per value head, so its replay
# cycle costs more at small batch, and its plain kernel prefers BV 8 there. Measured at
# B = 8, L = 16 (v11, v11c, v11d: KDA H_k = H_v = 32): plain BV 8 11.7-11.8 us vs BV 16
# 13.5-13.7, folding kernel BV 8 11.6, replay cycle 13.7. These entries come first for KDA.
_KDA_FIRST: dict[str, tuple[_Tile, ...]] = {
    "plain": ((8, 8, 1, 8, 0, 1, False),),
    "replay": ((8, 8, 1, 16, 0, 1, True),),
}


def default_kernel_config(batch: int, kernel: str = "replay", gate: str = "gdn") -> KernelConfig:
    """The launch configuration used for `batch` rows of a `gate` ("gdn" or "kda") layer by
    the "plain" or "replay" kernel."""
    if kernel not in _TILES:
        raise ValueError(f"kernel must be 'plain' or 'replay', got {kernel!r}")
    if gate not in GATES:
        raise ValueError(f"gate must be one of {GATES}, got {gate!r}")
    rows = (_KDA_FIRST[kernel] if gate == "kda" else ()) + _TILES[kernel]
    for max_batch, block_v, num_warps, cache_chunk, per_program, unroll, every_step in rows:
        if batch <= max_batch:
            return KernelConfig(
                block_v=block_v, num_warps=num_warps, cache_chunk=cache_chunk,
                tiles_per_program=per_program, rebuild_unroll=unroll, flush_every_step=every_step,
            )
    raise AssertionError("unreachable: the last table row covers every batch")


def layer_kernel_config(config: ReplayConfig, batch: int, kernel_config: KernelConfig | None) -> KernelConfig:
    """`kernel_config`, or the table's entry for this layer and batch (L = 1 runs the plain
    kernel, whose every step is a flush)."""
    if kernel_config is not None:
        if not isinstance(kernel_config, KernelConfig):
            raise ValueError(f"kernel_config must be a KernelConfig, got {type(kernel_config).__name__}")
        return kernel_config
    kernel = "plain" if config.cache_len == 1 else "replay"
    return default_kernel_config(batch, kernel, config.gate)


def check_kernel_shapes(head_k_dim: int, head_v_dim: int) -> None:
    """The kernels load whole key rows and BV-row tiles: d_k and d_v powers of two >= 16."""
    for name, dim in (("head_k_dim", head_k_dim), ("head_v_dim", head_v_dim)):
        if dim < common.MIN_DOT_DIM or dim & (dim - 1):
            raise ValueError(f"the pallas backend needs {name} to be a power of two >= 16, got {dim}")


def pallas_layer_step(
    state: ReplayState,
    q: Float[Array, "B Hk Dk"],
    k: Float[Array, "B Hk Dk"],
    v: Float[Array, "B Hv Dv"],
    g: Float[Array, "B Hv *Dk"],
    beta: Float[Array, "B Hv"],
    plan: StepPlan,
    *,
    use_qk_l2norm: bool,
    scale: float | None,
    gate_params: tuple[Array, Array] | None = None,
    kernel_config: KernelConfig | None = None,
    interpret: bool | None = None,
) -> tuple[Float[Array, "B Hv Dv"], ReplayState]:
    """`replay.xla_layer_step` on the Pallas kernels; same arguments and results."""
    cfg = state.config
    check_kernel_shapes(cfg.head_k_dim, cfg.head_v_dim)
    kernel_config = layer_kernel_config(cfg, v.shape[0], kernel_config)
    options = dict(
        use_qk_l2norm=use_qk_l2norm, scale=scale, gate_params=gate_params,
        config=kernel_config, interpret=interpret,
    )
    if cfg.cache_len == 1:
        y, checkpoint = plain_decode(
            state.checkpoint, q, k, v, g, beta, plan.slot, plan.valid, **options
        )
        return y, dataclasses.replace(state, checkpoint=checkpoint)
    if kernel_config.flush_every_step:
        kernel = fold_decode
    elif kernel_config.tiles_per_program:
        kernel = replay_decode_grouped
    else:
        kernel = replay_decode
    y, checkpoint, u_cache, k_cache, g_cache = kernel(
        state.checkpoint, state.u_cache, state.k_cache, state.g_cache,
        q, k, v, g, beta, plan.slot, plan.pos, common.row_modes(plan.valid, plan.flush),
        **options,
    )
    return y, dataclasses.replace(
        state, checkpoint=checkpoint, u_cache=u_cache, k_cache=k_cache, g_cache=g_cache
    )
