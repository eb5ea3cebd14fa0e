"""Fused ReplaySSM decode step (GDN and KDA): replay readout, append or flush, one launch.

Grid `(B, H_v, d_v // BV)`: one program per (row, value head, BV-row tile of the state).
Each program

1. reads its row's slot, cursor `pos` and mode (padding / append / flush);
2. loads the checkpoint tile `S_c [BV, d_k]` and the `pos` valid cache entries
   (`u [L, BV]`, the key head's `k [L, d_k]`, `g`): the loads are masked by `j < pos`, so
   stale entries cost no bytes;
3. computes the readout of the live state without forming it. With
   `S_{t-1} = S_c diag(e^G) + sum_j u_j (W_j * k_j)^T` (G = sum g_j, W_j = e^{G - c_j}),

       S_{t-1} x = S_c (e^G * x) + U^T ((W * K) x),

   for x = alpha*k and x = alpha*q: `u = beta (v - S_{t-1}(alpha k))`,
   `y = S_{t-1}(alpha q) + u (k . q)`;
4. append rows store `u` at `pos` (and, from one program per key head, `k` and `g`);
   flush rows rebuild the tile on chip with the `[BV, L] x [L, d_k]` product (at the
   configured precision) and write `S_t = S_{t-1} diag(alpha) + u k^T` in place. The
   checkpoint tile is read from memory once per step, flush or not.

Reads and writes of the state go through the aliased output refs only (in place).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
from jaxtyping import Array, Float, Int

from pallas_kernels import common
from pallas_kernels.common import KernelConfig, TokenSpec


def cache_block_len(cache_len: int) -> int:
    """Rows of the cache block a program loads: a power of two >= 16 (dot K dimension).

    Rows at or past the cursor are masked, so padding the block costs no memory traffic.
    """
    return max(common.next_power_of_two(cache_len), common.MIN_DOT_DIM)


def _replay_kernel(
    slot_ref, pos_ref, mode_ref, q_ref, k_ref, g_ref, beta_ref, v_ref, a_log_ref, dt_bias_ref,
    _ckpt_in, _u_in, _k_in, _g_in,
    y_ref, ckpt_ref, ucache_ref, kcache_ref, gcache_ref,
    *, spec: TokenSpec, block_v: int, cache_block: int, precision: str,
):
    b, h, tile = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    cols = pl.ds(tile * block_v, block_v)
    mode = mode_ref[b]

    @pl.when(mode == common.MODE_PAD)
    def _padding_row():
        y_ref[b, h, cols] = jnp.zeros((block_v,), y_ref.dtype)

    @pl.when(mode != common.MODE_PAD)
    def _live_row():
        slot, pos = slot_ref[b], pos_ref[b]
        hk = h // spec.group_size
        q, k, g, beta = common.load_token(
            spec, (q_ref, k_ref, g_ref, beta_ref, a_log_ref, dt_bias_ref), b, h
        )
        v = v_ref[b, h, cols].astype(jnp.float32)
        s_c = ckpt_ref[slot, h, cols, :].astype(jnp.float32)  # [BV, Dk]

        rows = jnp.arange(cache_block)
        live = rows < pos  # [Lb]
        live2 = live[:, None]
        entries = pl.ds(0, cache_block)
        k_c = plgpu.load(kcache_ref.at[slot, hk, entries, :], mask=live2, other=0.0)
        u_c = plgpu.load(ucache_ref.at[slot, h, entries, cols], mask=live2, other=0.0)
        if spec.per_channel_gate:
            g_c = plgpu.load(gcache_ref.at[slot, h, entries, :], mask=live2, other=0.0)
        else:
            g_c = plgpu.load(gcache_ref.at[slot, h, entries], mask=live, other=0.0)
        k_c, u_c = k_c.astype(jnp.float32), u_c.astype(jnp.float32)

        prefix = jnp.cumsum(g_c, axis=0)  # c_j (rows past pos add 0)
        total = jnp.sum(g_c, axis=0)  # G
        if spec.per_channel_gate:
            weights = jnp.where(live2, jnp.exp(total[None, :] - prefix), 0.0)  # [Lb, Dk]
            wk = weights * k_c
        else:
            weights = jnp.where(live, jnp.exp(total - prefix), 0.0)  # [Lb]
            wk = weights[:, None] * k_c
        ckpt_decay = jnp.exp(total)  # scalar (GDN) or [Dk] (KDA)
        alpha = jnp.exp(g)

        def live_state_times(x):  # S_{t-1} x without forming S_{t-1}: [BV]
            from_ckpt = jnp.sum(s_c * (ckpt_decay * x)[None, :], axis=1)
            coef = jnp.sum(wk * x[None, :], axis=1)  # [Lb]
            return from_ckpt + jnp.sum(u_c * coef[:, None], axis=0)

        u = beta * (v - live_state_times(alpha * k))
        y = live_state_times(alpha * q) + u * jnp.sum(k * q)
        y_ref[b, h, cols] = y.astype(y_ref.dtype)

        @pl.when(mode == common.MODE_FLUSH)
        def _flush():
            rebuilt = common.rebuild_dot(u_c.T, wk, precision)  # [BV, Dk]
            decay_row = ckpt_decay[None, :] if spec.per_channel_gate else ckpt_decay
            alpha_row = alpha[None, :] if spec.per_channel_gate else alpha
            prev = s_c * decay_row + rebuilt
            new = prev * alpha_row + u[:, None] * k[None, :]
            ckpt_ref[slot, h, cols, :] = new.astype(ckpt_ref.dtype)

        @pl.when(mode == common.MODE_APPEND)
        def _append():
            ucache_ref[slot, h, pos, cols] = u.astype(ucache_ref.dtype)

            @pl.when(tile == 0)
            def _append_gate():
                if spec.per_channel_gate:
                    gcache_ref[slot, h, pos, :] = g
                else:
                    gcache_ref[slot, h, pos] = g

            @pl.when((tile == 0) & (h % spec.group_size == 0))
            def _append_key():  # once per key head, not once per value head
                kcache_ref[slot, hk, pos, :] = k.astype(kcache_ref.dtype)


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
    use_qk_l2norm: bool = False,
    scale: float | None = None,
    gate_params: tuple[Array, Array] | None = None,
    config: KernelConfig = KernelConfig(),
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
      use_qk_l2norm, scale: as in `decode_step`.
      gate_params: `(A_log [H_v], dt_bias [H_v] or [H_v, d_k])` to compute the gates in the
        kernel from raw `a`, `b`.
      config: tile, warps, stages and rebuild precision.
      interpret: run the kernel in the Pallas interpreter (default: off GPU).

    Returns:
      `(y [B, H_v, d_v] in v's dtype, checkpoint, u_cache, k_cache, g_cache)`.
    """
    batch, num_v_heads, head_v_dim = v.shape
    per_channel = g_cache.ndim == 4
    config = config.for_head_dim(head_v_dim)
    spec = common.token_spec(
        q, v, per_channel_gate=per_channel, gate_params=gate_params,
        use_qk_l2norm=use_qk_l2norm, scale=scale,
    )
    a_log, dt_bias = common.gate_param_inputs(gate_params)
    kernel = functools.partial(
        _replay_kernel,
        spec=spec,
        block_v=config.block_v,
        cache_block=cache_block_len(u_cache.shape[2]),
        precision=config.rebuild_precision,
    )
    inputs = (slot, pos, mode, q, k, g, beta, v, a_log, dt_bias,
              checkpoint, u_cache, k_cache, g_cache)
    state_first = len(inputs) - 4
    out_shape = (
        jax.ShapeDtypeStruct(v.shape, v.dtype),
        *(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in inputs[state_first:]),
    )
    return pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=(batch, num_v_heads, head_v_dim // config.block_v),
        in_specs=[common.any_spec()] * len(inputs),
        out_specs=[common.any_spec()] * len(out_shape),
        input_output_aliases={state_first + i: 1 + i for i in range(4)},
        compiler_params=config.compiler_params(),
        interpret=common.default_interpret() if interpret is None else interpret,
        name="replayssm_decode",
    )(*inputs)
