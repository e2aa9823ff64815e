"""``python -m faults demo``: a crash in the middle of a save, and a bitwise resume from the step before.

1. Two gloo ranks (a :class:`faults.world.World`) train the deterministic job of
   :mod:`faults.training` (AdamW, per-rank RNG and data position in extra state) and save
   steps 2 and 4 with :class:`~refckpt.DistributedCheckpointer`: both acknowledged.
2. They train to step 6 and save again, with the fault point ``shard.fsync`` of
   :mod:`faults.points` armed on rank 1 through :class:`faults.inject.FaultyIO`: when rank 1's
   shard is written but not yet fsynced it reports the moment and the parent SIGKILLs it --
   a real, uncatchable death, as an OOM-kill or a preemption is. The launcher then tears the
   job down (the world kills rank 0, which waits in the save's collective).
3. Fresh processes resume with ``find_latest_checkpoint`` + ``load`` (:func:`faults.training.r_resume`)
   and compare everything they restored -- parameters, every optimizer moment, the step, the
   extra state -- with a run trained from scratch to the same step without interruption
   (:func:`faults.training.reference_digest`), never with what the checkpointer says.
4. They train two more steps and compare again: training continued from the resume is
   bitwise the uninterrupted run.

The transcript goes to ``say`` (the CLI passes ``print``); :func:`run_demo` returns 0 only when
every check held.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from typing import Any

from refckpt.errors import InvalidCheckpointPathError

from .contract import DEFAULT_CHECKPOINTER, step_dir_name

__all__ = ["run_demo", "CRASH_POINT", "CRASH_RANK", "SAVED_STEPS", "CRASH_STEP"]

log = logging.getLogger(__name__)

#: The fault point (``faults.points.CRASH_POINTS``) and the rank SIGKILLed there.
CRASH_POINT = "shard.fsync"
CRASH_RANK = 1
WORLD_SIZE = 2
SAVED_STEPS = (2, 4)
CRASH_STEP = 6
CONTINUE_STEPS = 2
_RUN_ID = "refckpt-demo"
_TIMEOUT = 60.0

# The job of one rank between the two calls of phase 1 (a world runs functions one at a time).
_RUN: dict[str, Any] = {}


def _r_train_and_save(root: str, cfg: Any, steps: tuple[int, ...]) -> list[tuple[int, str]]:
    """Rank function: train from scratch, save at each of ``steps``; (step, digest) of each save."""
    from refckpt.checkpointer import DistributedCheckpointer

    from .training import TrainRun

    run = _RUN["run"] = TrainRun(cfg)
    ck = DistributedCheckpointer(timeout=_TIMEOUT)
    saved = []
    for step in steps:
        run.train_to(step)
        ck.save(root, run.state(), global_step=step)  # sync: returns once acknowledged
        saved.append((step, run.digest()))
    return saved


def _r_save_into_crash(root: str, step: int, point: str, ranks: tuple[int, ...]) -> str:
    """Rank function: train to ``step`` and save it with ``point`` armed on ``ranks``."""
    import torch.distributed as dist

    from refckpt.checkpointer import DistributedCheckpointer

    from .inject import Action, FaultyIO, crash_spec

    run = _RUN["run"]
    run.train_to(step)
    io = FaultyIO(crash_spec(point, ranks, Action.EMIT), dist.get_rank())
    DistributedCheckpointer(io=io, timeout=_TIMEOUT).save(root, run.state(), global_step=step)
    return "fired" if io.fired else "the save finished before the fault point"


def _preload() -> None:
    from . import world as _world

    for mod in ("safetensors", "refckpt", "faults.inject", "faults.training"):
        if mod not in _world.FORKSERVER_PRELOAD:
            _world.FORKSERVER_PRELOAD.append(mod)


def _disk_summary(root: str, step: int) -> str:
    from refckpt.tools.readers import list_root

    listing = list_root(root)
    parts = [f"{s.name} {s.state}" for s in reversed(listing.steps)]
    if all(s.step != step for s in listing.steps):
        parts.append(f"no {step_dir_name(step)}")
    # Present or not depending on whether the surviving rank's failed save cleaned it up before
    # the launcher killed it; the next save removes it either way.
    parts += [f"{name} (staging of the interrupted save; readers ignore it)" for name in listing.staging]
    return f"{', '.join(parts)}; pointer says {(listing.pointer.raw or '').strip() or '(absent)'}"


def run_demo(root: str | None = None, say: Callable[[str], None] = log.info) -> int:
    """Run the demo (module docstring); checkpoints go to ``root`` (kept) or a temp dir (removed).
    Returns 0 when every check held, 1 otherwise."""
    from .inject import kill_on_event
    from .points import POINTS_BY_NAME
    from .training import RunConfig, r_resume, r_train
    from .world import RankDied, World

    keep = root is not None
    if root is not None:
        root = os.path.abspath(root)
        if os.path.exists(root) and (not os.path.isdir(root) or os.listdir(root)):
            raise InvalidCheckpointPathError(
                f"{root}: exists and is not an empty directory; the demo writes a fresh checkpoint root. "
                f"Pass a new path to --dir, or omit --dir to use a temporary one.")
    work = tempfile.mkdtemp(prefix="refckpt-demo-")
    root = root or os.path.join(work, "checkpoints")
    cfg = RunConfig()
    point = POINTS_BY_NAME[CRASH_POINT]
    _preload()
    checks: list[bool] = []
    try:
        say(f"faults demo: {WORLD_SIZE} gloo ranks train {cfg.optim.kinds[0]} with per-rank extra state; "
            f"checkpoints -> {root}{'' if keep else ' (temporary; pass --dir to keep them)'}")
        world = World(WORLD_SIZE, "gloo", _TIMEOUT, start_method="forkserver")
        try:
            saved = world.run(_r_train_and_save, root, cfg, SAVED_STEPS)
            say(f"[1/4] trained to step {SAVED_STEPS[-1]}, saved steps {', '.join(map(str, SAVED_STEPS))} "
                f"(each acknowledged: committed, published, pointer written)")
            say(f"[2/4] training to step {CRASH_STEP} and saving it; rank {CRASH_RANK} is armed to die at "
                f"fault point {point.name}: {point.doc}")
            try:
                res = world.run(_r_save_into_crash, root, CRASH_STEP, point.name, (CRASH_RANK,),
                                on_event=kill_on_event(world, [CRASH_RANK]))
                say(f"      FAIL: no rank died ({res})")
                checks.append(False)
            except RankDied as e:
                say(f"      rank {e.rank} killed by {e.signal} in the middle of the save of step {CRASH_STEP}; "
                    f"the job is torn down (the surviving rank is killed too)")
                checks.append(e.rank == CRASH_RANK)
        finally:
            world.close()
        say(f"      on disk: {_disk_summary(root, CRASH_STEP)}")
        expected = SAVED_STEPS[-1]
        want_path = os.path.join(root, step_dir_name(expected))
        want_digest = [dict(saved[r])[expected] for r in range(WORLD_SIZE)]

        say("[3/4] fresh processes resume (find_latest_checkpoint + load)")
        with World(WORLD_SIZE, "gloo", _TIMEOUT, start_method="forkserver") as fresh:
            resumed = fresh.run(r_resume, _RUN_ID, cfg, DEFAULT_CHECKPOINTER, {}, root, False)
            for rank, r in enumerate(resumed):
                ok = (r["error"] is None and r["path"] == want_path and r["step"] == expected
                      and r["digest"] == r["reference"] == want_digest[rank])
                checks.append(ok)
                landed = os.path.basename(r["path"]) if r["path"] else "nothing"
                say(f"      rank {rank}: loaded {landed} (the newest complete step: the last acknowledged save); "
                    f"params, optimizer moments and extra state bitwise equal to an uninterrupted run "
                    f"at step {r['step']}: {ok}" + (f" -- {r['error']}" if r["error"] else ""))
            cont = fresh.run(r_train, _RUN_ID, CONTINUE_STEPS)
            ok = all(digest == ref for _step, digest, ref in cont)
            checks.append(ok)
            say(f"[4/4] trained {CONTINUE_STEPS} more steps from the resumed state: bitwise equal to an "
                f"uninterrupted run at step {cont[0][0]} on every rank: {ok}")
        ok = all(checks) and len(checks) == 1 + WORLD_SIZE + 1
        say("OK: the crash lost only the unacknowledged save; resume was bitwise exact"
            if ok else f"FAIL: a check did not hold; on disk: {_disk_summary(root, CRASH_STEP)}")
        return 0 if ok else 1
    finally:
        shutil.rmtree(work, ignore_errors=True)
