"""Where a Mosaic GPU kernel's time goes: SM cycles of each named region (H200).

One step of a layer on the Mosaic backend with Mosaic's on-device profiler on
(`pallas_kernels.mosaic_gpu.build`: every kernel records its `jax.named_scope` regions per
warpgroup): `decode` (GDN or Mamba-2, `decode_step`) or `verify` (GDN, `verify_step`), every
row at the cursor that makes the step a non-flush or a flush one (`--step`), after a warm-up
step on other slots (so the profiled step finds no state in the L2 at B >= 128). For each
kernel the step launches it prints, per region, how often it ran, its median cycles and its
cycles per tile (all of its cycles over the kernel's `tile` regions: `pipeline.serve_tiles`
wraps each tile in one), and writes them as JSON. Regions nest (`tile` holds the others), and
an enclosing region's cycles include its inner ones'.

The profiler's buffers take shared memory (16 bytes a region per warpgroup, `--space`
regions; later ones are dropped) and its clock reads sit between the regions, so a profiled
step is slower than an unprofiled one and persistent CTAs may fit fewer per SM: read the
shares, time with `mosaic_bench.py` / `verify_bench.py`. `--smoke` runs tiny shapes in
interpret mode on CPU, which has no profiler (the tables are empty), so CI exercises the code.

  python benchmarks/mosaic_profile.py --kernel verify --dtype float32 --batch 512 --cache-len 16 --width 4
  python benchmarks/mosaic_profile.py --kernel decode --dtype bfloat16 --batch 512 \
      --params "programs=396,rebuild=3xtf32,readout=mma,auto_barriers=false,warpgroups=3,key_side=xla"
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, __file__.rsplit("/", 1)[0])
import decode_bench as db  # noqa: E402
import mosaic_bench as mb  # noqa: E402
import verify_bench as vb  # noqa: E402

import replayssm_jax as R  # noqa: E402
from pallas_kernels.mosaic_gpu.build import PROFILE_DIR_ENV, PROFILE_SPACE_ENV  # noqa: E402
from replayssm_jax.backends import mosaic_gpu  # noqa: E402
from replayssm_jax.plan import FlushPolicy  # noqa: E402

TILE_REGION = "tile"


def region_cycles(trace: dict) -> dict[str, list[int]]:
    """Each region's durations in SM cycles, from one Chrome trace of Mosaic's profiler
    (`traceEvents`: "B" / "E" events per `tid`, one per warpgroup, `ts` in clock cycles /
    1000 within a trace; nested regions close before the ones around them)."""
    open_regions: dict[int, list[dict]] = {}
    cycles: dict[str, list[int]] = {}
    for event in trace["traceEvents"]:
        stack = open_regions.setdefault(event["tid"], [])
        if event["ph"] == "B":
            stack.append(event)
            continue
        begin = stack.pop()
        if begin["name"] != event["name"]:
            raise ValueError(f"region {event['name']!r} closed while {begin['name']!r} was open (tid {event['tid']})")
        cycles.setdefault(event["name"], []).append(round((event["ts"] - begin["ts"]) * 1e3))
    return cycles


def region_table(cycles: dict[str, list[int]]) -> dict[str, dict]:
    """Per region: `count`, `median_cycles`, `total_cycles` and `cycles_per_tile` (its total
    over the count of `tile` regions; None without them)."""
    tiles = len(cycles.get(TILE_REGION, []))
    return {name: dict(count=len(c), median_cycles=statistics.median(c), total_cycles=sum(c),
                       cycles_per_tile=sum(c) / tiles if tiles else None)
            for name, c in sorted(cycles.items(), key=lambda item: -sum(item[1]))}


def layer_config(args) -> R.ReplayConfig:
    dtype = jnp.dtype(args.dtype)
    if args.gate == "mamba2":
        return mb.mamba2_config(args.smoke, args.cache_len, dtype, args.mamba2_shape)
    return mb.gdn_config(args.smoke, args.cache_len, dtype, args.value_heads)


def step_fn(args, cfg: R.ReplayConfig, kernel_params):
    """jit: one step of the layer on "mosaic_gpu" `(state, slots, inputs) -> state`."""
    if args.kernel == "verify":
        def step(state, slots, window):
            return R.verify_step(state, window, slots, backend="mosaic_gpu", kernel_params=kernel_params,
                                 interpret=args.smoke, **vb.verify_options(vb.mamba2_heads(cfg)))[1]
    else:
        def step(state, slots, token):
            return R.decode_step(state, token, slots, backend="mosaic_gpu", policy=FlushPolicy.NATURAL,
                                 kernel_params=kernel_params, **mb.step_options(cfg))[1]
    return jax.jit(step)


def kernel_params_of(args, cfg: R.ReplayConfig, batch: int):
    """The params the profiled kernel runs with: `--params` as `mosaic_bench.py`'s variants
    (verify: as `verify_bench.py`'s `mosaic_gpu:` entries, `programs=fit` its persistent
    CTAs), or the backend's defaults for the benchmarks' bf16 tokens."""
    if args.kernel == "verify":
        width = min(args.width, cfg.cache_len)
        if args.params != "default":
            return vb.backend_params("mosaic_gpu:" + args.params.replace(",", "+"), cfg, batch, width)[1]
        return mosaic_gpu.verify_default_params(cfg, batch, width, jnp.bfloat16)
    return mb.effective_params(args.params, cfg, batch)


def cursors(args, cfg: R.ReplayConfig) -> int:
    """Every slot's cursor: a full history that the step appends to (non-flush) or folds."""
    L = cfg.cache_len
    if args.kernel == "verify":
        width = min(args.width, L)
        return L - width if args.step == "nonflush" else L
    return L - 2 if args.step == "nonflush" else L - 1


def traces(folder: Path) -> dict[str, dict]:
    """The profiler's traces in `folder` by file name (one per kernel launch), removed."""
    out = {}
    for path in sorted(folder.glob("*-trace.json")):
        out[path.name] = json.loads(path.read_text())
        path.unlink()
    return out


@contextlib.contextmanager
def profiler_on(folder: Path, space: int):
    """The profiler's environment for the kernels built inside (`build.profile_settings`),
    restored after: builds are cached, so only kernels first built here record regions."""
    saved = {name: os.environ.get(name) for name in (PROFILE_DIR_ENV, PROFILE_SPACE_ENV)}
    os.environ[PROFILE_DIR_ENV], os.environ[PROFILE_SPACE_ENV] = str(folder), str(space)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name)
            else:
                os.environ[name] = value


def profile(args) -> dict:
    folder = Path(args.trace_dir or tempfile.mkdtemp(prefix="mosaic_profile_"))
    folder.mkdir(parents=True, exist_ok=True)
    with profiler_on(folder, args.space):
        return profile_in(args, folder)


def profile_in(args, folder: Path) -> dict:
    cfg = layer_config(args)
    batch = 2 if args.smoke else args.batch
    kernel_params = kernel_params_of(args, cfg, batch)
    rng = np.random.default_rng(0)
    num_slots = 2 * batch
    sets = rng.permutation(num_slots).reshape(2, batch).astype(np.int32)
    state = db.random_pool(cfg, num_slots, jax.random.key(1), np.full(num_slots, cursors(args, cfg)))
    inputs = (vb.random_window(cfg, batch, min(args.width, cfg.cache_len), jax.random.key(2))
              if args.kernel == "verify" else db.random_token(cfg, batch, jax.random.key(2)))
    fn = step_fn(args, cfg, kernel_params)
    jax.block_until_ready(fn(state, jnp.asarray(sets[0]), inputs))  # compile, warm up on other slots
    jax.effects_barrier()
    traces(folder)
    jax.block_until_ready(fn(state, jnp.asarray(sets[1]), inputs))
    jax.effects_barrier()  # the profiler writes its traces from a host callback
    kernels = {name: region_table(region_cycles(trace)) for name, trace in traces(folder).items()}
    return dict(meta=dict(kernel=args.kernel, gate=args.gate, dtype=args.dtype, batch=batch, cache_len=cfg.cache_len,
                          width=args.width if args.kernel == "verify" else None, step=args.step, params=args.params,
                          kernel_params=repr(kernel_params), space=args.space, smoke=args.smoke,
                          versions=db.versions()),
                kernels=kernels)


def print_tables(result: dict) -> None:
    meta = result["meta"]
    print(f"{meta['kernel']} {meta['gate']} {meta['dtype']} B={meta['batch']} L={meta['cache_len']} "
          f"{meta['step']} params={meta['params']}")
    if not result["kernels"]:
        print("  no trace written (interpret mode has no profiler)")
    for name, table in result["kernels"].items():
        print(f"  {name}")
        print(f"    {'region':<18}{'count':>9}{'median cycles':>15}{'cycles per tile':>17}")
        for region, row in table.items():
            per_tile = "-" if row["cycles_per_tile"] is None else f"{row['cycles_per_tile']:.0f}"
            print(f"    {region:<18}{row['count']:>9}{row['median_cycles']:>15.0f}{per_tile:>17}")


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kernel", default="decode", choices=("decode", "verify"))
    p.add_argument("--gate", default="gdn", choices=("gdn", "mamba2"), help="verify: gdn only")
    p.add_argument("--dtype", default="float32", help="state dtype")
    p.add_argument("--batch", type=int, default=512)
    p.add_argument("--cache-len", type=int, default=16)
    p.add_argument("--width", type=int, default=4, help="verify: the window's T")
    p.add_argument("--value-heads", type=int, default=32, help="GDN H_v (H_k = 16)")
    p.add_argument("--mamba2-shape", default="nemotron-h-8b", choices=tuple(mb.MAMBA2_SHAPES))
    p.add_argument("--params", default="default",
                   help="`default` or comma-separated kernel params as mosaic_bench's --variants entries")
    p.add_argument("--step", default="nonflush", choices=("nonflush", "flush"))
    p.add_argument("--space", type=int, default=128,
                   help="regions recorded per warpgroup at most (16 bytes of shared memory each: the default "
                        "keeps two fp32 verify CTAs or three bf16 decode warpgroups per SM; a persistent program "
                        "records its first tiles)")
    p.add_argument("--trace-dir", default="", help="where the profiler writes its traces (default: a temp dir)")
    p.add_argument("--out", default="mosaic_profile.json")
    p.add_argument("--smoke", action="store_true", help="tiny shapes, interpret mode (CPU; no profiler)")
    args = p.parse_args(argv)
    if args.kernel == "verify" and args.gate != "gdn":
        p.error("--kernel verify profiles the GDN verify kernel only")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    result = profile(args)
    print_tables(result)
    Path(args.out).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
