"""v28 (H200): launch the replay kernels' programs costliest rows first.

With staggered cursors (rows at random phases: a serving engine's case) each step mixes
~B/L flushing rows into a launch of appending ones, and the replay cycle lost to the plain
kernel at B = 16-64 (GDN fp32 L = 16, v23: 0.86 / 0.81 / 0.94x; bf16 state B = 32-128:
0.59-0.84x) although the same rows with synchronised cursors run 1.11-1.23x. A flush
program runs ~3x as long as an append program; the grid issues blocks in index order, so
flush programs that land late in the launch finish after every other block (at B = 32,
T = 4: 1024 programs in ~1.6 waves; staggered steps 44.8 us against a 26.9 us non-flush
step and a sync cycle of 30.1).

`StepPlan.launch_order` (flushing rows first, then appending rows, each by descending
cursor, padding last) maps the grid's row axis to rows; with the row index slowest
(`rows_outermost`) a row's programs are issued together, so the launch starts with every
flush program. Variants, each with synchronised and staggered cursors, at the table's
grouped entries (GDN fp32 B = 8-512, bf16 state B = 16-512, L = 16):

  table           the entry as it is (row index fastest), with the launch order
  no_order        ... rows in order (the identity instead of the launch order)
  outer           rows outermost, with the launch order
  outer_no_order  rows outermost, rows in order

and, with OLD=1 (run in a tree of the previous kernels on PYTHONPATH), the entry as the
previous commit launched it. Also: every kernel of one staggered cycle (the plan's XLA ops
beside the replay kernel), median per name, at B = 16 and 512.

Prediction: staggered cursors with "outer" near the sync cycle: B = 16 22.7 -> <= 19 us,
B = 32 44.8 -> ~33, B = 64 74.7 -> ~60, B = 128 118.8 -> ~108, B = 512 423.6 -> ~392;
bf16 B = 32 35.6 -> ~25, B = 128 90.4 -> ~80. "table" (order, row index fastest) about
half of that gain. Sync cursors within 2% of the previous kernels in every variant; the
sort of B keys ~2-3 us per forward pass.

  PYTHONPATH=$PWD python benchmarks/experiments/v28_launch_order.py $OUT/v28.json
  OLD=1 PYTHONPATH=_ab_old:$PWD python benchmarks/experiments/v28_launch_order.py $OUT/v28_old.json

(`_ab_old`: `git archive` of the previous commit's `pallas_kernels` and `replayssm_jax`.) This
ran on the kernels before `KernelConfig.launch_order` existed: every replay kernel then read
its row from `row_ref[launch]`, in the plan's order or, patched here, in row order. Today's
kernels read it only with `launch_order` (v28b), so rerunning this measures something else.

Outcome: staggered cursors as predicted from B = 128 with "outer" (B = 512 422.7 -> 383.0,
B = 256 219.7 -> 205.1, B = 128 119.5 -> 106.0; bf16 B = 32 36.3 -> 26.3, B = 512 301.2 ->
272.5; B = 16 22.5 -> 20.7), little with the row index fastest ("table": B = 512 415.0).
But the loaded row cost the sync step even in row order ("no_order" against OLD): the
(T = 4, W = 32) flush 78.9 -> 140.2 us at B = 32 and 148.8 -> 266.6 at B = 64 (so B = 32-64
lost staggered too: 73.8 / 91.8), the T = 4 non-flush step +7-18% (fp32 B = 128-256, bf16
B = 64-128), B = 6-16 +2-5%. The sort: 1.7 us at B = 16, 5.1 us at B = 512, once per step
here (once per forward pass in a model).
"""

import dataclasses, json, os, statistics, sys, time, warnings
SMOKE = bool(os.environ.get("SMOKE"))
OLD = bool(os.environ.get("OLD"))
import jax, jax.numpy as jnp, numpy as np
warnings.filterwarnings("ignore", message="The Pallas Triton backend is deprecated")
sys.path.insert(0, "benchmarks")
import decode_bench as DB
from pallas_kernels import ops
from replayssm_jax import replay

F32, BF16 = jnp.dtype("float32"), jnp.dtype("bfloat16")
ORDER = getattr(replay, "launch_order", None)


def in_row_order(valid, pos, flush, cache_len):
    return jnp.arange(valid.shape[0], dtype=jnp.int32)


def use_order(on: bool):
    replay.launch_order = ORDER if on else in_row_order
    DB.replay_cycle_fn.cache_clear()


VARIANTS = {"table": (False, True), "no_order": (False, False),
            "outer": (True, True), "outer_no_order": (True, False)}


def all_kernels(timer, cfg, batch, kc, staggered):
    """Median µs per kernel name over every kernel of 3 cycles, and launches per cycle."""
    from jax.experimental.mosaic.gpu import profiler
    rng = np.random.default_rng(batch)
    sets, num_slots = DB.slot_sets(batch, cfg.state_bytes_per_slot(), rng, SMOKE)
    cursors = rng.integers(0, cfg.cache_len, num_slots) if staggered else np.zeros(num_slots)
    pool = DB.random_pool(cfg, num_slots, jax.random.key(1), cursors)
    token = DB.random_token(cfg, batch, jax.random.key(2))
    fn = DB.replay_cycle_fn(cfg, kc, interpret=False)
    _, runs = profiler.measure(fn, aggregate=False, iterations=3)(pool, jnp.asarray(sets), token)
    names = {}
    for name, ms in runs[-1]:
        names.setdefault(name, []).append(ms * 1e3)
    return {n: dict(median_us=statistics.median(t), per_cycle=len(t)) for n, t in names.items()}


def main(out):
    t0 = time.time(); timer = DB.Timer(SMOKE); res = dict(meta=DB.versions(), rows=[], kernels=[])
    res["meta"]["tree"] = "old" if OLD else "new"
    gdn = DB.Shape(2, 4, 32) if SMOKE else DB.Shape()
    cases = [(F32, b) for b in (8, 16, 32, 64, 128, 256, 512)] + [(BF16, b) for b in (16, 32, 64, 128, 512)]
    variants = {"old_table": None} if OLD else VARIANTS
    for dt, b in (cases[:2] if SMOKE else cases):
        bb = 2 if SMOKE else b
        cfg = gdn.config(16, dt)
        plain = ops.default_kernel_config(b, "plain", "gdn", dt)
        entry = ops.default_kernel_config(b, "replay", "gdn", dt)
        row = dict(dtype=dt.name, batch=b, entry=dataclasses.asdict(entry),
                   plain_us=DB.time_plain(timer, cfg, bb, plain, np.random.default_rng(b), 5, SMOKE))
        for name, setting in variants.items():
            kc = entry
            if setting is not None:
                outer, order = setting
                kc = dataclasses.replace(entry, rows_outermost=outer)
                use_order(order)
            row.update(DB.time_both_cursors(timer, cfg, bb, name, kc, b, SMOKE))
        DB.record_row(res, row, out)
    if not SMOKE and not OLD:
        use_order(True)
        for dt, b in ((F32, 16), (F32, 512)):
            cfg = gdn.config(16, dt)
            kc = dataclasses.replace(ops.default_kernel_config(b, "replay", "gdn", dt), rows_outermost=True)
            kernels = all_kernels(timer, cfg, b, kc, staggered=True)
            print("kernels", b, json.dumps(kernels), flush=True)
            res["kernels"].append(dict(dtype=dt.name, batch=b, kernels=kernels))
    with open(out, "w") as f: json.dump(res, f, indent=1)
    print(f"total {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main(sys.argv[1])
