"""The benchmark scripts on a CPU: decode_bench's smoke mode end to end, the register
tool's lowering and occupancy arithmetic, and every exposed kernel configuration compiled
by Triton and ptxas for sm_90a (needs the `triton` extra, which CI installs; skipped
without it)."""

from __future__ import annotations

import itertools
import json
import pathlib
import sys

import jax.numpy as jnp
import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))

import decode_bench  # noqa: E402
import kernel_registers  # noqa: E402
from pallas_kernels import ops  # noqa: E402
from replayssm_jax.config import ReplayConfig  # noqa: E402

from helpers import exposed_kernel_configs, table_launches  # noqa: E402


def test_decode_bench_smoke_writes_every_section(tmp_path):
    out = tmp_path / "bench.json"
    result = decode_bench.main([
        "--smoke", "--sections", "check,steps,sweep", "--batches", "2", "--cache-lens", "1,4",
        "--extra", "kda", "--out", str(out),
    ])
    saved = json.loads(out.read_text())
    assert saved["rows"] == json.loads(json.dumps(result["rows"]))
    assert {c["precision"] for c in saved["checks"]} == {"ieee"}
    assert all(c["pool_copies"] == 0 or c["pool_copies"] > 0 for c in saved["checks"])  # counted
    for check in saved["checks"]:  # interpret mode on CPU, compared with the scan reference
        assert check["y_rel_err"] < 1e-5 and check["state_rel_err"] < 1e-5
    kinds = {(r["gate"], r["state_dtype"], r["cache_len"], r["cursors"]) for r in saved["rows"]}
    assert ("gdn", "float32", 1, "sync") in kinds and ("gdn", "bfloat16", 4, "staggered") in kinds
    assert ("kda", "float32", 16, "sync") in kinds
    assert len(saved["steps"][0]["replay_step_us"]) == 4


@pytest.mark.parametrize(
    "registers,warps,programs",
    [(128, 4, 4), (146, 1, 13), (255, 2, 4), (77, 1, 25), (32, 1, 32), (64, 16, 2), (16, 16, 4)],
)
def test_programs_per_sm(registers, warps, programs):
    # 65536 registers per SM, allocated per warp in units of 256; <= 64 warps, <= 32 programs.
    assert kernel_registers.programs_per_sm(registers, warps) == programs


def test_parse_config_round_trip_and_errors():
    kc = kernel_registers.parse_config("32,4,16,8,4")
    assert (kc.block_v, kc.num_warps, kc.cache_chunk, kc.tiles_per_program, kc.rebuild_unroll) == (32, 4, 16, 8, 4)
    assert not kc.flush_every_step
    assert kernel_registers.parse_config("16,1,16,0,1,1").flush_every_step
    chunked = kernel_registers.parse_config("16,1,16,0,1,0,16,1")
    assert (chunked.column_chunk, chunked.rows_outermost, chunked.flush_every_step) == (16, True, False)
    for bad in ("32,4", "16,1,16,0,1,0,16,1,7"):
        with pytest.raises(Exception, match="expected BV,warps,chunk,tiles_per_program,unroll"):
            kernel_registers.parse_config(bad)
    with pytest.raises(ValueError, match="rebuild_unroll"):
        kernel_registers.parse_config("32,4,16,8,0")


def _cfg(gate="gdn", cache_len=16, dtype=jnp.float32):
    return ReplayConfig(16 if gate == "gdn" else 32, 32, 128, 128, cache_len, gate=gate,
                        state_dtype=dtype, cache_dtype=dtype)


def test_kernel_ir_is_the_replay_kernel_for_an_h200():
    ir = kernel_registers.kernel_ir(_cfg(), ops.default_kernel_config(512), 512)
    assert "tt.func" in ir and "replayssm_decode" in ir


# What the package launches by default for each gate: each replay table entry at L > 1,
# each plain table entry at L = 1. These must not spill (a spilling kernel measured 2-6x
# slower).
PACKAGE_LAUNCHES = {(kc, kernel == "plain", gate, dtype) for kc, kernel, gate, dtype in table_launches()}


@pytest.mark.parametrize("kernel_config", exposed_kernel_configs(), ids=repr)
@pytest.mark.parametrize("gate", ["gdn", "kda"])
def test_every_exposed_config_compiles_for_sm90(kernel_config, gate):
    """Triton 3.6 (the GPU image's) runs its own passes on each exposed configuration's IR
    and ptxas builds it for sm_90a, fp32 and bf16 state, L = 13; the plain table's entries
    also at L = 1 (the plain kernel). Lowering alone (test_pallas_kernels) does not run
    Triton's passes, which can fail (NOTES, v11c). The package's own launches (for their
    gate and state dtype) must not spill; other rebuild precisions may (KDA at T = 2 with
    tensor-core rebuilds does), and so may a launch with a state dtype the table does not
    give it (KDA's large-batch folding tile with a bf16 state does)."""
    pytest.importorskip("triton", reason="compiling needs the `triton` extra")
    dtypes = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))
    plain_launch = any((kernel_config, True, gate, dtype) in PACKAGE_LAUNCHES for dtype in dtypes)
    cache_lens = (1, 13) if plain_launch else (13,)
    for cache_len, dtype in itertools.product(cache_lens, dtypes):
        cfg = _cfg(gate, cache_len, dtype)
        report = kernel_registers.ptxas_report(kernel_registers.kernel_ir(cfg, kernel_config, 8), kernel_config)
        assert 0 < report["registers"] <= 255
        if (kernel_config, cache_len == 1, gate, dtype) in PACKAGE_LAUNCHES:
            assert report["spill_store_bytes"] == report["spill_load_bytes"] == 0, (cache_len, dtype)
