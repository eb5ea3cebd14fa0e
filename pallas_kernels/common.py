"""Pieces shared by the decode kernels: grid order and parameter checks, per-token input
loading and gating inside a kernel, row modes, and the Pallas call plumbing.

All kernels use the Triton lowering of `pl.pallas_call` and whole-array refs
(`memory_space=pl.ANY`) indexed with the row's slot, so one compiled kernel serves any
mix of slots, cursors and flushes.
"""

from __future__ import annotations

import dataclasses
import enum
import warnings
from typing import Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import fuser as _fuser  # noqa: F401  (see below)
from jax.experimental.pallas import triton as plgpu
from jaxtyping import Array, Bool, Int

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


class GridOrder(enum.Enum):
    """How a decode kernel launches its grid `(rows, heads, tiles)`.

    Pallas-Triton launches grid axis 0 as CUDA's fastest block index, so the order decides
    which blocks run side by side.

    ROW_FASTEST: the grid as given: blocks running together read the same (head, tile) of
      scattered slots.
    ROW_SLOWEST: reversed: a row's blocks are issued together and read neighbouring tiles
      of one slot.
    LAUNCH_ORDER: row slowest, and program row r serves row `row_order[r]` (the caller's
      permutation, e.g. flushing rows first), the row index read once per program.
    LAUNCH_ORDER_RELOAD: as LAUNCH_ORDER, the row index read again in every tile (the
      grouped kernel only; a different schedule of the same work).
    """

    ROW_FASTEST = "row_fastest"
    ROW_SLOWEST = "row_slowest"
    LAUNCH_ORDER = "launch_order"
    LAUNCH_ORDER_RELOAD = "launch_order_reload"

    @property
    def row_slowest(self) -> bool:
        return self is not GridOrder.ROW_FASTEST

    @property
    def reorders(self) -> bool:
        """The kernel serves its rows in a caller-given order."""
        return self in (GridOrder.LAUNCH_ORDER, GridOrder.LAUNCH_ORDER_RELOAD)


def is_int(value: object) -> bool:
    """An int and not a bool (True would otherwise pass as 1)."""
    return isinstance(value, int) and not isinstance(value, bool)


def check_power_of_two(name: str, value: object, *, zero_ok: bool = False) -> None:
    if not is_int(value) or value < 0 or (value == 0 and not zero_ok) or value & (value - 1):
        allowed = "0 or a power of two" if zero_ok else "a power of two"
        raise ValueError(f"{name} must be {allowed}, got {value!r}")


def check_launch(params, allowed_orders: tuple[GridOrder, ...]) -> None:
    """Shared checks of a kernel's parameters: `block_v`, `num_warps`, `grid_order`, and
    `column_chunk` where the kernel has one."""
    check_power_of_two("block_v", params.block_v)
    if isinstance(params.num_warps, bool) or params.num_warps not in (1, 2, 4, 8, 16):
        raise ValueError(f"num_warps must be 1, 2, 4, 8 or 16, got {params.num_warps!r}")
    if params.grid_order not in allowed_orders:
        names = ", ".join(o.name for o in allowed_orders)
        raise ValueError(f"grid_order must be one of {names} for {type(params).__name__}, "
                         f"got {params.grid_order!r}")
    if hasattr(params, "column_chunk"):
        check_power_of_two("column_chunk", params.column_chunk, zero_ok=True)


def check_rebuild_unroll(unroll) -> None:
    """A rebuild's unroll: cache entries loaded per memory round trip, 1..MAX_REBUILD_UNROLL."""
    if not is_int(unroll) or not 1 <= unroll <= MAX_REBUILD_UNROLL:
        raise ValueError(f"rebuild_unroll must be in 1..{MAX_REBUILD_UNROLL}, got {unroll!r}")


def check_rebuild(params, dot_dims: dict[str, int]) -> None:
    """A replay kernel's rebuild options: precision, unroll, and tensor-core dot sizes."""
    if params.rebuild_precision not in PRECISIONS:
        raise ValueError(f"rebuild_precision must be one of {PRECISIONS}, got {params.rebuild_precision!r}")
    check_rebuild_unroll(params.rebuild_unroll)
    if params.rebuild_precision == "ieee":
        return
    for name, value in dot_dims.items():
        if 0 < value < MIN_DOT_DIM:
            raise ValueError(
                f"rebuild_precision={params.rebuild_precision!r} runs tensor-core dots and needs "
                f"{name} >= {MIN_DOT_DIM}, got {value}"
            )


def with_rebuild_precision(params, precision: Precision):
    """`params` with `precision`; its dot sizes (block_v, and cache_chunk or a nonzero
    column_chunk where it has them) raised to 16 where that runs tensor-core dots."""
    if precision == "ieee":
        return dataclasses.replace(params, rebuild_precision=precision)
    raised = {name: max(getattr(params, name), MIN_DOT_DIM) for name in ("block_v", "cache_chunk")
              if hasattr(params, name)}
    if getattr(params, "column_chunk", 0):
        raised["column_chunk"] = max(params.column_chunk, MIN_DOT_DIM)
    return dataclasses.replace(params, rebuild_precision=precision, **raised)


def for_head_dim(params, head_v_dim: int):
    """`params` with BV capped at d_v."""
    return dataclasses.replace(params, block_v=min(params.block_v, head_v_dim))


def column_slices(column_chunk: int, head_k_dim: int) -> tuple[pl.Slice, ...]:
    """The d_k columns in chunks of `column_chunk` (one chunk when 0 or >= d_k)."""
    width = column_chunk if 0 < column_chunk < head_k_dim else head_k_dim
    return tuple(pl.ds(c * width, width) for c in range(head_k_dim // width))


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


def mamba2_time_step(dt_plus_bias, dt_softplus: bool, dt_limit: tuple[float, float]):
    """Mamba-2's `dt = clip(softplus(dt_raw + dt_bias), *dt_limit)` (no softplus when
    `dt_softplus` is False) in a kernel, from `dt_raw + dt_bias` in fp32."""
    dt = _softplus(dt_plus_bias) if dt_softplus else dt_plus_bias
    lo, hi = dt_limit
    return jnp.minimum(jnp.maximum(dt, lo), hi) if (lo, hi) != (0.0, float("inf")) else dt


# A row's d_k-sized vectors and the `[rows, d_k]` tiles of the state and caches are held as
# tuples of column chunks (`column_slices`): `[W]` vectors, `[rows, W]` tiles.
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
    norms instead measured slower in the plain kernel (benchmarks/NOTES.md)."""
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


def decode_call(kernel, *, grid, inputs, state, y_like, num_warps: int, grid_order: GridOrder,
                interpret, name, num_stages: int = 1):
    """`pallas_call` of a decode kernel: whole-array refs, `state` arrays aliased in place.

    The kernel sees `(*inputs, *state)` then `(y, *state)` refs; returns `(y, *new_state)`.
    `grid` starts with the row axis; with a row-slowest `grid_order` it is launched reversed
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
        grid=tuple(reversed(grid)) if grid_order.row_slowest else grid,
        in_specs=[any_spec()] * len(operands),
        out_specs=[any_spec()] * len(out_shape),
        input_output_aliases={len(inputs) + i: 1 + i for i in range(len(state))},
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=default_interpret() if interpret is None else interpret,
        name=name,
    )(*operands)


def program_ids(grid_order: GridOrder) -> tuple:
    """The program's indices `(row, ..., ...)` in the order of the grid given to
    `decode_call`, however it was launched."""
    ids = tuple(pl.program_id(axis) for axis in range(3))
    return ids[::-1] if grid_order.row_slowest else ids


def launch_row(row_ref, launch, grid_order: GridOrder):
    """The row served by the programs at row index `launch` of the grid: `launch` itself, or
    in a launch order the row that `launch_rows` put there.

    The loaded row is held across the program where a block index is not, and the GPU
    build's code moves with it (registers and schedule differ per tile shape), hence
    `GridOrder.LAUNCH_ORDER_RELOAD` beside `LAUNCH_ORDER` (benchmarks/NOTES.md).
    """
    return row_ref[launch] if grid_order.reorders else launch


class VerifyRows(NamedTuple):
    """A verify step's rows as its kernels read them, `[B]` int32 each: the row's slot, its
    cursor and its window length, all 0 on a padding row (`verify_rows`)."""

    slot: Int[Array, " B"]
    pos: Int[Array, " B"]
    length: Int[Array, " B"]


def verify_rows(slots: Int[Array, " B"], cursors: Int[Array, " N"], lengths: Int[Array, " B"]) -> VerifyRows:
    """The rows of a verify step from what its caller holds: `slots` (negative or >= N: a
    padding row), the pool's `cursors` and the requested window `lengths`. The window
    kernels form the same rows in-kernel (`verify_coefficients`); this is the XLA form."""
    slots = slots.astype(jnp.int32)
    valid = (slots >= 0) & (slots < cursors.shape[0])
    slot = jnp.where(valid, slots, 0)
    return VerifyRows(slot, jnp.where(valid, cursors[slot], 0).astype(jnp.int32),
                      jnp.where(valid, lengths, 0).astype(jnp.int32))


def row_modes(valid, flush):
    """Per-row mode: MODE_PAD, MODE_APPEND or MODE_FLUSH (int32 `[B]`)."""
    return jnp.where(valid, jnp.where(flush, MODE_FLUSH, MODE_APPEND), MODE_PAD).astype(jnp.int32)


def set_rows(pool: Array, slot: Int[Array, " B"], rows: Array, keep: Bool[Array, " B"]) -> Array:
    """`pool [N, ...]` with `rows [B, ...]`, row b at `pool[slot[b]]` where `keep[b]` holds,
    rounded to the pool's dtype; other slots untouched.

    As `set_records`: skipped rows get distinct slots past the pool (dropped), so XLA stores
    plainly instead of by atomic read-modify-writes; kept slots must be distinct (a slot
    named twice is left undefined).
    """
    target = _unique_targets(slot, keep, pool.shape[0])
    return pool.at[target].set(rows.astype(pool.dtype), mode="drop", unique_indices=True)


def set_records(pool: Array, slot: Int[Array, " B"], pos: Int[Array, "B T"], records: Array,
                keep: Array) -> Array:
    """`pool [N, heads, L, ...]` with `records [B, T, heads, ...]`, record (b, t) at
    `pool[slot[b], :, pos[b, t]]` where `keep [B, T]` holds, rounded to the pool's dtype;
    other entries untouched.

    The records skipped get distinct slots past the pool (dropped), so the scatter's indices
    are unique and XLA stores each record plainly instead of by atomic read-modify-writes
    (a compare-and-swap loop per word for 16-bit records). Kept `(slot, pos)` pairs must be
    distinct (slots used once per step, as `verify_step` checks); a pair named twice leaves
    that slot's record undefined.
    """
    rows = _unique_targets(slot, keep, pool.shape[0])
    return pool.at[rows, :, pos].set(records.astype(pool.dtype), mode="drop", unique_indices=True)


def _unique_targets(slot: Int[Array, " B"], keep: Array, num_slots: int) -> Array:
    """Scatter slots of `keep`'s shape (`[B]` or `[B, T]`): row b's slot where `keep` holds,
    else distinct slots past the pool (`num_slots`, `num_slots + 1`, ...: dropped)."""
    skipped = num_slots + jnp.arange(keep.size, dtype=jnp.int32).reshape(keep.shape)
    kept = slot.astype(jnp.int32).reshape(slot.shape + (1,) * (keep.ndim - 1))
    return jnp.where(keep, kept, skipped)


def launch_rows(slot, pos, mode, row_order, grid_order: GridOrder):
    """`(rows, slot, pos, mode)` in launch order: program row r serves row `rows[r]`, whose
    slot, cursor and mode are `slot[r]`, `pos[r]`, `mode[r]` of the results.

    `row_order` (`[B]` int, a permutation of the rows) is required by a reordering
    `grid_order` and refused by the others. The per-row arrays are gathered here, outside
    the kernel, so a program reads its slot at once instead of after its row.
    """
    batch = slot.shape[0]
    if row_order is None:
        if grid_order.reorders:
            raise ValueError(f"grid_order {grid_order.name} needs a row_order")
        return jnp.arange(batch, dtype=jnp.int32), slot, pos, mode
    if not grid_order.reorders:
        raise ValueError(f"row_order is only read with a launch-order grid, not {grid_order.name}")
    rows = check_row_order(row_order, batch)
    return rows, slot[rows], pos[rows], mode[rows]


def check_row_order(row_order, batch: int) -> Int[Array, " B"]:
    """`row_order` as int32 after checking it: shape `[batch]`, integers, and (where its
    values are known at trace time) a permutation of the rows; ValueError otherwise."""
    if tuple(jnp.shape(row_order)) != (batch,):
        raise ValueError(f"row_order must have shape ({batch},), got {tuple(jnp.shape(row_order))}")
    if not jnp.issubdtype(jnp.result_type(row_order), jnp.integer):
        raise ValueError(f"row_order must be an integer array, got dtype {jnp.result_type(row_order)}")
    if not isinstance(row_order, jax.core.Tracer) and not np.array_equal(
            np.sort(np.asarray(row_order)), np.arange(batch)):
        raise ValueError(f"row_order must be a permutation of range({batch}), got {np.asarray(row_order).tolist()}")
    return jnp.asarray(row_order).astype(jnp.int32)


def default_interpret() -> bool:
    """Interpret mode unless the default backend is a GPU."""
    return jax.default_backend() != "gpu"


def next_power_of_two(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())
