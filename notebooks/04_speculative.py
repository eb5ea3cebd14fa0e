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
# # 04 · Speculative verify: acceptance rate vs bytes written, ring size vs folds
#
# A speculative step verifies a window of `T` tokens (the row's next input and `T - 1`
# drafts) and keeps `n` of them (1..T: the accepted drafts plus the verifier's bonus
# token). Rejected drafts must leave no trace in the state:
#
# * **conventional speculation** writes one full state `S` per window position, so that
#   any prefix can be restored: `T S` written per verify step;
# * **ReplaySSM verify** (`replayssm_jax.speculative`, method note §13) appends `T` small
#   records `(u, k, g)` of `E` bytes each and moves the cursor by `n`; it writes the
#   checkpoint only when the ring is full (the capacity rule: a row whose
#   `write_pos + T > L` folds its accepted history first).
#
# This notebook uses the byte model (`replayssm_jax.cost`; pure arithmetic, no device):
#
# 1. state bytes written per accepted token vs acceptance rate, for several `T`: the
#    write-traffic speed-up of ReplaySSM verify over conventional verify;
# 2. ring size `L` vs fold frequency, from the capacity rule;
# 3. a small live check: the folds `verify_step` + `accept` actually make on a tiny layer
#    equal the capacity rule's count.
#
# Acceptance rate `r` is the fraction of the `T - 1` drafts accepted, so a step keeps
# `n = 1 + r (T - 1)` tokens. The model assumes every step keeps the same `n` (steady
# state); integer `n` only, so each `r` below is reached exactly.

# %%
from nbutil import env_int, env_ints

# Layer shapes of the byte model (defaults: the GDN layer of replayssm.md §10).
NUM_K_HEADS = env_int("RS_NUM_K_HEADS", 16)
NUM_V_HEADS = env_int("RS_NUM_V_HEADS", 32)
HEAD_DIM = env_int("RS_HEAD_DIM", 128)
WIDTHS = env_ints("RS_SPEC_WIDTHS", (2, 4, 8))  # window sizes T
CACHE_LENS = env_ints("RS_SPEC_CACHE_LENS", (16, 32))  # rings L of the acceptance plot
RING_SWEEP = env_ints("RS_SPEC_RING_SWEEP", (4, 8, 12, 16, 24, 32, 48, 64))  # L of the fold plot
RING_WIDTH = env_int("RS_SPEC_RING_WIDTH", 4)  # T of the fold plot
# The live check: a tiny layer, a few verify steps per kept count (CPU-cheap).
LIVE_CACHE_LEN = env_int("RS_SPEC_LIVE_CACHE_LEN", 8)
LIVE_WIDTH = env_int("RS_SPEC_LIVE_WIDTH", 3)
# Enough steps for two folds at n = 1 (the first one after L - T + 1 steps).
LIVE_STEPS = env_int("RS_SPEC_LIVE_STEPS", 2 * LIVE_CACHE_LEN + 2)

# %%
import matplotlib

matplotlib.use("Agg")
import jax
import jax.numpy as jnp
import matplotlib.pyplot as plt
import matplotlib.ticker
import numpy as np

from nbutil import save_figure

from replayssm_jax import ReplayConfig, Tokens, cost, init_state
from replayssm_jax.speculative import accept, verify_step

KIB = 2**10


def layer(cache_len, state_dtype="float32", cache_dtype="bfloat16"):
    return ReplayConfig(NUM_K_HEADS, NUM_V_HEADS, HEAD_DIM, HEAD_DIM, cache_len, "gdn",
                        state_dtype, cache_dtype)


shape_text = f"GDN H_k={NUM_K_HEADS}, H_v={NUM_V_HEADS}, d={HEAD_DIM}, fp32 state, bf16 caches"
cfg = layer(max(CACHE_LENS))
print(shape_text)
print(f"S (one slot's state) = {cost.state_bytes(cfg) / KIB:,.0f} KiB, "
      f"E (one record u, k, g) = {cost.entry_bytes(cfg) / KIB:,.2f} KiB, S / E = "
      f"{cost.state_bytes(cfg) / cost.entry_bytes(cfg):.0f}")

# %% [markdown]
# ## 1. Acceptance rate vs state bytes written per accepted token
#
# Per row, layer and accepted token:
#
# * conventional: `T S / n`;
# * ReplaySSM: `(T E + S / m) / n`, with `m = floor((L - T) / n) + 1` verify steps per fold
#   (`cost.verify_fold_interval`).
#
# Plain one-token decode writes `S` per token. The speed-up below is the ratio of written
# bytes (conventional / ReplaySSM): the part of the verify step's traffic speculation adds.

# %%
def kept_counts(width):
    """n = 1..T and the acceptance rate r = (n - 1) / (T - 1) of each."""
    n = np.arange(1, width + 1)
    return n, (n - 1) / (width - 1)


print(f"{'T':>3} {'L':>4} {'r':>5} {'n':>3} {'folds/step':>10} {'ReplaySSM KiB/tok':>17} "
      f"{'conv. KiB/tok':>13} {'speed-up':>8}")
rows = {}
for width in WIDTHS:
    for L in CACHE_LENS:
        if width > L:
            continue
        c = layer(L)
        ns, rates = kept_counts(width)
        ours = np.array([cost.verify_written_per_token(c, width, n) for n in ns])
        conv = np.array([cost.conventional_written_per_token(c, width, n) for n in ns])
        rows[width, L] = rates, ours, conv
        for n, r, a, b in zip(ns, rates, ours, conv):
            folds = 1 / cost.verify_fold_interval(L, width, n)
            print(f"{width:3d} {L:4d} {r:5.0%} {n:3d} {folds:10.3f} {a / KIB:17.1f} {b / KIB:13.1f} "
                  f"{b / a:8.1f}")

# %%
fig, axes = plt.subplots(1, 2, figsize=(13, 4.6))
colors = {w: f"C{i}" for i, w in enumerate(WIDTHS)}
L_plot = min(CACHE_LENS)
ax = axes[0]
for width in WIDTHS:
    if (width, L_plot) not in rows:
        continue
    rates, ours, conv = rows[width, L_plot]
    ax.plot(100 * rates, conv / KIB, "s--", color=colors[width], label=f"conventional, T={width}")
    ax.plot(100 * rates, ours / KIB, "o-", color=colors[width], label=f"ReplaySSM, T={width}")
ax.axhline(cost.state_bytes(layer(L_plot)) / KIB, color="k", lw=0.8, ls=":",
           label="plain decode (S per token)")
ax.set(yscale="log", xlabel="draft acceptance rate r (%)",
       ylabel="state KiB written per accepted token (per row, layer)",
       title=f"(a) bytes written per accepted token, L={L_plot}\n{shape_text}")
ax.legend(fontsize=8, ncol=2)

ax = axes[1]
styles = {L: s for L, s in zip(CACHE_LENS, ["o-", "x--", "^:", "v-."])}
for width in WIDTHS:
    for L in CACHE_LENS:
        if (width, L) in rows:
            rates, ours, conv = rows[width, L]
            ax.plot(100 * rates, conv / ours, styles[L], color=colors[width], label=f"T={width}, L={L}")
ax.set(xlabel="draft acceptance rate r (%)", ylabel="conventional / ReplaySSM bytes written",
       title="(b) write-traffic speed-up of ReplaySSM verify\n(byte model, any batch)")
ax.legend(fontsize=8, ncol=2)
fig.tight_layout()
save_figure(fig, "04_acceptance_vs_bytes")

# %% [markdown]
# The speed-up falls with the acceptance rate: a rejected draft costs conventional
# speculation a full state but ReplaySSM only a record, so low acceptance is where the
# cursor move pays most; at full acceptance the ratio is still about `S / (E + S / (m T))`
# per window position, set by the record size and the fold frequency.
#
# ## 2. Ring size L vs fold frequency
#
# From the capacity rule: a row keeping `n` tokens per step folds every
# `m = floor((L - T) / n) + 1` verify steps. With `L = T` every step folds (the window
# fills the ring); each extra `n` slots of ring buys one more step between folds.

# %%
Ls = np.array([L for L in RING_SWEEP if L >= RING_WIDTH])
ns, rates = kept_counts(RING_WIDTH)
fig, axes = plt.subplots(1, 2, figsize=(13, 4.4))
for n, r in zip(ns, rates):
    m = np.array([cost.verify_fold_interval(int(L), RING_WIDTH, int(n)) for L in Ls])
    axes[0].plot(Ls, 1 / m, "o-", label=f"r={r:.0%} (n={n})")
    folds = cost.state_bytes(cfg) / m  # per verify step; S and E do not depend on L
    records = RING_WIDTH * cost.entry_bytes(cfg)
    axes[1].plot(Ls, 100 * folds / (folds + records), "o-", label=f"r={r:.0%} (n={n})")
axes[0].set(xscale="log", yscale="log", xlabel="ring size L (records)", ylabel="folds per verify step",
            title=f"(a) fold frequency, T={RING_WIDTH} (capacity rule)")
axes[1].set(xscale="log", xlabel="ring size L (records)", ylabel="% of written bytes that are folds",
            title=f"(b) share of the checkpoint writes, T={RING_WIDTH}\n{shape_text}", ylim=(0, 100))
for ax in axes:
    ax.set_xticks(Ls, [str(L) for L in Ls])
    ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.legend(fontsize=8)
fig.tight_layout()
save_figure(fig, "04_ring_vs_folds")

# %% [markdown]
# The folds dominate ReplaySSM's writes up to large rings (a checkpoint weighs `S / E` records,
# printed above), yet even at `L = T` the row writes one state per step where conventional
# speculation writes `T`. Higher acceptance fills the ring faster and folds more often: a
# larger `L` keeps the fold rate down when drafts are good.
#
# ## 3. Live check: the folds of `verify_step` + `accept`
#
# A tiny GDN layer (one head pair, d = 8), one row keeping the same `n` every step: count the
# steps at which `verify_step` folded (its returned cursor is reset to 0 while the row had
# history) and compare with the capacity rule's `m`.

# %%
tiny = ReplayConfig(1, 1, 8, 8, LIVE_CACHE_LEN, "gdn", "float32", "float32")
rng = np.random.default_rng(0)
slots = jnp.array([0], jnp.int32)
verify = jax.jit(verify_step)
keep = jax.jit(accept)


def window(width):
    normal = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)
    return Tokens(normal(1, width, 1, 8), normal(1, width, 1, 8), normal(1, width, 1, 8),
                  -jnp.abs(normal(1, width, 1)), jax.nn.sigmoid(normal(1, width, 1)))


for n in range(1, LIVE_WIDTH + 1):
    state = init_state(tiny, 1)
    fold_steps = []
    for step in range(LIVE_STEPS):
        before = int(state.write_pos[0])
        _, state = verify(state, window(LIVE_WIDTH), slots)
        if before and int(state.write_pos[0]) == 0:
            fold_steps.append(step)
        state = keep(state, slots, jnp.array([n], jnp.int32))
    measured = np.diff(fold_steps)
    model = cost.verify_fold_interval(LIVE_CACHE_LEN, LIVE_WIDTH, n)
    print(f"L={LIVE_CACHE_LEN} T={LIVE_WIDTH} n={n}: folds at steps {fold_steps}, "
          f"intervals {measured.tolist()}, capacity rule m = {model}")
    assert len(measured) and np.all(measured == model), (measured, model)
