"""Registers per thread (and PTX shuffle / barrier counts) of each decode kernel
configuration on an H200, without a GPU.

Occupancy decides these kernels' bandwidth (benchmarks/NOTES.md, v6): a kernel whose
programs hold more registers keeps fewer of them, and fewer bytes, in flight per SM. This
tool lowers a decode step for an abstract H200 (as `tests/test_pallas_kernels.py` does),
takes the Triton IR that Pallas hands to XLA, compiles it with the `triton` package for
sm_90a (the same Triton release as the GPU image, 3.6.0) and prints what `ptxas -v` reports.

The GPU build runs XLA's own Triton pipeline and CUDA's ptxas, and its counts can differ
by more than the occupancy steps (Nsight Compute's launch__registers_per_thread on the
H200, v24c/v24d, against this tool): the B > 256 grouped entry 96 vs 128 (5 programs per SM,
not 4), the B = 6-16 entry 128 vs 163, the folding kernel 62 vs 61 (BV 4) and 96 vs 89
(BV 8); v24's two-loop rebuild moved the GPU build from 96 to 128 while this tool saw 128
for both; benchmarks/NOTES.md (Occupancy) lists both counts for every table entry (v25f:
off by -45 to +34). Read the counts here as a static view of one kernel's variants, not as
the occupancy the GPU runs at; for that, on the GPU, every table launch at once:
`ncu --kernel-name regex:'replayssm|plain_decode' --metrics launch__registers_per_thread
python benchmarks/experiments/v25f_registers.py`.

Needs the `triton` extra (`pip install -e ".[triton]"`); runs on a CPU:

  python benchmarks/kernel_registers.py                     # the package's tile table
  python benchmarks/kernel_registers.py --gate kda --cache-len 32 --state-dtype bfloat16
  python benchmarks/kernel_registers.py --config 32,4,16,8,4 --config 16,4,16,4,1
  python benchmarks/kernel_registers.py --config 16,1,16,0,1,1   # the folding kernel
  python benchmarks/kernel_registers.py --config 32,4,16,8,2,0,32  # W = 32 column chunks
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import subprocess
import tempfile
import warnings

import jax
import jax.numpy as jnp

warnings.filterwarnings("ignore", message="The Pallas Triton backend is deprecated")

from jax._src.pallas.triton import pallas_call_registration  # noqa: E402

from pallas_kernels import ops  # noqa: E402
from pallas_kernels.common import KernelConfig  # noqa: E402
from replayssm_jax import replay  # noqa: E402
from replayssm_jax.config import ReplayConfig  # noqa: E402
from replayssm_jax.state import init_state  # noqa: E402

_H200 = jax.sharding.AbstractMesh(
    (1,), ("x",),
    abstract_device=jax.sharding.AbstractDevice(device_kind="NVIDIA H200", num_cores=None, platform="gpu"),
)


@contextlib.contextmanager
def captured_triton_ir():
    """Collect the Triton IR text of every `pallas_call` lowered inside the block.

    Wraps jax's private `lower_jaxpr_to_triton_module` (jax 0.11.2, pinned by this project).
    """
    lowering = pallas_call_registration.lowering
    original = lowering.lower_jaxpr_to_triton_module
    modules: list[str] = []

    def capture(*args, **kwargs):
        result = original(*args, **kwargs)
        modules.append(result.module.operation.get_asm(enable_debug_info=False))
        return result

    lowering.lower_jaxpr_to_triton_module = capture
    try:
        yield modules
    finally:
        lowering.lower_jaxpr_to_triton_module = original


def kernel_ir(cfg: ReplayConfig, kernel_config: KernelConfig, batch: int) -> str:
    """Triton IR of the decode kernel of one `pallas_layer_step` (lowered for an H200)."""
    state = jax.eval_shape(lambda: init_state(cfg, 2 * batch))
    sds = jax.ShapeDtypeStruct
    hk, hv, dk, dv = cfg.num_k_heads, cfg.num_v_heads, cfg.head_k_dim, cfg.head_v_dim
    token = (sds((batch, hk, dk), jnp.bfloat16), sds((batch, hk, dk), jnp.bfloat16),
             sds((batch, hv, dv), jnp.bfloat16), sds(cfg.g_shape(batch), jnp.float32),
             sds((batch, hv), jnp.float32))

    def step(state, q, k, v, g, beta, slots):
        plan = replay.plan_step(state.write_pos, slots, None, cfg.cache_len)
        return ops.pallas_layer_step(state, q, k, v, g, beta, plan, use_qk_l2norm=True, scale=None,
                                     kernel_config=kernel_config, interpret=False)

    with captured_triton_ir() as modules, jax.sharding.use_abstract_mesh(_H200):
        jax.jit(step, donate_argnums=0).trace(state, *token, sds((batch,), jnp.int32)).lower(
            lowering_platforms=("cuda",))
    (module,) = modules
    return module


# Static PTX instruction counts (each instruction once, loops not unrolled): the row sums'
# warp shuffles and the layout conversions' barriers and shared-memory stores are what
# bind the kernels' load/store pipe (benchmarks/NOTES.md, v8, v14).
PTX_COUNTS = {"shuffles": r"shfl\.sync", "barriers": r"bar\.sync", "shared_stores": r"st\.shared",
              "global_loads": r"ld\.global", "instructions": r";"}


def ptxas_report(ir_text: str, kernel_config: KernelConfig) -> dict:
    """Compile Triton IR for sm_90a; return registers, spill bytes, shared memory and the
    `PTX_COUNTS` of the PTX."""
    import triton
    from triton.backends.compiler import GPUTarget

    with tempfile.TemporaryDirectory() as tmp:
        ir_path = os.path.join(tmp, "kernel.ttir")
        with open(ir_path, "w") as f:
            f.write(ir_text)
        options = dict(num_warps=kernel_config.num_warps, num_stages=kernel_config.num_stages)
        compiled = triton.compile(ir_path, target=GPUTarget("cuda", 90, 32), options=options)
        ptx_path = os.path.join(tmp, "kernel.ptx")
        with open(ptx_path, "w") as f:
            f.write(compiled.asm["ptx"])
        ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
        out = subprocess.run([ptxas, "-arch=sm_90a", "-v", ptx_path, "-o", os.devnull],
                             capture_output=True, text=True, check=True).stderr
    registers = int(re.search(r"Used (\d+) registers", out).group(1))
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", out)
    counts = {name: len(re.findall(pattern, compiled.asm["ptx"])) for name, pattern in PTX_COUNTS.items()}
    return dict(registers=registers, spill_store_bytes=int(spills.group(1)),
                spill_load_bytes=int(spills.group(2)), shared_bytes=compiled.metadata.shared, **counts)


def programs_per_sm(registers: int, num_warps: int) -> int:
    """Resident programs per H100/H200 SM by registers alone (65536 per SM, allocated per
    warp in units of 256, at most 64 warps and 32 programs)."""
    per_warp = -(-registers * 32 // 256) * 256
    return min(65536 // (per_warp * num_warps), 64 // num_warps, 32)


CONFIG_FIELDS = "BV,warps,chunk,tiles_per_program,unroll[,flush_every_step[,column_chunk[,rows_outermost]]]"


def parse_config(text: str) -> KernelConfig:
    """`BV,warps,chunk,tiles_per_program,unroll[,flush_every_step[,column_chunk[,rows_outermost]]]`
    (the flags 0/1) -> KernelConfig."""
    try:
        fields = [int(x) for x in text.split(",")]
        bv, warps, chunk, per_program, unroll = fields[:5]
        every_step, column_chunk, outermost = (fields[5:] + [0, 0, 0])[:3]
        if len(fields) > 8:
            raise ValueError
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {CONFIG_FIELDS}, got {text!r}")
    return KernelConfig(block_v=bv, num_warps=warps, cache_chunk=chunk,
                        tiles_per_program=per_program, rebuild_unroll=unroll,
                        flush_every_step=bool(every_step), column_chunk=column_chunk,
                        rows_outermost=bool(outermost))


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gate", choices=("gdn", "kda"), default="gdn")
    p.add_argument("--num-k-heads", type=int, default=None, help="default 16 (GDN), 32 (KDA)")
    p.add_argument("--num-v-heads", type=int, default=32)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--cache-len", type=int, default=16)
    p.add_argument("--state-dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--config", type=parse_config, action="append",
                   help=f"{CONFIG_FIELDS} (repeatable); default: the tile table")
    args = p.parse_args(argv)
    num_k_heads = args.num_k_heads or (32 if args.gate == "kda" else 16)
    dtype = jnp.dtype(args.state_dtype)
    if args.config:
        cases = [(512, kc, "replay") for kc in args.config]
    else:
        cases = [(batch, kc, kernel) for kernel in ("replay", "plain")
                 for batch, _, kc in ops.table_entries(kernel, args.gate, dtype)]
    rows = []
    print(f"{'kernel':7} {'B':>4} {'BV':>3} {'warps':>5} {'T':>2} {'U':>2} {'W':>3} {'regs':>5} {'spill B':>8} "
          f"{'shared B':>8} {'programs/SM':>11} {'shfl':>5} {'bar':>4} {'instr':>6}")
    for batch, kc, kernel in cases:
        cache_len = 1 if kernel == "plain" else args.cache_len
        kernel = "fold" if kc.flush_every_step and kernel == "replay" else kernel
        cfg = ReplayConfig(num_k_heads, args.num_v_heads, args.head_dim, args.head_dim, cache_len,
                           gate=args.gate, state_dtype=dtype, cache_dtype=dtype)
        report = ptxas_report(kernel_ir(cfg, kc, batch), kc)
        row = dict(kernel=kernel, batch=batch, **{k: getattr(kc, k) for k in (
            "block_v", "num_warps", "tiles_per_program", "rebuild_unroll", "column_chunk",
            "rows_outermost")}, **report,
            programs_per_sm=programs_per_sm(report["registers"], kc.num_warps))
        print(f"{kernel:7} {batch:>4} {kc.block_v:>3} {kc.num_warps:>5} {kc.tiles_per_program:>2} "
              f"{kc.rebuild_unroll:>2} {kc.column_chunk:>3} {report['registers']:>5} "
              f"{report['spill_store_bytes'] + report['spill_load_bytes']:>8} {report['shared_bytes']:>8} "
              f"{row['programs_per_sm']:>11} {report['shuffles']:>5} {report['barriers']:>4} "
              f"{report['instructions']:>6}")
        rows.append(row)
    return rows


if __name__ == "__main__":
    main()
