"""The Mosaic GPU backend: GDN, KDA and Mamba-2 decode steps on `pallas_kernels.mosaic_gpu`.

One kernel per gate serves every row mode (padding, append, flush), so both flush policies
run through it: under EVERY_STEP every live row is a flush row. GDN (per-head decay) runs
`replay_decode.replay_decode_mgpu`, KDA (per-channel decay) `replay_decode_kda.
replay_decode_kda_mgpu`, Mamba-2 `mamba2_decode.mamba2_replay_decode_mgpu`; shapes as
their `check_shapes` / `check_kda_shapes` allow (d_k, d_v multiples of 64, L a multiple of
8 up to 256; KDA: d_k = 64 or a multiple of 128, and the CTA's shared memory bounds L;
Mamba-2: P and N multiples of 64, L a multiple of 8 within the kernel's shared memory).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from pallas_kernels import common
from pallas_kernels.mosaic_gpu import mamba2_decode, replay_decode_kda, verify_decode
from pallas_kernels.mosaic_gpu.mamba2_decode import MosaicMamba2Params, mamba2_replay_decode_mgpu
from pallas_kernels.mosaic_gpu.replay_decode import (MosaicReplayParams, check_shapes, persistent_programs,
                                                     replay_decode_mgpu)
from pallas_kernels.mosaic_gpu.pipeline import ctas_per_sm
from pallas_kernels.mosaic_gpu.replay_decode_kda import check_kda_shapes, replay_decode_kda_mgpu
from replayssm_jax.plan import StepPlan
from replayssm_jax.state import ReplayState
from replayssm_jax.tokens import Tokens

GATES: tuple[str, ...] = ("gdn", "kda", "mamba2")
H200_SMS = 132  # the SM count assumed off GPU (interpret mode), where the device reports none
WARPGROUPS, WARPGROUPS_FROM_BATCH = 3, 256  # GDN decode's programs per CTA at large batches (`warpgroups_for`)
VERIFY_KEY_SUMS_FROM_BATCH = 128  # fp32 GDN verify's key sums before the launch: measured faster from here
# A 2-byte GDN verify state: the key sums before the launch from B = 8 on rings of at most
# 32; three warpgroups per CTA from B = 128 at T <= 8 on rings of at most 32 (faster at every
# batch and width measured from there; three warpgroups slower at B = 32).
VERIFY_TWO_BYTE_KEY_SUMS_FROM_BATCH, VERIFY_TWO_BYTE_KEY_SUMS_MAX_RING = 8, 32
VERIFY_WARPGROUPS_FROM_BATCH, VERIFY_WARPGROUPS_MAX_WIDTH, VERIFY_WARPGROUPS_MAX_RING = 128, 8, 32
# An fp32 GDN verify state on rings of 16, T <= 4, below B = 128: one CTA per tile with the key
# sums before the launch and 3xTF32 folds from B = 16 (measured faster at B = 16, 32 and 64,
# slower at 128), and from B = 8 for windows of 3 or 4 (faster at T = 4; 3.5% slower at T = 2).
VERIFY_FP32_ONE_CTA_BELOW, VERIFY_FP32_ONE_CTA_FROM = 128, {1: 16, 2: 16, 3: 8, 4: 8}
VERIFY_ONE_WARP_MAX_WIDTH = 8  # window kernel programs of one warp up to this T (measured faster at 4 and 8)
WIDE_WINDOW, WIDE_WINDOW_RING = 8, 32  # GDN verify from these T and L: one CTA per tile (measured faster)


# Mamba-2 decode's persistent CTAs per SM at most, by device kind: on an H100 two ran a bf16
# state 17-20% faster than three (fp32 caches, L = 32) and faster with bf16 caches at L = 16
# and 32 (NOTES: "Mamba-2 bf16 decode, two CTAs per SM on the H100"), where three ran faster
# on the H200; elsewhere the kernel's own bound.
MAMBA2_CTAS_PER_SM = {"H100": 2}


def device_sm_count() -> int:
    """SMs of the first device; `H200_SMS` where it reports none (interpret mode on CPU)."""
    return int(getattr(jax.devices()[0], "core_count", 0) or H200_SMS)


def device_kind() -> str:
    """The first device's `device_kind` ("NVIDIA H100 80GB HBM3", "cpu", ...)."""
    return getattr(jax.devices()[0], "device_kind", "")


def for_device_kind(table: dict, default, kind: str | None = None):
    """`table`'s value for the first of its names found in `kind` (default: this device's
    `device_kind`), else `default`."""
    kind = device_kind() if kind is None else kind
    return next((value for name, value in table.items() if name in kind), default)


def mamba2_ctas_per_sm(kind: str | None = None) -> int:
    """Mamba-2 decode's persistent CTAs per SM at most on a device of `kind` (default: this
    one's): `MAMBA2_CTAS_PER_SM`'s, else `mamba2_decode.RESIDENT_CTAS`."""
    return for_device_kind(MAMBA2_CTAS_PER_SM, mamba2_decode.RESIDENT_CTAS, kind)


def fitting_programs(cfg, batch: int, token_dtype, *, rebuild: str = "exact", readout: str = "fma",
                     key_side: str = "kernel", warpgroups: int = 1, operands_in_tile: bool = False,
                     sm_count: int | None = None) -> int:
    """Persistent programs for a step of `batch` rows: as many CTAs per SM as the kernel's
    two-stage buffers fit in shared memory, on `sm_count` SMs (default: the device's), times
    their `warpgroups`; `readout`: the GDN and Mamba-2 kernels'; `key_side`, `warpgroups`,
    `operands_in_tile`: the GDN kernel's (0 where w warpgroups' buffers do not fit a CTA)."""
    sms = device_sm_count() if sm_count is None else sm_count
    shape = (batch, cfg.num_v_heads, cfg.head_v_dim, cfg.head_k_dim, cfg.cache_len, cfg.state_dtype,
             cfg.cache_dtype, token_dtype, sms)
    if cfg.gate == "mamba2":
        return mamba2_decode.persistent_programs(*shape, rebuild=rebuild, readout=readout,
                                                 max_ctas=mamba2_ctas_per_sm())
    if cfg.per_channel_gate:
        return replay_decode_kda.persistent_programs(*shape, rebuild=rebuild)
    return persistent_programs(*shape, rebuild=rebuild, readout=readout, key_side=key_side, warpgroups=warpgroups,
                               operands_in_tile=operands_in_tile)


def gpu_rebuild(cfg, token_dtype) -> str:
    """The flush rebuild a step takes on a GPU: "3xtf32" wherever its operands leave at
    least as many CTAs per SM as the exact rebuild's buffers (GDN's measured within 1.3e-7
    normwise of IEEE fp32 and faster; from a ring of 32 its chunked operands fit two CTAs
    per SM where the exact rebuild's record copies fit one), else "exact"."""
    fits = lambda rebuild: fitting_programs(cfg, 1, token_dtype, rebuild=rebuild, sm_count=1)
    return "3xtf32" if fits("3xtf32") >= fits("exact") else "exact"


def default_params(cfg, batch: int, token_dtype, *, interpret: bool | None = None
                   ) -> MosaicReplayParams | MosaicMamba2Params:
    """The kernel parameters a step uses when the caller gives none: as many persistent CTAs
    as fit on the device's SMs and the kernel's own barriers only (measured fastest on the
    H200 for GDN and Mamba-2), with `gpu_rebuild` on a GPU (`interpret` false; default: off
    GPU; the tensor cores do not run in interpret mode) and the exact rebuild off it. GDN
    with a 2-byte state and bf16 q, k reads the tile out on tensor cores (`readout="mma"`)
    and takes its key side from XLA (`key_side="xla"`), and with one warpgroup per CTA
    recomputes its buffers' addresses per tile (`per_tile_addresses`): each faster there
    and slower with an fp32 state (whose tile the readout must split into three parts)
    (`benchmarks/NOTES.md`: "decode tensor-core readout", "per-tile addresses"). Three
    warpgroups (`warpgroups_for`) sum their key side on tensor cores (`key_side="mma"`;
    their column sums would share the CTA's one reduction scratch: NOTES "three
    warpgroups' own key side, wrong on the GPU", "key side on tensor cores")."""
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    rebuild = "exact" if interpret else gpu_rebuild(cfg, token_dtype)
    if cfg.gate == "mamba2":
        programs = fitting_programs(cfg, batch, token_dtype, rebuild=rebuild)
        return MosaicMamba2Params(programs=programs, auto_barriers=False, rebuild=rebuild)
    two_byte = cfg.state_dtype.itemsize == 2 and jnp.dtype(token_dtype) == jnp.bfloat16
    tensor_core_readout = two_byte and not cfg.per_channel_gate
    readout = "mma" if tensor_core_readout else "fma"
    key_side = "xla" if tensor_core_readout else "kernel"
    fits = lambda warpgroups, key_side=key_side: fitting_programs(cfg, batch, token_dtype, rebuild=rebuild,
                                                                  readout=readout, key_side=key_side,
                                                                  warpgroups=warpgroups)
    side_of_three = "mma" if jnp.dtype(cfg.cache_dtype) == jnp.bfloat16 else "xla"  # its products need bf16 keys
    warpgroups = warpgroups_for(cfg, batch, token_dtype) if fits(WARPGROUPS, side_of_three) else 1  # bf16 GDN only
    key_side = side_of_three if warpgroups > 1 else key_side
    return MosaicReplayParams(programs=fits(warpgroups), auto_barriers=False, rebuild=rebuild, readout=readout,
                              key_side=key_side, per_tile_addresses=tensor_core_readout and warpgroups == 1,
                              warpgroups=warpgroups)


def warpgroups_for(cfg, batch: int, token_dtype) -> int:
    """GDN decode's programs per CTA: `WARPGROUPS` where measured faster, 1 elsewhere. With
    three warpgroups ptxas fits a thread in ~167 registers (a 128-thread CTA takes ~250,
    two per SM), so an SM runs three programs: faster on the H200 from B = 256 with a bf16
    state and q, k at L = 16; slower at B <= 128, where each program has fewer tiles and one
    CTA per SM has none of another's to hide its own behind (NOTES: "three warpgroups per
    CTA"). fp32 tiles do not fit three programs' buffers; rings past 16 are not measured."""
    two_byte = cfg.state_dtype.itemsize == 2 and jnp.dtype(token_dtype) == jnp.bfloat16
    measured = cfg.gate == "gdn" and two_byte and cfg.cache_len <= 16
    return WARPGROUPS if measured and batch >= WARPGROUPS_FROM_BATCH else 1


def verify_default_params(cfg, batch: int, width: int, token_dtype, *, interpret: bool | None = None
                          ) -> MosaicReplayParams | MosaicMamba2Params:
    """The verify kernel's parameters when the caller gives none. GDN: the tensor-core readout
    where q and k are bf16 (`readout="mma"`); on a GPU (`interpret` false; default: off GPU)
    folds rebuilt by "3xtf32" where its operands fit as many CTAs per SM as the exact
    rebuild's record copies (as the decode kernel's `gpu_rebuild`) and the tile is not an
    fp32 one on persistent CTAs (measured slower there), else exactly; persistent CTAs
    without Mosaic's barriers where two or more fit per SM (the next tile's copies then hide
    behind another CTA's work), else one CTA per tile (one persistent CTA per SM measured
    slower); with a 2-byte state and bf16 q, k, addresses recomputed per tile
    (`per_tile_addresses`); the window's key sums before the launch (`key_side="xla"`:
    tensor-core sums in a kernel of their own, `verify_decode.window_key_values`) where they
    make room for two persistent CTAs per SM (fp32, L = 32) and with an fp32 state from
    `VERIFY_KEY_SUMS_FROM_BATCH` (measured faster at L = 16 too), with a 2-byte state on
    rings of at most `VERIFY_TWO_BYTE_KEY_SUMS_MAX_RING` from
    `VERIFY_TWO_BYTE_KEY_SUMS_FROM_BATCH` (longer rings keep the kernel's own: not measured
    against them); a 2-byte state on rings of at most `VERIFY_WARPGROUPS_MAX_RING` with bf16
    q, k and windows of at most `VERIFY_WARPGROUPS_MAX_WIDTH` positions: from
    `VERIFY_WARPGROUPS_FROM_BATCH` three warpgroups per CTA (`WARPGROUPS` persistent
    programs, one CTA per SM; measured at T = 2, 4, 8 on rings of 16, T = 4 on rings of 32),
    on a GPU with their tensor-core folds' key records taken with the tile where that fits
    (`prefetch_folds`); an fp32 state on rings of 16, T <= 4, from
    `VERIFY_FP32_ONE_CTA_FROM[T]` to `VERIFY_FP32_ONE_CTA_BELOW`: one CTA per tile with the
    key sums before the launch and 3xTF32 folds on a GPU; an fp32 state on persistent CTAs:
    exact folds, their record copies taken with the tile (`prefetch_folds`) where that fits
    as many CTAs per SM; windows of `WIDE_WINDOW` or more positions on rings of
    `WIDE_WINDOW_RING` or more: one CTA per tile with the key sums before the launch (the
    persistent kernel sits at the register cap there and its readouts slow ~3.7x); the
    window's records and staged vectors from their own kernel (`window_side="kernel"`, one
    warp per program up to `VERIFY_ONE_WARP_MAX_WIDTH` positions) where d_k is a power of
    two (its Triton blocks). Each choice is a measured line of `benchmarks/NOTES.md`
    ("verify defaults", "verify tensor-core readout, measured", "verify folds on tensor
    cores", "GDN verify with per-tile addresses", "verify key sums from XLA", "verify key
    sums before the launch at L = 16", "verify window kernel, measured", "verify T = 8 on
    rings of 32", "one CTA per tile at T = 4, and verify with a bf16 state", "the edges of
    the verify defaults", "bf16 verify on rings of 32", "fp32 verify below B = 32", "verify
    folds' records with the tile", "tensor-core folds' key records with the tile"). KDA: one
    CTA per tile on CUDA cores, exact folds (no persistent form), the window's records from
    their own kernel where d_k is a power of two (measured faster); Mamba-2: one CTA per
    tile, exact folds, the window's scalars and gated time steps from their own kernel where
    N is a power of two (one launch in place of XLA's several; NOTES "the Mamba-2 verify
    window in one launch")."""
    power_of_two_keys = cfg.head_k_dim & (cfg.head_k_dim - 1) == 0
    if cfg.gate == "mamba2":
        return MosaicMamba2Params(window_side="kernel" if power_of_two_keys else "xla")
    if cfg.per_channel_gate:
        return MosaicReplayParams(window_side="kernel" if power_of_two_keys else "xla")
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    readout = "mma" if jnp.dtype(token_dtype) == jnp.bfloat16 else "fma"
    two_byte = cfg.state_dtype.itemsize == 2
    window = dict(window_side="xla")
    if power_of_two_keys:  # one warp per program keeps its reductions in the warp (measured faster at T = 4, 8)
        window = dict(window_side="kernel", window_warps=1 if width <= VERIFY_ONE_WARP_MAX_WIDTH else 2)
    side_keys_fit = verify_decode.key_block_heads(cfg.num_k_heads, cfg.cache_len,
                                                  verify_decode.window_rows(width)) > 0
    if width >= WIDE_WINDOW and cfg.cache_len >= WIDE_WINDOW_RING and side_keys_fit:
        # The configurations measured at T = 8, L = 32 (fp32 and bf16 states).
        return MosaicReplayParams(readout=readout, rebuild="3xtf32" if two_byte and not interpret else "exact",
                                  key_side="xla", per_tile_addresses=two_byte and readout == "mma", **window)
    fp32_small_batch = (not two_byte and cfg.cache_len <= 16 and width in VERIFY_FP32_ONE_CTA_FROM
                        and VERIFY_FP32_ONE_CTA_FROM[width] <= batch < VERIFY_FP32_ONE_CTA_BELOW)
    if fp32_small_batch and side_keys_fit:
        return MosaicReplayParams(readout=readout, rebuild="exact" if interpret else "3xtf32", key_side="xla",
                                  **window)
    key_side = verify_key_side(cfg, batch, width, token_dtype, readout) if side_keys_fit else "kernel"
    if (key_side == "xla" and two_byte and cfg.cache_len <= VERIFY_WARPGROUPS_MAX_RING and readout == "mma"
            and width <= VERIFY_WARPGROUPS_MAX_WIDTH and batch >= VERIFY_WARPGROUPS_FROM_BATCH):
        three = dict(readout=readout, rebuild="exact" if interpret else "3xtf32", key_side=key_side)
        programs = _verify_programs(cfg, batch, width, token_dtype, warpgroups=WARPGROUPS, **three)
        if programs:
            # Tensor-core folds take their key records with the tile where those buffers fit
            # too (NOTES: "tensor-core folds' key records with the tile").
            prefetch = not interpret and _verify_programs(cfg, batch, width, token_dtype, warpgroups=WARPGROUPS,
                                                          prefetch_folds=True, **three) == programs
            return MosaicReplayParams(programs=programs, auto_barriers=False, per_tile_addresses=True,
                                      warpgroups=WARPGROUPS, prefetch_folds=prefetch, **window, **three)
    shape = (width, cfg.head_k_dim, cfg.cache_len, cfg.state_dtype, cfg.cache_dtype, token_dtype)
    fits = lambda rebuild, prefetch_folds=False: ctas_per_sm(
        verify_decode.persistent_smem_bytes(*shape, readout=readout, rebuild=rebuild, key_side=key_side,
                                            prefetch_folds=prefetch_folds), verify_decode.RESIDENT_CTAS)
    persistent = fits("exact") >= 2
    # "3xtf32" shortened the flush step with one CTA per tile and with a bf16 tile, but on
    # persistent CTAs with an fp32 tile it slowed every step (NOTES: "verify folds on tensor cores").
    fp32_persistent = persistent and not two_byte
    tensor_cores = not interpret and fits("3xtf32") >= fits("exact") and not fp32_persistent
    rebuild = "3xtf32" if tensor_cores else "exact"
    if not persistent:
        return MosaicReplayParams(readout=readout, rebuild=rebuild, **window)
    # An fp32 tile's exact folds take their record copies with the tile where those fit the
    # same CTAs per SM (NOTES: "verify folds' records with the tile").
    prefetch = not two_byte and rebuild == "exact" and fits("exact", prefetch_folds=True) >= fits("exact")
    return MosaicReplayParams(programs=_verify_programs(cfg, batch, width, token_dtype, readout=readout,
                                                        rebuild=rebuild, key_side=key_side),
                              auto_barriers=False, readout=readout, rebuild=rebuild, key_side=key_side,
                              per_tile_addresses=two_byte and readout == "mma", prefetch_folds=prefetch, **window)


def verify_key_side(cfg, batch: int, width: int, token_dtype, readout: str) -> str:
    """Where the GDN verify kernel takes the window's key sums from (where their blocks take
    the ring, `verify_decode.key_block_heads`): "xla", their own kernel before the launch,
    where that makes room for two persistent CTAs per SM or the batch measured faster with
    them (fp32 states from `VERIFY_KEY_SUMS_FROM_BATCH`, 2-byte states on rings of at most
    `VERIFY_TWO_BYTE_KEY_SUMS_MAX_RING` from `VERIFY_TWO_BYTE_KEY_SUMS_FROM_BATCH`); else "kernel"."""
    shape = (width, cfg.head_k_dim, cfg.cache_len, cfg.state_dtype, cfg.cache_dtype, token_dtype)
    cta_bytes = lambda side: verify_decode.persistent_smem_bytes(*shape, readout=readout, key_side=side)
    makes_room = ctas_per_sm(cta_bytes("kernel")) < 2 <= ctas_per_sm(cta_bytes("xla"))
    if cfg.state_dtype.itemsize == 2:
        measured = cfg.cache_len <= VERIFY_TWO_BYTE_KEY_SUMS_MAX_RING
        measured_from = VERIFY_TWO_BYTE_KEY_SUMS_FROM_BATCH if measured else None
    else:
        measured_from = VERIFY_KEY_SUMS_FROM_BATCH
    return "xla" if makes_room or (measured_from is not None and batch >= measured_from) else "kernel"


def _verify_programs(cfg, batch: int, width: int, token_dtype, **params) -> int:
    """`verify_decode.persistent_programs` for the layer on this device's SMs."""
    return verify_decode.persistent_programs(batch, width, cfg.num_v_heads, cfg.head_v_dim, cfg.head_k_dim,
                                             cfg.cache_len, cfg.state_dtype, cfg.cache_dtype, token_dtype,
                                             device_sm_count(), **params)


def check_config(cfg) -> None:
    """Raise ValueError unless the layer's config runs on this backend."""
    if cfg.gate not in GATES:
        raise ValueError(f"backend 'mosaic_gpu' supports gates {GATES}, got {cfg.gate!r}")
    if cfg.gate == "mamba2":
        mamba2_decode.check_shapes(cfg.head_v_dim, cfg.head_k_dim, cfg.cache_len, cfg.state_dtype.itemsize,
                                   cfg.cache_dtype.itemsize)
    elif cfg.per_channel_gate:
        check_kda_shapes(cfg.head_k_dim, cfg.head_v_dim, cfg.cache_len, cfg.state_dtype.itemsize,
                         cfg.cache_dtype.itemsize)
    else:
        check_shapes(cfg.head_k_dim, cfg.head_v_dim, cfg.cache_len, cfg.state_dtype.itemsize)


def _check_params(kernel_params, want: type) -> None:
    if kernel_params is not None and not isinstance(kernel_params, want):
        raise ValueError(f"kernel_params must be a {want.__name__} for backend 'mosaic_gpu' and this gate, "
                         f"got {type(kernel_params).__name__}")


def layer_step(
    state: ReplayState,
    tokens: Tokens,
    plan: StepPlan,
    *,
    use_qk_l2norm: bool,
    scale: float | None,
    gate_params: tuple[Array, Array] | None = None,
    kernel_params: MosaicReplayParams | None = None,
    interpret: bool | None = None,
) -> tuple[Float[Array, "B Hv Dv"], ReplayState]:
    """`backends.xla.layer_step` on the Mosaic GPU kernels; same arguments and results, plus
    `kernel_params` (default `default_params`; with `launch_order` the kernel serves the
    rows in the plan's launch order) and `interpret` (default: off GPU)."""
    cfg = state.config
    check_config(cfg)
    _check_params(kernel_params, MosaicReplayParams)
    kernel = replay_decode_kda_mgpu if cfg.per_channel_gate else replay_decode_mgpu
    # One token dtype for q, k and v's buffers: bf16 only where all three are.
    params = kernel_params or default_params(cfg, tokens.v.shape[0], jnp.result_type(tokens.q, tokens.v),
                                             interpret=interpret)
    y, checkpoint, u_cache, k_cache, g_cache = kernel(
        state.checkpoint, state.u_cache, state.k_cache, state.g_cache,
        tokens.q, tokens.k, tokens.v, tokens.g, tokens.beta,
        plan.slot, plan.pos, common.row_modes(plan.valid, plan.flush),
        use_qk_l2norm=use_qk_l2norm, scale=scale, gate_params=gate_params, params=params,
        row_order=plan.launch_order if params.launch_order else None, interpret=interpret,
    )
    return y, dataclasses.replace(state, checkpoint=checkpoint, u_cache=u_cache, k_cache=k_cache, g_cache=g_cache)


def mamba2_layer_step(
    state: ReplayState,
    tokens,
    plan: StepPlan,
    *,
    params,
    kernel_params: MosaicMamba2Params | None = None,
    interpret: bool | None = None,
) -> tuple[Float[Array, "B H P"], ReplayState]:
    """`backends.xla.mamba2_layer_step` on the Mosaic GPU kernel (`tokens: Mamba2Tokens`,
    `params: Mamba2Params`); plus `kernel_params` (default `default_params`; with
    `launch_order`, the plan's launch order) and `interpret` (default: off GPU)."""
    cfg = state.config
    check_config(cfg)
    _check_params(kernel_params, MosaicMamba2Params)
    kernel_params = kernel_params or default_params(cfg, tokens.x.shape[0], tokens.x.dtype, interpret=interpret)
    y, checkpoint, x_cache, b_cache, dt_cache = mamba2_replay_decode_mgpu(
        state.checkpoint, state.u_cache, state.k_cache, state.g_cache,
        tokens.x, tokens.B, tokens.C, tokens.dt, params.A, params.D, params.dt_bias,
        plan.slot, plan.pos, common.row_modes(plan.valid, plan.flush),
        z=tokens.z, dt_softplus=params.dt_softplus, dt_limit=params.dt_limit, params=kernel_params,
        row_order=plan.launch_order if kernel_params.launch_order else None, interpret=interpret,
    )
    return y, dataclasses.replace(state, checkpoint=checkpoint, u_cache=x_cache, k_cache=b_cache, g_cache=dt_cache)
