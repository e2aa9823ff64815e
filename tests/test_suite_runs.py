"""The shipped resilience suite (``pytest --pyargs faults.suite``) runs from the installed
package with the plugin's ``--checkpointer`` option: refckpt and the independent checkpointer
pass it, and a mutant that trusts the pointer is caught."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _suite(checkpointer: str, budget: int = 3) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pytest", "--pyargs", "faults.suite", "-q", "-p", "no:cacheprovider",
         "-p", "no:randomly", f"--checkpointer={checkpointer}", f"--fault-budget={budget}",
         "--hypothesis-seed=0"],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
        env={**os.environ, "FAULTS_SUITE_NO_SHRINK": "1"},
    )


@pytest.mark.xdist_group("faults-suite")
@pytest.mark.parametrize("spec", ["refckpt:DistributedCheckpointer", "tests.independent_ckpt:make"])
def test_correct_checkpointers_pass_the_suite(spec):
    out = _suite(spec)
    assert out.returncode == 0, out.stdout[-3000:]
    assert "4 passed" in out.stdout


@pytest.mark.xdist_group("faults-suite")
def test_suite_kills_a_pointer_trusting_mutant():
    out = _suite("tests.mutants:TrustsPointer", budget=10)
    assert out.returncode == 1, out.stdout[-3000:]
    assert "test_resume_lands_on_newest_complete_step" in out.stdout
