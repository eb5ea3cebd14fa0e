"""The Mosaic GPU decode kernels beside the Pallas-Triton kernels, one process (H200).

Sections:
  check         GDN: one GPU step per backend (xla, pallas_triton, mosaic_gpu) on the same
                state and tokens, with padding, append and flush rows: outputs and every
                state array against xla (relative max error), and the copies of a state
                array in the donated step's compiled HLO (0: updated in place); fp32 at
                B = 8 (L = 16) and 64 (L = 32), bf16 at B = 8 and 256 (three warpgroups).
  sweep         GDN H_k = 16, H_v = 32 (--gdn-value-heads), d = 128, for each state dtype (--dtypes), L
                (--cache-lens) and B (--batches): the plain kernel, the Triton replay cycle
                (the launch table's row, natural policy) and the Mosaic replay cycle of
                each --variants entry, sync cursors (non-flush, flush, cycle-amortised)
                and staggered cursors (per step; --cursors), bytes counted and the
                fraction of the byte floor from the copy bandwidth measured in the same run.
  kda-check     the check for KDA (H_k = H_v = 32, d = 128; a row with raw gates and one
                at d = 64, two warps per key channel).
  kda           the sweep for KDA, H_k = H_v = 32, d = 128 (--kda-*): the plain kernel,
                Triton under the launch table's default policy (a 4-byte state folds every
                step) and the Mosaic replay cycle.
  mamba2-check  the check for Mamba-2 (Nemotron-H-8B heads: H = 128, P = 64, N = 128, G = 8;
                z gate on).
  mamba2        the sweep for Mamba-2 at Nemotron-H-8B shapes (--mamba2-shapes: also
                mamba2-2.7b, H = 80, G = 1): --dtypes, L in --mamba2-cache-lens, B in
                --batches (L = 16 first, then fp32 first).

Each sweep section stops starting new cells --budget-s after it began. `--resident-slots K`
(a diagnostic) puts every row on one of K slots, so the pool stays in the L2 and a sweep
times the kernels' work without HBM traffic: on an H100, roughly a lower bound on what they
take on an H200 (the same SMs, 1.4x the bandwidth), where they are not bandwidth-bound. Timing as
`decode_bench.py`: CUPTI kernel times, medians, slot sets rotated past the L2; a Mosaic
step is its kernel plus what XLA computes for it before the launch (`mosaic_xla_side_us`:
GDN's staged vectors and key side), not the step's plan, which a model makes once for all
of its layers. `--smoke` runs tiny shapes in interpret mode on CPU (wall clock) so CI
exercises the code.

  python benchmarks/mosaic_bench.py --sections mamba2-check,mamba2 --budget-s 170 --out mamba2_mosaic.json
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import re
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, __file__.rsplit("/", 1)[0])
import decode_bench as db  # noqa: E402

import replayssm_jax as R  # noqa: E402
from replayssm_jax import cost  # noqa: E402
from replayssm_jax.backends import mosaic_gpu  # noqa: E402
from replayssm_jax.plan import FlushPolicy  # noqa: E402
from pallas_kernels.mosaic_gpu import mamba2_decode, replay_decode  # noqa: E402
from pallas_kernels.mosaic_gpu.mamba2_decode import MosaicMamba2Params  # noqa: E402
from pallas_kernels.mosaic_gpu.rebuild import check_rebuild  # noqa: E402
from pallas_kernels.mosaic_gpu.replay_decode import MosaicReplayParams  # noqa: E402

START = time.time()
MOSAIC_KERNELS = {"gdn": "replayssm_replay_decode_mgpu", "kda": "replayssm_replay_decode_mgpu_kda",
                  "mamba2": "replayssm_mamba2_decode_mgpu"}


def gdn_config(smoke: bool, cache_len: int, state_dtype, num_v_heads: int = 32) -> R.ReplayConfig:
    """GDN H_k = 16, H_v = `num_v_heads`, d = 128 (smoke: the kernel's smallest tiles, L = 8)."""
    sd = jnp.dtype(state_dtype)
    return (R.ReplayConfig(1, 2, 64, 64, 8, state_dtype=sd, cache_dtype=sd) if smoke else
            R.ReplayConfig(16, num_v_heads, 128, 128, cache_len, state_dtype=sd, cache_dtype=sd))


def kda_config(smoke: bool, cache_len: int, state_dtype, head_dim: int = 128) -> R.ReplayConfig:
    """KDA H_k = H_v = 32 at d = 128 (4 heads at d = 64; smoke: the smallest tiles, L = 8)."""
    sd = jnp.dtype(state_dtype)
    if smoke:
        return R.ReplayConfig(1, 2, 64, 64, 8, gate="kda", state_dtype=sd, cache_dtype=sd)
    heads = 32 if head_dim == 128 else 4
    return R.ReplayConfig(heads, heads, head_dim, head_dim, cache_len, gate="kda", state_dtype=sd, cache_dtype=sd)


def gate_params(cfg: R.ReplayConfig, key):
    """Random `(A_log, dt_bias)`: the step then reads the token's g and beta as raw inputs."""
    ka, kb = jax.random.split(key)
    channels = (cfg.head_k_dim,) if cfg.per_channel_gate else ()
    return 0.3 * jax.random.normal(ka, (cfg.num_v_heads,)), jax.random.normal(kb, (cfg.num_v_heads, *channels))


MAMBA2_SHAPES = {"nemotron-h-8b": db.NEMOTRON_H_8B, "mamba2-2.7b": db.MAMBA2_2_7B}


def mamba2_config(smoke: bool, cache_len: int, state_dtype, shape: str = "nemotron-h-8b",
                  cache_dtype: str = "state") -> R.ReplayConfig:
    """Mamba-2 at `MAMBA2_SHAPES[shape]` (smoke: two heads of the smallest tiles, L = 8),
    its caches in `cache_dtype` ("state": the state's dtype)."""
    sd = jnp.dtype(state_dtype)
    cfg = (R.ReplayConfig.mamba2(2, 64, 64, 1, 8, state_dtype=sd, cache_dtype=sd) if smoke
           else MAMBA2_SHAPES[shape].config(cache_len, sd))
    return cfg if cache_dtype == "state" else dataclasses.replace(cfg, cache_dtype=jnp.dtype(cache_dtype))


def step_options(cfg: R.ReplayConfig, raw_gates: bool = False) -> dict:
    """`decode_step` / `layer_step` options of the benchmark's layers: q/k L2 norm for GDN
    and KDA (with `raw_gates`, random gate parameters), the fixed layer parameters for
    Mamba-2."""
    if cfg.gate_kind.additive:
        return dict(gate_params=db.mamba2_params(cfg.num_v_heads))
    return dict(use_qk_l2norm=True, gate_params=gate_params(cfg, jax.random.key(5)) if raw_gates else None)


@functools.lru_cache(maxsize=None)
def mosaic_cycle_fn(cfg: R.ReplayConfig, interpret: bool, kernel_params=None):
    """jit: L steps of the Mosaic kernel (`kernel_params`: its params class), each over
    every slot set in turn."""

    def one_step(token, state, slots):
        plan = R.plan_step(state.write_pos, slots, None, cfg.cache_len, FlushPolicy.NATURAL)
        if cfg.gate_kind.additive:
            y, state = mosaic_gpu.mamba2_layer_step(state, token, plan, params=db.mamba2_params(cfg.num_v_heads),
                                                    kernel_params=kernel_params, interpret=interpret)
        else:
            y, state = mosaic_gpu.layer_step(state, token, plan, use_qk_l2norm=True, scale=None,
                                             kernel_params=kernel_params, interpret=interpret)
        state = dataclasses.replace(state, write_pos=R.advance_write_pos(state.write_pos, plan))
        return state, y[0, 0, 0]

    def cycle(state, sets, token):
        over_sets = lambda st, _: jax.lax.scan(functools.partial(one_step, token), st, sets)
        state, _ = jax.lax.scan(over_sets, state, None, length=cfg.cache_len)
        return state

    return jax.jit(cycle, donate_argnums=0)


def xla_side(cfg: R.ReplayConfig, params):
    """`(k_cache, slots, token) -> arrays`: what XLA computes before a step's Mosaic kernel
    (`xla_side_inputs`: the staged vectors of the "mma" readout, GDN's key side from XLA),
    part of the layer's step, not of its plan."""
    if cfg.gate_kind.additive:
        return lambda k_cache, slots, token: mamba2_decode.xla_side_inputs(token.C, params=params)
    if cfg.per_channel_gate:
        return lambda k_cache, slots, token: []
    return lambda k_cache, slots, token: replay_decode.xla_side_inputs(
        token.q, token.k, k_cache, slots, params=params, use_qk_l2norm=True, scale=None)


@functools.lru_cache(maxsize=None)
def xla_side_fn(cfg: R.ReplayConfig, params):
    """jit: `xla_side` for every slot set in turn, each set with a token of its own (as
    every step has), so that XLA cannot compute the token's part once for all of them."""
    side = xla_side(cfg, params)
    own_token = lambda token, i: jax.tree.map(lambda x: x + jnp.asarray(i, x.dtype), token)
    return jax.jit(lambda k_cache, sets, token: [side(k_cache, sets[i], own_token(token, i))
                                                 for i in range(sets.shape[0])])


def time_xla_side(timer, cfg, params, k_cache, sets, token, iterations) -> float:
    """Median µs per step of `xla_side` over every slot set in turn (all of its kernels); 0
    where the params leave XLA nothing to compute."""
    if not jax.eval_shape(xla_side(cfg, params), k_cache, sets[0], token):
        return 0.0
    fn = xla_side_fn(cfg, params)
    label = f"xla side {cfg.gate} {jnp.dtype(cfg.state_dtype).name} B={sets.shape[1]}"
    totals = timer.run_totals(fn, (k_cache, sets, token), iterations, label=label, per=sets.shape[0])
    return statistics.median(totals) / sets.shape[0]


def time_mosaic(timer, cfg, batch, rng, iterations, smoke, staggered, params):
    """Median µs per step of the layer's kernels, the Mosaic kernel and XLA's side inputs
    before it (`time_xla_side`, timed on its own over the same slot sets and added to every
    step): `(non-flush, flush, cycle, xla_side)` for sync cursors, `(None, None, per step,
    xla_side)` for staggered ones. `params`: the kernel's (`effective_params`)."""
    sets, num_slots = db.slot_sets(batch, cfg.state_bytes_per_slot(), rng, smoke, timer.resident_slots)
    cursors = rng.integers(0, cfg.cache_len, num_slots) if staggered else np.zeros(num_slots)
    pool = db.random_pool(cfg, num_slots, jax.random.key(1), cursors)
    token = db.random_token(cfg, batch, jax.random.key(2))
    fn = mosaic_cycle_fn(cfg, smoke, params)
    if not getattr(time_mosaic, "shown", False):  # list the kernels of one Mosaic cycle once
        timer._shown, time_mosaic.shown = False, True
    # The cycle donates its state: time it on a fresh pool per call (the copies are other
    # kernels, not counted). The pool is an argument: the timer jits the call, and a pool it
    # closed over would be lowered as a constant (GBs, minutes of compile per cell).
    times = timer.kernel_times(lambda p, s, t: fn(jax.tree.map(jnp.copy, p), s, t),
                               (pool, jnp.asarray(sets), token), "" if smoke else MOSAIC_KERNELS[cfg.gate],
                               iterations)
    side_us = time_xla_side(timer, cfg, params, pool.k_cache, jnp.asarray(sets), token, iterations)
    if staggered or smoke:
        return None, None, statistics.median(times) + side_us, side_us
    non_flush, flush, cycle = db.split_cycle(times, len(sets), cfg.cache_len)
    return non_flush + side_us, flush + side_us, cycle + side_us, side_us


def rel(a, b) -> float:
    a, b = np.asarray(jnp.asarray(a, jnp.float32), np.float64), np.asarray(jnp.asarray(b, jnp.float32), np.float64)
    return float(np.max(np.abs(a - b)) / (np.max(np.abs(b)) + 1e-30))


def normwise(a, b) -> float:
    """`||a - b|| / ||b||` (Frobenius), the issue's measure for a rebuild against IEEE fp32."""
    a, b = np.asarray(jnp.asarray(a, jnp.float32), np.float64), np.asarray(jnp.asarray(b, jnp.float32), np.float64)
    return float(np.linalg.norm(a - b) / (np.linalg.norm(b) + 1e-30))


def mosaic_params(spec: str, cfg: R.ReplayConfig, batch: int):
    """The Mosaic params of a variant spec: `default` (None: the backend's
    `default_params`), or comma-separated fields of the gate's params class (`programs=N`
    or `programs=fit`, `rebuild=tf32`, `swizzle=64`, `auto_barriers=false`, `readout=mma`),
    the others at the class's defaults, or after `default,` at the backend's
    `default_params` for the cell (`default,programs=264`: only the programs differ).
    `programs=fit`: as many persistent programs as the merged fields' buffers fit."""
    if spec == "default":
        return None
    cls = MosaicMamba2Params if cfg.gate_kind.additive else MosaicReplayParams
    on_defaults, fields = db.variant_fields(spec.split(","))
    base = mosaic_gpu.default_params(cfg, batch, jnp.bfloat16) if on_defaults else cls()
    if fields.get("programs") == "fit":
        fields["programs"] = fit_programs(lambda name: fields.get(name, getattr(base, name)), cfg, batch)
    return dataclasses.replace(base, **fields)


def fit_programs(field, cfg: R.ReplayConfig, batch: int) -> int:
    """`mosaic_gpu.fitting_programs` for the buffers that the params fields `field(name)`
    ask for."""
    gdn_fields = ({} if cfg.gate_kind.additive else  # the KDA kernel's buffers ignore them
                  {name: field(name) for name in ("key_side", "warpgroups", "operands_in_tile")})
    return mosaic_gpu.fitting_programs(cfg, batch, jnp.bfloat16, rebuild=field("rebuild"), readout=field("readout"),
                                       **gdn_fields)


def effective_params(spec: str, cfg: R.ReplayConfig, batch: int):
    """The params a variant's steps run with: `mosaic_params`', or for `default` the
    backend's `default_params` for the benchmark's bf16 tokens."""
    return mosaic_params(spec, cfg, batch) or mosaic_gpu.default_params(cfg, batch, jnp.bfloat16)


def pool_copies(hlo_text: str, state: R.ReplayState) -> int:
    """HLO `copy` instructions with the shape of a state array: 0 when the donated step
    updates the pool in place (interpret mode copies its operands by construction)."""
    shapes = {tuple(leaf.shape) for leaf in jax.tree.leaves(state)}
    results = (re.search(r"= \w+\[([\d,]*)\]\S* copy\(", line) for line in hlo_text.splitlines())
    return sum(1 for m in results if m and tuple(int(d) for d in m.group(1).split(",") if d) in shapes)


def check_cases(smoke: bool, gate: str) -> list[tuple[R.ReplayConfig, int, bool]]:
    """(config, batch, raw gates) of the check section of `gate`."""
    if gate == "kda":
        if smoke:
            return [(kda_config(True, 8, jnp.float32), 3, False), (kda_config(True, 8, jnp.float32), 3, True)]
        return [(kda_config(False, 16, jnp.float32), 8, False), (kda_config(False, 32, jnp.float32), 64, True),
                (kda_config(False, 16, jnp.bfloat16), 8, False), (kda_config(False, 16, jnp.float32, 64), 8, False)]
    config = mamba2_config if gate == "mamba2" else gdn_config
    if smoke:
        return [(config(True, 8, jnp.float32), 3, False)]
    # GDN bf16 at B = 256 too: the default there runs three warpgroups per CTA.
    wide = ((jnp.bfloat16, 256, 16),) if gate == "gdn" else ()
    return [(config(False, L, dtype), batch, False) for dtype, batch, L in
            ((jnp.float32, 8, 16), (jnp.float32, 64, 32), (jnp.bfloat16, 8, 16), *wide)]


def tensor_core_rebuilds(smoke: bool, cfg: R.ReplayConfig) -> list[str]:
    """The opt-in Mosaic rebuild modes a GDN check case also runs (GPU only: interpret mode
    cannot run wgmma)."""
    if smoke or cfg.gate != "gdn":
        return []
    modes = []
    for mode in ("tf32", "bf16", "3xtf32"):
        try:
            check_rebuild(mode, cfg.cache_len)
        except ValueError:
            continue
        modes.append(mode)
    return modes


def check_section(smoke: bool, gate: str = "gdn", mosaic_variants: str = "default") -> list[dict]:
    """`mosaic_variants` (GDN and Mamba-2): the sweep's variants, each run as one more
    Mosaic backend; one that a case's shapes or shared memory refuse (a ValueError from its
    build) is reported as skipped with the reason."""
    rows = []
    for cfg, batch, raw in check_cases(smoke, gate):
        rng = np.random.default_rng(batch)
        num_slots = 2 * batch
        pool = db.random_pool(cfg, num_slots, jax.random.key(3), rng.integers(0, cfg.cache_len, num_slots))
        token = db.random_token(cfg, batch, jax.random.key(4))
        slots = jnp.asarray(np.where(np.arange(batch) % 5 == 4, -1, rng.permutation(num_slots)[:batch]), jnp.int32)
        force = jnp.asarray(np.arange(batch) % 3 == 0)
        outs, copies, skipped = {}, {}, {}
        variants = {name: (name, None) for name in ("xla", "pallas_triton", "mosaic_gpu")}
        variants.update({f"mosaic_gpu rebuild={mode}": ("mosaic_gpu", MosaicReplayParams(rebuild=mode))
                         for mode in tensor_core_rebuilds(smoke, cfg)})
        for spec in (spec for spec in mosaic_variants.split(";") if spec != "default"):
            name, kernel_params = f"mosaic_gpu {spec}", None
            try:  # params a case's defaults refuse (e.g. an option of one warpgroup on three)
                kernel_params = mosaic_params(spec, cfg, batch)
            except ValueError as err:
                skipped[name] = str(err)
            variants[name] = ("mosaic_gpu", kernel_params)
        for name, (backend, kernel_params) in variants.items():
            if name in skipped:
                continue
            step = functools.partial(R.decode_step, backend=backend, policy="natural", kernel_params=kernel_params,
                                     **step_options(cfg, raw))
            try:
                compiled = jax.jit(step, donate_argnums=0).lower(pool, token, slots, force).compile()
            except ValueError as err:
                if backend == "xla" or kernel_params is None:
                    raise
                skipped[name] = str(err)
                continue
            outs[name] = compiled(jax.tree.map(jnp.copy, pool), token, slots, force)
            copies[name] = pool_copies(compiled.as_text(), pool)
        ref_y, ref_state = outs["xla"]
        # the slots this step flushed (the others' checkpoints are unchanged, hence exact)
        flushed = np.any(np.asarray(ref_state.checkpoint != pool.checkpoint), axis=(1, 2, 3))
        for backend in list(variants)[1:]:
            if backend in skipped:
                row = dict(gate=cfg.gate, backend=backend, state_dtype=cfg.state_dtype.name, batch=batch,
                           cache_len=cfg.cache_len, skipped=skipped[backend])
                print(f"check {json.dumps(row)}", flush=True)
                rows.append(row)
                continue
            y, st = outs[backend]
            row = dict(gate=cfg.gate, backend=backend, state_dtype=cfg.state_dtype.name, batch=batch,
                       cache_len=cfg.cache_len, head_dim=cfg.head_k_dim, raw_gates=raw, y=rel(y, ref_y),
                       checkpoint=rel(st.checkpoint, ref_state.checkpoint),
                       flushed_checkpoints=rel(st.checkpoint[flushed], ref_state.checkpoint[flushed]),
                       flushed_normwise=normwise(st.checkpoint[flushed], ref_state.checkpoint[flushed]),
                       u_cache=rel(st.u_cache, ref_state.u_cache), k_cache=rel(st.k_cache, ref_state.k_cache),
                       g_cache=rel(st.g_cache, ref_state.g_cache),
                       write_pos_equal=bool(np.array_equal(st.write_pos, ref_state.write_pos)),
                       pool_copies=copies[backend])
            print(f"check {json.dumps(row)}", flush=True)
            rows.append(row)
    return rows


def sweep_cells(args, gate: str) -> list[R.ReplayConfig]:
    """The configs of a sweep section (each timed at every batch): GDN in H_v-major, then
    dtype-major order; Mamba-2 shape by shape with the headline cells first (L = 16 before
    the other lengths, fp32 before bf16)."""
    if gate == "mamba2":
        lengths = sorted(map(int, args.mamba2_cache_lens.split(",")), key=lambda L: (L != 16, L))
        return [mamba2_config(args.smoke, L, dt, shape, args.mamba2_cache_dtype)
                for shape in args.mamba2_shapes.split(",") for L in lengths for dt in args.dtypes.split(",")]
    lengths = [int(L) for L in args.cache_lens.split(",")]
    return [gdn_config(args.smoke, L, dt, int(hv)) for hv in args.gdn_value_heads.split(",")
            for dt in args.dtypes.split(",") for L in lengths]


def sweep_section(timer, args, bandwidth, gate: str = "gdn") -> list[dict]:
    rows = []
    deadline = time.time() + args.budget_s
    for cfg in sweep_cells(args, gate):
        for batch in map(int, args.batches.split(",")):
            if time.time() > deadline:
                print(f"budget spent: skipping {gate} {cfg.state_dtype.name} L={cfg.cache_len} B={batch}", flush=True)
                continue
            rng = np.random.default_rng(batch * 100 + cfg.cache_len)
            plain_cfg = dataclasses.replace(cfg, cache_len=1)
            plain_us = db.time_plain(timer, plain_cfg, batch, db.plain_params(plain_cfg, batch), rng, 3, args.smoke)
            params = db.table_params(cfg, batch, FlushPolicy.NATURAL)
            for staggered in (cursors == "staggered" for cursors in args.cursors.split(",")):
                t_nf, t_fl, t_cyc = db.time_replay(timer, cfg, batch, params, FlushPolicy.NATURAL, rng, 3,
                                                   args.smoke, staggered)
                for variant in args.variants.split(";"):
                    try:
                        effective = effective_params(variant, cfg, batch)
                    except ValueError as err:  # a variant this cell's defaults refuse: no row
                        print(f"sweep skips {variant!r} at {cfg.state_dtype.name} L={cfg.cache_len} B={batch}: {err}",
                              flush=True)
                        continue
                    rows.append(sweep_row(timer, args, cfg, batch, rng, staggered, variant, effective, bandwidth,
                                          plain_us, params, (t_nf, t_fl, t_cyc)))
    return rows


def sweep_row(timer, args, cfg, batch, rng, staggered, variant, effective, bandwidth, plain_us, params,
              triton_us) -> dict:
    """One Mosaic variant (`effective`: its `effective_params`) timed beside the cell's plain
    and Triton times."""
    t_nf, t_fl, t_cyc = triton_us
    m_nf, m_fl, m_cyc, m_side = time_mosaic(timer, cfg, batch, rng, 3, args.smoke, staggered, effective)
    cycle_bytes = cost.replay_cycle_bytes(cfg, batch).total
    floor = cost.floor_us(cycle_bytes, bandwidth)
    nf_bytes = statistics.mean(cost.replay_step_bytes(cfg, [p] * batch).total for p in range(cfg.cache_len - 1))
    fl_bytes = cost.replay_step_bytes(cfg, [cfg.cache_len - 1] * batch).total
    row = dict(mosaic_variant=variant, mosaic_params=repr(effective),
               gate=cfg.gate, num_k_heads=cfg.num_k_heads, num_v_heads=cfg.num_v_heads,
               head_k_dim=cfg.head_k_dim, head_v_dim=cfg.head_v_dim,
               state_dtype=cfg.state_dtype.name, cache_dtype=cfg.cache_dtype.name, cache_len=cfg.cache_len,
               batch=batch, cursors="staggered" if staggered else "sync", triton_params=repr(params),
               plain_us=plain_us, triton_nonflush_us=t_nf, triton_flush_us=t_fl,
               triton_cycle_us=t_cyc, mosaic_nonflush_us=m_nf, mosaic_flush_us=m_fl,
               mosaic_cycle_us=m_cyc, mosaic_xla_side_us=m_side, cycle_bytes=cycle_bytes, nonflush_bytes=nf_bytes,
               flush_bytes=fl_bytes, cycle_floor_us=floor,
               nonflush_floor_us=cost.floor_us(nf_bytes, bandwidth),
               flush_floor_us=cost.floor_us(fl_bytes, bandwidth),
               mosaic_floor_fraction=floor / m_cyc, triton_floor_fraction=floor / t_cyc,
               mosaic_vs_plain=plain_us / m_cyc, triton_vs_plain=plain_us / t_cyc,
               mosaic_vs_triton=t_cyc / m_cyc, elapsed_s=time.time() - START)
    print(f"sweep {json.dumps(row)}", flush=True)
    return row


def kda_section(timer, args, bandwidth) -> list[dict]:
    """KDA rows: the plain kernel, Triton under the launch table's default policy and the
    Mosaic replay cycle, sync and staggered cursors (keys as the sweep's rows)."""
    rows = []
    deadline = time.time() + args.budget_s
    for dtype in args.kda_dtypes.split(","):
        for L in map(int, args.kda_cache_lens.split(",")):
            for batch in map(int, args.kda_batches.split(",")):
                if time.time() > deadline:
                    print(f"budget spent: skipping KDA {dtype} L={L} B={batch}", flush=True)
                    continue
                sd = jnp.dtype(dtype)
                cfg = kda_config(args.smoke, L, sd)
                rng = np.random.default_rng(batch * 100 + L + 1)
                plain_cfg = dataclasses.replace(cfg, cache_len=1)
                plain_us = db.time_plain(timer, plain_cfg, batch, db.plain_params(plain_cfg, batch), rng, 3, args.smoke)
                policy = R.default_flush_policy(cfg, batch)
                params = db.table_params(cfg, batch, policy)
                cycle_bytes = cost.replay_cycle_bytes(cfg, batch).total
                floor = cost.floor_us(cycle_bytes, bandwidth)
                for staggered in (cursors == "staggered" for cursors in args.cursors.split(",")):
                    _, _, t_step = db.time_replay(timer, cfg, batch, params, policy, rng, 3, args.smoke, staggered)
                    for variant in args.variants.split(";"):
                        rows.append(kda_row(timer, args, cfg, batch, rng, staggered, variant, plain_us, policy, params,
                                            t_step, floor, cycle_bytes))
    return rows


def kda_row(timer, args, cfg, batch, rng, staggered, variant, plain_us, policy, params, t_step, floor,
            cycle_bytes) -> dict:
    """One Mosaic variant timed beside the KDA cell's plain and Triton times."""
    effective = effective_params(variant, cfg, batch)
    m_nf, m_fl, m_cyc, _ = time_mosaic(timer, cfg, batch, rng, 3, args.smoke, staggered, effective)
    row = dict(mosaic_variant=variant, mosaic_params=repr(effective), gate="kda", state_dtype=cfg.state_dtype.name,
               cache_len=cfg.cache_len, batch=batch, cursors="staggered" if staggered else "sync",
               triton_policy=policy.value,
               triton_params=repr(params), plain_us=plain_us, triton_cycle_us=t_step,
               mosaic_nonflush_us=m_nf, mosaic_flush_us=m_fl, mosaic_cycle_us=m_cyc,
               cycle_bytes=cycle_bytes, cycle_floor_us=floor, mosaic_floor_fraction=floor / m_cyc,
               mosaic_vs_plain=plain_us / m_cyc, triton_vs_plain=plain_us / t_step, mosaic_vs_triton=t_step / m_cyc)
    print(f"kda {json.dumps(row)}", flush=True)
    return row


def print_table(rows):
    print(f"{'gate':>6} {'dtype':>8} {'L':>3} {'B':>4} {'cursors':>9} {'variant':>14} {'plain':>8} {'tri cyc':>8} "
          f"{'mgpu nf':>8} {'mgpu fl':>8} {'mgpu cyc':>8} {'of it xla':>9} {'floor':>8} {'m/floor':>7} {'m vs pl':>7} "
          f"{'m vs tri':>8}")
    for r in rows:
        f = lambda x: f"{x:8.1f}" if x is not None else f"{'-':>8}"
        print(f"{r['gate']:>6} {r['state_dtype']:>8} {r['cache_len']:>3} {r['batch']:>4} {r['cursors']:>9} "
              f"{r.get('mosaic_variant', 'default'):>14} "
              f"{f(r['plain_us'])} {f(r['triton_cycle_us'])} {f(r['mosaic_nonflush_us'])} {f(r['mosaic_flush_us'])} "
              f"{f(r['mosaic_cycle_us'])} {f(r.get('mosaic_xla_side_us')):>9} {f(r['cycle_floor_us'])} "
              f"{r['mosaic_floor_fraction']:7.2f} "
              f"{r['mosaic_vs_plain']:7.2f} {r['mosaic_vs_triton']:8.2f}")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sections", default="check,sweep,kda-check,kda",
                   help="comma-separated: check, sweep, kda-check, kda, mamba2-check, mamba2")
    p.add_argument("--out", default="mosaic_bench.json")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--cache-lens", default="16,32")
    p.add_argument("--mamba2-cache-lens", default="8,16,32", help="cache lengths of the mamba2 section")
    p.add_argument("--batches", default="1,8,32,128,512")
    p.add_argument("--gdn-value-heads", default="32", help="H_v of the GDN sweep (H_k = 16), e.g. 32,64")
    p.add_argument("--mamba2-cache-dtype", default="state",
                   help="the mamba2 section's caches: state (the state's dtype) or a dtype, e.g. float32")
    p.add_argument("--mamba2-shapes", default="nemotron-h-8b",
                   help=f"shapes of the mamba2 section, from {','.join(MAMBA2_SHAPES)}")
    p.add_argument("--kda-dtypes", default="float32")
    p.add_argument("--kda-cache-lens", default="16")
    p.add_argument("--kda-batches", default="1,8,128,512")
    p.add_argument("--variants", default="default",
                   help="';'-separated Mosaic variants timed side by side in the sweeps and run in the checks: "
                        "'default' or comma-separated params fields, e.g. 'programs=fit' (persistent CTAs, as "
                        "many as fit), 'programs=264,rebuild=tf32' (other fields at the class's defaults), or "
                        "'default,programs=264' (other fields at the backend's defaults)")
    p.add_argument("--cursors", default="sync,staggered", help="the sweeps' cursor sets: sync, staggered")
    p.add_argument("--budget-s", type=float, default=420.0,
                   help="each sweep section stops starting new cells this long after it began")
    db.add_resident_slots_option(p)
    p.add_argument("--smoke", action="store_true", help="tiny shapes, interpret mode, wall clock (CPU)")
    args = p.parse_args(argv)
    timer = db.option_timer(args)
    if args.smoke:
        args.batches, args.cache_lens, args.mamba2_cache_lens, args.dtypes = "2", "8", "8", "float32"
        args.kda_batches, args.kda_cache_lens, args.kda_dtypes = "2", "8", "float32"
    result = dict(versions=db.versions(), args=vars(args))
    sections = args.sections.split(",")
    bandwidth = db.copy_bandwidth_GBps(timer)
    result["copy_bandwidth_GBps"] = bandwidth
    print(f"copy bandwidth {bandwidth:.0f} GB/s", flush=True)
    parts = (("check", "check", lambda: check_section(args.smoke, "gdn", args.variants)),
             ("sweep", "sweep", lambda: sweep_section(timer, args, bandwidth)),
             ("kda-check", "kda_check", lambda: check_section(args.smoke, "kda", args.variants)),
             ("kda", "kda_sweep", lambda: kda_section(timer, args, bandwidth)),
             ("mamba2-check", "mamba2_check", lambda: check_section(args.smoke, "mamba2", args.variants)),
             ("mamba2", "mamba2_sweep", lambda: sweep_section(timer, args, bandwidth, "mamba2")))
    for section, key, run in parts:
        if section not in sections:
            continue
        result[key] = run()
        if key.endswith("sweep"):
            print_table(result[key])
        with open(args.out, "w") as f:  # after each section: a run cut short keeps what it finished
            json.dump(result, f, indent=1, default=str)
    print(f"wrote {args.out}", flush=True)


if __name__ == "__main__":
    main()
