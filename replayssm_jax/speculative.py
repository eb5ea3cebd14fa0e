"""Speculative verify with ReplaySSM: score a draft window from checkpoint + cache, keep the
accepted prefix by moving the cursor.

`verify_step` takes T draft tokens per row and returns the outputs of all T positions, as T
sequential decode steps would, and appends the T records `(u_i, k_i, g_i)` at
`write_pos .. write_pos + T - 1` without writing the checkpoint and without moving the
cursor. `accept` then moves each row's cursor by its own count `n` (0..T, the bonus token
included): the first `n` records become history, the others lie beyond the cursor and are
never read again. A rejected draft therefore costs nothing to roll back, where conventional
speculation writes one full state per draft token.

Window math for one row and value head (method notes §13), with `S` the live state before
the window, `anc(i)` the window positions before `i` that position `i` sees (all `j < i`
for a chain, the ancestors of `i` for a tree) and `G_i` the sum of `g` over `anc(i)` and
`i` (per key channel for KDA; a per-head decay is broadcast over the channels):

    R_i  = beta_i (v_i - S (exp(G_i) * k_i))
    A_ij = beta_i sum_c k_i[c] exp(G_i[c] - G_j[c]) k_j[c]        for j in anc(i), else 0
    U    = (I + A)^{-1} R                                        (forward substitution)
    y_i  = S (exp(G_i) * q_i) + sum_{j in anc(i) + {i}} (sum_c q_i[c] exp(G_i[c] - G_j[c]) k_j[c]) u_j

`u_i` are the corrected values sequential decode along `i`'s branch would produce, so the
appended records are the ones it would have cached.

Capacity rule: the ring holds L records. A live row whose `write_pos + length > L` cannot
append its window behind its history; it folds its history (accepted records only: the
window is not yet in the ring) into the checkpoint first, in the same step, and writes the
window at `0 .. length - 1`; its cursor becomes 0 in the returned state. The decision is
made per row on the device, so one compiled executable serves every mix of rows. A window
wider than the ring (`T > L`) is refused, and so is any window on a ring of one (`L = 1`):
its accepted token would sit in the cache with the cursor at 1, but at L = 1 the
pallas_triton decode step is the plain kernel on the checkpoint, which reads no cache (the
next step would drop the token); with `T = L = 1` there is no draft to verify anyway.

Flush policy: verify always plans by the capacity rule above (the natural policy for a
window): a window is never folded before it is verified, since a fold writes only records
the caller has accepted. `FlushPolicy.EVERY_STEP` does not apply to verify.

Trees: `parents [B, T]` gives each draft position's parent index (-1: a child of the
current state; `parents[i] < i`). `accept(..., path=...)` takes the accepted root-to-leaf
positions and copies their records to `write_pos .. write_pos + n - 1`, so the next step
replays exactly the accepted tokens.

Mamba-2 (gate "mamba2", the additive rule): the update `dt x B^T` does not read the state,
so there is no delta-rule correction and the window is a masked sum. With `Gamma_i` the sum
of dt over `anc(i)` and `i`,

    y_i = exp(A Gamma_i) S C_i + sum_{j in anc(i) + {i}} dt_j exp(A (Gamma_i - Gamma_j)) (B_j . C_i) x_j
          + D x_i                                             (times silu(z_i) when z is given)

and the records are the raw `(x_i, B_i, dt_i)` (dt after the softplus), as decode caches
them. Capacity rule, folds, padding, trees and `accept` are as above. Mamba-2 verifies on the
xla backend and on "mosaic_gpu" (`mamba2_verify_decode_mgpu`); "pallas_triton" has no Mamba-2
window readout.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int

from replayssm_jax import gating
from pallas_kernels import common
from pallas_kernels.mosaic_gpu.mamba2_decode import MosaicMamba2Params
from pallas_kernels.mosaic_gpu.replay_decode import MosaicReplayParams
from pallas_kernels.mosaic_gpu.verify_decode import verify_decode_mgpu
from pallas_kernels.mosaic_gpu.verify_decode_kda import verify_decode_kda_mgpu
from pallas_kernels.mosaic_gpu.verify_decode_mamba2 import mamba2_verify_decode_mgpu
from pallas_kernels.verify_readout import VerifyReadoutParams, verify_readout
from replayssm_jax.backends import auto, mosaic_gpu, pallas_triton, xla
from replayssm_jax.plan import launch_order, plan_step
from replayssm_jax.state import ReplayState, check_state
from replayssm_jax.tokens import Mamba2Params, Mamba2Tokens, Tokens, check_gate_params
from replayssm_jax.validation import check_array, check_slots, concrete_or_none, debug_check

VERIFY_BACKENDS = ("xla", "pallas_triton", "mosaic_gpu", "auto")
_HIGHEST = jax.lax.Precision.HIGHEST


def check_window(config, window: Tokens | Mamba2Tokens) -> tuple[int, int]:
    """Raise ValueError naming the field of `window` whose shape or dtype is wrong; return
    `(B, T)`."""
    additive = config.gate_kind.additive
    kind, lead, lead_shape = (Mamba2Tokens, "x", "[B, T, H, P]") if additive else (Tokens, "q", "[B, T, H_k, d_k]")
    if not isinstance(window, kind):
        raise ValueError(f"window must be a {kind.__name__} for gate {config.gate!r}, got {type(window).__name__}")
    check_array(f"window.{lead}", getattr(window, lead), (None,) * 4, layout=lead_shape)
    batch, width = jnp.shape(getattr(window, lead))[:2]
    shapes = config.gate_kind.token_shapes(config, batch)
    for name, want in shapes.items():
        check_array(f"window.{name}", getattr(window, name), (batch, width, *want[1:]), float)
    if additive and window.z is not None:
        check_array("window.z", window.z, (batch, width, *shapes["x"][1:]), float)
    return batch, width


def _check_int_array(
    name: str, x: Array, shape: tuple[int | None, ...], layout: str | None = None
) -> np.ndarray | None:
    """An integer array of `shape` (`layout`: as in `check_array`); its value when concrete."""
    check_array(name, x, shape, int, layout=layout)
    return concrete_or_none(x)


def check_lengths(lengths: Array | None, batch: int, width: int) -> None:
    if lengths is None:
        return
    values = _check_int_array("lengths", lengths, (batch,))
    n = jnp.asarray(lengths, jnp.int32)
    debug_check(jnp.all((n >= 0) & (n <= width)),
                f"lengths must lie in [0, {width}] (the window width): {{n}}", n=n)
    if values is not None and (np.any(values < 0) or np.any(values > width)):
        raise ValueError(f"lengths must lie in [0, {width}] (the window width), got {values.tolist()}")


def check_parents(parents: Array | None, batch: int, width: int) -> None:
    """Each position's parent precedes it: `-1 <= parents[:, i] < i`."""
    if parents is None:
        return
    values = _check_int_array("parents", parents, (batch, width))
    p = jnp.asarray(parents, jnp.int32)
    debug_check(jnp.all((p >= -1) & (p < jnp.arange(width))),
                "parents must be -1 or an earlier position: {p}", p=p)
    if values is None:
        return
    bad = (values < -1) | (values >= np.arange(width)[None, :])
    if np.any(bad):
        row, col = map(int, np.argwhere(bad)[0])
        raise ValueError(
            f"parents[{row}, {col}] = {int(values[row, col])}: a parent must be -1 or an "
            f"earlier position (< {col})"
        )


def ancestors(parents: Int[Array, "B T"] | None, batch: int, width: int
              ) -> Bool[Array, "B T T"] | Bool[np.ndarray, "B T T"]:
    """`anc[b, i, j]`: window position j precedes i on i's branch (strict). None: a chain,
    as a NumPy array with its batch copies in memory: a constant in the compiled step (XLA
    does not fold a broadcast, and JAX stages a NumPy array of zero strides as one, so a
    broadcast chain mask would cost a kernel launch every step)."""
    if parents is None:
        chain = np.arange(width)[None, :] < np.arange(width)[:, None]
        return np.tile(chain, (batch, 1, 1))
    parents = parents.astype(jnp.int32)
    anc = jnp.zeros((batch, width, width), bool)
    positions = jnp.arange(width)
    for i in range(width):  # parents[i] < i: row parents[i] is final before row i is formed
        p = parents[:, i]
        has_parent = p >= 0
        row = jnp.take_along_axis(anc, jnp.maximum(p, 0)[:, None, None], axis=1)[:, 0]
        row = (row | (positions[None, :] == p[:, None])) & has_parent[:, None]
        anc = anc.at[:, i].set(row)
    return anc


def window_decay(g: Float[Array, "B Hv T Dk"], anc: Bool[Array, "B T T"]) -> Float[Array, "B Hv T Dk"]:
    """`G_i`: the sum of g over `anc(i)` and `i`, per key channel."""
    seen = anc | jnp.eye(g.shape[2], dtype=bool)[None]  # anc(i) + {i}
    return jnp.einsum("bij,bhjc->bhic", seen.astype(g.dtype), g, precision=_HIGHEST)


def window_solve(
    SK: Float[Array, "B Hv T Dv"],
    SQ: Float[Array, "B Hv T Dv"],
    q: Float[Array, "B Hv T Dk"],
    k: Float[Array, "B Hv T Dk"],
    v: Float[Array, "B Hv T Dv"],
    G: Float[Array, "B Hv T Dk"],
    beta: Float[Array, "B Hv T"],
    anc: Bool[Array, "B T T"],
) -> tuple[Float[Array, "B Hv T Dv"], Float[Array, "B Hv T Dv"]]:
    """`(y, u)` of every window position from the readouts `SK_i = S (exp(G_i) * k_i)` and
    `SQ_i = S (exp(G_i) * q_i)` of the live state (formulas in the module doc)."""
    width = q.shape[2]
    seen = anc | jnp.eye(width, dtype=bool)[None]
    # exp(G_i - G_j) only where j is on i's branch (<= 1 there); elsewhere the difference
    # can be large and positive, so it is zeroed before the exponential.
    mask = seen[:, None, :, :, None]
    diff = jnp.where(mask, G[:, :, :, None, :] - G[:, :, None, :, :], 0.0)
    decay = jnp.where(mask, jnp.exp(diff), 0.0)  # [B, Hv, T(i), T(j), Dk]
    KK = jnp.einsum("bhic,bhijc,bhjc->bhij", k, decay, k, precision=_HIGHEST)
    QK = jnp.einsum("bhic,bhijc,bhjc->bhij", q, decay, k, precision=_HIGHEST)
    A = jnp.where(anc[:, None], beta[..., None] * KK, 0.0)
    R = beta[..., None] * (v - SK)
    eye = jnp.eye(width, dtype=A.dtype)
    U = jax.scipy.linalg.solve_triangular(eye + A, R, lower=True, unit_diagonal=True)
    y = SQ + jnp.einsum("bhij,bhjv->bhiv", QK, U, precision=_HIGHEST)
    return y, U


def window_outputs(
    live: Float[Array, "B Hv Dv Dk"],
    q: Float[Array, "B Hv T Dk"],
    k: Float[Array, "B Hv T Dk"],
    v: Float[Array, "B Hv T Dv"],
    g: Float[Array, "B Hv T Dk"],
    beta: Float[Array, "B Hv T"],
    anc: Bool[Array, "B T T"],
) -> tuple[Float[Array, "B Hv T Dv"], Float[Array, "B Hv T Dv"]]:
    """`(y, u)` of every window position from the live state (formulas in the module doc);
    q, k expanded to value heads, q scaled, g per key channel, all float32."""
    G = window_decay(g, anc)
    SK = jnp.einsum("bhvc,bhic->bhiv", live, jnp.exp(G) * k, precision=_HIGHEST)
    SQ = jnp.einsum("bhvc,bhic->bhiv", live, jnp.exp(G) * q, precision=_HIGHEST)
    return window_solve(SK, SQ, q, k, v, G, beta, anc)


def verify_step(
    state: ReplayState,
    window: Tokens | Mamba2Tokens,
    slots: Int[Array, " B"],
    *,
    backend: str = "xla",
    lengths: Int[Array, " B"] | None = None,
    parents: Int[Array, "B T"] | None = None,
    use_qk_l2norm: bool = False,
    scale: float | None = None,
    gate_params: tuple[Array, Array] | Mamba2Params | None = None,
    kernel_params: VerifyReadoutParams | MosaicReplayParams | MosaicMamba2Params | None = None,
    interpret: bool | None = None,
) -> tuple[Float[Array, "B T Hv Dv"], ReplayState]:
    """Verify a draft window of T tokens per row (see the module doc for the math and the
    capacity rule).

    Args:
      state: the layer's `ReplayState`.
      window: `Tokens` with leading axes `[B, T]`: q, k `[B, T, H_k, d_k]`, v
        `[B, T, H_v, d_v]`, g `[B, T, H_v]` (GDN) or `[B, T, H_v, d_k]` (KDA), beta
        `[B, T, H_v]` (raw `a`, `b` with `gate_params`). Gate "mamba2": a `Mamba2Tokens`
        with leading axes `[B, T]` (x `[B, T, H, P]`, B, C `[B, T, G, N]`, raw dt
        `[B, T, H]`, optional z), with `gate_params=Mamba2Params(...)` (required).
      slots: `[B]` int, the physical slot of each row; negative = padding row (output 0,
        nothing written).
      backend: "xla" (the readable specification) or "pallas_triton": the readouts
        `S (exp(G_i) * k_i)`, `S (exp(G_i) * q_i)` of the live state (and, for folding rows,
        the folded checkpoint) from one `verify_readout` kernel launch, which reads each
        checkpoint tile once and never forms the live state in memory; the T x T solve,
        the outputs and the appends stay in XLA (they touch only `[B, H_v, T, .]` arrays);
        or "mosaic_gpu": the whole window in one `verify_decode_mgpu` (KDA:
        `verify_decode_kda_mgpu`; Mamba-2: `mamba2_verify_decode_mgpu`) launch (the
        readouts, the T x T solve or masked sum, the outputs, the records and the folds;
        it resets the folding rows' cursors) after the window's T x T scalars and the rows
        (from one Pallas Triton launch, `verify_coefficients`, where d_k (Mamba-2: N) is a
        power of two, else from XLA), plus XLA's scatter of the folding rows' records that
        other CTAs may still read (KDA: key and gate; GDN: key, with the tensor-core readout
        every row's; Mamba-2: B, and dt where P > 64); or "auto"
        (`backends.auto.verify_backend`: "mosaic_gpu" on a Hopper GPU, "xla" elsewhere).
      lengths: optional `[B]` int in [0, T]: positions >= lengths[b] are padding (output 0,
        no record written, no effect on the capacity rule). Default: T for every row.
      parents: optional `[B, T]` int tree: `parents[b, i]` in [-1, i), -1 for a child of
        the current state. Default: a chain (`parents[b, i] = i - 1`).
      use_qk_l2norm, scale, gate_params: as in `decode_step` (Mamba-2 takes no
        use_qk_l2norm or scale).
      kernel_params: with "pallas_triton", a `VerifyReadoutParams` in place of the launch
        table's row (step "verify"); with "mosaic_gpu", a `MosaicReplayParams` (Mamba-2: a
        `MosaicMamba2Params`) in place of `backends.mosaic_gpu.verify_default_params`.
      interpret: with a kernel backend, run the kernel in its interpreter (default: off
        GPU).

    Returns:
      `(y, new_state)`: y `[B, T, H_v, d_v]` in v's dtype (Mamba-2: `[B, T, H, P]` in x's
      dtype), y[b, i] the output of position i
      given its branch; new_state holds the window's records at `base .. base + length - 1`
      where `base` is the row's `write_pos`, or 0 for a row that folded (its checkpoint is
      then its live state before the window and its `write_pos` is 0). Other rows'
      checkpoints and every `write_pos` are otherwise unchanged: call `accept` next.

    Raises:
      ValueError: on a wrong shape or dtype, an unknown backend (Mamba-2: "pallas_triton";
        "mosaic_gpu": shapes its kernels cannot take),
        `T > L`, `L = 1`, lengths outside [0, T], a parent that does not precede its child, or
        (when slots are concrete) a slot out of range or named twice.
    """
    check_state(state)
    cfg = state.config
    batch, width = check_window(cfg, window)
    check_slots("slots", slots, batch, state.num_slots)
    check_lengths(lengths, batch, width)
    check_parents(parents, batch, width)
    check_gate_params(cfg, gate_params)
    # Array-likes (lists, NumPy int64) as the step's int32 arrays.
    slots, lengths, parents = (None if x is None else jnp.asarray(x, jnp.int32) for x in (slots, lengths, parents))
    if backend not in VERIFY_BACKENDS:
        raise ValueError(f"backend must be one of {VERIFY_BACKENDS} for verify_step, got {backend!r}")
    if backend == "auto":
        backend = auto.verify_backend(cfg)
    if cfg.cache_len < 2:
        raise ValueError("verify_step needs cache_len >= 2: at cache_len = 1 an accepted token stays in the "
                         "cache, which the pallas_triton decode step (the plain kernel at L = 1) never reads")
    if width > cfg.cache_len:
        raise ValueError(f"window width T = {width} exceeds the ring (cache_len = {cfg.cache_len})")
    if backend == "xla" and (kernel_params is not None or interpret is not None):
        raise ValueError("kernel_params and interpret apply to the kernel backends only")
    if cfg.gate_kind.additive:
        if backend == "pallas_triton":
            raise ValueError("verify_step for gate 'mamba2' runs on backend 'xla' or 'mosaic_gpu' (no Triton "
                             "kernel reads out a Mamba-2 window)")
        if use_qk_l2norm or scale is not None:
            raise ValueError("use_qk_l2norm and scale apply to the delta-rule gates, not to gate 'mamba2'")
    if backend == "pallas_triton":
        pallas_triton.check_kernel_shapes(cfg.head_k_dim, cfg.head_v_dim)
        kernel_params = pallas_triton.verify_params(cfg, batch, kernel_params)
    if backend == "mosaic_gpu":
        mosaic_gpu.check_config(cfg)
        want = MosaicMamba2Params if cfg.gate_kind.additive else MosaicReplayParams
        if kernel_params is not None and not isinstance(kernel_params, want):
            raise ValueError(f"kernel_params must be a {want.__name__} for backend 'mosaic_gpu' and gate "
                             f"{cfg.gate!r}, got {type(kernel_params).__name__}")
        token_dtype = window.x.dtype if cfg.gate_kind.additive else window.v.dtype
        kernel_params = kernel_params or mosaic_gpu.verify_default_params(cfg, batch, width, token_dtype,
                                                                          interpret=interpret)

    anc = ancestors(parents, batch, width)
    if backend == "mosaic_gpu":
        # The kernels form the rows from the caller's slots, cursors and lengths themselves.
        requested = np.full((batch,), width, np.int32) if lengths is None else lengths
        if cfg.gate_kind.additive:
            return _mosaic_mamba2_verify(state, window, gate_params, slots, requested, anc,
                                         kernel_params=kernel_params, interpret=interpret)
        return _mosaic_verify(state, window, slots, requested, anc, use_qk_l2norm=use_qk_l2norm, scale=scale,
                              gate_params=gate_params, kernel_params=kernel_params, interpret=interpret)
    plan, fold, in_window = _window_plan(state, slots, lengths, batch, width)
    if cfg.gate_kind.additive:
        y, records, checkpoint, pools = _mamba2_window(state, window, gate_params, plan, fold, in_window, anc)
    else:
        y, records, checkpoint, pools = _delta_window(state, window, plan, fold, in_window, anc, backend=backend,
                                                      use_qk_l2norm=use_qk_l2norm, scale=scale,
                                                      gate_params=gate_params, kernel_params=kernel_params,
                                                      interpret=interpret)
    return y, _append_window(state, plan, fold, in_window, checkpoint, pools, records)


def _window_plan(state: ReplayState, slots, lengths, batch: int, width: int):
    """`(plan, fold [B], in_window [B, T])`: the rows' plan, the rows the capacity rule
    folds and the positions that are not padding (none on padding rows)."""
    cfg = state.config
    plan = plan_step(state.write_pos, slots, None, cfg.cache_len)
    length = jnp.full((batch,), width, jnp.int32) if lengths is None else lengths
    length = jnp.where(plan.valid, length, 0)
    fold = plan.valid & (plan.pos + length > cfg.cache_len)
    in_window = jnp.arange(width)[None, :] < length[:, None]  # [B, T]
    return plan, fold, in_window


def _keeper(in_window: Bool[Array, "B T"]):
    """`x [B, T, ...]` with its padding positions (and padding rows) set to 0."""
    batch, width = in_window.shape
    return lambda x: jnp.where(in_window.reshape(batch, width, *([1] * (x.ndim - 2))), x, 0)


def _folded_live(state: ReplayState, plan, fold, live: Float[Array, "B Hv Dv Dk"]):
    """`(live, checkpoint)` of the xla backend: a folding row's live state is written to its
    checkpoint and its window is computed from the checkpoint as it is stored, so its
    records agree with what the next step replays from that checkpoint."""
    folded = live.astype(state.config.state_dtype)
    live = jnp.where(fold[:, None, None, None], folded.astype(jnp.float32), live)
    return live, common.set_rows(state.checkpoint, plan.slot, folded, fold)


def _delta_window(state, window: Tokens, plan, fold, in_window, anc, *, backend, use_qk_l2norm, scale,
                  gate_params, kernel_params, interpret):
    """The delta-rule window (GDN, KDA): `(y [B, T, H_v, d_v], records (u, k, g) [B, T, ...],
    checkpoint, (u, k, g cache pools to append to))`."""
    cfg = state.config
    batch, width = in_window.shape
    # Padding positions and rows are zeroed first: their garbage must not reach the solve
    # (a blocked triangular solve multiplies the zero entries of A with them).
    keep = _keeper(in_window)
    out_dtype = window.v.dtype
    window = xla.gate_tokens(cfg, window, gate_params)
    window = jax.tree.map(lambda x: keep(x.astype(jnp.float32)), window)
    q, k = gating.prepare_qk(window.q, window.k, use_qk_l2norm=use_qk_l2norm, scale=scale)
    heads = lambda x: jnp.moveaxis(xla.expand_heads(x, cfg.group_size, axis=2), 1, 2)
    g = xla.per_channel_decay(window.g, cfg.head_k_dim, cfg.per_channel_gate)  # [B, T, Hv, Dk]

    qh, kh, gh = heads(q), heads(k), jnp.moveaxis(g, 1, 2)
    vh, betah = jnp.moveaxis(window.v, 1, 2), jnp.moveaxis(window.beta, 1, 2)
    if backend == "xla":
        live, checkpoint = _folded_live(state, plan, fold, xla.replay_state(state, plan))
        # The appends do not depend on the replay's reads of the caches; tie the caches to
        # `live` so XLA orders the reads first and updates donated buffers in place (as in
        # `xla.layer_step`; without it the caches are copied every step).
        live, k_pool, g_pool = jax.lax.optimization_barrier((live, state.k_cache, state.g_cache))
        pools = (state.u_cache, k_pool, g_pool)
        y, u = window_outputs(live, qh, kh, vh, gh, betah, anc)
    else:
        y, u, checkpoint, pools = _pallas_window(
            state, plan, fold, qh, kh, vh, gh, betah, anc, kernel_params, interpret)
    y = keep(jnp.moveaxis(y, 2, 1)).astype(out_dtype)
    return y, (jnp.moveaxis(u, 2, 1), k, window.g), checkpoint, pools


def mamba2_window_outputs(
    live: Float[Array, "B H P N"],
    x: Float[Array, "B H T P"],
    B: Float[Array, "B H T N"],
    C: Float[Array, "B H T N"],
    dt: Float[Array, "B H T"],
    A: Float[Array, " H"],
    anc: Bool[Array, "B T T"],
) -> Float[Array, "B H T P"]:
    """The Mamba-2 window's outputs before the skip and the z gate (formula in the module
    doc), from the live state; B, C expanded to heads, dt after the softplus, float32."""
    width = x.shape[2]
    seen = (anc | jnp.eye(width, dtype=bool)[None])[:, None]  # [B, 1, T(i), T(j)]
    gamma = jnp.einsum("bij,bhj->bhi", seen[:, 0].astype(dt.dtype), dt, precision=_HIGHEST)
    log_a = A[None, :, None] * gamma  # A Gamma_i: [B, H, T]
    # exp(A (Gamma_i - Gamma_j)) only where j is on i's branch (<= 1 there); elsewhere the
    # difference can be large and positive, so it is zeroed before the exponential.
    diff = jnp.where(seen, log_a[:, :, :, None] - log_a[:, :, None, :], 0.0)
    weights = jnp.where(seen, dt[:, :, None, :] * jnp.exp(diff), 0.0)  # [B, H, T(i), T(j)]
    b_dot_c = jnp.einsum("bhjn,bhin->bhij", B, C, precision=_HIGHEST)
    s_c = jnp.einsum("bhpn,bhin->bhip", live, C, precision=_HIGHEST)
    return jnp.exp(log_a)[..., None] * s_c + jnp.einsum("bhij,bhjp->bhip", weights * b_dot_c, x,
                                                         precision=_HIGHEST)


def _mamba2_window(state, window: Mamba2Tokens, params: Mamba2Params, plan, fold, in_window, anc):
    """The Mamba-2 window (xla): `(y [B, T, H, P], records (x, B, dt) [B, T, ...],
    checkpoint, (x, B, dt cache pools to append to))`."""
    cfg = state.config
    keep = _keeper(in_window)
    out_dtype = window.x.dtype
    # dt is formed before padding is zeroed (a zero raw dt is not a zero step): padding
    # positions then get dt = 0, no decay and no update, and never reach a valid output.
    dt = keep(gating.mamba2_dt(window.dt, params.dt_bias, dt_softplus=params.dt_softplus,
                               dt_limit=params.dt_limit))  # [B, T, H]
    x, B, C = (keep(a.astype(jnp.float32)) for a in (window.x, window.B, window.C))
    heads = lambda a: jnp.moveaxis(xla.expand_heads(a, cfg.group_size, axis=2), 1, 2)  # [B, H, T, .]

    live, checkpoint = _folded_live(state, plan, fold, xla.mamba2_replay_state(state, plan, params.A))
    # As in `_delta_window`: the appends (here all three records) do not depend on the
    # replay's reads of the caches; order the reads first so donated caches update in place.
    live, pools = jax.lax.optimization_barrier((live, (state.u_cache, state.k_cache, state.g_cache)))
    xh = jnp.moveaxis(x, 1, 2)
    y = mamba2_window_outputs(live, xh, heads(B), heads(C), jnp.moveaxis(dt, 1, 2), params.A.astype(jnp.float32),
                              anc)
    y = jnp.moveaxis(y + params.D.astype(jnp.float32)[None, :, None, None] * xh, 2, 1)  # [B, T, H, P]
    if window.z is not None:
        y = y * gating.silu(window.z)
    y = keep(y).astype(out_dtype)
    return y, (window.x, window.B, dt), checkpoint, pools


def _append_window(state: ReplayState, plan, fold, in_window, checkpoint, pools, records) -> ReplayState:
    """The window's records `(u, k, g)` (Mamba-2: `(x, B, dt)`), each `[B, T, heads, ...]`,
    appended at `base .. base + length - 1` (`base` = 0 on folding rows, else the cursor);
    folding rows' cursors become 0, others stay."""
    u_pool, k_pool, g_pool = pools
    u, k, g = records
    pos_bt = _window_positions(plan, fold, in_window.shape[1])
    u_cache, k_cache, g_cache = (common.set_records(pool, plan.slot, pos_bt, x, in_window)
                                 for pool, x in ((u_pool, u), (k_pool, k), (g_pool, g)))
    return dataclasses.replace(state, checkpoint=checkpoint, u_cache=u_cache, k_cache=k_cache,
                               g_cache=g_cache, write_pos=_fold_cursors(state, plan, fold))


def _window_positions(plan, fold, width: int) -> Int[Array, "B T"]:
    """Each window record's position in its row's ring: from 0 on folding rows, from the
    cursor on the others."""
    base = jnp.where(fold, 0, plan.pos)
    return base[:, None] + jnp.arange(width)[None, :]


def _fold_cursors(state: ReplayState, plan, fold) -> Int[Array, " N"]:
    """`write_pos` with the folding rows' cursors at 0 (their windows start the ring)."""
    return state.write_pos.at[jnp.where(fold, plan.slot, state.num_slots)].set(0, mode="drop")


def _mosaic_verify(state, window: Tokens, slots, lengths, anc, *, use_qk_l2norm, scale, gate_params, kernel_params,
                   interpret):
    """`verify_step` on the Mosaic GPU kernel: `(y, new_state)`."""
    cfg = state.config
    window = xla.gate_tokens(cfg, window, gate_params)
    kernel = verify_decode_kda_mgpu if cfg.per_channel_gate else verify_decode_mgpu
    order = {}
    if kernel_params.launch_order and not cfg.per_channel_gate:
        # The GDN kernel's rows in a launch order, folding rows first (the plan's order is
        # the decode flush's); the KDA kernel refuses `launch_order`.
        plan, fold, _ = _window_plan(state, slots, lengths, *anc.shape[:2])
        order = dict(row_order=launch_order(plan.valid, plan.pos, fold, cfg.cache_len))
    # The kernel resets the folding rows' cursors itself (one XLA launch fewer).
    y, checkpoint, u_cache, k_cache, g_cache, write_pos = kernel(
        state.checkpoint, state.u_cache, state.k_cache, state.g_cache,
        window.q, window.k, window.v, window.g, window.beta, slots, state.write_pos, lengths, anc,
        use_qk_l2norm=use_qk_l2norm, scale=scale, params=kernel_params, interpret=interpret, **order)
    return y, dataclasses.replace(state, checkpoint=checkpoint, u_cache=u_cache, k_cache=k_cache, g_cache=g_cache,
                                  write_pos=write_pos)


def _mosaic_mamba2_verify(state, window: Mamba2Tokens, params: Mamba2Params, slots, lengths, anc, *,
                          kernel_params, interpret):
    """`verify_step` for gate "mamba2" on the Mosaic GPU kernel: `(y, new_state)`; the raw
    time steps are gated with the window (`mamba2_verify_decode_mgpu`)."""
    y, checkpoint, x_cache, b_cache, dt_cache, write_pos = mamba2_verify_decode_mgpu(
        state.checkpoint, state.u_cache, state.k_cache, state.g_cache,
        window.x, window.B, window.C, window.dt, params.A, params.D, params.dt_bias, slots, state.write_pos, lengths,
        anc, z=window.z, dt_softplus=params.dt_softplus, dt_limit=params.dt_limit, params=kernel_params,
        interpret=interpret)
    return y, dataclasses.replace(state, checkpoint=checkpoint, u_cache=x_cache, k_cache=b_cache, g_cache=dt_cache,
                                  write_pos=write_pos)


def _pallas_window(state, plan, fold, q, k, v, g, beta, anc, params, interpret):
    """`window_outputs` with the live state's readouts from the `verify_readout` kernel:
    `(y, u, checkpoint with the folding rows' live states, (u, k, g caches))`."""
    G = window_decay(g, anc)
    decay = jnp.exp(G)
    SK, SQ, checkpoint = verify_readout(
        state.checkpoint, state.u_cache, state.k_cache, state.g_cache, decay * k, decay * q,
        plan.slot, plan.pos, common.row_modes(plan.valid, fold), params=params, interpret=interpret)
    # The appends do not depend on the kernel's reads of the caches: tie the caches to its
    # results so XLA orders those reads first and updates donated caches in place.
    SK, SQ, pools = jax.lax.optimization_barrier((SK, SQ, (state.u_cache, state.k_cache, state.g_cache)))
    y, u = window_solve(SK, SQ, q, k, v, G, beta, anc)
    return y, u, checkpoint, pools


def accept(
    state: ReplayState,
    slots: Int[Array, " B"],
    num_accepted: Int[Array, " B"],
    *,
    path: Int[Array, "B P"] | None = None,
) -> ReplayState:
    """Keep the first `num_accepted[b]` records of row b's verified window: move its cursor
    by that count (padding rows: untouched).

    Args:
      state: the state `verify_step` returned.
      slots: `[B]` int, as given to `verify_step`.
      num_accepted: `[B]` int, 0..T, the bonus token included.
      path: for a tree window, `[B, P]` int: the accepted positions from the root down
        (`path[b, m]` is the m-th accepted token's window position; entries at
        m >= num_accepted[b] are ignored). Their records are copied to
        `write_pos .. write_pos + n - 1` first, so the ring holds the accepted tokens in
        order.

    Raises:
      ValueError: on a wrong shape or dtype, a negative count, a count (or path) that
        reaches past the ring, or a path that is not increasing (when values are concrete).
    """
    check_state(state)
    check_array("slots", slots, (None,), layout="a 1-D [B] array")
    batch = np.shape(slots)[0]
    check_slots("slots", slots, batch, state.num_slots)
    counts = _check_int_array("num_accepted", num_accepted, (batch,))
    slots, num_accepted = jnp.asarray(slots, jnp.int32), jnp.asarray(num_accepted, jnp.int32)  # array-likes too
    plan = plan_step(state.write_pos, slots, None, state.config.cache_len)
    length = state.config.cache_len
    pos = concrete_or_none(plan.pos)
    if counts is not None:
        live = concrete_or_none(plan.valid)
        if np.any(counts < 0):
            raise ValueError(f"num_accepted must be >= 0, got {counts.tolist()}")
        if pos is not None and live is not None and np.any(live & (pos + counts > length)):
            raise ValueError(
                f"num_accepted {counts.tolist()} moves a cursor past the ring (write_pos "
                f"{pos.tolist()}, cache_len {length})"
            )
    n = jnp.where(plan.valid, num_accepted, 0)
    debug_check(jnp.all(num_accepted >= 0), "num_accepted must be >= 0: {n}", n=num_accepted)
    debug_check(jnp.all(plan.pos + n <= length),
                f"num_accepted moves a cursor past the ring (cache_len {length}): {{n}} at write_pos {{p}}",
                n=num_accepted, p=plan.pos)
    if path is not None:
        state = _compact_path(state, plan, n, path, counts, pos)
    target = jnp.where(plan.valid, plan.slot, state.num_slots)
    write_pos = state.write_pos.at[target].set(plan.pos + n, mode="drop")
    return dataclasses.replace(state, write_pos=write_pos)


def _compact_path(state, plan, n, path, counts, pos) -> ReplayState:
    """Copy the records at `pos + path[:, m]` to `pos + m` for m < n (all reads first)."""
    batch = plan.batch
    values = _check_int_array("path", path, (batch, None), layout=f"[B, P] with B = {batch}")
    path = jnp.asarray(path, jnp.int32)  # array-likes too
    width = path.shape[1]
    if counts is not None and np.any(counts > width):
        raise ValueError(f"num_accepted {counts.tolist()} exceeds the path length {width}")
    if values is not None and counts is not None:
        used = np.arange(width)[None, :] < counts[:, None]
        rising = np.diff(np.concatenate([np.full((batch, 1), -1), values], axis=1), axis=1) > 0
        if np.any(used & ((values < 0) | ~rising)):
            raise ValueError(f"path must list increasing window positions >= 0, got {values.tolist()}")
        if pos is not None and np.any(used & (pos[:, None] + values >= state.config.cache_len)):
            raise ValueError(f"path {values.tolist()} reaches past the ring (write_pos {pos.tolist()})")
    length = state.config.cache_len
    steps = jnp.arange(width)[None, :]
    moves = (steps < n[:, None]) & plan.valid[:, None]
    rising = path > jnp.concatenate([jnp.full((batch, 1), -1, jnp.int32), path[:, :-1]], axis=1)
    debug_check(jnp.all(n <= width), f"num_accepted exceeds the path length {width}: {{n}}", n=n)
    debug_check(jnp.all(~moves | (rising & (plan.pos[:, None] + path < length))),
                "path must list increasing window positions inside the ring: {p}", p=path)
    src = jnp.clip(plan.pos[:, None] + path, 0, length - 1)
    dst = plan.pos[:, None] + steps
    fields = {}
    for name in ("u_cache", "k_cache", "g_cache"):
        cache = getattr(state, name)
        picked = cache[plan.slot[:, None], :, src]  # [B, P, H, ...]
        fields[name] = common.set_records(cache, plan.slot, dst, picked, moves)
    return dataclasses.replace(state, **fields)
