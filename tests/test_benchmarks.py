"""The benchmark scripts on a CPU: decode_bench's smoke mode end to end, and the register
tool's parameter parsing, table listing and occupancy arithmetic (the launch table's rows
compiled for sm_90a are tested in test_launch_table.py), the Mosaic register tool on
PTX dumped on the H200, and the Mosaic profile tool's trace arithmetic."""

from __future__ import annotations

import dataclasses

import json
import os
import pathlib
import sys
import tarfile

import jax.numpy as jnp
import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))

import decode_bench  # noqa: E402
import kernel_registers  # noqa: E402
import mosaic_bench  # noqa: E402
import mosaic_profile  # noqa: E402
import mosaic_registers  # noqa: E402
import verify_bench  # noqa: E402
from pallas_kernels.common import GridOrder  # noqa: E402
from pallas_kernels.fold_decode import FoldParams  # noqa: E402
from pallas_kernels.replay_decode_grouped import ReplayGroupedParams  # noqa: E402
from replayssm_jax.backends import pallas_triton  # noqa: E402


@pytest.mark.heavy
def test_decode_bench_smoke_writes_every_section(tmp_path):
    out = tmp_path / "bench.json"
    result = decode_bench.main([
        "--smoke", "--sections", "check,steps,sweep,debug", "--batches", "2", "--cache-lens", "1,4",
        "--extra", "kda", "--policies", "default,natural,every_step", "--out", str(out),
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
    # KDA with a 4-byte state folds every step by default; the natural policy's replay is timed beside it
    kda = {r["policy"] for r in saved["rows"] if r["gate"] == "kda"}
    assert kda == {"every_step", "natural"}
    assert {r["kernel"] for r in saved["rows"] if r["gate"] == "kda" and r["policy"] == "natural"} == {
        "ReplayGroupedParams"}
    assert len(saved["steps"][0]["replay_step_us"]) == 4
    (debug,) = saved["debug"]  # wall times of jit and checked steps, both measured
    assert debug["jit_sync_us"] > 0 and debug["checked_sync_us"] > 0 and debug["jit_pipelined_us"] > 0


@pytest.mark.heavy
@pytest.mark.parametrize("gate,check,sweep", [  # KDA's sections share GDN's code but for the gates
    ("gdn", "check", "sweep"), pytest.param("kda", "kda_check", "kda_sweep", marks=pytest.mark.slow),
    ("mamba2", "mamba2_check", "mamba2_sweep")])
def test_mosaic_bench_smoke(tmp_path, gate, check, sweep):
    """The Mosaic GPU bench end to end in interpret mode, a layer's two sections per test
    (GDN, KDA with raw gates too, Mamba-2): the checks agree with xla and the sweep rows
    carry both backends' cycles, and a second Mosaic variant (persistent CTAs) runs beside
    the default."""
    out = tmp_path / "mosaic.json"
    prefix = "" if gate == "gdn" else f"{gate}-"
    caches = ["--mamba2-cache-dtype", "bfloat16"] if gate == "mamba2" else []  # smoke states are fp32
    mosaic_bench.main(["--smoke", "--sections", f"{prefix}check,{gate if prefix else 'sweep'}",
                       "--variants", "default;programs=3", "--out", str(out), *caches])
    result = json.loads(out.read_text())
    assert {row["backend"] for row in result[check]} == {"pallas_triton", "mosaic_gpu", "mosaic_gpu programs=3"}
    assert {row["mosaic_variant"] for row in result[sweep]} == {"default", "programs=3"}
    assert all(row["gate"] == gate and row["checkpoint"] < 1e-5 and row["write_pos_equal"] for row in result[check])
    # the Mosaic kernels' state refs are updated in place even in interpret mode
    assert all(row["pool_copies"] == 0 for row in result[check] if row["backend"] == "mosaic_gpu")
    assert {row["cursors"] for row in result[sweep]} == {"sync", "staggered"}
    assert all(row["gate"] == gate and row["mosaic_cycle_us"] > 0 and row["triton_cycle_us"] > 0
               for row in result[sweep])
    if gate == "mamba2":
        assert {(row["state_dtype"], row["cache_dtype"]) for row in result[sweep]} == {("float32", "bfloat16")}
    if gate == "kda":
        assert {row["raw_gates"] for row in result[check]} == {False, True}
        assert {row["triton_policy"] for row in result[sweep]} == {"every_step"}  # a 4-byte KDA state folds
    else:  # the fp32 defaults compute everything in the kernel: no XLA side inputs
        assert all(row["mosaic_xla_side_us"] == 0 for row in result[sweep])


def test_mosaic_step_times_include_what_xla_computes_before_the_kernel():
    """A GDN step with the tensor-core readout and the key side from XLA is timed with XLA's
    side inputs (staged q, k and key sums) added; with the defaults for an fp32 state there
    are none."""
    import jax
    import numpy as np

    from pallas_kernels.mosaic_gpu.replay_decode import MosaicReplayParams

    db = decode_bench
    cfg = mosaic_bench.gdn_config(True, 8, "float32")
    timer = db.Timer(True)
    side_params = MosaicReplayParams(readout="mma", key_side="xla")
    *_, side_us = mosaic_bench.time_mosaic(timer, cfg, 2, np.random.default_rng(0), 1, True, True, side_params)
    assert side_us > 0
    pool = db.random_pool(cfg, 4, jax.random.key(0), np.zeros(4))
    token = db.random_token(cfg, 2, jax.random.key(1))
    sets = jnp.asarray([[0, 1], [2, 3]], jnp.int32)
    assert mosaic_bench.time_xla_side(timer, cfg, MosaicReplayParams(), pool.k_cache, sets, token, 1) == 0.0


def test_mosaic_cycle_is_timed_on_the_pool_as_an_argument():
    """The CUPTI timer jits what it times: a pool the timed call closed over would be
    lowered as a constant (GBs at the benchmark's batches), so the pool must come in as an
    argument and leave nothing large for the lowering to capture."""
    import jax
    import numpy as np

    class Recorder(decode_bench.Timer):
        def kernel_times(self, fn, args, name, iterations):
            self.lowered = jax.jit(fn).lower(*args).as_text()
            self.args = args
            return super().kernel_times(fn, args, name, iterations)

    cfg = mosaic_bench.gdn_config(True, 8, "float32")
    timer = Recorder(True)
    params = mosaic_bench.effective_params("default", cfg, 2)
    mosaic_bench.time_mosaic(timer, cfg, 2, np.random.default_rng(0), 1, True, False, params)
    pools = [a for a in timer.args if hasattr(a, "checkpoint")]
    assert len(pools) == 1
    assert "dense<" not in timer.lowered or all(
        len(line) < 4096 for line in timer.lowered.splitlines() if "dense<" in line)


def test_mosaic_bench_check_reports_a_variant_a_case_refuses():
    """A variant whose build a case refuses (here a tensor-core rebuild, which interpret mode
    cannot run) is reported as skipped with the reason; the other backends are checked."""
    rows = mosaic_bench.check_section(True, "gdn", "default;rebuild=tf32")
    (skipped,) = [row for row in rows if row["backend"] == "mosaic_gpu rebuild=tf32"]
    assert "interpret" in skipped["skipped"] and "y" not in skipped
    assert all(row["checkpoint"] < 1e-5 for row in rows if "skipped" not in row)


def test_mosaic_variant_specs_parse_to_params():
    import replayssm_jax as R
    from pallas_kernels.mosaic_gpu.mamba2_decode import MosaicMamba2Params
    from pallas_kernels.mosaic_gpu.replay_decode import MosaicReplayParams

    gdn = R.ReplayConfig(16, 32, 128, 128, 16)
    assert mosaic_bench.mosaic_params("default", gdn, 512) is None
    assert mosaic_bench.mosaic_params("programs=fit,auto_barriers=false", gdn, 512) == MosaicReplayParams(
        programs=264, auto_barriers=False)  # two CTAs per SM on the 132 SMs assumed off GPU
    assert mosaic_bench.mosaic_params("rebuild=tf32,swizzle=64", gdn, 8) == MosaicReplayParams(rebuild="tf32",
                                                                                               swizzle=64)
    nemotron = R.ReplayConfig.mamba2(128, 64, 128, 8, 16)
    assert mosaic_bench.mosaic_params("programs=7", nemotron, 8) == MosaicMamba2Params(programs=7)
    # after `default,` only the named fields leave the backend's defaults for the cell
    from replayssm_jax.backends import mosaic_gpu

    on_defaults = mosaic_bench.mosaic_params("default,programs=7", nemotron, 512)
    assert on_defaults == dataclasses.replace(mosaic_gpu.default_params(nemotron, 512, jnp.bfloat16), programs=7)
    assert not on_defaults.auto_barriers and MosaicMamba2Params(programs=7).auto_barriers
    # `programs=fit` counts the buffers of the merged fields: with `default,` too, and four
    # bf16 programs per CTA fit (one CTA an SM) with the GPU's tensor-core folds only with
    # their fold operands in the tile.
    bf16 = R.ReplayConfig(16, 32, 128, 128, 16, state_dtype=jnp.bfloat16, cache_dtype=jnp.bfloat16)
    four = "default,warpgroups=4,rebuild=3xtf32,programs=fit"
    with pytest.raises(ValueError, match="programs must be a positive multiple of it, got 0"):
        mosaic_bench.mosaic_params(four, bf16, 512)
    assert mosaic_bench.mosaic_params(four + ",operands_in_tile=true", bf16, 512).programs == 4 * 132
    assert mosaic_bench.mosaic_params("default,programs=fit", bf16, 512).programs == (
        mosaic_gpu.default_params(bf16, 512, jnp.bfloat16).programs)


@pytest.mark.heavy
def test_decode_bench_mamba2_smoke(tmp_path):
    out = tmp_path / "mamba2.json"
    decode_bench.main(["--smoke", "--sections", "mamba2", "--mamba2-batches", "2", "--mamba2-cache-lens", "4",
                       "--out", str(out)])
    saved = json.loads(out.read_text())
    for check in saved["mamba2_checks"]:  # interpret mode on CPU against the scan reference
        assert check["y_rel_err"] < (3e-2 if check["state_dtype"] == "bfloat16" else 1e-5), check
    kinds = {(r["state_dtype"], r["policy"], r["cursors"], r["kernel"]) for r in saved["rows"]}
    assert ("float32", "natural", "staggered", "Mamba2ReplayParams") in kinds
    assert ("bfloat16", "natural", "sync", "Mamba2ReplayParams") in kinds
    assert {r["gate"] for r in saved["rows"]} == {"mamba2"}
    assert all(r["plain_params"].startswith("Mamba2PlainParams") and r["plain_us"] > 0 for r in saved["rows"])


@pytest.mark.parametrize(
    "registers,warps,programs",
    [(128, 4, 4), (146, 1, 13), (255, 2, 4), (77, 1, 25), (32, 1, 32), (64, 16, 2), (16, 16, 4)],
)
def test_programs_per_sm(registers, warps, programs):
    # 65536 registers per SM, allocated per warp in units of 256; <= 64 warps, <= 32 programs.
    assert kernel_registers.programs_per_sm(registers, warps) == programs


def test_parse_params_round_trip_and_errors():
    params = kernel_registers.parse_params("grouped:block_v=32,tiles_per_program=8,grid_order=launch_order")
    assert params == ReplayGroupedParams(32, 4, 8, grid_order=GridOrder.LAUNCH_ORDER)
    assert kernel_registers.parse_params("fold:block_v=16,empty_cache_branch=1") == FoldParams(
        16, empty_cache_branch=True)
    for bad in ("nokind:block_v=8", "grouped:block_v", "grouped:colour=3"):
        with pytest.raises(Exception, match="expected KIND:field=value"):
            kernel_registers.parse_params(bad)
    with pytest.raises(Exception, match="rebuild_unroll must be in"):  # the class's own check
        kernel_registers.parse_params("grouped:rebuild_unroll=0")


def test_table_cases_list_each_reachable_row_once():
    cases = kernel_registers.table_cases("gdn", jnp.float32, 16)
    params = [p for _, p, _ in cases]
    assert len(params) == len(set(params)), "a row listed twice"
    for batch, p, length in cases:
        step = {"PlainParams": "plain", "FoldParams": "fold",
                "VerifyReadoutParams": "verify"}.get(type(p).__name__, "replay")
        assert pallas_triton.launch_row(step, "gdn", 4, batch, length).params == p
    gdn_fp32_rows = {row.params for row in pallas_triton.LAUNCH_TABLE
                     if row.gate in (None, "gdn") and row.state_bytes in (None, 4)}
    assert set(params) <= gdn_fp32_rows


@pytest.mark.heavy
@pytest.mark.parametrize("gate", ["gdn", pytest.param("kda", marks=pytest.mark.slow), "mamba2"])
def test_verify_bench_smoke_writes_its_rows(tmp_path, gate):
    out = tmp_path / "verify.json"
    result = verify_bench.main(["--smoke", "--gate", gate, "--batches", "2", "--cache-lens", "8", "--widths", "2",
                                "--out", str(out)])
    saved = json.loads(out.read_text())
    assert saved["rows"] == json.loads(json.dumps(result["rows"]))
    (row,) = saved["rows"]
    assert (row["gate"], row["L"], row["T"], row["B"]) == (gate, 8, 2, 2)
    assert row["conventional_us"] > 0
    assert set(row["backends"]) == set(verify_bench.MAMBA2_BACKENDS if gate == "mamba2" else verify_bench.BACKENDS)
    for name, times in row["backends"].items():
        for key in ("nonflush_us", "flush_us", "acc75_amortised_us"):
            assert times[key] > 0, (name, key)
    assert row["flush_bytes"] > row["nonflush_bytes"]
    assert saved["check"]["folding_rows"] >= 2  # rows 0 and 1 fold at every L
    for name, errors in saved["check"]["backends"].items():
        assert errors.pop("write_pos_equal"), name
        assert max(errors.values()) < 1e-4, (name, errors)  # fp32 against xla: summation order only


def test_verify_bench_runs_mosaic_kernel_options(tmp_path):
    """A `mosaic_gpu:` backend entry runs the GDN verify kernel as persistent CTAs without
    Mosaic's barriers, with the tensor-core readout (its products as dots in interpret
    mode) and the rows in launch order, checked against xla and timed beside the default,
    also at staggered cursors."""
    variant = "mosaic_gpu:programs=fit+auto_barriers=false+readout=mma+launch_order=true"
    result = verify_bench.main(["--smoke", "--batches", "2", "--cache-lens", "8", "--widths", "2", "--staggered",
                                "--backends", f"mosaic_gpu,{variant}", "--out", str(tmp_path / "v.json")])
    (row,) = result["rows"]
    assert row["backends"][variant]["kernel_params"] == dict(swizzle=128, rebuild="exact", programs=4,
                                                             auto_barriers=False,  # 2 rows x 2 heads x 1 tile
                                                             readout="mma", group_records=None, chunk=0,
                                                             key_side="kernel", per_tile_addresses=False, warpgroups=1,
                                                             launch_order=True, window_side="xla", window_warps=2,
                                                             prefetch_folds=False, group_folds=False,
                                                             operands_in_tile=False)
    assert row["backends"][variant]["nonflush_us"] > 0
    assert all(times["staggered_us"] > 0 and 0 <= times["staggered_fold_fraction"] <= 1
               for times in row["backends"].values())
    errors = result["check"]["backends"][variant]
    assert errors.pop("write_pos_equal") and max(errors.values()) < 1e-4, errors
    with pytest.raises(ValueError, match="kernel options are for the mosaic_gpu verify kernels"):
        verify_bench.backend_params("pallas_triton:programs=2", verify_bench.R.ReplayConfig(1, 2, 64, 64, 8), 2, 2)
    # `default+...`: the backend's defaults for the row with the named fields replaced.
    cfg = verify_bench.R.ReplayConfig(1, 2, 64, 64, 8)
    name, params = verify_bench.backend_params("mosaic_gpu:default+window_side=kernel", cfg, 2, 2)
    defaults = verify_bench.mosaic_gpu.verify_default_params(cfg, 2, 2, jnp.bfloat16)
    assert name == "mosaic_gpu" and params == dataclasses.replace(defaults, window_side="kernel")
    # `programs=fit` after `default+` too, with the spec's other fields.
    spec = "mosaic_gpu:default+programs=fit+rebuild=exact+prefetch_folds=false+group_folds=true"
    _, params = verify_bench.backend_params(spec, cfg, 2, 2)
    fit = verify_bench.verify_decode.persistent_programs(2, 2, 2, 64, 64, 8, jnp.float32, jnp.float32, jnp.bfloat16,
                                                         verify_bench.mosaic_gpu.device_sm_count(),
                                                         readout=defaults.readout, key_side=defaults.key_side,
                                                         group_folds=True)
    assert params == dataclasses.replace(defaults, programs=fit, rebuild="exact", prefetch_folds=False,
                                         group_folds=True) and fit > 0
    kda = verify_bench.R.ReplayConfig(2, 2, 64, 64, 8, gate="kda")
    assert verify_bench.backend_params("mosaic_gpu:window_side=kernel", kda, 2, 2) == (
        "mosaic_gpu", verify_bench.MosaicReplayParams(window_side="kernel"))
    # Mamba-2: its own parameters, on its defaults too (a window formed by XLA beside the kernel's).
    mamba2 = verify_bench.R.ReplayConfig.mamba2(2, 64, 64, 1, 8)
    assert verify_bench.backend_params("mosaic_gpu:default+window_side=xla", mamba2, 2, 2) == (
        "mosaic_gpu", verify_bench.MosaicMamba2Params(window_side="xla"))


def test_verify_bench_reports_a_refused_variant_and_goes_on(tmp_path):
    """A variant whose parameters the kernel refuses (here `group_folds` without persistent
    programs) is reported as refused in the check and in the row, with the reason; the
    other backends are still checked and timed."""
    bad = "mosaic_gpu:group_folds=true"
    result = verify_bench.main(["--smoke", "--batches", "2", "--cache-lens", "8", "--widths", "2",
                                "--backends", f"mosaic_gpu,{bad}", "--out", str(tmp_path / "v.json")])
    checked = result["check"]["backends"]
    assert "group_folds copies an exact fold's key records" in checked[bad]["refused"]
    assert checked["mosaic_gpu"].pop("write_pos_equal") and max(checked["mosaic_gpu"].values()) < 1e-4
    (row,) = result["rows"]
    assert "group_folds copies" in row["backends"][bad]["refused"]
    assert row["backends"]["mosaic_gpu"]["nonflush_us"] > 0


@pytest.mark.parametrize("cache_len,width,accepted,want", [
    (16, 4, 4, 1 / 4),   # 0, 4, 8, 12 fit; 16 folds, the window lands at 0 -> 4
    (16, 4, 2, 1 / 7),   # 0, 2, .., 12 fit (7 steps), 14 folds -> 2: a 7-step cycle
    (4, 4, 1, 1.0),      # T = L: every step after the first folds
    (32, 8, 6, 1 / 5),   # 0, 6, .., 24 fit (24 + 8 = 32); 30 folds -> 6: cycle 6, 12, 18, 24, 30
])
def test_flush_fraction_follows_the_capacity_rule(cache_len, width, accepted, want):
    assert verify_bench.flush_fraction(cache_len, width, accepted) == pytest.approx(want)


def test_prefill_bench_smoke(tmp_path):
    import prefill_bench

    rows = prefill_bench.main(["--smoke", "--repeats", "1", "--out", str(tmp_path / "p.json")])
    assert rows and all(r["final_state_rel_err"] < 1e-5 for r in rows)
    assert json.loads((tmp_path / "p.json").read_text())["rows"] == json.loads(json.dumps(rows))


LOOP_PTX = """
.visible .entry k(
)
.maxntid 128, 1, 1
{
\tmov.u64 \t%rd1, 0;
\tadd.s64 \t%rd2, %rd1, 64;
\tmov.u32 \t%r1, 0;
\tadd.s32 \t%r9, %r1, 1;
$L__BB0_1:
\tld.shared.f32 \t%f1, [%rd2];
\tadd.s32 \t%r1, %r1, 1;
\tsetp.lt.s32 \t%p1, %r1, 8;
\t@%p1 bra \t$L__BB0_1;
\tret;
}
"""


def test_live_into_loops_counts_values_defined_before_a_loop_and_used_in_it():
    # %rd2 (an address) and %r1 (the counter) are defined before the loop and used in it;
    # %rd1 and %r9 are not used in it.
    assert mosaic_registers.live_into_loops(LOOP_PTX) == {"rd": 1, "r": 1}
    assert mosaic_registers.live_into_loops(LOOP_PTX.replace("@%p1 bra \t$L__BB0_1;", "")) == {}
    budgeted = mosaic_registers.with_budget(LOOP_PTX, 3, "8.7")
    assert ".maxntid 128, 1, 1\n.minnctapersm 3" in budgeted
    assert mosaic_registers.with_budget(budgeted, 2).count(".minnctapersm 2") == 1


def test_mosaic_registers_on_the_gdn_kernel_dumped_on_the_h200(tmp_path):
    """The GDN bf16 decode kernel (L = 16, B = 512) as Mosaic built it on the H200: about a
    hundred 64-bit values (shared-memory addresses) computed before its persistent loop live
    in it, and ptxas takes 255 registers where Mosaic asks one CTA per SM but fits 168 (with
    spills) when asked for three, as it did on the GPU."""
    pytest.importorskip("triton")
    raw = pathlib.Path(__file__).resolve().parents[1] / "benchmarks/results/raw"
    with tarfile.open(raw / "h200_2026-12-04_r13_gdn_bf16_ptx.tar.gz") as tar:
        dump = tar.extractfile("ptx_chunk4.txt").read().decode()
    (ptx,) = mosaic_registers.kernel_ptx(dump)
    path = tmp_path / "gdn.ptx"
    path.write_text(ptx)
    (row,) = mosaic_registers.analyse([str(path)], [1, 3])
    assert row["live_into_loop"]["rd"] >= 100
    assert row["ctas_per_sm=1"]["registers"] > 168 >= row["ctas_per_sm=3"]["registers"]
    assert row["ctas_per_sm=1"]["spill_store_bytes"] == 0 < row["ctas_per_sm=3"]["spill_store_bytes"]


@pytest.mark.parametrize("spec", ["mamba2:float32:8:4:chunk=1,readout=fma", "verify:float32:16:8",
                                  # Fields valid only with the defaults' others (four warpgroups
                                  # need their auto_barriers=False), with or without `default,`.
                                  "gdn:bfloat16:16:512:warpgroups=4,programs=528,operands_in_tile=true,rebuild=3xtf32",
                                  "gdn:bfloat16:16:512:default,warpgroups=4,operands_in_tile=true,rebuild=3xtf32"])
def test_mosaic_registers_builds_each_variant_up_to_the_gpu_compile(spec):
    """`--dump`'s compile step parses the variant, merges its fields into the backend's
    defaults and lowers the kernel; off GPU Mosaic stops there (it compiles on a GPU only)."""
    with pytest.raises(ValueError, match="Only interpret mode is supported on CPU"):
        mosaic_registers.compile_variant(spec)


def _region(tid, name, begin_cycles, end_cycles):
    """A region's begin and end events as Mosaic's profiler writes them (`ts`: cycles / 1000)."""
    return [dict(name=name, ph="B", ts=begin_cycles / 1e3, pid=1, tid=tid),
            dict(name=name, ph="E", ts=end_cycles / 1e3, pid=1, tid=tid)]


def test_mosaic_profile_sums_each_region_over_the_tiles():
    b, e = _region(1, "tile", 0, 1000)
    events = ([b, *_region(1, "readout", 100, 400), e] + _region(2, "tile", 5000, 5500)
              + [dict(b, ts=1.0), *_region(1, "readout", 1200, 1300), dict(e, ts=2.0)])
    table = mosaic_profile.region_table(mosaic_profile.region_cycles({"traceEvents": events}))
    assert list(table) == ["tile", "readout"]  # most cycles first
    assert table["tile"] == dict(count=3, median_cycles=1000, total_cycles=2500, cycles_per_tile=2500 / 3)
    assert table["readout"] == dict(count=2, median_cycles=200, total_cycles=400, cycles_per_tile=400 / 3)
    no_tiles = mosaic_profile.region_table(mosaic_profile.region_cycles({"traceEvents": _region(3, "wait", 0, 7)}))
    assert no_tiles["wait"]["cycles_per_tile"] is None
    crossed = [*_region(1, "tile", 0, 10)[:1], *_region(1, "wait", 1, 5)[:1], *_region(1, "tile", 0, 10)[1:]]
    with pytest.raises(ValueError, match="closed while 'wait' was open"):
        mosaic_profile.region_cycles({"traceEvents": crossed})


def test_mosaic_profile_smoke_leaves_the_environment_as_it_was(tmp_path, monkeypatch):
    monkeypatch.delenv(mosaic_profile.PROFILE_DIR_ENV, raising=False)
    out = tmp_path / "profile.json"
    result = mosaic_profile.main(["--smoke", "--kernel", "verify", "--width", "2", "--out", str(out),
                                  "--trace-dir", str(tmp_path / "traces")])
    saved = json.loads(out.read_text())
    assert saved["meta"]["kernel"] == "verify" and saved["meta"]["kernel_params"].startswith("MosaicReplayParams(")
    assert saved["kernels"] == result["kernels"] == {}  # interpret mode has no profiler
    assert mosaic_profile.PROFILE_DIR_ENV not in os.environ
    with pytest.raises(SystemExit):
        mosaic_profile.parse_args(["--kernel", "verify", "--gate", "mamba2"])


def test_resident_slots_put_every_row_on_a_small_pool():
    """`--resident-slots K`: one slot set whose B rows share K slots, each slot on B / K rows,
    in a pool of K slots, and the sweeps' timers use it (the Mosaic step's pool has K slots)."""
    import numpy as np

    sets, num_slots = decode_bench.slot_sets(12, 1 << 20, np.random.default_rng(0), False, resident_slots=4)
    assert sets.shape == (1, 12) and num_slots == 4
    np.testing.assert_array_equal(np.bincount(sets[0], minlength=4), [3, 3, 3, 3])
    rotated, rotated_slots = decode_bench.slot_sets(12, 1 << 20, np.random.default_rng(0), False)
    assert rotated_slots >= 24 and len(set(rotated.ravel().tolist())) == rotated.size  # disjoint sets

    class Recorder(decode_bench.Timer):
        def kernel_times(self, fn, args, name, iterations):
            self.args = args
            return super().kernel_times(fn, args, name, iterations)

    cfg = mosaic_bench.gdn_config(True, 8, "float32")
    timer = Recorder(True, resident_slots=1)
    params = mosaic_bench.effective_params("default", cfg, 2)
    mosaic_bench.time_mosaic(timer, cfg, 2, np.random.default_rng(0), 1, True, False, params)
    pool, sets = timer.args[:2]
    assert pool.checkpoint.shape[0] == 1 and np.asarray(sets).tolist() == [[0, 0]]
    with pytest.raises(SystemExit, match="--resident-slots must be >= 0"):
        mosaic_bench.main(["--smoke", "--resident-slots", "-1"])


def test_verify_bench_resident_slots_time_one_small_pool():
    """`verify_bench --resident-slots K`: the conventional baseline and every verify step time
    one slot set on a pool of K slots (one row per slot here: K = B)."""
    import numpy as np

    calls = []

    class Recorder(decode_bench.Timer):
        def kernel_times(self, fn, args, name, iterations):
            calls.append(args)
            return super().kernel_times(fn, args, name, iterations)

    shape = decode_bench.Shape(1, 2, 64)
    row = verify_bench.bench_row(Recorder(True, resident_slots=2), shape, jnp.float32, 8, 2, 2, 1000.0, 1, True,
                                 ["mosaic_gpu"])
    assert row["slot_sets"] == 1 and len(calls) == 3  # conventional, non-flush, flush
    conventional, *steps = calls
    assert all(buffer.shape[0] == 2 for buffer in conventional[0])
    for state, sets, *_ in steps:
        assert state.checkpoint.shape[0] == 2 and sorted(np.asarray(sets).ravel().tolist()) == [0, 1]
    with pytest.raises(SystemExit, match="--resident-slots must be >= 0"):
        verify_bench.main(["--smoke", "--resident-slots", "-1"])
