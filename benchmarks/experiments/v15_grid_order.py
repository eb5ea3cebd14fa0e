"""v15 experiment (H200): launch grids with the row index slowest instead of fastest.

Pallas-Triton launches grid axis 0 as CUDA's x, the fastest-varying block index. The
kernels' grids start with the row (B, ...), so blocks that run at the same time read the
same (head, tile) of B different, scattered slots: 8 KB pieces at the plain kernel's
BV 16. Reversed, `(d_v / BV, H_v, B)`, neighbouring blocks read neighbouring tiles of one
slot, the whole 2 MiB slot as one stream. Prediction: plain kernel 2-5% faster at
B = 512 (588 -> 560-575 us), the grouped replay kernel (one program already reads 128 KB
contiguous) and the folding kernel within 2%. The plain kernel over `[BV, 16]` column
chunks (v14) is timed reversed too.

  PYTHONPATH=$PWD python benchmarks/experiments/v15_grid_order.py $OUT/v15.json   # H200
`SMOKE=1` runs it on a CPU in interpret mode.
"""

import contextlib, functools, json, os, sys, time, warnings
SMOKE = bool(os.environ.get("SMOKE"))
import jax, jax.numpy as jnp, numpy as np
warnings.filterwarnings("ignore", message="The Pallas Triton backend is deprecated")
sys.path.insert(0, "benchmarks"); sys.path.insert(0, "benchmarks/experiments")
import decode_bench as DB
import v14_column_chunks as V14
from jax.experimental import pallas as pl
from pallas_kernels import common, plain_decode as PD
from pallas_kernels.ops import default_kernel_config, pallas_layer_step
from replayssm_jax.decode import step_plan

ORIGINAL_CALL = common.decode_call
ORIGINAL_PROGRAM_ID = pl.program_id


def reversed_decode_call(kernel, *, grid, **kw):
    """`common.decode_call` with the grid reversed; the kernel sees its axes as before."""
    n = len(grid)

    def wrapped(*refs):
        pl.program_id = lambda axis: ORIGINAL_PROGRAM_ID(n - 1 - axis)
        try:
            kernel(*refs)
        finally:
            pl.program_id = ORIGINAL_PROGRAM_ID

    return ORIGINAL_CALL(wrapped, grid=tuple(reversed(grid)), **kw)


def use(order, plain_kernel=V14.CURRENT):
    common.decode_call = reversed_decode_call if order == "reversed" else ORIGINAL_CALL
    PD._plain_kernel = plain_kernel
    DB.plain_steps_fn.cache_clear(); DB.time_plain_cached.cache_clear(); DB.replay_cycle_fn.cache_clear()
    jax.clear_caches()


PLAIN_VARIANTS = {
    "current": ("current", V14.CURRENT),
    "reversed": ("reversed", V14.CURRENT),
    "reversed_chunk16": ("reversed", functools.partial(V14.chunked_plain, width=16)),
}


def check(cfg, batch):
    """Max |difference| of y and state between grid orders: plain and replay, one step."""
    from pallas_kernels.plain_decode import plain_decode
    rng = np.random.default_rng(0)
    n = 2 * batch
    state = DB.random_pool(cfg, n, jax.random.key(3), rng.integers(0, cfg.cache_len, n))
    token = DB.random_token(cfg, batch, jax.random.key(4))
    slots = jnp.asarray(rng.permutation(n)[:batch].astype(np.int32))
    kc = default_kernel_config(batch, "replay")

    def replay_step(st, t, s):
        plan, _ = step_plan(cfg, st.write_pos, s, None, backend="pallas", kernel_config=kc)
        y, st = pallas_layer_step(st, *t, plan, use_qk_l2norm=True, scale=None, kernel_config=kc, interpret=SMOKE)
        return y, st.checkpoint, st.u_cache

    def plain_step(st, t, s):
        return plain_decode(st.checkpoint, *t, s, s >= 0, use_qk_l2norm=True,
                            config=default_kernel_config(batch, "plain"), interpret=SMOKE)

    outs = {}
    for order in ("current", "reversed"):
        use(order)
        outs[order] = [np.asarray(x.astype(jnp.float32)) for f in (plain_step, replay_step)
                       for x in jax.jit(f)(state, token, slots)]
    use("current")
    return max(float(np.max(np.abs(a - b))) for a, b in zip(outs["current"], outs["reversed"]))


def main(out):
    t0 = time.time(); timer = DB.Timer(SMOKE); res = dict(meta=DB.versions(), rows=[])
    bw = res["meta"]["copy_bandwidth_GBps"] = 0.0 if SMOKE else DB.copy_bandwidth_GBps(timer)
    print(res["meta"], flush=True)
    shape = DB.Shape(2, 4, 32) if SMOKE else DB.Shape()
    res["check_max_abs_diff"] = {b: check(shape.config(16, jnp.dtype("float32")), b) for b in (3, 9)}
    print("check", res["check_max_abs_diff"], flush=True)
    plain_cases = [("float32", 4)] if SMOKE else [("float32", b) for b in (512, 128, 32, 8, 1)] + [("bfloat16", 512)]
    for dtype, batch in plain_cases:
        cfg = shape.config(1, jnp.dtype(dtype)); kc = default_kernel_config(batch, "plain")
        row = dict(kernel="plain", state_dtype=dtype, batch=batch, block_v=kc.block_v, num_warps=kc.num_warps)
        for name, (order, kernel) in PLAIN_VARIANTS.items():
            if time.time() - t0 > 400: print("time guard", flush=True); break
            use(order, kernel)
            row[name] = DB.time_plain(timer, cfg, batch, kc, np.random.default_rng(batch), 5, SMOKE)
        use("current")
        print("row", json.dumps(row), flush=True); res["rows"].append(row)
    replay_cases = [4] if SMOKE else [512, 128, 8, 4, 1]
    for batch in replay_cases:
        cfg = shape.config(16, jnp.dtype("float32")); kc = default_kernel_config(batch, "replay")
        row = dict(kernel="fold" if kc.flush_every_step else "replay", batch=batch, block_v=kc.block_v,
                   num_warps=kc.num_warps, tiles_per_program=kc.tiles_per_program)
        for order in ("current", "reversed"):
            if time.time() - t0 > 480: print("time guard", flush=True); break
            use(order)
            nf, fl, cyc = DB.time_replay(timer, cfg, batch, kc, np.random.default_rng(batch), 3, SMOKE, False)
            row[order] = dict(nonflush=nf, flush=fl, cycle=cyc)
        use("current")
        print("row", json.dumps(row), flush=True); res["rows"].append(row)
        with open(out, "w") as f: json.dump(res, f, indent=1)
    with open(out, "w") as f: json.dump(res, f, indent=1)
    print(f"total {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main(sys.argv[1])
