"""Mamba-2 selective-state decode: the plain kernel and the fused ReplaySSM step.

Per head h (H heads, head dim P, state size N, G groups; head h uses group h // (H/G)):

    dt = clip(softplus(dt_raw + dt_bias_h), lo, hi)
    S_t = exp(A_h dt) S_{t-1} + dt x B^T           (S [P, N])
    y   = S_t C + D_h x                            (times silu(z) when z is given)

Grid `(B, H, P // BP)` (launched reversed with a row-slowest `grid_order`): one program per
(row, head, BP-row tile of the state), whole rows of N.

`mamba2_plain_decode` reads the tile, applies the token and writes it back (the baseline).

`mamba2_replay_decode` works on a checkpoint and a cache of the raw inputs `x [N_slots, H,
L, P]`, `B [N_slots, G, L, N]`, `dt [N_slots, H, L]` (float32, after the softplus); `C` is
never cached. Each program loads its checkpoint tile `S_c [BP, N]` once, then

* an append row (output only) takes `r = S_c C` and walks the valid entries oldest first,
  `r <- exp(A dt_j) r + dt_j (B_j . C) x_j`, then this token: this is
  `y = exp(A Gamma) (S_c C) + sum_j dt_j exp(A (Gamma - c_j)) (B_j . C) x_j + D x` in
  Horner form (no state tile is formed beyond S_c); it stores x at `pos` (and, from the
  head's tile 0, dt; from the group's first head, B);
* a flush row folds the same window into the tile already in registers,
  `S <- exp(A dt_j) S + dt_j x_j B_j^T`, and writes `S_t` in place: the checkpoint is read
  from memory once per step, flush or not;
* a padding row writes y = 0 and nothing else.

Reads and writes of the state and caches go through the aliased output refs (in place).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jaxtyping import Array, Float, Int

from pallas_kernels import common
from pallas_kernels.common import GridOrder


@dataclasses.dataclass(frozen=True)
class Mamba2PlainParams:
    """Launch parameters of `mamba2_plain_decode`.

    Attributes:
      block_v: BP, state rows (of the head dim P) per program (a power of two; capped at P).
      num_warps: warps per program.
      grid_order: ROW_FASTEST or ROW_SLOWEST (`common.GridOrder`).
    """

    block_v: int = 16
    num_warps: int = 1
    grid_order: GridOrder = GridOrder.ROW_FASTEST

    def __post_init__(self) -> None:
        common.check_launch(self, (GridOrder.ROW_FASTEST, GridOrder.ROW_SLOWEST))


@dataclasses.dataclass(frozen=True)
class Mamba2ReplayParams:
    """Launch parameters of `mamba2_replay_decode` (fields as in `Mamba2PlainParams`)."""

    block_v: int = 16
    num_warps: int = 1
    grid_order: GridOrder = GridOrder.ROW_FASTEST

    def __post_init__(self) -> None:
        common.check_launch(self, (GridOrder.ROW_FASTEST, GridOrder.ROW_SLOWEST))


@dataclasses.dataclass(frozen=True)
class _Spec:
    """Static options of one call: group size, dt gating, output gate."""

    group_size: int
    dt_softplus: bool
    dt_limit: tuple[float, float]
    has_z: bool


def _time_step(spec: _Spec, dt_ref, dt_bias_ref, b, h):
    dt = dt_ref[b, h].astype(jnp.float32) + dt_bias_ref[h].astype(jnp.float32)
    return common.mamba2_time_step(dt, spec.dt_softplus, spec.dt_limit)


def _load_token(spec: _Spec, refs, b, h, rows):
    """Row b's `(x [BP], B [N], C [N], dt, A_h, D_h)` for head h, float32."""
    x_ref, bt_ref, ct_ref, dt_ref, a_ref, d_ref, dt_bias_ref = refs
    grp = h // spec.group_size
    x = x_ref[b, h, rows].astype(jnp.float32)
    bt = bt_ref[b, grp, :].astype(jnp.float32)
    ct = ct_ref[b, grp, :].astype(jnp.float32)
    return x, bt, ct, _time_step(spec, dt_ref, dt_bias_ref, b, h), a_ref[h].astype(jnp.float32), \
        d_ref[h].astype(jnp.float32)


def _output(spec: _Spec, z_ref, y_ref, b, h, rows, readout, x, d):
    y = readout + d * x
    if spec.has_z:
        z = z_ref[b, h, rows].astype(jnp.float32)
        y = y * (z * jax.nn.sigmoid(z))
    y_ref[b, h, rows] = y.astype(y_ref.dtype)


def _fold(tile, x, bt, dt, a):
    """`exp(A dt) S + dt x B^T` on a `[BP, N]` tile."""
    return jnp.exp(a * dt) * tile + (dt * x)[:, None] * bt[None, :]


def _plain_kernel(slot_ref, valid_ref, x_ref, bt_ref, ct_ref, dt_ref, z_ref, a_ref, d_ref, dt_bias_ref,
                  _state_in, y_ref, state_ref, *, spec: _Spec, block_v: int, grid_order: GridOrder):
    b, h, tile = common.program_ids(grid_order)
    rows = pl.ds(tile * block_v, block_v)
    valid = valid_ref[b] != 0

    @pl.when(~valid)
    def _padding_row():
        y_ref[b, h, rows] = jnp.zeros((block_v,), y_ref.dtype)

    @pl.when(valid)
    def _live_row():
        slot = slot_ref[b]
        x, bt, ct, dt, a, d = _load_token(spec, (x_ref, bt_ref, ct_ref, dt_ref, a_ref, d_ref, dt_bias_ref),
                                          b, h, rows)
        new = _fold(state_ref[slot, h, rows, :].astype(jnp.float32), x, bt, dt, a)
        _output(spec, z_ref, y_ref, b, h, rows, jnp.sum(new * ct[None, :], axis=1), x, d)
        state_ref[slot, h, rows, :] = new.astype(state_ref.dtype)


def _replay_kernel(slot_ref, pos_ref, mode_ref, x_ref, bt_ref, ct_ref, dt_ref, z_ref, a_ref, d_ref,
                   dt_bias_ref, _state_in, _x_in, _b_in, _dt_in, y_ref, state_ref, xc_ref, bc_ref, dtc_ref,
                   *, spec: _Spec, block_v: int, grid_order: GridOrder):
    b, h, tile = common.program_ids(grid_order)
    rows = pl.ds(tile * block_v, block_v)
    mode = mode_ref[b]

    @pl.when(mode == common.MODE_PAD)
    def _padding_row():
        y_ref[b, h, rows] = jnp.zeros((block_v,), y_ref.dtype)

    @pl.when(mode != common.MODE_PAD)
    def _live_row():
        slot, pos = slot_ref[b], pos_ref[b]
        grp = h // spec.group_size
        x, bt, ct, dt, a, d = _load_token(spec, (x_ref, bt_ref, ct_ref, dt_ref, a_ref, d_ref, dt_bias_ref),
                                          b, h, rows)
        s_c = state_ref[slot, h, rows, :].astype(jnp.float32)

        def entry(j):
            return (xc_ref[slot, h, j, rows].astype(jnp.float32), bc_ref[slot, grp, j, :].astype(jnp.float32),
                    dtc_ref[slot, h, j])

        @pl.when(mode == common.MODE_FLUSH)
        def _flush():
            def body(j, tile_state):
                return _fold(tile_state, *entry(j), a)

            new = _fold(jax.lax.fori_loop(0, pos, body, s_c), x, bt, dt, a)
            _output(spec, z_ref, y_ref, b, h, rows, jnp.sum(new * ct[None, :], axis=1), x, d)
            state_ref[slot, h, rows, :] = new.astype(state_ref.dtype)

        @pl.when(mode == common.MODE_APPEND)
        def _append():
            def body(j, readout):
                x_j, b_j, dt_j = entry(j)
                return jnp.exp(a * dt_j) * readout + (dt_j * jnp.sum(b_j * ct)) * x_j

            readout = jax.lax.fori_loop(0, pos, body, jnp.sum(s_c * ct[None, :], axis=1))
            readout = jnp.exp(a * dt) * readout + (dt * jnp.sum(bt * ct)) * x
            _output(spec, z_ref, y_ref, b, h, rows, readout, x, d)
            xc_ref[slot, h, pos, rows] = x.astype(xc_ref.dtype)

            @pl.when(tile == 0)
            def _append_dt():
                dtc_ref[slot, h, pos] = dt

            @pl.when((tile == 0) & (h % spec.group_size == 0))
            def _append_b():
                bc_ref[slot, grp, pos, :] = bt.astype(bc_ref.dtype)


def _inputs(x, B, C, dt, z, A, D, dt_bias, dt_softplus, dt_limit):
    spec = _Spec(group_size=x.shape[1] // B.shape[1], dt_softplus=bool(dt_softplus),
                 dt_limit=tuple(float(v) for v in dt_limit), has_z=z is not None)
    z = jnp.zeros((1,), x.dtype) if z is None else z
    return spec, (x, B, C, dt, z, A, D, dt_bias)


def mamba2_plain_decode(
    state: Float[Array, "N H P Ns"],
    x: Float[Array, "B H P"],
    B: Float[Array, "B G Ns"],
    C: Float[Array, "B G Ns"],
    dt: Float[Array, "B H"],
    A: Float[Array, " H"],
    D: Float[Array, " H"],
    dt_bias: Float[Array, " H"],
    slot: Int[Array, " B"],
    valid: Array,
    *,
    z: Float[Array, "B H P"] | None = None,
    dt_softplus: bool = True,
    dt_limit: tuple[float, float] = (0.0, float("inf")),
    params: Mamba2PlainParams = Mamba2PlainParams(),
    interpret: bool | None = None,
):
    """One plain Mamba-2 step: `(y [B, H, P] in x's dtype, new state [N_slots, H, P, N])`.

    Args:
      state: the state pool, updated in place when donated.
      x, B, C, dt, z: the token (raw dt; z optional); A, D, dt_bias: `[H]`.
      slot: `[B]` int32 slot of each row (any valid index on padding rows).
      valid: `[B]` bool, False on padding rows (y = 0, nothing written).
      dt_softplus, dt_limit: the dt gating (softplus, then clamp).
      params: tile, warps and grid order.
      interpret: run in the Pallas interpreter (default: off GPU).
    """
    batch, heads, head_dim = x.shape
    params = common.for_head_dim(params, head_dim)
    spec, token = _inputs(x, B, C, dt, z, A, D, dt_bias, dt_softplus, dt_limit)
    kernel = functools.partial(_plain_kernel, spec=spec, block_v=params.block_v, grid_order=params.grid_order)
    return common.decode_call(
        kernel, grid=(batch, heads, head_dim // params.block_v),
        inputs=(slot, valid.astype(jnp.int32), *token), state=(state,), y_like=x,
        num_warps=params.num_warps, grid_order=params.grid_order, interpret=interpret,
        name="mamba2_plain_decode",
    )


def mamba2_replay_decode(
    state: Float[Array, "N H P Ns"],
    x_cache: Float[Array, "N H L P"],
    b_cache: Float[Array, "N G L Ns"],
    dt_cache: Float[Array, "N H L"],
    x: Float[Array, "B H P"],
    B: Float[Array, "B G Ns"],
    C: Float[Array, "B G Ns"],
    dt: Float[Array, "B H"],
    A: Float[Array, " H"],
    D: Float[Array, " H"],
    dt_bias: Float[Array, " H"],
    slot: Int[Array, " B"],
    pos: Int[Array, " B"],
    mode: Int[Array, " B"],
    *,
    z: Float[Array, "B H P"] | None = None,
    dt_softplus: bool = True,
    dt_limit: tuple[float, float] = (0.0, float("inf")),
    params: Mamba2ReplayParams = Mamba2ReplayParams(),
    interpret: bool | None = None,
):
    """One fused Mamba-2 ReplaySSM step: `(y, state, x_cache, b_cache, dt_cache)`.

    Args:
      state, x_cache, b_cache, dt_cache: the checkpoint and caches (dt_cache float32),
        updated in place when donated.
      x, B, C, dt, z, A, D, dt_bias, dt_softplus, dt_limit: as in `mamba2_plain_decode`.
      slot: `[B]` int32 slot of each row (any valid index on padding rows).
      pos: `[B]` int32 valid cache entries of the row's slot (the write position).
      mode: `[B]` int32 `common.MODE_PAD`, `MODE_APPEND` or `MODE_FLUSH`.
      params: tile, warps and grid order.
      interpret: run in the Pallas interpreter (default: off GPU).
    """
    batch, heads, head_dim = x.shape
    params = common.for_head_dim(params, head_dim)
    spec, token = _inputs(x, B, C, dt, z, A, D, dt_bias, dt_softplus, dt_limit)
    kernel = functools.partial(_replay_kernel, spec=spec, block_v=params.block_v, grid_order=params.grid_order)
    return common.decode_call(
        kernel, grid=(batch, heads, head_dim // params.block_v),
        inputs=(slot, pos, mode, *token), state=(state, x_cache, b_cache, dt_cache), y_like=x,
        num_warps=params.num_warps, grid_order=params.grid_order, interpret=interpret,
        name="replayssm_mamba2_decode",
    )
