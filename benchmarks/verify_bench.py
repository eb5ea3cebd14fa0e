"""GPU benchmark of speculative verify: ReplaySSM `verify_step` (pallas_triton and mosaic_gpu)
against the project's conventional verify (one process, table + JSON).

Per (state dtype, L, T, B), GDN H_k = 16, H_v = 32, d = 128 (`--gate kda`: KDA, the same
shapes with a per-channel decay; `--gate mamba2`: Mamba-2 at Nemotron-H-8B shapes, H = 128,
P = 64, N = 128, G = 8, on mosaic_gpu only: pallas_triton has no Mamba-2 verify):

  conventional  the plain recurrence over the window writing T intermediate states per row
                (what rollback needs without a cache): the plain decode kernel launched T
                times per verify step, launch t writing its rows' states into its own state
                buffer t. Timing stand-in: launch t reads its input state from buffer t, not
                from buffer t - 1 (the same bytes and work as the chained recurrence; the
                values are not used), so no buffer is copied between launches.
  nonflush      `verify_step(backend=...)` per backend with every row at write_pos = L - T
                (the longest history that still fits the window: the costliest non-flush
                step), all of its kernels (pallas_triton: the readout kernel and XLA's solve
                and appends; mosaic_gpu: the one verify kernel and XLA's scatter of folding
                rows' key and gate records, Mamba-2: B and dt).
  flush         the same with write_pos = L (every row folds its whole ring first).
  staggered     (--staggered) the same with each slot at a random write_pos in 0..L, so a
                step mixes folding rows (write_pos + T > L, about T / (L + 1) of them) with
                appending ones, as a serving engine's steps do; `staggered_vs_mix` is its
                time over that mix of the flush and (costliest) non-flush steps' times: above
                1 where the folding rows' work is spread unevenly over the kernel's programs.
  amortised     per verify step at acceptance 50 / 75 / 100 % of T (the bonus token
                included, n = max(1, round(a T)) records accepted per step): the flush
                frequency follows from the capacity rule (a row folds when write_pos + T > L)
                over the steady-state cursor cycle, each non-flush step costed as the
                costliest (pessimistic).

Bytes: conventional T (read + write) states per row; non-flush one checkpoint read,
`L - T` cache entries read and T records written per row; flush that plus one checkpoint
write and L entries read. The byte floor is bytes / copy bandwidth (measured at the start).

Timing: CUPTI kernel times of a jitted `lax.scan` over R disjoint slot sets (R * B * slot
bytes >= 3x the L2), as `decode_bench.py`; a verify step's time is the sum of its kernels.
`--resident-slots K` (a diagnostic, as `mosaic_bench.py`'s) puts every row on one of K slots,
a pool the L2 holds: the kernels' time without HBM traffic (on an H100, about what these
work-bound kernels take on an H200); its floor fractions are then not of the HBM's floor.

Check (before timing): each backend against xla on a state whose rows mix appending,
folding, empty and padding rows, per `--checks` pair of state dtype and L (default
float32:16; e.g. float32:16,float32:32,bfloat16:16 also checks the tensor-core folds'
chunked operands).

  python benchmarks/verify_bench.py --out verify.json     # on the GPU
  python benchmarks/verify_bench.py --gate kda --out verify_kda.json
  python benchmarks/verify_bench.py --gate mamba2 --dtypes float32,bfloat16 --out verify_mamba2.json
  python benchmarks/verify_bench.py --smoke --out x.json  # CPU, interpret mode
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import statistics
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np

warnings.filterwarnings("ignore", message="The Pallas Triton backend is deprecated")

import replayssm_jax as R  # noqa: E402
from decode_bench import (  # noqa: E402
    NEMOTRON_H_8B,
    PLAIN_KERNEL,
    Shape,
    add_resident_slots_option,
    copy_bandwidth_GBps,
    kernel_runs,
    mamba2_params,
    option_timer,
    plain_params,
    random_pool,
    slot_sets,
    variant_fields,
    versions,
)
from pallas_kernels.mamba2_decode import Mamba2PlainParams, mamba2_plain_decode  # noqa: E402
from pallas_kernels.mosaic_gpu import verify_decode  # noqa: E402
from pallas_kernels.mosaic_gpu.mamba2_decode import MosaicMamba2Params  # noqa: E402
from pallas_kernels.mosaic_gpu.replay_decode import MosaicReplayParams  # noqa: E402
from pallas_kernels.plain_decode import plain_decode  # noqa: E402
from replayssm_jax.backends import mosaic_gpu  # noqa: E402

ACCEPTANCE = (0.5, 0.75, 1.0)
BACKENDS = ("pallas_triton", "mosaic_gpu")
MAMBA2_BACKENDS = ("mosaic_gpu",)
MAIN_KERNEL = {"pallas_triton": "replayssm_verify_readout", "mosaic_gpu": "replayssm_verify_decode_mgpu"}
MAMBA2_MAIN_KERNEL = "replayssm_mamba2_verify_decode_mgpu"


def verify_options(heads: int | None) -> dict:
    """`verify_step` options: the fixed Mamba-2 layer parameters of `heads` heads, or (None)
    the q/k L2 norm of GDN and KDA."""
    return dict(use_qk_l2norm=True) if heads is None else dict(gate_params=mamba2_params(heads))


def mamba2_heads(cfg: R.ReplayConfig) -> int | None:
    """H for a Mamba-2 layer, None for the delta-rule gates (the key of `verify_options`)."""
    return cfg.num_v_heads if cfg.gate_kind.additive else None


def random_window(cfg: R.ReplayConfig, batch: int, width: int, key) -> R.Tokens | R.Mamba2Tokens:
    ks = jax.random.split(key, 5)
    hk, hv, dk, dv = cfg.num_k_heads, cfg.num_v_heads, cfg.head_k_dim, cfg.head_v_dim
    bf = jnp.bfloat16
    if cfg.gate_kind.additive:  # x, B, C, raw dt, z
        return R.Mamba2Tokens(
            jax.random.normal(ks[0], (batch, width, hv, dv), bf), jax.random.normal(ks[1], (batch, width, hk, dk), bf),
            jax.random.normal(ks[2], (batch, width, hk, dk), bf),
            jax.random.normal(ks[3], (batch, width, hv), jnp.float32),
            jax.random.normal(ks[4], (batch, width, hv, dv), bf),
        )
    return R.Tokens(
        jax.random.normal(ks[0], (batch, width, hk, dk), bf),
        jax.random.normal(ks[1], (batch, width, hk, dk), bf),
        jax.random.normal(ks[2], (batch, width, hv, dv), bf),
        -0.1 * jax.nn.softplus(jax.random.normal(ks[3], (batch, width, *cfg.g_shape(batch)[1:]), jnp.float32)),
        jax.nn.sigmoid(jax.random.normal(ks[4], (batch, width, hv), jnp.float32)),
    )


def backend_params(backend: str, cfg: R.ReplayConfig, batch: int, width: int):
    """`(backend name, kernel_params)` of a `--backends` entry: a backend name (the backend's
    defaults), or `mosaic_gpu:` and `+`-separated fields of the verify kernel's parameters
    (`MosaicReplayParams`; Mamba-2: `MosaicMamba2Params`), the others at the class's
    defaults or, after `default+`, at the backend's `verify_default_params` for the row
    (`mosaic_gpu:default+window_side=kernel`). GDN: `programs=N` or `programs=fit` (as many
    persistent CTAs as fit on the device with the spec's other fields, after `default+` too),
    `auto_barriers=false`, `swizzle=64`, `readout=mma`, `rebuild=3xtf32`, `key_side=xla`,
    `window_side=kernel`, ...; KDA's kernel takes `window_side` and `window_warps` only,
    Mamba-2's `window_side`."""
    name, _, spec = backend.partition(":")
    if not spec:
        return name, None
    if name != "mosaic_gpu":
        raise ValueError(f"kernel options are for the mosaic_gpu verify kernels, got {backend!r}")
    on_defaults, fields = variant_fields(spec.split("+"))
    cls = MosaicMamba2Params if cfg.gate == "mamba2" else MosaicReplayParams
    base = mosaic_gpu.verify_default_params(cfg, batch, width, jnp.bfloat16) if on_defaults else cls()
    if cls is MosaicReplayParams and fields.get("programs") == "fit":
        field = lambda key: fields.get(key, getattr(base, key))
        fields["programs"] = verify_decode.persistent_programs(
            batch, width, cfg.num_v_heads, cfg.head_v_dim, cfg.head_k_dim, cfg.cache_len, cfg.state_dtype,
            cfg.cache_dtype, jnp.bfloat16, mosaic_gpu.device_sm_count(), readout=field("readout"),
            rebuild=field("rebuild"), key_side=field("key_side"), warpgroups=field("warpgroups"),
            prefetch_folds=field("prefetch_folds"), group_folds=field("group_folds"))
    return name, dataclasses.replace(base, **fields)


@functools.lru_cache(maxsize=None)
def verify_fn(backend: str, interpret: bool, reps: int, heads: int | None = None, kernel_params=None):
    """jit: `reps` rounds of one verify step over each slot set in turn. No accept, and
    every step starts from the given cursors (a folding step's reset cursor is dropped), so
    every step is the same kind. Every step verifies the same window, as the conventional
    baseline's steps do; its lengths (`lengths [S, B]`, all T) are an input of each step, as
    a drafter's are, which XLA cannot prove constant, so the window's own work (norms,
    decays, the T x T products) stays in the loop instead of being hoisted out of it.
    `heads`: as `verify_options`; `kernel_params`: as `verify_step`'s."""

    def run(state, sets, lengths, window):
        def one(arrays, step):
            slots, step_lengths = step
            st = dataclasses.replace(state, checkpoint=arrays[0], u_cache=arrays[1], k_cache=arrays[2],
                                     g_cache=arrays[3])
            y, st = R.verify_step(st, window, slots, lengths=step_lengths, backend=backend, interpret=interpret,
                                  kernel_params=kernel_params, **verify_options(heads))
            return (st.checkpoint, st.u_cache, st.k_cache, st.g_cache), y[0, 0, 0, 0]

        arrays = (state.checkpoint, state.u_cache, state.k_cache, state.g_cache)
        arrays, _ = jax.lax.scan(one, arrays, (jnp.tile(sets, (reps, 1)), jnp.tile(lengths, (reps, 1))))
        return arrays

    return jax.jit(run)


@functools.lru_cache(maxsize=None)
def conventional_fn(params, width: int, interpret: bool):
    """jit: per slot set, T plain-kernel launches, launch t on state buffer t."""

    def launch(buf, token, slots):
        if isinstance(params, Mamba2PlainParams):
            layer = mamba2_params(buf.shape[1])
            return mamba2_plain_decode(buf, token.x, token.B, token.C, token.dt, layer.A, layer.D, layer.dt_bias,
                                       slots, slots >= 0, z=token.z, params=params, interpret=interpret)
        return plain_decode(buf, token.q, token.k, token.v, token.g, token.beta, slots, slots >= 0,
                            use_qk_l2norm=True, params=params, interpret=interpret)

    def run(buffers, sets, window):
        def one(bufs, slots):
            out = []
            for t, buf in enumerate(bufs):
                y, buf = launch(buf, jax.tree.map(lambda x: x[:, t], window), slots)
                out.append(buf)
            return tuple(out), y[0, 0, 0]

        buffers, _ = jax.lax.scan(one, buffers, sets)
        return buffers

    return jax.jit(run)


def per_step_us(runs, steps: int) -> tuple[float, dict]:
    """Median over runs of the µs per step of the kernels launched once per step (a count
    per run that `steps` divides: the jit's one-off copies into the loop carry are left
    out); and per such kernel, its launches per run and its median µs per step (where a
    step's time goes)."""
    counts = {}
    for name, _ in runs[0]:
        counts[name] = counts.get(name, 0) + 1
    per_step = {name: n for name, n in counts.items() if n % steps == 0}
    totals = [sum(us for name, us in run if name in per_step) / steps for run in runs]
    kernel_us = {name: statistics.median(sum(us for n, us in run if n == name) / steps for run in runs)
                 for name in per_step}
    return statistics.median(totals), {name: dict(launches=per_step[name], us_per_step=kernel_us[name])
                                       for name in sorted(per_step, key=kernel_us.get, reverse=True)}


def flush_fraction(cache_len: int, width: int, accepted: int) -> float:
    """Fraction of verify steps that fold, over the steady-state cursor cycle: a step at
    cursor p folds when p + T > L (then the window lands at 0), and accept moves the cursor
    by `accepted`."""
    pos, seen, order = 0, {}, []
    while pos not in seen:
        seen[pos] = len(order)
        fold = pos + width > cache_len
        order.append(fold)
        pos = (0 if fold else pos) + accepted
    cycle = order[seen[pos]:]
    return sum(cycle) / len(cycle)


def token_bytes(cfg: R.ReplayConfig) -> int:
    """One window position's inputs and output y: bf16 q, k, v and fp32 g, beta (Mamba-2, in
    the GDN layout's names: bf16 x, B, C, z, fp32 dt)."""
    hv, hk, dk, dv = cfg.num_v_heads, cfg.num_k_heads, cfg.head_k_dim, cfg.head_v_dim
    gates = hv * 4 + hv * dv * 2 if cfg.gate_kind.additive else 2 * hv * 4
    return (2 * hk * dk + hv * dv) * 2 + gates + hv * dv * 2


def verify_bytes(cfg: R.ReplayConfig, batch: int, width: int, flush: bool) -> int:
    hv, hk, dk, dv, L = cfg.num_v_heads, cfg.num_k_heads, cfg.head_k_dim, cfg.head_v_dim, cfg.cache_len
    s, c = cfg.state_dtype.itemsize, cfg.cache_dtype.itemsize
    state = hv * dv * dk * s
    entry = (hv * dv + hk * dk) * c + hv * 4 * (dk if cfg.per_channel_gate else 1)
    history = L if flush else L - width
    return batch * ((2 if flush else 1) * state + (history + width) * entry + width * token_bytes(cfg))


def conventional_bytes(cfg: R.ReplayConfig, batch: int, width: int) -> int:
    hv, dk, dv = cfg.num_v_heads, cfg.head_k_dim, cfg.head_v_dim
    return batch * width * (2 * hv * dv * dk * cfg.state_dtype.itemsize + token_bytes(cfg))


def bench_row(timer, shape, dtype, cache_len, width, batch, bandwidth, iterations, smoke, backends,
              staggered: bool = False) -> dict:
    cfg = shape.config(cache_len, dtype)
    rng = np.random.default_rng(batch * 100 + cache_len * 10 + width)
    sets, num_slots = slot_sets(batch, cfg.state_bytes_per_slot(), rng, smoke, timer.resident_slots)
    window = random_window(cfg, batch, width, jax.random.key(2))
    reps = 1 if smoke else max(1, -(-8 // len(sets)))  # >= 8 steps per run: one-off copies stand out
    row = dict(gate=shape.gate, state_dtype=jnp.dtype(dtype).name, L=cache_len, T=width, B=batch,
               H_k=shape.num_k_heads, H_v=shape.num_v_heads, d=shape.head_dim, d_v=shape.value_dim or shape.head_dim,
               slot_sets=len(sets))

    plain_cfg = shape.config(1, dtype)
    params = plain_params(plain_cfg, batch)
    pool = random_pool(plain_cfg, num_slots, jax.random.key(1), np.zeros(num_slots)).checkpoint
    buffers = tuple(pool + 0 for _ in range(width))
    times = timer.kernel_times(conventional_fn(params, width, smoke), (buffers, jnp.asarray(sets), window),
                               PLAIN_KERNEL, iterations)
    # One run serves len(sets) verify steps of T launches each.
    row["conventional_us"] = times[0] if smoke else sum(times) / (iterations * len(sets))

    for kind in ("nonflush", "flush"):
        nbytes = verify_bytes(cfg, batch, width, kind == "flush")
        row[f"{kind}_bytes"] = nbytes
        row[f"{kind}_floor_us"] = nbytes / (bandwidth * 1e9) * 1e6
    row["conventional_bytes"] = conventional_bytes(cfg, batch, width)
    row["conventional_floor_fraction"] = row["conventional_bytes"] / (bandwidth * 1e9) * 1e6 / row["conventional_us"]
    row["backends"] = {}
    for b in backends:
        try:  # a variant this row refuses leaves the other backends timed
            row["backends"][b] = backend_times(timer, b, cfg, num_slots, sets, window, reps, row, iterations, smoke,
                                               staggered)
        except ValueError as err:
            print(f"row refuses {b!r} at {row['state_dtype']} L={cache_len} T={width} B={batch}: {err}", flush=True)
            row["backends"][b] = dict(refused=str(err))
    return row


def backend_times(timer, backend, cfg, num_slots, sets, window, reps, row, iterations, smoke,
                  staggered: bool = False) -> dict:
    """One backend's non-flush and flush step times, floor fractions and the amortised cost
    per verify step at each acceptance rate (`row` holds the bytes and the conventional
    time); with `staggered`, also a step of slots at random cursors against its mix."""
    cache_len, width = row["L"], row["T"]
    steps = reps * len(sets)
    name, kernel_params = backend_params(backend, cfg, row["B"], width)
    out = {} if kernel_params is None else dict(kernel_params=dataclasses.asdict(kernel_params))
    kinds = [("nonflush", np.full(num_slots, cache_len - width)), ("flush", np.full(num_slots, cache_len))]
    if staggered:
        kinds.append(("staggered", np.random.default_rng(7).integers(0, cache_len + 1, num_slots)))
    for kind, cursors in kinds:
        state = random_pool(cfg, num_slots, jax.random.key(1), cursors)
        fn = verify_fn(name, smoke, reps, mamba2_heads(cfg), kernel_params)  # the flush step reuses its compile
        verify_args = (state, jnp.asarray(sets), jnp.full(np.shape(sets), width, jnp.int32), window)
        if smoke:
            out[f"{kind}_us"] = timer.kernel_times(fn, verify_args, "", 1)[0] / steps
            out[f"{kind}_main_kernel_us"] = None
        else:
            runs = kernel_runs(fn, verify_args, iterations)
            out[f"{kind}_us"], out[f"{kind}_kernels"] = per_step_us(runs, steps)
            # Every kernel of a run, one-off copies included, over its steps: an upper bound
            # that shows what the per-step filter left out.
            out[f"{kind}_all_kernels_us"] = statistics.median(sum(us for _, us in run) / steps for run in runs)
            main = MAMBA2_MAIN_KERNEL if cfg.gate_kind.additive else MAIN_KERNEL[name]
            out[f"{kind}_main_kernel_us"] = statistics.median(us for run in runs for name, us in run if main in name)
        if kind != "staggered":
            out[f"{kind}_floor_fraction"] = row[f"{kind}_floor_us"] / out[f"{kind}_us"]
    if staggered:
        folding = float(np.mean(kinds[-1][1][np.asarray(sets)] + width > cache_len))
        out["staggered_fold_fraction"] = folding
        out["staggered_vs_mix"] = out["staggered_us"] / (folding * out["flush_us"] + (1 - folding) * out["nonflush_us"])
    for a in ACCEPTANCE:
        accepted = max(1, round(a * width))
        f = flush_fraction(cache_len, width, accepted)
        amortised = f * out["flush_us"] + (1 - f) * out["nonflush_us"]
        key = f"acc{round(a * 100)}"
        out[f"{key}_flush_fraction"] = f
        out[f"{key}_amortised_us"] = amortised
        out[f"{key}_speedup_vs_conventional"] = row["conventional_us"] / amortised
    return out


def check(shape, backends, smoke, state_dtype: str = "float32", cache_len: int = 16) -> dict:
    """Each backend's verify against xla on one state whose rows mix appending, folding
    (history + window past the ring), empty and padding rows, with ragged lengths and a tree
    window: the largest relative error of y and of every state array (smoke: L = 8), or
    `refused` with the reason where a backend's parameters refuse these rows (a ValueError:
    printed, and the other backends still checked)."""
    cfg = shape.config(cache_len if not smoke else 8, jnp.dtype(state_dtype))
    batch, width, num_slots = 8, 4, 10
    rng = np.random.default_rng(0)
    cursors = rng.integers(0, cfg.cache_len + 1, num_slots)
    slots = np.where(np.arange(batch) == 3, -1, rng.permutation(num_slots)[:batch])
    lengths = rng.integers(0, width + 1, batch)
    # Whatever the draws at this L: rows 0 and 1 fold (a full ring, and one entry short of
    # it), row 2 fills the ring exactly without folding.
    lengths[:3] = width
    cursors[slots[:3]] = cfg.cache_len, cfg.cache_len - 1, cfg.cache_len - width
    state = random_pool(cfg, num_slots, jax.random.key(1), cursors)
    slots = jnp.asarray(slots, jnp.int32)
    window = random_window(cfg, batch, width, jax.random.key(4))
    extra = dict(lengths=jnp.asarray(lengths, jnp.int32),
                 parents=jnp.asarray(np.stack([rng.integers(-1, np.arange(width)) for _ in range(batch)]), jnp.int32))
    run = jax.jit(R.verify_step, static_argnames=("backend", "use_qk_l2norm", "interpret", "kernel_params"))
    extra |= verify_options(mamba2_heads(cfg))
    want = run(state, window, slots, backend="xla", **extra)
    rel = lambda a, b: float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32)))
                             / (jnp.max(jnp.abs(b.astype(jnp.float32))) + 1e-30))
    out = {}
    for b in backends:
        try:  # a variant the check's rows refuse (its batch's defaults, say) leaves the others checked
            name, kernel_params = backend_params(b, cfg, batch, width)
            y, st = run(state, window, slots, backend=name, interpret=smoke, kernel_params=kernel_params, **extra)
        except ValueError as err:
            print(f"check refuses {b!r} at {cfg.state_dtype.name} L={cfg.cache_len} B={batch}: {err}", flush=True)
            out[b] = dict(refused=str(err))
            continue
        out[b] = dict(y=rel(y, want[0]), **{name: rel(getattr(st, name), getattr(want[1], name))
                                           for name in ("checkpoint", "u_cache", "k_cache", "g_cache")},
                      write_pos_equal=bool(jnp.all(st.write_pos == want[1].write_pos)))
    return dict(folding_rows=int(np.sum((np.asarray(slots) >= 0)
                                        & (cursors[np.maximum(np.asarray(slots), 0)] + lengths > cfg.cache_len))),
                backends=out)


def print_table(rows: list[dict]) -> None:
    print(f"{'backend':>13} {'dtype':>8} {'L':>3} {'T':>2} {'B':>4} {'conv':>8} {'nonfl':>8} {'flush':>8} "
          f"{'nf floor':>8} {'amort75':>8} {'x conv':>6}")
    for r in rows:
        for name, b in r["backends"].items():
            if "refused" in b:
                print(f"{name:>13} {r['state_dtype']:>8} {r['L']:>3} {r['T']:>2} {r['B']:>4} refused")
                continue
            print(f"{name:>13} {r['state_dtype']:>8} {r['L']:>3} {r['T']:>2} {r['B']:>4} {r['conventional_us']:8.1f} "
                  f"{b['nonflush_us']:8.1f} {b['flush_us']:8.1f} {b['nonflush_floor_fraction']:8.2f} "
                  f"{b['acc75_amortised_us']:8.1f} {b['acc75_speedup_vs_conventional']:6.2f}")


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="verify_bench.json")
    p.add_argument("--budget-s", type=float, default=180.0, help="stop starting new configs after this")
    p.add_argument("--batches", default="8,128,512")
    p.add_argument("--cache-lens", default="16,32")
    p.add_argument("--widths", default="4,8,2")
    p.add_argument("--dtypes", default="float32", help="state dtypes, e.g. float32,bfloat16")
    p.add_argument("--backends", default=None,
                   help=f"verify backends, e.g. mosaic_gpu (default {','.join(BACKENDS)}; mamba2: mosaic_gpu); "
                        "GDN: 'mosaic_gpu:programs=fit+auto_barriers=false' for kernel options (backend_params)")
    p.add_argument("--gate", default="gdn", choices=("gdn", "kda", "mamba2"))
    p.add_argument("--iterations", type=int, default=3)
    p.add_argument("--checks", default="float32:16",
                   help="state dtype:L pairs checked against xla before timing, e.g. float32:16,bfloat16:32")
    p.add_argument("--staggered", action="store_true",
                   help="also time a step of slots at random cursors (folding and appending rows mixed)")
    add_resident_slots_option(p)
    p.add_argument("--smoke", action="store_true", help="tiny shapes, interpret mode, wall clock (CPU)")
    args = p.parse_args(argv)
    timer = option_timer(args)
    start = time.time()
    ints = lambda s: [int(x) for x in s.split(",") if x]
    # d = 64 (Mamba-2: P = N = 64): the Mosaic kernels' smallest tile
    if args.gate == "mamba2":
        shape = Shape(1, 2, 64, "mamba2", 64) if args.smoke else NEMOTRON_H_8B
    else:
        shape = Shape(1, 2, 64, args.gate) if args.smoke else Shape(gate=args.gate)
    meta = versions()
    meta["copy_bandwidth_GBps"] = 1000.0 if args.smoke else copy_bandwidth_GBps(timer)
    meta["timing"] = ("wall clock, interpret mode (smoke)" if args.smoke else
                      "CUPTI kernel times summed per verify step; " + (
                          f"every row on one of {args.resident_slots} slots (L2-resident)" if args.resident_slots
                          else "slot sets rotated past 3x L2"))
    meta["conventional"] = "plain decode kernel launched T times, launch t on its own state buffer"
    print(f"meta {meta}", flush=True)
    backends = (args.backends.split(",") if args.backends else
                list(MAMBA2_BACKENDS if args.gate == "mamba2" else BACKENDS))
    first, *more = [(dt, int(L)) for dt, L in (pair.split(":") for pair in args.checks.split(","))]
    result = dict(meta=meta, check=check(shape, backends, args.smoke, *first), rows=[])
    print(f"check {first} {json.dumps(result['check'])}", flush=True)
    if more and not args.smoke:
        result["more_checks"] = {f"{dt}:{L}": check(shape, backends, args.smoke, dt, L) for dt, L in more}
        print(f"more checks {json.dumps(result['more_checks'])}", flush=True)
    # T = 4 first (the reference figures' window), so a budget stop loses the least.
    grid = [(jnp.dtype(dt), L, t, b) for dt in args.dtypes.split(",") for t in ints(args.widths)
            for L in ints(args.cache_lens) for b in ints(args.batches) if t <= L]
    for dt, L, t, b in grid:
        if time.time() > start + args.budget_s:
            print(f"budget reached: {len(result['rows'])} rows done", flush=True)
            break
        try:
            row = bench_row(timer, shape, dt, L, t, b, meta["copy_bandwidth_GBps"], args.iterations, args.smoke,
                            backends, args.staggered)
        except Exception as err:  # keep the rest of the grid; the error is in the log
            print(f"FAILED {dt.name} L={L} T={t} B={b}: {err!r}"[:2000], flush=True)
            continue
        print(f"row {json.dumps(row)}", flush=True)
        result["rows"].append(row)
        with open(args.out, "w") as f:  # partial results survive a timeout
            json.dump(result, f, indent=1)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    if result["rows"]:
        print_table(result["rows"])
    print(f"total {time.time() - start:.0f} s", flush=True)
    return result


if __name__ == "__main__":
    main()
