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
# # 01 · Quickstart: one ReplaySSM layer
#
# A ReplaySSM layer keeps, per physical slot, a **checkpoint** of the recurrent state and a
# short **cache** of the last updates `(u, k, g)`; the checkpoint is written back ("flushed")
# once every `L` steps (see `/work/shared/replayssm.md` §3–§5). This notebook:
#
# 1. builds a `ReplayConfig` and a state,
# 2. packs the inputs as a `Tokens` pytree,
# 3. runs a jitted decode loop with the state donated, under an explicit flush policy,
# 4. checks every output against the plain scan (`recurrent_reference`),
# 5. reads the live state with `materialize_state`,
# 6. looks at the step's plan (`plan_step`) and forces a flush,
# 7. copies a slot,
# 8. runs the same steps under both flush policies and both backends.
#
# Sizes are set in the next cell and can be overridden from the environment
# (e.g. `RS_BATCH=64 RS_HEAD_DIM=128`) for a run on a GPU.

# %%
from nbutil import env_int

BATCH = env_int("RS_BATCH", 4)  # rows decoded per step
NUM_SLOTS = env_int("RS_NUM_SLOTS", 2 * BATCH)  # physical slots in the pool
NUM_K_HEADS = env_int("RS_NUM_K_HEADS", 2)
NUM_V_HEADS = env_int("RS_NUM_V_HEADS", 4)
HEAD_DIM = env_int("RS_HEAD_DIM", 32)  # d_k = d_v (the pallas_triton backend needs a power of two >= 16)
CACHE_LEN = env_int("RS_CACHE_LEN", 8)  # L
STEPS = env_int("RS_STEPS", 37)  # tokens decoded (not a multiple of L on purpose)
BACKEND_STEPS = env_int("RS_BACKEND_STEPS", 12)  # tokens of the backend / policy comparison
SEED = env_int("RS_SEED", 0)

# %%
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

import replayssm_jax as rs
from nbutil import device_label

print("jax", jax.__version__, "on", device_label())

# %% [markdown]
# ## 1. Config and state
#
# `ReplayConfig` is static (shapes, `L`, gate, dtypes). `init_state` allocates the pool:
# checkpoint `[N, H_v, d_v, d_k]`, caches of `L` entries per slot and one cursor
# (`write_pos`) per slot.

# %%
config = rs.ReplayConfig(
    num_k_heads=NUM_K_HEADS,
    num_v_heads=NUM_V_HEADS,
    head_k_dim=HEAD_DIM,
    head_v_dim=HEAD_DIM,
    cache_len=CACHE_LEN,
    gate="gdn",
    state_dtype=jnp.float32,
    cache_dtype=jnp.float32,
)
state = rs.init_state(config, NUM_SLOTS)
print(config)
for name in ("checkpoint", "u_cache", "k_cache", "g_cache", "write_pos"):
    x = getattr(state, name)
    print(f"{name:10s} {str(x.shape):24s} {x.dtype}")

# %% [markdown]
# ## 2. Inputs: a `Tokens` pytree
#
# A step's inputs travel as one pytree, `rs.Tokens(q, k, v, g, beta)`. With a leading
# `[B]` axis it is one decode step; with `[B, T]` a sequence (what `recurrent_reference`
# takes). `jax.tree.map` slices all five fields at once.
#
# Random GDN inputs for `STEPS` tokens, gated the Qwen3-Next way (`g = -exp(A_log) ·
# softplus(a + dt_bias)`, `β = sigmoid(b)`), q and k L2-normalised inside the step.
# Rows map to physical slots through `slots`; here row `i` uses slot `2i + 1`, not slot `i`.

# %%
def make_tokens(key, batch, steps, cfg) -> rs.Tokens:
    """Raw decode inputs with a time axis: q, k [B,T,Hk,dk], v [B,T,Hv,dv], g, beta [B,T,Hv]."""
    kq, kk, kv, ka, kb, kA, kd = jax.random.split(key, 7)
    hk, hv, dk, dv = cfg.num_k_heads, cfg.num_v_heads, cfg.head_k_dim, cfg.head_v_dim
    A_log = jax.random.uniform(kA, (hv,), minval=-3.0, maxval=0.0)
    dt_bias = jax.random.normal(kd, (hv,))
    return rs.Tokens(
        q=jax.random.normal(kq, (batch, steps, hk, dk)),
        k=jax.random.normal(kk, (batch, steps, hk, dk)),
        v=jax.random.normal(kv, (batch, steps, hv, dv)),
        g=rs.gdn_gate(jax.random.normal(ka, (batch, steps, hv)), A_log, dt_bias),
        beta=rs.beta_gate(jax.random.normal(kb, (batch, steps, hv))),
    )


def at_step(tokens: rs.Tokens, t: int) -> rs.Tokens:
    """The `[B]` tokens of step `t` of a `[B, T]` sequence."""
    return jax.tree.map(lambda x: x[:, t], tokens)


tokens = make_tokens(jax.random.key(SEED), BATCH, STEPS, config)
slots = jnp.arange(BATCH, dtype=jnp.int32) * 2 + 1
print({name: tuple(x.shape) for name, x in vars(tokens).items()})
print("slots per row:", slots.tolist())

# %% [markdown]
# ## 3. The flush policy, and a jitted decode loop with the state donated
#
# Each step, `decode_step` first builds the step's **plan** (`rs.plan_step`, on the device):
# per row its slot, its cursor `pos`, and whether it flushes. Which rows flush is set by the
# plan's **flush policy**:
#
# * `FlushPolicy.NATURAL`: a row flushes when its slot already holds `L - 1` cached entries
#   (or when forced): the replay cycle of the method note.
# * `FlushPolicy.EVERY_STEP`: every live row flushes at every step, i.e. the plain
#   recurrence on the checkpoint, no cache traffic. Same outputs.
#
# With `policy=None`, `decode_step` uses `rs.default_flush_policy(config, B)`. It depends
# only on the layer and the batch (never on the backend), and picks `EVERY_STEP` at small
# batches, where folding every step measured faster on the H200 than the replay cycle
# (GDN with a 4-byte state at `B <= 5`, 2-byte states at `B <= 8`, KDA with a 4-byte state
# at every batch; see `benchmarks/NOTES.md`). Our `B = 4` float32 layer is such a case, so
# to watch the cache at work this notebook asks for `NATURAL` explicitly.
#
# One compiled executable serves every step, flush and non-flush. Donating the state
# (`donate_argnums=0`) lets XLA update the pool in place instead of copying it each step;
# the old `state` object must not be used after the call.

# %%
print(f"default_flush_policy(config, B={BATCH}) = {rs.default_flush_policy(config, BATCH)}")
for b in (1, 5, 6, 64):
    print(f"  B={b:3d}: {rs.default_flush_policy(config, b).name}")

POLICY = rs.FlushPolicy.NATURAL
step = jax.jit(functools.partial(rs.decode_step, policy=POLICY, use_qk_l2norm=True), donate_argnums=0)

ys = []
for t in range(STEPS):
    y, state = step(state, at_step(tokens, t), slots)
    ys.append(y)
ys = jnp.stack(ys, axis=1)  # [B, T, Hv, dv]
print("outputs", ys.shape, "| compiled executables:", step._cache_size())
print("cursors after", STEPS, "steps:", state.write_pos.tolist(), f"(= {STEPS} mod {CACHE_LEN} on used slots)")

# %% [markdown]
# ## 4. Check against the plain recurrence
#
# `recurrent_reference(tokens, initial_state)` is a `lax.scan` over the plain recurrence
# that materialises the full state every step. Replay is exact algebra but sums in a
# different order (§11), so we compare with a tolerance: every step's output, and the live
# state at the end.

# %%
y_ref, state_ref = rs.recurrent_reference(
    tokens, jnp.zeros((BATCH, NUM_V_HEADS, HEAD_DIM, HEAD_DIM)), use_qk_l2norm=True
)


def rel_err(x, ref):
    """Frobenius-norm relative error ||x - ref|| / ||ref||."""
    x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(x - ref) / np.linalg.norm(ref))


per_step = [rel_err(ys[:, t], y_ref[:, t]) for t in range(STEPS)]
print(f"output rel. error: max over {STEPS} steps {max(per_step):.2e}")
np.testing.assert_allclose(ys, y_ref, rtol=1e-4, atol=1e-4)

# %% [markdown]
# ## 5. Read the live state
#
# Between flushes the checkpoint is *not* the current state: `materialize_state` replays
# the slot's valid cache entries onto its checkpoint (the state the next token would see).

# %%
live = rs.materialize_state(state, slots)
print(f"live state vs reference:        rel. error {rel_err(live, state_ref):.2e}")
print(f"stale checkpoint vs reference:  rel. error {rel_err(state.checkpoint[slots], state_ref):.2e}"
      "  (expected large: cache entries not yet flushed)")
np.testing.assert_allclose(live, state_ref, rtol=1e-4, atol=1e-4)

# %% [markdown]
# ## 6. The plan, and a forced flush
#
# `plan_step(write_pos, slots, force_flush, L, policy)` is what `decode_step` computes
# first; a model computes it once per forward pass and runs every layer under it
# (`rs.layer_step`), then moves the cursors once (`rs.advance_write_pos`).
#
# `force_flush=[B] bool` flushes chosen rows now, whatever their cursor (§8: this is how a
# prefix-cache snapshot lands on an exact position). After it the checkpoint **is** the live
# state and the cursor is 0. Here we decode one more token and flush row 0 only.

# %%
force = jnp.zeros(BATCH, bool).at[0].set(True)
plan = rs.plan_step(state.write_pos, slots, force, CACHE_LEN, POLICY)
print("plan of the next step:")
for field in ("slot", "valid", "pos", "flush", "launch_order"):
    print(f"  {field:12s} {getattr(plan, field).tolist()}")
print(f"  {'policy':12s} {plan.policy}")

tokens1 = make_tokens(jax.random.key(SEED + 1), BATCH, 1, config)
print("cursors before:", state.write_pos[slots].tolist())
y1, state = step(state, at_step(tokens1, 0), slots, force)
print("cursors after: ", state.write_pos[slots].tolist(), "(row 0 flushed to 0)")

y1_ref, state_ref = rs.recurrent_reference(tokens1, state_ref, use_qk_l2norm=True)
np.testing.assert_allclose(y1, y1_ref[:, 0], rtol=1e-4, atol=1e-4)
src_slot = int(slots[0])
print(f"row 0: checkpoint vs reference state, rel. error "
      f"{rel_err(state.checkpoint[src_slot], state_ref[0]):.2e}")
np.testing.assert_allclose(state.checkpoint[src_slot], state_ref[0], rtol=1e-4, atol=1e-4)

# %% [markdown]
# ## 7. Copy a slot
#
# Copying a sequence (a fork, or a prefix-cache hit) gives the destination slot the source's
# state with an **empty cache** (cursor 0). §8 copies from a flushed source. For this one
# layer we do it with the public API: materialise the source's live state (exact for any
# cursor, and equal to the checkpoint when the source is flushed), write it into the
# destination's checkpoint and set the destination's cursor to 0.
#
# For a whole model (several layers sharing one `write_pos`, plus the conv state), use the
# model-level `replayssm_jax.model.slots.copy_slots(state, src, dst)` on a `ModelState`; the
# cell after next says whether it is present in this checkout.

# %%
def copy_slot_single_layer(state: rs.ReplayState, src: int, dst: int) -> rs.ReplayState:
    """One layer: slot `dst` gets slot `src`'s live state as its checkpoint and cursor 0.

    Rounds to the checkpoint dtype (exact for float32 and for a flushed source).
    """
    src_live = rs.materialize_state(state, jnp.array([src], jnp.int32))[0]
    checkpoint = state.checkpoint.at[dst].set(src_live.astype(state.config.state_dtype))
    write_pos = state.write_pos.at[dst].set(0)
    return dataclasses.replace(state, checkpoint=checkpoint, write_pos=write_pos)


free_slot = next(s for s in range(NUM_SLOTS) if s not in set(slots.tolist()))
state = copy_slot_single_layer(state, src_slot, free_slot)
print(f"copied slot {src_slot} (cursor 0, flushed) -> slot {free_slot}")

# Decode the same token in both: the source (row 0) and the copy (row 1 now points at it).
# Other rows are padding (slot -1): their output is 0 and nothing is written.
pair = jnp.array([src_slot, free_slot] + [-1] * (BATCH - 2), jnp.int32)
one = at_step(make_tokens(jax.random.key(SEED + 2), 1, 1, config), 0)  # one row
tokens2 = jax.tree.map(lambda x: jnp.broadcast_to(x, (BATCH, *x.shape[1:])), one)
y2, state = step(state, tokens2, pair)
print("source vs copy, max |dy| =", float(jnp.max(jnp.abs(y2[0] - y2[1]))))
print("padding rows are zero:", bool(jnp.all(y2[2:] == 0)))
np.testing.assert_array_equal(y2[0], y2[1])

# %%
import importlib.util

has_model_slots = importlib.util.find_spec("replayssm_jax.model.slots") is not None
print("replayssm_jax.model.slots present in this checkout:", has_model_slots)
if has_model_slots:
    from replayssm_jax.model import slots as model_slots

    if hasattr(model_slots, "copy_slots"):
        doc = (model_slots.copy_slots.__doc__ or "").strip().splitlines()
        print("model-level copy_slots(state, src, dst):", doc[0] if doc else "(no docstring)")

# %% [markdown]
# ## 8. Both flush policies, both backends
#
# `backend="xla"` is the pure-jax specification; `backend="pallas_triton"` runs the fused
# Pallas-Triton kernels (in interpret mode off a GPU, so slowly here). Which kernel runs
# follows from the plan: the replay kernel under `NATURAL`, the folding kernel under
# `EVERY_STEP` (its launch parameters come from the backend's `LAUNCH_TABLE`). Given the
# same plan, both backends end in the same state; both policies give the same outputs,
# and only the cursors differ (`EVERY_STEP` returns them to 0 every step).

# %%
tokens3 = make_tokens(jax.random.key(SEED + 3), BATCH, BACKEND_STEPS, config)
y3_ref, _ = rs.recurrent_reference(tokens3, jnp.zeros_like(state_ref), use_qk_l2norm=True)
for backend in ("xla", "pallas_triton"):
    for policy in rs.FlushPolicy:
        run = jax.jit(functools.partial(rs.decode_step, backend=backend, policy=policy,
                                        use_qk_l2norm=True), donate_argnums=0)
        s = rs.init_state(config, NUM_SLOTS)
        out = []
        for t in range(BACKEND_STEPS):
            y, s = run(s, at_step(tokens3, t), slots)
            out.append(y)
        out = jnp.stack(out, axis=1)
        print(f"{backend:14s} {policy.name:10s} rel. error vs reference {rel_err(out, y3_ref):.1e} "
              f"| cursors {s.write_pos[slots].tolist()}")
        np.testing.assert_allclose(out, y3_ref, rtol=1e-4, atol=1e-4)

# %% [markdown]
# ## Summary
#
# * inputs are one `Tokens` pytree; one jitted executable served every step, flush and
#   non-flush, with the state donated;
# * outputs match the plain scan to float32 rounding (~1e-7 relative at the default sizes);
# * the checkpoint is stale between flushes; `materialize_state` gives the live state;
# * which rows flush is the plan's flush policy (`default_flush_policy` folds every step at
#   small batches); a forced flush makes the checkpoint the live state and resets the cursor;
# * a copied slot starts from the source's state with an empty cache and decodes the same;
# * both backends and both policies give the same outputs.
