"""v11 experiment (H200): the folding kernel (`fold_decode`, flush every step) against the
plain kernel and the replay cycle at small batch; the plain kernel with both readouts taken
from the incoming tile (`common.delta_rule_step`) against its current form (y from S_t).
Prints rows, writes JSON to argv[1].

Ran on the H200 with the kernels of the commit that adds `pallas_kernels/fold_decode.py`:
`PYTHONPATH=$PWD python benchmarks/experiments/v11_fold_fallback.py $OUT/v11.json`
(raw/h200_2026-11-29_v11_fold.*); `SMOKE=1` runs it on a CPU in interpret mode.
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

def side_by_side_plain(slot_ref, valid_ref, q_ref, k_ref, g_ref, beta_ref, v_ref, a_log_ref, dt_bias_ref,
                       _state_in, y_ref, state_ref, *, spec, block_v):
    """The plain kernel with y and u both read from the incoming tile."""
    b, h, tile = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    cols = pl.ds(tile * block_v, block_v)
    valid = valid_ref[b] != 0

    @pl.when(~valid)
    def _padding_row():
        y_ref[b, h, cols] = jnp.zeros((block_v,), y_ref.dtype)

    @pl.when(valid)
    def _live_row():
        slot = slot_ref[b]
        q, k, g, beta = common.load_token(spec, (q_ref, k_ref, g_ref, beta_ref, a_log_ref, dt_bias_ref), b, h)
        v = v_ref[b, h, cols].astype(jnp.float32)
        y, _, new = common.delta_rule_step(spec, state_ref[slot, h, cols, :].astype(jnp.float32), q, k, v, g, beta)
        y_ref[b, h, cols] = y.astype(y_ref.dtype)
        state_ref[slot, h, cols, :] = new.astype(state_ref.dtype)

def use_plain(kernel):
    PD._plain_kernel = kernel
    DB.replay_cycle_fn.cache_clear(); DB.plain_steps_fn.cache_clear(); DB.time_plain_cached.cache_clear()
    jax.clear_caches()

def main(out):
    t0 = time.time(); timer = DB.Timer(SMOKE); res = dict(meta=DB.versions(), rows=[])
    res["meta"]["copy_bandwidth_GBps"] = 0.0 if SMOKE else DB.copy_bandwidth_GBps(timer)
    print(res["meta"], flush=True)
    shapes = {"gdn": DB.Shape(2, 4, 32) if SMOKE else DB.Shape(),
              "kda": DB.Shape(4, 4, 32, "kda") if SMOKE else DB.Shape(32, 32, 128, "kda")}
    plain_tiles = [(16, 1)] if SMOKE else [(8, 1), (16, 1)]
    fold_tiles = [(16, 1)] if SMOKE else [(8, 1), (16, 1), (16, 2), (32, 2), (32, 4)]
    reference_replay = KernelConfig(block_v=32, num_warps=2, cache_chunk=16, tiles_per_program=2, rebuild_unroll=4)
    if SMOKE:
        reference_replay = KernelConfig(block_v=16, num_warps=2, tiles_per_program=2)
    cases = [("gdn", jnp.float32, b) for b in ((2,) if SMOKE else (1, 2, 4, 8, 16))]
    cases += [] if SMOKE else [("gdn", jnp.bfloat16, 1), ("gdn", jnp.bfloat16, 8), ("kda", jnp.float32, 1), ("kda", jnp.float32, 8)]
    for gate, dtype, batch in cases:
        if time.time() - t0 > 420: print("time guard", flush=True); break
        cfg = shapes[gate].config(16, dtype)
        row = dict(gate=gate, state_dtype=jnp.dtype(dtype).name, batch=batch, cache_len=16, plain={}, fold={}, fold_staggered={})
        for form, kernel in (("current", CURRENT_PLAIN), ("side_by_side", side_by_side_plain)):
            use_plain(kernel)
            for bv, w in plain_tiles:
                row["plain"][f"{form} {bv},{w}"] = DB.time_plain(timer, dataclasses.replace(cfg, cache_len=1), batch,
                                                                 KernelConfig(block_v=bv, num_warps=w), np.random.default_rng(batch), 3, SMOKE)
        use_plain(CURRENT_PLAIN)
        for bv, w in fold_tiles:
            kc = KernelConfig(block_v=bv, num_warps=w, flush_every_step=True)
            row["fold"][f"{bv},{w}"] = DB.time_replay(timer, cfg, batch, kc, np.random.default_rng(0), 3, SMOKE, staggered=False)[2]
            row["fold_staggered"][f"{bv},{w}"] = DB.time_replay(timer, cfg, batch, kc, np.random.default_rng(0), 3, SMOKE, staggered=True)[2]
        nf, fl, cyc = DB.time_replay(timer, cfg, batch, reference_replay, np.random.default_rng(0), 3, SMOKE, staggered=False)
        stag = DB.time_replay(timer, cfg, batch, reference_replay, np.random.default_rng(0), 3, SMOKE, staggered=True)[2]
        row["replay_32_2_t2"] = dict(nonflush_us=nf, flush_us=fl, cycle_us=cyc, staggered_us=stag)
        print("small", json.dumps(row), flush=True); res["rows"].append(row)
    # plain kernel forms at larger batch
    for gate, dtype, batch in ([("gdn", jnp.float32, 4)] if SMOKE else [("gdn", jnp.float32, 32), ("gdn", jnp.float32, 128), ("gdn", jnp.float32, 512), ("gdn", jnp.bfloat16, 512)]):
        if time.time() - t0 > 480: print("time guard", flush=True); break
        cfg = shapes[gate].config(1, dtype)
        row = dict(gate=gate, state_dtype=jnp.dtype(dtype).name, batch=batch, plain={})
        for form, kernel in (("current", CURRENT_PLAIN), ("side_by_side", side_by_side_plain)):
            use_plain(kernel)
            row["plain"][form] = DB.time_plain(timer, cfg, batch, KernelConfig(block_v=16, num_warps=1), np.random.default_rng(batch), 3, SMOKE)
        use_plain(CURRENT_PLAIN)
        print("plain", json.dumps(row), flush=True); res["rows"].append(row)
        with open(out, "w") as f: json.dump(res, f, indent=1)
    with open(out, "w") as f: json.dump(res, f, indent=1)
    print(f"total {time.time() - t0:.0f} s")

if __name__ == "__main__":
    main(sys.argv[1])
