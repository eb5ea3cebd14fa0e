"""The `python -m replayssm_jax check` main job and the subcommand dispatcher."""

from __future__ import annotations

import re

import pytest

from replayssm_jax import FlushPolicy, ReplayConfig, check_job, default_flush_policy
from replayssm_jax.__main__ import main as cli_main


@pytest.mark.parametrize("batch", [3, 9])  # the default policy for GDN: fold every step / replay
@pytest.mark.parametrize("gate", ["gdn", "kda"])
def test_check_job_reports_agreement(gate, batch, backend, capsys):
    argv = ["--steps", "12", "--cache-len", "4", "--batch", str(batch), "--gate", gate]
    status = check_job.main([*argv, "--backend", backend])
    out = capsys.readouterr().out
    assert status == 0, out
    assert "agreement: OK" in out
    errors = re.search(r"outputs (\S+), live state (\S+) \(tolerance", out)
    assert errors and max(map(float, errors.groups())) <= check_job.TOLERANCE, out
    # The default policy (on every backend) flushes every live row at every step at small
    # batch, and for KDA with a 4-byte state at every batch.
    config = ReplayConfig(check_job.NUM_K_HEADS, check_job.NUM_V_HEADS, check_job.HEAD_DIM,
                          check_job.HEAD_DIM, 4, gate=gate)
    every_step = batch == 3 or gate == "kda"
    assert (default_flush_policy(config, batch) is FlushPolicy.EVERY_STEP) == every_step
    if every_step:
        counts = re.search(r"flushes: 0 natural, (\d+) forced .*, (\d+) under the fold-every-step "
                           r"policy", out)
        assert counts and sum(map(int, counts.groups())) == 12 * batch, out
    else:
        assert re.search(r"flushes: [1-9]\d* natural", out), out
        assert "fold-every-step" not in out, out


def test_replay_traffic_counts_checkpoint_entries_and_flushes():
    config = ReplayConfig(num_k_heads=2, num_v_heads=4, head_k_dim=8, head_v_dim=16, cache_len=4)
    ckpt = 4 * 16 * 8 * 4
    entry = (4 * 16 + 2 * 8) * 4 + 4 * 4  # u per value head, k per key head, fp32 g per value head
    assert check_job.replay_traffic(config, 0, False) == check_job.Traffic(ckpt, entry)
    assert check_job.replay_traffic(config, 3, True) == check_job.Traffic(ckpt + 3 * entry, ckpt)
    assert check_job.plain_traffic(config) == check_job.Traffic(ckpt, ckpt)


def test_cli_without_command_lists_commands(capsys):
    assert cli_main([]) == 0
    out = capsys.readouterr().out
    assert "check" in out and "demo" in out


def test_cli_dispatches_check(capsys):
    assert cli_main(["check", "--steps", "3", "--cache-len", "2", "--batch", "2"]) == 0
    assert "agreement: OK" in capsys.readouterr().out


def test_cli_rejects_unknown_command():
    with pytest.raises(SystemExit):
        cli_main(["bogus"])
