"""The shipped resilience suite as a user runs it (``pytest --pyargs faults.suite``, installed
package, ``--checkpointer`` options), as mutation testing: the independent checkpointer on
plain DCP passes, and every one-bug mutant in ``tests/mutants.py`` is failed. The kill matrix
is printed (``-s`` or the captured output of a failure shows it).

refckpt itself goes through the suite in this repository's own run: ``faults/suite`` is in
``testpaths``, judged with the default ``--checkpointer``."""

from __future__ import annotations

import os

import pytest

from faults.killmatrix import format_matrix, run, verdict
from tests.mutants import MUTANTS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow(seconds=90)
@pytest.mark.xdist_group("faults-killmatrix")
def test_every_mutant_is_killed_and_the_independent_checkpointer_passes():
    mutants = [f"tests.mutants:{name}" for name in MUTANTS]
    assert len(mutants) >= 10
    out = run(["tests.independent_ckpt:make"], mutants, workers=1, budget=2, world_sizes="2", cwd=ROOT)
    table = format_matrix(out)
    print(table)
    ok, wrong = verdict(out)
    assert ok, "\n".join(wrong) + "\n" + table
    assert out["results"]["tests.independent_ckpt:make"]["passed"], table
