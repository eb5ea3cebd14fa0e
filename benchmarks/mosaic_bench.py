"""The Mosaic GPU decode kernel beside the Pallas-Triton kernels, one process (H200).

Sections:
  check  one GPU step per backend (xla, pallas_triton, mosaic_gpu) on the same state and
         tokens, with padding, append and flush rows: outputs and every state array against
         xla (relative max error); GDN and KDA (`--gates`), KDA with raw gates in one row
         and at d = 64 (two warps per key channel) in another.
  sweep  GDN H_k = 16, H_v = 32, d = 128, for each state dtype, L and B: the plain kernel,
         the Triton replay cycle (the launch table's row, natural policy) and the Mosaic
         replay cycle, sync cursors (non-flush, flush, cycle-amortised) and staggered
         cursors (per step), bytes counted and the fraction of the byte floor from the copy
         bandwidth measured in the same run.
  kda    the same for KDA, H_k = H_v = 32, d = 128 (`--kda-*`): the plain kernel, Triton
         under the launch table's default policy (a 4-byte state folds every step) and the
         Mosaic replay cycle.

Timing as `decode_bench.py`: CUPTI kernel times, medians, slot sets rotated past the L2.
`--smoke` runs tiny shapes in interpret mode on CPU (wall clock) so CI exercises the code.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
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

MOSAIC_KERNEL = "replayssm_replay_decode_mgpu"  # a prefix of the KDA kernel's name too


@functools.lru_cache(maxsize=None)
def mosaic_cycle_fn(cfg: R.ReplayConfig, interpret: bool):
    """jit: L steps of the Mosaic kernel, each over every slot set in turn."""

    def one_step(token, state, slots):
        plan = R.plan_step(state.write_pos, slots, None, cfg.cache_len, FlushPolicy.NATURAL)
        y, state = mosaic_gpu.layer_step(state, token, plan, use_qk_l2norm=True, scale=None, interpret=interpret)
        state = dataclasses.replace(state, write_pos=R.advance_write_pos(state.write_pos, plan))
        return state, y[0, 0, 0]

    def cycle(state, sets, token):
        over_sets = lambda st, _: jax.lax.scan(functools.partial(one_step, token), st, sets)
        state, _ = jax.lax.scan(over_sets, state, None, length=cfg.cache_len)
        return state

    return jax.jit(cycle, donate_argnums=0)


def time_mosaic(timer, cfg, batch, rng, iterations, smoke, staggered):
    """Median kernel µs: (non-flush, flush, cycle) for sync cursors, (None, None, per step)
    for staggered ones."""
    sets, num_slots = db.slot_sets(batch, cfg.state_bytes_per_slot(), rng, smoke)
    cursors = rng.integers(0, cfg.cache_len, num_slots) if staggered else np.zeros(num_slots)
    pool = db.random_pool(cfg, num_slots, jax.random.key(1), cursors)
    token = db.random_token(cfg, batch, jax.random.key(2))
    fn = mosaic_cycle_fn(cfg, smoke)
    if not getattr(time_mosaic, "shown", False):  # list the kernels of one Mosaic cycle once
        timer._shown, time_mosaic.shown = False, True
    # The cycle donates its state: time it on a fresh pool per call (the copies are other
    # kernels, not counted).
    times = timer.kernel_times(lambda s, t: fn(jax.tree.map(jnp.copy, pool), s, t), (jnp.asarray(sets), token),
                               "" if smoke else MOSAIC_KERNEL, iterations)
    if staggered or smoke:
        return None, None, statistics.median(times)
    return db.split_cycle(times, len(sets), cfg.cache_len)


def rel(a, b) -> float:
    a, b = np.asarray(jnp.asarray(a, jnp.float32), np.float64), np.asarray(jnp.asarray(b, jnp.float32), np.float64)
    return float(np.max(np.abs(a - b)) / (np.max(np.abs(b)) + 1e-30))


# (gate, state dtype, B, L, d, raw gates); in smoke mode one tiny shape per (gate, dtype, raw)
CHECK_CASES = (
    ("gdn", jnp.float32, 8, 16, 128, False), ("gdn", jnp.float32, 64, 32, 128, False),
    ("gdn", jnp.bfloat16, 8, 16, 128, False),
    ("kda", jnp.float32, 8, 16, 128, False), ("kda", jnp.float32, 64, 32, 128, True),
    ("kda", jnp.bfloat16, 8, 16, 128, False), ("kda", jnp.float32, 8, 16, 64, False),
)


def check_config(gate, state_dtype, L, head_dim, smoke) -> R.ReplayConfig:
    """The check's layer: GDN H_k = 16, H_v = 32; KDA H_k = H_v = 32 (4 at d = 64); tiny in smoke mode."""
    if smoke:
        return R.ReplayConfig(1, 2, 64, 64, 8, gate=gate, state_dtype=state_dtype, cache_dtype=state_dtype)
    heads = (16, 32) if gate == "gdn" else (32, 32) if head_dim == 128 else (4, 4)
    return R.ReplayConfig(*heads, head_dim, head_dim, L, gate=gate, state_dtype=state_dtype, cache_dtype=state_dtype)


def gate_params(cfg: R.ReplayConfig, key):
    """Random `(A_log, dt_bias)`: the step then reads the token's g and beta as raw inputs."""
    ka, kb = jax.random.split(key)
    channels = (cfg.head_k_dim,) if cfg.per_channel_gate else ()
    return 0.3 * jax.random.normal(ka, (cfg.num_v_heads,)), jax.random.normal(kb, (cfg.num_v_heads, *channels))


def check_section(smoke: bool, gates=("gdn", "kda")) -> list[dict]:
    rows = []
    seen = set()
    for gate, state_dtype, batch, L, head_dim, raw in CHECK_CASES:
        cfg = check_config(gate, state_dtype, L, head_dim, smoke)
        if gate not in gates or (cfg, raw) in seen:
            continue
        seen.add((cfg, raw))
        batch = 3 if smoke else batch
        rng = np.random.default_rng(batch)
        num_slots = 2 * batch
        pool = db.random_pool(cfg, num_slots, jax.random.key(3), rng.integers(0, cfg.cache_len, num_slots))
        token = db.random_token(cfg, batch, jax.random.key(4))
        params = gate_params(cfg, jax.random.key(5)) if raw else None
        slots = jnp.asarray(np.where(np.arange(batch) % 5 == 4, -1, rng.permutation(num_slots)[:batch]), jnp.int32)
        force = jnp.asarray(np.arange(batch) % 3 == 0)
        outs = {}
        for backend in ("xla", "pallas_triton", "mosaic_gpu"):
            outs[backend] = jax.jit(functools.partial(R.decode_step, backend=backend, policy="natural",
                                                      use_qk_l2norm=True))(pool, token, slots, force,
                                                                           gate_params=params)
        ref_y, ref_state = outs["xla"]
        for backend in ("pallas_triton", "mosaic_gpu"):
            y, st = outs[backend]
            row = dict(backend=backend, gate=gate, state_dtype=cfg.state_dtype.name, batch=batch,
                       cache_len=cfg.cache_len, head_dim=cfg.head_k_dim, raw_gates=raw,
                       y=rel(y, ref_y), checkpoint=rel(st.checkpoint, ref_state.checkpoint),
                       u_cache=rel(st.u_cache, ref_state.u_cache), k_cache=rel(st.k_cache, ref_state.k_cache),
                       g_cache=rel(st.g_cache, ref_state.g_cache),
                       write_pos_equal=bool(np.array_equal(st.write_pos, ref_state.write_pos)))
            print(f"check {json.dumps(row)}", flush=True)
            rows.append(row)
    return rows


def sweep_section(timer, args, bandwidth) -> list[dict]:
    rows = []
    deadline = time.time() + args.budget_s
    for dtype in args.dtypes.split(","):
        for L in map(int, args.cache_lens.split(",")):
            for batch in map(int, args.batches.split(",")):
                if time.time() > deadline:
                    print(f"budget spent: skipping {dtype} L={L} B={batch}", flush=True)
                    continue
                sd = jnp.dtype(dtype)
                cfg = (R.ReplayConfig(1, 2, 64, 64, 8, state_dtype=sd, cache_dtype=sd) if args.smoke else
                       R.ReplayConfig(16, 32, 128, 128, L, state_dtype=sd, cache_dtype=sd))
                rng = np.random.default_rng(batch * 100 + L)
                plain_cfg = dataclasses.replace(cfg, cache_len=1)
                plain_us = db.time_plain(timer, plain_cfg, batch, db.plain_params(plain_cfg, batch), rng, 3, args.smoke)
                params = db.table_params(cfg, batch, FlushPolicy.NATURAL)
                cycle_bytes = cost.replay_cycle_bytes(cfg, batch).total
                floor = cost.floor_us(cycle_bytes, bandwidth)
                nf_bytes = statistics.mean(cost.replay_step_bytes(cfg, [p] * batch).total for p in range(cfg.cache_len - 1))
                fl_bytes = cost.replay_step_bytes(cfg, [cfg.cache_len - 1] * batch).total
                for staggered in (False, True):
                    t_nf, t_fl, t_cyc = db.time_replay(timer, cfg, batch, params, FlushPolicy.NATURAL, rng, 3,
                                                       args.smoke, staggered)
                    m_nf, m_fl, m_cyc = time_mosaic(timer, cfg, batch, rng, 3, args.smoke, staggered)
                    row = dict(state_dtype=cfg.state_dtype.name, cache_len=cfg.cache_len, batch=batch,
                               cursors="staggered" if staggered else "sync", triton_params=repr(params),
                               plain_us=plain_us, triton_nonflush_us=t_nf, triton_flush_us=t_fl,
                               triton_cycle_us=t_cyc, mosaic_nonflush_us=m_nf, mosaic_flush_us=m_fl,
                               mosaic_cycle_us=m_cyc, cycle_bytes=cycle_bytes, nonflush_bytes=nf_bytes,
                               flush_bytes=fl_bytes, cycle_floor_us=floor,
                               nonflush_floor_us=cost.floor_us(nf_bytes, bandwidth),
                               flush_floor_us=cost.floor_us(fl_bytes, bandwidth),
                               mosaic_floor_fraction=floor / m_cyc, triton_floor_fraction=floor / t_cyc,
                               mosaic_vs_plain=plain_us / m_cyc, triton_vs_plain=plain_us / t_cyc,
                               mosaic_vs_triton=t_cyc / m_cyc)
                    print(f"sweep {json.dumps(row)}", flush=True)
                    rows.append(row)
    return rows


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
                cfg = (R.ReplayConfig(1, 2, 64, 64, 8, gate="kda", state_dtype=sd, cache_dtype=sd) if args.smoke else
                       R.ReplayConfig(32, 32, 128, 128, L, gate="kda", state_dtype=sd, cache_dtype=sd))
                rng = np.random.default_rng(batch * 100 + L + 1)
                plain_cfg = dataclasses.replace(cfg, cache_len=1)
                plain_us = db.time_plain(timer, plain_cfg, batch, db.plain_params(plain_cfg, batch), rng, 3, args.smoke)
                policy = R.default_flush_policy(cfg, batch)
                params = db.table_params(cfg, batch, policy)
                cycle_bytes = cost.replay_cycle_bytes(cfg, batch).total
                floor = cost.floor_us(cycle_bytes, bandwidth)
                for staggered in (False, True):
                    _, _, t_step = db.time_replay(timer, cfg, batch, params, policy, rng, 3, args.smoke, staggered)
                    m_nf, m_fl, m_cyc = time_mosaic(timer, cfg, batch, rng, 3, args.smoke, staggered)
                    row = dict(gate="kda", state_dtype=cfg.state_dtype.name, cache_len=cfg.cache_len, batch=batch,
                               cursors="staggered" if staggered else "sync", triton_policy=policy.value,
                               triton_params=repr(params), plain_us=plain_us, triton_cycle_us=t_step,
                               mosaic_nonflush_us=m_nf, mosaic_flush_us=m_fl, mosaic_cycle_us=m_cyc,
                               cycle_bytes=cycle_bytes, cycle_floor_us=floor, mosaic_floor_fraction=floor / m_cyc,
                               mosaic_vs_plain=plain_us / m_cyc, triton_vs_plain=plain_us / t_step,
                               mosaic_vs_triton=t_step / m_cyc)
                    print(f"kda {json.dumps(row)}", flush=True)
                    rows.append(row)
    return rows


def print_table(rows):
    print(f"{'dtype':>8} {'L':>3} {'B':>4} {'cursors':>9} {'plain':>8} {'tri cyc':>8} {'mgpu nf':>8} {'mgpu fl':>8} "
          f"{'mgpu cyc':>8} {'floor':>8} {'m/floor':>7} {'m vs pl':>7} {'m vs tri':>8}")
    for r in rows:
        f = lambda x: f"{x:8.1f}" if x is not None else f"{'-':>8}"
        print(f"{r['state_dtype']:>8} {r['cache_len']:>3} {r['batch']:>4} {r['cursors']:>9} {f(r['plain_us'])} "
              f"{f(r['triton_cycle_us'])} {f(r['mosaic_nonflush_us'])} {f(r['mosaic_flush_us'])} {f(r['mosaic_cycle_us'])} "
              f"{f(r['cycle_floor_us'])} {r['mosaic_floor_fraction']:7.2f} {r['mosaic_vs_plain']:7.2f} "
              f"{r['mosaic_vs_triton']:8.2f}")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sections", default="check,sweep,kda")
    p.add_argument("--gates", default="gdn,kda", help="gates of the check section")
    p.add_argument("--out", default="mosaic_bench.json")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--cache-lens", default="16,32")
    p.add_argument("--batches", default="1,8,32,128,512")
    p.add_argument("--kda-dtypes", default="float32")
    p.add_argument("--kda-cache-lens", default="16")
    p.add_argument("--kda-batches", default="1,8,128,512")
    p.add_argument("--budget-s", type=float, default=420.0, help="stop starting new sweep / kda cells after this")
    p.add_argument("--smoke", action="store_true", help="tiny shapes, interpret mode, wall clock (CPU)")
    args = p.parse_args(argv)
    if args.smoke:
        args.batches, args.cache_lens, args.dtypes = "2", "8", "float32"
        args.kda_batches, args.kda_cache_lens, args.kda_dtypes = "2", "8", "float32"
    timer = db.Timer(args.smoke)
    result = dict(versions=db.versions(), args=vars(args))
    sections = args.sections.split(",")
    bandwidth = db.copy_bandwidth_GBps(timer)
    result["copy_bandwidth_GBps"] = bandwidth
    print(f"copy bandwidth {bandwidth:.0f} GB/s", flush=True)
    if "check" in sections:
        result["check"] = check_section(args.smoke, tuple(args.gates.split(",")))
    if "sweep" in sections:
        result["sweep"] = sweep_section(timer, args, bandwidth)
        print_table(result["sweep"])
    if "kda" in sections:
        result["kda"] = kda_section(timer, args, bandwidth)
        print("KDA (H_k = H_v = 32, d = 128; tri cyc: Triton under the table's default policy, per step)")
        print_table(result["kda"])
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1, default=str)
    print(f"wrote {args.out}", flush=True)


if __name__ == "__main__":
    main()
