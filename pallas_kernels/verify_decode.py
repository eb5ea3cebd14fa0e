"""Fused speculative verify of a draft window (GDN and KDA), one launch per layer step.

Grid `(B, H_v, d_v / (BV * P))` (launched reversed with `GridOrder.ROW_SLOWEST`), P =
`tiles_per_program`: one program per (row, value head, P consecutive BV-row tiles of the
state). S is the row's live state before the window, G_i the sum of g over window position
i's branch (its ancestors and i; per key channel for KDA), `anc` the strict-ancestor mask.

The window's vectors are stacked as the rows of one tile `X [R, d_k]`: keys of positions
0..T-1 in rows 0..T-1, queries in rows T..2T-1, zeros after (R = `window_rows(T)`, a power
of two >= 16: the dots' minimum), so one `[R, d_k] x [d_k, BV]` dot reads the state out
for all 2T vectors. Every `[., d_k]` operand (X, the checkpoint tile, the cached keys and,
for KDA, gates) is loaded in `[., W]` column chunks inside a loop over the chunks, where it
is used: registers hold one chunk at a time whatever d_k. Each program

1. builds the window's matrices (small: every program recomputes them), from the chunks of
   X as loaded, its row norms applied to the products (L2 norm and q's scale in the kernel):

       F_nj = sum_c x_n[c] exp(G_n[c] - G_j[c]) k_j[c]     for j on row n's branch (the
              ancestors of a key row's position; the ancestors and itself for a query)
       A = beta F (key rows),  Inv = (I + A)^{-1} = prod_s (I + (-A)^(2^s))   (A^T = 0)
       mix: y_i = Z_{T+i} + sum_j (F Inv)_{T+i, j} R_j      (the query rows moved up)

   and the key side of the cache, `P = ((e^G X)(W * K_c)^T)` (`W_j` the valid entries'
   replay weights);
2. per tile reads out the live state for every window vector without forming it,

       Z = (e^G X) diag(e^{G_c}) S_c^T + P U_c                             ([R, BV])

   (`e^{G_c}` the checkpoint's decay over the cache), the checkpoint tile read once, then
   `R = beta (V - Z_k)`, `U = Inv R`, `Y = mix [R; Z_q]` as `[R, R] x [R, BV]` dots, and
   stores `y [B, T, H_v, BV-slice]` and the window's u records into the u cache at
   `base .. base + length - 1` in place (aliased).

Cache entries are masked by position: entries at and past the cursor are never read, so a
stale entry, NaN included, contributes nothing. Rows in `MODE_FLUSH` (the caller's choice:
history plus window overflows the ring) first fold their history into the checkpoint
tile, exactly entry by entry (`replay_decode.rebuild_exact`) or with one
`[BV, L] x [L, W]` dot per chunk (`fold_by_dot`), store it in place, and read out from the
stored value with no cache term; their window lands at 0. `MODE_PAD` rows store zero
outputs and touch nothing else.

The window's k and g records are not written here: a folding row's programs read the
history at the positions 0.. that its window overwrites, the key cache is shared by the
programs of every value head of a key head (and g by every tile of a value head), and
programs are not ordered; the caller appends k and g after the launch.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Literal

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
from jaxtyping import Array, Float, Int

from pallas_kernels import common
from pallas_kernels.common import GridOrder
from pallas_kernels.replay_decode import rebuild_exact
from pallas_kernels.replay_decode_grouped import cache_block_len

DotPrecision = Literal["ieee", "tf32x3"]
DOT_PRECISIONS: tuple[str, ...] = ("ieee", "tf32x3")
_HIGHEST = jax.lax.Precision.HIGHEST


@dataclasses.dataclass(frozen=True)
class VerifyDecodeParams:
    """Launch parameters of `verify_decode`.

    Attributes:
      block_v: BV, value rows of the state per tile (a power of two >= 16, a dot size;
        capped at d_v).
      num_warps: warps per program.
      tiles_per_program: P >= 1 BV tiles of one value head per program (lowered to a
        divisor of d_v / BV); the program builds the window's matrices once for its tiles.
      column_chunk: W, the d_k columns of every `[., d_k]` operand in chunks of W (a power
        of two >= 16, or 0: whole rows), loaded and used one chunk per loop iteration.
      dot_precision: the dots with float32 operands that touch the state, the cache or the
        window's values:
        "ieee": fp32 fused multiply-adds on CUDA cores (exact);
        "tf32x3": three tf32 tensor-core products per dot (hi*hi + hi*lo + lo*hi), ~1e-6
          relative. The products of the window's T x T matrices are always "ieee".
        The Pallas interpreter computes every dot in fp32, whatever is chosen.
      fold_by_dot: folding rows rebuild the live tile as `S_c e^G + U^T (W * K)` with one
        `[BV, L] x [L, W]` dot per chunk in `dot_precision`, instead of entry by entry in
        exact fp32 (`rebuild_exact`).
      rebuild_unroll: U, cache entries the exact rebuild loads per memory round trip (the
        result is the same for every U).
      num_stages: Triton software-pipelining depth of the kernel's loops (chunks, tiles).
      grid_order: ROW_FASTEST or ROW_SLOWEST.
    """

    block_v: int = 32
    num_warps: int = 4
    tiles_per_program: int = 1
    column_chunk: int = 16
    dot_precision: DotPrecision = "tf32x3"
    fold_by_dot: bool = False
    rebuild_unroll: int = 2
    num_stages: int = 1
    grid_order: GridOrder = GridOrder.ROW_SLOWEST

    def __post_init__(self) -> None:
        common.check_launch(self, (GridOrder.ROW_FASTEST, GridOrder.ROW_SLOWEST))
        for name in ("block_v", "column_chunk"):
            if 0 < getattr(self, name) < common.MIN_DOT_DIM:
                raise ValueError(f"{name} must be >= {common.MIN_DOT_DIM} (a dot size), got {getattr(self, name)}")
        tiles = self.tiles_per_program
        if isinstance(tiles, bool) or not isinstance(tiles, int) or tiles < 1:
            raise ValueError(f"tiles_per_program must be an int >= 1, got {tiles!r}")
        if self.dot_precision not in DOT_PRECISIONS:
            raise ValueError(f"dot_precision must be one of {DOT_PRECISIONS}, got {self.dot_precision!r}")
        if not isinstance(self.fold_by_dot, bool):
            raise ValueError(f"fold_by_dot must be a bool, got {self.fold_by_dot!r}")
        if isinstance(self.num_stages, bool) or not isinstance(self.num_stages, int) or self.num_stages < 1:
            raise ValueError(f"num_stages must be an int >= 1, got {self.num_stages!r}")
        unroll = self.rebuild_unroll
        if isinstance(unroll, bool) or not isinstance(unroll, int) or not 1 <= unroll <= common.MAX_REBUILD_UNROLL:
            raise ValueError(f"rebuild_unroll must be in 1..{common.MAX_REBUILD_UNROLL}, got {unroll!r}")


def window_rows(width: int) -> int:
    """R, the rows of the stacked window tile: 2T (keys, then queries) padded to a power of
    two >= 16."""
    return max(common.next_power_of_two(2 * width), common.MIN_DOT_DIM)


def _dot_fn(precision: str, interpret: bool):
    """`dot(a, b)` of float32 tiles in `precision` (the interpreter's CPU dot has no tf32x3:
    it runs fp32 there)."""
    algorithm = _HIGHEST
    if precision == "tf32x3" and not interpret:
        algorithm = jax.lax.DotAlgorithmPreset.TF32_TF32_F32_X3
    return lambda a, b: jnp.dot(a, b, precision=algorithm, preferred_element_type=jnp.float32)


def _exact_dot(a, b):
    return jnp.dot(a, b, precision=_HIGHEST, preferred_element_type=jnp.float32)


def _row(x, j):
    """Row j of a tile `[R, W]` as a vector `[W]`."""
    return jnp.sum(jnp.where(jnp.arange(x.shape[0])[:, None] == j, x, 0.0), axis=0)


def _column(x, j):
    """Column j of a tile `[M, R]` as a vector `[M]`."""
    return jnp.sum(jnp.where(jnp.arange(x.shape[1])[None, :] == j, x, 0), axis=1)


def _inverse_unit_lower(a, width: int):
    """`(I + A)^{-1}` for strictly lower-triangular A `[R, R]` with `A^width = 0`:
    `(I - A)(I + A^2)(I + A^4)...` up to the power that reaches `width`."""
    rows = jnp.arange(a.shape[0])
    power = -a
    inv = (rows[:, None] == rows[None, :]).astype(jnp.float32) + power
    reach = 2
    while reach < width:
        power = _exact_dot(power, power)
        inv = inv + _exact_dot(inv, power)
        reach *= 2
    return inv


class _Window:
    """Row indices of the stacked window tile for T = `width` (see the module doc)."""

    def __init__(self, width: int):
        self.width = width
        self.rows = jnp.arange(window_rows(width))
        self.is_key = self.rows < width
        self.is_query = (self.rows >= width) & (self.rows < 2 * width)
        self.position = jnp.where(self.is_key, self.rows, self.rows - width)  # of rows < 2T
        self.cols = self.rows[None, :]  # as the columns of an [R, R] tile: positions j

    def live(self, length):
        """Rows that hold a window vector (position < length)."""
        return (self.is_key | self.is_query) & (self.position < length)


def _verify_kernel(
    slot_ref, pos_ref, mode_ref, length_ref, anc_ref, q_ref, k_ref, v_ref, g_ref, beta_ref,
    _ckpt_in, _u_in, _k_in, _g_in,
    y_ref, ckpt_ref, ucache_ref, kcache_ref, gcache_ref,
    *, per_channel: bool, group_size: int, use_qk_l2norm: bool, scale: float, width: int, block_v: int,
    tiles_per_program: int, chunk: int, num_chunks: int, cache_block: int, precision: str, fold_by_dot: bool,
    unroll: int, grid_order: GridOrder, interpret: bool,
):
    b, h, split = common.program_ids(grid_order)
    mode = mode_ref[b]
    win = _Window(width)
    num_rows = win.rows.shape[0]
    first = split * tiles_per_program
    dot = _dot_fn(precision, interpret)
    at = jnp.int32  # a static index as a ref index (Python ints do not index refs here)
    y_rows = lambda cols: y_ref.at[b, pl.ds(0, num_rows), h, cols]
    in_width = win.is_key[:, None]  # output rows 0..T-1

    @pl.when(mode == common.MODE_PAD)
    def _padding_row():
        for p in range(tiles_per_program):
            cols = pl.ds((first + p) * block_v, block_v)
            plgpu.store(y_rows(cols), jnp.zeros((num_rows, block_v), y_ref.dtype), mask=in_width)

    @pl.when(mode != common.MODE_PAD)
    def _live_row():
        slot, pos, length = slot_ref[b], pos_ref[b], length_ref[b]
        fold = mode == common.MODE_FLUSH
        hist = jnp.where(fold, 0, pos)  # entries the readout replays; the window lands here
        hk = h // group_size
        live = win.live(length)
        in_len = (win.rows < length)[:, None]  # rows 0..T-1: positions
        entries = pl.ds(0, cache_block)
        live_entry = jnp.arange(cache_block) < pos  # the history
        live_pos = live_entry[:, None]
        live_read = (jnp.arange(cache_block) < hist)[:, None]  # what the readout replays
        columns = lambda c: pl.ds(c * chunk, chunk)

        # Every [., d_k] operand is loaded one column chunk at a time where it is used
        # (chunk loops, not values held across the program): registers stay bounded.
        query_rows = jnp.clip(win.rows - width, 0, width - 1)[:, None]  # in bounds for masked rows

        def window_chunk(c):
            """Chunk c of the stacked window as loaded (not normalised), `[R, W]`."""
            keys = plgpu.load(k_ref.at[b, pl.ds(0, num_rows), hk, columns(c)],
                              mask=(win.is_key & live)[:, None], other=0.0)
            queries = plgpu.load(q_ref.at[b, query_rows, hk, (c * chunk + jnp.arange(chunk))[None, :]],
                                 mask=(win.is_query & live)[:, None], other=0.0)
            return keys.astype(jnp.float32) + queries.astype(jnp.float32)

        def cache_chunk(ref, index, c, mask):
            return plgpu.load(ref.at[(*index, entries, columns(c))], mask=mask, other=0.0).astype(jnp.float32)

        beta_w = plgpu.load(beta_ref.at[b, pl.ds(0, num_rows), h], mask=win.rows < length, other=0.0)
        beta_w = beta_w.astype(jnp.float32)  # zero on query rows
        anc = plgpu.load(anc_ref.at[b, jnp.clip(win.position, 0, width - 1)[:, None], jnp.minimum(win.cols, width - 1)],
                         mask=live[:, None] & (win.cols < width), other=0)
        seen = (anc != 0) | (live[:, None] & (win.cols == win.position[:, None]))
        branch = seen & ~(win.is_key[:, None] & (win.cols == win.rows[:, None]))  # strict for keys

        if per_channel:
            seen_cols = [_column(seen.astype(jnp.float32), j) for j in range(width)]
            branch_cols = [_column(branch.astype(jnp.int32), j) > 0 for j in range(width)]

            def branch_decay(c):
                """G of each row's position, chunk c `[R, W]`: the branch's sum of g."""
                g_row = lambda j: plgpu.load(g_ref.at[b, at(j), h, columns(c)],
                                             mask=jnp.full((chunk,), j < length), other=0.0).astype(jnp.float32)
                return sum((seen_cols[j][:, None] * g_row(j)[None, :] for j in range(1, width)),
                           seen_cols[0][:, None] * g_row(0)[None, :])

            def window_body(c, carry):
                """Chunk c of: the squared norms, F (module doc, before the norms) and
                `(e^G X)(W * K_c)^T`."""
                sumsq, f, p = carry
                x, G_c = window_chunk(c), branch_decay(c)
                g_c = cache_chunk(gcache_ref, (slot, h), c, live_pos)
                weights = jnp.where(live_pos, jnp.exp(jnp.sum(g_c, axis=0)[None, :] - jnp.cumsum(g_c, axis=0)), 0.0)
                p = p + dot(x * jnp.exp(G_c), (cache_chunk(kcache_ref, (slot, hk), c, live_read) * weights).T)
                for j in range(width):
                    # The exponent masked to the rows whose branch holds j before `exp`
                    # (elsewhere G_n - G_j can be large and positive).
                    weighted = jnp.exp(jnp.where(branch_cols[j][:, None], G_c - _row(G_c, j)[None, :], 0.0))
                    column = jnp.sum(x * weighted * _row(x, j)[None, :], axis=1)
                    f = f + jnp.where(win.cols == j, jnp.where(branch_cols[j], column, 0.0)[:, None], 0.0)
                return sumsq + jnp.sum(x * x, axis=1), f, p

            zeros = (jnp.zeros((num_rows,), jnp.float32), jnp.zeros(seen.shape, jnp.float32),
                     jnp.zeros((num_rows, cache_block), jnp.float32))
            sumsq, f, p = jax.lax.fori_loop(0, num_chunks, window_body, zeros)
        else:
            g_w = plgpu.load(g_ref.at[b, pl.ds(0, num_rows), h], mask=win.rows < length, other=0.0)
            G = jnp.sum(jnp.where(seen, g_w.astype(jnp.float32)[None, :], 0.0), axis=1)
            g_c = plgpu.load(gcache_ref.at[slot, h, entries], mask=live_entry, other=0.0).astype(jnp.float32)
            total = jnp.sum(g_c, axis=0)
            weights = jnp.where(live_entry, jnp.exp(total - jnp.cumsum(g_c, axis=0)), 0.0)  # W_j, [Lb]
            decay_c = jnp.exp(total)

            def window_body(c, carry):
                """Chunk c of: the squared norms, the Gram matrix X X^T and `K_c X^T`."""
                sumsq, gram, kx = carry
                x = window_chunk(c)
                kx = kx + dot(cache_chunk(kcache_ref, (slot, hk), c, live_read), x.T)
                return sumsq + jnp.sum(x * x, axis=1), gram + dot(x, x.T), kx

            zeros = (jnp.zeros((num_rows,), jnp.float32), jnp.zeros(seen.shape, jnp.float32),
                     jnp.zeros((cache_block, num_rows), jnp.float32))
            sumsq, gram, kx = jax.lax.fori_loop(0, num_chunks, window_body, zeros)

        # The norms (and q's scale) scale X's rows, so they are applied to the products.
        factor = jnp.where(win.is_query, scale, 1.0)
        if use_qk_l2norm:
            factor = factor * jax.lax.rsqrt(sumsq + common.L2NORM_EPS)
        f_scale = factor[:, None] * factor[None, :]  # column j < T: key row j's factor
        if per_channel:
            f = f * f_scale
            p = jnp.where(fold, 0.0, p * factor[:, None])  # a folded row reads its new checkpoint only
            row_scale = factor
        else:
            e_g = jnp.exp(G)
            f = jnp.where(branch, jnp.exp(jnp.where(branch, G[:, None] - G[None, :], 0.0)) * gram * f_scale, 0.0)
            p = kx.T * ((factor * e_g)[:, None] * jnp.where(fold, 0.0, weights)[None, :])
            row_scale = factor * e_g * jnp.where(fold, 1.0, decay_c)
        keys2 = win.is_key[:, None] & (win.cols < width)
        inv = jnp.where(keys2, _inverse_unit_lower(beta_w[:, None] * f, width), 0.0)
        shift = (win.cols == win.rows[:, None] + width) & win.is_key[:, None]  # row i <- row T + i
        moved = jnp.where(win.is_query[:, None], _exact_dot(f, inv) + (win.cols == win.rows[:, None]), 0.0)
        mix = _exact_dot(shift.astype(jnp.float32), moved)  # y = mix [R; Z_q]

        def readout_operand(c, decayed: bool):
            """Chunk c of the readout's first operand, `[R, W]`, before `row_scale`: X,
            for KDA times `e^G` and (`decayed`) the checkpoint's decay over the cache."""
            x = window_chunk(c)
            if not per_channel:
                return x
            x = x * jnp.exp(branch_decay(c))
            if decayed:
                x = x * jnp.exp(jnp.sum(cache_chunk(gcache_ref, (slot, h), c, live_pos), axis=0))[None, :]
            return x

        def streamed_readout(cols):
            """`X S_c^T`-part of Z for a replaying row, the checkpoint read chunk by chunk."""
            def body(c, acc):
                s_c = ckpt_ref[slot, h, cols, columns(c)].astype(jnp.float32)  # [BV, W]
                return acc + dot(readout_operand(c, True), s_c.T)

            return jax.lax.fori_loop(0, num_chunks, body, jnp.zeros((num_rows, block_v), jnp.float32))

        slices = tuple(columns(c) for c in range(num_chunks))
        spec = common.TokenSpec(group_size=group_size, per_channel_gate=per_channel, raw_gates=False,
                                use_qk_l2norm=False, scale=1.0)

        def store_and_read(cols, c, prev):
            """Store the rebuilt chunk c (in the checkpoint's dtype) and return its part of
            the readout, from the stored value."""
            stored = prev.astype(ckpt_ref.dtype)
            ckpt_ref[slot_ref[b], h, cols, columns(c)] = stored
            return dot(readout_operand(c, False), stored.astype(jnp.float32).T)

        def folded_readout(cols):
            """Fold the history into the tile, store it, read it out (no cache term)."""
            if fold_by_dot:  # chunk by chunk: `S_c e^G + U^T (W * K_c)`
                u_t = plgpu.load(ucache_ref.at[slot, h, entries, cols], mask=live_pos, other=0.0)
                u_t = u_t.astype(jnp.float32).T  # [BV, Lb]

                def body(c, acc):
                    s_c = ckpt_ref[slot, h, cols, columns(c)].astype(jnp.float32)
                    k_c = cache_chunk(kcache_ref, (slot, hk), c, live_pos)
                    if per_channel:
                        g_c = cache_chunk(gcache_ref, (slot, h), c, live_pos)
                        total = jnp.sum(g_c, axis=0)[None, :]
                        w = jnp.where(live_pos, jnp.exp(total - jnp.cumsum(g_c, axis=0)), 0.0)
                        prev = s_c * jnp.exp(total) + dot(u_t, k_c * w)
                    else:
                        prev = s_c * decay_c + dot(u_t, k_c * weights[:, None])
                    return acc + store_and_read(cols, c, prev)

                return jax.lax.fori_loop(0, num_chunks, body, jnp.zeros((num_rows, block_v), jnp.float32))
            # Exact: entry by entry over the whole tile.
            s_c = common.load_chunks(ckpt_ref, (slot, h, cols), slices)  # [BV, W] chunks
            if per_channel:
                decay = tuple(jnp.exp(jnp.sum(cache_chunk(gcache_ref, (slot, h), c, live_pos), axis=0))
                              for c in range(num_chunks))
            else:
                decay = decay_c
            prev = rebuild_exact(spec, (ucache_ref, kcache_ref, gcache_ref), slot, h, cols, slices, pos,
                                 s_c, decay, unroll)
            return sum(store_and_read(cols, c, x) for c, x in enumerate(prev))

        def finish(cols, z, replayed: bool):
            """Solve and store the tile's window from its readout `z` (before `row_scale`);
            `replayed`: add the cache's term (a folded row has none)."""
            z = z * row_scale[:, None]
            if replayed:
                u_c = plgpu.load(ucache_ref.at[slot, h, entries, cols], mask=live_read, other=0.0)
                z = z + dot(p, u_c.astype(jnp.float32))  # [R, BV]
            v_w = plgpu.load(v_ref.at[b, pl.ds(0, num_rows), h, cols], mask=in_len, other=0.0)
            r = beta_w[:, None] * (v_w.astype(jnp.float32) - z)  # key rows; zero elsewhere
            stacked = jnp.where(win.is_key[:, None], r, z)
            plgpu.store(y_rows(cols), jnp.where(in_len, dot(mix, stacked), 0.0).astype(y_ref.dtype), mask=in_width)
            plgpu.store(ucache_ref.at[slot, h, pl.ds(hist, num_rows), cols],
                        dot(inv, stacked).astype(ucache_ref.dtype), mask=in_len)

        def tile(i, carry):
            cols = pl.ds((first + i) * block_v, block_v)

            # Two branches that each finish the tile, not one `cond` returning the readout:
            # with a branch that writes the checkpoint and returns a value, XLA copied the
            # checkpoint pool under the Pallas interpreter (tests/test_verify_kernel.py).
            @pl.when(fold)
            def _folding():
                finish(cols, folded_readout(cols), replayed=False)

            @pl.when(~fold)
            def _replaying():
                finish(cols, streamed_readout(cols), replayed=True)

            return carry

        jax.lax.fori_loop(0, tiles_per_program, tile, 0)


def verify_decode(
    checkpoint: Float[Array, "N Hv Dv Dk"],
    u_cache: Float[Array, "N Hv L Dv"],
    k_cache: Float[Array, "N Hk L Dk"],
    g_cache: Float[Array, "N Hv L *Dk"],
    q: Float[Array, "B T Hk Dk"],
    k: Float[Array, "B T Hk Dk"],
    v: Float[Array, "B T Hv Dv"],
    g: Float[Array, "B T Hv *Dk"],
    beta: Float[Array, "B T Hv"],
    ancestors: Int[Array, "B T T"],
    slot: Int[Array, " B"],
    pos: Int[Array, " B"],
    mode: Int[Array, " B"],
    length: Int[Array, " B"],
    *,
    use_qk_l2norm: bool = False,
    scale: float | None = None,
    params: VerifyDecodeParams = VerifyDecodeParams(),
    interpret: bool | None = None,
):
    """Outputs of a draft window of T tokens per row, and its u records, in one launch.

    Args:
      checkpoint, u_cache, k_cache, g_cache: the layer's state arrays (checkpoint and u
        cache updated in place when donated; k and g caches only read).
      q, k: `[B, T, H_k, d_k]` raw (normalised in the kernel with `use_qk_l2norm`, q then
        times `scale`); v: `[B, T, H_v, d_v]`.
      g: log-decay `[B, T, H_v]` (GDN) or `[B, T, H_v, d_k]` (KDA); beta: `[B, T, H_v]`.
      ancestors: `[B, T, T]` int, nonzero where window position j is a strict ancestor of
        position i (`j < i` everywhere for a chain).
      slot: `[B]` int32 slot of each row (any valid index on padding rows).
      pos: `[B]` int32 valid cache entries of the row's slot.
      mode: `[B]` int32, `common.MODE_PAD` (zero outputs, nothing else touched),
        `MODE_APPEND` (records at `pos ..`) or `MODE_FLUSH` (fold the history into the
        checkpoint first; records at `0 ..`). The caller makes sure records fit the ring.
      length: `[B]` int32 in [0, T]: positions at and past it are padding (output 0,
        inputs never read, no record).
      use_qk_l2norm, scale: as in `decode_step` (default scale `d_k^-1/2`).
      params: tile, warps, tiles per program, column chunk, dot precision, fold rebuild,
        pipelining, grid order.
      interpret: run the kernel in the Pallas interpreter (default: off GPU).

    Returns:
      `(y [B, T, H_v, d_v] in v's dtype, checkpoint, u_cache, k_cache, g_cache)`; the
      window's u records at `base .. base + length - 1` (base: `pos`, or 0 when folding).
    """
    batch, width, num_v_heads, head_v_dim = v.shape
    params = common.for_head_dim(params, head_v_dim)
    tiles = head_v_dim // params.block_v
    tiles_per_program = min(params.tiles_per_program, tiles)
    while tiles % tiles_per_program:
        tiles_per_program //= 2
    interpret = common.default_interpret() if interpret is None else interpret
    head_k_dim = q.shape[3]
    chunk = params.column_chunk if 0 < params.column_chunk < head_k_dim else head_k_dim
    kernel = functools.partial(
        _verify_kernel, per_channel=g_cache.ndim == 4, group_size=num_v_heads // q.shape[2],
        use_qk_l2norm=use_qk_l2norm, scale=float(head_k_dim ** -0.5 if scale is None else scale),
        width=width, block_v=params.block_v, tiles_per_program=tiles_per_program,
        chunk=chunk, num_chunks=head_k_dim // chunk, cache_block=cache_block_len(u_cache.shape[2]),
        precision=params.dot_precision, fold_by_dot=params.fold_by_dot, unroll=params.rebuild_unroll,
        grid_order=params.grid_order, interpret=interpret,
    )
    return common.decode_call(
        kernel,
        grid=(batch, num_v_heads, tiles // tiles_per_program),
        inputs=(slot, pos, mode, length, ancestors, q, k, v, g, beta),
        state=(checkpoint, u_cache, k_cache, g_cache),
        y_like=v, num_warps=params.num_warps, num_stages=params.num_stages, grid_order=params.grid_order,
        interpret=interpret, name="replayssm_verify_decode",
    )
