"""``python -m faults demo``: a rank SIGKILLed in the middle of a save on 2 gloo ranks, resumed bitwise.

The demo lives in the harness (it injects the crash), not in the library's ``refckpt`` command;
what it leaves on disk is read back with the library's own ``refckpt ls`` and ``inspect``.
"""

from __future__ import annotations

import json

from faults.__main__ import main as faults_main
from refckpt.tools.cli import main as refckpt_main

from ._builders import run_main


def demo(capsys, *argv):
    return run_main(faults_main, capsys, "demo", *argv)


def cli(capsys, *argv):
    return run_main(refckpt_main, capsys, *argv)


def test_demo_crashes_a_rank_mid_save_and_resumes_bitwise(capsys, tmp_path):
    root = tmp_path / "demo"
    code, out, err = demo(capsys, "--dir", root)
    assert code == 0, out + err
    assert "rank 1 killed by SIGKILL in the middle of the save of step 6" in out
    for rank in (0, 1):
        assert (f"rank {rank}: loaded global_step_4 (the newest complete step: the last acknowledged save); params, optimizer "
                f"moments and extra state bitwise equal to an uninterrupted run at step 4: True") in out
    assert "bitwise equal to an uninterrupted run at step 6 on every rank: True" in out
    assert out.rstrip().endswith("OK: the crash lost only the unacknowledged save; resume was bitwise exact")
    # What it left behind, read by the other commands: two ranks, per-rank extra state.
    code, out, _ = cli(capsys, "ls", "--json", root)
    data = json.loads(out)
    assert [(s["step"], s["state"], s["world_size"]) for s in data["steps"]] == [(4, "complete", 2), (2, "complete", 2)]
    assert data["resume_step"] == 4 and data["pointer"]["note"] == "agrees with resume"
    code, out, _ = cli(capsys, "inspect", "--json", root)
    data = json.loads(out)
    assert code == 0 and data["world_size"] == 2 and data["extra_state"]["files"] == 2
    assert set(data["extra_state"]["keys"]) == {"global_step", "rng", "rank", "data_position"}
    files = {c["file"] for e in data["entries"] if e["kind"] == "tensor" for c in e["chunks"]}
    assert files <= {"__0_0.safetensors", "__1_0.safetensors"} and files
    assert demo(capsys, "--dir", root)[0] == 2  # refuses a non-empty directory
