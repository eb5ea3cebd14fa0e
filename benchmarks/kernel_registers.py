"""Registers per thread (and PTX shuffle / barrier counts) of each decode kernel launch
on an H200, without a GPU.

Occupancy decides these kernels' bandwidth (benchmarks/NOTES.md): a kernel whose programs
hold more registers keeps fewer of them, and fewer bytes, in flight per SM. This tool lowers
a decode step for an abstract H200 (as the tests do), takes the Triton IR that Pallas hands
to XLA, compiles it with the `triton` package for sm_90a (the same Triton release as the GPU
image, 3.6.0) and prints what `ptxas -v` reports.

The GPU build runs XLA's own Triton pipeline and CUDA's ptxas, and its counts can differ by
more than the occupancy steps (benchmarks/NOTES.md, Occupancy, lists both for the table's
rows). Read the counts here as a static view of one kernel's variants, not as the occupancy
the GPU runs at; for that, on the GPU: `ncu --kernel-name regex:'replayssm|plain_decode'
--metrics launch__registers_per_thread`.

Needs the `triton` extra (`pip install -e ".[triton]"`); runs on a CPU:

  python benchmarks/kernel_registers.py                     # every row of the launch table
  python benchmarks/kernel_registers.py --gate kda --cache-len 32 --state-dtype bfloat16
  python benchmarks/kernel_registers.py --params grouped:block_v=32,tiles_per_program=8
  python benchmarks/kernel_registers.py --params fold:block_v=16,empty_cache_branch=1
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

from pallas_kernels.common import GridOrder  # noqa: E402
from pallas_kernels.fold_decode import FoldParams  # noqa: E402
from pallas_kernels.plain_decode import PlainParams  # noqa: E402
from pallas_kernels.replay_decode import ReplayTileParams  # noqa: E402
from pallas_kernels.replay_decode_grouped import ReplayGroupedParams  # noqa: E402
from pallas_kernels.verify_readout import VerifyReadoutParams  # noqa: E402
from replayssm_jax.backends import pallas_triton  # noqa: E402
from replayssm_jax.config import ReplayConfig  # noqa: E402
from replayssm_jax.plan import FlushPolicy, plan_step  # noqa: E402
from replayssm_jax.speculative import verify_step  # noqa: E402
from replayssm_jax.state import init_state  # noqa: E402
from replayssm_jax.tokens import Mamba2Params, Mamba2Tokens, Tokens  # noqa: E402

PARAM_KINDS = {"plain": PlainParams, "fold": FoldParams, "tile": ReplayTileParams, "grouped": ReplayGroupedParams,
               "verify": VerifyReadoutParams}
VERIFY_WIDTH = 4  # draft tokens per row of the verify step lowered here

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


def params_policy(params) -> FlushPolicy:
    """The plan a launch with `params` runs under: the folding kernel's is fold-every-step."""
    return FlushPolicy.EVERY_STEP if isinstance(params, FoldParams) else FlushPolicy.NATURAL


def kernel_ir(cfg: ReplayConfig, params, batch: int) -> str:
    """Triton IR of the decode kernel of one pallas_triton layer step (lowered for an H200),
    or with `VerifyReadoutParams` of a verify step of `VERIFY_WIDTH` tokens per row.
    `cfg.cache_len` must be 1 for `PlainParams` and above 1 for the other kernels."""
    state = jax.eval_shape(lambda: init_state(cfg, 2 * batch))
    if cfg.gate_kind.additive:
        return _mamba2_kernel_ir(cfg, params, batch, state)
    sds = jax.ShapeDtypeStruct
    hk, hv, dk, dv = cfg.num_k_heads, cfg.num_v_heads, cfg.head_k_dim, cfg.head_v_dim
    verify = isinstance(params, VerifyReadoutParams)
    lead = (batch, VERIFY_WIDTH) if verify else (batch,)
    g_shape = (*lead, *cfg.g_shape(batch)[1:])
    tokens = Tokens(sds((*lead, hk, dk), jnp.bfloat16), sds((*lead, hk, dk), jnp.bfloat16),
                    sds((*lead, hv, dv), jnp.bfloat16), sds(g_shape, jnp.float32),
                    sds((*lead, hv), jnp.float32))

    def step(state, tokens, slots):
        if verify:
            return verify_step(state, tokens, slots, backend="pallas_triton", use_qk_l2norm=True,
                               kernel_params=params, interpret=False)
        plan = plan_step(state.write_pos, slots, None, cfg.cache_len, params_policy(params))
        return pallas_triton.layer_step(state, tokens, plan, use_qk_l2norm=True, scale=None,
                                        kernel_params=params, interpret=False)

    return _lowered_ir(step, state, tokens, batch)


def _mamba2_kernel_ir(cfg: ReplayConfig, params, batch: int, state) -> str:
    """`kernel_ir` of a Mamba-2 layer (bf16 x, B, C, z; float32 dt and parameters)."""
    sds = jax.ShapeDtypeStruct
    h, g, n, p = cfg.num_v_heads, cfg.num_k_heads, cfg.head_k_dim, cfg.head_v_dim
    tokens = Mamba2Tokens(sds((batch, h, p), jnp.bfloat16), sds((batch, g, n), jnp.bfloat16),
                          sds((batch, g, n), jnp.bfloat16), sds((batch, h), jnp.float32),
                          sds((batch, h, p), jnp.bfloat16))
    layer = Mamba2Params(*(sds((h,), jnp.float32) for _ in range(3)))

    def step(state, tokens, slots, layer):
        plan = plan_step(state.write_pos, slots, None, cfg.cache_len, FlushPolicy.NATURAL)
        return pallas_triton.mamba2_layer_step(state, tokens, plan, params=layer, kernel_params=params,
                                               interpret=False)

    return _lowered_ir(step, state, tokens, batch, layer)


def _lowered_ir(step, state, tokens, batch: int, *extra) -> str:
    """The one Triton module of `step(state, tokens, slots, *extra)` lowered for an H200."""
    with captured_triton_ir() as modules, jax.sharding.use_abstract_mesh(_H200):
        jax.jit(step, donate_argnums=0).trace(state, tokens, jax.ShapeDtypeStruct((batch,), jnp.int32),
                                              *extra).lower(
            lowering_platforms=("cuda",))
    (module,) = modules
    return module


# Static PTX instruction counts (each instruction once, loops not unrolled): the row sums'
# warp shuffles and the layout conversions' barriers and shared-memory stores are what
# bind the kernels' load/store pipe (benchmarks/NOTES.md).
PTX_COUNTS = {"shuffles": r"shfl\.sync", "barriers": r"bar\.sync", "shared_stores": r"st\.shared",
              "global_loads": r"ld\.global", "instructions": r";"}


def ptxas_path() -> str:
    """The ptxas that the `triton` package ships (sm_90a, no CUDA toolkit needed)."""
    import triton

    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")


def ptxas_usage(report: str) -> dict:
    """Registers per thread and spill bytes from the text of `ptxas -v`."""
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", report)
    return dict(registers=int(re.search(r"Used (\d+) registers", report).group(1)),
                spill_store_bytes=int(spills.group(1)), spill_load_bytes=int(spills.group(2)))


def ptxas_report(ir_text: str, params) -> dict:
    """Compile Triton IR for sm_90a; return registers, spill bytes, shared memory and the
    `PTX_COUNTS` of the PTX."""
    import triton
    from triton.backends.compiler import GPUTarget

    with tempfile.TemporaryDirectory() as tmp:
        ir_path = os.path.join(tmp, "kernel.ttir")
        with open(ir_path, "w") as f:
            f.write(ir_text)
        options = dict(num_warps=params.num_warps, num_stages=getattr(params, "num_stages", 1))
        compiled = triton.compile(ir_path, target=GPUTarget("cuda", 90, 32), options=options)
        ptx_path = os.path.join(tmp, "kernel.ptx")
        with open(ptx_path, "w") as f:
            f.write(compiled.asm["ptx"])
        out = subprocess.run([ptxas_path(), "-arch=sm_90a", "-v", ptx_path, "-o", os.devnull],
                             capture_output=True, text=True, check=True).stderr
    counts = {name: len(re.findall(pattern, compiled.asm["ptx"])) for name, pattern in PTX_COUNTS.items()}
    return dict(**ptxas_usage(out), shared_bytes=compiled.metadata.shared, **counts)


def programs_per_sm(registers: int, num_warps: int) -> int:
    """Resident programs per H100/H200 SM by registers alone (65536 per SM, allocated per
    warp in units of 256, at most 64 warps and 32 programs)."""
    per_warp = -(-registers * 32 // 256) * 256
    return min(65536 // (per_warp * num_warps), 64 // num_warps, 32)


def parse_params(text: str):
    """`KIND:field=value,...` (KIND one of plain, fold, tile, grouped, verify; ints, `grid_order`
    by name, flags 0/1) -> that kernel's parameter class."""
    kind, _, fields = text.partition(":")
    try:
        cls = PARAM_KINDS[kind]
        values = {}
        for item in filter(None, fields.split(",")):
            name, value = item.split("=")
            default = getattr(cls(), name)
            values[name] = (GridOrder[value.upper()] if isinstance(default, GridOrder) else
                            bool(int(value)) if isinstance(default, bool) else
                            value if isinstance(default, str) else int(value))
        return cls(**values)
    except (KeyError, ValueError, AttributeError, TypeError) as err:
        raise argparse.ArgumentTypeError(f"expected KIND:field=value,... with KIND in {tuple(PARAM_KINDS)}, "
                                         f"got {text!r} ({err})") from err


def table_cases(gate: str, state_dtype, cache_len: int) -> list[tuple[int, object, int]]:
    """`(batch, params, cache length)` of every launch-table row that this gate and state
    dtype reach at `cache_len` (plain rows at L = 1), at the row's smallest batch."""
    state_bytes = jnp.dtype(state_dtype).itemsize
    cases = []
    for row in pallas_triton.LAUNCH_TABLE:
        length = 1 if row.step == "plain" else cache_len
        if (row.matches(row.step, gate, state_bytes, row.batch[0], length)
                and pallas_triton.launch_row(row.step, gate, state_bytes, row.batch[0], length) is row):
            cases.append((row.batch[0], row.params, length))
    return cases


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gate", choices=("gdn", "kda"), default="gdn")
    p.add_argument("--num-k-heads", type=int, default=None, help="default 16 (GDN), 32 (KDA)")
    p.add_argument("--num-v-heads", type=int, default=32)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--cache-len", type=int, default=16)
    p.add_argument("--state-dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--params", type=parse_params, action="append",
                   help="KIND:field=value,... (repeatable); default: every launch-table row")
    args = p.parse_args(argv)
    num_k_heads = args.num_k_heads or (32 if args.gate == "kda" else 16)
    dtype = jnp.dtype(args.state_dtype)
    if args.params:
        cases = [(512, params, 1 if isinstance(params, PlainParams) else args.cache_len) for params in args.params]
    else:
        cases = table_cases(args.gate, dtype, args.cache_len)
    rows = []
    print(f"{'params':60} {'B':>4} {'regs':>5} {'spill B':>8} {'shared B':>8} {'programs/SM':>11} "
          f"{'shfl':>5} {'bar':>4} {'instr':>6}")
    for batch, params, cache_len in cases:
        cfg = ReplayConfig(num_k_heads, args.num_v_heads, args.head_dim, args.head_dim, cache_len,
                           gate=args.gate, state_dtype=dtype, cache_dtype=dtype)
        report = ptxas_report(kernel_ir(cfg, params, batch), params)
        row = dict(params=repr(params), batch=batch, **report,
                   programs_per_sm=programs_per_sm(report["registers"], params.num_warps))
        print(f"{repr(params)[:60]:60} {batch:>4} {report['registers']:>5} "
              f"{report['spill_store_bytes'] + report['spill_load_bytes']:>8} {report['shared_bytes']:>8} "
              f"{row['programs_per_sm']:>11} {report['shuffles']:>5} {report['barriers']:>4} "
              f"{report['instructions']:>6}")
        rows.append(row)
    return rows


if __name__ == "__main__":
    main()
