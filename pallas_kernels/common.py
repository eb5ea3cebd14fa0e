"""Pieces shared by the decode kernels: kernel configuration, per-token input loading
and gating inside a kernel, row modes, and the Pallas call plumbing.

All kernels use the Triton lowering of `pl.pallas_call` and whole-array refs
(`memory_space=pl.ANY`) indexed with the row's slot, so one compiled kernel serves any
mix of slots, cursors and flushes.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import fuser as _fuser  # noqa: F401  (see below)
from jax.experimental.pallas import triton as plgpu

# Pallas lowering imports its fuser lazily, and that import registers a jax config option
# that is part of the tracing context: a jitted step that first lowers a kernel would then
# be traced (and compiled) a second time on its next call. Importing it here, before any
# trace, keeps one compilation.

# Pallas-Triton is deprecated in jax 0.11 in favour of Mosaic GPU; it is still the GPU
# backend of pallas_call that this project targets (see README).
warnings.filterwarnings(
    "ignore", message="The Pallas Triton backend is deprecated", category=DeprecationWarning
)

# Row modes, computed once per step from the flush plan.
MODE_PAD = 0  # padding row: y = 0, nothing read or written
MODE_APPEND = 1  # non-flush row: read checkpoint + cache, append (u, k, g)
MODE_FLUSH = 2  # flush row: write S_t into the checkpoint

Precision = Literal["ieee", "tf32", "bf16"]
PRECISIONS: tuple[str, ...] = ("ieee", "tf32", "bf16")
SOFTPLUS_THRESHOLD = 20.0
L2NORM_EPS = 1e-6
MIN_DOT_DIM = 16  # tensor-core dots need M, N, K >= 16
MAX_REBUILD_UNROLL = 16


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """Launch parameters of one decode kernel.

    Attributes:
      block_v: BV, value rows of the state per program (a power of two dividing d_v; >= 16
        for the tensor-core rebuild precisions).
      num_warps: warps per program.
      num_stages: Triton software-pipelining depth of the cache loops.
      cache_chunk: C, cache entries loaded per iteration of the per-tile kernel's replay
        loops (a power of two; >= 16 for the tensor-core rebuild precisions), so its
        registers stay bounded for any L. The grouped kernel loads the valid entries at once.
      rebuild_precision: how a flush rebuilds the live state tile:
        "ieee": fp32 on CUDA cores, `S_c diag(e^G) + sum_j u_j (W_j * k_j)^T` one cached
          entry at a time, newest first (one fused multiply-add per tile element and entry);
        "tf32": `[BV, C] x [C, d_k]` products on tensor cores in tf32 (~1e-3 relative on
          the rebuilt part);
        "bf16": the same products with operands rounded to bf16 (~1e-2).
      tiles_per_program: 0 runs the per-tile replay kernel (one program per value-head
        tile); T >= 1 the key-head-grouped kernel with T tiles per program.
      rebuild_unroll: U, cache entries the "ieee" rebuild loads per memory round trip (it
        then applies them in order, so the result is the same for every U); a flush waits
        on ceil(pos / U) round trips instead of pos. Larger U costs registers.
      flush_every_step: the step flushes every live row (the plan says so, through
        `decode.step_plan`, used by `decode_step`, the model decoder and the check job) and
        runs `fold_decode`, which folds a row's cached entries into its checkpoint tile on its
        first such step; from then on the row's cache stays empty and each step is the plain
        recurrence on the checkpoint. Only `block_v` and `num_warps` apply then (the fold is
        exact fp32); `tiles_per_program` must be 0. The package's table sets it at small
        batch, where it measured faster than the replay cycle (H200, benchmarks/NOTES.md).
      empty_cache_branch: the folding kernel (`flush_every_step`) gives rows whose
        cache is empty (cursor 0: every step of a row after its first under such a plan)
        a branch of their own without the fold loop, so their step compiles like the plain
        kernel's. H200, fp32 state (v25): 3.17 -> 3.01 us at B = 1, 4.29 -> 4.07 at B = 2
        (BV 4); slower at B = 5 (7.26 -> 8.5) and for a bf16 state at B = 1 (2.64 -> 2.75).
      column_chunk: W, the d_k columns of a state tile are handled as `[BV, W]` chunks
        (a power of two dividing d_k; 0: whole rows, one `[BV, d_k]` block). Triton lays
        a `[BV, 128]` fp32 block out with the 32 lanes of a warp along d_k, so each row
        sum (`S k`, `S q`) costs 5 shuffle steps per row a thread holds; a `[BV, 16]`
        chunk gets 4 lanes along d_k and 8 along rows, and products summed chunk by chunk
        in registers leave one 2-step row sum (H200: the plain kernel 5-8% faster at
        B >= 32, the grouped kernel 3-9%; benchmarks/NOTES.md, v14-v16). The per-tile
        replay kernel works on whole rows.
      rows_outermost: launch the grid with the row index slowest instead of fastest, so
        that neighbouring blocks read neighbouring tiles of one slot instead of the same
        tile of B scattered slots (H200: the plain kernel 5% faster at B = 512 and 10%
        slower at B = 8; v15).
      launch_order: the replay kernels (per-tile and grouped) serve the grid's rows in the
        plan's launch order (`StepPlan.launch_order`: flushing rows first, then appending
        rows, padding rows last) instead of in row order; with `rows_outermost` the blocks
        are then issued costliest rows first, so a step that mixes flush and append rows
        (staggered cursors) does not end on flush programs issued late. The folding and
        plain kernels launch in row order whatever this says.
      reload_row: with `launch_order`, the grouped kernel reads its row index again in
        every tile instead of holding it across the program (`launch_row`): a different
        schedule, which the GPU build rewards at some entries and punishes at others
        (H200, v28h, L = 16, sync / staggered us: (32, 4, T = 4, W = 32) at B = 32 held
        34.2 / 74.2, re-read 31.1 / 38.5; v28b: T = 8 at B = 512 held 384 / 383, re-read
        400 / 399).
    """

    block_v: int = 16
    num_warps: int = 2
    num_stages: int = 1
    cache_chunk: int = 16
    rebuild_precision: Precision = "ieee"
    tiles_per_program: int = 0
    rebuild_unroll: int = 1
    flush_every_step: bool = False
    empty_cache_branch: bool = False
    column_chunk: int = 0
    rows_outermost: bool = False
    launch_order: bool = False
    reload_row: bool = False

    def __post_init__(self) -> None:
        for name in ("block_v", "cache_chunk"):
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                raise ValueError(f"{name} must be a power of two, got {value}")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"num_warps must be 1, 2, 4, 8 or 16, got {self.num_warps}")
        if self.tiles_per_program < 0:
            raise ValueError(f"tiles_per_program must be >= 0, got {self.tiles_per_program}")
        if not 1 <= self.rebuild_unroll <= MAX_REBUILD_UNROLL:
            raise ValueError(
                f"rebuild_unroll must be in 1..{MAX_REBUILD_UNROLL}, got {self.rebuild_unroll}"
            )
        for name in ("flush_every_step", "empty_cache_branch", "rows_outermost", "launch_order", "reload_row"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.reload_row and not self.launch_order:
            raise ValueError("reload_row reads the row of the launch order: it needs launch_order=True")
        if self.column_chunk < 0 or self.column_chunk & (self.column_chunk - 1):
            raise ValueError(f"column_chunk must be 0 or a power of two, got {self.column_chunk}")
        if self.flush_every_step and self.tiles_per_program:
            raise ValueError(
                "flush_every_step runs the per-tile folding kernel: tiles_per_program must be 0, "
                f"got {self.tiles_per_program}"
            )
        if self.num_stages < 1:
            raise ValueError(f"num_stages must be >= 1, got {self.num_stages}")
        if self.rebuild_precision not in PRECISIONS:
            raise ValueError(
                f"rebuild_precision must be one of {PRECISIONS}, got {self.rebuild_precision!r}"
            )
        if self.rebuild_precision != "ieee" and min(self.block_v, self.cache_chunk) < MIN_DOT_DIM:
            raise ValueError(
                f"rebuild_precision={self.rebuild_precision!r} runs tensor-core dots and needs "
                f"block_v and cache_chunk >= {MIN_DOT_DIM}, got {self.block_v}, {self.cache_chunk}"
            )
        if self.rebuild_precision != "ieee" and 0 < self.column_chunk < MIN_DOT_DIM:
            raise ValueError(
                f"rebuild_precision={self.rebuild_precision!r} runs one tensor-core dot per column "
                f"chunk and needs column_chunk 0 or >= {MIN_DOT_DIM}, got {self.column_chunk}"
            )

    def with_rebuild_precision(self, precision: Precision) -> "KernelConfig":
        """This config with `precision`; BV, C and a nonzero W raised to 16 where it runs
        tensor-core dots."""
        if precision == "ieee":
            return dataclasses.replace(self, rebuild_precision=precision)
        return dataclasses.replace(
            self, rebuild_precision=precision, block_v=max(self.block_v, MIN_DOT_DIM),
            cache_chunk=max(self.cache_chunk, MIN_DOT_DIM),
            column_chunk=self.column_chunk and max(self.column_chunk, MIN_DOT_DIM),
        )

    def for_head_dim(self, head_v_dim: int) -> "KernelConfig":
        """This config with BV capped at d_v."""
        return dataclasses.replace(self, block_v=min(self.block_v, head_v_dim))

    def column_slices(self, head_k_dim: int) -> tuple[pl.Slice, ...]:
        """The d_k columns in chunks of `column_chunk` (one chunk when 0 or >= d_k)."""
        width = self.column_chunk if 0 < self.column_chunk < head_k_dim else head_k_dim
        return tuple(pl.ds(c * width, width) for c in range(head_k_dim // width))

    def compiler_params(self) -> plgpu.CompilerParams:
        return plgpu.CompilerParams(num_warps=self.num_warps, num_stages=self.num_stages)


@dataclasses.dataclass(frozen=True)
class TokenSpec:
    """Static description of how a kernel reads one token's inputs.

    Attributes:
      group_size: value heads per key head.
      per_channel_gate: KDA (g per key channel) instead of GDN (g per head).
      raw_gates: the g/beta inputs hold raw `a`/`b` and the gates are computed in-kernel
        from `A_log` and `dt_bias` (Qwen3-Next / KDA gating).
      use_qk_l2norm: L2-normalise q and k in the kernel.
      scale: multiplies q after the norm.
    """

    group_size: int
    per_channel_gate: bool
    raw_gates: bool
    use_qk_l2norm: bool
    scale: float


def token_spec(q, v, *, per_channel_gate, gate_params, use_qk_l2norm, scale) -> TokenSpec:
    """The `TokenSpec` of a call with inputs q `[B, H_k, d_k]` and v `[B, H_v, d_v]`."""
    return TokenSpec(
        group_size=v.shape[1] // q.shape[1],
        per_channel_gate=per_channel_gate,
        raw_gates=gate_params is not None,
        use_qk_l2norm=use_qk_l2norm,
        scale=float(q.shape[2] ** -0.5 if scale is None else scale),
    )


def gate_param_inputs(gate_params):
    """`(A_log, dt_bias)` kernel inputs; one-element placeholders when gates come precomputed."""
    if gate_params is None:
        return jnp.zeros((1,), jnp.float32), jnp.zeros((1,), jnp.float32)
    return gate_params


def _softplus(x):
    return jnp.where(x > SOFTPLUS_THRESHOLD, x, jnp.log1p(jnp.exp(jnp.minimum(x, SOFTPLUS_THRESHOLD))))


# A row's d_k-sized vectors and the `[rows, d_k]` tiles of the state and caches are held as
# tuples of column chunks (`KernelConfig.column_slices`): `[W]` vectors, `[rows, W]` tiles.
# A per-head gate (GDN) is one scalar for every chunk; a per-channel gate (KDA) is a tuple.
Chunks = tuple


def load_chunks(ref, index: tuple, slices) -> Chunks:
    """`ref[*index, c]` for each column chunk c, in float32."""
    return tuple(ref[(*index, c)].astype(jnp.float32) for c in slices)


def store_chunks(ref, index: tuple, slices, chunks: Chunks) -> None:
    """`ref[*index, c] = chunk` for each column chunk c, in the ref's dtype."""
    for c, chunk in zip(slices, chunks):
        ref[(*index, c)] = chunk.astype(ref.dtype)


def load_qk(spec: TokenSpec, q_ref, k_ref, b, hk, slices) -> tuple[Chunks, Chunks, jax.Array]:
    """Row b's q, k for key head hk inside a kernel, as float32 column chunks normalised
    (if asked), q scaled, as the recurrence uses them; and `k . q`.

    The norms come from whole-row loads, one reduction each: summing per-chunk partial
    norms instead measured 4% slower in the plain kernel (v19 vs v15, B = 512)."""
    q_fac, k_fac = spec.scale, 1.0
    if spec.use_qk_l2norm:
        inv_norm = lambda ref: jax.lax.rsqrt(
            jnp.sum(jnp.square(ref[b, hk, :].astype(jnp.float32))) + L2NORM_EPS)
        q_fac, k_fac = q_fac * inv_norm(q_ref), inv_norm(k_ref)
    qs = tuple(q_ref[b, hk, c].astype(jnp.float32) * q_fac for c in slices)
    ks = tuple(k_ref[b, hk, c].astype(jnp.float32) * k_fac for c in slices)
    return qs, ks, sum(jnp.sum(q * k) for q, k in zip(qs, ks))


def load_gates(spec: TokenSpec, g_ref, beta_ref, a_log_ref, dt_bias_ref, b, h, slices):
    """Row b's `(log_alpha, beta)` for value head h: log_alpha column chunks (KDA) or one
    scalar (GDN), computed from raw `a`, `b` in the kernel when `spec.raw_gates`."""
    beta = beta_ref[b, h].astype(jnp.float32)

    def gate(raw, dt_bias):
        raw = raw.astype(jnp.float32)
        if not spec.raw_gates:
            return raw
        return -jnp.exp(a_log_ref[h].astype(jnp.float32)) * _softplus(raw + dt_bias.astype(jnp.float32))

    if spec.raw_gates:
        beta = jax.nn.sigmoid(beta)
    if spec.per_channel_gate:
        return tuple(gate(g_ref[b, h, c], dt_bias_ref[h, c] if spec.raw_gates else None)
                     for c in slices), beta
    return gate(g_ref[b, h], dt_bias_ref[h] if spec.raw_gates else None), beta


def load_token(spec: TokenSpec, refs, b, h, slices):
    """Load and prepare row b's token for value head h inside a kernel.

    Args:
      refs: `(q, k, g_or_a, beta_or_b, A_log, dt_bias)` input refs.
      slices: the column chunks of d_k.

    Returns:
      `(q chunks, k chunks, k . q, log_alpha (chunks, or a scalar for GDN), beta)` in
      float32; q is normalised and scaled, k normalised, as the recurrence uses them.
    """
    q_ref, k_ref, g_ref, beta_ref, a_log_ref, dt_bias_ref = refs
    qs, ks, k_dot_q = load_qk(spec, q_ref, k_ref, b, h // spec.group_size, slices)
    g, beta = load_gates(spec, g_ref, beta_ref, a_log_ref, dt_bias_ref, b, h, slices)
    return qs, ks, k_dot_q, g, beta


def over_rows(spec: TokenSpec, x):
    """A decay for a whole-row `[BV, Dk]` tile: per key channel (KDA, `[Dk]` -> `[1, Dk]`)
    or one scalar (GDN, unchanged)."""
    return x[None, :] if spec.per_channel_gate else x


def gate_map(fn, g):
    """`fn` applied to a gate: each chunk of a per-channel gate, or the one scalar."""
    return tuple(fn(x) for x in g) if isinstance(g, tuple) else fn(g)


def scale_columns(tiles: Chunks, factor) -> Chunks:
    """Tile chunks `[R, W]` times a per-column factor (chunks `[W]`) or a scalar."""
    if isinstance(factor, tuple):
        return tuple(t * f[None, :] for t, f in zip(tiles, factor))
    return tuple(t * factor for t in tiles)


def scale_vector(vecs: Chunks, factor) -> Chunks:
    """Vector chunks `[W]` times per-column chunks `[W]` or a scalar."""
    if isinstance(factor, tuple):
        return tuple(x * f for x, f in zip(vecs, factor))
    return tuple(x * factor for x in vecs)


def row_sum(tiles: Chunks, vecs: Chunks):
    """`T x` (`[R]`) of a tile and a vector given as chunks: the chunk products are summed
    in registers first, then one row sum."""
    acc = tiles[0] * vecs[0][None, :]
    for t, x in zip(tiles[1:], vecs[1:]):
        acc = acc + t * x[None, :]
    return jnp.sum(acc, axis=1)


def add_outer(tiles: Chunks, u, vecs: Chunks) -> Chunks:
    """`T + u x^T` over the chunks (`u [R]`, x chunks `[W]`)."""
    return tuple(t + u[:, None] * x[None, :] for t, x in zip(tiles, vecs))


def delta_rule_step(state: Chunks, qs: Chunks, ks: Chunks, v, g, beta):
    """One token of the gated delta rule on a live state tile (float32 chunks `[BV, W]`).

    Returns `(y [BV], u [BV], S_t chunks)` with alpha = exp(g):
    `S~ = S diag(alpha)`, `u = beta (v - S~ k)`, `S_t = S~ + u k^T`, `y = S_t q`: the
    plain kernel's order.
    """
    decayed = scale_columns(state, gate_map(jnp.exp, g))
    u = beta * (v - row_sum(decayed, ks))
    new = add_outer(decayed, u, ks)
    return row_sum(new, qs), u, new


def rebuild_dot(u_t, wk, precision: str):
    """`u_t [BV, C] @ wk [C, Dk]` on tensor cores: "tf32", or "bf16" operands; f32 result."""
    if precision == "bf16":
        return jnp.dot(
            u_t.astype(jnp.bfloat16), wk.astype(jnp.bfloat16), preferred_element_type=jnp.float32
        )
    return jnp.dot(u_t, wk, precision=jax.lax.Precision.DEFAULT, preferred_element_type=jnp.float32)


def any_spec() -> pl.BlockSpec:
    """A whole-array ref: the kernel indexes it itself (slots, cursors, tiles)."""
    return pl.BlockSpec(memory_space=pl.ANY)


def decode_call(kernel, *, grid, inputs, state, y_like, config: KernelConfig, interpret, name):
    """`pallas_call` of a decode kernel: whole-array refs, `state` arrays aliased in place.

    The kernel sees `(*inputs, *state)` then `(y, *state)` refs; returns `(y, *new_state)`.
    `grid` starts with the row axis; with `config.rows_outermost` it is launched reversed
    and the kernel reads its indices through `program_ids`.
    """
    operands = (*inputs, *state)
    out_shape = (
        jax.ShapeDtypeStruct(y_like.shape, y_like.dtype),
        *(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in state),
    )
    return pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=tuple(reversed(grid)) if config.rows_outermost else grid,
        in_specs=[any_spec()] * len(operands),
        out_specs=[any_spec()] * len(out_shape),
        input_output_aliases={len(inputs) + i: 1 + i for i in range(len(state))},
        compiler_params=config.compiler_params(),
        interpret=default_interpret() if interpret is None else interpret,
        name=name,
    )(*operands)


def program_ids(rows_outermost: bool) -> tuple:
    """The program's indices `(row, ..., ...)` in the order of the grid given to
    `decode_call`, however it was launched."""
    ids = tuple(pl.program_id(axis) for axis in range(3))
    return ids[::-1] if rows_outermost else ids


def launch_row(row_ref, launch, launch_order: bool):
    """The row served by the programs at row index `launch` of the grid: `launch` itself, or
    with `launch_order` the row that `launch_rows` put there, read once per program.

    The loaded row is held across the program where a block index is not, and the GPU
    build's code moves with it: on the H200 it cost the grouped kernel's (32, 4, T = 4,
    W = 32) flush 79 -> 140 us at B = 32 at the same 128 registers and no spills (v28,
    v28f), and a bf16 state's T = 4 entry 96 -> 121 registers; reading it again in every
    tile (`KernelConfig.reload_row`) fixed that flush but cost the T = 8 non-flush step 5%
    (v28b, v28h). Hence switches per table entry, and the previous kernel without them.
    """
    return row_ref[launch] if launch_order else launch


def row_modes(valid, flush):
    """Per-row mode: MODE_PAD, MODE_APPEND or MODE_FLUSH (int32 `[B]`)."""
    return jnp.where(valid, jnp.where(flush, MODE_FLUSH, MODE_APPEND), MODE_PAD).astype(jnp.int32)


def concrete_or_none(x) -> np.ndarray | None:
    """The value of `x` when it is known at trace time, else None (a jit tracer). Shared
    with the package's argument checks (`replayssm_jax.decode`, `replayssm_jax.model`),
    which import it from here: this module cannot import theirs."""
    try:
        return np.asarray(x)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        return None


def launch_rows(slot, pos, mode, row_order, config: KernelConfig):
    """`(rows, slot, pos, mode)` in launch order: program row r serves row `rows[r]`, whose
    slot, cursor and mode are `slot[r]`, `pos[r]`, `mode[r]` of the results.

    `row_order` (`[B]` int, a permutation of the rows, e.g. `StepPlan.launch_order`) needs
    `config.launch_order`; None keeps the rows in order. The per-row arrays are gathered
    here, outside the kernel, so a program reads its slot at once instead of after its row.
    """
    batch = slot.shape[0]
    if row_order is not None and not config.launch_order:
        raise ValueError("row_order is only read with KernelConfig(launch_order=True)")
    if row_order is None:
        return jnp.arange(batch, dtype=jnp.int32), slot, pos, mode
    if tuple(jnp.shape(row_order)) != (batch,):
        raise ValueError(f"row_order must have shape ({batch},), got {tuple(jnp.shape(row_order))}")
    if not jnp.issubdtype(jnp.result_type(row_order), jnp.integer):
        raise ValueError(f"row_order must be an integer array, got dtype {jnp.result_type(row_order)}")
    values = concrete_or_none(row_order)  # None under jit: the caller's plan computed it
    if values is not None and not np.array_equal(np.sort(values), np.arange(batch)):
        raise ValueError(f"row_order must be a permutation of range({batch}), got {values.tolist()}")
    rows = row_order.astype(jnp.int32)
    return rows, slot[rows], pos[rows], mode[rows]


def default_interpret() -> bool:
    """Interpret mode unless the default backend is a GPU."""
    return jax.default_backend() != "gpu"


def next_power_of_two(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())
