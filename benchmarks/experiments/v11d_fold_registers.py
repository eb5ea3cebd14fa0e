"""v11d experiment (H200): the folding kernel storing its flushed tile through a freshly
read slot (ptxas, sm_90a, BV 16 / 1 warp: 167 -> 128 registers, 12 -> 16 programs per SM)
against the plain kernel, in its current form and with the same slot re-read, at small
batch; the replay cycle of the table's B <= 16 entry beside them. Prints rows, writes JSON
to argv[1].

Ran on the H200 with the kernels of commit ac95989 (the slot re-read, reverted after this run):
`PYTHONPATH=$PWD python benchmarks/experiments/v11d_fold_registers.py $OUT/v11d.json`
(raw/h200_2026-11-29_v11d_fold_registers.*); `SMOKE=1` runs it on a CPU in interpret mode.
"""

import dataclasses, json, os, sys, time, warnings
SMOKE = bool(os.environ.get("SMOKE"))
import jax, jax.numpy as jnp, numpy as np
warnings.filterwarnings("ignore", message="The Pallas Triton backend is deprecated")
sys.path.insert(0, "benchmarks")
import decode_bench as DB
from jax.experimental import pallas as pl
from pallas_kernels import common, plain_decode as PD
from pallas_kernels.common import KernelConfig

CURRENT_PLAIN = PD._plain_kernel

def plain_with_slot_reread(slot_ref, valid_ref, q_ref, k_ref, g_ref, beta_ref, v_ref, a_log_ref, dt_bias_ref,
                           _state_in, y_ref, state_ref, *, spec, block_v):
    """The plain kernel with its store addressed through `slot_ref[b]` read again."""
    b, h, tile = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    cols = pl.ds(tile * block_v, block_v)
    valid = valid_ref[b] != 0

    @pl.when(~valid)
    def _padding_row():
        y_ref[b, h, cols] = jnp.zeros((block_v,), y_ref.dtype)

    @pl.when(valid)
    def _live_row():
        q, k, g, beta = common.load_token(spec, (q_ref, k_ref, g_ref, beta_ref, a_log_ref, dt_bias_ref), b, h)
        v = v_ref[b, h, cols].astype(jnp.float32)
        decayed = state_ref[slot_ref[b], h, cols, :].astype(jnp.float32) * common.over_rows(spec, jnp.exp(g))
        u = beta * (v - jnp.sum(decayed * k[None, :], axis=1))
        new = decayed + u[:, None] * k[None, :]
        y_ref[b, h, cols] = jnp.sum(new * q[None, :], axis=1).astype(y_ref.dtype)
        state_ref[slot_ref[b], h, cols, :] = new.astype(state_ref.dtype)

def use_plain(kernel):
    PD._plain_kernel = kernel
    DB.replay_cycle_fn.cache_clear(); DB.plain_steps_fn.cache_clear(); DB.time_plain_cached.cache_clear()
    jax.clear_caches()

def main(out):
    t0 = time.time(); timer = DB.Timer(SMOKE); res = dict(meta=DB.versions(), rows=[])
    res["meta"]["copy_bandwidth_GBps"] = 0.0 if SMOKE else DB.copy_bandwidth_GBps(timer)
    print(res["meta"], flush=True)
    shapes = {"gdn": DB.Shape(2, 4, 32) if SMOKE else DB.Shape(),
              "kda": DB.Shape(4, 4, 32, "kda") if SMOKE else DB.Shape(32, 32, 128, "kda"),
              "gdn_hv64": DB.Shape(2, 4, 32) if SMOKE else DB.Shape(16, 64, 128)}
    plain_tiles = [(16, 1)] if SMOKE else [(8, 1), (16, 1)]
    fold_tiles = [(16, 1)] if SMOKE else [(8, 1), (16, 1), (16, 2)]
    cases = [("gdn", "float32", 2)] if SMOKE else (
        [("gdn", "float32", b) for b in (1, 2, 4, 8, 16)]
        + [("gdn", "bfloat16", b) for b in (1, 4, 8)] + [("kda", "float32", b) for b in (1, 4, 8)]
        + [("gdn_hv64", "float32", b) for b in (1, 8)])
    replay16 = KernelConfig(block_v=32, num_warps=2, cache_chunk=16, tiles_per_program=2, rebuild_unroll=4)
    for shape, dtype, batch in cases:
        if time.time() - t0 > 420: print("time guard", flush=True); break
        cfg = shapes[shape].config(16, jnp.dtype(dtype))
        row = dict(shape=shape, state_dtype=dtype, batch=batch, plain={}, fold={})
        for form, kernel in (("current", CURRENT_PLAIN), ("slot_reread", plain_with_slot_reread)):
            use_plain(kernel)
            for bv, w in plain_tiles:
                row["plain"][f"{form} {bv},{w}"] = DB.time_plain(timer, dataclasses.replace(cfg, cache_len=1), batch,
                                                                 KernelConfig(block_v=bv, num_warps=w), np.random.default_rng(batch), 3, SMOKE)
        use_plain(CURRENT_PLAIN)
        for bv, w in fold_tiles:
            kc = KernelConfig(block_v=bv, num_warps=w, flush_every_step=True)
            row["fold"][f"{bv},{w}"] = DB.time_replay(timer, cfg, batch, kc, np.random.default_rng(0), 3, SMOKE, staggered=False)[2]
        if batch >= 8 and not SMOKE:
            nf, fl, cyc = DB.time_replay(timer, cfg, batch, replay16, np.random.default_rng(0), 3, SMOKE, staggered=False)
            stag = DB.time_replay(timer, cfg, batch, replay16, np.random.default_rng(0), 3, SMOKE, staggered=True)[2]
            row["replay_32_2_t2"] = dict(nonflush_us=nf, flush_us=fl, cycle_us=cyc, staggered_us=stag)
        print("row", json.dumps(row), flush=True); res["rows"].append(row)
        with open(out, "w") as f: json.dump(res, f, indent=1)
    print(f"total {time.time() - t0:.0f} s")

if __name__ == "__main__":
    main(sys.argv[1])
