# ---
# jupyter:
#   jupytext:
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 02 · Cache length L: state traffic vs rebuild work
#
# Plain decode reads and writes the whole recurrent state every step. ReplaySSM reads the
# checkpoint every step, writes it once every `L` steps, and in between reads the valid cache
# entries and appends one (method note §10). This notebook:
#
# 1. plots the **byte model** (`replayssm_jax.cost`) against `L` for several batch sizes and
#    state / cache dtypes: pure arithmetic, no device involved;
# 2. overlays **measured** step times from the newest committed H200 benchmark summary
#    (`benchmarks/results/*.json`, never the per-run files under `raw/`) on the same axes:
#    model floor vs measurement;
# 3. shows the **flush-step spike** with synchronised cursors and how staggered cursors
#    flatten it;
# 4. shows **where ReplaySSM stops paying**: small batches, where the plan's default flush
#    policy folds every step instead.
#
# Every measured number below comes from the benchmark file named in the output; when no
# file exists the measured parts are skipped, never filled in.

# %%
import os

from nbutil import env_ints

# Layer shapes of the byte model (defaults: the GDN layer of replayssm.md §10).
NUM_K_HEADS = int(os.environ.get("RS_NUM_K_HEADS", 16))
NUM_V_HEADS = int(os.environ.get("RS_NUM_V_HEADS", 32))
HEAD_DIM = int(os.environ.get("RS_HEAD_DIM", 128))
CACHE_LENS = env_ints("RS_CACHE_LENS", (1, 2, 4, 8, 16, 32, 64))
BATCHES = env_ints("RS_BATCHES", (1, 8, 32, 128, 512))  # batches of the byte model and of the L plots
SPIKE_BATCH = int(os.environ.get("RS_SPIKE_BATCH", 32))  # batch of the flush-spike plot
SPIKE_CACHE_LEN = int(os.environ.get("RS_SPIKE_CACHE_LEN", 16))
# Benchmark summary: $RS_BENCH_JSON, else the newest benchmarks/results/*.json (not raw/).
BENCH_JSON = os.environ.get("RS_BENCH_JSON", "")
# Bandwidth for model floors in µs when no benchmark file gives one (an assumption, labelled
# as such: the copy bandwidth quoted for one H200 in replayssm.md §10).
ASSUMED_BANDWIDTH_GBPS = float(os.environ.get("RS_ASSUMED_BANDWIDTH_GBPS", 4270.0))

# %%
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np

from nbutil import repo_root, save_figure
from matplotlib.lines import Line2D

from replayssm_jax import FlushPolicy, ReplayConfig, cost, default_flush_policy

MIB = 2**20

# %% [markdown]
# ## 1. The byte model against L
#
# Per row and step, averaged over a cycle of `L` steps (`cost.replay_cycle_bytes`):
#
# `S (1 + 1/L)` checkpoint bytes `+ E (L - 1)/2` cache reads `+ E (L - 1)/L` appends,
#
# with `S` the state of one slot and `E` one cache entry `(u, k, g)`. Plain decode moves
# `2 S`. `L = 1` is exactly plain decode. Every term is proportional to the batch, so the
# ratio to plain decode does not depend on the batch; the absolute bytes do.

# %%
def layer(cache_len, state_dtype="float32", cache_dtype="bfloat16", gate="gdn",
          hk=NUM_K_HEADS, hv=NUM_V_HEADS, dk=HEAD_DIM, dv=HEAD_DIM):
    return ReplayConfig(hk, hv, dk, dv, cache_len, gate, state_dtype, cache_dtype)


def ratio_to_plain(cfg):
    """Cycle-averaged ReplaySSM bytes / plain bytes (batch-independent)."""
    return cost.replay_cycle_bytes(cfg, 1).total / cost.plain_step_bytes(cfg, 1).total


DTYPE_COMBOS = [  # (state dtype, cache dtype)
    ("float32", "float32"),
    ("float32", "bfloat16"),
    ("bfloat16", "bfloat16"),
]
shape_text = f"H_k={NUM_K_HEADS}, H_v={NUM_V_HEADS}, d_k=d_v={HEAD_DIM}"
print("layer:", shape_text)
short = {"float32": "fp32", "bfloat16": "bf16"}
print("ReplaySSM bytes / plain bytes, columns: state dtype / cache dtype")
print(f"{'L':>4} " + " ".join(f"{short[s] + '/' + short[c]:>10}" for s, c in DTYPE_COMBOS)
      + "   state only: (1+1/L)/2")
for L in CACHE_LENS:
    ratios = " ".join(f"{ratio_to_plain(layer(L, s, c)):10.3f}" for s, c in DTYPE_COMBOS)
    print(f"{L:4d} {ratios}   {(1 + 1 / L) / 2:10.3f}")

# %%
Ls = np.array(CACHE_LENS)
fig, axes = plt.subplots(1, 3, figsize=(16, 4.6))

# (a) components per row, fp32 state, bf16 caches
ax = axes[0]
parts = [cost.replay_cycle_bytes(layer(L), 1) for L in CACHE_LENS]
stack = {
    "checkpoint read": [p.checkpoint_read for p in parts],
    "checkpoint write (1/L)": [p.checkpoint_write for p in parts],
    "cache reads (valid entries)": [p.cache_read for p in parts],
    "cache appends": [p.cache_append for p in parts],
}
ax.stackplot(Ls, *[np.array(v) / MIB for v in stack.values()], labels=list(stack), alpha=0.8)
plain_row_mib = cost.plain_step_bytes(layer(1), 1).total / MIB
ax.axhline(plain_row_mib, color="k", ls="--", label="plain decode")
ax.set(xscale="log", xlabel="cache length L (steps)", ylabel="MiB per row per step (cycle average)",
       title="(a) ReplaySSM bytes by component\nfp32 state, bf16 caches", ylim=(0, 1.7 * plain_row_mib))
ax.set_xticks(Ls, [str(L) for L in Ls])
ax.legend(fontsize=8, loc="upper right")

# (b) ratio to plain, per dtype combination and gate
ax = axes[1]
for (s, c), color in zip(DTYPE_COMBOS, ["C0", "C1", "C2"]):
    ax.plot(Ls, [ratio_to_plain(layer(L, s, c)) for L in Ls], "o-", color=color,
            label=f"GDN, {s} state, {c} caches")
    ax.plot(Ls, [ratio_to_plain(layer(L, s, c, gate="kda")) for L in Ls], "x:", color=color,
            label=f"KDA, {s} state, {c} caches")
ax.plot(Ls, (1 + 1 / Ls) / 2, "k--", label="state bytes only: (1+1/L)/2")
ax.axhline(1.0, color="grey", lw=0.8)
ax.set(xscale="log", xlabel="cache length L (steps)", ylabel="ReplaySSM bytes / plain bytes",
       title="(b) byte ratio to plain decode (any batch)", ylim=(0, 1.4))
ax.set_xticks(Ls, [str(L) for L in Ls])
ax.legend(fontsize=7)

# (c) absolute bytes per step for several batch sizes
ax = axes[2]
for i, B in enumerate(BATCHES):
    for s, ls in (("float32", "-"), ("bfloat16", "--")):
        ax.plot(Ls, [cost.replay_cycle_bytes(layer(L, s), B).total / MIB for L in Ls], ls,
                marker="o", ms=3, color=f"C{i}", label=f"B={B}" if s == "float32" else None)
ax.set(xscale="log", yscale="log", xlabel="cache length L (steps)", ylabel="MiB per step (all rows)",
       title="(c) bytes per step vs L and batch\nsolid fp32 state, dashed bf16 state; bf16 caches")
ax.set_xticks(Ls, [str(L) for L in Ls])
ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
fig.suptitle(f"Byte model (replayssm_jax.cost), GDN/KDA layer {shape_text}: arithmetic, no device",
             y=1.02)
save_figure(fig, "02_byte_model_vs_L")
plt.show()

# %% [markdown]
# The state term falls like `(1 + 1/L)/2` and is worth most of the saving by `L = 8`; the
# cache reads grow like `(L - 1)/2` entries and, for a KDA layer (a g entry per key channel,
# in float32) or float32 caches, start to eat the saving at large `L`. Bytes are not the whole
# cost: the rebuild of the live state from `pos` entries is a `[d_v, pos] x [pos, d_k]`
# product per head on chip (`cost.rebuild_flops`), so arithmetic per byte grows with `L`:

# %%
for L in (4, 16, 32, 64):
    cfg = layer(L)
    flops = np.mean([cost.rebuild_flops(cfg, p) for p in range(L)])
    print(f"L={L:3d}: rebuild {flops / cost.replay_cycle_bytes(cfg, 1).total:5.1f} FLOP per byte moved "
          "(cycle average, fp32 state, bf16 caches)")

# %% [markdown]
# ## 2. The benchmark file
#
# Measured step times come only from a committed benchmark **summary**
# (`benchmarks/results/*.json`, written from the benchmark runs on an H200); the per-run
# files under `benchmarks/results/raw/` are never read here. We load the newest summary (by
# its `meta.date`, then file name), or the file named by `$RS_BENCH_JSON`.

# %%
def find_benchmark(explicit: str) -> Path | None:
    """The benchmark summary to use: `explicit` if given, else the newest committed one."""
    if explicit:
        return Path(explicit)
    files = sorted((repo_root() / "benchmarks" / "results").glob("*.json"))  # not raw/
    if not files:
        return None
    dated = [(json.loads(f.read_text()).get("meta", {}).get("date", ""), f.name, f) for f in files]
    return max(dated)[2]


bench_path = find_benchmark(BENCH_JSON)
if bench_path is None:
    bench, rows, source = None, [], None
    print("NO BENCHMARK FILE: benchmarks/results/*.json does not exist yet (and RS_BENCH_JSON "
          "is not set).\nThe measured overlays below are skipped; only the byte model is shown.")
else:
    bench = json.loads(bench_path.read_text())
    # Rows marked "superseded" ran a launch-table entry the package no longer uses.
    rows = [r for r in bench["rows"] if not r.get("superseded")]
    meta = bench["meta"]
    source = bench_path.name
    print(f"benchmark file: {bench_path}")
    for key in ("gpu", "date", "jax", "jaxlib", "triton", "copy_bandwidth_GBps", "timing"):
        print(f"  {key:20s} {meta.get(key)}")
    print(f"  {len(rows)} rows ({len(bench['rows']) - len(rows)} superseded rows left out)")

bandwidth = bench["meta"]["copy_bandwidth_GBps"] if bench else ASSUMED_BANDWIDTH_GBPS
gpu_label = f"{bench['meta']['gpu']}, from {source}" if bench else "no benchmark file"


# %%
def row_config(row) -> ReplayConfig:
    """The layer a benchmark row measured, as a ReplayConfig."""
    return ReplayConfig(row["num_k_heads"], row["num_v_heads"], row["head_k_dim"], row["head_v_dim"],
                        row["cache_len"], row["gate"], row["state_dtype"], row["cache_dtype"])


def shape_key(row):
    """The layer shape of a row: (gate, H_k, H_v, d_k, d_v)."""
    return (row["gate"], row["num_k_heads"], row["num_v_heads"], row["head_k_dim"], row["head_v_dim"])


def select(rows, **want):
    """Rows whose fields equal every `want` value."""
    return [r for r in rows if all(r[k] == v for k, v in want.items())]


def folds_every_step(row) -> bool:
    """The row was measured under FlushPolicy.EVERY_STEP (the file's `flush_every_step`)."""
    if "policy" in row:
        return row["policy"] == FlushPolicy.EVERY_STEP.value
    return bool(row.get("flush_every_step"))


def byte_check(rows):
    """Largest relative gap between the file's byte counts and replayssm_jax.cost."""
    worst = 0.0
    for r in rows:
        cfg = row_config(r)
        if folds_every_step(r):  # every step flushes an empty cache
            replay = r["batch"] * cost.replay_row_bytes(cfg, 0, force_flush=True).total
        else:
            replay = cost.replay_cycle_bytes(cfg, r["batch"]).total
        model = {"plain_bytes": cost.plain_step_bytes(cfg, r["batch"]).total, "replay_cycle_bytes": replay}
        for k, v in model.items():
            worst = max(worst, abs(r[k] - v) / v)
    return worst


if rows:
    shapes = sorted({shape_key(r) for r in rows})
    print("layer shapes in the file (gate, H_k, H_v, d_k, d_v):", shapes)
    print("(state dtype, cache dtype) pairs:", sorted({(r["state_dtype"], r["cache_dtype"]) for r in rows}))
    print(f"byte counts in the file vs replayssm_jax.cost: largest relative gap {byte_check(rows):.2%}")

# %% [markdown]
# Some rows were measured with every step folding (`FlushPolicy.EVERY_STEP`): the policy
# the plan picks by default at small batches (§5). The package's `default_flush_policy`
# should name the same policy as the file for each row with `L > 1`:

# %%
if rows:
    replay_rows = [r for r in rows if r["cache_len"] > 1]
    disagree = [r for r in replay_rows
                if folds_every_step(r) != (default_flush_policy(row_config(r), r["batch"]) is FlushPolicy.EVERY_STEP)]
    print(f"{sum(map(folds_every_step, replay_rows))} of {len(replay_rows)} rows with L > 1 measured "
          f"under EVERY_STEP; default_flush_policy agrees on {len(replay_rows) - len(disagree)}")
    for r in disagree[:8]:
        print(f"  differs: {r['gate']} {r['state_dtype']} B={r['batch']} L={r['cache_len']}: file "
              f"{'EVERY_STEP' if folds_every_step(r) else 'NATURAL'}, "
              f"default {default_flush_policy(row_config(r), r['batch']).name}")

# %% [markdown]
# ## 3. Model floor vs measured step time, against L
#
# The model floor is the cycle-averaged bytes divided by the copy bandwidth in the file's
# `meta` (what a kernel that only moved its bytes at copy speed would take). Measured points are
# the file's `replay_cycle_us` (per-step time averaged over a whole cycle of `L` steps) for
# synchronised cursors; `L = 1` is plain decode. One line per batch of `BATCHES` (the file
# has more batches: §5 plots them all against the batch). Hollow markers: rows measured under
# `FlushPolicy.EVERY_STEP`, whose steps all fold (their floor is higher than the cycle's).

# %%
def main_shape(rows):
    """The GDN layer shape with the most rows (the one to plot), or None."""
    gdn = [shape_key(r) for r in rows if r["gate"] == "gdn"] or [shape_key(r) for r in rows]
    return max(set(gdn), key=gdn.count) if gdn else None


plot_shape = main_shape(rows)
gate, hk, hv, dk, dv = plot_shape or ("gdn", NUM_K_HEADS, NUM_V_HEADS, HEAD_DIM, HEAD_DIM)
plot_rows = [r for r in rows if shape_key(r) == plot_shape]


def cache_dtype_per_state(rows):
    """For each state dtype, the cache dtype of most of its rows."""
    out = {}
    for sd in {r["state_dtype"] for r in rows}:
        cds = [r["cache_dtype"] for r in rows if r["state_dtype"] == sd]
        out[sd] = max(set(cds), key=cds.count)
    return out


# Without a file, model the benchmark's convention: caches in the state dtype.
cache_of = cache_dtype_per_state(plot_rows) or {"float32": "float32", "bfloat16": "bfloat16"}
plot_rows = [r for r in plot_rows if r["cache_dtype"] == cache_of[r["state_dtype"]]]
state_dtypes = sorted(cache_of, key=lambda d: d != "float32")
layer_text = f"{gate.upper()} H_k={hk} H_v={hv} d_k={dk} d_v={dv}"
print("plotted:", layer_text, "| state dtype -> cache dtype:", cache_of, f"| {len(plot_rows)} rows")


def plot_measured(ax, xs, ys, every_step, color, style="o-", **line_kw):
    """A measured curve: filled markers for NATURAL rows, hollow ones for EVERY_STEP rows."""
    marker, ls = style[0], style[1:] or "-"
    ax.plot(xs, ys, ls=ls, color=color, **line_kw)
    for x, y, e in zip(xs, ys, every_step):
        ax.plot([x], [y], marker=marker, ls="none", color=color, mfc="white" if e else color, ms=6)


def batch_ticks(ax, batches):
    """Powers of two as labelled ticks of a log batch axis."""
    lo, hi = min(batches), max(batches)
    ticks = [b for b in (2**i for i in range(16)) if lo <= b <= hi]
    ax.set_xticks(ticks, [str(b) for b in ticks])
    ax.minorticks_off()


HOLLOW = Line2D([], [], color="grey", marker="o", mfc="white", ls="none",
                label="measured under FlushPolicy.EVERY_STEP")

fig, axes = plt.subplots(1, len(state_dtypes), figsize=(6.5 * len(state_dtypes), 4.8), squeeze=False,
                         sharey=True)
not_plotted = set()
for ax, sd in zip(axes[0], state_dtypes):
    measured = select(plot_rows, state_dtype=sd, cursors="sync")
    not_plotted |= {r["batch"] for r in measured} - set(BATCHES)
    for i, B in enumerate(BATCHES):
        cfgs = [layer(L, sd, cache_of[sd], gate, hk, hv, dk, dv) for L in Ls]
        floor = [cost.floor_us(cost.replay_cycle_bytes(c, B).total, bandwidth) for c in cfgs]
        ax.plot(Ls, floor, "--", color=f"C{i}", lw=1)
        pts = sorted(select(measured, batch=B), key=lambda r: r["cache_len"])
        if pts:
            plot_measured(ax, [r["cache_len"] for r in pts], [r["replay_cycle_us"] for r in pts],
                          [folds_every_step(r) for r in pts], f"C{i}")
    ax.set(xscale="log", yscale="log", xlabel="cache length L (steps; L = 1 is plain decode)",
           title=f"{sd} state, {cache_of[sd]} caches")
    ax.set_xticks(Ls, [str(L) for L in Ls])
    if not measured:
        ax.text(0.5, 0.02, "no measurements: model only", transform=ax.transAxes, ha="center")
axes[0][0].set_ylabel("time per decode step (µs, cycle average)")
bw_text = (f"model floor at the file's copy bandwidth {bandwidth:.0f} GB/s" if bench
           else f"model floor at an ASSUMED {bandwidth:.0f} GB/s (no benchmark file)")
fig.suptitle(f"Is the measured step time near the byte floor, as L varies? {layer_text}\n"
             f"measured: {gpu_label}; {bw_text}", y=1.04)
batch_handles = [Line2D([], [], color=f"C{i}", lw=3, label=f"B={B}") for i, B in enumerate(BATCHES)]
style_handles = [Line2D([], [], color="grey", ls="--", label="model floor (bytes / copy bandwidth)"),
                 Line2D([], [], color="grey", marker="o", label="measured ReplaySSM, synchronised cursors"),
                 HOLLOW]
fig.legend(handles=batch_handles, loc="upper center", bbox_to_anchor=(0.5, 0.0), ncol=len(batch_handles),
           fontsize=9)
fig.legend(handles=style_handles, loc="upper center", bbox_to_anchor=(0.5, -0.06), ncol=3, fontsize=9)
save_figure(fig, "02_model_vs_measured_vs_L")
plt.show()
if not_plotted:
    print("batches in the file not drawn here (see §5):", sorted(not_plotted))

# %% [markdown]
# ## 4. The flush-step spike, and staggered cursors
#
# With synchronised cursors (every sequence started together) every row flushes on the same
# step: that step writes `B` checkpoints while the others write none. Staggering the cursors
# (row `i` at `(t + i) mod L`) spreads the flushes, so every step moves the cycle average.
# Left: the byte model over three cycles. Right: measured flush / non-flush / cycle times,
# each divided by the plain step's time at the same batch (rows under `FlushPolicy.NATURAL`
# only: under `EVERY_STEP` every step is a flush of an empty cache, with no spike).

# %%
spike_caches = cache_of.get("float32", "float32")
spike_cfg = layer(SPIKE_CACHE_LEN, "float32", spike_caches, gate, hk, hv, dk, dv)
steps = np.arange(3 * SPIKE_CACHE_LEN)
sync = [cost.replay_step_bytes(spike_cfg, cost.sync_cursors(t, SPIKE_BATCH, SPIKE_CACHE_LEN)).total
        for t in steps]
stag = [cost.replay_step_bytes(spike_cfg, cost.staggered_cursors(t, SPIKE_BATCH, SPIKE_CACHE_LEN)).total
        for t in steps]
plain = cost.plain_step_bytes(spike_cfg, SPIKE_BATCH).total

fig, axes = plt.subplots(1, 2, figsize=(14, 4.6))
ax = axes[0]
ax.step(steps, np.array(sync) / MIB, where="mid", label="synchronised cursors")
ax.step(steps, np.array(stag) / MIB, where="mid", label="staggered cursors")
ax.axhline(plain / MIB, color="k", ls="--", label="plain decode")
ax.set(xlabel="decode step", ylabel="MiB moved in the step (all rows)", ylim=(0, None),
       title=f"(a) byte model, B={SPIKE_BATCH}, L={SPIKE_CACHE_LEN}, fp32 state, "
             f"{short.get(spike_caches, spike_caches)} caches\n{layer_text}")
ax.legend(fontsize=8, loc="lower right")

ax = axes[1]
spike_rows = [r for r in select(plot_rows, state_dtype="float32", cache_len=SPIKE_CACHE_LEN)
              if not folds_every_step(r)]
sync_rows = {r["batch"]: r for r in spike_rows if r["cursors"] == "sync"}
stag_rows = {r["batch"]: r for r in spike_rows if r["cursors"] == "staggered"}
bars = sorted(set(sync_rows) | set(stag_rows))
if bars:
    series = [  # label, rows, field, color, style
        ("flush step (sync)", sync_rows, "replay_flush_us", "C3", "^-"),
        ("cycle average (sync)", sync_rows, "replay_cycle_us", "C0", "o-"),
        ("cycle average (staggered)", stag_rows, "replay_cycle_us", "C1", "s-"),
        ("non-flush step (sync)", sync_rows, "replay_nonflush_us", "C2", "v-"),
    ]
    for label, by_batch, field, color, style in series:
        pts = [(b, r[field] / r["plain_us"]) for b, r in sorted(by_batch.items()) if r.get(field) is not None]
        if pts:
            ax.plot(*zip(*pts), style, color=color, label=label)
    ax.axhline(1.0, color="k", ls="--", label="plain decode")
    ax.set(xscale="log", xlabel="batch (rows per step)", ylabel="measured time / plain decode time",
           title=f"(b) measured, L={SPIKE_CACHE_LEN}, fp32 state, FlushPolicy.NATURAL rows\n{gpu_label}",
           ylim=(0, None))
    batch_ticks(ax, bars)
    ax.legend(fontsize=8)
else:
    ax.axis("off")
    ax.text(0.5, 0.5, f"No measurements for L={SPIKE_CACHE_LEN}, fp32 state\n({gpu_label}):\n"
            "measured panel skipped", ha="center", va="center", transform=ax.transAxes)
fig.suptitle("How large is the flush-step spike, and do staggered cursors remove it?", y=1.03)
save_figure(fig, "02_flush_spike")
plt.show()

for b in bars if bars else []:
    r = sync_rows.get(b)
    if r and r["replay_flush_us"] is not None and r["replay_nonflush_us"] is not None:
        print(f"B={b:4d}: flush step {r['replay_flush_us'] / r['replay_nonflush_us']:.2f}x the non-flush step "
              f"(byte counts in the file: {r['replay_flush_bytes'] / r['replay_nonflush_bytes']:.2f}x); "
              f"cycle average staggered / sync: "
              + (f"{stag_rows[b]['replay_cycle_us'] / r['replay_cycle_us']:.2f}" if b in stag_rows else "n/a"))

# %% [markdown]
# ## 5. Where ReplaySSM stops paying: small batches
#
# In the byte model the saving is a constant fraction at every batch (grey lines: plain
# bytes / ReplaySSM bytes). A real step also has a fixed cost (launch, the per-row rebuild
# latency) that does not shrink with the batch; at small batches that fixed cost dominates, the
# bytes saved are worth little, and the extra rebuild work can make the replay cycle slower
# than plain decode. The measured speed-ups (`plain_us / replay_cycle_us`) show where that
# happens. Where ReplaySSM loses at every batch, the loss is the kernel's, not the byte
# model's: panel (b) shows the fraction of its byte floor each kernel reaches.
#
# The package answers small batches in the step's **plan**, through its flush policy:
# `default_flush_policy(config, B)` (`replayssm_jax.plan`), which `decode_step` uses when no
# policy is given, returns `FlushPolicy.EVERY_STEP` for GDN with a 4-byte state at
# `B <= 5`, for 2-byte states at `B <= 8` and for KDA with a 4-byte state at every batch,
# else `NATURAL`. Under `EVERY_STEP` every live row flushes at every step: the plain
# recurrence on the checkpoint (on the `pallas_triton` backend, its folding kernel), which
# measured faster there than the replay cycle. The policy depends only on the layer and the
# batch, never on the backend, so every backend runs the same plan. Rows measured under it
# (the file's `flush_every_step: true`, checked against `default_flush_policy` in §2) are
# drawn hollow: they are the folding kernel's speed, not the cache's, and the break-even list
# below leaves them out.

# %%
fig, axes = plt.subplots(1, 2, figsize=(14, 4.8))
ax = axes[0]
curves = sorted({(r["state_dtype"], r["cache_len"]) for r in plot_rows if r["cache_len"] > 1},
                key=lambda c: (c[0] != "float32", c[1]))
curve_lens = sorted({L for _, L in curves})
style = {"float32": "o-", "bfloat16": "s--"}
for sd, L in curves:
    pts = sorted(select(plot_rows, state_dtype=sd, cache_len=L, cursors="sync"), key=lambda r: r["batch"])
    plot_measured(ax, [r["batch"] for r in pts], [r["speedup_vs_plain"] for r in pts],
                  [folds_every_step(r) for r in pts], f"C{curve_lens.index(L) % 10}", style[sd])
for sd in state_dtypes:
    cd = cache_of.get(sd, sd)
    model = 1 / ratio_to_plain(layer(SPIKE_CACHE_LEN, sd, cd, gate, hk, hv, dk, dv))
    ax.axhline(model, color="grey", ls=style[sd][1:], lw=1.2)
ax.axhline(1.0, color="k", lw=1)
ax.set(xscale="log", xlabel="batch (rows per step)", ylabel="speed-up vs plain decode (×)",
       title=f"(a) speed-up vs batch, synchronised cursors\n{gpu_label}")
handles = [Line2D([], [], color=f"C{i % 10}", lw=3, label=f"L={L}") for i, L in enumerate(curve_lens)]
handles += [Line2D([], [], color="k", marker=style[sd][0], ls=style[sd][1:], label=f"{sd} state")
            for sd in state_dtypes]
handles += [HOLLOW, Line2D([], [], color="grey", label=f"byte model, L={SPIKE_CACHE_LEN}, any batch")]
ax.legend(handles=handles, fontsize=8, ncol=2, loc="upper center", bbox_to_anchor=(0.5, -0.14))
if curves:
    batch_ticks(ax, [r["batch"] for r in plot_rows])
else:
    ax.text(0.5, 0.5, "no measurements: only the byte model (grey)", ha="center", transform=ax.transAxes)
    ax.set_xlim(min(BATCHES), max(BATCHES))

ax = axes[1]
for i, sd in enumerate(state_dtypes):
    pts = sorted(select(plot_rows, state_dtype=sd, cache_len=SPIKE_CACHE_LEN, cursors="sync"),
                 key=lambda r: r["batch"])
    if pts:
        plot_measured(ax, [r["batch"] for r in pts], [r["replay_roofline_fraction"] for r in pts],
                      [folds_every_step(r) for r in pts], f"C{i}", "o-")
        ax.plot([r["batch"] for r in pts], [r["plain_roofline_fraction"] for r in pts], "s:",
                color=f"C{i}")
ax.set(xscale="log", xlabel="batch (rows per step)", ylabel="byte floor / measured time",
       title=f"(b) fraction of the byte floor reached, L={SPIKE_CACHE_LEN}\n{gpu_label}", ylim=(0, 1.05))
handles = [Line2D([], [], color=f"C{i}", lw=3, label=f"{sd} state") for i, sd in enumerate(state_dtypes)]
handles += [Line2D([], [], color="k", marker="o", label="ReplaySSM"),
            Line2D([], [], color="k", marker="s", ls=":", label="plain decode"), HOLLOW]
if curves:
    ax.legend(handles=handles, fontsize=8, ncol=2, loc="upper center", bbox_to_anchor=(0.5, -0.14))
    batch_ticks(ax, [r["batch"] for r in plot_rows])
else:
    ax.text(0.5, 0.5, "no measurements", ha="center", transform=ax.transAxes)
    ax.set_xlim(min(BATCHES), max(BATCHES))
fig.suptitle(f"At which batch does ReplaySSM beat plain decode, and why not below? {layer_text}", y=1.02)
save_figure(fig, "02_small_batch")
plt.show()

# %%
if plot_rows:
    print(f"Measured ({source}): smallest batch where ReplaySSM beats plain decode "
          "(synchronised cursors, FlushPolicy.NATURAL rows)")
    for sd, L in curves:
        pts = sorted(select(plot_rows, state_dtype=sd, cache_len=L, cursors="sync"), key=lambda r: r["batch"])
        wins = [r["batch"] for r in pts if r["speedup_vs_plain"] > 1.0 and not folds_every_step(r)]
        folded = ", ".join(f"B={r['batch']}: {r['speedup_vs_plain']:.2f}x" for r in pts if folds_every_step(r))
        print(f"  {sd:9s} L={L:3d}: {min(wins) if wins else 'never in this file'}"
              + (f"   (EVERY_STEP rows: {folded})" if folded else ""))
else:
    print("No benchmark file: the break-even batch is a measured quantity and is not shown.")

# %% [markdown]
# Other layer shapes in the file (e.g. more value heads, KDA) are not plotted; their measured
# speed-ups per batch (synchronised cursors) are listed here, `*` marking rows measured under
# `FlushPolicy.EVERY_STEP`.

# %%
other = [r for r in rows if shape_key(r) != plot_shape and r["cursors"] == "sync"]
groups = sorted({(shape_key(r), r["state_dtype"], r["cache_dtype"], r["cache_len"]) for r in other})
for key, sd, cd, L in groups:
    pts = sorted((r for r in other if (shape_key(r), r["state_dtype"], r["cache_dtype"], r["cache_len"])
                  == (key, sd, cd, L)), key=lambda r: r["batch"])
    g, k_heads, v_heads, d_k, d_v = key
    speedups = ", ".join(f"B={r['batch']}{'*' if folds_every_step(r) else ''}: {r['speedup_vs_plain']:.2f}x"
                         for r in pts)
    print(f"{g.upper()} H_k={k_heads} H_v={v_heads} d={d_k}, {sd} state, {cd} caches, L={L}: {speedups}")
if not other:
    print("no other layer shapes" + (f" in {source}" if source else " (no benchmark file)"))

# %% [markdown]
# ## Summary
#
# * Byte model (any device): the state term of ReplaySSM falls like `(1 + 1/L)/2` of plain
#   decode; cache reads grow like `(L - 1)/2` entries, so bytes bottom out around `L = 8..16`
#   for these shapes with bf16 caches and earlier with float32 caches or a KDA layer. The
#   on-chip rebuild work per byte grows linearly with `L`.
# * Synchronised cursors concentrate every checkpoint write on one step (the flush spike);
#   staggered cursors move the cycle-average bytes on every step. Measured, a staggered step
#   mixes long flush programs into a launch of short append programs. The plan orders the rows
#   costliest first (`StepPlan.launch_order`: flushing rows first), and the `pallas_triton`
#   backend's `LAUNCH_TABLE` launches in that order (`GridOrder.LAUNCH_ORDER*` rows) for GDN
#   with a 4-byte state from `B = 10`, with programs of one `[64, d_k]` tile at `B = 10..28`
#   (`B = 10..64` when `L > 16`). In `h200_2026-11-29.json` (L = 16, fp32 state) the
#   staggered cycle is within a few percent of the synchronised one at every measured batch
#   except `B = 32` (1.25x); the ratios are printed under the flush-spike figure.
# * Small batches: the fixed cost of a step outweighs the bytes saved, and the plan's default
#   flush policy (`default_flush_policy`) folds every step there instead of running the
#   replay cycle; the break-even batch of the replay cycle is printed above.
# * The measured side (model floor vs time, flush spike, break-even batch) is printed above
#   with its source file, or marked as missing when no benchmark file is committed.
