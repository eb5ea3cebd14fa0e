"""The benchmark scripts on a CPU: decode_bench's smoke mode end to end, and the
register tool's lowering and occupancy arithmetic (its ptxas step needs the `triton`
extra and is skipped without it)."""

from __future__ import annotations

import json
import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))

import decode_bench  # noqa: E402
import kernel_registers  # noqa: E402
from pallas_kernels import ops  # noqa: E402
from replayssm_jax.config import ReplayConfig  # noqa: E402


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
    with pytest.raises(Exception, match="expected BV,warps,chunk,tiles_per_program,unroll"):
        kernel_registers.parse_config("32,4")
    with pytest.raises(ValueError, match="rebuild_unroll"):
        kernel_registers.parse_config("32,4,16,8,0")


def _cfg(gate="gdn", cache_len=16):
    return ReplayConfig(16 if gate == "gdn" else 32, 32, 128, 128, cache_len, gate=gate)


def test_kernel_ir_is_the_replay_kernel_for_an_h200():
    ir = kernel_registers.kernel_ir(_cfg(), ops.default_kernel_config(512), 512)
    assert "tt.func" in ir and "replayssm_decode" in ir


def test_ptxas_report_of_the_table_configs():
    pytest.importorskip("triton", reason="the ptxas step needs the `triton` extra")
    for batch in (1, 512):
        kc = ops.default_kernel_config(batch)
        report = kernel_registers.ptxas_report(kernel_registers.kernel_ir(_cfg(), kc, batch), kc)
        # The table's configurations must not spill (a spilling kernel measured 2-6x slower).
        assert 0 < report["registers"] <= 255
        assert report["spill_store_bytes"] == report["spill_load_bytes"] == 0
