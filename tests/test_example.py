"""The README's main job keeps working: a small run of ``refckpt example`` resumes bitwise."""

from __future__ import annotations

from refckpt.tools.example import run_example


def test_example_resumes_bitwise(tmp_path, capsys):
    assert run_example(str(tmp_path / "ckpt"), world_size=2, steps=4, every=2, start_method="forkserver") == 0
    out = capsys.readouterr().out
    assert "params+moments bitwise equal to step 4: True" in out
    assert "OK: resumed state is bitwise what was saved" in out
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == [
        "global_step_2", "global_step_4", "latest_checkpoint_iteration.txt"]
