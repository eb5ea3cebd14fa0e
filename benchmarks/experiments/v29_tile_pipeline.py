"""v29 (H200): why does the grouped kernel's non-flush step read its checkpoint at ~0.74 of
the copy-bandwidth floor where the plain kernel reaches 0.93?

A program of the B > 256 entry (BV 32, 4 warps, T = 8, W = 64) walks its 8 tiles in a
`fori_loop`: a tile's chunks are loaded, reduced (row-sum shuffles, 3-4 layout conversions
through shared memory, each a barrier of the 4 warps), and only then the next tile's loads
issue; 5 programs per SM (96 registers, v25f) hold at most ~80 KB in flight and nothing
while they reduce. The plain kernel runs 12 one-warp programs per SM, each loads its whole
`[16, d_k]` tile at once and has no barrier (PTX: 0 `bar.sync` against the grouped
kernel's 51). Variants, GDN fp32 L = 16, sync and staggered cursors, at B = 512, 128, 32:

  head         the grouped kernel of commit BASE (main's) on the table's entry
  table        BASE's kernel with HOIST (GDN's cache weights `e^G, w, w K k, w K q`
               computed once per value head of a program instead of once per tile), on
               the entry
  unroll       + the tile loops unrolled at trace time (ptxas may issue tile p+1's loads early)
  prefetch     + tile p+1's operands loaded before tile p's work, carried through the loop
  nf_only      + the flush branch removed (diagnostic: the non-flush step at the registers it
               needs alone; its "flush" step is a non-flush step at cursor 15, so its cycle
               figures mean nothing)
  w1_t16       table's kernel on the plain kernel's tile: BV 16, one warp, `[16, 16]`
               chunks, T = 16 (a program per row and key head, as at T = 8), the entry's
               other fields
  w1_t8        the same, T = 8 (a program per row and value head)
  w1_t4        the same, T = 4
  w4_bv16      BV 16, 4 warps, T = 16, W = 32

(nf_head, BASE's kernel without its flush branch, is v29b's) each variant's state after one
cycle checked against `head` (< 1e-5 relative; nf_only not),
plus a read-only bandwidth (an XLA row sum over 2 GiB) beside the copy bandwidth. Registers
of one flush step per variant (GPU build), Nsight Compute:

  PYTHONPATH=$PWD python benchmarks/experiments/v29_tile_pipeline.py time $OUT/v29.json
  ncu --clock-control none --kernel-name regex:replayssm --metrics launch__registers_per_thread \\
      python benchmarks/experiments/v29_tile_pipeline.py regs [variant ...]

Predictions (B = 512 unless said):
  table     non-flush -1 to -3% against head (fewer instructions per tile), flush within 1%.
  unroll    within 3% (the register budget leaves ptxas no room to hoist a 32-register tile).
  prefetch  128 registers (4 programs per SM) and non-flush -5 to -10% (a tile's loads always
            in flight), flush +5%.
  nf_only   if registers bound the non-flush step: 10-15% faster than table with fewer
            registers; if the GPU build already holds 96 for the full kernel, within 3%.
  w1_*      CPU ptxas 216-238 registers (8-9 programs per SM, ~70 KB in flight, 2-4
            barriers): non-flush within +-10% of table; T = 16 / 8 best at B = 512, T = 4
            at B = 128 (waves); flush slower (one warp replays a `[16, d_k]` tile per entry).
  w4_bv16   CPU ptxas 118 registers: 8 KB tiles, twice the barriers per byte: +5-15%.

Outcome (2026-12-01; raw/h200_2026-12-01_v29_*; copy 4285 GB/s, read 4623; B = 512 sync
cycle / non-flush / flush, staggered, us): head 384.5 / 338.2 / 1078.9, 383.4; table 397.2 /
348.3 / 1131.0, 396.0 (B = 128: 106.9 / 95.9 / 271.2 against head's 107.4 / 92.9 / 325.5);
unroll 397.3 / 346.8 / 1154.4; prefetch 487.3 / 415.0 / 1570.4; nf_only non-flush 334.5;
w1_t16 / w1_t8 / w1_t4 414.3 / 407.2 / 412.6 (non-flush 356-363; at B = 128 w1_t8 105.1 /
93.5 / 278.8, staggered 112.1 against head's 106.4); w4_bv16 449.3. Every prediction but
unroll's was wrong: the hoist costs the non-flush step 3% (and the T = 8 flush 5%) while it
takes 17% off the T = 4 flush; nothing here is kept. The timing stopped at its 400 s limit
before B = 32's rows, and Nsight Compute crashed after two launches (no register counts);
v29b measured the flush branch's cost on head itself.
"""

import dataclasses, os, statistics, subprocess, sys, time, types, warnings
SMOKE = bool(os.environ.get("SMOKE"))
import jax, jax.numpy as jnp, numpy as np
warnings.filterwarnings("ignore", message="The Pallas Triton backend is deprecated")
sys.path.insert(0, "benchmarks")
import decode_bench as DB
from pallas_kernels import ops
from replayssm_jax.decode import step_plan

F32 = jnp.dtype("float32")
SOURCE = "pallas_kernels/replay_decode_grouped.py"
BASE = "c347211"  # the grouped kernel as committed then (main's kernel since: unchanged)
# GDN's cache weights once per value head of the program, each head's tiles in a loop of
# their own ("table" below; applied to BASE's source it is the tree that ran, docstrings aside).
HOIST = [
    ("                else:\n"
     "                    g_c = plgpu.load(gcache_ref.at[slot, vh, entries], mask=live, other=0.0)\n",
     ""),
    ("            def operands():\n",
     "            def operands():\n                g_c = None\n"),
    ("        if not spec.per_channel_gate:\n"
     "            kk, kq = common.row_sum(k_c, ks), common.row_sum(k_c, qs)\n\n"
     "        def body(p, carry):\n",
     "        def head_weights(h):\n"
     "            vh = tile_of(h * tiles_per_head)[0]\n"
     "            g_c = plgpu.load(gcache_ref.at[slot, vh, entries], mask=live, other=0.0)\n"
     "            total = jnp.sum(g_c, axis=0)\n"
     "            weights = jnp.where(live, jnp.exp(total - jnp.cumsum(g_c, axis=0)), 0.0)\n"
     "            return jnp.exp(total), weights, (weights * kk)[:, None], (weights * kq)[:, None]\n\n"
     "        if spec.per_channel_gate:\n"
     "            heads = [None]\n"
     "        else:\n"
     "            kk, kq = common.row_sum(k_c, ks), common.row_sum(k_c, qs)\n"
     "            heads = [head_weights(h) for h in range(max(1, tiles_per_program // tiles_per_head))]\n\n"
     "        def body(weights_of_head, p, carry):\n"),
    ("                total = jnp.sum(g_c, axis=0)\n"
     "                weights = jnp.where(live, jnp.exp(total - jnp.cumsum(g_c, axis=0)), 0.0)\n"
     "                decay_c = jnp.exp(total)\n"
     "                s_k = alpha * (decay_c * common.row_sum(s_c, ks)\n"
     "                               + jnp.sum(u_c * (weights * kk)[:, None], axis=0))\n"
     "                s_q = alpha * (decay_c * common.row_sum(s_c, qs)\n"
     "                               + jnp.sum(u_c * (weights * kq)[:, None], axis=0))\n",
     "                decay_c, weights, w_kk, w_kq = weights_of_head\n"
     "                s_k = alpha * (decay_c * common.row_sum(s_c, ks) + jnp.sum(u_c * w_kk, axis=0))\n"
     "                s_q = alpha * (decay_c * common.row_sum(s_c, qs) + jnp.sum(u_c * w_kq, axis=0))\n"),
    ("        jax.lax.fori_loop(0, tiles_per_program, body, 0)\n\n        @pl.when((mode",
     "        tiles_per_loop = tiles_per_program // len(heads)\n"
     "        for h, weights_of_head in enumerate(heads):\n"
     "            jax.lax.fori_loop(h * tiles_per_loop, (h + 1) * tiles_per_loop,\n"
     "                              functools.partial(body, weights_of_head), 0)\n\n        @pl.when((mode"),
]
LOOPS = ("            jax.lax.fori_loop(h * tiles_per_loop, (h + 1) * tiles_per_loop,\n"
         "                              functools.partial(body, weights_of_head), 0)\n")
UNROLL = [(LOOPS, "            for p in range(h * tiles_per_loop, (h + 1) * tiles_per_loop):\n"
                  "                body(weights_of_head, p, 0)\n")]
PREFETCH = [
    ("            (g_c, u_c, s_c), v, (g, beta) = load_tile(p, b_tile)\n",
     "            (g_c, u_c, s_c), v, (g, beta) = carry\n"
     "            ahead = load_tile(jnp.minimum(p + 1, tiles_per_program - 1), tile_row())\n"),
    ("            return carry\n\n        tiles_per_loop",
     "            return ahead\n\n        tiles_per_loop"),
    (LOOPS, LOOPS.replace("weights_of_head), 0)",
                          "weights_of_head),\n"
                          "                              load_tile(h * tiles_per_loop, tile_row()))")),
]
NF_ONLY = [("            @pl.when(mode == common.MODE_FLUSH)\n            def _flush():",
            "            def _flush():  # never called: the flush compiled out")]
SOURCES = {"head": [], "table": HOIST, "unroll": HOIST + UNROLL, "prefetch": HOIST + PREFETCH,
           "nf_only": HOIST + NF_ONLY, "nf_head": NF_ONLY}
TILES = {"w1_t16": dict(block_v=16, num_warps=1, tiles_per_program=16, column_chunk=16),
         "w1_t8": dict(block_v=16, num_warps=1, tiles_per_program=8, column_chunk=16),
         "w1_t4": dict(block_v=16, num_warps=1, tiles_per_program=4, column_chunk=16),
         "w4_bv16": dict(block_v=16, num_warps=4, tiles_per_program=16, column_chunk=32)}
VARIANTS = ["head", "table", "unroll", "prefetch", "nf_only", *TILES]  # as run


def kernel_source(name):
    """The grouped kernel's source for a variant: BASE's with the variant's edits."""
    src = subprocess.run(["git", "show", f"{BASE}:{SOURCE}"], capture_output=True, text=True,
                         check=True).stdout
    for old, new in SOURCES.get(name, HOIST):  # the tile variants ran on "table"'s kernel
        assert src.count(old) == 1, (name, old)
        src = src.replace(old, new)
    return src


def use(name, entry):
    """Install the variant's kernel; return its KernelConfig."""
    module = types.ModuleType(f"grouped_{name}")
    exec(compile(kernel_source(name), f"{SOURCE}[{name}]", "exec"), module.__dict__)
    ops.replay_decode_grouped = module.replay_decode_grouped
    DB.replay_cycle_fn.cache_clear()
    return dataclasses.replace(entry, **TILES.get(name, {}))


def read_bandwidth_GBps(num_bytes=2 << 30):
    x = jax.random.normal(jax.random.key(0), (num_bytes // 4096, 1024), jnp.float32)
    fn = jax.jit(lambda a: jnp.sum(a, axis=1))
    from jax.experimental.mosaic.gpu import profiler
    _, runs = profiler.measure(fn, aggregate=True, iterations=10)(x)
    return num_bytes / (statistics.median(runs) * 1e-3) / 1e9


def check(shape, batch, entry):
    """Every variant but nf_only against head: the pool after one sync cycle (appends and
    flush), max relative error over its arrays."""
    cfg = shape.config(16, F32)
    out = {name: DB.pool_after_cycle(cfg, batch, use(name, entry), SMOKE) for name in VARIANTS if name != "nf_only"}
    errs = {f"err_{name}": max(DB.rel_err(a, b) for a, b in zip(leaves, out["head"]))
            for name, leaves in out.items() if name != "head"}
    print("check", batch, errs, flush=True)
    assert max(errs.values()) < 1e-5, errs
    return errs


def timing(out):
    t0 = time.time(); timer = DB.Timer(SMOKE); res = dict(meta=DB.versions(), rows=[])
    shape = DB.Shape(2, 4, 32) if SMOKE else DB.Shape()
    if not SMOKE:
        res["copy_GBps"] = DB.copy_bandwidth_GBps(timer)
        res["read_GBps"] = read_bandwidth_GBps()
        print(f"copy {res['copy_GBps']:.0f} GB/s, read {res['read_GBps']:.0f} GB/s", flush=True)
    for b in (512, 128, 32) if not SMOKE else (512,):
        bb = 2 if SMOKE else b
        cfg = shape.config(16, F32)
        entry = ops.default_kernel_config(b, "replay", "gdn", F32)
        if SMOKE:
            entry = dataclasses.replace(entry, block_v=8, column_chunk=0)
        row = dict(batch=b, entry=dataclasses.asdict(entry), **check(shape, bb, entry))
        row["plain_us"] = DB.time_plain(timer, cfg, bb, ops.default_kernel_config(b, "plain", "gdn", F32),
                                        np.random.default_rng(b), 5, SMOKE)
        for name in VARIANTS:
            row.update(DB.time_both_cursors(timer, cfg, bb, name, use(name, entry), b, SMOKE))
        DB.record_row(res, row, out)
    print(f"total {time.time() - t0:.0f} s")


def registers(names, batches=(512, 128)):
    """One flush step (every cursor at L - 1) per (batch, variant), for Nsight Compute."""
    cfg = DB.Shape().config(16, F32)
    index = 0
    for b in batches:
        entry = ops.default_kernel_config(b, "replay", "gdn", F32)
        n = b + 3
        slots = jnp.asarray(np.random.default_rng(b).permutation(n)[:b], jnp.int32)
        pool = DB.random_pool(cfg, n, jax.random.key(1), np.full(n, 15))
        token = DB.random_token(cfg, b, jax.random.key(2))
        for name in names:
            kc = use(name, entry)

            def step(st, tok):
                plan, _ = step_plan(cfg, st.write_pos, slots, None, backend="pallas", kernel_config=kc)
                return ops.pallas_layer_step(st, *tok, plan, use_qk_l2norm=True, scale=None,
                                             kernel_config=kc, interpret=False)[0]

            jax.block_until_ready(jax.jit(step)(pool, token))
            print(f"launch {index}: B={b} {name}", flush=True)
            index += 1


if __name__ == "__main__":
    registers(sys.argv[2:] or VARIANTS) if sys.argv[1] == "regs" else timing(sys.argv[2])
