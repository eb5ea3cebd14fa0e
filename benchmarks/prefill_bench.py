"""Chunked prefill (`replayssm_jax.chunked`, UT transform) against the token scan
(`recurrent_reference`) on one GPU: wall time of a jitted prefill of T tokens, medians over
repeats after a warm-up, and the normwise error of the final state between the two.

  python benchmarks/prefill_bench.py --out prefill.json          # GPU
  python benchmarks/prefill_bench.py --smoke                     # CPU, tiny
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

import replayssm_jax as R
from replayssm_jax.chunked import chunked_gated_delta_rule


def _tokens(rng, batch, steps, hk, hv, d) -> R.Tokens:
    normal = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.float32)
    return R.Tokens(q=normal(batch, steps, hk, d), k=normal(batch, steps, hk, d), v=normal(batch, steps, hv, d),
                    g=jnp.asarray(-np.logaddexp(0, rng.normal(-1.5, 1, (batch, steps, hv))), jnp.float32),
                    beta=jnp.asarray(rng.uniform(0.05, 0.95, (batch, steps, hv)), jnp.float32))


def _median_ms(fn, args, repeats: int) -> float:
    jax.block_until_ready(fn(*args))  # compile and warm up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", default="512,4096")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--out", default="prefill_bench.json")
    p.add_argument("--smoke", action="store_true")
    args = p.parse_args(argv)
    hk, hv, d = (1, 2, 16) if args.smoke else (16, 32, 128)
    lengths = [64] if args.smoke else [int(x) for x in args.lengths.split(",")]
    rng = np.random.default_rng(0)
    scan = jax.jit(lambda t, s: R.recurrent_reference(t, s, use_qk_l2norm=True))
    chunked = jax.jit(lambda t, s: chunked_gated_delta_rule(t, s, use_qk_l2norm=True))
    rows = []
    for steps in lengths:
        tokens = _tokens(rng, args.batch, steps, hk, hv, d)
        s0 = jnp.asarray(0.1 * rng.normal(size=(args.batch, hv, d, d)), jnp.float32)
        _, want = scan(tokens, s0)
        _, got = chunked(tokens, s0)
        err = float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want))
        row = dict(batch=args.batch, steps=steps, num_k_heads=hk, num_v_heads=hv, head_dim=d,
                   scan_ms=_median_ms(scan, (tokens, s0), args.repeats),
                   chunked_ms=_median_ms(chunked, (tokens, s0), args.repeats), final_state_rel_err=err)
        row["speedup"] = row["scan_ms"] / row["chunked_ms"]
        print(json.dumps(row), flush=True)
        rows.append(row)
    meta = dict(device=str(jax.devices()[0].device_kind), jax=jax.__version__,
                date=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                timing="wall clock of the jitted call, median of repeats after a warm-up")
    with open(args.out, "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
    return rows


if __name__ == "__main__":
    main()
