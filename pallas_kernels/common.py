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
    """

    block_v: int = 16
    num_warps: int = 2
    num_stages: int = 1
    cache_chunk: int = 16
    rebuild_precision: Precision = "ieee"
    tiles_per_program: int = 0
    rebuild_unroll: int = 1
    flush_every_step: bool = False

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
        if not isinstance(self.flush_every_step, bool):
            raise ValueError(f"flush_every_step must be a bool, got {self.flush_every_step!r}")
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

    def with_rebuild_precision(self, precision: Precision) -> "KernelConfig":
        """This config with `precision`; BV and C raised to 16 where it runs tensor-core dots."""
        if precision == "ieee":
            return dataclasses.replace(self, rebuild_precision=precision)
        return dataclasses.replace(
            self, rebuild_precision=precision, block_v=max(self.block_v, MIN_DOT_DIM),
            cache_chunk=max(self.cache_chunk, MIN_DOT_DIM),
        )

    def for_head_dim(self, head_v_dim: int) -> "KernelConfig":
        """This config with BV capped at d_v."""
        return dataclasses.replace(self, block_v=min(self.block_v, head_v_dim))

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


def _l2norm(x):
    return x * jax.lax.rsqrt(jnp.sum(x * x) + L2NORM_EPS)


def load_qk(spec: TokenSpec, q_ref, k_ref, b, hk):
    """Row b's q, k for key head hk inside a kernel: float32 `[Dk]`, normalised (if asked),
    q scaled, as the recurrence uses them."""
    q = q_ref[b, hk, :].astype(jnp.float32)
    k = k_ref[b, hk, :].astype(jnp.float32)
    if spec.use_qk_l2norm:
        q, k = _l2norm(q), _l2norm(k)
    return q * spec.scale, k


def load_gates(spec: TokenSpec, g_ref, beta_ref, a_log_ref, dt_bias_ref, b, h):
    """Row b's `(log_alpha, beta)` for value head h: log_alpha `[Dk]` (KDA) or scalar (GDN),
    computed from raw `a`, `b` in the kernel when `spec.raw_gates`."""
    if spec.per_channel_gate:
        g = g_ref[b, h, :].astype(jnp.float32)
    else:
        g = g_ref[b, h].astype(jnp.float32)
    beta = beta_ref[b, h].astype(jnp.float32)
    if spec.raw_gates:
        dt_bias = dt_bias_ref[h, :] if spec.per_channel_gate else dt_bias_ref[h]
        g = -jnp.exp(a_log_ref[h].astype(jnp.float32)) * _softplus(g + dt_bias.astype(jnp.float32))
        beta = jax.nn.sigmoid(beta)
    return g, beta


def load_token(spec: TokenSpec, refs, b, h):
    """Load and prepare row b's token for value head h inside a kernel.

    Args:
      refs: `(q, k, g_or_a, beta_or_b, A_log | None, dt_bias | None)` input refs.

    Returns:
      `(q [Dk], k [Dk], log_alpha [Dk] or scalar, beta scalar)` in float32; q is normalised
      and scaled, k normalised, as the recurrence uses them.
    """
    q_ref, k_ref, g_ref, beta_ref, a_log_ref, dt_bias_ref = refs
    q, k = load_qk(spec, q_ref, k_ref, b, h // spec.group_size)
    g, beta = load_gates(spec, g_ref, beta_ref, a_log_ref, dt_bias_ref, b, h)
    return q, k, g, beta


def over_rows(spec: TokenSpec, x):
    """A decay for a `[BV, Dk]` state tile: per key channel (KDA, `[Dk]` -> `[1, Dk]`) or one
    scalar (GDN, unchanged)."""
    return x[None, :] if spec.per_channel_gate else x


def delta_rule_step(spec: TokenSpec, state, q, k, v, g, beta):
    """One token of the gated delta rule on a live state tile `state [BV, Dk]` (float32).

    Returns `(y [BV], u [BV], S_t [BV, Dk])` with alpha = exp(g):
    `u = beta (v - S(alpha k))`, `y = S(alpha q) + u (k . q)`, `S_t = S diag(alpha) + u k^T`.
    Both readouts come from the incoming tile, side by side, so y does not wait on `S_t`.
    """
    alpha = jnp.exp(g)
    s_k = jnp.sum(state * (alpha * k)[None, :], axis=1)
    s_q = jnp.sum(state * (alpha * q)[None, :], axis=1)
    u = beta * (v - s_k)
    y = s_q + u * jnp.sum(k * q)
    return y, u, state * over_rows(spec, alpha) + u[:, None] * k[None, :]


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
    """
    operands = (*inputs, *state)
    out_shape = (
        jax.ShapeDtypeStruct(y_like.shape, y_like.dtype),
        *(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in state),
    )
    return pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=grid,
        in_specs=[any_spec()] * len(operands),
        out_specs=[any_spec()] * len(out_shape),
        input_output_aliases={len(inputs) + i: 1 + i for i in range(len(state))},
        compiler_params=config.compiler_params(),
        interpret=default_interpret() if interpret is None else interpret,
        name=name,
    )(*operands)


def row_modes(valid, flush):
    """Per-row mode: MODE_PAD, MODE_APPEND or MODE_FLUSH (int32 `[B]`)."""
    return jnp.where(valid, jnp.where(flush, MODE_FLUSH, MODE_APPEND), MODE_PAD).astype(jnp.int32)


def default_interpret() -> bool:
    """Interpret mode unless the default backend is a GPU."""
    return jax.default_backend() != "gpu"


def next_power_of_two(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())
