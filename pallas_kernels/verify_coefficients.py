"""A verify window's scalars (GDN, KDA, Mamba-2) and staged vectors in one launch (Pallas Triton).

The Mosaic GPU verify kernel (`mosaic_gpu.verify_decode`) takes, per `(row, value head)`, a
record of the window's `T x T` products, decays and norms, and per `(row, key head)` the
window's raw q and k staged as one operand. XLA forms them in about eight small kernels (a
product, reductions, transposes, a pad, a concatenate), which at small batches take as long
as the verify kernel itself. This kernel forms both in one launch, grid `(B, H_k)`: one
program per (row, key head) loads the window's T q and k vectors once and writes the records
of the key head's `H_v / H_k` value heads.

Record of `(b, h)` (fp32, `record_len` floats, the layout `verify_decode.pack_coefficients`
defines): `A [T, T]`, `M [T, T]` row-major, then `e^{G} [T]`, `beta [T]`, `g [T]`,
`q_scale [T]`, `k_scale [T]`, then zeros, where, for i, j below the row's length,

    A_ij = beta_i e^{G_i - G_j} (k_i . k_j) k_scale_i k_scale_j   for j in anc(i), else 0
    M_ij = e^{G_i - G_j} (q_i . k_j) q_scale_i k_scale_j           for j in anc(i) + {i}, else 0
    G_i  = sum of g_j over j in anc(i) + {i}

with q_scale = scale / |q| and k_scale = 1 / |k| (`use_qk_l2norm`; else scale and 1), and
zeros at and past the row's length (the inputs there, NaN included, never reach a product).
Staged vectors of `(b, hk)` (`[N, d_k]` in q's dtype, `verify_decode.window_vectors`' layout):
the raw q_0 .. q_{T-1}, k_0 .. k_{T-1} with zero rows at and past the length, then zero rows.

The GDN program stacks the window as one `[R, d_k]` block X, q_t in row t and k_t in row
T + t, zero rows past them (R the next power of two >= 2T, at least 16 for 2-byte q and k:
a tensor-core dot's M). One dot, X X^T `[R, R]` in fp32, holds every product: its q.k
block (rows < T) gives M, its k.k block (rows T .. 2T-1) A, its diagonal the norms (fp32 q
and k: a CUDA-core dot in IEEE fp32, in chunks of channels). Each record is then `[R, R]`
and `[R]` element-wise work and one masked store per block (integer-array offsets): the
columns T .. 2T-1 of rows 0 .. 2T-1 are M's and A's entries; the staged vectors are X's
rows, stored as they are loaded. Lanes outside the window or at and past the length are
masked on every load and store.

The KDA program works on `[P, d_k]` and `[P]` blocks, P the next power of two >= T (Triton's
block shapes), one position at a time: rows and lanes at and past T are masked on every
load and store.

Both programs also write their key head's `k_scale [T]` into `key_scales [B, T, H_k]`
(zeros at and past the length): the factors that scale the window's key records, in the
order of the records themselves, so the wrapper's scatter takes them without a transpose
of the records' lanes (a launch of its own in XLA).

Every window kernel (GDN, KDA, Mamba-2) takes the step's rows as its caller holds them:
`slots [B]` (negative or >= N: a padding row), the pool's `cursors [N]` and the requested
`lengths [B]`. It forms each row's slot, cursor and length (`common.verify_rows`), and the
row's first program stores them: the kernels after it read them from there, with no XLA
launch of their own to form them.

With `history=g_cache` the GDN program also writes each of its value heads' history
weights (`verify_decode.history_weights`' record, `[history_len]` fp32): `W_j =
e^{sum_{j<i<pos} g_i}` for each cache entry j < pos (0 at and past it), `e^{sum_{i<pos} g_i}`
at index L, then zeros; the suffix sums as one running sum over the records newest first
(a Triton scan over L' lanes, L' the next power of two >= L). The verify kernel then reads
one weight per entry instead of forming the decays in every tile, with no launch of its own.

`kda_verify_coefficients` is the same for a KDA window (per-channel decays): its records
(`A`, `M`, beta and the norms), the key scales and the decays `e^{G}` `[B, T, H_v, d_k]`
that the KDA verify kernel takes, in place of XLA's channel sums over `[B, T, T, H_v, d_k]`.
`mamba2_verify_coefficients` forms a Mamba-2 window's records (`M`, `e^{A Gamma}`, dt) and
its gated time steps, grid `(B, H)`, in place of XLA's softplus, products, masks and pad.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
from jaxtyping import Array, Bool, Float, Int

from pallas_kernels import common
from pallas_kernels.common import L2NORM_EPS

VECTORS = 5  # e^{G}, beta, g, q_scale, k_scale per position, after A and M (`verify_decode.GDN_VECTORS`)
KDA_VECTORS = 3  # beta, q_scale, k_scale per position (`verify_decode_kda.KDA_VECTORS`)
MAMBA2_VECTORS = 2  # e^{A Gamma}, dt per position, after M (`verify_decode_mamba2.MAMBA2_VECTORS`)
LOG2E = 1.4426950408889634  # log2(e): the GDN program's exponentials are exp2s


@dataclasses.dataclass(frozen=True)
class VerifyCoefficientsParams:
    """Launch parameters of `verify_coefficients`.

    Attributes:
      num_warps: warps per program (a GDN program's blocks are `[R, d_k]` and `[R, R]`, a
        KDA program's `[P, d_k]`: one or two warps cover them).
    """

    num_warps: int = 2

    def __post_init__(self) -> None:
        if isinstance(self.num_warps, bool) or self.num_warps not in (1, 2, 4, 8):
            raise ValueError(f"num_warps must be 1, 2, 4 or 8, got {self.num_warps!r}")


def _lane_vector(values, lanes):
    """`[P]` with `values[i]` (scalars) at lane i and zeros elsewhere."""
    out = jnp.zeros(lanes.shape, jnp.float32)
    for i, x in enumerate(values):
        out = jnp.where(lanes == i, x, out)
    return out


def _stacked(vectors, lanes):
    """`[P, d_k]` with row t = `vectors[t]` (`[d_k]`) and zero rows past them."""
    out = jnp.zeros((lanes.shape[0], vectors[0].shape[0]), jnp.float32)
    for t, x in enumerate(vectors):
        out = jnp.where(lanes[:, None] == t, x[None, :], out)
    return out


class _Window(NamedTuple):
    """A program's view of its row's window: `length`, `lanes` `[P]`, the raw q, k `[d_k]`
    per position (fp32, zero at and past the length) and their norm factors (scalars, zero
    there)."""

    length: jax.Array
    lanes: jax.Array
    qs: list
    ks: list
    q_scale: list
    k_scale: list


def _load_window(length, q_ref, k_ref, b, hk, *, width, lanes_len, use_qk_l2norm, scale) -> _Window:
    T = width
    # The window's vectors, zero at and past the length (a select: NaN there stays out).
    qs = [jnp.where(t < length, q_ref[b, t, hk, :].astype(jnp.float32), 0.0) for t in range(T)]
    ks = [jnp.where(t < length, k_ref[b, t, hk, :].astype(jnp.float32), 0.0) for t in range(T)]

    def inv_norm(x):
        return jax.lax.rsqrt(jnp.sum(x * x) + L2NORM_EPS) if use_qk_l2norm else jnp.float32(1.0)

    q_scale = [jnp.where(t < length, scale * inv_norm(qs[t]), 0.0) for t in range(T)]
    k_scale = [jnp.where(t < length, inv_norm(ks[t]), 0.0) for t in range(T)]
    return _Window(length, jnp.arange(lanes_len, dtype=jnp.int32), qs, ks, q_scale, k_scale)


def _branches(anc_ref, b, window: _Window, width: int):
    """`(strict, seen)`: per position i the lanes j of its strict ancestors and of its branch
    with i itself, both within the row's length (`[P]` bool each)."""
    lanes, length = window.lanes, window.length
    valid = lanes < length  # length <= T, so lanes >= T are never valid
    in_row = lambda i: jnp.logical_and(valid, i < length)
    anc = [plgpu.load(anc_ref.at[b, jnp.int32(i), pl.ds(0, lanes.shape[0])], mask=lanes < width, other=0) != 0
           for i in range(width)]
    strict = [jnp.logical_and(anc[i], in_row(i)) for i in range(width)]
    seen = [jnp.logical_and(jnp.logical_or(anc[i], lanes == i), in_row(i)) for i in range(width)]
    return strict, seen


def _record_stores(coef_ref, b, window: _Window, width: int):
    """`(store(h, offset, x[P], mask), finish(h, vectors))` for the records of row b:
    `finish` stores the per-position vectors after the two `T x T` blocks, then zeros to
    the record's end. A record's last P-lane stores can reach past its end, where the mask
    keeps them: their offsets are traced values (a zero the tracer cannot prove), since a
    static slice past the end is refused at trace time."""
    T, lanes, record_len = width, window.lanes, coef_ref.shape[2]
    P, row_mask = lanes.shape[0], lanes < width
    zero = jnp.minimum(window.length, 0)

    def store(h, offset, x, mask=row_mask):
        plgpu.store(coef_ref.at[b, h, pl.ds(zero + offset, P)], x, mask=mask)

    def finish(h, vectors):
        for o, x in enumerate(vectors):
            store(h, 2 * T * T + o * T, x, jnp.logical_and(row_mask, lanes < record_len - 2 * T * T - o * T))
        for start in range(2 * T * T + len(vectors) * T, record_len, P):
            store(h, start, jnp.zeros((P,), jnp.float32), lanes < record_len - start)

    return store, finish


def _window_rows(length, lanes, width: int):
    """`(pos, valid)` `[R]` of the stacked block's rows (q_t in row t, k_t in row T + t): the
    position t of each row (0 past 2T, an in-bounds index for the masked lanes) and whether
    it is below the row's length. The static bound `lanes < 2T` lets the compiler drop the
    lanes past the window."""
    in_window = lanes < 2 * width
    pos = jnp.where(in_window, jnp.where(lanes < width, lanes, lanes - width), 0)
    return pos, in_window & (pos < length)


def _stacked_window(q_ref, k_ref, b, hk, pos, valid, is_q, cols):
    """X `[R, K]` in q's dtype, channels `cols` `[1, K]`: q_t in row t, k_t in row T + t,
    zero rows at and past the length and past 2T (masked loads: nothing there, NaN
    included, is read)."""
    shape = (pos.shape[0], cols.shape[1])

    def load(ref, mask):
        return plgpu.load(ref.at[b, pos[:, None], hk, cols], mask=jnp.broadcast_to(mask[:, None], shape), other=0)

    return jnp.where(is_q[:, None], load(q_ref, valid & is_q), load(k_ref, valid & ~is_q))


def _stage_vectors(vec_ref, b, hk, x, cols):
    """`vec_ref[b, hk, :, cols]` `[N, K]`: X's rows (q, k, then zeros), zero rows past R.
    Masked lanes address row N, past the block: the interpreter writes every lane and drops
    only those out of bounds, so they never land on another lane's row."""
    R, N = x.shape[0], vec_ref.shape[2]
    lanes = jnp.arange(R, dtype=jnp.int32)
    for first in range(0, N, R):
        inside = first + lanes < N
        rows = jnp.where(inside, first + lanes, N)[:, None]
        plgpu.store(vec_ref.at[b, hk, rows, cols], x if first == 0 else jnp.zeros_like(x),
                    mask=jnp.broadcast_to(inside[:, None], x.shape))


def _window_gram(q_ref, k_ref, vec_ref, b, hk, pos, valid, is_q, chunk: int):
    """`[R, R]` fp32 X X^T, staging X's rows on the way (unless `vec_ref` is None), one dot
    per `chunk` channels. A 2-byte X is one tensor-core dot (exact products, fp32 sums);
    fp32 X a CUDA-core one in IEEE fp32 (the default precision would be TF32)."""
    gram = None
    for first in range(0, q_ref.shape[3], chunk):
        cols = first + jnp.arange(chunk, dtype=jnp.int32)[None, :]
        x = _stacked_window(q_ref, k_ref, b, hk, pos, valid, is_q, cols)
        if vec_ref is not None:
            _stage_vectors(vec_ref, b, hk, x, cols)
        part = jax.lax.dot_general(x, x, (((1,), (1,)), ((), ())), precision=jax.lax.Precision.HIGHEST,
                                   preferred_element_type=jnp.float32)
        gram = part if gram is None else gram + part
    return gram


def _gram_blocks(width: int, channels: int, dtype, num_warps: int) -> tuple[int, int]:
    """`(R, chunk)` of `_window_gram`: X's rows, the window's two vectors a position stacked
    (a power of two: Triton's blocks), and the channels of each dot. 2-byte X is one
    tensor-core dot, whose M is at least 16; fp32 X a CUDA-core dot (IEEE fp32) with its
    operands in registers: chunks of channels keep each to 16 floats a thread (32 a warp)."""
    lanes_len = common.next_power_of_two(2 * width)
    if jnp.dtype(dtype).itemsize == 2:
        return max(common.MIN_DOT_DIM, lanes_len), channels
    return lanes_len, min(channels, max(common.MIN_DOT_DIM, 16 * 32 * num_warps // lanes_len))


def _scales(gram, valid, factor, use_qk_l2norm: bool, axis: int):
    """`[R]` fp32 `factor / |x_r|` (`factor` alone without the L2 norm) on valid lanes, zeros
    elsewhere; |x_r|^2 is the Gram's diagonal, reduced over `axis` (1 gives the layout of
    the Gram's rows, 0 of its columns: both are used, with no conversion between them)."""
    if use_qk_l2norm:
        lanes = jnp.arange(gram.shape[0], dtype=jnp.int32)
        squares = jnp.sum(jnp.where(lanes[:, None] == lanes[None, :], gram, 0.0), axis=axis)
        factor = factor * jax.lax.rsqrt(squares + L2NORM_EPS)
    return jnp.where(valid, factor, 0.0)


def _record_blocks(anc_ref, b, pos, valid, width: int):
    """`(in_record, seen, keep)` `[R, R]` bool over the Gram's rows r (positions `pos`) and
    columns c: `in_record` the entries that are M's (r < T) and A's (T <= r < 2T) with the
    keys in columns T .. 2T-1; `seen` c's position on r's branch, r's own included; `keep`
    the entries each matrix holds (M: anc(i) + {i}, A: anc(i)). Both are within the row's
    length; the ancestry is one masked load."""
    lanes = jnp.arange(pos.shape[0], dtype=jnp.int32)
    r, c = lanes[:, None], lanes[None, :]
    in_record = (r < 2 * width) & (c >= width) & (c < 2 * width)
    anc = plgpu.load(anc_ref.at[b, pos[:, None], pos[None, :]], mask=in_record, other=0) != 0
    both = in_record & valid[:, None] & valid[None, :]
    same = pos[:, None] == pos[None, :]
    return in_record, (anc | same) & both, (anc | (same & (r < width))) & both


def _record_offsets(in_record, width: int, record_len: int):
    """`[R, R]` int32: the record offset of each entry of `in_record` (M_ij at T^2 + i T + j,
    A_ij at i T + j), and `record_len`, past the record, elsewhere (the interpreter drops
    out-of-bounds lanes; any other offset could land on a stored entry)."""
    lanes = jnp.arange(in_record.shape[0], dtype=jnp.int32)
    r, c = lanes[:, None], lanes[None, :]
    row = jnp.where(r < width, width * width + r * width, (r - width) * width)
    return jnp.where(in_record, row + c - width, record_len)


def _exp(x):
    """e^x as 2^{x log2 e}: the hardware's exp2 in place of expf's range reduction. The
    product's rounding costs at most |x| 2^-24 relative, under 6e-6 where e^x is normal."""
    return jnp.exp2(x * LOG2E)


def _store_lanes(coef_ref, b, h, start, x, count: int):
    """`x[:count]` (`[R]`) at record offsets `start ..`; masked lanes address past the record."""
    lanes = jnp.arange(x.shape[0], dtype=jnp.int32)
    inside = lanes < count
    plgpu.store(coef_ref.at[b, h, jnp.where(inside, start + lanes, coef_ref.shape[2])], x, mask=inside)


def _store_key_scales(kscale_ref, b, hk, scales, lanes, width: int, first: int):
    """`kscale_ref[b, :, hk]` `[T]`: the k_scale lanes `first .. first + T - 1` of
    `scales`; the other lanes are masked and address position T, past the block (as
    `_stage_vectors`' rows)."""
    is_k = (lanes >= first) & (lanes < first + width)
    plgpu.store(kscale_ref.at[b, jnp.where(is_k, lanes - first, width), hk], scales, mask=is_k)


def _gate_records(gcache_ref, h, slot, pos):
    """`(newer, first)`: head h's gate records of `slot` newest first as `[L']` lanes (L' the
    next power of two >= L), shifted by one lane (lane k holds `g_{L'-k}`, lane 0 none), so
    that their running sum at lane k is `sum_{j<i<pos} g_i` for `j = L' - 1 - k`; and entry
    0's record, the one `newer` leaves out. Entries at and past `pos` (stale, NaN included)
    are masked to zero."""
    lanes = jnp.arange(common.next_power_of_two(gcache_ref.shape[2]), dtype=jnp.int32)
    src = lanes.shape[0] - lanes
    valid = (lanes > 0) & (src < pos)  # pos <= L
    newer = plgpu.load(gcache_ref.at[slot, h, jnp.where(valid, src, 0)], mask=valid, other=0)
    first = jnp.where(pos > 0, gcache_ref[slot, h, 0].astype(jnp.float32), 0.0)
    return newer.astype(jnp.float32), first


def _store_history_weights(weights_ref, b, h, newer, first, pos, cache_len: int):
    """Head h's history weights of row b (module doc) from its masked gate records
    (`_gate_records`): the suffix sums as one running sum (a scan of log2(L') steps) over
    the newest-first records, stored to their entries in reverse lane order."""
    lanes = jnp.arange(newer.shape[0], dtype=jnp.int32)
    entry = newer.shape[0] - 1 - lanes  # the ring entry j of lane k
    after = jnp.cumsum(newer)  # sum_{j<i<pos} g_i
    inside = entry < cache_len
    plgpu.store(weights_ref.at[b, h, jnp.where(inside, entry, weights_ref.shape[2])],
                jnp.where(entry < pos, _exp(after), 0.0), mask=inside)
    total = jnp.where(lanes == 0, _exp(jnp.sum(newer) + first), 0.0)  # e^G, then zeros
    _store_lanes(weights_ref, b, h, cache_len, total, weights_ref.shape[2] - cache_len)


def _row(slots_ref, cursors_ref, lengths_ref, b):
    """Row b's `(slot, pos, length)` scalars, `common.verify_rows`' rule: a slot outside
    [0, N) pads the row (slot, cursor and length 0)."""
    requested = slots_ref[b]
    valid = (requested >= 0) & (requested < cursors_ref.shape[0])
    slot = jnp.where(valid, requested, 0)
    return slot, jnp.where(valid, cursors_ref[slot], 0), jnp.where(valid, lengths_ref[b], 0)


def _store_row(row_refs, b, hk, row) -> None:
    """Row b's `(slot, pos, length)` into the rows' outputs, by the row's first program."""

    @pl.when(hk == 0)
    def _store():
        for ref, x in zip(row_refs, row):
            ref[b] = x.astype(jnp.int32)


def _kernel(slots_ref, cursors_ref, lengths_ref, q_ref, k_ref, g_ref, beta_ref, anc_ref, *refs, width, group_size,
            use_qk_l2norm, scale, lanes_len, chunk, history):
    # refs: `[g_cache]` with `history`, then the records, the staged vectors, the key
    # scales, with `history` the weights, then the rows' slot, cursor and length.
    *refs, slot_out, pos_out, length_out = refs
    if history:
        gcache_ref, coef_ref, vec_ref, kscale_ref, weights_ref = refs
    else:
        coef_ref, vec_ref, kscale_ref = refs
    b, hk = pl.program_id(0), pl.program_id(1)
    row_slot, row_pos, row_length = row = _row(slots_ref, cursors_ref, lengths_ref, b)
    _store_row((slot_out, pos_out, length_out), b, hk, row)
    T, R, record_len = width, lanes_len, coef_ref.shape[2]
    lanes = jnp.arange(R, dtype=jnp.int32)
    is_q = lanes < T
    pos, valid = _window_rows(row_length, lanes, T)
    # The gate records first: their loads are in flight while the window's products run.
    # A padding row reads slot 0's (cursor 0: every record masked); the verify kernel skips it.
    records = ([_gate_records(gcache_ref, hk * group_size + v, row_slot, row_pos)
                for v in range(group_size)] if history else [])
    gram = _window_gram(q_ref, k_ref, vec_ref, b, hk, pos, valid, is_q, chunk)
    # q_scale in rows < T, k_scale in rows T .. 2T-1, as rows and as columns of the Gram.
    factor = jnp.where(is_q, scale, 1.0)
    scales = _scales(gram, valid, factor, use_qk_l2norm, 1)
    normed = gram * (scales[:, None] * _scales(gram, valid, factor, use_qk_l2norm, 0)[None, :])
    _store_key_scales(kscale_ref, b, hk, scales, lanes, T, first=T)
    in_record, seen, keep = _record_blocks(anc_ref, b, pos, valid, T)
    offsets = _record_offsets(in_record, T, record_len)
    base = 2 * T * T  # the per-position vectors, after A and M
    for v in range(group_size):
        h = hk * group_size + v
        g_vec = plgpu.load(g_ref.at[b, pos, h], mask=valid, other=0).astype(jnp.float32)
        beta = plgpu.load(beta_ref.at[b, pos, h], mask=valid, other=0).astype(jnp.float32)
        # G of each row's position, summed over the key columns on its branch.
        G = jnp.sum(jnp.where(seen, g_vec[None, :], 0.0), axis=1)
        # e^{G_i - G_j} only on i's branch (<= 1 there); elsewhere the difference can be
        # large and positive, so it is zeroed before the exponential.
        decay = jnp.where(seen, _exp(jnp.where(seen, G[:, None] - G[None, :], 0.0)), 0.0)
        weight = jnp.where(is_q, 1.0, beta)  # A's rows carry beta_i, M's none
        plgpu.store(coef_ref.at[b, h, offsets], jnp.where(keep, decay * normed * weight[:, None], 0.0),
                    mask=in_record)
        # e^{G} then beta, g, then q_scale and k_scale: each a run of X's rows' lanes.
        _store_lanes(coef_ref, b, h, base, jnp.where(is_q, jnp.where(valid, _exp(G), 0.0), beta), 2 * T)
        _store_lanes(coef_ref, b, h, base + 2 * T, g_vec, T)
        _store_lanes(coef_ref, b, h, base + 3 * T, scales, 2 * T)
        for start in range(base + VECTORS * T, record_len, R):
            _store_lanes(coef_ref, b, h, start, jnp.zeros((R,), jnp.float32), record_len - start)
        if history:
            _store_history_weights(weights_ref, b, h, *records[v], row_pos, gcache_ref.shape[2])


def _launch(body, q, k, g, beta, anc, rows: tuple, more_outs: tuple, *, vectors: int, record_len: int,
            lanes_len: int, use_qk_l2norm: bool, scale: float, params: VerifyCoefficientsParams, interpret, name: str,
            more_operands: tuple = ()):
    """The checks both window kernels share (the rows, the record's length for `vectors`
    per-position scalars, a power-of-two d_k), then one `pallas_call` of `body` over
    `(B, H_k)` with every operand and result in global memory: `(records [B, H_v, C] fp32,
    *more_outs, common.VerifyRows)`; `body` works on `lanes_len`-lane blocks and takes the
    rows `(slots, cursors, lengths)` first. The caller has checked that H_k divides H_v."""
    batch, width, num_k_heads, head_k_dim = q.shape
    num_v_heads = beta.shape[2]
    _check_rows(rows, batch)
    if record_len < 2 * width * width + vectors * width:
        raise ValueError(f"record_len {record_len} is too short for T = {width} "
                         f"(needs {2 * width * width + vectors * width})")
    if head_k_dim & (head_k_dim - 1):
        raise ValueError(f"{name} needs d_k a power of two (Triton blocks), got {head_k_dim}")
    kernel = functools.partial(body, width=width, group_size=num_v_heads // num_k_heads,
                               use_qk_l2norm=bool(use_qk_l2norm), scale=float(scale),
                               lanes_len=lanes_len)
    records_out = jax.ShapeDtypeStruct((batch, num_v_heads, record_len), jnp.float32)
    return _call(kernel, rows, (q, k, g, beta, anc.astype(jnp.int32), *more_operands), (records_out, *more_outs),
                 grid=(batch, num_k_heads), params=params, interpret=interpret, name=name)


def _check_rows(rows: tuple, batch: int) -> None:
    """ValueError unless the rows are `(slots [B], cursors [N], lengths [B])`."""
    slots, cursors, lengths = rows
    if slots.shape != (batch,) or lengths.shape != (batch,) or cursors.ndim != 1:
        raise ValueError(f"the rows must be slots [B], cursors [N] and lengths [B] with B = {batch}, got "
                         f"{slots.shape}, {cursors.shape}, {lengths.shape}")


def _call(kernel, rows: tuple, operands: tuple, outs: tuple, *, grid, params: VerifyCoefficientsParams, interpret,
          name: str):
    """One `pallas_call` of a window kernel over `grid`, every operand and result in global
    memory: the rows `(slots, cursors, lengths)` (int32) then `operands` in, `outs` then
    the rows' slot, cursor and length `[B]` out; returns `(*outs, common.VerifyRows)`."""
    rows = tuple(x.astype(jnp.int32) for x in rows)
    row_outs = (jax.ShapeDtypeStruct(rows[0].shape, jnp.int32),) * 3
    spec = common.any_spec()
    *results, slot, pos, length = pl.pallas_call(
        kernel,
        out_shape=(*outs, *row_outs),
        grid=grid,
        in_specs=[spec] * (len(rows) + len(operands)),
        out_specs=[spec] * (len(outs) + len(row_outs)),
        compiler_params=plgpu.CompilerParams(num_warps=params.num_warps, num_stages=1),
        interpret=common.default_interpret() if interpret is None else interpret,
        name=f"replayssm_{name}",
    )(*rows, *operands)
    return (*results, common.VerifyRows(slot, pos, length))


def verify_coefficients(
    q: Float[Array, "B T Hk Dk"],
    k: Float[Array, "B T Hk Dk"],
    g: Float[Array, "B T Hv"],
    beta: Float[Array, "B T Hv"],
    anc: Bool[Array, "B T T"],
    slots: Int[Array, " B"],
    cursors: Int[Array, " N"],
    lengths: Int[Array, " B"],
    *,
    record_len: int,
    vector_rows: int,
    use_qk_l2norm: bool,
    scale: float,
    history: Float[Array, "N Hv L"] | None = None,
    history_len: int | None = None,
    params: VerifyCoefficientsParams = VerifyCoefficientsParams(),
    interpret: bool | None = None,
) -> tuple[Float[Array, "B Hv C"], Float[Array, "B Hk N Dk"], Float[Array, "B T Hk"],
           Float[Array, "B Hv Lw"] | None, common.VerifyRows]:
    """The window's coefficient records, staged vectors, key scales and history weights
    (module doc), and the step's rows, one launch.

    Args:
      q, k: `[B, T, H_k, d_k]` raw window vectors (d_k a power of two).
      g, beta: `[B, T, H_v]` per-head log-decay and beta of each position.
      anc: `[B, T, T]` bool, `anc[b, i, j]` when j is a strict ancestor of i (a chain:
        j < i).
      slots: `[B]` int, each row's slot (negative or >= N: a padding row, length 0).
      cursors: `[N]` int32, the pool's cursors (in [0, L]).
      lengths: `[B]` int in [0, T], the valid positions each row asks for.
      record_len: C, floats per record (>= 2 T^2 + 5 T).
      vector_rows: N, rows of each staged `[N, d_k]` block (>= 2 T).
      use_qk_l2norm, scale: as the verify kernel's.
      history: optional `g_cache [N, H_v, L]`: the gate records the history weights sum.
      history_len: floats per history record (> L), with `history` only.
      params: warps per program.
      interpret: run in the Pallas interpreter (default: off GPU).

    Returns:
      `(records [B, H_v, C] fp32, vectors [B, H_k, N, d_k] in q's dtype, key_scales
      [B, T, H_k] fp32 (each record's k_scale run, zeros at and past the length), weights
      [B, H_v, history_len] fp32 or None without history, rows)`: `rows` the step's
      `common.VerifyRows` (`common.verify_rows` of slots, cursors and lengths), formed by
      the kernel so that no XLA launch forms them for the kernels after it.
    """
    batch, width, num_k_heads, head_k_dim = q.shape
    if (history is None) != (history_len is None):
        raise ValueError(f"history and history_len come together, got history_len={history_len!r} with "
                         f"history {'absent' if history is None else 'given'}")
    more_operands, more_outs = (), ()
    if history is not None:
        if history.ndim != 3 or history.shape[1] != g.shape[2] or history.shape[0] != cursors.shape[0]:
            raise ValueError(f"history must be g_cache [N, H_v, L] with N = {cursors.shape[0]} (one cursor per "
                             f"slot), H_v = {g.shape[2]}, got {history.shape}")
        if history_len <= history.shape[2]:
            raise ValueError(f"history_len {history_len} must exceed L = {history.shape[2]} (e^G sits at index L)")
        more_operands = (history,)
        more_outs = (jax.ShapeDtypeStruct((batch, g.shape[2], history_len), jnp.float32),)
    if vector_rows < 2 * width:
        raise ValueError(f"vector_rows {vector_rows} is fewer than 2 T = {2 * width}")
    if g.shape[2] % num_k_heads or g.shape != beta.shape or g.shape[:2] != (batch, width):
        raise ValueError(f"g and beta must be [B, T, H_v] with H_k | H_v, got {g.shape}, {beta.shape} "
                         f"for q {q.shape}")
    vectors_out = jax.ShapeDtypeStruct((batch, num_k_heads, vector_rows, head_k_dim), q.dtype)
    key_scales_out = jax.ShapeDtypeStruct((batch, width, num_k_heads), jnp.float32)
    lanes_len, chunk = _gram_blocks(width, head_k_dim, q.dtype, params.num_warps)
    records, vectors, key_scales, *weights, rows = _launch(
        functools.partial(_kernel, chunk=chunk, history=history is not None), q, k, g, beta, anc,
        (slots, cursors, lengths), (vectors_out, key_scales_out, *more_outs), vectors=VECTORS, record_len=record_len,
        lanes_len=lanes_len, use_qk_l2norm=use_qk_l2norm, scale=scale, params=params, interpret=interpret,
        name="verify_coefficients", more_operands=more_operands)
    return records, vectors, key_scales, (weights[0] if weights else None), rows


def _kda_kernel(slots_ref, cursors_ref, lengths_ref, q_ref, k_ref, g_ref, beta_ref, anc_ref, coef_ref, kscale_ref,
                decay_ref, slot_out, pos_out, length_out, *, width, group_size, use_qk_l2norm, scale, lanes_len):
    b, hk = pl.program_id(0), pl.program_id(1)
    T = width
    row = _row(slots_ref, cursors_ref, lengths_ref, b)
    _store_row((slot_out, pos_out, length_out), b, hk, row)
    w = _load_window(row[2], q_ref, k_ref, b, hk, width=width, lanes_len=lanes_len,
                     use_qk_l2norm=use_qk_l2norm, scale=scale)
    length, lanes = w.length, w.lanes
    k_scales = _lane_vector(w.k_scale, lanes)
    _store_key_scales(kscale_ref, b, hk, k_scales, lanes, T, first=0)
    qn = [w.qs[t] * w.q_scale[t] for t in range(T)]
    kn = [w.ks[t] * w.k_scale[t] for t in range(T)]
    keys = _stacked(kn, lanes)  # [P, d_k], row j = normalised k_j
    strict, seen = _branches(anc_ref, b, w, width)
    store, finish = _record_stores(coef_ref, b, w, width)
    for j in range(group_size):
        h = hk * group_size + j
        gs = _stacked([jnp.where(t < length, g_ref[b, t, h, :].astype(jnp.float32), 0.0) for t in range(T)], lanes)
        beta = [jnp.where(t < length, beta_ref[b, t, h].astype(jnp.float32), 0.0) for t in range(T)]
        # G_i [d_k]: the sum of g over i's branch, per channel.
        G = [jnp.sum(jnp.where(seen[i][:, None], gs, 0.0), axis=0) for i in range(T)]
        G_rows = _stacked(G, lanes)
        for i in range(T):
            # e^{G_i - G_j} per channel only on i's branch (<= 1 there); elsewhere the
            # difference can be large and positive, so it is zeroed before the exponential.
            branch = seen[i][:, None]
            decay = jnp.where(branch, jnp.exp(jnp.where(branch, G[i][None, :] - G_rows, 0.0)), 0.0)  # [P, d_k]
            weighted = decay * keys
            kk = jnp.sum(weighted * kn[i][None, :], axis=1)
            qk = jnp.sum(weighted * qn[i][None, :], axis=1)
            store(h, i * T, jnp.where(strict[i], beta[i] * kk, 0.0))
            store(h, T * T + i * T, qk)
            decay_ref[b, i, h, :] = jnp.where(i < length, jnp.exp(G[i]), 0.0)
        finish(h, (_lane_vector(beta, lanes), _lane_vector(w.q_scale, lanes), k_scales))


def kda_verify_coefficients(
    q: Float[Array, "B T Hk Dk"],
    k: Float[Array, "B T Hk Dk"],
    g: Float[Array, "B T Hv Dk"],
    beta: Float[Array, "B T Hv"],
    anc: Bool[Array, "B T T"],
    slots: Int[Array, " B"],
    cursors: Int[Array, " N"],
    lengths: Int[Array, " B"],
    *,
    record_len: int,
    use_qk_l2norm: bool,
    scale: float,
    params: VerifyCoefficientsParams = VerifyCoefficientsParams(),
    interpret: bool | None = None,
) -> tuple[Float[Array, "B Hv C"], Float[Array, "B T Hk"], Float[Array, "B T Hv Dk"], common.VerifyRows]:
    """A KDA window's coefficient records, key scales and per-channel decays (`mosaic_gpu.
    verify_decode_kda.kda_window_coefficients`' layout), one launch, grid `(B, H_k)`.

    Record of `(b, h)` (fp32, `record_len` floats): `A [T, T]`, `M [T, T]`, then `beta [T]`,
    `q_scale [T]`, `k_scale [T]`, then zeros, where, below the row's length,

        A_ij = beta_i sum_c k_i[c] e^{G_i[c] - G_j[c]} k_j[c]   for j in anc(i), else 0
        M_ij = sum_c q_i[c] e^{G_i[c] - G_j[c]} k_j[c]           for j in anc(i) + {i}, else 0
        G_i  = sum of g_j over j in anc(i) + {i}, per channel

    with q, k normalised (`use_qk_l2norm`) and q scaled. Second result: the key scales
    `[B, T, H_k]` (each record's k_scale run, as `verify_coefficients`'); third: `e^{G_i}`
    `[B, T, H_v, d_k]`; fourth: the step's rows (`common.VerifyRows`). Zeros at and past
    each row's length (inputs there, NaN included, never reach a product).

    Args:
      q, k: `[B, T, H_k, d_k]` raw window vectors (d_k a power of two).
      g: `[B, T, H_v, d_k]` activated per-channel log-decays; beta: `[B, T, H_v]`.
      anc, slots, cursors, lengths, use_qk_l2norm, scale, params, interpret: as
        `verify_coefficients`.
      record_len: C, floats per record (>= 2 T^2 + 3 T).
    """
    batch, width, num_k_heads, head_k_dim = q.shape
    num_v_heads = beta.shape[2]
    if (num_v_heads % num_k_heads or g.shape != (batch, width, num_v_heads, head_k_dim)
            or beta.shape[:2] != (batch, width)):
        raise ValueError(f"g must be [B, T, H_v, d_k] and beta [B, T, H_v] with H_k | H_v, got {g.shape}, "
                         f"{beta.shape} for q {q.shape}")
    key_scales_out = jax.ShapeDtypeStruct((batch, width, num_k_heads), jnp.float32)
    decays_out = jax.ShapeDtypeStruct((batch, width, num_v_heads, head_k_dim), jnp.float32)
    return _launch(_kda_kernel, q, k, g, beta, anc, (slots, cursors, lengths), (key_scales_out, decays_out),
                   vectors=KDA_VECTORS, record_len=record_len, lanes_len=max(2, common.next_power_of_two(width)),
                   use_qk_l2norm=use_qk_l2norm, scale=scale, params=params, interpret=interpret,
                   name="kda_verify_coefficients")


def _mamba2_kernel(slots_ref, cursors_ref, lengths_ref, b_ref, c_ref, dt_ref, dt_bias_ref, a_ref, d_ref, anc_ref,
                   coef_ref, dt_out_ref, slot_out, pos_out, length_out, *, width, group_size, lanes_len, chunk,
                   dt_softplus, dt_limit):
    b, h = pl.program_id(0), pl.program_id(1)
    row = _row(slots_ref, cursors_ref, lengths_ref, b)
    _store_row((slot_out, pos_out, length_out), b, h, row)
    T, R, record_len = width, lanes_len, coef_ref.shape[2]
    lanes = jnp.arange(R, dtype=jnp.int32)
    is_c = lanes < T
    pos, valid = _window_rows(row[2], lanes, T)
    # C_i in row i, B_j in row T + j: the Gram's entry (i, T + j) is C_i . B_j.
    gram = _window_gram(c_ref, b_ref, None, b, h // group_size, pos, valid, is_c, chunk)
    raw = plgpu.load(dt_ref.at[b, pos, h], mask=valid, other=0).astype(jnp.float32)
    dt = jnp.where(valid, common.mamba2_time_step(raw + dt_bias_ref[h].astype(jnp.float32), dt_softplus, dt_limit),
                   0.0)
    in_record, seen, _ = _record_blocks(anc_ref, b, pos, valid, T)
    in_m = in_record & (lanes[:, None] < T)  # M's entries: C rows, B columns
    # A Gamma of each row's position: A dt summed over the columns on its branch.
    log_a = jnp.sum(jnp.where(seen, (a_ref[h].astype(jnp.float32) * dt)[None, :], 0.0), axis=1)
    # e^{A (Gamma_i - Gamma_j)} only on i's branch (<= 1 there, A < 0); elsewhere the
    # difference can be large and positive, so it is zeroed before the exponential.
    decay = jnp.where(seen, _exp(jnp.where(seen, log_a[:, None] - log_a[None, :], 0.0)), 0.0)
    skip = jnp.where(seen & (pos[:, None] == pos[None, :]), d_ref[h].astype(jnp.float32), 0.0)
    r, c = lanes[:, None], lanes[None, :]
    offsets = jnp.where(in_m, r * T + c - T, record_len)
    plgpu.store(coef_ref.at[b, h, offsets], jnp.where(in_m, decay * dt[None, :] * gram + skip, 0.0), mask=in_m)
    _store_lanes(coef_ref, b, h, T * T, jnp.where(is_c & valid, _exp(log_a), 0.0), T)
    _store_lanes(coef_ref, b, h, T * T + T, dt, T)
    for start in range(T * T + MAMBA2_VECTORS * T, record_len, R):
        _store_lanes(coef_ref, b, h, start, jnp.zeros((R,), jnp.float32), record_len - start)
    # The time steps in the records' [B, T, H] order; masked lanes address position T.
    plgpu.store(dt_out_ref.at[b, jnp.where(is_c, lanes, T), h], dt, mask=is_c)


def mamba2_verify_coefficients(
    B: Float[Array, "B T G Ns"],
    C: Float[Array, "B T G Ns"],
    dt: Float[Array, "B T H"],
    dt_bias: Float[Array, " H"],
    A: Float[Array, " H"],
    D: Float[Array, " H"],
    anc: Bool[Array, "B T T"],
    slots: Int[Array, " B"],
    cursors: Int[Array, " N"],
    lengths: Int[Array, " B"],
    *,
    record_len: int,
    dt_softplus: bool = True,
    dt_limit: tuple[float, float] = (0.0, float("inf")),
    params: VerifyCoefficientsParams = VerifyCoefficientsParams(),
    interpret: bool | None = None,
) -> tuple[Float[Array, "B H C"], Float[Array, "B T H"], common.VerifyRows]:
    """A Mamba-2 window's coefficient records (`mosaic_gpu.verify_decode_mamba2.
    mamba2_window_coefficients`' layout), its time steps and the step's rows, one launch,
    grid `(B, H)`.

    Record of `(b, h)` (fp32, `record_len` floats): `M [T, T]`, then `e^{A Gamma} [T]`,
    `dt [T]`, then zeros, where, below the row's length,

        M_ij = e^{A_h (Gamma_i - Gamma_j)} dt_j (C_i . B_j) + D_h [i = j]   for j in anc(i) + {i}, else 0
        Gamma_i = sum of dt_j over j in anc(i) + {i}

    with `dt = clip(softplus(dt_raw + dt_bias), *dt_limit)` (no softplus when `dt_softplus`
    is False), formed here. Each program stacks its group's C_i and B_j as one `[R, N]`
    block and takes every `C_i . B_j` from one dot, as `verify_coefficients` does q and k.

    Args:
      B, C: `[B, T, G, N]` the window's B and C (one dtype; N a power of two).
      dt: `[B, T, H]` raw time steps; dt_bias, A, D: `[H]`.
      anc, slots, cursors, lengths, params, interpret: as `verify_coefficients`.
      record_len: C, floats per record (>= T^2 + 2 T).
      dt_softplus, dt_limit: the time step's gating.

    Returns:
      `(records [B, H, C] fp32, dt [B, T, H] fp32 (the gated time steps, zeros at and past
      each row's length), rows)`: zeros at and past each row's length (inputs there, NaN
      included, never reach a product); `rows` as `verify_coefficients`'.
    """
    batch, width, num_groups, state_size = B.shape
    heads = dt.shape[2]
    if C.shape != B.shape or C.dtype != B.dtype:
        raise ValueError(f"B and C must share a shape and dtype, got {B.shape} {B.dtype} and {C.shape} {C.dtype}")
    if dt.shape[:2] != (batch, width) or heads % num_groups:
        raise ValueError(f"dt must be [B, T, H] with G | H, got {dt.shape} for B {B.shape}")
    for name, x in (("dt_bias", dt_bias), ("A", A), ("D", D)):
        if x.shape != (heads,):
            raise ValueError(f"{name} must be [H] = {(heads,)}, got {x.shape}")
    _check_rows((slots, cursors, lengths), batch)
    if record_len < width * width + MAMBA2_VECTORS * width:
        raise ValueError(f"record_len {record_len} is too short for T = {width} "
                         f"(needs {width * width + MAMBA2_VECTORS * width})")
    if state_size & (state_size - 1):
        raise ValueError(f"mamba2_verify_coefficients needs N a power of two (Triton blocks), got {state_size}")
    lanes_len, chunk = _gram_blocks(width, state_size, B.dtype, params.num_warps)
    kernel = functools.partial(_mamba2_kernel, width=width, group_size=heads // num_groups, lanes_len=lanes_len,
                               chunk=chunk, dt_softplus=bool(dt_softplus),
                               dt_limit=tuple(float(x) for x in dt_limit))
    outs = (jax.ShapeDtypeStruct((batch, heads, record_len), jnp.float32),
            jax.ShapeDtypeStruct((batch, width, heads), jnp.float32))
    return _call(kernel, (slots, cursors, lengths), (B, C, dt, dt_bias, A, D, anc.astype(jnp.int32)), outs,
                 grid=(batch, heads), params=params, interpret=interpret, name="mamba2_verify_coefficients")
