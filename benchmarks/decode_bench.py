"""GPU benchmark of the ReplaySSM and plain decode kernels (one process, table + JSON).

Sections (check, tune, sweep by default; in this order):
  check   correctness on the GPU against the scan reference (fp32, bf16, every rebuild
          precision, KDA, in-kernel gating, padding rows) and the donated step's HLO
          (no copy of the state pool);
  tune    block_v x num_warps sweep of both kernels at a few batch sizes;
  steps   (diagnostic) per-step replay kernel time across a synchronised cycle;
  sweep   the benchmark grid: per config the plain kernel, and the replay kernel with
          synchronised cursors (non-flush, flush, cycle-amortised) and staggered cursors.
  debug   the cost of debug mode: wall time per decode step of `jit(decode_step)` and of
          `checked(decode_step)` (its in-jit checks on), both synchronised every step (the
          checked call must read its error back), and of `jit` pipelined as in serving.
  mamba2  Mamba-2 (gate "mamba2"): a GPU check of both Mamba-2 kernels against the scan
          reference, then the sweep's rows on Nemotron-H-8B (H = 128, P = 64, N = 128,
          G = 8) and Mamba-2 2.7B (H = 80, G = 1) shapes, fp32 and bf16 states,
          L in --mamba2-cache-lens, B in --mamba2-batches (L = 16 first, then fp32 first).

Timing: per-kernel CUPTI times (`jax.experimental.mosaic.gpu.profiler.measure`) of a jitted
`lax.scan` over whole cycles; the kernel rows are picked by name, medians over all steps of
a kind. The slot sets rotate between consecutive kernels (R disjoint sets of B slots, each
set used once every R kernels, R * B * slot bytes >= 3x the L2) so the L2 does not hold the
state. Byte floors use the copy bandwidth measured at the start of the same run.

  python benchmarks/decode_bench.py --out results.json            # on the GPU
  python benchmarks/decode_bench.py --smoke                        # CPU, interpret mode
  python benchmarks/decode_bench.py --sections mamba2 --budget-s 230 --out mamba2.json
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import datetime
import functools
import json
import math
import platform
import statistics
import sys
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

warnings.filterwarnings("ignore", message="The Pallas Triton backend is deprecated")

import replayssm_jax as R  # noqa: E402
from pallas_kernels import common  # noqa: E402
from pallas_kernels.common import GridOrder  # noqa: E402
from pallas_kernels.mamba2_decode import Mamba2PlainParams, mamba2_plain_decode  # noqa: E402
from pallas_kernels.plain_decode import PlainParams, plain_decode  # noqa: E402
from pallas_kernels.replay_decode import ReplayTileParams  # noqa: E402
from pallas_kernels.replay_decode_grouped import ReplayGroupedParams  # noqa: E402
from replayssm_jax import cost  # noqa: E402
from replayssm_jax.backends import pallas_triton  # noqa: E402
from replayssm_jax.plan import FlushPolicy  # noqa: E402
from replayssm_jax.state import state_shapes  # noqa: E402

L2_BYTES = 60 * 2**20  # H200 L2 (50 MiB usable; 60 MiB rounds up)
# Kernel rows picked by name: every replay-side kernel's pallas_call name starts with
# "replayssm_" (fold, per-tile and grouped replay); the plain kernel is "plain_decode".
REPLAY_KERNEL, PLAIN_KERNEL = "replayssm_", "plain_decode"


def table_params(cfg: R.ReplayConfig, batch: int, policy: FlushPolicy):
    """The launch table's parameters for this layer, batch and policy."""
    return pallas_triton.launch_params(cfg, batch, policy)


def plain_params(cfg: R.ReplayConfig, batch: int) -> PlainParams:
    """The launch table's plain-kernel parameters (the L = 1 step) for this layer's state."""
    return table_params(dataclasses.replace(cfg, cache_len=1), batch, FlushPolicy.NATURAL)


@dataclasses.dataclass(frozen=True)
class Shape:
    num_k_heads: int = 16
    num_v_heads: int = 32
    head_dim: int = 128
    gate: str = "gdn"
    value_dim: int | None = None  # d_v (Mamba-2: P) when it differs from d_k (Mamba-2: N)

    def config(self, cache_len: int, state_dtype) -> R.ReplayConfig:
        """Caches in the state dtype (fp32 state: exact parity with the plain recurrence)."""
        return R.ReplayConfig(
            self.num_k_heads, self.num_v_heads, self.head_dim, self.value_dim or self.head_dim, cache_len,
            gate=self.gate, state_dtype=state_dtype, cache_dtype=state_dtype,
        )


# Mamba-2 layer shapes (`Shape(G, H, N, "mamba2", P)`).
NEMOTRON_H_8B = Shape(8, 128, 128, "mamba2", 64)
MAMBA2_2_7B = Shape(1, 80, 128, "mamba2", 64)


def variant_fields(items: list[str]) -> tuple[bool, dict]:
    """`(on_defaults, fields)` of a kernel variant spec split into its items: whether it
    starts with `default` (the named fields then replace the backend's defaults), and the
    `field=value` items (`true` / `false` as bools, digits as ints, other values as they
    are)."""
    parse = lambda v: v == "true" if v in ("true", "false") else int(v) if v.isdigit() else v
    on_defaults = items[0] == "default"
    return on_defaults, {name: parse(value) for name, value in (item.split("=") for item in items[on_defaults:])}


def mamba2_params(heads: int) -> R.Mamba2Params:
    """Fixed Mamba-2 layer parameters of `heads` heads: A in [-8, -1], dt_bias near
    softplus^-1(0.05)."""
    return R.Mamba2Params(A=-jnp.linspace(1.0, 8.0, heads, dtype=jnp.float32),
                          D=jnp.ones((heads,), jnp.float32), dt_bias=jnp.full((heads,), -3.0, jnp.float32))


# ----------------------------------------------------------------------------- timing


def kernel_runs(fn, args, iterations: int) -> list[list[tuple[str, float]]]:
    """CUPTI `(kernel name, µs)` of each of `iterations` runs of `fn(*args)`."""
    from jax.experimental.mosaic.gpu import profiler

    _, runs = profiler.measure(fn, aggregate=False, iterations=iterations)(*args)
    runs = runs if iterations > 1 else [runs]
    return [[(name, ms * 1e3) for name, ms in run] for run in runs]


class Timer:
    """Per-kernel GPU times (µs) of one call: CUPTI on a GPU, wall clock in smoke mode;
    `resident_slots`: the slot layout of the pools it times (`slot_sets`)."""

    def __init__(self, smoke: bool, resident_slots: int = 0):
        self.smoke = smoke
        self.resident_slots = resident_slots

    def kernel_times(self, fn, args, name: str, iterations: int) -> list[float]:
        if self.smoke:  # one call, compile included: smoke times exercise the code, they measure nothing
            t0 = time.perf_counter()
            jax.block_until_ready(fn(*args))
            return [(time.perf_counter() - t0) * 1e6]
        runs = kernel_runs(fn, args, iterations)
        times = [[us for kname, us in run if name in kname] for run in runs]
        if not times[0]:
            names = sorted({kname for kname, _ in runs[0]})
            raise RuntimeError(f"no kernel named {name!r} among {names}")
        if not getattr(self, "_shown", False):
            print(f"cupti kernels of one run: {sorted({k for k, _ in runs[0]})}", flush=True)
            self._shown = True
        return [t for run in times for t in run]  # launch order, run after run

    def run_totals(self, fn, args, iterations: int, label: str = "", per: int = 1) -> list[float]:
        """µs of all of `fn`'s kernels together, one figure per run (smoke: one wall-clock call).
        With a `label`, also prints each kernel's median µs over the runs, divided by `per`
        (the steps one run holds), so that a total can be read kernel by kernel."""
        if self.smoke:
            return self.kernel_times(fn, args, "", 1)
        runs = kernel_runs(fn, args, iterations)
        if label:
            per_kernel = collections.defaultdict(list)
            for run in runs:
                totals = collections.defaultdict(float)
                for kname, us in run:
                    totals[kname] += us
                for kname, us in totals.items():
                    per_kernel[kname].append(us / per)
            shares = ", ".join(f"{k}: {statistics.median(v):.1f}" for k, v in sorted(per_kernel.items()))
            print(f"{label} µs per step by kernel: {shares}", flush=True)
        return [sum(us for _, us in run) for run in runs]


def copy_bandwidth_GBps(timer: Timer, num_bytes: int = 2 << 30) -> float:
    """Device-to-device streaming bandwidth: read + write of a `num_bytes` f32 buffer (NaN
    in smoke mode, before the buffer is made: 2 GiB on a CPU costs half a minute)."""
    if timer.smoke:
        return float("nan")
    x = jax.random.normal(jax.random.key(0), (num_bytes // 4,), jnp.float32)
    fn = jax.jit(lambda a: a * 1.0001 + 1.0)
    from jax.experimental.mosaic.gpu import profiler

    _, runs = profiler.measure(fn, aggregate=True, iterations=10)(x)
    return 2 * num_bytes / (statistics.median(runs) * 1e-3) / 1e9


# ----------------------------------------------------------------------------- state


def random_pool(cfg: R.ReplayConfig, num_slots: int, key, write_pos) -> R.ReplayState:
    """A pool with random (non-zero) checkpoint and caches and the given cursors."""
    ks = jax.random.split(key, 4)
    shapes = state_shapes(cfg, num_slots)
    rnd = lambda k, s, scale: (scale * jax.random.normal(k, s.shape, jnp.float32)).astype(s.dtype)
    return R.ReplayState(
        checkpoint=rnd(ks[0], shapes["checkpoint"], 0.05),
        u_cache=rnd(ks[1], shapes["u_cache"], 0.05),
        k_cache=rnd(ks[2], shapes["k_cache"], 0.08),
        # log-decays (negative) for the delta rule; time steps dt (positive) for Mamba-2
        g_cache=(1.0 if cfg.gate_kind.additive else -1.0) * jnp.abs(rnd(ks[3], shapes["g_cache"], 0.05)),
        write_pos=jnp.asarray(write_pos, jnp.int32),
        config=cfg,
    )


def random_token(cfg: R.ReplayConfig, batch: int, key) -> R.Tokens | R.Mamba2Tokens:
    ks = jax.random.split(key, 5)
    hk, hv, dk, dv = cfg.num_k_heads, cfg.num_v_heads, cfg.head_k_dim, cfg.head_v_dim
    bf = jnp.bfloat16
    if cfg.gate_kind.additive:
        return R.Mamba2Tokens(
            jax.random.normal(ks[0], (batch, hv, dv), bf), jax.random.normal(ks[1], (batch, hk, dk), bf),
            jax.random.normal(ks[2], (batch, hk, dk), bf), jax.random.normal(ks[3], (batch, hv), jnp.float32),
            jax.random.normal(ks[4], (batch, hv, dv), bf),
        )
    return R.Tokens(
        jax.random.normal(ks[0], (batch, hk, dk), bf),
        jax.random.normal(ks[1], (batch, hk, dk), bf),
        jax.random.normal(ks[2], (batch, hv, dv), bf),
        -0.1 * jax.nn.softplus(jax.random.normal(ks[3], cfg.g_shape(batch), jnp.float32)),
        jax.nn.sigmoid(jax.random.normal(ks[4], (batch, hv), jnp.float32)),
    )


def pool_layout(batch: int, slot_bytes: int, smoke: bool) -> tuple[int, int]:
    """(R, N): R slot sets of `batch` slots with R * batch * slot_bytes >= 3 x L2, in a
    pool of N >= 2 * batch slots."""
    rotations = 1 if smoke else max(1, math.ceil(3 * L2_BYTES / (batch * slot_bytes)))
    return rotations, max(2 * batch, rotations * batch)


def add_resident_slots_option(parser) -> None:
    """`--resident-slots K` (`slot_sets`' diagnostic), for the sweeps that take it."""
    parser.add_argument("--resident-slots", type=int, default=0,
                        help="a diagnostic: every row on one of this many slots, a pool the L2 holds "
                             "(`decode_bench.slot_sets`): the times without HBM traffic, their floor fractions "
                             "then not of the HBM's floor; 0 (default): slot sets rotated past the L2")


def option_timer(args) -> Timer:
    """The `Timer` of parsed `--smoke` and `--resident-slots` (refused below 0)."""
    if args.resident_slots < 0:
        raise SystemExit(f"--resident-slots must be >= 0, got {args.resident_slots}")
    return Timer(args.smoke, args.resident_slots)


def slot_sets(batch: int, slot_bytes: int, rng: np.random.Generator, smoke: bool, resident_slots: int = 0):
    """R disjoint shuffled sets of `batch` slots `[R, B]`, and the pool size N.

    `resident_slots` K > 0, a diagnostic: one set whose rows share a pool of K slots (row
    r on slot r mod K, shuffled), small enough for the L2 to hold, so the kernels run
    without HBM traffic and their time is their work's (issue, latency, L2 bandwidth):
    what bounds them on a GPU of more HBM bandwidth with the same SMs (an H100's timing for
    an H200). Rows of one slot read and write each other's records, so the values are
    meaningless; only the times are kept."""
    if resident_slots:
        return rng.permutation(np.arange(batch) % resident_slots)[None].astype(np.int32), resident_slots
    rotations, num_slots = pool_layout(batch, slot_bytes, smoke)
    sets = rng.permutation(num_slots)[: rotations * batch].reshape(rotations, batch)
    return sets.astype(np.int32), num_slots


# ----------------------------------------------------------------------------- timed runs


@functools.lru_cache(maxsize=None)
def replay_cycle_fn(cfg: R.ReplayConfig, params, policy: FlushPolicy, interpret: bool):
    """jit: L steps, each over every slot set in turn; returns the state."""

    def one_step(token, state, slots):
        plan = R.plan_step(state.write_pos, slots, None, cfg.cache_len, policy)
        if cfg.gate_kind.additive:
            y, state = pallas_triton.mamba2_layer_step(state, token, plan, params=mamba2_params(cfg.num_v_heads),
                                                       kernel_params=params, interpret=interpret)
        else:
            y, state = pallas_triton.layer_step(
                state, token, plan, use_qk_l2norm=True, scale=None, kernel_params=params, interpret=interpret,
            )
        state = dataclasses.replace(state, write_pos=R.advance_write_pos(state.write_pos, plan))
        return state, y[0, 0, 0]

    def cycle(state, sets, token):
        over_sets = lambda st, _: jax.lax.scan(functools.partial(one_step, token), st, sets)
        state, _ = jax.lax.scan(over_sets, state, None, length=cfg.cache_len)
        return state

    return jax.jit(cycle)


@functools.lru_cache(maxsize=None)
def plain_steps_fn(params: PlainParams | Mamba2PlainParams, steps: int, interpret: bool):
    def one_step(token, state, slots):
        if isinstance(params, Mamba2PlainParams):
            layer = mamba2_params(state.shape[1])
            y, state = mamba2_plain_decode(
                state, token.x, token.B, token.C, token.dt, layer.A, layer.D, layer.dt_bias, slots, slots >= 0,
                z=token.z, params=params, interpret=interpret,
            )
        else:
            y, state = plain_decode(
                state, token.q, token.k, token.v, token.g, token.beta, slots, slots >= 0, use_qk_l2norm=True,
                params=params, interpret=interpret,
            )
        return state, y[0, 0, 0]

    def run(state, sets, token):
        over_sets = lambda st, _: jax.lax.scan(functools.partial(one_step, token), st, sets)
        state, _ = jax.lax.scan(over_sets, state, None, length=steps)
        return state

    return jax.jit(run)


@functools.lru_cache(maxsize=None)
def time_plain_cached(timer, cfg_without_len, batch, params, iterations, smoke) -> float:
    """Plain-kernel µs, measured once per (state config, batch, tiles): L plays no part."""
    return time_plain(timer, cfg_without_len, batch, params, np.random.default_rng(batch), iterations, smoke)


def time_plain(timer, cfg, batch, params, rng, iterations, smoke) -> float:
    sets, num_slots = slot_sets(batch, cfg.state_bytes_per_slot(), rng, smoke, timer.resident_slots)
    pool = random_pool(cfg, num_slots, jax.random.key(1), np.zeros(num_slots)).checkpoint
    token = random_token(cfg, batch, jax.random.key(2))
    fn = plain_steps_fn(params, 4, interpret=smoke)
    times = timer.kernel_times(fn, (pool, jnp.asarray(sets), token), PLAIN_KERNEL, iterations)
    return statistics.median(times)


def step_medians(times: list[float], rotations: int, cache_len: int) -> list[float]:
    """Median kernel µs at each step of a synchronised cycle (step i: every row at pos i)."""
    per_run = rotations * cache_len
    by_step = [[t for i, t in enumerate(times) if (i % per_run) // rotations == s]
               for s in range(cache_len)]
    return [statistics.median(ts) for ts in by_step]


def replay_kernel_times(timer, cfg, batch, params, policy, rng, iterations, smoke, staggered: bool):
    """All replay-kernel µs of `iterations` cycles (launch order) and the rotation count R."""
    sets, num_slots = slot_sets(batch, cfg.state_bytes_per_slot(), rng, smoke, timer.resident_slots)
    cursors = rng.integers(0, cfg.cache_len, num_slots) if staggered else np.zeros(num_slots)
    pool = random_pool(cfg, num_slots, jax.random.key(1), cursors)
    token = random_token(cfg, batch, jax.random.key(2))
    fn = replay_cycle_fn(cfg, params, policy, interpret=smoke)
    name = PLAIN_KERNEL if cfg.cache_len == 1 else REPLAY_KERNEL  # L = 1 runs the plain kernel
    return timer.kernel_times(fn, (pool, jnp.asarray(sets), token), name, iterations), len(sets)


def time_replay(timer, cfg, batch, params, policy, rng, iterations, smoke, staggered: bool):
    """Median kernel µs: (non-flush, flush, cycle-amortised) for sync cursors, or
    (None, None, per-step) for staggered cursors. A fold-every-step policy gives
    (None, per-step, per-step) for both."""
    L = cfg.cache_len
    times, rotations = replay_kernel_times(timer, cfg, batch, params, policy, rng, iterations, smoke, staggered)
    if policy is FlushPolicy.EVERY_STEP:
        return None, statistics.median(times), statistics.median(times)
    if staggered or timer.smoke:
        return None, None, statistics.median(times)
    if L == 1:
        return None, statistics.median(times), statistics.median(times)
    return split_cycle(times, rotations, L)


def split_cycle(times: list[float], rotations: int, cache_len: int) -> tuple[float, float, float]:
    """(non-flush, flush, cycle-amortised) median µs of synchronised cycles given in launch
    order (step L - 1 flushes every row)."""
    L = cache_len
    step_of = lambda i: (i % (rotations * L)) // rotations
    flush = [t for i, t in enumerate(times) if step_of(i) == L - 1]
    nonflush = [t for i, t in enumerate(times) if step_of(i) != L - 1]
    nf, fl = statistics.median(nonflush), statistics.median(flush)
    return nf, fl, ((L - 1) * nf + fl) / L


# ----------------------------------------------------------------------------- sections


def rel_err(x, ref) -> float:
    x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(x - ref) / max(np.linalg.norm(ref), 1e-30))


# The per-tile replay kernel as the GPU check runs it: two cache chunks at L = 13 or 16,
# the exact rebuild 8 entries per round trip (a partial last load at L = 13).
CHECK_PER_TILE = ReplayTileParams(block_v=8, num_warps=1, cache_chunk=8, rebuild_unroll=8)


def check_layouts() -> dict:
    """The check section's kernel launches by name: the launch table's rows at the batches
    and layers named (GDN H_v = 32 fp32 unless said), and two launch-order variants."""
    gdn = lambda L=16, dtype=jnp.float32, gate="gdn": R.ReplayConfig(
        16, 32, 128, 128, L, gate=gate, state_dtype=dtype, cache_dtype=dtype)
    natural, every = FlushPolicy.NATURAL, FlushPolicy.EVERY_STEP
    return {
        "grouped": table_params(gdn(), 512, natural),
        "grouped_one_tile": table_params(gdn(), 8, natural),
        "grouped_mid": table_params(gdn(), 32, natural),
        "grouped_one_tile_ordered": table_params(gdn(), 16, natural),
        "per_tile": CHECK_PER_TILE,
        "fold": table_params(gdn(), 1, every),
        "fold_two_byte": table_params(gdn(dtype=jnp.bfloat16), 1, every),
        "fold_kda": table_params(gdn(gate="kda"), 512, every),
        "kda_replay": table_params(gdn(gate="kda"), 512, natural),
        "plain": plain_params(gdn(), 512),
        "grouped_two_byte_mid": table_params(gdn(dtype=jnp.bfloat16), 32, natural),
        "grouped_long_cache": table_params(gdn(17, jnp.bfloat16), 32, natural),
        "grouped_launch_order": dataclasses.replace(table_params(gdn(), 512, natural),
                                                    grid_order=GridOrder.LAUNCH_ORDER),
        "per_tile_launch_order": dataclasses.replace(CHECK_PER_TILE, grid_order=GridOrder.LAUNCH_ORDER),
    }


def check_section(smoke: bool) -> list[dict]:
    """GPU kernels vs the scan reference at every step; the donated step's HLO.

    Each case runs one kernel layout with the case's rebuild precision: "grouped" (the
    package's configuration at large batch), "grouped_one_tile" (its configuration at
    B = 6-9: one `[64, d_k]` tile per program; "grouped_one_tile_ordered" the same at
    B = 10-28, in launch order with the row read per tile), "grouped_mid" (at B = 29-64:
    launch order, the row read per tile), "grouped_two_byte_mid" (a 2-byte state's at
    B = 9-64: T = 2 in launch order), "grouped_long_cache" (a 2-byte state's at B = 9-64
    for L > 16: the one-tile entry on whole rows), "per_tile" (`replay_decode` walking the cache
    in two chunks, the exact rebuild 8 entries per round trip), "fold" (`fold_decode`, the
    package's configuration at small batch; "fold_two_byte" its bf16-state one; "fold_kda"
    KDA's at large batch: the plain kernel's tile, empty-cache branch) or "plain"
    (L = 1: the plain kernel with the package's large-batch configuration), under one of
    four plans: "replay" (flush when the cache is full, or forced), "every_step" (every
    live row flushes: the fold-every-step policy), "fold_natural" ("fold" under the
    replay plan: appends, and folds of every cursor on the GPU) and "staggered" (the replay
    plan with rows forced to flush at different steps, so steps mix flush and append rows
    at different cursors: "*_launch_order" layouts launch them in the plan's order).
    """
    rows = []
    dims = (2, 4, 32, 32) if smoke else (4, 8, 128, 128)
    cases = [
        ("gdn", 4, jnp.float32, "ieee", False, "grouped"), ("gdn", 16, jnp.float32, "ieee", False, "grouped"),
        ("gdn", 16, jnp.float32, "tf32", False, "grouped"), ("gdn", 16, jnp.float32, "bf16", False, "grouped"),
        ("gdn", 16, jnp.bfloat16, "bf16", False, "grouped"), ("kda", 16, jnp.float32, "ieee", False, "grouped"),
        ("kda", 8, jnp.bfloat16, "tf32", False, "grouped"), ("gdn", 1, jnp.float32, "ieee", False, "plain"),
        ("gdn", 16, jnp.float32, "ieee", True, "grouped"), ("kda", 16, jnp.float32, "ieee", True, "grouped"),
        ("gdn", 13, jnp.float32, "ieee", False, "per_tile"), ("kda", 16, jnp.float32, "ieee", True, "per_tile"),
        ("gdn", 16, jnp.float32, "ieee", False, "grouped_one_tile"),
        ("gdn", 13, jnp.float32, "ieee", True, "grouped_one_tile"),
    ]
    cases = [case + ("replay",) for case in cases] + [
        ("gdn", 16, jnp.float32, "ieee", False, "fold", "every_step"),
        ("kda", 13, jnp.float32, "ieee", True, "fold", "fold_natural"),
        ("gdn", 16, jnp.bfloat16, "ieee", False, "fold_two_byte", "every_step"),
        ("kda", 16, jnp.float32, "ieee", True, "fold_kda", "every_step"),
        ("kda", 13, jnp.float32, "ieee", False, "fold_kda", "fold_natural"),
        ("gdn", 16, jnp.float32, "ieee", False, "grouped_launch_order", "staggered"),
        ("gdn", 13, jnp.float32, "ieee", True, "grouped_mid", "staggered"),
        ("gdn", 16, jnp.float32, "ieee", False, "grouped_one_tile_ordered", "staggered"),
        ("gdn", 16, jnp.bfloat16, "ieee", False, "grouped_launch_order", "staggered"),
        ("kda", 13, jnp.float32, "ieee", True, "per_tile_launch_order", "staggered"),
        ("gdn", 16, jnp.bfloat16, "ieee", False, "grouped_two_byte_mid", "staggered"),
        ("gdn", 17, jnp.bfloat16, "ieee", True, "grouped_long_cache", "staggered"),
        ("kda", 16, jnp.float32, "ieee", True, "kda_replay", "staggered"),
    ]
    layouts = check_layouts()
    if smoke:  # two grouped, the two fp32 folding cases and the fp32 launch-order case
        launch_order_fp32 = lambda c: c[5:] == ("grouped_launch_order", "staggered") and c[2] == jnp.float32
        cases = cases[:2] + [c for c in cases if c[5] == "fold" or launch_order_fp32(c)]
    for gate, L, dtype, precision, raw, layout, plan_kind in cases:
        hk, hv, dk, dv = dims
        cfg = R.ReplayConfig(hk, hv, dk, dv, L, gate=gate, state_dtype=dtype, cache_dtype=dtype)
        batch, num_slots, steps = 6, 12, 3 * L + 1
        rng = np.random.default_rng(L)
        slots = np.array([7, 2, -1, 11, 0, 5], np.int32)
        s0 = 0.1 * rng.standard_normal((num_slots, hv, dv, dk)).astype(np.float32)
        state = R.init_state(cfg, num_slots, jnp.asarray(s0, dtype))
        q = rng.standard_normal((batch, steps, hk, dk)).astype(np.float32)
        k = rng.standard_normal((batch, steps, hk, dk)).astype(np.float32)
        v = rng.standard_normal((batch, steps, hv, dv)).astype(np.float32)
        g_shape = (batch, steps, hv, dk) if gate == "kda" else (batch, steps, hv)
        a = rng.standard_normal(g_shape).astype(np.float32)
        b = rng.standard_normal((batch, steps, hv)).astype(np.float32)
        a_log = rng.standard_normal(hv).astype(np.float32) * 0.5
        dt_bias = rng.standard_normal((hv, dk) if gate == "kda" else (hv,)).astype(np.float32)
        gate_fn = R.kda_gate if gate == "kda" else R.gdn_gate
        g = np.asarray(gate_fn(jnp.asarray(a), jnp.asarray(a_log), jnp.asarray(dt_bias)))
        beta = np.asarray(R.beta_gate(jnp.asarray(b)))
        init = np.where(slots[:, None, None, None] >= 0, np.asarray(jnp.asarray(s0, dtype), np.float32)[np.maximum(slots, 0)], 0)
        y_ref, _, s_ref = R.recurrent_reference(R.Tokens(q, k, v, g, beta), init, use_qk_l2norm=True,
                                                return_all_states=True)
        params = layouts[layout]
        if hasattr(params, "rebuild_precision"):
            params = common.with_rebuild_precision(params, precision)
        policy = FlushPolicy.EVERY_STEP if plan_kind == "every_step" else FlushPolicy.NATURAL

        @functools.partial(jax.jit, donate_argnums=0)
        def step(state, q, k, v, g_or_a, beta_or_b, slots, force):
            plan = R.plan_step(state.write_pos, slots, force, cfg.cache_len, policy)
            y, new = pallas_triton.layer_step(
                state, R.Tokens(q, k, v, g_or_a, beta_or_b), plan, use_qk_l2norm=True, scale=None,
                gate_params=(jnp.asarray(a_log), jnp.asarray(dt_bias)) if raw else None,
                kernel_params=params, interpret=smoke,
            )
            return y, dataclasses.replace(new, write_pos=R.advance_write_pos(state.write_pos, plan))

        y_err = s_err = 0.0
        live = slots >= 0
        for t in range(steps):
            gin, bin_ = (a[:, t], b[:, t]) if raw else (g[:, t], beta[:, t])
            force = (t + 3 * np.arange(batch)) % 7 == 0 if plan_kind == "staggered" else None
            y, state = step(state, q[:, t], k[:, t], v[:, t], gin, bin_, jnp.asarray(slots), force)
            y = np.asarray(y, np.float32)
            assert np.all(y[~live] == 0), "padding row output not zero"
            y_err = max(y_err, rel_err(y[live], y_ref[live, t]))
            s_live = np.asarray(R.materialize_state(state, jnp.asarray(slots)))
            s_err = max(s_err, rel_err(s_live[live], s_ref[live, t]))
        hlo = step.lower(state, q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], jnp.asarray(slots),
                         force).compile().as_text()
        pool_shape = "[" + ",".join(map(str, state.checkpoint.shape)) + "]"
        pool_copies = [ln.strip()[:120] for ln in hlo.splitlines() if pool_shape in ln and " copy(" in ln]
        row = dict(gate=gate, cache_len=L, dtype=jnp.dtype(dtype).name, precision=precision,
                   layout=layout, plan=plan_kind,
                   raw_gates=raw, kernel_params=repr(params), y_rel_err=y_err, state_rel_err=s_err,
                   pool_copies=len(pool_copies))
        print(f"check {row}", flush=True)
        rows.append(row)
    return rows


TUNE_VARIANTS = (  # per-tile (ReplayTileParams) and grouped (ReplayGroupedParams) replay kernels
    ReplayTileParams(8, 1, cache_chunk=8, rebuild_unroll=8), ReplayTileParams(32, 2, rebuild_unroll=4),
    ReplayTileParams(64, 4, rebuild_unroll=4),
    ReplayGroupedParams(16, 1, 1, rebuild_unroll=4), ReplayGroupedParams(16, 2, 2, rebuild_unroll=4),
    ReplayGroupedParams(32, 2, 2, rebuild_unroll=4), ReplayGroupedParams(16, 4, 4, rebuild_unroll=4),
    ReplayGroupedParams(32, 4, 4, rebuild_unroll=4), ReplayGroupedParams(32, 4, 8, rebuild_unroll=4),
    ReplayGroupedParams(64, 8, 4, rebuild_unroll=4),
)


def tune_section(timer, shape, batches, smoke, deadline) -> tuple[list[dict], dict]:
    """Time every variant of the replay kernels (GDN, fp32 state, L = 16, sync cursors,
    natural policy) beside the plain kernel's table entry, then the best variant of the
    last batch with the tensor-core rebuilds.

    Returns the rows and `{batch: best replay parameters}`.
    """
    rows, best = [], {}
    variants = TUNE_VARIANTS[:2] if smoke else TUNE_VARIANTS
    cfg = shape.config(16, jnp.float32)
    natural = FlushPolicy.NATURAL
    for batch in batches:
        replay_times = {}
        plain_us = time_plain_cached(timer, dataclasses.replace(cfg, cache_len=1), batch,
                                     plain_params(cfg, batch), 3, smoke)
        for params in variants:
            if time.time() > deadline:
                break
            try:
                nf, fl, replay_us = time_replay(timer, cfg, batch, params, natural, np.random.default_rng(0),
                                                3, smoke, staggered=False)
            except Exception as err:  # a variant that does not compile is skipped, not fatal
                print(f"FAILED tune B={batch} {params}: {err!r}"[:2000], flush=True)
                continue
            replay_times[params] = replay_us
            row = dict(batch=batch, params=repr(params), plain_us=plain_us, replay_nonflush_us=nf,
                       replay_flush_us=fl, replay_cycle_us=replay_us)
            print(f"tune {row}", flush=True)
            rows.append(row)
        if replay_times:
            best[batch] = min(replay_times, key=replay_times.get)
            print(f"tune best B={batch}: {best[batch]}", flush=True)
    for batch in batches[-1:]:
        base = best.get(batch, table_params(cfg, batch, natural))
        for precision in ("tf32", "bf16"):
            params = common.with_rebuild_precision(base, precision)
            try:
                nf, fl, rep = time_replay(timer, cfg, batch, params, natural, np.random.default_rng(0), 3, smoke,
                                          staggered=False)
            except Exception as err:
                print(f"FAILED tune B={batch} {params}: {err!r}"[:2000], flush=True)
                continue
            row = dict(batch=batch, params=repr(params), precision=precision, replay_nonflush_us=nf,
                       replay_flush_us=fl, replay_cycle_us=rep)
            print(f"tune {row}", flush=True)
            rows.append(row)
    return rows, best


def choose_params(best: dict, cfg: R.ReplayConfig, batch: int, policy: FlushPolicy):
    """The replay-side parameters for a sweep cell: for GDN under the natural policy at
    L > 1 the tuned ones of the nearest tuned batch (log scale) when the tune section ran,
    else the launch table's."""
    if best and cfg.gate == "gdn" and policy is FlushPolicy.NATURAL and cfg.cache_len > 1:
        nearest = min(best, key=lambda b: (abs(math.log2(b) - math.log2(batch)), b))
        return best[nearest]
    return table_params(cfg, batch, policy)


def sweep_row(timer, shape, cfg, batch, bandwidth, smoke, params, policy: FlushPolicy) -> list[dict]:
    """Plain kernel and the replay cycle (sync and staggered cursors) of one grid cell."""
    kc_plain = plain_params(cfg, batch)
    rng = np.random.default_rng(batch * 1000 + cfg.cache_len)
    iters = 3
    plain_us = time_plain_cached(timer, dataclasses.replace(cfg, cache_len=1), batch, kc_plain, iters, smoke)
    plain_bytes = cost.plain_step_bytes(cfg, batch).total
    L = cfg.cache_len
    every_step = policy is FlushPolicy.EVERY_STEP or L == 1
    out = []
    for staggered in (False, True):
        if staggered and L == 1:
            continue
        nf, fl, cyc = time_replay(timer, cfg, batch, params, policy, rng, iters, smoke, staggered)
        if every_step:  # every step: a flush of an empty cache
            cycle_bytes = fl_bytes = batch * cost.replay_row_bytes(cfg, 0, force_flush=True).total
            nf_bytes = None
        else:
            cycle_bytes = cost.replay_cycle_bytes(cfg, batch).total
            nf_bytes = None if staggered else statistics.mean(
                cost.replay_step_bytes(cfg, [p] * batch).total for p in range(L - 1))
            fl_bytes = None if staggered else cost.replay_step_bytes(cfg, [L - 1] * batch).total
        floor = cost.floor_us(cycle_bytes, bandwidth)
        plain_floor = cost.floor_us(plain_bytes, bandwidth)
        launched = common.for_head_dim(params, cfg.head_v_dim)
        row = dict(
            gate=shape.gate, num_k_heads=cfg.num_k_heads, num_v_heads=cfg.num_v_heads,
            head_k_dim=cfg.head_k_dim, head_v_dim=cfg.head_v_dim,
            state_dtype=cfg.state_dtype.name, cache_dtype=cfg.cache_dtype.name, cache_len=L,
            batch=batch, num_slots=pool_layout(batch, cfg.state_bytes_per_slot(), smoke)[1],
            cursors="staggered" if staggered else "sync", policy=policy.value,
            kernel=type(launched).__name__, params=repr(launched), plain_params=repr(kc_plain),
            plain_us=plain_us, plain_bytes=plain_bytes,
            replay_nonflush_us=nf, replay_flush_us=fl, replay_cycle_us=cyc,
            replay_nonflush_bytes=nf_bytes, replay_flush_bytes=fl_bytes, replay_cycle_bytes=cycle_bytes,
            replay_floor_us=floor, plain_floor_us=plain_floor,
            replay_roofline_fraction=floor / cyc, plain_roofline_fraction=plain_floor / plain_us,
            speedup_vs_plain=plain_us / cyc,
        )
        out.append(row)
    return out


def steps_section(timer, shape, cases, smoke, best, bandwidth_GBps: float) -> list[dict]:
    """Where the replay kernel's time goes: per-step kernel µs across a synchronised cycle
    (step i reads i cache entries; the last step flushes), beside the plain kernel."""
    rows = []
    for batch, L in cases:
        cfg = shape.config(L, jnp.float32)
        params = choose_params(best, cfg, batch, FlushPolicy.NATURAL)
        rng = np.random.default_rng(7)
        times, rotations = replay_kernel_times(timer, cfg, batch, params, FlushPolicy.NATURAL, rng, 3, smoke,
                                               staggered=False)
        per_step = [times[0]] * L if smoke else step_medians(times, rotations, L)
        plain = time_plain(timer, cfg, batch, plain_params(cfg, batch), rng, 3, smoke)
        row = dict(batch=batch, cache_len=L, params=repr(params),
                   plain_us=plain, replay_step_us=per_step,
                   checkpoint_read_floor_us=cost.floor_us(batch * cfg.state_bytes_per_slot(),
                                                          bandwidth_GBps))
        print(f"steps {json.dumps(row)}", flush=True)
        rows.append(row)
    return rows


def debug_section(shape, batches: list[int], smoke: bool, steps: int = 100) -> list[dict]:
    """Wall µs per donated decode step (GDN, fp32, L = 16, pallas_triton, natural policy):
    plain jit and `checked` each synchronised per step, and plain jit pipelined; medians
    over `steps` steps after a warm-up cycle."""
    cfg = shape.config(4 if smoke else 16, jnp.float32)
    step_fn = functools.partial(R.decode_step, backend="pallas_triton", policy="natural", use_qk_l2norm=True)
    variants = {"jit": jax.jit(step_fn, donate_argnums=0), "checked": R.checked(step_fn, donate_argnums=0)}
    rows = []
    for batch in batches:
        token = random_token(cfg, batch, jax.random.key(batch))
        slots = jnp.arange(batch, dtype=jnp.int32)
        row = dict(gate=cfg.gate, state_dtype=cfg.state_dtype.name, cache_len=cfg.cache_len, batch=batch)
        for name, fn in variants.items():
            state = random_pool(cfg, 2 * batch, jax.random.key(0), np.zeros(2 * batch, np.int32))
            for _ in range(cfg.cache_len):
                _, state = jax.block_until_ready(fn(state, token, slots))
            times = []
            for _ in range(steps):
                t0 = time.perf_counter()
                _, state = jax.block_until_ready(fn(state, token, slots))
                times.append((time.perf_counter() - t0) * 1e6)
            row[f"{name}_sync_us"] = statistics.median(times)
            if name == "jit":
                t0 = time.perf_counter()
                for _ in range(steps):
                    _, state = fn(state, token, slots)
                jax.block_until_ready(state)
                row["jit_pipelined_us"] = (time.perf_counter() - t0) * 1e6 / steps
        row["checked_vs_jit_sync"] = row["checked_sync_us"] / row["jit_sync_us"]
        row["checked_vs_jit_pipelined"] = row["checked_sync_us"] / row["jit_pipelined_us"]
        print(f"debug {json.dumps(row)}", flush=True)
        rows.append(row)
    return rows


def mamba2_check(smoke: bool) -> list[dict]:
    """Both Mamba-2 kernels on the device against the scan reference: a few steps through
    a shuffled pool with a padding row and forced flushes; errors of y and the live state."""
    rows = []
    shape = Shape(2, 4, 32, "mamba2", 16) if smoke else Shape(2, 8, 128, "mamba2", 64)
    cases = ((1, jnp.float32), (4, jnp.float32), (4, jnp.bfloat16)) if smoke else (
        (1, jnp.float32), (4, jnp.float32), (16, jnp.float32), (16, jnp.bfloat16))
    for L, dtype in cases:
        cfg = shape.config(L, dtype)
        params = mamba2_params(cfg.num_v_heads)
        rng = np.random.default_rng(L)
        steps, seqs, num_slots = L + 3, 3, 6
        tokens = random_token(cfg, seqs * steps, jax.random.key(L))
        tokens = jax.tree.map(lambda a: a.astype(jnp.float32).reshape(seqs, steps, *a.shape[1:]), tokens)
        seq_slots = rng.permutation(num_slots)[:seqs]
        ref_y, _, ref_states = R.mamba2_reference(
            tokens, jnp.zeros((seqs, cfg.num_v_heads, cfg.head_v_dim, cfg.head_k_dim)), params,
            return_all_states=True)
        state = R.init_state(cfg, num_slots)
        step = jax.jit(functools.partial(R.decode_step, backend="pallas_triton", policy="natural"))
        y_err = state_err = 0.0
        for t in range(steps):
            rows_seq = rng.permutation(np.r_[np.arange(seqs), -1])
            slots = np.where(rows_seq >= 0, seq_slots[np.maximum(rows_seq, 0)], -1).astype(np.int32)
            row_tokens = jax.tree.map(lambda a: a[np.maximum(rows_seq, 0), t], tokens)
            y, state = step(state, row_tokens, jnp.asarray(slots), jnp.asarray(rng.random(seqs + 1) < 0.2),
                            gate_params=params)
            live = rows_seq >= 0
            y_err = max(y_err, rel_err(np.asarray(y)[live], ref_y[rows_seq[live], t]))
            live_state = R.materialize_state(state, jnp.asarray(seq_slots, jnp.int32), params)
            state_err = max(state_err, rel_err(live_state, ref_states[:, t]))
        row = dict(gate="mamba2", cache_len=L, state_dtype=jnp.dtype(dtype).name, y_rel_err=y_err,
                   state_rel_err=state_err)
        print(f"mamba2 check {json.dumps(row)}", flush=True)
        rows.append(row)
    return rows


def mamba2_grid(smoke: bool, cache_lens: list[int], batches: list[int],
                dtypes: tuple = (jnp.float32, jnp.bfloat16)) -> list[tuple]:
    """(shape, state dtype, L, B) cells, the issue's headline cells first: L = 16 before the
    other lengths, fp32 before bf16 (of `dtypes`), then Nemotron-H before Mamba-2 2.7B."""
    shapes = [Shape(2, 4, 32, "mamba2", 16)] if smoke else [NEMOTRON_H_8B, MAMBA2_2_7B]
    lengths = sorted(cache_lens, key=lambda L: (L != 16, L))
    return [(shp, dt, L, b) for L in lengths for dt in dtypes for shp in shapes
            for b in batches]


def sweep_cells(result, grid, timer, args, best, deadline, policies) -> None:
    """Time every (shape, dtype, L, B) cell of `grid` under its flush policies into
    `result["rows"]`, until `deadline`; the JSON is rewritten after each cell."""
    for shp, dt, L, b in tqdm(grid, desc="sweep", file=sys.stderr, disable=None, leave=False):
        if time.time() > deadline:
            print(f"budget reached: {len(result['rows'])} rows done", flush=True)
            break
        cfg = shp.config(L, dt)
        default = R.default_flush_policy(cfg, b)
        cell = [default] + [policy for policy in (FlushPolicy.NATURAL, FlushPolicy.EVERY_STEP)
                            if policy.value in policies and policy is not default and L > 1]
        rows = []
        for policy in cell:
            try:
                rows += sweep_row(timer, shp, cfg, b, result["meta"]["copy_bandwidth_GBps"], args.smoke,
                                  choose_params(best, cfg, b, policy), policy)
            except Exception as err:  # keep the rest of the sweep; the error is in the log
                print(f"FAILED sweep row {shp} {jnp.dtype(dt).name} L={L} B={b} {policy}: {err!r}"[:2000],
                      flush=True)
        for row in rows:
            print(f"row {json.dumps(row)}", flush=True)
            result["rows"].append(row)
        with open(args.out, "w") as f:  # partial results survive a timeout
            json.dump(result, f, indent=1)


def print_table(rows: list[dict]) -> None:
    head = f"{'gate':4} {'Hv':>3} {'state':8} {'L':>3} {'B':>4} {'policy':10} {'cur':5} {'plain':>8} {'nonfl':>8} {'flush':>8} {'cycle':>8} {'floor':>8} {'roof':>5} {'x':>5}"
    print(head)
    for r in rows:
        f = lambda x: "-" if x is None else f"{x:8.1f}"
        print(f"{r['gate']:4} {r['num_v_heads']:>3} {r['state_dtype'][:8]:8} {r['cache_len']:>3} {r['batch']:>4} "
              f"{r['policy'][:10]:10} "
              f"{r['cursors'][:5]:5} {r['plain_us']:8.1f} {f(r['replay_nonflush_us'])} {f(r['replay_flush_us'])} "
              f"{r['replay_cycle_us']:8.1f} {r['replay_floor_us']:8.1f} {r['replay_roofline_fraction']:5.2f} "
              f"{r['speedup_vs_plain']:5.2f}")


def versions() -> dict:
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    dev = jax.devices()[0]
    return dict(gpu=getattr(dev, "device_kind", str(dev)), platform=platform.platform(),
                date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                jax=jax.__version__, jaxlib=jax.lib.__version__ if hasattr(jax.lib, "__version__") else jax.__version__,
                triton=triton_version, python=sys.version.split()[0])


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sections", default="check,tune,sweep")
    p.add_argument("--out", default="decode_bench.json")
    p.add_argument("--budget-s", type=float, default=540.0, help="stop starting new configs after this")
    p.add_argument("--batches", default="1,8,32,64,128,256,512")
    p.add_argument("--cache-lens", default="1,4,8,16,32")
    p.add_argument("--tune-batches", default="1,8,32,128,512")
    p.add_argument("--extra", default="hv64,kda", help="extra grids: hv64 (H_v=64, L=16), kda (L=16), mamba2 (the mamba2 section's grid)")
    p.add_argument("--policies", default="default",
                   help="flush policies per sweep cell: 'default' (default_flush_policy), and with "
                        "'natural' or 'every_step' in the list also that policy where the default differs")
    p.add_argument("--kda-batches", default="1,8,128,512", help="batches of the kda extra grid")
    p.add_argument("--steps-cases", default="512:16,512:32,128:16,8:16")
    p.add_argument("--mamba2-batches", default="1,8,32,128,512", help="batches of the mamba2 section")
    p.add_argument("--mamba2-cache-lens", default="8,16,32", help="cache lengths of the mamba2 section")
    p.add_argument("--mamba2-dtypes", default="float32,bfloat16", help="state dtypes of the mamba2 section")
    p.add_argument("--debug-batches", default="1,8,128,512", help="batches of the debug section")
    p.add_argument("--smoke", action="store_true", help="tiny shapes, interpret mode, wall clock (CPU)")
    return p.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    start = time.time()
    deadline = start + args.budget_s
    timer = Timer(args.smoke)
    sections = args.sections.split(",")
    ints = lambda s: [int(x) for x in s.split(",") if x]
    shape = Shape(2, 4, 32) if args.smoke else Shape()
    meta = versions()
    meta["copy_bandwidth_GBps"] = copy_bandwidth_GBps(timer) if not args.smoke else 1000.0
    meta["timing"] = ("wall clock, interpret mode (smoke)" if args.smoke else
                      "CUPTI per-kernel times, median over steps; slot sets rotated past 3x L2")
    print(f"meta {meta}", flush=True)
    result = dict(meta=meta, checks=[], tune=[], rows=[])
    best = {}
    if "check" in sections:
        result["checks"] = check_section(args.smoke)
    if "tune" in sections:
        result["tune"], best = tune_section(timer, shape, ints(args.tune_batches), args.smoke, deadline)
        result["chosen"] = {b: repr(params) for b, params in best.items()}
    if "steps" in sections:
        cases = [(2, 4)] if args.smoke else [tuple(map(int, c.split(":"))) for c in args.steps_cases.split(",")]
        result["steps"] = steps_section(timer, shape, cases, args.smoke, best,
                                        meta["copy_bandwidth_GBps"])
    if "sweep" in sections:
        grid = [(shape, dt, L, b) for dt in (jnp.float32, jnp.bfloat16)
                for L in ints(args.cache_lens) for b in ints(args.batches)]
        extras = args.extra.split(",") if args.extra else []
        if "hv64" in extras and not args.smoke:
            hv64 = Shape(16, 64, 128)
            grid += [(hv64, dt, 16, b) for dt in (jnp.float32, jnp.bfloat16) for b in ints(args.batches)]
        if "kda" in extras:
            kda = Shape(4, 4, 32, "kda") if args.smoke else Shape(32, 32, 128, "kda")
            kda_batches = ints(args.batches) if args.smoke else ints(args.kda_batches)
            grid += [(kda, jnp.float32, 16, b) for b in kda_batches]
        if "mamba2" in extras:
            grid += mamba2_grid(args.smoke, ints(args.mamba2_cache_lens), ints(args.mamba2_batches))
        sweep_cells(result, grid, timer, args, best, deadline, args.policies.split(","))
    if "debug" in sections:
        result["debug"] = debug_section(shape, [2] if args.smoke else ints(args.debug_batches), args.smoke,
                                         steps=3 if args.smoke else 100)
    if "mamba2" in sections:
        result["mamba2_checks"] = mamba2_check(args.smoke)
        # the replay cycle is timed under the natural policy beside the default everywhere
        dtypes = tuple(jnp.dtype(d) for d in args.mamba2_dtypes.split(","))
        sweep_cells(result, mamba2_grid(args.smoke, ints(args.mamba2_cache_lens), ints(args.mamba2_batches), dtypes),
                    timer, args, best, deadline, ["default", "natural"])
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    if result["rows"]:
        print_table(result["rows"])
    print(f"total {time.time() - start:.0f} s", flush=True)
    return result


if __name__ == "__main__":
    main()
