"""Every cell of the fault matrix (faults.matrix.cells()): fault kind x protocol step x target
x world size (1, 2, 4) x sync/async, injected for real against refckpt.

Crash cells SIGKILL ranks inside fresh (forkserver) worlds; everything else and every resume
check runs in reused worlds. Each cell asserts the invariants of docs/design.md's fault model:
resume lands on the newest complete step on every rank, bitwise equal to an uninterrupted
run at that step, no acknowledged save is lost, training continued from it stays bitwise
equal, the next save works and leaves nothing behind; I/O errors raise on every rank and
move nothing; a dead or hung peer turns into an error on every survivor in bounded time.
"""

from __future__ import annotations

import pytest

from faults.matrix import Worlds, cells, run_cell

CELLS = cells()


@pytest.fixture(scope="session")
def matrix_worlds(world_factory):
    worlds = Worlds(world_factory.get)
    yield worlds
    worlds.close()  # the saved steps cells copy (the reused worlds are the factory's)


def _group(i: int, c) -> str:
    """Cells share reused worlds per xdist group; two groups per (size, mode, crash/other) keep
    the 4-rank groups (about 40-50 cells of ~4 s each) from becoming the run's longest chain."""
    return f"faults-matrix-w{c.world_size}-{c.mode}-{'crash' if c.kind == 'crash' else 'other'}-{i % 2}"


def _marks(i: int, c) -> list:
    """The cell's xdist group; a 4-rank cell is in the extended profile (conftest.py): 4 ranks on 2 cores
    made those cells about a seventh of `pytest -n 8`'s CPU, and their kinds and points all run at
    1 and 2 ranks in the default run."""
    marks = [pytest.mark.xdist_group(_group(i, c))]
    return marks + [pytest.mark.extended] if c.world_size >= 4 else marks


@pytest.mark.parametrize("cell", [pytest.param(c, id=c.id, marks=_marks(i, c)) for i, c in enumerate(CELLS)])
def test_fault_cell(cell, matrix_worlds, tmp_path):
    outcome = run_cell(cell, matrix_worlds, str(tmp_path))
    if outcome.skipped:
        pytest.skip(outcome.skipped)
    assert outcome.ok, f"{cell.id}: {outcome.detail}"


def test_matrix_covers_every_point_kind_size_and_mode():
    from faults.inject import DISK_FAULTS
    from faults.points import CRASH_POINTS, PROCESS_EVENTS, FaultKind

    kinds = {c.kind for c in CELLS}
    assert kinds == ({str(k) for k in FaultKind} - {"async_persist_fails", "async_persist_killed"}
                     - {str(k) for k in PROCESS_EVENTS}), kinds
    for p in CRASH_POINTS:
        for w in (1, 2, 4):
            for mode in (("async",) if p.async_only else ("sync", "async")):
                assert any(c.kind == "crash" and c.where == p.name and c.world_size == w and c.mode == mode for c in CELLS)
    assert len(DISK_FAULTS) == 19
    assert {(c.where, c.world_size, c.mode) for c in CELLS if c.kind == "second_writer"} == {
        (v, w, m) for v in ("same_step", "different_steps") for w in (1, 2) for m in ("sync", "async")}
    # async persist failures and kills are the async cells of the I/O-error and crash kinds
    assert any(c.kind == "enospc_fsync" and c.mode == "async" for c in CELLS)
    assert any(c.kind == "crash" and c.where.startswith("shard") and c.mode == "async" for c in CELLS)


def test_the_four_rank_cells_are_the_extended_profile(request):
    """Every 4-rank cell is marked extended (and only those): `pytest -n 8` skips them, saying which
    command runs them, and .ci/run runs that command; every kind and point also runs at 1 and 2 ranks."""
    import conftest

    for i, c in enumerate(CELLS):
        assert any(m.name == "extended" for m in _marks(i, c)) == (c.world_size == 4), c.id
    # the skips, wherever this run collected cells (the whole run does; `-k` may select none)
    for item in [i for i in request.session.items if i.nodeid.startswith("tests/test_fault_matrix.py::test_fault_cell[")]:
        four = "-w4-" in item.name
        assert (item.get_closest_marker("extended") is not None) == four, item.nodeid
        skips = [m.kwargs.get("reason") for m in item.iter_markers("skip")]
        if four and not request.config.getoption("--extended"):
            assert skips == [conftest.EXTENDED_SKIP], (item.nodeid, skips)
        elif not four:
            assert not skips, item.nodeid
    small = {(c.kind, c.where, c.mode) for c in CELLS if c.world_size < 4}
    assert {(c.kind, c.where, c.mode) for c in CELLS if c.world_size == 4} <= small
