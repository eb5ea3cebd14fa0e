"""Fused ReplaySSM decode step (GDN and KDA): replay readout, append or flush, one launch.

Grid `(B, H_v, d_v // BV)` (launched reversed with a row-slowest `grid_order`; the row
axis in `row_order` with `GridOrder.LAUNCH_ORDER`): one program per (row, value head,
BV-row tile of the state), working on whole rows. Each program

1. reads its row's slot, cursor `pos` and mode (padding / append / flush);
2. loads the checkpoint tile `S_c [BV, d_k]` once;
3. computes the readout of the live state without forming it. With
   `S_{t-1} = S_c diag(e^G) + sum_j u_j (W_j * k_j)^T` (G = sum_{j<pos} g_j,
   W_j = exp(sum_{j<i<pos} g_i)),

       S_{t-1} x = sum_j u_j (k_j . (W_j * x)) + S_c (e^G * x)

   for x = alpha*k and x = alpha*q, walking the valid cache entries backwards in chunks of C
   (masked loads: stale entries cost no bytes; registers do not grow with L) while x picks
   up each chunk's decay; then `u = beta (v - S_{t-1}(alpha k))`,
   `y = S_{t-1}(alpha q) + u (k . q)`;
4. append rows store `u` at `pos` (and, from one program per key head, `k` and `g`);
   flush rows rebuild the tile on chip from the `S_c` already in registers (entry by entry
   in exact fp32, or chunk by chunk with `[BV, C] x [C, d_k]` tensor-core products) and
   write `S_t = S_{t-1} diag(alpha) + u k^T` in place. The checkpoint is read from memory
   once per step, flush or not.

Reads and writes of the state go through the aliased output refs only (in place).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
from jaxtyping import Array, Float, Int

from pallas_kernels import common
from pallas_kernels.common import GridOrder, TokenSpec


@dataclasses.dataclass(frozen=True)
class ReplayTileParams:
    """Launch parameters of `replay_decode` (one program per value-head tile, whole rows).

    Attributes:
      block_v: BV, value rows of the state per program (a power of two; capped at d_v;
        >= 16 for the tensor-core rebuild precisions).
      num_warps: warps per program.
      num_stages: Triton software-pipelining depth of the cache loops.
      cache_chunk: C, cache entries loaded per iteration of the replay loops (a power of
        two; >= 16 for the tensor-core rebuild precisions), so registers stay bounded for
        any L.
      rebuild_precision: how a flush rebuilds the live state tile:
        "ieee": fp32 on CUDA cores, `S_c diag(e^G) + sum_j u_j (W_j * k_j)^T` one cached
          entry at a time, newest first (one fused multiply-add per tile element and entry);
        "tf32": `[BV, C] x [C, d_k]` products on tensor cores in tf32 (~1e-3 relative on
          the rebuilt part);
        "bf16": the same products with operands rounded to bf16 (~1e-2).
      rebuild_unroll: U, cache entries the "ieee" rebuild loads per memory round trip (then
        applied in order, so the result is the same for every U); larger U costs registers.
      grid_order: ROW_FASTEST, ROW_SLOWEST or LAUNCH_ORDER.
    """

    block_v: int = 16
    num_warps: int = 2
    num_stages: int = 1
    cache_chunk: int = 16
    rebuild_precision: common.Precision = "ieee"
    rebuild_unroll: int = 1
    grid_order: GridOrder = GridOrder.ROW_FASTEST

    def __post_init__(self) -> None:
        common.check_launch(self, (GridOrder.ROW_FASTEST, GridOrder.ROW_SLOWEST, GridOrder.LAUNCH_ORDER))
        common.check_power_of_two("cache_chunk", self.cache_chunk)
        if not common.is_int(self.num_stages) or self.num_stages < 1:
            raise ValueError(f"num_stages must be an int >= 1, got {self.num_stages!r}")
        common.check_rebuild(self, {"block_v": self.block_v, "cache_chunk": self.cache_chunk})


def _load_chunk(spec, refs, slot, h, cols, start, chunk, pos):
    """Cache entries `start .. start+C-1` of the slot (zeros at and past `pos`).

    Returns `(k [C, Dk], u [C, BV], g [C] or [C, Dk])` in float32.
    """
    ucache_ref, kcache_ref, gcache_ref = refs
    rows = start + jnp.arange(chunk)
    live = rows < pos
    entries = pl.ds(start, chunk)
    k_c = plgpu.load(kcache_ref.at[slot, h // spec.group_size, entries, :], mask=live[:, None], other=0.0)
    u_c = plgpu.load(ucache_ref.at[slot, h, entries, cols], mask=live[:, None], other=0.0)
    if spec.per_channel_gate:
        g_c = plgpu.load(gcache_ref.at[slot, h, entries, :], mask=live[:, None], other=0.0)
    else:
        g_c = plgpu.load(gcache_ref.at[slot, h, entries], mask=live, other=0.0)
    return k_c.astype(jnp.float32), u_c.astype(jnp.float32), g_c


def _suffix_weights(g_c, live_rows):
    """`exp(sum_{j<i<C} g_i)` per entry j of a chunk, 0 on masked rows; and the chunk's sum."""
    total = jnp.sum(g_c, axis=0)
    suffix = total - jnp.cumsum(g_c, axis=0)
    mask = live_rows[:, None] if g_c.ndim == 2 else live_rows
    return jnp.where(mask, jnp.exp(suffix), 0.0), total


def weighted_keys(k_c, weights):
    return k_c * (weights if weights.ndim == 2 else weights[:, None])


def _live_readout(spec, refs, slot, h, cols, pos, s_c, xs, chunk):
    """`S_{t-1} x` for each x in `xs` (each `[Dk]`), walking the cache backwards; and `e^G`
    (scalar, or `[Dk]` for KDA), the decay of the checkpoint over the valid entries."""
    num_chunks = (pos + chunk - 1) // chunk

    def body(i, carry):
        outs, decay = carry
        start = (num_chunks - 1 - i) * chunk
        k_c, u_c, g_c = _load_chunk(spec, refs, slot, h, cols, start, chunk, pos)
        weights, total = _suffix_weights(g_c, start + jnp.arange(chunk) < pos)
        wk = weighted_keys(k_c, weights)
        outs = tuple(o + jnp.sum(u_c * jnp.sum(wk * (decay * x)[None, :], axis=1)[:, None], axis=0)
                     for o, x in zip(outs, xs))
        return outs, decay * jnp.exp(total)

    zeros = tuple(jnp.zeros((s_c.shape[0],), jnp.float32) for _ in xs)
    decay0 = jnp.ones((s_c.shape[1],), jnp.float32) if spec.per_channel_gate else jnp.float32(1.0)
    outs, decay = jax.lax.fori_loop(0, num_chunks, body, (zeros, decay0))
    return tuple(o + jnp.sum(s_c * (decay * x)[None, :], axis=1) for o, x in zip(outs, xs)), decay


def rebuild_exact(spec, refs, slot, h, cols, slices, pos, s_c, decay_total, unroll: int = 1):
    """S_{t-1} tile in fp32 on CUDA cores: `S_c diag(e^G) + sum_j u_j (W_j * k_j)^T`.

    `s_c` and the result are column chunks `[BV, W]`; `decay_total` is `e^G` (scalar, or
    chunks `[W]` for KDA). The entries are walked newest first, so `W_j` is a running
    product of the later entries' decays and each entry costs one fused multiply-add per
    tile element. Each iteration loads `unroll` entries at once (independent loads; a
    masked entry, u = 0 and g = 0, leaves the tile and the running decay unchanged
    exactly), so a flush waits on ceil(pos / unroll) memory round trips.
    """
    ucache_ref, kcache_ref, gcache_ref = refs
    hk = h // spec.group_size

    def masked(ref, live):
        return plgpu.load(ref, mask=jnp.full(ref.shape, live), other=0.0).astype(jnp.float32)

    def load_entry(j):
        live = j >= 0
        row = jnp.maximum(j, 0)  # in bounds for the masked lanes' address
        u_j = masked(ucache_ref.at[slot, h, row, cols], live)
        k_j = tuple(masked(kcache_ref.at[slot, hk, row, c], live) for c in slices)
        if spec.per_channel_gate:
            g_j = tuple(masked(gcache_ref.at[slot, h, row, c], live) for c in slices)
        else:
            g_j = jnp.where(live, gcache_ref[slot, h, row], 0.0)
        return u_j, k_j, g_j

    def body(i, carry):
        state, weight = carry  # weight: W_j of the next entry, scalar or chunks [W]
        entries = [load_entry(pos - 1 - i * unroll - e) for e in range(unroll)]
        for u_j, k_j, g_j in entries:
            if spec.per_channel_gate:
                state = common.add_outer(state, u_j, common.scale_vector(k_j, weight))
                weight = common.scale_vector(weight, common.gate_map(jnp.exp, g_j))
            else:
                state = common.add_outer(state, weight * u_j, k_j)
                weight = weight * jnp.exp(g_j)
        return state, weight

    if spec.per_channel_gate:
        weight0 = tuple(jnp.ones((c.size,), jnp.float32) for c in slices)
    else:
        weight0 = jnp.float32(1.0)
    state0 = common.scale_columns(s_c, decay_total)
    state, _ = jax.lax.fori_loop(0, (pos + unroll - 1) // unroll, body, (state0, weight0))
    return state


def _rebuild_dot(spec, refs, slot, h, cols, pos, s_c, chunk, precision):
    """S_{t-1} tile as `S_c e^G + sum_chunks U_c^T (W_c * K_c)` on tensor cores."""
    num_chunks = (pos + chunk - 1) // chunk

    def body(i, carry):
        acc, decay = carry  # decay: exp(sum of g over later chunks), scalar or [Dk]
        start = (num_chunks - 1 - i) * chunk
        k_c, u_c, g_c = _load_chunk(spec, refs, slot, h, cols, start, chunk, pos)
        weights, total = _suffix_weights(g_c, start + jnp.arange(chunk) < pos)
        wk = weighted_keys(k_c, weights) * common.over_rows(spec, decay)
        return acc + common.rebuild_dot(u_c.T, wk, precision), decay * jnp.exp(total)

    decay0 = jnp.ones((s_c.shape[1],), jnp.float32) if spec.per_channel_gate else jnp.float32(1.0)
    acc, decay = jax.lax.fori_loop(0, num_chunks, body, (jnp.zeros_like(s_c), decay0))
    return acc + s_c * common.over_rows(spec, decay)


def write_flushed_tile(ckpt_ref, slot, h, cols, slices, prev, alpha, u, ks):
    """Store `S_t = S_{t-1} diag(alpha) + u k^T` (prev = S_{t-1} tile, column chunks;
    alpha a scalar or chunks) into the checkpoint.

    Pass `slot` freshly read from the slot ref, not the value the tile was loaded with:
    then the compiler rebuilds the store's per-element address tensor here instead of
    keeping the load's alive across the readout and the rebuild (ptxas, sm_90a, grouped
    kernel at BV = 32, 4 warps: 155 -> 128 registers per thread).
    """
    new = common.add_outer(common.scale_columns(prev, alpha), u, ks)
    common.store_chunks(ckpt_ref, (slot, h, cols), slices, new)


def append_gate(spec, gcache_ref, slot, h, slices, pos, g):
    """Store this token's log-decay (scalar, or chunks for KDA) at cache position `pos`."""
    if spec.per_channel_gate:
        common.store_chunks(gcache_ref, (slot, h, pos), slices, g)
    else:
        gcache_ref[slot, h, pos] = g


def append_key(kcache_ref, slot, hk, slices, pos, ks):
    """Store this token's (normalised) key chunks at cache position `pos`."""
    common.store_chunks(kcache_ref, (slot, hk, pos), slices, ks)


def append_entry(spec, cache_refs, slot, h, tile, cols, slices, pos, u, g, ks):
    """Store this token's cache entry at position `pos` from the program of value head h's
    tile `tile` (rows `cols`): its u rows; g from tile 0; k from tile 0 of the first value
    head of each key head (once per key head, not once per value head)."""
    ucache_ref, kcache_ref, gcache_ref = cache_refs
    ucache_ref[slot, h, pos, cols] = u.astype(ucache_ref.dtype)

    @pl.when(tile == 0)
    def _append_gate():
        append_gate(spec, gcache_ref, slot, h, slices, pos, g)

    @pl.when((tile == 0) & (h % spec.group_size == 0))
    def _append_key():
        append_key(kcache_ref, slot, h // spec.group_size, slices, pos, ks)


def _replay_kernel(
    row_ref, slot_ref, pos_ref, mode_ref, q_ref, k_ref, g_ref, beta_ref, v_ref, a_log_ref, dt_bias_ref,
    _ckpt_in, _u_in, _k_in, _g_in,
    y_ref, ckpt_ref, ucache_ref, kcache_ref, gcache_ref,
    *, spec: TokenSpec, block_v: int, chunk: int, precision: str, unroll: int, grid_order: GridOrder,
):
    launch, h, tile = common.program_ids(grid_order)
    b = common.launch_row(row_ref, launch, grid_order)  # slot, cursor, mode: in launch order
    cols = pl.ds(tile * block_v, block_v)
    whole = (pl.ds(0, q_ref.shape[2]),)  # this kernel works on whole rows: one column chunk
    mode = mode_ref[launch]
    cache_refs = (ucache_ref, kcache_ref, gcache_ref)

    @pl.when(mode == common.MODE_PAD)
    def _padding_row():
        y_ref[b, h, cols] = jnp.zeros((block_v,), y_ref.dtype)

    @pl.when(mode != common.MODE_PAD)
    def _live_row():
        slot, pos = slot_ref[launch], pos_ref[launch]
        (q,), (k,), k_dot_q, g, beta = common.load_token(
            spec, (q_ref, k_ref, g_ref, beta_ref, a_log_ref, dt_bias_ref), b, h, whole
        )
        v = v_ref[b, h, cols].astype(jnp.float32)
        s_c = ckpt_ref[slot, h, cols, :].astype(jnp.float32)  # [BV, Dk]
        alpha = common.gate_map(jnp.exp, g)
        (alpha_row,) = alpha if spec.per_channel_gate else (alpha,)
        (s_k, s_q), decay_total = _live_readout(
            spec, cache_refs, slot, h, cols, pos, s_c, (alpha_row * k, alpha_row * q), chunk
        )
        u = beta * (v - s_k)
        y_ref[b, h, cols] = (s_q + u * k_dot_q).astype(y_ref.dtype)

        @pl.when(mode == common.MODE_FLUSH)
        def _flush():
            if precision == "ieee":
                decay = (decay_total,) if spec.per_channel_gate else decay_total
                prev = rebuild_exact(spec, cache_refs, slot, h, cols, whole, pos, (s_c,), decay, unroll)
            else:
                prev = (_rebuild_dot(spec, cache_refs, slot, h, cols, pos, s_c, chunk, precision),)
            write_flushed_tile(ckpt_ref, slot_ref[launch], h, cols, whole, prev, alpha, u, (k,))

        @pl.when(mode == common.MODE_APPEND)
        def _append():
            append_entry(spec, cache_refs, slot, h, tile, cols, whole, pos, u, g, (k,))


def replay_decode(
    checkpoint: Float[Array, "N Hv Dv Dk"],
    u_cache: Float[Array, "N Hv L Dv"],
    k_cache: Float[Array, "N Hk L Dk"],
    g_cache: Float[Array, "N Hv L *Dk"],
    q: Float[Array, "B Hk Dk"],
    k: Float[Array, "B Hk Dk"],
    v: Float[Array, "B Hv Dv"],
    g: Float[Array, "B Hv *Dk"],
    beta: Float[Array, "B Hv"],
    slot: Int[Array, " B"],
    pos: Int[Array, " B"],
    mode: Int[Array, " B"],
    *,
    row_order: Int[Array, " B"] | None = None,
    use_qk_l2norm: bool = False,
    scale: float | None = None,
    gate_params: tuple[Array, Array] | None = None,
    params: ReplayTileParams = ReplayTileParams(),
    interpret: bool | None = None,
):
    """One fused ReplaySSM decode step of one layer.

    Args:
      checkpoint, u_cache, k_cache, g_cache: the layer's state arrays (updated in place
        when donated).
      q, k: `[B, H_k, d_k]`; v: `[B, H_v, d_v]`.
      g: log-decay `[B, H_v]` (GDN) or `[B, H_v, d_k]` (KDA); with `gate_params`, the raw
        gate input `a` of the same shape.
      beta: `[B, H_v]`; with `gate_params`, the raw `b` (beta = sigmoid(b)).
      slot: `[B]` int32 slot of each row (any valid index on padding rows).
      pos: `[B]` int32 valid cache entries of the row's slot.
      mode: `[B]` int32, `common.MODE_PAD` / `MODE_APPEND` / `MODE_FLUSH`.
      row_order: `[B]` int permutation of the rows, required with
        `GridOrder.LAUNCH_ORDER` (and refused otherwise): the grid's row axis, launched
        slowest, serves the rows in this order, e.g. costliest first.
      use_qk_l2norm, scale: as in `decode_step`.
      gate_params: `(A_log [H_v], dt_bias [H_v] or [H_v, d_k])` to compute the gates in the
        kernel from raw `a`, `b`.
      params: tile, warps, stages, cache chunk, rebuild precision and grid order.
      interpret: run the kernel in the Pallas interpreter (default: off GPU).

    Returns:
      `(y [B, H_v, d_v] in v's dtype, checkpoint, u_cache, k_cache, g_cache)`.
    """
    batch, num_v_heads, head_v_dim = v.shape
    per_channel = g_cache.ndim == 4
    params = common.for_head_dim(params, head_v_dim)
    spec = common.token_spec(
        q, v, per_channel_gate=per_channel, gate_params=gate_params,
        use_qk_l2norm=use_qk_l2norm, scale=scale,
    )
    a_log, dt_bias = common.gate_param_inputs(gate_params)
    kernel = functools.partial(
        _replay_kernel,
        spec=spec,
        block_v=params.block_v,
        chunk=params.cache_chunk,
        precision=params.rebuild_precision,
        unroll=params.rebuild_unroll,
        grid_order=params.grid_order,
    )
    return common.decode_call(
        kernel,
        grid=(batch, num_v_heads, head_v_dim // params.block_v),
        inputs=(*common.launch_rows(slot, pos, mode, row_order, params.grid_order),
                q, k, g, beta, v, a_log, dt_bias),
        state=(checkpoint, u_cache, k_cache, g_cache),
        y_like=v, num_warps=params.num_warps, num_stages=params.num_stages,
        grid_order=params.grid_order, interpret=interpret, name="replayssm_replay_decode",
    )
