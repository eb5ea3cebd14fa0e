"""The "pallas" backend of `decode_step`: ReplayState in, kernels, ReplayState out.

Tile choice per batch size (and gate) lives here (`default_kernel_config`), measured on an H200
(benchmarks/results/). With cache_len == 1 every step flushes, so the step runs the plain
kernel on the checkpoint: same semantics, no cache traffic.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
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

# Batch size -> launch configuration per kernel: `(max batch, KernelConfig)`, first match.
# Measured on an H200 (benchmarks/results/raw/*v6*, *v8*, *v11*, *v14*-*v24d*: GDN
# H_v = 32, L = 16; each batch takes the entry of the nearest measured one).
# Plain kernel: narrow one-warp tiles (occupancy); `[4, 32]` column chunks at B <= 2 (v21:
# 3.17 -> 3.01 us at B = 1 against `[8, 32]`); whole rows with the row index fastest at
# B = 3-16 (at B = 8 both chunks and the reversed grid cost 10-15%, v14, v15); from B = 17
# `[16, 16]` chunks and the row index outermost (v15: 588 -> 538 us at B = 512).
# Replay: at B <= 5 flushing every step through the folding kernel beat the replay cycle
# (v11, v21b, v23b); at B <= 2 with BV 4 and its empty-cache branch (v25: B = 1 3.17 ->
# 3.01 us, level with the plain kernel; B = 2 4.29 -> 4.07, 1.02x; the branch costs B = 5
# 7.26 -> 8.5). From B = 6 the grouped kernel: at B <= 28 one `[64, d_k]`
# tile per program (v21b: the two tiles of a (32, 2 warps, T = 2) program side by side, half
# the flush's dependent round trips: B = 8 cycle 10.5 -> 9.7 us, B = 16 20.1 -> 17.6; v29b,
# v29c at B = 17-28: below), T = 4 with W = 32
# chunks up to B = 64, W = 64 above (v21, v21b: B = 512 cycle 409 -> 390 us, B = 128 108.9
# -> 105.3, but B = 32 30.2 -> 32.2), one program per (row, key head) from B = 257 (its
# rebuild unroll depends on L: SHORT_CACHE_MAX_LEN below). Unrolling the exact rebuild
# costs registers (v8: U = 4 -> 2 in the grouped kernel, 146 -> 128 registers at T = 4 by
# kernel_registers.py, whose counts differ from the GPU build's: v24c).
# One `[64, d_k]` tile per program, rows outermost in launch order, the row read per tile
# (B = 6-9 run the same tile in row order).
_ONE_TILE_ORDERED = KernelConfig(block_v=64, num_warps=4, tiles_per_program=1, rebuild_unroll=2, column_chunk=32,
                                 rows_outermost=True, launch_order=True, reload_row=True)
_TILES: dict[str, tuple[tuple[int, KernelConfig], ...]] = {
    "plain": (
        (2, KernelConfig(block_v=4, num_warps=1, column_chunk=32)),
        (4, KernelConfig(block_v=8, num_warps=1, cache_chunk=8)),
        (16, KernelConfig(block_v=16, num_warps=1)),
        (1 << 30, KernelConfig(block_v=16, num_warps=1, column_chunk=16, rows_outermost=True)),
    ),
    "replay": (
        (2, KernelConfig(block_v=4, num_warps=1, flush_every_step=True, empty_cache_branch=True)),
        (5, KernelConfig(block_v=8, num_warps=1, flush_every_step=True)),
        (9, dataclasses.replace(_ONE_TILE_ORDERED, rows_outermost=False, launch_order=False, reload_row=False)),
        (28, _ONE_TILE_ORDERED),
        (64, KernelConfig(block_v=32, num_warps=4, tiles_per_program=4, rebuild_unroll=2, column_chunk=32,
                          rows_outermost=True, launch_order=True, reload_row=True)),
        (256, KernelConfig(block_v=32, num_warps=4, tiles_per_program=4, rebuild_unroll=2, column_chunk=64,
                           rows_outermost=True, launch_order=True)),
        (1 << 30, KernelConfig(block_v=32, num_warps=4, tiles_per_program=8, rebuild_unroll=2, column_chunk=64,
                               rows_outermost=True, launch_order=True)),
    ),
}
# Launch order (v28, v28b; L = 16, synchronised / staggered cursors, us): from B = 65 the
# grouped kernel runs rows outermost in the plan's launch order, flush rows' programs
# issued first, so staggered steps (a serving engine's) cost what a synchronised cycle
# does: B = 128 105.6 / 119.7 -> 107.4 / 106.0, B = 512 383.7 / 424.1 -> 384.2 / 383.0. At
# B = 17-64 the held row costs the (T = 4, W = 32) flush 80% (`common.launch_row`); read
# again per tile (`reload_row`) it costs the sync cycle 5% and saves 13-16% staggered
# (v28h: B = 32 29.5 / 44.2 -> 31.1 / 38.5, B = 48 42.3 / 56.3 -> 44.4 / 47.4, B = 64 55.2 /
# 67.7 -> 57.7 / 59.1). The T = 1 entry takes it from B = 10 (v28j: B = 10 14.0 / 13.9 ->
# 13.2 / 12.9, B = 12 15.6 / 19.9 -> 14.3 / 15.3, B = 16 17.9 / 22.9 -> 19.1 / 18.4) and keeps
# row order up to B = 9: the re-read row costs B = 8 19% sync and staggered (v28h: 9.9 / 9.7
# -> 11.8 / 11.5); B = 9 was not measured. With staggered cursors ~B/L rows flush in every
# step and the step ends on a flush program, which at T = 4 runs ~3x an append program, so
# the T = 1 entry (a quarter of it) serves up to B = 28 (v29b, v29c, L = 16, T = 1 against
# T = 4: B = 17 19.7 / 19.2 against 23.0 / 33.0, B = 20 23.6 / 22.6 against 25.2 / 33.5,
# B = 24 26.3 / 25.5 against 27.5 / 34.7, B = 28 30.6 / 29.6 against 29.3 / 36.7; at B = 32
# 34.1 / 33.5 against 31.1 / 38.5, and slower in both from B = 48). Long caches flush
# longer programs (L - 1 entries): for L > SHORT_CACHE_MAX_LEN the T = 1 entry serves up to
# LONG_CACHE_ONE_TILE_MAX_BATCH (v29e, L = 32, sync / staggered: B = 32 35.5 / 33.8 against
# 31.6 / 57.4, B = 48 50.0 / 48.1 against 45.3 / 66.3, B = 64 64.6 / 62.9 against 58.9 /
# 74.9, plain 36.1 / 53.1 / 70.2: staggered 0.63-0.94x -> 1.07-1.12x plain, sync 1.15-1.19x
# -> 1.02-1.09x), for a 2-byte state too (whole rows; bf16, L = 32: B = 24 22.9 / 23.6
# against 25.6 / 42.2, B = 32 30.9 / 29.9 against 28.9 / 44.2, B = 64 57.4 / 55.4 against
# 54.9 / 56.2; at B = 16 all entries within 2%).
LONG_CACHE_ONE_TILE_MAX_BATCH = 64
# KDA (per-channel decay) puts the replay's key-side work per value head, so its replay
# cycle costs more at small batch, and its plain kernel prefers BV 8 there. Measured at
# B = 8, L = 16 (v11, v11c, v11d: KDA H_k = H_v = 32): plain BV 8 11.7-11.8 us vs BV 16
# 13.5-13.7, folding kernel BV 8 11.6, replay cycle 13.7. These plain entries come first
# for KDA.
_KDA_PLAIN_FIRST = ((8, KernelConfig(block_v=8, num_warps=1, cache_chunk=8)),)
# Replay entries that come first for 2-byte states, which keep whole rows: the folding
# kernel at BV 4 at B = 1 (v23c: 2.66-2.69 us against 3.01 at BV 8, plain 2.62) and at BV 8
# up to B = 8 (v22b: 7.5 us against 8.5 for the (32, 2, T = 2) grouped entry, plain 6.3; the
# `[64, d_k]` entry measured 9.4 in v22), and at B = 9-16 the grouped entry measured before
# v21 (the `[64, d_k]` tiles were measured for a GDN fp32 state only). Launch order (v28,
# v28b; sync / staggered us): B = 16 15.5 / 24.0 -> 15.6 / 19.1, B = 32 24.4 / 36.7 -> 24.1
# / 26.3, B = 64 43.6 / 55.0 -> 46.2 / 47.2; at B = 128 rows outermost alone (79.7 / 91.2
# -> 78.5 / 87.5; with the order 88.5 / 87.5); from B = 257 the 4-byte rows' T = 8 entry,
# also rows outermost only: with the order H_v = 32 gained (B = 512 274.1 / 302.7 -> 272.8 /
# 272.5) but H_v = 64 lost (v28d: 537.3 / 554.7 -> 621.0 / 617.4). KDA keeps these rows;
# GDN takes (32, 4 warps, T = 2) in launch order at B = 9-64 (v29e, L = 16, sync /
# staggered us, against the rows above: B = 16 14.8 / 16.3 against 15.7 / 19.4, B = 24
# 19.8 / 19.7 against 22.0 / 24.3, B = 32 25.4 / 24.7 against 24.2 / 26.5, B = 64 46.0 /
# 45.4 against 46.5 / 47.6; B = 9-15 not measured).
_TWO_BYTE_TAIL = (
    (256, KernelConfig(block_v=32, num_warps=4, tiles_per_program=4, rebuild_unroll=2, rows_outermost=True)),
    (1 << 30, KernelConfig(block_v=32, num_warps=4, tiles_per_program=8, rebuild_unroll=2, rows_outermost=True)),
)
_TWO_BYTE_FOLD = (
    (1, KernelConfig(block_v=4, num_warps=1, flush_every_step=True)),
    (8, KernelConfig(block_v=8, num_warps=1, flush_every_step=True)),
)
_KDA_TWO_BYTE_REPLAY_FIRST = _TWO_BYTE_FOLD + (
    (16, KernelConfig(block_v=32, num_warps=2, tiles_per_program=2, rebuild_unroll=4,
                      rows_outermost=True, launch_order=True)),
    (64, KernelConfig(block_v=32, num_warps=4, tiles_per_program=4, rebuild_unroll=2,
                      rows_outermost=True, launch_order=True)),
) + _TWO_BYTE_TAIL
_TWO_BYTE_REPLAY_FIRST = _TWO_BYTE_FOLD + (
    (64, KernelConfig(block_v=32, num_warps=4, tiles_per_program=2, rebuild_unroll=2,
                      rows_outermost=True, launch_order=True)),
) + _TWO_BYTE_TAIL
# KDA with a 4-byte state flushes every step at every batch: its replay cycle, whose grouped
# kernel holds 168 registers per thread (3 programs per SM, v25f), measured 0.82-0.89x the
# plain kernel at B = 32-512 (v27: 50.2 / 172.4 / 656.5 us against 41.0 / 150.3 / 585.9),
# the folding kernel on the plain kernel's large-batch tile with the empty-cache branch
# 1.00-1.05x (39.2 / 147.9 / 583.1 us); at B = 12 / 16 1.07 / 1.12x against the former
# (32, 2, T = 2) replay entry's 0.69 / 0.88x (v27b); at B <= 8 on BV 8 whole rows (above).
_KDA_REPLAY = (
    (8, KernelConfig(block_v=8, num_warps=1, flush_every_step=True)),
    (1 << 30, KernelConfig(block_v=16, num_warps=1, flush_every_step=True, empty_cache_branch=True,
                           column_chunk=16, rows_outermost=True)),
)


# The B > 256 entry rebuilds one entry per round trip (U = 1) for GDN with a 4-byte state
# and a cache of at most SHORT_CACHE_MAX_LEN entries (v24d, B = 512, cycle U = 2 -> 1: L = 4
# 417 -> 405, L = 8 394 -> 381, L = 16 391 -> 384 us; B = 300, L = 16: 235 -> 231). Longer
# caches keep U = 2 (L = 32: 410 -> 441 us with U = 1, its non-flush step 358 -> 394), and
# so do bf16 states (v24c, B = 512, L = 16: 272 -> 279 us with U = 1; KDA's replay cycle
# 656 -> 661, though KDA with a 4-byte state no longer replays: _KDA_REPLAY).
SHORT_CACHE_MAX_LEN = 16
_SHORT_CACHE_REBUILD_UNROLL = 1


def default_kernel_config(
    batch: int, kernel: str = "replay", gate: str = "gdn", state_dtype=jnp.float32,
    cache_len: int = SHORT_CACHE_MAX_LEN,
) -> KernelConfig:
    """The launch configuration used for `batch` rows of a `gate` ("gdn" or "kda") layer by
    the "plain" or "replay" kernel. Column chunks apply to 4-byte states only: with a bf16
    state a thread's share of a whole row is 8 elements and the chunked kernels measured
    slower (v14, v15: plain kernel at B = 512 296 -> 332 us; ptxas: 117 -> 167 registers
    in the grouped kernel). KDA's grouped kernel keeps whole rows too: chunked, its
    per-channel weights and keys take it from 164 to 228 registers per thread (2 programs
    per SM instead of 3). 2-byte states take their own replay entries (the folding kernel
    up to B = 8; GDN's and KDA's differ at B = 9-64); KDA with a 4-byte state flushes every
    step through the folding kernel at every batch (`_KDA_REPLAY`), and takes its own plain
    entry up to B = 8. `cache_len` (the layer's L) picks, for GDN, the rebuild unroll of the
    B > 256 entry and, above SHORT_CACHE_MAX_LEN, the one-tile entry up to
    LONG_CACHE_ONE_TILE_MAX_BATCH (above)."""
    rows, whole_rows = _table_rows(kernel, gate, state_dtype, cache_len)
    config = next(config for max_batch, config in rows if batch <= max_batch)
    if whole_rows:
        config = dataclasses.replace(config, column_chunk=0)
    return config


def _table_rows(
    kernel: str, gate: str, state_dtype, cache_len: int
) -> tuple[tuple[tuple[int, KernelConfig], ...], bool]:
    """The `(max batch, KernelConfig)` rows `default_kernel_config` searches, first match, and
    whether it takes their entries on whole rows."""
    if kernel not in _TILES:
        raise ValueError(f"kernel must be 'plain' or 'replay', got {kernel!r}")
    if gate not in GATES:
        raise ValueError(f"gate must be one of {GATES}, got {gate!r}")
    if isinstance(cache_len, bool) or not isinstance(cache_len, int) or cache_len < 1:
        raise ValueError(f"cache_len must be an int >= 1, got {cache_len!r}")
    two_byte = jnp.dtype(state_dtype).itemsize < 4
    if kernel == "replay" and gate == "kda" and not two_byte:
        return _KDA_REPLAY, False
    first = ()
    if kernel == "plain" and gate == "kda":
        first = _KDA_PLAIN_FIRST
    elif kernel == "replay" and two_byte:
        first = _KDA_TWO_BYTE_REPLAY_FIRST if gate == "kda" else _TWO_BYTE_REPLAY_FIRST
    rows = first + _TILES[kernel]
    if kernel == "replay" and gate == "gdn" and cache_len > SHORT_CACHE_MAX_LEN:
        rows = _long_cache_rows(rows)
    if kernel == "replay" and not two_byte and cache_len <= SHORT_CACHE_MAX_LEN:
        max_batch, last = rows[-1]
        rows = rows[:-1] + ((max_batch, dataclasses.replace(last, rebuild_unroll=_SHORT_CACHE_REBUILD_UNROLL)),)
    return rows, two_byte  # 2-byte states take every entry on whole rows


def _long_cache_rows(rows):
    """GDN rows for L > SHORT_CACHE_MAX_LEN: the one-tile entry in launch order serves every
    batch from the first launch-order row's to LONG_CACHE_ONE_TILE_MAX_BATCH (above)."""
    first_ordered = next(i for i, (_, config) in enumerate(rows) if config.launch_order)
    return rows[:first_ordered] + ((LONG_CACHE_ONE_TILE_MAX_BATCH, _ONE_TILE_ORDERED),) + rows[first_ordered:]


def table_entries(
    kernel: str, gate: str = "gdn", state_dtype=jnp.float32
) -> list[tuple[int, int, KernelConfig]]:
    """`(smallest batch, cache length, KernelConfig)` of each distinct configuration
    `default_kernel_config` returns for this kernel, gate and state dtype: every launch the
    table can make, with a cache length that reaches it (the rows differ only between
    L <= SHORT_CACHE_MAX_LEN and longer caches)."""
    entries = []
    for cache_len in (SHORT_CACHE_MAX_LEN, SHORT_CACHE_MAX_LEN + 1):
        lowest = 1
        for max_batch, _ in _table_rows(kernel, gate, state_dtype, cache_len)[0]:
            if max_batch >= lowest:  # not shadowed by the rows before it
                config = default_kernel_config(lowest, kernel, gate, state_dtype, cache_len)
                if all(config != c for *_, c in entries):
                    entries.append((lowest, cache_len, config))
                lowest = max_batch + 1
    return entries


def layer_kernel_config(config: ReplayConfig, batch: int, kernel_config: KernelConfig | None) -> KernelConfig:
    """`kernel_config`, or the table's entry for this layer and batch (L = 1 runs the plain
    kernel, whose every step is a flush)."""
    if kernel_config is not None:
        if not isinstance(kernel_config, KernelConfig):
            raise ValueError(f"kernel_config must be a KernelConfig, got {type(kernel_config).__name__}")
        return kernel_config
    kernel = "plain" if config.cache_len == 1 else "replay"
    return default_kernel_config(batch, kernel, config.gate, config.state_dtype, config.cache_len)


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
        kernel = fold_decode  # in row order: under its own plan every live row flushes
    else:
        kernel = replay_decode_grouped if kernel_config.tiles_per_program else replay_decode
        if kernel_config.launch_order:
            options["row_order"] = plan.launch_order
    y, checkpoint, u_cache, k_cache, g_cache = kernel(
        state.checkpoint, state.u_cache, state.k_cache, state.g_cache,
        q, k, v, g, beta, plan.slot, plan.pos, common.row_modes(plan.valid, plan.flush),
        **options,
    )
    return y, dataclasses.replace(
        state, checkpoint=checkpoint, u_cache=u_cache, k_cache=k_cache, g_cache=g_cache
    )
