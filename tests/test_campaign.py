"""The fault commands: a seeded campaign replays exactly and reports zero losses; the matrix
command prints its table and fails (exit 1) when a cell fails."""

from __future__ import annotations

import os

import pytest

from faults.campaign import run_campaign
from faults.matrix import Cell, Outcome, format_summary

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
@pytest.mark.xdist_group("faults-campaign")
def test_campaign_is_seeded_and_loses_nothing():
    logs_a, logs_b = [], []
    a = run_campaign(7, 3, world_sizes=(1, 2), log=logs_a.append)
    run_campaign(7, 3, world_sizes=(1, 2), log=logs_b.append)

    def strip(lines):  # drop timings
        return [line.rsplit(" (", 1)[0] for line in lines]

    assert strip(logs_a) == strip(logs_b), "the same seed must replay the same faults"
    assert a.rounds == 3 and a.faults_injected >= 3 and a.resumes_checked > 0
    assert a.checkpoints_lost == 0 and a.hangs == 0 and not a.failures, a.failures
    table = a.table()
    assert "checkpoints lost (must be 0)  0" in table and "hangs (must be 0)" in table


def test_summary_marks_a_failed_cell():
    good = Outcome(Cell("crash", "publish", "coordinator", 2, "sync"), True, "", 0.1)
    bad = Outcome(Cell("crash", "publish", "coordinator", 2, "async"), False, "resumed step 2", 0.1)
    text = format_summary([good, bad])
    assert "| crash | publish | ✅ 1/1 | ❌ 0/1 |" in text
    assert "1/2 cells passed (1 failed)" in text


def test_matrix_command_runs_a_selection(capsys):
    from faults.__main__ import main

    assert main(["matrix", "--world-sizes", "1", "--modes", "sync", "--kinds", "stale_pointer,nul_pointer"]) == 0
    out = capsys.readouterr().out
    assert "| stale_pointer | after-save | ✅ 1/1 |" in out
    assert "2/2 cells passed (0 failed)" in out
