"""Speculative verify of a GDN draft window on Mosaic GPU (`plgpu.kernel`), one launch per step.

Grid `(B, H_v * d_v / BV)`, one warpgroup per CTA, BV = 64: CTA (b, h, t) serves value rows
`t*BV .. t*BV + BV - 1` of value head h of row b for all T window positions; or, with
`MosaicReplayParams.programs = n`, n persistent programs serve chunks of the tiles dealt
round robin from two stages of shared buffers, the next tile's copies in flight
(`pipeline.serve_tiles`, as the decode kernels; a key head's tiles compute the window's
`K k_i`, `K q_i` once, `window_keys`), one per CTA or `MosaicReplayParams.warpgroups` per
CTA. The caller gives the step's rows as it holds them: `slots [B]` (negative or >= N: a
padding row), the pool's `cursors [N]` and the window `lengths [B]`; each row's slot,
cursor `pos` and length (`common.verify_rows`) come from the window kernel, which forms
them in-kernel (or from XLA for the window formed there). `anc [B, T, T]` says which
window positions precede each position on its branch (a chain or a tree).

Math (as `replayssm_jax.speculative`, GDN: per-head decays, so every exponential is a
scalar). With S the row's live state before the window, G_i the sum of g over position i's
ancestors and i, and q_i, k_i after the L2 norm and the scale:

    R_i  = beta_i (v_i - e^{G_i} S k_i)
    u_i  = R_i - sum_{j in anc(i)} beta_i e^{G_i - G_j} (k_i . k_j) u_j      (forward substitution)
    y_i  = e^{G_i} S q_i + sum_{j in anc(i) + {i}} e^{G_i - G_j} (q_i . k_j) u_j

The scalars of these sums (the `T x T` products, decays and norms: `window_coefficients`,
a few small XLA ops on `[B, T, H, d_k]` inputs, or with `MosaicReplayParams.window_side =
"kernel"` one Pallas Triton launch, `pallas_kernels.verify_coefficients`, which also stages
the vectors and forms the history weights below) arrive packed per (row, value head); the
kernel applies them to vectors. The key sums `K k_i`, `K q_i` over the ring are computed
once per key-head group on a fresh tile (`window_keys`) or, with `MosaicReplayParams.
key_side = "xla"`, before the launch by a kernel of their own on tensor cores
(`window_key_values`: each tile copies its `[2T, L]` box of them in place of the key
records, which only a tensor-core fold then fetches).
`S x` is read out as in `replay_decode` without forming S: `e^G S_c x + U^T (W * (K x))`
over the row's `pos` valid cache entries (W and e^G per (row, value head) formed before the
launch, `history_weights` or the window kernel; WGMMA-layout row and column reductions,
records loaded transposed from swizzled buffers; entries at and past `pos` are masked with
selects before any product). The checkpoint tile and the records are read once for all 2T vectors.
The tile's part `S_c x` is a row reduction per vector (`MosaicReplayParams.readout = "fma"`,
default) or, with "mma", one product `S_c X^T` for all 2T raw bf16 vectors on tensor cores
(`tile_products`; the raw vectors staged by XLA, `window_vectors`).

Row modes (`window_mode` of the cursor and length, derived in the kernels):
- `MODE_APPEND`: the window's records go to `pos .. pos + length - 1`; the checkpoint is
  not written.
- `MODE_FLUSH` (the capacity rule folds the row): the live state S is rebuilt on chip
  from the checkpoint tile in registers, in exact fp32 (`MosaicReplayParams.rebuild =
  "exact"`: newest entry first with the history's weights, `replay_decode.rebuild_weighted`,
  from untiled record copies) or on tensor cores
  (`rebuild.rebuild_mma`: "3xtf32" within ~1e-7 normwise of it, or the opt-in "tf32" /
  "bf16"; with the key sums before the launch, from the key records it copies), rounded to
  the checkpoint's dtype and stored in place (what the fold reads besides the tile is
  fetched once `S_c` is in registers or, with `MosaicReplayParams.prefetch_folds`, copied
  with the tile into buffers of each stage's own, or, with `MosaicReplayParams.group_folds`,
  the u records with the tile into the stage's u buffer and the key records once per
  key-head group into one buffer per CTA, a tile ahead); the window is
  read out from that stored value (so its records agree with what the next step replays)
  and its u and gate records go to `0 .. length - 1` (the fold reads the history's gates
  as the weights formed before the launch, never the gate records). The kernel does not
  write a folding row's key records: other CTAs of the same slot may still be reading the
  history they would overwrite (the wrapper writes them after the launch,
  `append_records`). It sets a folding row's cursor to 0 in place (no kernel
  reads the cursors after the window kernel).
- `MODE_PAD`: y = 0, nothing written.
Window positions at and past `length` give y = 0 and no records; their inputs are replaced
by zeros before use, so garbage there (NaN included) reaches nothing.

Writes in place (`jax.new_ref`): u records `[L, BV]` rows of this tile; g records (tile 0)
of live rows and, with readout "fma", the appending rows' k records (tile 0 of each key
head's first value head; with "mma" no key is in registers, and XLA writes every live
row's k records after the launch, `append_records`); the folded checkpoint tile; a
folding row's cursor (tile 0 of head 0). y `[B, T, H_v, d_v]` leaves through shared memory
and one TMA copy.

KDA (per-channel decay) has its own kernel, `verify_decode_kda.py`, sharing this file's
window preparation, coefficient packing and per-position solve; so has Mamba-2
(`verify_decode_mamba2.py`: no solve, its coefficient packing and row handling).
"""

from __future__ import annotations

import functools
import operator

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
from jaxtyping import Array, Bool, Float, Int

from pallas_kernels.common import L2NORM_EPS, MODE_APPEND, MODE_FLUSH, MODE_PAD, VerifyRows, set_records, verify_rows
from pallas_kernels.mosaic_gpu.build import build_kernel
from pallas_kernels.mosaic_gpu.layouts import (BLOCK_ROWS, COL, F32, ROW, WGMMA, bcast_cols, bcast_rows, check_smem,
                                               col_sum, copy_record_rows, copy_replay_tile, load_transposed,
                                               record_copies, replay_scratch, row_sum, smem_bytes,
                                               tiled)
from pallas_kernels.mosaic_gpu.pipeline import (STAGES, group_shared, kernel_scratch, launch_order_input,
                                                programs_that_fit, serve_tiles, tile_buffers, tile_grid)
from pallas_kernels.mosaic_gpu.readout import (column, split_bf16, stage_vectors, summed_products, tile_parts,
                                               tile_products, vector_rows)
from pallas_kernels.mosaic_gpu.rebuild import check_rebuild, rebuild_operands
from pallas_kernels.mosaic_gpu.replay_decode import (MosaicReplayParams, check_fma_readout, check_mma_readout,
                                                     check_own_layout, check_shapes, qk_scales, rebuild_tensor_cores,
                                                     rebuild_weighted)
from pallas_kernels.verify_coefficients import VECTORS, VerifyCoefficientsParams, verify_coefficients

KEY_CHUNK = 64  # columns of the key sums' ring and vector copies (`window_key_values`): d_k's unit
MAX_WIDTH = 16  # the window is unrolled in the kernel: code size grows as T^2
# Persistent CTAs resident per SM at most (`pipeline.ctas_per_sm`): ptxas gives this kernel
# 222 (exact folds) and 242 (3xTF32) registers per thread at fp32, L = 16, T = 4 (H200).
RESIDENT_CTAS = 2


def window_mode(pos, length, cache_len: int):
    """A verify row's `common.MODE_*` from its cursor and window length (arrays, or a
    kernel's scalars): `MODE_PAD` at length 0 (a padding row, or one with no position to
    verify: either writes nothing and outputs zeros), `MODE_FLUSH` where the ring cannot
    hold the history and the window (`pos + length > L`, the capacity rule), else
    `MODE_APPEND`. The kernels derive it from what they read anyway, so no `[B]` mode
    buffer is formed before the launch."""
    return jnp.where(length == 0, MODE_PAD, jnp.where(pos + length > cache_len, MODE_FLUSH, MODE_APPEND))


def select_if(flag, x, layout, other=0.0):
    """x where the scalar `flag` holds, else `other` (a select: NaN in x stays out). The
    predicate is a vector in x's layout: Mosaic selects do not broadcast a scalar one."""
    n = x.shape[0]
    mask = plgpu.broadcasted_iota(jnp.int32, (n,), 0, layout=layout) < jnp.where(flag, n, 0)
    return jnp.where(mask, x, other)


# e^{G}, beta, g, q_scale, k_scale per position: the record layout both window paths write.
GDN_VECTORS = VECTORS
# A history-weights record `[L + HISTORY_PAD]` (`history_weights`): the L weights, e^G, zeros
# (a TMA copy moves whole 16-byte units).
HISTORY_PAD = 4
# A record is copied as `[C / COEF_LANES, COEF_LANES]`: a TMA box takes at most 256 elements
# along each dimension, which a flat record passes from T = 11 on.
COEF_LANES = 16


def coefficient_count(width: int, vectors: int = GDN_VECTORS, matrices: int = 2) -> int:
    """C, the length of one `(row, value head)` record of `window_coefficients` (`matrices`
    `T x T` blocks, GDN's `A` and `M`, and `vectors` per-position scalars, padded to whole
    `COEF_LANES` rows)."""
    return -(-(matrices * width * width + vectors * width) // COEF_LANES) * COEF_LANES


def coefficient_shape(width: int, vectors: int = GDN_VECTORS, matrices: int = 2) -> tuple[int, int]:
    """The shape of one record as the kernel copies it."""
    return coefficient_count(width, vectors, matrices) // COEF_LANES, COEF_LANES


def history_weights(g_cache: Float[Array, "N Hv L"], slot: Int[Array, " B"],
                    pos: Int[Array, " B"]) -> Float[Array, "B Hv Lw"]:
    """Per (row, value head) the decays of its history, `[L + HISTORY_PAD]`: `W_j =
    exp(sum_{j<i<pos} g_i)` for each ring entry j < pos (0 at and past it), then `e^G =
    exp(sum_{i<pos} g_i)`, then zeros, from the gate records of the row's slot (a padding
    row's, slot < 0, are slot 0's: never read). What `replay_decode.decay_weights` forms in
    a tile, once per head instead of once per tile: the suffix loop's selects were a sixth
    of a verify tile's arithmetic at L = 32."""
    cache_len = g_cache.shape[-1]
    g = g_cache[jnp.maximum(slot, 0)].astype(F32)  # [B, Hv, L]
    valid = jnp.arange(cache_len)[None, None, :] < pos[:, None, None]
    g = jnp.where(valid, g, 0.0)  # a stale entry (NaN included) enters no sum
    from_j = lax.cumsum(g, axis=2, reverse=True)  # sum_{j <= i < pos} g_i
    after_j = jnp.concatenate([from_j[..., 1:], jnp.zeros_like(from_j[..., :1])], axis=2)  # sum_{j < i < pos}
    weights = jnp.where(valid, jnp.exp(after_j), 0.0)
    pad = jnp.zeros((*g.shape[:2], HISTORY_PAD - 1), F32)
    return jnp.concatenate([weights, jnp.exp(from_j[..., :1]), pad], axis=2)


def prepare_window(q, k, g, beta, length, *, use_qk_l2norm: bool, scale: float):
    """The window's inputs in fp32 with positions at and past a row's length zeroed (their
    inputs, NaN included, are dropped first): `(in_window [B, T], q_n, k_n, g, beta,
    q_scale, k_scale)`, where q_n, k_n `[B, T, H_k, d_k]` are q, k normalised (when
    `use_qk_l2norm`) and q_n scaled, and `q_scale`, `k_scale` `[B, T, H_k]` give those
    factors for the raw vectors."""
    batch, width = q.shape[:2]
    in_window = jnp.arange(width)[None, :] < length[:, None]  # [B, T]
    keep = lambda x: jnp.where(in_window.reshape(batch, width, *[1] * (x.ndim - 2)), x.astype(F32), 0.0)
    q, k, g, beta = keep(q), keep(k), keep(g), keep(beta)
    q_scale, k_scale = (keep(jnp.broadcast_to(x, q.shape[:3]))
                        for x in qk_scales(q, k, use_qk_l2norm=use_qk_l2norm, scale=scale))
    return in_window, q * q_scale[..., None], k * k_scale[..., None], g, beta, q_scale, k_scale


def pack_coefficients(parts: list, width: int, vectors: int, matrices: int = 2) -> Float[Array, "B Hv R Lanes"]:
    """`[B, H_v, ...]` parts (the `matrices` `T x T` blocks first) flattened, joined, padded
    to `coefficient_count` and shaped as `coefficient_shape` per `(row, value head)`."""
    packed = jnp.concatenate([x.reshape(*x.shape[:2], -1) for x in parts], axis=-1)
    count = coefficient_count(width, vectors, matrices)
    packed = jnp.pad(packed, ((0, 0), (0, 0), (0, count - packed.shape[-1])))
    return packed.reshape(*packed.shape[:2], *coefficient_shape(width, vectors, matrices))


def unpack_coefficients(c_smem, width: int, vectors: int, matrices: int = 2):
    """Readers of one packed record in shared memory (`coefficient_shape`): `(*T x T
    blocks(i, j), *per-position scalars(i))`, GDN's `(A, M, ...)`."""
    T = width
    at = lambda n: c_smem[n // COEF_LANES, n % COEF_LANES]
    blocks = [lambda i, j, m=m: at(m * T * T + i * T + j) for m in range(matrices)]
    return (*blocks, *((lambda i, o=o: at(matrices * T * T + o * T + i)) for o in range(vectors)))


def solve_positions(width, length, A, M, beta, v_rows, o_smem, read_k, read_q, append):
    """The window position by position: `u_i` by forward substitution and `y_i` into
    `o_smem[i]` (ROW, 0 at and past `length`).

    `read_k(i, load) -> (R_k, k_i)` gives the live state's readout that enters `R_i`
    (`e^{G_i} S k_i`) and the key record k_i (COL); `read_q(i, load)` the readout of `y_i`
    (`e^{G_i} S q_i`); `load(ref, layout)` loads a position's vector in fp32, zeros at and
    past `length`. One position's vectors at a time, loaded when used: keeping all 2T of
    them in registers spills. `append(i, in_window, u_i, k_i)` writes the records."""
    u = []
    for i in range(width):
        in_window = i < length
        load = lambda ref, layout: select_if(in_window, plgpu.load(ref, layout=layout, optimized=False).astype(F32),
                                             layout)
        r_k, k_col = read_k(i, load)
        u_i = beta(i) * (load(v_rows.at[i], ROW) - r_k)
        for j in range(i):
            u_i = u_i - A(i, j) * u[j]
        u.append(u_i)
        y_i = read_q(i, load)
        for j in range(i + 1):
            y_i = y_i + M(i, j) * u[j]
        o_smem[i] = select_if(in_window, y_i, ROW).astype(o_smem.dtype)
        append(i, in_window, u_i, k_col)


def window_keys(k_smem, k_rows_w, q_rows, width, length):
    """What every tile of a key-head group (one row, one key head) shares, as a function of
    the row `r` of `[2T, L]`: `K k_i` (r = 2i) and `K q_i` (r = 2i + 1) `[L]` (COL) over
    every ring entry, of the raw (unscaled) window vectors (stale entries included: each
    tile masks them; zeros at and past `length`). Each sum is formed when asked for:
    holding all 2T in registers spills."""
    keys_t = load_transposed(k_smem)  # [Dk, L]

    def key_sum(row):
        vectors = q_rows if row % 2 else k_rows_w
        x_row = select_if(row // 2 < length, plgpu.load(vectors.at[row // 2], layout=ROW, optimized=False).astype(F32),
                          ROW)
        return col_sum(keys_t * bcast_rows(x_row, keys_t.shape))

    return key_sum


def store_window_keys(shared_smem, key_sum) -> None:
    """`window_keys`' sums into the rows of `shared_smem [2T, L]`."""
    for row in range(shared_smem.shape[0]):
        shared_smem[row] = key_sum(row)


def load_window_keys(shared_smem):
    """`window_keys`' sums from `shared_smem` (`store_window_keys`), as a function of the row."""
    return lambda row: plgpu.load(shared_smem.at[row], layout=COL, optimized=False)


def key_block_heads(num_k_heads: int, cache_len: int, vector_rows: int) -> int:
    """m, the key heads of one block of `window_key_values`: the most that divide H_k
    whose rings stack into at most 64 rows (a `wgmma`'s M) and whose `vector_rows` rows of
    window vectors each (`side_vectors`) into at most 256 (the copy's box); 0 where no
    ring fits."""
    fits = lambda m: num_k_heads % m == 0 and m * cache_len <= BLOCK_ROWS and m * vector_rows <= 256
    return max((m for m in range(1, num_k_heads + 1) if fits(m)), default=0)


def side_vectors(q: Float[Array, "B T Hk Dk"], k: Float[Array, "B T Hk Dk"], length: Int[Array, " B"],
                 staged: Float[Array, "B Hk N Dk"] | None = None) -> Float[Array, "B Hk PN Dk"]:
    """The key sums' B operand per (row, key head): `masked_window`'s rows as P exact bf16
    parts (`readout.split_bf16`: one for bf16 q and k, which is `window_vectors`, or `staged`
    where the caller has it; three for fp32), each part padded to `window_rows(T)` rows, the
    parts one after another."""
    if q.dtype == jnp.bfloat16:
        return window_vectors(q, k, length) if staged is None else staged
    x = masked_window(q, k, length).astype(F32)
    return jnp.concatenate([stage_vectors(part) for part in split_bf16(x, tile_parts(q.dtype))], axis=2)


def _key_blocks_kernel(slot_ref, pos_ref, length_ref, keys_ref, x_ref, out_ref, k_smem, x_smem, out_smem, barriers,
                       *, heads, cache_len, x_parts, key_parts, interpret):
    """CTA (b, blk): the sums of key heads `blk * m .. blk * m + m - 1` of row b into
    `out_ref[b, blk]` (`window_key_values`), as `wgmma`s: the m rings stacked as the rows
    of one `[64, d_k]` register operand (split into exact bf16 parts), times each head's
    window vectors; row `i L + l` of head i's product holds `K x` of entry l, and the
    transposed store puts them at column `i L + l` of the block. The rings and vectors come
    in `KEY_CHUNK`-column chunks, each on a barrier of its own, all copies issued first: a
    chunk's split and products run while the later chunks land, and only one chunk's parts
    hold registers. Rows other than appending ones (`window_mode`) store zeros without
    reading the ring."""
    b, blk = lax.axis_index("b"), lax.axis_index("blk")
    chunks, ring_rows, head_x_rows = len(k_smem), heads * cache_len, x_smem[0].shape[0] // heads
    vectors = head_x_rows // x_parts
    zeros = lambda: plgpu.layout_cast(jnp.zeros((BLOCK_ROWS, vectors), F32), WGMMA)

    def ring_sums():
        for c in range(chunks):
            columns = pl.ds(c * KEY_CHUNK, KEY_CHUNK)
            keys_dst = k_smem[c] if ring_rows == BLOCK_ROWS else k_smem[c].at[pl.ds(0, ring_rows)]
            plgpu.copy_gmem_to_smem(keys_ref.at[slot_ref[b], pl.ds(blk * ring_rows, ring_rows),
                                                columns], keys_dst, barriers.at[c])
            plgpu.copy_gmem_to_smem(x_ref.at[b, pl.ds(blk * heads * head_x_rows, heads * head_x_rows), columns],
                                    x_smem[c], barriers.at[c])
        # Rows past the stacked rings (where 64 is not a multiple of L) are never selected.
        head_of_row = plgpu.broadcasted_iota(jnp.int32, (BLOCK_ROWS, vectors), 0, layout=WGMMA) // cache_len
        head_sums = [[] for _ in range(heads)]
        for c in range(chunks):
            plgpu.barrier_wait(barriers.at[c])
            ring = split_bf16(plgpu.load(k_smem[c], layout=WGMMA).astype(F32), key_parts)
            for i in range(heads):
                parts = [x_smem[c].at[pl.ds((i * x_parts + p) * vectors, vectors)] for p in range(x_parts)]
                head_sums[i].append(summed_products(ring, parts, interpret=interpret))
        head_sums = [functools.reduce(operator.add, chunk_sums) for chunk_sums in head_sums]
        sums = zeros()
        for i in range(heads):
            sums = jnp.where(head_of_row == i, head_sums[i], sums)
        return sums

    reads = window_mode(pos_ref[b], length_ref[b], cache_len) == MODE_APPEND
    sums = lax.cond(reads, ring_sums, zeros)
    out_smem.T[...] = plgpu.layout_cast(sums, plgpu.Layout.WGMMA_TRANSPOSED)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(out_smem, out_ref.at[b, blk])
    plgpu.wait_smem_to_gmem(0)


@functools.lru_cache(maxsize=None)
def _build_key_blocks(batch, num_k_heads, head_k_dim, cache_len, cache_dtype, x_rows, x_parts, interpret):
    heads = key_block_heads(num_k_heads, cache_len, x_rows)
    vectors, chunks = x_rows // x_parts, head_k_dim // KEY_CHUNK
    # A buffer per chunk, not one indexed by it: a `wgmma` operand sliced by a static index
    # does not lower (Mosaic GPU, jax 0.11.2).
    scratch = [tuple(plgpu.SMEM((BLOCK_ROWS, KEY_CHUNK), cache_dtype, transforms=tiled(128, cache_dtype))
                     for _ in range(chunks)),
               tuple(plgpu.SMEM((heads * x_rows, KEY_CHUNK), jnp.bfloat16, transforms=tiled(128, jnp.bfloat16))
                     for _ in range(chunks)),
               plgpu.SMEM((vectors, BLOCK_ROWS), F32), plgpu.Barrier(num_arrivals=2, num_barriers=chunks)]
    body = functools.partial(_key_blocks_kernel, heads=heads, cache_len=cache_len, x_parts=x_parts,
                             key_parts=tile_parts(cache_dtype), interpret=interpret)
    return build_kernel(body, jax.ShapeDtypeStruct((batch, num_k_heads // heads, vectors, BLOCK_ROWS), F32), scratch,
                        dict(grid=(batch, num_k_heads // heads), grid_names=("b", "blk")),
                        name="replayssm_verify_key_sums_mgpu", interpret=interpret)


def window_key_values(q: Float[Array, "B T Hk Dk"], k: Float[Array, "B T Hk Dk"], k_cache: Float[Array, "N Hk L Dk"],
                      rows: VerifyRows, *, interpret: bool,
                      staged: Float[Array, "B Hk N Dk"] | None = None) -> Float[Array, "B Hb N 64"]:
    """`window_keys`' sums of every row and key head before the verify kernel: `K x` over
    each slot's whole ring for the raw window vectors x (`masked_window`'s: q_0 .. q_{T-1},
    then k_0 .. k_{T-1}; zeros at and past a row's length; stale entries included: the
    verify kernel masks them), in blocks of m =
    `key_block_heads` key heads: `[B, H_k / m, N, 64]` with N = `window_rows(T)`, the sums
    of key head hk, vector j, ring entry l at `[b, hk // m, j, (hk % m) L + l]`
    (`side_block`). A small kernel of its own, one CTA per block, on tensor cores: the
    products of fp32 key records and bf16 vectors are exact in fp32 (the records and, for
    fp32 q and k, the vectors split into bf16 parts). `staged`: the caller's
    `window_vectors` of q and k, if it has them (`side_vectors`). `rows`: the step's slot,
    cursor and length per row (`common.VerifyRows`). Only appending rows (`window_mode` of
    the cursor and length) read their rings; the others (folding rows, which the verify
    kernel reads from their rebuilt tile, and rows of length 0) get zeros."""
    batch, width, num_k_heads, head_k_dim = q.shape
    num_slots, _, cache_len, _ = k_cache.shape
    slot, pos, length = (x.astype(jnp.int32) for x in rows)
    x = side_vectors(q, k, length, staged)
    x_rows = x.shape[2]
    if not key_block_heads(num_k_heads, cache_len, x_rows):
        raise ValueError(f"the verify key sums before the launch need cache_len <= {BLOCK_ROWS} and at most 256 "
                         f"rows of window vectors per key head, got cache_len = {cache_len}, {x_rows} rows")
    kernel = _build_key_blocks(batch, num_k_heads, head_k_dim, cache_len, k_cache.dtype, x_rows,
                               tile_parts(q.dtype), interpret)
    return kernel(slot, pos, length, k_cache.reshape(num_slots, num_k_heads * cache_len, head_k_dim),
                  x.reshape(batch, num_k_heads * x_rows, head_k_dim))


def side_block(side_ref, b, hk, num_k_heads: int, width: int, cache_len: int):
    """Row b, key head hk's `[2T, L]` sums in `window_key_values`' blocks (a strided box of
    the `[B, H_k / m, N, 64]` ref), in `masked_window`'s order (`load_side_keys`)."""
    heads = num_k_heads // side_ref.shape[1]
    return side_ref.at[b, hk // heads, pl.ds(0, 2 * width), pl.ds(hk % heads * cache_len, cache_len)]


def load_side_keys(side_smem, width: int):
    """`window_keys`' sums as a function of its row (`K k_i` at 2i, `K q_i` at 2i + 1) from
    `side_smem [2T, L]`, a `side_block` copy, whose rows are `masked_window`'s (`K q_i` at
    i, `K k_i` at T + i)."""
    return lambda row: plgpu.load(side_smem.at[row // 2 if row % 2 else width + row // 2], layout=COL,
                                  optimized=False)


def store_zeros(o_smem, y_ref, b, h, rows, width):
    """A padding row's outputs: zeros for every window position."""
    for i in range(width):
        o_smem[i] = plgpu.layout_cast(jnp.zeros((BLOCK_ROWS,), o_smem.dtype), ROW)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(o_smem, y_ref.at[b, :, h, rows])


def state_refs(pools: tuple, cursors: Int[Array, " N"]) -> list:
    """`jax.new_ref` of each state pool and of the pool's cursors: the arrays a verify
    kernel updates in place (in place of a copy when the caller donates them)."""
    return [jax.new_ref(x) for x in (*pools, cursors)]


def reset_cursor(cursor_ref, slot, first_folding_tile) -> None:
    """In a verify kernel, a folding row's cursor to 0, stored by one tile of the row
    (`first_folding_tile`): no CTA reads the cursors (the rows come from before the
    launch), so no other tile has to wait for it."""

    @pl.when(first_folding_tile)
    def _reset():
        cursor_ref[slot] = jnp.int32(0)


def check_rows(slots: Int[Array, " B"], cursors: Int[Array, " N"], lengths: Int[Array, " B"], batch: int,
               num_slots: int) -> None:
    """ValueError unless `slots` and `lengths` are integer `[B]` and `cursors` int32 `[N]`,
    one per slot of the pools."""
    for name, x, shape in (("slots", slots, (batch,)), ("lengths", lengths, (batch,)),
                           ("cursors", cursors, (num_slots,))):
        if x.shape != shape or not jnp.issubdtype(x.dtype, jnp.integer):
            raise ValueError(f"{name} must be integer of shape {shape}, got {x.dtype} {x.shape}")
    if cursors.dtype != jnp.int32:
        raise ValueError(f"cursors must be int32 (updated in place), got {cursors.dtype}")


def append_folding_records(key_cache: Float[Array, "N Hk L *Dk"], gate_cache: Float[Array, "N Hv L *C"],
                           keys: Float[Array, "B T Hk *Dk"], gates: Float[Array, "B T Hv *C"], slot: Int[Array, " B"],
                           mode: Int[Array, " B"], length: Int[Array, " B"]) -> tuple:
    """`(key_cache, gate_cache)` with each folding row's key and gate records (Mamba-2: B
    and dt) at `0 .. length - 1`, rounded to the caches' dtypes: written after the launch,
    since until it ends the kernel's other CTAs of the slot may read the history they
    overwrite. Other rows and positions are untouched."""
    return tuple(append_records(cache, records, slot, mode, length) for cache, records in
                 ((key_cache, keys), (gate_cache, gates)))


def append_records(cache: Float[Array, "N H L *C"], records: Float[Array, "B T H *C"], slot: Int[Array, " B"],
                   mode: Int[Array, " B"], length: Int[Array, " B"],
                   appending_at: Int[Array, " B"] | None = None) -> Float[Array, "N H L *C"]:
    """`cache` with each folding row's `records` at `0 .. length - 1`, rounded to its
    dtype (`append_folding_records`); with `appending_at` (the rows' cursors), the
    appending rows' too, at `pos .. pos + length - 1` (the GDN verify kernel with the
    tensor-core readout holds no key in registers, and loading each from global memory on
    the tile that stores it cost that tile a memory round trip per position). Other rows
    and positions are untouched."""
    batch, width = records.shape[:2]
    in_window = jnp.arange(width)[None, :] < length[:, None]
    fold = (mode == MODE_FLUSH)[:, None]
    at = jnp.broadcast_to(jnp.arange(width)[None, :], (batch, width))
    if appending_at is None:
        return set_records(cache, slot, at, records, in_window & fold)
    return set_records(cache, slot, jnp.where(fold, 0, appending_at[:, None]) + at, records,
                       in_window & (mode != MODE_PAD)[:, None])


def record_key_scales(coef: Float[Array, "B Hv R Lanes"], width: int, vectors: int,
                      group_size: int) -> Float[Array, "B T Hk"]:
    """Each window key's norm factor `k_scale` (the records' last vector,
    `pack_coefficients`, read from each key head's first value head), in the key records'
    order: a transpose of the records' lanes, for the window formed by XLA (the window
    kernels write them in this order themselves, `verify_coefficients`' key scales)."""
    batch, num_v_heads = coef.shape[:2]
    start = 2 * width * width + (vectors - 1) * width
    return jnp.swapaxes(coef.reshape(batch, num_v_heads, -1)[:, ::group_size, start:start + width], 1, 2)


def masked_window(q: Float[Array, "B T Hk Dk"], k: Float[Array, "B T Hk Dk"],
                  length: Int[Array, " B"]) -> Float[Array, "B 2T Hk Dk"]:
    """The window's raw q and k stacked along T (`[q_0 .. q_{T-1}, k_0 .. k_{T-1}]`), zeros
    at and past each row's length (its inputs there, NaN included, are dropped)."""
    in_window = jnp.arange(q.shape[1])[None, :] < length[:, None]
    return jnp.where(jnp.tile(in_window, 2)[:, :, None, None], jnp.concatenate([q, k], axis=1), 0)


def window_rows(width: int) -> int:
    """N, the rows of `window_vectors`: 2T rounded up to a multiple of 8 (`wgmma`'s N)."""
    return vector_rows(2 * width)


def window_vectors(q: Float[Array, "B T Hk Dk"], k: Float[Array, "B T Hk Dk"],
                   length: Int[Array, " B"]) -> Float[Array, "B Hk N Dk"]:
    """The "mma" readout's B operand per (row, key head): `masked_window`'s rows, then zero
    rows up to `window_rows(T)`, in q's dtype."""
    return stage_vectors(masked_window(q, k, length))


def window_coefficients(
    q: Float[Array, "B T Hk Dk"],
    k: Float[Array, "B T Hk Dk"],
    g: Float[Array, "B T Hv"],
    beta: Float[Array, "B T Hv"],
    anc: Bool[Array, "B T T"],
    length: Int[Array, " B"],
    *,
    use_qk_l2norm: bool,
    scale: float,
) -> Float[Array, "B Hv R Lanes"]:
    """The window's scalars per `(row, value head)`, packed for the kernel (fp32,
    `coefficient_count(T)` floats shaped as `coefficient_shape(T)`): `A [T, T]`, `M [T, T]`,
    `e^{G} [T]`, `beta [T]`, `g [T]`, `q_scale [T]`, `k_scale [T]`, then zeros, where

        A_ij = beta_i e^{G_i - G_j} (k_i . k_j)   for j in anc(i), else 0
        M_ij = e^{G_i - G_j} (q_i . k_j)          for j in anc(i) + {i}, else 0

    with q_i, k_i normalised and q_i scaled (`q_scale`, `k_scale` give those factors for the
    raw vectors). Positions at and past a row's length get zeros everywhere (their inputs,
    NaN included, are dropped first)."""
    width, num_k_heads = q.shape[1], q.shape[2]
    group = g.shape[2] // num_k_heads
    in_window = jnp.arange(width)[None, :] < length[:, None]  # [B, T]
    # One Gram matrix of the raw vectors [q; k] per (row, key head) gives the norms (its
    # diagonal) and every product the kernel needs, rescaled afterwards: one reduction
    # over d_k, where normalising first costs a reduction per norm and per product.
    x = masked_window(q, k, length)  # [B, 2T, Hk, Dk]
    gram = jnp.einsum("bihc,bjhc->bhij", x, x, precision=lax.Precision.HIGHEST,
                      preferred_element_type=F32)  # [B, Hk, 2T, 2T]
    squares = jnp.diagonal(gram, axis1=2, axis2=3)  # [B, Hk, 2T]
    inv_norm = lax.rsqrt(squares + L2NORM_EPS) if use_qk_l2norm else jnp.ones_like(squares)
    valid_hk = in_window[:, None, :]
    q_scale = jnp.where(valid_hk, scale * inv_norm[..., :width], 0.0)  # [B, Hk, T]
    k_scale = jnp.where(valid_hk, inv_norm[..., width:], 0.0)
    outer = lambda a, b: a[..., :, None] * b[..., None, :]
    heads = lambda y: jnp.repeat(y, group, axis=1)  # [B, Hk, ...] -> [B, Hv, ...]
    kk = heads(gram[..., width:, width:] * outer(k_scale, k_scale))
    qk = heads(gram[..., :width, width:] * outer(q_scale, k_scale))
    seen = (anc | jnp.eye(width, dtype=bool)[None]) & in_window[:, :, None] & in_window[:, None, :]
    # [B, T, Hv] -> [B, Hv, T], 0 past the row's window.
    keep = lambda y: jnp.where(in_window[:, None, :], jnp.moveaxis(y, 1, 2).astype(F32), 0.0)
    g_t, beta_t = keep(g), keep(beta)
    # G_i: the sum of g over i's branch (a masked sum over T, which fuses with its users).
    G = jnp.sum(jnp.where(seen[:, None], g_t[..., None, :], 0.0), axis=-1)  # [B, Hv, T]
    # e^{G_i - G_j} only where j is on i's branch (<= 1 there); elsewhere the difference
    # can be large and positive, so it is zeroed before the exponential.
    mask = seen[:, None]
    decay = jnp.where(mask, jnp.exp(jnp.where(mask, G[..., :, None] - G[..., None, :], 0.0)), 0.0)
    strict = (anc & seen)[:, None]
    A = jnp.where(strict, beta_t[..., :, None] * decay * kk, 0.0)
    M = decay * qk
    e_G = jnp.where(in_window[:, None, :], jnp.exp(G), 0.0)
    scales = [heads(x) for x in (q_scale, k_scale)]
    return pack_coefficients([A, M, e_G, beta_t, g_t, *scales], width, GDN_VECTORS)


def _scratch(width, head_k_dim, cache_len, state_dtype, cache_dtype, qk_dtype, y_dtype, swizzle, stages,
             readout="fma", rebuild="exact", xla_side=False, own_fold_buffers=False, prefetch_folds=False,
             group_folds=False) -> list:
    """`[stages, shared, fold keys, fold buffers, barriers, rows barrier, fold keys barrier]`: `stages` sets
    of a tile's replay buffers (y `[T, BV]`; its head's `history_weights` `[L + HISTORY_PAD]` in
    place of the gate records), its window coefficients, the window's vectors
    for ROW loads (`[q, k]` `[T, d_k]` for `window_keys`; `[]` with the key side computed before the launch;
    v `[T, BV]`) and the readout's (`readout_scratch`); `[shared]` the key-head group's
    `K k_i`, `K q_i` (`store_window_keys`, `[2T, L]` fp32); a barrier per stage
    (`stage_copies`) and, for the exact rebuild, one for the fold's record copies (else
    `[]`). With the key side computed before the launch (`xla_side`) each stage takes those sums `[2T, L]`
    in place of the key records and `shared` is `[]`; a tensor-core fold then copies the
    key records into `[fold keys]` `[L, d_k]` (one per CTA) with its own barrier (else
    `[]`, `[]`). What a fold needs besides the replay buffers shares the stage's
    checkpoint-tile buffer (a `plgpu.RefUnion`), since a fold is done with it before it
    stores the folded tile there: the exact rebuild's untiled record copies (fetched once
    `S_c` is in registers) or a tensor-core rebuild's operands (`rebuild_operands`), or,
    with `own_fold_buffers` (several warpgroups, which cannot share a union), those in
    `fold buffers`, one set per program (else `[]`); with `prefetch_folds` the copies go
    with a folding row's tile, so each stage has its own: the exact rebuild's in its tile
    buffer (`[tile, record copies]` instead of their union), a tensor-core fold's key
    records in `[fold keys]`, and the rows or fold keys barrier (one per stage). Two stages
    of fp32 L = 16 buffers fit twice per SM (with `prefetch_folds` too, at T <= 4 and the
    key sums before the launch). With `group_folds` (exact folds) a stage's value-record
    buffer is a union of the swizzled one and an untiled one, which a folding row's tile
    copy fills, and `[fold keys]` is one untiled key-record buffer per CTA `[L, d_k]` with
    its barrier, filled once per key-head group (`pipeline` group copies); the tile buffer
    then shares nothing. Two stages of fp32 L = 32 buffers with it fit twice per SM."""
    def stage():
        bufs = replay_scratch(BLOCK_ROWS, head_k_dim, cache_len, state_dtype, cache_dtype, (width, BLOCK_ROWS),
                              y_dtype, swizzle)
        bufs[3] = plgpu.SMEM((cache_len + HISTORY_PAD,), F32)  # `history_weights`, not the gate records
        if group_folds:
            bufs[0] = [bufs[0], []]
            bufs[1] = plgpu.RefUnion(bufs[1], plgpu.SMEM(bufs[1].shape, cache_dtype))
        elif prefetch_folds and rebuild == "exact":
            bufs[0] = [bufs[0], fold_buffers(bufs[0])]
        elif not own_fold_buffers:
            bufs[0] = plgpu.RefUnion(bufs[0], fold_buffers(bufs[0]))
        if xla_side:
            bufs[2] = plgpu.SMEM((2 * width, cache_len), F32)
        qk_rows = [] if xla_side else [plgpu.SMEM((width, head_k_dim), qk_dtype) for _ in range(2)]
        return (bufs + [plgpu.SMEM(coefficient_shape(width), F32), qk_rows]
                + [plgpu.SMEM((width, BLOCK_ROWS), y_dtype)] + readout_scratch(width, head_k_dim, qk_dtype, readout))

    def fold_buffers(tile):
        """What a fold needs besides the tile: the exact rebuild's record copies, or a
        tensor-core rebuild's operands (`rebuild_operands`)."""
        if rebuild == "exact":
            return record_copies(BLOCK_ROWS, head_k_dim, cache_len, cache_dtype)
        return rebuild_operands(tile, BLOCK_ROWS, head_k_dim, cache_len, rebuild, cache_dtype)

    tile, _, keys, _, _ = replay_scratch(BLOCK_ROWS, head_k_dim, cache_len, state_dtype, cache_dtype,
                                         (width, BLOCK_ROWS), y_dtype, swizzle)
    fold_keys = xla_side and rebuild != "exact"
    fold_copies = stages if prefetch_folds else 1  # buffers and barriers of the folds' copies
    if group_folds:  # one untiled key-record buffer per CTA, filled once per group
        fold_keys_bufs, rows_barriers = [plgpu.SMEM((cache_len, head_k_dim), cache_dtype)], 0
    else:
        fold_keys_bufs = [keys] * fold_copies if fold_keys else []
        rows_barriers = fold_copies if rebuild == "exact" else 0
    return [[stage() for _ in range(stages)], [] if xla_side else [plgpu.SMEM((2 * width, cache_len), F32)],
            fold_keys_bufs, fold_buffers(tile) if own_fold_buffers else [],
            plgpu.Barrier(num_arrivals=stage_copies(readout, xla_side), num_barriers=stages),
            [plgpu.Barrier(num_arrivals=2)] * rows_barriers, [plgpu.Barrier(num_arrivals=1)] * len(fold_keys_bufs)]


def readout_scratch(width: int, head_k_dim: int, qk_dtype, readout: str) -> list:
    """The buffers a tile's readout reads: "fma", q and k `[T, d_k]` again for COL loads
    (layout inference cannot give two layouts to loads of one buffer); "mma", the window's
    raw vectors `[N, d_k]` (`window_vectors`, swizzled: the `wgmma` operand)."""
    if readout == "mma":
        return [plgpu.SMEM((window_rows(width), head_k_dim), qk_dtype, transforms=tiled(128, qk_dtype))]
    return [plgpu.SMEM((width, head_k_dim), qk_dtype) for _ in range(2)]


def stage_copies(readout: str, xla_side: bool = False) -> int:
    """TMA copies per tile: its four replay buffers (the key records or, `xla_side`, the key
    sums), the coefficients, q and k (not with `xla_side`), v, and the readout's
    (`readout_scratch`)."""
    return (6 if xla_side else 8) + (1 if readout == "mma" else 2)


def _kernel(slot_ref, pos_ref, length_ref, q_ref, k_ref, v_ref, coef_ref, weights_ref, *refs,
            width, group_size, tiles, num_programs, chunk, readout, parts, rebuild, xla_side, program_scratch, per_tile,
            warpgroups, ordered, prefetch_folds, group_folds, interpret):
    # Inputs, the row order, the window's raw vectors with the "mma" readout and the key
    # sums computed before the launch first; outputs; scratch.
    order_ref, *refs = refs if ordered else (None, *refs)
    xw_ref, *refs = refs if readout == "mma" else (None, *refs)
    side_ref, *refs = refs if xla_side else (None, *refs)
    ckpt_ref, ucache_ref, kcache_ref, gcache_ref, cursor_ref, y_ref, *all_scratch = refs
    batch, num_v_heads = y_ref.shape[0], y_ref.shape[2]
    row_mode = lambda b: window_mode(pos_ref[b], length_ref[b], ucache_ref.shape[2])
    own_fold_buffers = warpgroups > 1  # not in a union with the tile (`_scratch`)

    # `(stages, shared, fold keys, fold buffers, barriers, rows barrier, fold keys barrier)`
    buffers = lambda b: tile_buffers(all_scratch, program_scratch, b, batch, per_tile=per_tile, warpgroups=warpgroups)

    def issue(b, h, tile, stage):
        """Start the tile's copies into `stages[stage]` (none for padding rows; with
        `prefetch_folds` a folding row's record copies too)."""
        stages, _, fold_keys, _, barriers, rows_barrier, fold_barrier = buffers(b)
        tile_buf, u_smem, k_smem, w_smem, _, c_smem, qk_rows, *window_smem = stages[stage]
        t_smem = tile_buf if own_fold_buffers else tuple(tile_buf)[0]
        barrier, slot, hk, rows = barriers.at[stage], slot_ref[b], h // group_size, pl.ds(tile * BLOCK_ROWS, BLOCK_ROWS)
        mode = row_mode(b)

        def replay_copies(u_dst):
            copy_replay_tile((ckpt_ref, ucache_ref, kcache_ref, gcache_ref), (t_smem, u_dst, k_smem, w_smem),
                             slot, h, hk, rows, barrier, gates=weights_ref.at[b, h],
                             keys=side_block(side_ref, b, hk, q_ref.shape[2], width, u_dst.shape[0]) if xla_side
                             else None)

        @pl.when(mode != MODE_PAD)
        def _copies():
            if group_folds:  # a folding row's value records untiled, for its fold; others' swizzled
                swizzled, untiled = tuple(u_smem)
                pl.when(mode == MODE_FLUSH)(lambda: replay_copies(untiled))
                pl.when(mode == MODE_APPEND)(lambda: replay_copies(swizzled))
            else:
                replay_copies(u_smem)
            plgpu.copy_gmem_to_smem(coef_ref.at[b, h], c_smem, barrier)
            # The window's vectors: per-position loads then hit shared memory instead of
            # waiting on global memory one position after another.
            readout_sources = (xw_ref.at[b, hk],) if readout == "mma" else (q_ref.at[b, :, hk], k_ref.at[b, :, hk])
            qk_sources = () if xla_side else (q_ref.at[b, :, hk], k_ref.at[b, :, hk])
            sources = qk_sources + (v_ref.at[b, :, h, rows],) + readout_sources
            for src, dst in zip(sources, [*qk_rows, *window_smem]):
                plgpu.copy_gmem_to_smem(src, dst, barrier)

        if prefetch_folds:
            @pl.when(mode == MODE_FLUSH)
            def _fold_records():
                if rebuild == "exact":
                    copy_record_rows((ucache_ref, kcache_ref), tuple(tile_buf)[1], slot, h, hk, rows,
                                     rows_barrier[stage])
                else:
                    plgpu.copy_gmem_to_smem(kcache_ref.at[slot, hk], fold_keys[stage], fold_barrier[stage])

    def issue_group(b, h, tile):
        """With `group_folds`: a folding row's key records for its key-head group's tiles."""
        _, _, fold_keys, _, _, _, fold_barrier = buffers(b)

        @pl.when(row_mode(b) == MODE_FLUSH)
        def _fold_keys():
            plgpu.copy_gmem_to_smem(kcache_ref.at[slot_ref[b], h // group_size], fold_keys[0], fold_barrier[0])

    def compute(b, h, tile, stage, fresh, prefetch=lambda: None):
        stages, shared_smem, fold_keys, own_fold_bufs, barriers, rows_barrier, fold_barrier = buffers(b)
        fold = stage if prefetch_folds else 0  # the folds' copies: this stage's, or the one set
        at = lambda copies: copies[fold] if copies else None
        _tile(b, h, tile, stages[stage], shared_smem, at(fold_keys), own_fold_bufs, barriers.at[stage],
              at(rows_barrier), at(fold_barrier), fresh, prefetch)

    def _tile(b, h, tile, bufs, shared_smem, fold_keys, own_fold_bufs, barrier, rows_barrier, fold_barrier, fresh,
              prefetch):
        # k_smem: the key records, or with the key side computed before the launch the window's key sums.
        # w_smem: the row's `history_weights` for head h, in place of its gate records.
        tile_buf, u_smem, k_smem, w_smem, o_smem, c_smem, qk_rows, v_rows, *readout_bufs = bufs
        # The fold's record copies or operands: aliasing the tile, or their own buffers.
        t_smem, fold_bufs = (tile_buf, own_fold_bufs) if own_fold_buffers else tuple(tile_buf)
        if group_folds:  # the swizzled value records; a folding row's untiled ones and its group's keys
            u_smem, u_untiled = tuple(u_smem)
            fold_bufs = (u_untiled, fold_keys)
        hk = h // group_size
        rows = pl.ds(tile * BLOCK_ROWS, BLOCK_ROWS)
        mode = row_mode(b)
        cache_len = u_smem.shape[0]

        @pl.when(mode == MODE_PAD)
        def _padding_row():
            prefetch()
            store_zeros(o_smem, y_ref, b, h, rows, width)

        @pl.when(mode != MODE_PAD)
        def _live_row():
            slot, pos, length = slot_ref[b], pos_ref[b], length_ref[b]
            fold = mode == MODE_FLUSH
            with jax.named_scope("wait"):
                plgpu.barrier_wait(barrier)
            with jax.named_scope("key_side"):
                if xla_side:
                    key_sum = load_side_keys(k_smem, width)
                else:
                    q_rows, k_rows_w = qk_rows
                    key_sum = group_shared(fresh,
                                           functools.partial(window_keys, k_smem, k_rows_w, q_rows, width, length),
                                           functools.partial(store_window_keys, shared_smem[0]),
                                           functools.partial(load_window_keys, shared_smem[0]))
            with jax.named_scope("records"):
                weights = plgpu.load(w_smem.at[pl.ds(0, cache_len)], layout=COL, optimized=False)
                decay_total = w_smem[cache_len]
                s_c = plgpu.load(t_smem, layout=WGMMA).astype(F32)  # [BV, Dk]
                j_tile = plgpu.broadcasted_iota(jnp.int32, (BLOCK_ROWS, cache_len), 1, layout=WGMMA)
            # A folding row's live state, rebuilt with its whole history and rounded as
            # stored; other rows keep S_c (their history is read out below).
            with jax.named_scope("fold"):
                if rebuild == "exact":
                    u_rows, k_rows = fold_bufs

                    @pl.when(fold)
                    def _fetch_rows():
                        # The rebuild reads single records at a dynamic index, which the swizzled
                        # buffers cannot serve: folding rows fetch an untiled copy (L2-resident)
                        # into the tile's buffer, once every thread holds S_c, or (prefetched)
                        # wait for the copy their tile's issue started.
                        with jax.named_scope("fold_fetch"):
                            if group_folds:  # the value records came with the tile; the keys once a group
                                pl.when(fresh)(lambda: plgpu.barrier_wait(fold_barrier))
                                return
                            if not prefetch_folds:
                                plgpu.commit_smem()
                                copy_record_rows((ucache_ref, kcache_ref), (u_rows, k_rows), slot, h, hk, rows,
                                                 rows_barrier)
                            plgpu.barrier_wait(rows_barrier)

                    # A branch, not the loop run zero times: other rows skip its setup (the
                    # region profile gave it ~5% of a non-folding fp32 tile).
                    rebuilt = lax.cond(fold, lambda: rebuild_weighted(s_c, decay_total, u_rows, k_rows, w_smem, pos),
                                       lambda: s_c)
                else:
                    def tensor_core_fold():
                        u_all = jnp.where(j_tile < pos, load_transposed(u_smem), 0.0)  # [BV, L], stale entries 0
                        keys = k_smem
                        if xla_side:  # the key records, which only a fold reads, into the CTA's buffer
                            keys = fold_keys
                            with jax.named_scope("fold_fetch"):
                                if not prefetch_folds:
                                    plgpu.copy_gmem_to_smem(kcache_ref.at[slot, hk], keys, fold_barrier)
                                plgpu.barrier_wait(fold_barrier)
                        return rebuild_tensor_cores(s_c, decay_total, u_all, weights, keys, pos, fold_bufs)

                    # A branch, not a select: the other rows skip the products.
                    rebuilt = lax.cond(fold, tensor_core_fold, lambda: s_c)
                s_eff = rebuilt.astype(t_smem.dtype).astype(F32)
                history_len = jnp.where(fold, 0, pos)
                decay_eff = jnp.where(fold, 1.0, decay_total)

            reset_cursor(cursor_ref, slot, fold & (h == 0) & (tile == 0))

            @pl.when(fold)
            def _store_checkpoint():
                with jax.named_scope("store_checkpoint"):
                    plgpu.commit_smem()  # every thread done with the records or operands before the tile is rewritten
                    t_smem[...] = s_eff.astype(t_smem.dtype)
                    plgpu.commit_smem()
                    plgpu.copy_smem_to_gmem(t_smem, ckpt_ref.at[slot, h, rows])

            # The next group's key records (`group_folds`), once a fold is done with these:
            # the store above began with a warpgroup barrier.
            prefetch()

            with jax.named_scope("products"):
                u_t = jnp.where(j_tile < history_len, load_transposed(u_smem), 0.0)  # [BV, L], stale entries 0
                valid = plgpu.broadcasted_iota(jnp.int32, (cache_len,), 0, layout=COL) < history_len

                # "mma": `S_eff x` for all 2T raw vectors at once (column j: q_j, column T + j: k_j).
                products = (tile_products(s_eff, readout_bufs[0], parts, interpret=interpret) if readout == "mma"
                            else None)
                q_cols, k_cols = readout_bufs if readout == "fma" else (None, None)

            def tile_x(x_col):
                """`S_eff x` `[BV]` (ROW) for x in COL, on CUDA cores."""
                return row_sum(s_eff * bcast_cols(x_col, s_eff.shape))

            def live_x(s_x, k_x):
                """`S x` `[BV]` (ROW) of the live state from `S_eff x` and `K x` `[L]` (COL)."""
                c = jnp.where(valid, k_x * weights, 0.0)
                return row_sum(u_t * bcast_cols(c, u_t.shape)) + decay_eff * s_x

            A, M, e_G, beta, g, q_scale, k_scale = unpack_coefficients(c_smem, width, GDN_VECTORS)
            base = jnp.where(fold, 0, pos)

            def read_k(i, load):
                with jax.named_scope("readout"):
                    k_x = k_scale(i) * key_sum(2 * i)
                    if readout == "mma":  # no key in registers: XLA writes the key records
                        return e_G(i) * live_x(k_scale(i) * column(products, width + i), k_x), None
                    k_col = k_scale(i) * load(k_cols.at[i], COL)
                    return e_G(i) * live_x(tile_x(k_col), k_x), k_col

            def read_q(i, load):
                with jax.named_scope("readout"):
                    q_x = q_scale(i) * key_sum(2 * i + 1)
                    if readout == "mma":
                        return e_G(i) * live_x(q_scale(i) * column(products, i), q_x)
                    return e_G(i) * live_x(tile_x(q_scale(i) * load(q_cols.at[i], COL)), q_x)

            def append(i, in_window, u_i, k_col):
                with jax.named_scope("append"):
                    @pl.when(in_window)
                    def _append_u():
                        ucache_ref[slot, h, base + i, rows] = u_i.astype(ucache_ref.dtype)

                    @pl.when(in_window & (tile == 0))
                    def _append_gate():
                        gcache_ref[slot, h, base + i] = g(i)

                    if k_col is not None:  # "fma": the key is in registers; "mma" leaves it to XLA
                        @pl.when(in_window & (mode == MODE_APPEND) & (tile == 0) & (h % group_size == 0))
                        def _append_key():
                            kcache_ref[slot, hk, base + i] = k_col.astype(kcache_ref.dtype)

            solve_positions(width, length, A, M, beta, v_rows, o_smem, read_k, read_q, append)
            with jax.named_scope("store"):
                # After the tile's store: the persistent loop leaves only the newest store in flight.
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(o_smem, y_ref.at[b, :, h, rows])

    serve_tiles(batch, num_v_heads, tiles, num_programs, issue, compute, group_size=group_size, chunk=chunk,
                issue_group=issue_group if group_folds else None, warpgroups=warpgroups, row_order=order_ref)


def check_params(params, kernel: str, *, pipelined: bool = False, window_side: bool = False) -> None:
    """Raise ValueError on the decode kernels' options a verify kernel does not take
    (`key_side="mma"` in any of them): unless `pipelined` (the GDN kernel, which takes the
    others), it rebuilds folds in exact fp32, runs one CTA per tile, keeps Mosaic's barriers
    and reads out on CUDA cores; its records' layout is its own (`group_records` None); a
    window formed by a kernel (`window_side`) where `pipelined` or `window_side` (KDA).
    `params`: a `MosaicReplayParams` or a `MosaicMamba2Params`."""
    check_own_layout(params, kernel, per_tile_addresses=pipelined, key_side=pipelined, warpgroups=pipelined,
                     launch_order=pipelined, window_side=pipelined or window_side)
    if getattr(params, "key_side", "kernel") == "mma":  # decode's: verify's window sums are its own
        raise ValueError(f"{kernel} sums its window's keys in the kernel or before the launch: key_side must be "
                         "'kernel' or 'xla', got 'mma'")
    if pipelined:
        return
    for name in ("prefetch_folds", "group_folds"):
        if getattr(params, name, False):
            raise ValueError(f"{kernel} runs one CTA per tile: {name} must be False")
    if getattr(params, "rebuild", "exact") != "exact":
        raise ValueError(f"{kernel} rebuilds in exact fp32 only, got rebuild={params.rebuild!r}")
    check_fma_readout(params, kernel)
    if params.programs:
        raise ValueError(f"{kernel} runs one CTA per tile: programs must be 0, got {params.programs}")
    if not params.auto_barriers:
        raise ValueError(f"{kernel} keeps Mosaic's automatic barriers: auto_barriers must be True")
    if getattr(params, "chunk", 0):
        raise ValueError(f"{kernel} runs one CTA per tile: chunk must be 0, got {params.chunk}")


def persistent_smem_bytes(width: int, head_k_dim: int, cache_len: int, state_dtype, cache_dtype, token_dtype, *,
                          swizzle: int = 128, readout: str = "fma", rebuild: str = "exact",
                          key_side: str = "kernel", warpgroups: int = 1, prefetch_folds: bool = False,
                          group_folds: bool = False) -> int:
    """Shared memory of one persistent verify CTA (two stages per program, `warpgroups`
    programs; `token_dtype`: q, k, v and y's)."""
    scratch = _scratch(width, head_k_dim, cache_len, state_dtype, cache_dtype, token_dtype, token_dtype, swizzle,
                       STAGES, readout, rebuild, key_side == "xla", warpgroups > 1, prefetch_folds, group_folds)
    return smem_bytes(kernel_scratch(scratch, per_tile=False, warpgroups=warpgroups)[0])


def persistent_programs(batch: int, width: int, num_v_heads: int, head_v_dim: int, head_k_dim: int,
                        cache_len: int, state_dtype, cache_dtype, token_dtype, sm_count: int, *,
                        swizzle: int = 128, readout: str = "fma", rebuild: str = "exact",
                        key_side: str = "kernel", warpgroups: int = 1, prefetch_folds: bool = False,
                        group_folds: bool = False) -> int:
    """`MosaicReplayParams.programs` for the verify kernel on a device of `sm_count` SMs: as
    many persistent CTAs per SM as its two stages fit in shared memory, at most
    `RESIDENT_CTAS` (`token_dtype`: q, k, v and y's); with `warpgroups` w > 1, one CTA of w
    programs per SM (its threads may take all the registers), 0 where their buffers do not
    fit."""
    cta_bytes = persistent_smem_bytes(width, head_k_dim, cache_len, state_dtype, cache_dtype, token_dtype,
                                      swizzle=swizzle, readout=readout, rebuild=rebuild, key_side=key_side,
                                      warpgroups=warpgroups, prefetch_folds=prefetch_folds, group_folds=group_folds)
    return programs_that_fit(cta_bytes, sm_count, batch * num_v_heads * (head_v_dim // BLOCK_ROWS), RESIDENT_CTAS,
                             warpgroups)


@functools.lru_cache(maxsize=None)
def _build(batch, width, num_v_heads, head_v_dim, head_k_dim, cache_len, state_dtype, cache_dtype, qk_dtype, y_dtype,
           group_size, swizzle, programs, auto_barriers, readout, rebuild, chunk, per_tile_addresses, xla_side,
           warpgroups, ordered, prefetch_folds, group_folds, interpret):
    tiles = head_v_dim // BLOCK_ROWS
    num_tiles = batch * num_v_heads * tiles
    warpgroups = min(warpgroups, num_tiles)  # every program serves at least one tile
    program_scratch = _scratch(width, head_k_dim, cache_len, state_dtype, cache_dtype, qk_dtype, y_dtype, swizzle,
                               STAGES if programs else 1, readout, rebuild, xla_side, warpgroups > 1, prefetch_folds,
                               group_folds)
    scratch, view = kernel_scratch(program_scratch, per_tile=per_tile_addresses, warpgroups=warpgroups)
    check_smem(scratch, f"verify_decode_mgpu at T = {width}, cache_len = {cache_len}, d_k = {head_k_dim}"
               + (f", {warpgroups} warpgroups" if warpgroups > 1 else ""))
    num_programs = min(programs, num_tiles) // warpgroups * warpgroups
    body = functools.partial(_kernel, width=width, group_size=group_size, tiles=tiles, num_programs=num_programs,
                             chunk=chunk, readout=readout, parts=tile_parts(state_dtype), rebuild=rebuild,
                             xla_side=xla_side, program_scratch=view,
                             per_tile=per_tile_addresses, warpgroups=warpgroups, ordered=ordered,
                             prefetch_folds=prefetch_folds, group_folds=group_folds, interpret=interpret)
    return build_kernel(body, jax.ShapeDtypeStruct((batch, width, num_v_heads, head_v_dim), y_dtype), scratch,
                        tile_grid(batch, num_v_heads, tiles, num_programs, warpgroups),
                        name="replayssm_verify_decode_mgpu", interpret=interpret, auto_barriers=auto_barriers)


def verify_decode_mgpu(
    checkpoint: Float[Array, "N Hv Dv Dk"],
    u_cache: Float[Array, "N Hv L Dv"],
    k_cache: Float[Array, "N Hk L Dk"],
    g_cache: Float[Array, "N Hv L"],
    q: Float[Array, "B T Hk Dk"],
    k: Float[Array, "B T Hk Dk"],
    v: Float[Array, "B T Hv Dv"],
    g: Float[Array, "B T Hv"],
    beta: Float[Array, "B T Hv"],
    slots: Int[Array, " B"],
    cursors: Int[Array, " N"],
    lengths: Int[Array, " B"],
    anc: Bool[Array, "B T T"],
    *,
    use_qk_l2norm: bool = False,
    scale: float | None = None,
    params: MosaicReplayParams = MosaicReplayParams(),
    row_order: Int[Array, " B"] | None = None,
    interpret: bool | None = None,
):
    """Verify one GDN draft window per row on Mosaic GPU: `window_coefficients` in XLA, then
    one kernel launch.

    Args:
      checkpoint, u_cache, k_cache, g_cache: the layer's state pools (GDN: per-head decays).
      q, k, v: the window's tokens, raw q/k (normalised when `use_qk_l2norm`).
      g, beta: activated gates (log-decay and write strength).
      slots: `[B]` int, each row's slot (negative or >= N: a padding row).
      cursors: `[N]` int32, the pool's cursors (each slot's records before it are live);
        the kernel sets each folding row's to 0 in place.
      lengths: `[B]` int, each row's valid window length in [0, T]; with the row's cursor
        its mode (`window_mode`: 0 or a padding row verifies nothing; `pos + length > L`
        folds the history into the checkpoint first).
      anc: `[B, T, T]` bool, True where position j precedes position i on i's branch.
      use_qk_l2norm, scale: as `replay_decode_mgpu`.
      params: the checkpoint tile's swizzle, persistent CTAs, automatic barriers, the folds'
        rebuild and the readout (`MosaicReplayParams`; tensor-core rebuilds need a GPU;
        readout "mma" takes bf16 q and k, and interpret mode computes its products as dots).
      row_order: `[B]` the order rows are served in (folding rows first, as the decode
        kernels' launch order), given iff `params.launch_order`.
      interpret: run in Mosaic GPU interpret mode (default: off GPU).

    Returns:
      `(y [B, T, H_v, d_v] in v's dtype, checkpoint, u_cache, k_cache, g_cache, cursors)`
      with every row's window records appended and each folding row's cursor at 0, the
      state arrays updated in place when the caller donates them (a folding row's key
      records, and with readout "mma" every row's, by XLA after the launch, see the module
      doc).
    """
    batch, width, num_v_heads, head_v_dim = v.shape
    head_k_dim = q.shape[-1]
    cache_len = u_cache.shape[2]
    if g_cache.ndim != 3:
        raise ValueError(f"verify_decode_mgpu supports per-head (GDN) decay only; g_cache has shape {g_cache.shape}")
    if not 1 <= width <= min(MAX_WIDTH, cache_len):
        raise ValueError(f"verify_decode_mgpu needs a window width T in [1, min({MAX_WIDTH}, L = {cache_len})], "
                         f"got T = {width}")
    if anc.shape != (batch, width, width):
        raise ValueError(f"anc must have shape {(batch, width, width)}, got {anc.shape}")
    check_rows(slots, cursors, lengths, batch, checkpoint.shape[0])
    check_shapes(head_k_dim, head_v_dim, cache_len, checkpoint.dtype.itemsize, params.swizzle)
    check_params(params, "verify_decode_mgpu", pipelined=True)
    exact_fold = params.rebuild == "exact"
    if params.prefetch_folds and (not params.programs or (params.warpgroups != 1 if exact_fold
                                                          else params.key_side != "xla")):
        raise ValueError("prefetch_folds copies a fold's records one tile ahead on persistent programs: it needs "
                         "programs > 0 and, for the exact rebuild, warpgroups=1, for a tensor-core one key_side='xla' "
                         f"(the only fold that fetches its key records), got programs={params.programs}, "
                         f"rebuild={params.rebuild!r}, warpgroups={params.warpgroups}, key_side={params.key_side!r}")
    if params.group_folds and (not params.programs or params.warpgroups != 1 or not exact_fold):
        raise ValueError("group_folds copies an exact fold's key records once per key-head group on persistent "
                         f"programs of one warpgroup: it needs programs > 0, warpgroups=1 and rebuild='exact', got "
                         f"programs={params.programs}, warpgroups={params.warpgroups}, rebuild={params.rebuild!r}")
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    check_rebuild(params.rebuild, cache_len, interpret)
    check_mma_readout(params, q.dtype, "verify_decode_mgpu")
    order = launch_order_input(params, row_order, batch, "verify_decode_mgpu")
    if q.dtype != k.dtype:
        raise ValueError(f"q and k must share a dtype, got {q.dtype} and {k.dtype}")
    scale = float(head_k_dim ** -0.5 if scale is None else scale)
    if params.window_side == "kernel":
        coef, staged, key_scales, weights, rows = verify_coefficients(
            q, k, g, beta, anc.astype(bool), slots, cursors, lengths, record_len=coefficient_count(width),
            vector_rows=window_rows(width), use_qk_l2norm=bool(use_qk_l2norm), scale=scale,
            history=g_cache, history_len=cache_len + HISTORY_PAD,
            params=VerifyCoefficientsParams(num_warps=params.window_warps), interpret=interpret)
        coef = coef.reshape(batch, num_v_heads, *coefficient_shape(width))
    else:
        rows = verify_rows(slots, cursors, lengths)
        coef = window_coefficients(q, k, g, beta, anc.astype(bool), rows.length, use_qk_l2norm=bool(use_qk_l2norm),
                                   scale=scale)
        staged = window_vectors(q, k, rows.length)
        weights = history_weights(g_cache, rows.slot, rows.pos)
        key_scales = record_key_scales(coef, width, GDN_VECTORS, num_v_heads // q.shape[2])
    slot, pos, length = rows
    kernel = _build(batch, width, num_v_heads, head_v_dim, head_k_dim, cache_len, checkpoint.dtype, u_cache.dtype,
                    q.dtype, v.dtype, num_v_heads // q.shape[2], params.swizzle, params.programs,
                    params.auto_barriers, params.readout, params.rebuild, params.chunk, params.per_tile_addresses,
                    params.key_side == "xla", params.warpgroups, bool(order), params.prefetch_folds,
                    params.group_folds, bool(interpret))
    refs = state_refs((checkpoint, u_cache, k_cache, g_cache), cursors)
    vectors = [staged] if params.readout == "mma" else []
    if params.key_side == "xla":
        vectors.append(window_key_values(q, k, k_cache, rows, interpret=bool(interpret), staged=staged))
    y = kernel(slot, pos, length, q, k, v, coef, weights, *order, *vectors, *refs)
    checkpoint, u_cache, k_cache, g_cache, cursors = (jax.freeze(r) for r in refs)
    keys = k.astype(F32) * key_scales[..., None]
    mode = window_mode(pos, length, cache_len)  # XLA fuses it into the records' scatter
    k_cache = append_records(k_cache, keys, slot, mode, length, pos if params.readout == "mma" else None)
    return y, checkpoint, u_cache, k_cache, g_cache, cursors
