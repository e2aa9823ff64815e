"""The fault matrix: every (fault kind x protocol step x target x world size x sync/async)
cell that applies, a runner for one cell, and the table of outcomes.

``python -m faults matrix`` runs every cell and prints the table that docs/faults.md shows;
the tests in ``tests/test_fault_matrix.py`` run the same cells through the same runner.
"""

from __future__ import annotations

import dataclasses
import os
import random
import tempfile
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from . import world as _world
from .contract import LEASE_PREFIX, POINTER_FILE, step_dir_name
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
#: Disk faults after which two more saves (with ``keep_last=1``, so retention deletes the
#: damaged step) must succeed and resume: damage that breaks the *next* save, not the resume.
SAVE_AFTER_DAMAGE = (FaultKind.DEEP_TREE, FaultKind.FIFO_IN_STEP, FaultKind.DEVICE_IN_STEP)
#: Two jobs saving into one root at once: the same step, or two different steps.
SECOND_WRITER_VARIANTS = ("same_step", "different_steps")
#: World sizes of the two-writer cells: the publish race is the coordinators'; two worlds of 4
#: (8 fresh ranks per cell) add no case that 2 does not, at a cost the 2-core budget cannot carry.
SECOND_WRITER_SIZES = (1, 2)
WRITER_TIMEOUT = 120.0
#: A real SIGINT (KeyboardInterrupt) or SIGTERM (a handler calling sys.exit) at every crash point.
INTERRUPT_KINDS = (FaultKind.SIGINT_IN_SAVE, FaultKind.SIGTERM_IN_SAVE)
#: The checkpointer's collective timeout in interrupt cells, and the deadline every rank's save must
#: meet: a rank left waiting for an interrupted peer would wait the timeout and miss the deadline.
INTERRUPT_TIMEOUT, INTERRUPT_DEADLINE = 30.0, 15.0
#: One rank's bad state: extra state that cannot be pickled; a meta tensor (no data to copy).
CALLER_ERROR_VARIANTS = ("unpicklable_extra", "meta_tensor")
_CELL_SEEDED = frozenset({FaultKind.BITFLIP_RECORD, FaultKind.TRUNCATED_RECORD, FaultKind.CORRUPT_RECORD_FIELD,
                          FaultKind.FORGED_RECORD_FIELD, FaultKind.FIFO_IN_STEP, FaultKind.DEVICE_IN_STEP})


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
    #: Why the fault could not be injected on this machine (``mknod`` not permitted, ...);
    #: such a cell proved nothing: tests skip it with this reason, tables show it apart.
    skipped: str = ""


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
                    for kind in INTERRUPT_KINDS:
                        out.append(Cell(str(kind), p.name, str(t), w, mode))
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
            if w in SECOND_WRITER_SIZES:
                for variant in SECOND_WRITER_VARIANTS:
                    out.append(Cell(str(FaultKind.SECOND_WRITER), variant, str(Target.ALL), w, mode))
            if w > 1:
                for variant in CALLER_ERROR_VARIANTS:
                    out.append(Cell(str(FaultKind.CALLER_ERROR_ONE_RANK), variant, str(Target.NON_COORDINATOR), w, mode))
            if w == 1 and mode == "async":
                out.append(Cell(str(FaultKind.EXIT_WITH_ASYNC_SAVE), "plain", str(Target.ALL), w, mode))
                out.append(Cell(str(FaultKind.EXIT_WITH_ASYNC_SAVE), "atexit", str(Target.ALL), w, mode))
                out.append(Cell(str(FaultKind.FORK_DURING_SAVE), "child-resumes", str(Target.COORDINATOR), w, mode))
            if w > 1:
                for kind in (FaultKind.RANK_DIES_IN_COLLECTIVE, FaultKind.RANK_HANGS_IN_COLLECTIVE):
                    for phase in ("save", "load"):
                        if phase == "load" and mode == "async":
                            continue
                        out.append(Cell(str(kind), phase, str(Target.NON_COORDINATOR), w, mode))
    return out


class Worlds:
    """Reused worlds for the checks that no fault kills (one per size), plus fresh crash worlds,
    and the saved steps every cell starts from (:meth:`saved`)."""

    def __init__(self, get: Callable[[int], Any] | None = None, backend: str = "gloo") -> None:
        self._own: dict[int, Any] = {}
        self._get = get
        self.backend = backend
        self._templates: dict[tuple, str] = {}
        self._template_dir: str | None = None

    def saved(self, w: int, steps: tuple[int, ...], save_async: bool, into: str) -> None:
        """Put in ``into`` (a fresh root) what :func:`faults.scenarios.save_steps` of ``steps``
        leaves there at world size ``w``: the steps and the pointer, saved by refckpt once per
        (size, steps, mode) in the reused world and copied after. The training and the saves
        are deterministic, so every cell gets the bytes its own save would have written; each
        cell's fault then lands on its own copy. About a third of a cell's saves were this."""
        import shutil

        from . import scenarios as sc

        key = (w, tuple(steps), save_async)
        template = self._templates.get(key)
        if template is None:
            if self._template_dir is None:
                self._template_dir = tempfile.mkdtemp(prefix="faults-matrix-saved-")
            template = os.path.join(self._template_dir, f"w{w}-{'-'.join(map(str, steps))}-{int(save_async)}")
            os.makedirs(template)
            self.get(w).run(sc.save_steps, template, list(steps), save_async=save_async)
            self._templates[key] = template
        for name in os.listdir(template):
            if name.startswith(LEASE_PREFIX):  # a reader's lease is the template's, not the cell's
                continue
            src, dst = os.path.join(template, name), os.path.join(into, name)
            if os.path.isdir(src):
                shutil.copytree(src, dst)
            else:
                shutil.copy2(src, dst)

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
        if self._template_dir is not None:
            _rmtree_quietly(self._template_dir)
            self._template_dir = None
            self._templates.clear()


def _check(cond: bool, what: str, problems: list[str]) -> None:
    if not cond:
        problems.append(what)


def run_cell(cell: Cell, worlds: Worlds, root: str, seed: int = 0, then: FaultKind | None = None) -> Outcome:
    """Run one cell in ``root`` (an empty directory); ``ok`` iff every invariant held.

    ``then`` composes a pointer fault (one that never changes the right answer) with a crash
    cell: it is applied to the disk after the crash, before resuming.
    """
    from . import scenarios as sc
    from .inject import DISK_FAULTS, Action, FaultNotApplicable, crash_spec, io_error_spec, kill_on_event
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
        worlds.saved(w, (2,), False, root)
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
            detail += "; then " + fault(root, os.path.join(root, step_dir_name(expected)), 0, random.Random(seed))
        r = worlds.get(w).run(sc.resume_cell, root, expected)
        for rank, x in enumerate(r):
            _check(x["path"] == os.path.join(root, step_dir_name(expected)),
                   f"rank {rank} resumed {x['path']}, expected step {expected}", problems)
            _check(x["step"] == expected and x["rank_ok"], f"rank {rank} extra_state {x['step']}", problems)
            _check(x["exact"], f"rank {rank}: state differs from the uninterrupted run at step {expected}", problems)
            _check(x["continued_exact"], f"rank {rank}: training after resume diverged", problems)
            _check(x["exact2"] and x["path2"].endswith(step_dir_name(4 if expected == 2 else expected + 2)),
                   f"rank {rank}: save after the crash did not resume exactly ({x['path2']})", problems)
            _check(not x["leftovers"], f"leftovers after the next save: {x['leftovers']}", problems)
        detail = f"{detail}; resumed step {expected} bitwise" if not problems else detail
    elif kind in IO_KINDS:
        role = Role(cell.where)
        ranks = tuple(target_ranks(Target(cell.target), w))
        spec = io_error_spec(kind, role, ranks)
        worlds.saved(w, (2,), False, root)
        r = worlds.get(w).run(sc.io_error_cell, root, spec, async_)
        published = role is Role.POINTER_TMP  # the pointer is written after the step is committed
        for rank, x in enumerate(r):
            _check(x["error"] is not None and ("AsyncSaveFailedError" if async_ else "SaveFailedError") in x["error"],
                   f"rank {rank} did not raise: {x['error']}", problems)
            _check(x["pointer"] == "2\n", f"pointer moved to {x['pointer']!r}", problems)
            want = [step_dir_name(2), POINTER_FILE] + ([step_dir_name(4)] if published else [])
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
        worlds.saved(w, (2, 4), async_, root)
        rank = 0 if Target(cell.target) is Target.COORDINATOR else w - 1
        # The faults added with the record checks draw from the cell too, so the cells of one
        # kind exercise different bits, fields and files (the older kinds keep their draws).
        rng = random.Random(f"{seed}:{cell.id}" if kind in _CELL_SEEDED else seed)
        try:
            detail = fault(root, os.path.join(root, step_dir_name(4)), rank, rng)
        except FaultNotApplicable as e:
            return Outcome(cell, True, f"skipped: {e}", time.monotonic() - t0, skipped=str(e))
        try:
            expected = 2 if fault.falls_back else 4
            r = worlds.get(w).run(sc.disk_resume_cell, root, expected)
            for rk, x in enumerate(r):
                _check(x["path"] == os.path.join(root, step_dir_name(expected)) and x["step"] == expected,
                       f"rank {rk} resumed {x['path']}, expected step {expected}", problems)
                _check(x["exact"], f"rank {rk}: state differs from step {expected}", problems)
            if kind in (FaultKind.BITFLIP_SHARD, FaultKind.CORRUPT_EXTRA_STATE, FaultKind.BITFLIP_RECORD,
                        FaultKind.CORRUPT_RECORD_FIELD, FaultKind.FORGED_RECORD_FIELD):
                # A damaged step must be skipped loudly: a fall-back warning on every rank when the
                # load caught it, or a logged skip where the scan did (the coordinator scans).
                _check(all(x["fallback_warned"] for x in r) or any(x["skip_logged"] for x in r),
                       "fell back without a warning on every rank or a logged skip of the damaged step", problems)
            if kind in SAVE_AFTER_DAMAGE:
                _saves_after_damage(worlds, w, root, async_, problems)
        finally:
            if kind is FaultKind.DEEP_TREE:
                _clear(root)
    elif kind in (FaultKind.PARTIAL_OPTIMIZER, FaultKind.PARTIAL_MAIN_PARAMS):
        r = worlds.get(w).run(sc.partial_optimizer_cell, root, cell.where, async_)
        for rk, x in enumerate(r):
            if cell.where == "main_params":
                _check(x["error"] is not None and "fp32" in x["error"], f"rank {rk}: partial main params loaded: {x}", problems)
                continue
            _check(x["params_equal"] and x["present_equal"], f"rank {rk}: restored state differs", problems)
            _check(x["zeros_kept"], f"rank {rk}: absent entries not zero", problems)
            want_warn = 1 if x["n_absent"] else 0
            _check(len(x["warnings"]) == want_warn, f"rank {rk}: {len(x['warnings'])} warnings for {x['n_absent']} absent",
                   problems)
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
    elif kind in INTERRUPT_KINDS:
        detail = _interrupt(worlds, cell, root, problems)
    elif kind is FaultKind.CALLER_ERROR_ONE_RANK:
        worlds.saved(w, (2,), False, root)
        bad = w - 1
        r = worlds.get(w).run(sc.caller_error_cell, root, cell.where, bad, async_, INTERRUPT_TIMEOUT)
        for rk, x in enumerate(r):
            _check(x["raised"] is not None, f"rank {rk} acknowledged step 4 although rank {bad}'s state is bad", problems)
            _check(x["seconds"] <= INTERRUPT_DEADLINE,
                   f"rank {rk} took {x['seconds']:.0f} s to fail (waited for rank {bad}, which failed at once?)", problems)
            _check(x["entries"] == [step_dir_name(2), POINTER_FILE],
                   f"rank {rk}: the root holds {x['entries']} after a caller error (a staging directory left?)", problems)
            _check(x["again"] is None, f"rank {rk}: the same checkpointer then failed to save step 6: {x['again']}",
                   problems)
        _resumed_exactly(worlds, w, root, 6, problems)
        detail = (r[0]["raised"] or "")[:100]
    elif kind is FaultKind.EXIT_WITH_ASYNC_SAVE:
        from .contract import DEFAULT_CHECKPOINTER
        from .events import exit_problems
        from .training import RunConfig, load_factory

        problems += exit_problems(load_factory(DEFAULT_CHECKPOINTER), DEFAULT_CHECKPOINTER, root, RunConfig(), cell.where)
        detail = "the async save in flight at exit was published, or the exit failed"
    elif kind is FaultKind.FORK_DURING_SAVE:
        from .contract import DEFAULT_CHECKPOINTER
        from .events import fork_problems
        from .training import RunConfig

        problems += fork_problems(DEFAULT_CHECKPOINTER, root, RunConfig())
        detail = "the child resumed step 1 on its own; the parent's save completed"
    elif kind is FaultKind.SECOND_WRITER:
        detail = _second_writer(worlds, w, root, cell.where, async_, problems)
    else:  # pragma: no cover - cells() only makes the kinds above
        problems.append(f"no runner for {cell.kind}")
    return Outcome(cell, not problems, "; ".join(problems) if problems else detail, time.monotonic() - t0)


def _resumed_exactly(worlds: Worlds, w: int, root: str, expected: int, problems: list[str]) -> None:
    """A restarted job resumes ``expected`` bitwise, trains on exactly, saves, and leaves nothing."""
    from . import scenarios as sc

    for rank, x in enumerate(worlds.get(w).run(sc.resume_cell, root, expected)):
        _check(x["path"] == os.path.join(root, step_dir_name(expected)) and x["exact"] and x["step"] == expected,
               f"rank {rank} resumed {x['path']} (exact={x['exact']}), expected step {expected}", problems)
        _check(x["continued_exact"] and x["exact2"], f"rank {rank}: training or saving after resume diverged", problems)
        _check(not x["leftovers"], f"leftovers after the next save: {x['leftovers']}", problems)


def _interrupt(worlds: Worlds, cell: Cell, root: str, problems: list[str]) -> str:
    """A real SIGINT or SIGTERM-with-handler at a crash point, on the target ranks; nobody dies, so
    the reused world runs it. Every interrupted rank raises the interrupt itself (KeyboardInterrupt /
    SystemExit), the others agree (all acknowledged or all raised) within the deadline, an
    acknowledged step 4 loads bitwise, the same objects save step 6, and a restart resumes it."""
    from . import scenarios as sc
    from .inject import Action, crash_spec

    w, async_ = cell.world_size, cell.mode == "async"
    kind, point = FaultKind(cell.kind), POINTS_BY_NAME[cell.where]
    ranks = tuple(target_ranks(Target(cell.target), w))
    spec = crash_spec(point, ranks, Action.SIGINT if kind is FaultKind.SIGINT_IN_SAVE else Action.SIGTERM)
    worlds.saved(w, (2,), False, root)
    r = worlds.get(w).run(sc.interrupt_cell, root, spec, async_, 1 if point.needs_retention else None,
                          INTERRUPT_TIMEOUT, timeout=INTERRUPT_TIMEOUT * 3)
    want = "KeyboardInterrupt" if kind is FaultKind.SIGINT_IN_SAVE else "SystemExit"
    _check(any(x["fired"] for x in r), f"the signal was never sent at {point.name}", problems)
    for rk, x in enumerate(r):
        if x["fired"]:
            _check(x["raised"] == want, f"rank {rk}: the {cell.kind} came out as {x['raised'] or 'a normal return'}, "
                   f"not {want} ({x.get('message', '')})", problems)
        _check(x["seconds"] <= INTERRUPT_DEADLINE, f"rank {rk}: its save took {x['seconds']:.0f} s", problems)
        if "acked_exact" in x or x.get("acked_error"):
            _check(bool(x.get("acked_exact")), f"rank {rk}: step 4 was acknowledged but does not load bitwise "
                   f"({x.get('acked_error')})", problems)
        _check(x["again"] is None, f"rank {rk}: the same checkpointer then failed to save step 6: {x['again']}", problems)
    others = [x for x in r if not x["fired"]]
    _check(len({x["raised"] is None for x in others}) <= 1,
           f"ranks that were not interrupted disagree: {[(x['raised'], x.get('message', '')[:80]) for x in others]}",
           problems)
    _resumed_exactly(worlds, w, root, 6, problems)
    return "; ".join(f"r{rk}: {x['raised'] or 'acked'}" for rk, x in enumerate(r))


def _clear(root: str) -> None:
    """Empty ``root`` without recursion: a deep tree left by a failed retention must not break
    pytest's own clean-up of its temporary directories (``shutil.rmtree`` recurses)."""
    from .inject import remove_tree

    for name in os.listdir(root):
        remove_tree(os.path.join(root, name))


def _saves_after_damage(worlds: Worlds, w: int, root: str, async_: bool, problems: list[str]) -> None:
    """Two more saves with ``keep_last=1`` (retention must delete the damaged step 4 and step
    2), then resume: the saves work, the newest lands bitwise, nothing is left behind."""
    from . import scenarios as sc
    from .world import WorldError

    try:
        worlds.get(w).run(sc.save_steps, root, [6, 8], save_async=async_, keep_last=1)
    except WorldError as e:
        problems.append(f"a save after the damage failed: {str(e).strip().splitlines()[-1][:300]}")
        return
    r = worlds.get(w).run(sc.disk_resume_cell, root, 8)
    for rk, x in enumerate(r):
        _check(x["path"] == os.path.join(root, step_dir_name(8)) and x["exact"],
               f"rank {rk}: after two more saves resumed {x['path']} (exact={x['exact']}), expected step 8", problems)
    left = sorted(n for n in os.listdir(root) if n != POINTER_FILE and not n.startswith(LEASE_PREFIX))
    _check(left == [step_dir_name(8)], f"keep_last=1 left {left} (the damaged step must be deleted)", problems)


def _second_writer(worlds: Worlds, w: int, root: str, variant: str, async_: bool, problems: list[str]) -> str:
    """Two jobs of ``w`` ranks each save into ``root`` at once (a reused world and a fresh one;
    their rank 0s meet at a gate in this process, so the saves start together). Step 2 of a
    third run is there before. Then: every save that returned on every rank resumes bitwise
    as that writer's state, no step that loads mixes the writers' files (model and optimizer
    of one, extra state of the other, or ranks that disagree), and resume finds a step no
    older than the newest acknowledged one. A save that raised is fine."""
    from . import scenarios as sc
    from .world import World, WorldError

    worlds.get(w).run(sc.save_steps, root, [2])
    steps = (6, 6) if variant == "same_step" else (6, 8)
    gate = threading.Barrier(2, timeout=WRITER_TIMEOUT)

    def on_event(rank, payload):
        if isinstance(payload, tuple) and payload[:1] == ("gate",):
            gate.wait()

    fresh = World(w, worlds.backend, WRITER_TIMEOUT, start_method="forkserver")
    pair = [worlds.get(w), fresh]
    out: list = [None, None]

    def job(i: int) -> None:
        try:
            out[i] = pair[i].run(sc.writer_cell, root, i + 1, steps[i], async_, on_event=on_event,
                                 timeout=WRITER_TIMEOUT)
        except BaseException as e:  # noqa: BLE001 - judged below
            out[i] = e
            gate.abort()

    try:
        threads = [threading.Thread(target=job, args=(i,), name=f"faults-writer-{i + 1}") for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        try:
            fresh.close()
        except WorldError:
            pass  # a rank that failed was reported by its run above
    acked: list[tuple[int, int]] = []
    notes = []
    for i, res in enumerate(out):
        if isinstance(res, BaseException):
            problems.append(f"writer {i + 1} never finished its save: {type(res).__name__}: {str(res).strip()[:300]}")
            continue
        errors = [x["error"] for x in res if x["error"]]
        if not errors:
            acked.append((i + 1, steps[i]))
        notes.append(f"writer {i + 1} step {steps[i]}: " + ("ok" if not errors else errors[0][:80]))
    if problems:
        return "; ".join(notes)
    if variant == "same_step" and len(acked) == 2:
        problems.append(f"both writers were told step {steps[0]} is saved; one of them was overwritten")
    try:
        r = worlds.get(w).run(sc.writers_check_cell, root, sorted(set(steps) | {2}), {2: [0], **{s: [1, 2] for s in steps}},
                              timeout=WRITER_TIMEOUT)
    except WorldError as e:
        problems.append(f"checking the root after the two writers failed: {str(e).strip()[-300:]}")
        return "; ".join(notes)
    for rk, x in enumerate(r):
        for writer, step in acked:
            got = x["loads"].get(step, {})
            _check(got.get("writer") == writer and got.get("extra_writer") == writer,
                   f"rank {rk}: writer {writer}'s acknowledged step {step} loads as {got}", problems)
        for step, got in x["loads"].items():
            if got.get("error") is None:
                _check(got.get("writer") is not None and got.get("writer") == got.get("extra_writer"),
                       f"rank {rk}: step {step} mixes the writers' files: {got}", problems)
        newest = max([s for _, s in acked] + [2])
        latest = x["latest"]
        _check(latest is not None and int(latest.rsplit("_", 1)[1]) >= newest and x["latest_error"] is None,
               f"rank {rk}: resume found {latest} ({x['latest_error']}); the newest acknowledged step is {newest}", problems)
    seen = [{s: (v.get("writer"), v.get("extra_writer"), v.get("error") is None) for s, v in x["loads"].items()} for x in r]
    _check(all(v == seen[0] for v in seen), f"ranks disagree on what the steps hold: {seen}", problems)
    return "; ".join(notes)


def format_table(outcomes: list[Outcome]) -> str:
    lines = ["| fault | where | target | world | mode | outcome |", "|---|---|---|---|---|---|"]
    for o in outcomes:
        c = o.cell
        verdict = "skipped" if o.skipped else "ok" if o.ok else "FAIL"
        lines.append(f"| {c.kind} | {c.where} | {c.target} | {c.world_size} | {c.mode} | "
                     f"{verdict}: {o.detail.replace('|', '/')} |")
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
                _rmtree_quietly(d)
            outcomes.append(o)
            log(f"{'skip' if o.skipped else 'ok  ' if o.ok else 'FAIL'} {cell.id} ({o.seconds:.1f}s) {o.detail[:100]}")
    finally:
        worlds.close()
    return outcomes


def _rmtree_quietly(path: str) -> None:
    """Remove a cell's directory at any depth (a deep tree may be left in it); errors ignored."""
    from .inject import remove_tree

    try:
        remove_tree(path)
    except OSError:
        pass


def format_summary(outcomes: list[Outcome]) -> str:
    """One row per (fault kind, where), one column per (world size, mode); each entry is
    ``passed/cells`` over the targets (coordinator, non-coordinator, all ranks) that apply."""
    cols = sorted({(o.cell.world_size, o.cell.mode) for o in outcomes}, key=lambda c: (c[0], c[1] != "sync"))
    rows: dict[tuple[str, str], dict[tuple[int, str], list[bool]]] = {}
    skipped: dict[tuple[str, str], dict[tuple[int, str], int]] = {}
    for o in outcomes:
        key, col = (o.cell.kind, o.cell.where), (o.cell.world_size, o.cell.mode)
        if o.skipped:
            skipped.setdefault(key, {}).setdefault(col, 0)
            skipped[key][col] += 1
            rows.setdefault(key, {})
            continue
        rows.setdefault(key, {}).setdefault(col, []).append(o.ok)
    head = "| fault | where | " + " | ".join(f"{w} rank{'s' if w > 1 else ''} {m}" for w, m in cols) + " |"
    lines = [head, "|" + "---|" * (len(cols) + 2)]
    for (kind, where), by in rows.items():
        cells_ = []
        for col in cols:
            res = by.get(col)
            skip = skipped.get((kind, where), {}).get(col, 0)
            text = "–" if not res else f"{'✅' if all(res) else '❌'} {sum(res)}/{len(res)}"
            if skip:
                text = f"⏭ {skip} skipped" if not res else f"{text}, {skip} skipped"
            cells_.append(text)
        lines.append(f"| {kind} | {where} | " + " | ".join(cells_) + " |")
    ran = [o for o in outcomes if not o.skipped]
    ok = sum(o.ok for o in ran)
    secs = sum(o.seconds for o in outcomes)
    lines.append("")
    lines.append(f"{ok}/{len(ran)} cells passed ({len(ran) - ok} failed) in {secs:.0f} s."
                 + (f" {len(outcomes) - len(ran)} skipped here: {sorted({o.skipped for o in outcomes if o.skipped})[0]}"
                    if len(ran) < len(outcomes) else ""))
    return "\n".join(lines)
