"""Properties of the pallas_triton backend's launch table (not its rows restated).

Every (step, gate, state bytes, batch, cache length) finds a row; every row is reached by
some layer and batch; each row names the results file behind it; each kernel lowers for an
abstract H200 under its own `pallas_call` name, and every row (with the `triton` extra)
compiles for sm_90a without spills. Each row against the xla backend: test_pallas_kernels.py.
"""

from __future__ import annotations

import itertools
import pathlib
import re
import sys

import jax.numpy as jnp
import pytest

import replayssm_jax as R
from pallas_kernels.fold_decode import FoldParams
from pallas_kernels.mamba2_decode import Mamba2PlainParams, Mamba2ReplayParams
from pallas_kernels.plain_decode import PlainParams
from pallas_kernels.replay_decode import ReplayTileParams
from pallas_kernels.replay_decode_grouped import ReplayGroupedParams
from pallas_kernels.verify_readout import VerifyReadoutParams
from replayssm_jax.backends import pallas_triton
from replayssm_jax.backends.pallas_triton import LAUNCH_TABLE, launch_row

ROOT = pathlib.Path(__file__).resolve().parents[1]
RAW = ROOT / "benchmarks" / "results" / "raw"
GATES, STATE_BYTES = ("gdn", "kda", "mamba2"), (4, 2)
BATCHES = [*range(1, 300), 511, 512, 513, 1024, 4096]
DELTA_STEP_TYPES = {"plain": (PlainParams,), "fold": (FoldParams,), "replay": (ReplayGroupedParams, ReplayTileParams),
                    "verify": (VerifyReadoutParams,)}
MAMBA2_STEP_TYPES = {"plain": (Mamba2PlainParams,), "fold": (Mamba2ReplayParams,), "replay": (Mamba2ReplayParams,)}


def step_types(gate: str) -> dict[str, tuple[type, ...]]:
    return MAMBA2_STEP_TYPES if gate == "mamba2" else DELTA_STEP_TYPES


def _cache_lens(step: str) -> tuple[int, ...]:
    return (1,) if step == "plain" else (2, 3, 8, 13, 16, 17, 32, 64)


def reachable_cases(row) -> list[tuple[str, int, int, int]]:
    """The `(gate, state bytes, batch, cache length)` sampled here at which `row` is chosen."""
    return [(gate, nbytes, batch, length)
            for gate, nbytes, length in itertools.product(GATES, STATE_BYTES, _cache_lens(row.step))
            for batch in BATCHES
            if row.matches(row.step, gate, nbytes, batch, length)
            and launch_row(row.step, gate, nbytes, batch, length) is row]


ROW_IDS = [f"{i}-{row.step}-{row.gate}-{row.state_bytes}-B{row.batch[0]}-L{row.cache_len[0]}"
           for i, row in enumerate(LAUNCH_TABLE)]


@pytest.mark.parametrize("step", list(DELTA_STEP_TYPES))
def test_every_layer_and_batch_finds_a_row_of_its_step(step):
    gates = [gate for gate in GATES if step in step_types(gate)]  # verify: the delta-rule gates
    for gate, nbytes, length, batch in itertools.product(gates, STATE_BYTES, _cache_lens(step), BATCHES):
        row = launch_row(step, gate, nbytes, batch, length)
        assert row.step == step and isinstance(row.params, step_types(gate)[step]), (gate, row)


@pytest.mark.parametrize("index", range(len(LAUNCH_TABLE)), ids=ROW_IDS)
def test_every_row_is_reachable_and_cites_its_results(index):
    row = LAUNCH_TABLE[index]
    cases = reachable_cases(row)
    assert cases, f"row {index} is shadowed by the rows before it: {row}"
    assert all(isinstance(row.params, step_types(gate)[row.step]) for gate, *_ in cases), row
    if not row.source.startswith("untuned"):
        assert (RAW / row.source).is_file(), f"row {index} cites a missing results file {row.source}"


def test_lookup_is_the_first_matching_row():
    for gate, nbytes, batch, length in [("gdn", 4, 1, 16), ("kda", 2, 100, 32), ("gdn", 2, 600, 3)]:
        for step in DELTA_STEP_TYPES:
            first = next(r for r in LAUNCH_TABLE if r.matches(step, gate, nbytes, batch, length))
            assert launch_row(step, gate, nbytes, batch, length) is first


def test_policy_and_cache_length_pick_the_step():
    cfg = R.ReplayConfig(2, 4, 32, 32, 16)
    assert pallas_triton.step_kind(cfg, R.FlushPolicy.NATURAL) == "replay"
    assert pallas_triton.step_kind(cfg, R.FlushPolicy.EVERY_STEP) == "fold"
    one = R.ReplayConfig(2, 4, 32, 32, 1)
    assert {pallas_triton.step_kind(one, p) for p in R.FlushPolicy} == {"plain"}
    with pytest.raises(ValueError, match="kernel_params must be FoldParams"):
        pallas_triton.launch_params(cfg, 4, R.FlushPolicy.EVERY_STEP, ReplayGroupedParams())
    with pytest.raises(ValueError, match="kernel_params must be PlainParams"):
        pallas_triton.launch_params(one, 4, R.FlushPolicy.NATURAL, FoldParams())


# ---------------------------------------------------------------- lowering and compiling for an H200

sys.path.insert(0, str(ROOT / "benchmarks"))
import kernel_registers  # noqa: E402

KERNEL_NAMES = {PlainParams: "plain_decode", FoldParams: "replayssm_fold_decode",
                ReplayTileParams: "replayssm_replay_decode", ReplayGroupedParams: "replayssm_replay_decode_grouped",
                Mamba2PlainParams: "mamba2_plain_decode", Mamba2ReplayParams: "replayssm_mamba2_decode",
                VerifyReadoutParams: "replayssm_verify_readout"}


def _h200_config(gate: str, nbytes: int, cache_len: int) -> R.ReplayConfig:
    dtype = jnp.float32 if nbytes == 4 else jnp.bfloat16
    if gate == "mamba2":  # Nemotron-H-8B's head dim, state size and heads per group
        return R.ReplayConfig.mamba2(32, 64, 128, 2, cache_len, state_dtype=dtype, cache_dtype=dtype)
    return R.ReplayConfig(16 if gate == "gdn" else 32, 32, 128, 128, cache_len, gate=gate,
                          state_dtype=dtype, cache_dtype=dtype)


@pytest.mark.parametrize("params", [PlainParams(), FoldParams(), ReplayTileParams(), ReplayGroupedParams(),
                                    Mamba2PlainParams(), Mamba2ReplayParams(), VerifyReadoutParams()], ids=repr)
def test_each_kernel_lowers_under_its_own_name(params):
    # A profile tells the kernels apart by their pallas_call names.
    gate = "mamba2" if isinstance(params, (Mamba2PlainParams, Mamba2ReplayParams)) else "gdn"
    cfg = _h200_config(gate, 4, 1 if isinstance(params, (PlainParams, Mamba2PlainParams)) else 13)
    ir = kernel_registers.kernel_ir(cfg, params, 8)
    assert re.findall(r"tt\.func \w* ?@(\w+)", ir) == [KERNEL_NAMES[type(params)]]


MAMBA2_ROWS = [i for i, row in enumerate(LAUNCH_TABLE) if row.gate == "mamba2"]


@pytest.mark.parametrize("index", MAMBA2_ROWS, ids=[ROW_IDS[i] for i in MAMBA2_ROWS])
def test_every_mamba2_row_lowers_for_h200(index):
    """Each Mamba-2 row's kernel lowers to Triton IR for an abstract H200 with either state
    dtype, at the two cache lengths its loops see (the compile test below needs triton)."""
    row = LAUNCH_TABLE[index]
    for nbytes, length in itertools.product(STATE_BYTES, (1,) if row.step == "plain" else (2, 32)):
        ir = kernel_registers.kernel_ir(_h200_config("mamba2", nbytes, length), row.params, 8)
        assert re.findall(r"tt\.func \w* ?@(\w+)", ir) == [KERNEL_NAMES[type(row.params)]]


@pytest.mark.parametrize("index", range(len(LAUNCH_TABLE)), ids=ROW_IDS)
def test_every_row_compiles_for_sm90_without_spills(index):
    """Triton 3.6 (the GPU image's) runs its passes on the row's IR and ptxas builds it for
    sm_90a, for each gate and state size that reaches the row, at H200 shapes. A spilling
    kernel measured 2-6x slower, so the table's launches must not spill."""
    pytest.importorskip("triton", reason="compiling needs the `triton` extra")
    row = LAUNCH_TABLE[index]
    for gate, nbytes in {(gate, nbytes) for gate, nbytes, *_ in reachable_cases(row)}:
        cfg = _h200_config(gate, nbytes, 1 if row.step == "plain" else 13)
        report = kernel_registers.ptxas_report(kernel_registers.kernel_ir(cfg, row.params, 8), row.params)
        assert 0 < report["registers"] <= 255
        assert report["spill_store_bytes"] == report["spill_load_bytes"] == 0, (gate, nbytes, report)
