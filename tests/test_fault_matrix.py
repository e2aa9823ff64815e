"""Every cell of the fault matrix (faults.matrix.cells()): fault kind x protocol step x target
x world size (1, 2, 4) x sync/async, injected for real against refckpt.

Process events are cells too: a real SIGINT (KeyboardInterrupt) or SIGTERM whose handler calls
``sys.exit`` at every crash point on the coordinator, a non-coordinator and every rank (the
interrupted rank raises the interrupt itself, the others agree within the deadline, an
acknowledged step loads bitwise, the same objects save again); one rank's bad state; interpreter
exit with an async save in flight; fork during a save.

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
INTERRUPTS = {"sigint_in_save", "sigterm_in_save"}
#: Cells that start interpreters of their own (exit, fork): the default run has the same scripts for
#: refckpt in faults.suite's test_process_events; these cells are in the extended profile.
WHOLE_INTERPRETERS = {"exit_with_async_save", "fork_during_save"}


@pytest.fixture(scope="session")
def matrix_worlds(world_factory):
    worlds = Worlds(world_factory.get)
    yield worlds
    worlds.close()  # the saved steps cells copy (the reused worlds are the factory's)


def _group(i: int, c) -> str:
    """Cells share reused worlds per xdist group; two groups per (size, mode, crash/other) keep
    the 4-rank groups (about 40-50 cells of ~4 s each) from becoming the run's longest chain."""
    return f"faults-matrix-w{c.world_size}-{c.mode}-{'crash' if c.kind == 'crash' else 'other'}-{i % 2}"


def _extended(c) -> bool:
    """A 4-rank cell is in the extended profile (conftest.py): 4 ranks on 2 cores made those cells
    about a seventh of `pytest -n 8`'s CPU, and their kinds and points all run at 1 and 2 ranks in
    the default run. Of the interrupt cells (2 signals x every point x target x size x mode), the
    default run keeps one cell per point at 2 ranks, sync -- its target rotating along the points
    (coordinator, non-coordinator, all), SIGINT and SIGTERM alternating -- and the extended profile
    runs the rest. Of the 2-rank crash
    cells (a fresh world each, the matrix's costliest), the default run keeps one mode per (point,
    target) -- sync and async alternating along the points, async where a point is async-only --
    and runs every 1-rank crash cell in both modes; the extended profile runs the other mode."""
    if c.world_size >= 4 or c.kind in WHOLE_INTERPRETERS:
        return True
    if c.kind in INTERRUPTS:
        return not (c.world_size == 2 and c.mode == "sync" and c.kind == _default_signal(c)
                    and c.target == _default_target(c))
    if c.kind == "crash" and c.world_size == 2:
        return c.mode != _default_mode(c)
    return False


def _point(c):
    """The cell's crash point and its index in ``CRASH_POINTS``."""
    from faults.points import CRASH_POINTS

    i = [p.name for p in CRASH_POINTS].index(c.where)
    return i, CRASH_POINTS[i]


def _alternate(c) -> int:
    """0 or 1, alternating along the crash points and their targets."""
    return (_point(c)[0] + ("coordinator", "non-coordinator", "all").index(c.target)) % 2


def _default_signal(c) -> str:
    return "sigint_in_save" if _alternate(c) == 0 else "sigterm_in_save"


def _default_target(c) -> str:
    """The interrupt cell's target the default run keeps at a point: the coordinator where the point
    is coordinator-only, else coordinator, non-coordinator and all ranks in turn along the points."""
    i, point = _point(c)
    return "coordinator" if point.coordinator_only else ("coordinator", "non-coordinator", "all")[i % 3]


def _default_mode(c) -> str:
    if _point(c)[1].async_only:
        return "async"
    return "sync" if _alternate(c) == 0 else "async"


def _marks(i: int, c) -> list:
    """The cell's xdist group, and the extended mark (:func:`_extended`)."""
    marks = [pytest.mark.xdist_group(_group(i, c))]
    return marks + [pytest.mark.extended] if _extended(c) else marks


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
    assert kinds == ({str(k) for k in FaultKind} - {"async_persist_fails", "async_persist_killed"}), kinds
    assert {str(k) for k in PROCESS_EVENTS} <= kinds
    for p in CRASH_POINTS:
        for w in (1, 2, 4):
            for mode in (("async",) if p.async_only else ("sync", "async")):
                for kind in ("crash", "sigint_in_save", "sigterm_in_save"):
                    targets = {c.target for c in CELLS if c.kind == kind and c.where == p.name and c.world_size == w
                               and c.mode == mode}
                    # every rank of one, the coordinator, a non-coordinator, all ranks
                    want = ({"coordinator"} if w == 1 or p.coordinator_only
                            else {"coordinator", "non-coordinator", "all"})
                    assert targets == want, (kind, p.name, w, mode, targets)
    assert {(c.where, c.world_size, c.mode) for c in CELLS if c.kind == "caller_error_one_rank"} == {
        (v, w, m) for v in ("unpicklable_extra", "meta_tensor") for w in (2, 4) for m in ("sync", "async")}
    assert {c.where for c in CELLS if c.kind in ("exit_with_async_save", "fork_during_save")} == {
        "plain", "atexit", "child-resumes"}
    assert len(DISK_FAULTS) == 19
    assert {(c.where, c.world_size, c.mode) for c in CELLS if c.kind == "second_writer"} == {
        (v, w, m) for v in ("same_step", "different_steps") for w in (1, 2) for m in ("sync", "async")}
    # async persist failures and kills are the async cells of the I/O-error and crash kinds
    assert any(c.kind == "enospc_fsync" and c.mode == "async" for c in CELLS)
    assert any(c.kind == "crash" and c.where.startswith("shard") and c.mode == "async" for c in CELLS)


def test_the_four_rank_cells_are_the_extended_profile(request):
    """Every 4-rank cell, the interrupt cells beyond one per point (at 2 ranks, sync) and
    the 2-rank crash cells beyond one mode per point and target are marked extended (and only
    those): `pytest -n 8` skips them, saying which command runs them, and .ci/run runs that
    command; every kind and point runs at 2 ranks in the default run (and every kind but the
    interrupts at 1), every crash point in each of its modes at 1 rank."""
    import conftest

    for i, c in enumerate(CELLS):
        assert any(m.name == "extended" for m in _marks(i, c)) == (c.world_size == 4 or c.kind in WHOLE_INTERPRETERS or (
            c.kind in INTERRUPTS and (c.world_size, c.mode, c.kind, c.target) != (
                2, "sync", _default_signal(c), _default_target(c))) or (
            c.kind == "crash" and c.world_size == 2 and c.mode != _default_mode(c))), c.id
    default = [c for c in CELLS if c.kind in INTERRUPTS and not _extended(c)]
    assert sorted(c.where for c in default) == sorted({c.where for c in CELLS if c.kind in INTERRUPTS and c.world_size == 2
                                                       and c.mode == "sync"})  # each point (sync at 2 ranks) once
    assert {c.kind for c in default} == INTERRUPTS  # both signals
    assert {c.target for c in default} == {"coordinator", "non-coordinator", "all"}  # every target
    assert {(c.world_size, c.mode) for c in default} == {(2, "sync")}
    crashes = [c for c in CELLS if c.kind == "crash" and not _extended(c)]
    two = {(c.where, c.target) for c in crashes if c.world_size == 2}
    assert two == {(c.where, c.target) for c in CELLS if c.kind == "crash" and c.world_size == 2}  # every point and target
    assert len(two) == len([c for c in crashes if c.world_size == 2])  # in one mode each
    assert {c.mode for c in crashes if c.world_size == 2} == {"sync", "async"}  # both modes
    assert {(c.where, c.mode) for c in crashes if c.world_size == 1} == {
        (c.where, c.mode) for c in CELLS if c.kind == "crash" and c.world_size == 1}  # every point, each of its modes
    # the skips, wherever this run collected cells (the whole run does; `-k` may select none)
    for item in [i for i in request.session.items if i.nodeid.startswith("tests/test_fault_matrix.py::test_fault_cell[")]:
        cell = next(c for c in CELLS if f"[{c.id}]" in item.name)
        four = _extended(cell)
        assert (item.get_closest_marker("extended") is not None) == four, item.nodeid
        skips = [m.kwargs.get("reason") for m in item.iter_markers("skip")]
        if four and not request.config.getoption("--extended"):
            assert skips == [conftest.EXTENDED_SKIP], (item.nodeid, skips)
        elif not four:
            assert not skips, item.nodeid
    small = {(c.kind, c.where, c.mode) for c in CELLS if c.world_size < 4}
    assert {(c.kind, c.where, c.mode) for c in CELLS if c.world_size == 4} <= small
