"""The fault matrix: every (fault kind x protocol step x target x world size x sync/async)
cell that applies, a runner for one cell, and the table of outcomes.

``python -m faults matrix`` runs every cell and prints the table that the README shows;
the tests in ``tests/test_fault_matrix.py`` run the same cells through the same runner.
"""

from __future__ import annotations

import dataclasses
import os
import random
import shutil
import tempfile
import time
from typing import Any, Callable, Iterable

from . import world as _world
from .points import CRASH_POINTS, POINTS_BY_NAME, FaultKind, Role, Target, target_ranks

# Crash worlds are forked by the forkserver: preload what every cell imports.
for _mod in ("safetensors", "refckpt", "faults.inject", "faults.scenarios"):
    if _mod not in _world.FORKSERVER_PRELOAD:
        _world.FORKSERVER_PRELOAD.append(_mod)

__all__ = ["Cell", "Outcome", "cells", "run_cell", "Worlds", "format_table"]

WORLD_SIZES = (1, 2, 4)
MODES = ("sync", "async")
CRASH_TIMEOUT = 30.0
IO_KINDS = (FaultKind.ENOSPC_WRITE, FaultKind.ENOSPC_FSYNC, FaultKind.EIO_WRITE, FaultKind.EIO_FSYNC)
IO_ROLES = (Role.EXTRA_STATE, Role.SHARD, Role.COMMIT_TMP, Role.POINTER_TMP)
PARTIAL_VARIANTS = ("frozen", "never_grad", "before_first_step", "main_params")


@dataclasses.dataclass(frozen=True)
class Cell:
    kind: str
    where: str  # crash point, I/O role, disk fault, or variant
    target: str
    world_size: int
    mode: str

    @property
    def id(self) -> str:
        return f"{self.kind}-{self.where}-{self.target}-w{self.world_size}-{self.mode}"


@dataclasses.dataclass
class Outcome:
    cell: Cell
    ok: bool
    detail: str
    seconds: float


def _targets(world_size: int, coordinator_only: bool) -> list[Target]:
    if world_size == 1:
        return [Target.COORDINATOR]
    if coordinator_only:
        return [Target.COORDINATOR]
    return [Target.COORDINATOR, Target.NON_COORDINATOR, Target.ALL]


def cells(world_sizes: Iterable[int] = WORLD_SIZES, modes: Iterable[str] = MODES) -> list[Cell]:
    out: list[Cell] = []
    for w in world_sizes:
        for mode in modes:
            for p in CRASH_POINTS:
                if p.async_only and mode != "async":
                    continue
                for t in _targets(w, p.coordinator_only):
                    out.append(Cell(str(FaultKind.CRASH), p.name, str(t), w, mode))
            for kind in IO_KINDS:
                for role in IO_ROLES:
                    coord_only = role in (Role.COMMIT_TMP, Role.POINTER_TMP)
                    for t in _targets(w, coord_only):
                        out.append(Cell(str(kind), str(role), str(t), w, mode))
            from .inject import DISK_FAULTS

            for kind in DISK_FAULTS:
                t = Target.COORDINATOR if w == 1 else Target.NON_COORDINATOR
                out.append(Cell(str(kind), "after-save", str(t), w, mode))
            for variant in PARTIAL_VARIANTS:
                kind = FaultKind.PARTIAL_MAIN_PARAMS if variant == "main_params" else FaultKind.PARTIAL_OPTIMIZER
                out.append(Cell(str(kind), variant, "all", w, mode))
            if w > 1:
                for kind in (FaultKind.RANK_DIES_IN_COLLECTIVE, FaultKind.RANK_HANGS_IN_COLLECTIVE):
                    for phase in ("save", "load"):
                        if phase == "load" and mode == "async":
                            continue
                        out.append(Cell(str(kind), phase, str(Target.NON_COORDINATOR), w, mode))
    return out


class Worlds:
    """Reused worlds for the checks that no fault kills (one per size), plus fresh crash worlds."""

    def __init__(self, get: Callable[[int], Any] | None = None, backend: str = "gloo") -> None:
        self._own: dict[int, Any] = {}
        self._get = get
        self.backend = backend

    def get(self, n: int):
        if self._get is not None:
            return self._get(n)
        from .world import World

        w = self._own.get(n)
        if w is None or not w.alive:
            w = self._own[n] = World(n, self.backend, timeout=120, start_method="forkserver").start()
        return w

    def fresh(self, fn, n: int, *args, collect: bool = False, on_event=None, timeout: float = 120.0):
        from .world import World

        world = World(n, self.backend, timeout, start_method="forkserver")
        try:
            ev = on_event(world) if on_event is not None else None
            return world.run(fn, *args, timeout=timeout, on_event=ev, collect_failures=collect)
        finally:
            world.close()

    def close(self) -> None:
        for w in self._own.values():
            w.close()
        self._own.clear()


def _check(cond: bool, what: str, problems: list[str]) -> None:
    if not cond:
        problems.append(what)


def run_cell(cell: Cell, worlds: Worlds, root: str, seed: int = 0, then: FaultKind | None = None) -> Outcome:
    """Run one cell in ``root`` (an empty directory); ``ok`` iff every invariant held.

    ``then`` composes a pointer fault (one that never changes the right answer) with a crash
    cell: it is applied to the disk after the crash, before resuming.
    """
    from . import scenarios as sc
    from .inject import Action, DISK_FAULTS, crash_spec, io_error_spec, kill_on_event
    from .world import RankDied

    t0 = time.monotonic()
    problems: list[str] = []
    w, async_ = cell.world_size, cell.mode == "async"
    kind = FaultKind(cell.kind)
    detail = ""
    if kind is FaultKind.CRASH:
        point = POINTS_BY_NAME[cell.where]
        ranks = tuple(target_ranks(Target(cell.target), w))
        whole_job = Target(cell.target) is Target.ALL
        spec = crash_spec(point, ranks, Action.EMIT if whole_job else Action.KILL)
        keep = 1 if point.needs_retention else None
        try:
            res = worlds.fresh(sc.crash_cell, w, root, spec, async_, keep, CRASH_TIMEOUT,
                               on_event=(lambda world: kill_on_event(world)) if whole_job else None)
            problems.append(f"no rank died at {point.name}: {res}")
        except RankDied as e:
            detail = f"rank {e.rank} killed by {e.signal}"
        expected = 4 if point.publishes else 2
        if then is not None:
            fault = DISK_FAULTS[then]
            assert not fault.falls_back, f"{then} would change the expected step; compose pointer faults only"
            detail += "; then " + fault(root, os.path.join(root, f"global_step_{expected}"), 0, random.Random(seed))
        r = worlds.get(w).run(sc.resume_cell, root, expected)
        for rank, x in enumerate(r):
            _check(x["path"] == os.path.join(root, f"global_step_{expected}"), f"rank {rank} resumed {x['path']}, expected step {expected}", problems)
            _check(x["step"] == expected and x["rank_ok"], f"rank {rank} extra_state {x['step']}", problems)
            _check(x["exact"], f"rank {rank}: state differs from the uninterrupted run at step {expected}", problems)
            _check(x["continued_exact"], f"rank {rank}: training after resume diverged", problems)
            _check(x["exact2"] and x["path2"].endswith(f"global_step_{4 if expected == 2 else expected + 2}"),
                   f"rank {rank}: save after the crash did not resume exactly ({x['path2']})", problems)
            _check(not x["leftovers"], f"leftovers after the next save: {x['leftovers']}", problems)
        detail = f"{detail}; resumed step {expected} bitwise" if not problems else detail
    elif kind in IO_KINDS:
        role = Role(cell.where)
        ranks = tuple(target_ranks(Target(cell.target), w))
        spec = io_error_spec(kind, role, ranks)
        r = worlds.get(w).run(sc.io_error_cell, root, spec, async_)
        published = role is Role.POINTER_TMP  # the pointer is written after the step is committed
        for rank, x in enumerate(r):
            _check(x["error"] is not None and ("AsyncSaveFailedError" if async_ else "SaveFailedError") in x["error"],
                   f"rank {rank} did not raise: {x['error']}", problems)
            _check(x["pointer"] == "2\n", f"pointer moved to {x['pointer']!r}", problems)
            want = ["global_step_2", "latest_checkpoint_iteration.txt"] + (["global_step_4"] if published else [])
            _check(x["entries"] == sorted(want), f"entries {x['entries']}", problems)
        _check(any(x["fired"] for x in r), "fault never fired", problems)
        expected = 4 if published else 2
        rr = worlds.get(w).run(sc.resume_cell, root, expected)
        for rank, x in enumerate(rr):
            _check(x["exact"] and x["step"] == expected, f"rank {rank} resumed {x['path']} inexactly", problems)
            _check(x["exact2"] and not x["leftovers"], f"rank {rank}: next save failed ({x['leftovers']})", problems)
        detail = (r[0]["error"] or "")[:90]
    elif cell.kind in {str(k) for k in DISK_FAULTS}:
        fault = DISK_FAULTS[kind]
        worlds.get(w).run(sc.save_steps, root, [2, 4], save_async=async_)
        rank = 0 if Target(cell.target) is Target.COORDINATOR else w - 1
        detail = fault(root, os.path.join(root, "global_step_4"), rank, random.Random(seed))
        expected = 2 if fault.falls_back else 4
        r = worlds.get(w).run(sc.disk_resume_cell, root, expected)
        for rk, x in enumerate(r):
            _check(x["path"] == os.path.join(root, f"global_step_{expected}") and x["step"] == expected,
                   f"rank {rk} resumed {x['path']}, expected step {expected}", problems)
            _check(x["exact"], f"rank {rk}: state differs from step {expected}", problems)
        if kind in (FaultKind.BITFLIP_SHARD, FaultKind.CORRUPT_EXTRA_STATE):
            _check(all(x["fallback_warned"] for x in r), "fallback without the loud warning on every rank", problems)
    elif kind in (FaultKind.PARTIAL_OPTIMIZER, FaultKind.PARTIAL_MAIN_PARAMS):
        r = worlds.get(w).run(sc.partial_optimizer_cell, root, cell.where, async_)
        for rk, x in enumerate(r):
            if cell.where == "main_params":
                _check(x["error"] is not None and "fp32" in x["error"], f"rank {rk}: partial main params loaded: {x}", problems)
                continue
            _check(x["params_equal"] and x["present_equal"], f"rank {rk}: restored state differs", problems)
            _check(x["zeros_kept"], f"rank {rk}: absent entries not zero", problems)
            want_warn = 1 if x["n_absent"] else 0
            _check(len(x["warnings"]) == want_warn, f"rank {rk}: {len(x['warnings'])} warnings for {x['n_absent']} absent", problems)
        detail = r[0].get("warnings", [""])[0][-80:] if r and r[0].get("warnings") else str(r[0].get("error", ""))[:80]
    elif kind in (FaultKind.RANK_DIES_IN_COLLECTIVE, FaultKind.RANK_HANGS_IN_COLLECTIVE):
        action = Action.KILL if kind is FaultKind.RANK_DIES_IN_COLLECTIVE else Action.HANG
        bad = w - 1
        timeout = 3.0  # the checkpointer's collective timeout; survivors must raise within it
        r = worlds.fresh(sc.collective_failure_cell, w, root, cell.where, action, bad, async_, timeout,
                         collect=True, timeout=timeout + 5.0)
        for rk, x in enumerate(r):
            if rk == bad:
                continue
            _check(isinstance(x, str) and x.startswith("raised"), f"survivor rank {rk}: {x!r}", problems)
            _check(isinstance(x, str) and ("SaveFailedError" in x or "CollectiveError" in x or "CheckpointError" in x),
                   f"survivor rank {rk} raised an untyped error: {x!r}", problems)
        detail = "; ".join(f"r{rk}: {x if isinstance(x, str) else type(x).__name__}" for rk, x in enumerate(r))[:100]
    else:  # pragma: no cover - cells() only makes the kinds above
        problems.append(f"no runner for {cell.kind}")
    return Outcome(cell, not problems, "; ".join(problems) if problems else detail, time.monotonic() - t0)


def format_table(outcomes: list[Outcome]) -> str:
    lines = ["| fault | where | target | world | mode | outcome |", "|---|---|---|---|---|---|"]
    for o in outcomes:
        c = o.cell
        lines.append(f"| {c.kind} | {c.where} | {c.target} | {c.world_size} | {c.mode} | "
                     f"{'ok' if o.ok else 'FAIL'}: {o.detail.replace('|', '/')} |")
    return "\n".join(lines)


def run_all(selected: list[Cell], *, log: Callable[[str], None] = print) -> list[Outcome]:
    worlds = Worlds()
    outcomes = []
    try:
        for cell in selected:
            d = tempfile.mkdtemp(prefix="faults-cell-")
            try:
                o = run_cell(cell, worlds, d)
            finally:
                shutil.rmtree(d, ignore_errors=True)
            outcomes.append(o)
            log(f"{'ok  ' if o.ok else 'FAIL'} {cell.id} ({o.seconds:.1f}s) {o.detail[:100]}")
    finally:
        worlds.close()
    return outcomes


def format_summary(outcomes: list[Outcome]) -> str:
    """One row per (fault kind, where), one column per (world size, mode); each entry is
    ``passed/cells`` over the targets (coordinator, non-coordinator, all ranks) that apply."""
    cols = sorted({(o.cell.world_size, o.cell.mode) for o in outcomes}, key=lambda c: (c[0], c[1] != "sync"))
    rows: dict[tuple[str, str], dict[tuple[int, str], list[bool]]] = {}
    for o in outcomes:
        rows.setdefault((o.cell.kind, o.cell.where), {}).setdefault((o.cell.world_size, o.cell.mode), []).append(o.ok)
    head = "| fault | where | " + " | ".join(f"{w} rank{'s' if w > 1 else ''} {m}" for w, m in cols) + " |"
    lines = [head, "|" + "---|" * (len(cols) + 2)]
    for (kind, where), by in rows.items():
        cells_ = []
        for col in cols:
            res = by.get(col)
            cells_.append("–" if not res else f"{'✅' if all(res) else '❌'} {sum(res)}/{len(res)}")
        lines.append(f"| {kind} | {where} | " + " | ".join(cells_) + " |")
    ok = sum(o.ok for o in outcomes)
    secs = sum(o.seconds for o in outcomes)
    lines.append("")
    lines.append(f"{ok}/{len(outcomes)} cells passed ({len(outcomes) - ok} failed) in {secs:.0f} s.")
    return "\n".join(lines)
