"""Rank functions for tests/test_agreement.py (module level: worlds pickle them by reference).

Every function catches what its test provokes -- ``KeyboardInterrupt`` and ``SystemExit``
included -- and returns plain data, so the reused world survives: an interrupted rank stays a live
rank whose next save and load the test makes with the *same* checkpointer objects.

Signals are real (``os.kill(os.getpid(), SIGINT)``), sent from the rank's own ``FileIO.mark`` at a
named step of the save protocol: deterministic, with no sleep."""

from __future__ import annotations

import os
import signal
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

from faults.training import RunConfig, TrainRun, reference_digest
from refckpt import DistributedCheckpointer, SavePoint
from refckpt.durable import FileIO

CFG = RunConfig(extra_per_rank=True)
_RUNS: dict[str, Any] = {}


#: Steps only the coordinator runs (its FileIO marks them): a signal "on rank r" there is sent by
#: the coordinator to rank r's process, which is then waiting for the coordinator's answer.
COORDINATOR_POINTS = (str(SavePoint.PREPARE), str(SavePoint.COMMIT), str(SavePoint.PUBLISH), str(SavePoint.POINTER))


class SignalAt(FileIO):
    """Sends ``signum`` to the processes ``pids`` when the save protocol reaches ``point``, once."""

    def __init__(self, point: str, signum: int, pids: list[int]) -> None:
        self.point, self.signum, self.pids, self.fired = point, signum, pids, False

    def mark(self, point, **info) -> None:
        if str(point) == self.point and not self.fired:
            self.fired = True
            for pid in self.pids:
                os.kill(pid, self.signum)


def _exit_on_sigterm(signum, frame):
    sys.exit(143)  # what a trainer's SIGTERM handler does on a preemption notice


def _outcome(fn) -> dict[str, Any]:
    """What ``fn()`` did: returned, or raised (which class, and whether it was an Exception)."""
    t0 = time.monotonic()
    try:
        fn()
        out = {"raised": None}
    except BaseException as e:  # noqa: BLE001 - the interrupts are what these tests look at
        out = {"raised": type(e).__name__, "exception": isinstance(e, Exception), "message": str(e)[:500],
               "code": getattr(e, "code", None)}
    out["seconds"] = time.monotonic() - t0
    return out


def interrupted_save(root: str, point: str, signame: str, ranks: tuple[int, ...], save_async: bool = False) -> dict:
    """Train to step 2 and save it, with ``signame`` delivered at ``point`` on ``ranks``; then, with the
    same checkpointer objects, save step 3 and load it back. What each rank saw, and whether the
    state it loaded equals an uninterrupted run's."""
    rank = dist.get_rank()
    signum = getattr(signal, signame)
    old = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    # a world's worker ignores SIGINT (Ctrl-C is its parent's): here it is Python's own handler
    signal.signal(signal.SIGINT, signal.default_int_handler)
    if signame == "SIGTERM":
        signal.signal(signal.SIGTERM, _exit_on_sigterm)
    pids: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(pids, os.getpid())
    if point in COORDINATOR_POINTS:
        io = SignalAt(point, signum, [pids[r] for r in ranks]) if rank == 0 else FileIO()
    else:
        io = SignalAt(point, signum, [os.getpid()]) if rank in ranks else FileIO()
    ck = DistributedCheckpointer(io=io, timeout=60)
    run = TrainRun(CFG)
    out: dict[str, Any] = {}
    try:
        run.train_to(2)

        def save():
            ck.save(root, run.state(), global_step=2, save_async=save_async)
            ck.maybe_wait_for_async_save()

        out["save"] = _outcome(save)
        out["fired"] = getattr(io, "fired", False)
        out["after"] = _outcome(lambda: None)  # a held signal would surface here at the latest
    finally:
        signal.signal(signal.SIGTERM, old[0])
        signal.signal(signal.SIGINT, old[1])
    dist.barrier()
    out["step2_complete"] = os.path.isfile(os.path.join(root, "global_step_2", ".metadata"))
    out["staging_left"] = sorted(n for n in os.listdir(root) if n.endswith(".partial"))
    run.train_to(3)
    out["save3"] = _outcome(lambda: ck.save(root, run.state(), global_step=3))
    fresh = TrainRun(CFG)
    state = fresh.state(target=True)
    out["load"] = _outcome(lambda: out.__setitem__("path", ck.load_latest(root, state)))
    if out["load"]["raised"] is None:
        fresh.apply(state)
        out["exact"] = fresh.step == 3 and fresh.digest() == reference_digest(CFG, 3)
    return out


def one_rank_bad_state(root: str, bad_rank: int, case: str, save_async: bool) -> dict:
    """A save whose state is wrong on ``bad_rank`` only (``unpicklable`` extra state, or a ``meta``
    tensor in the model); every rank must raise within seconds, the same checkpointer then saves
    and loads again."""
    rank = dist.get_rank()
    run = TrainRun(CFG)
    run.train_to(1)
    ck = DistributedCheckpointer(timeout=60)
    state = run.state()
    if rank == bad_rank:
        if case == "unpicklable":
            state["extra_state"]["callback"] = lambda: None
        else:
            key = next(iter(state["model"]))
            state["model"] = {**state["model"], key: torch.empty_like(state["model"][key], device="meta")}

    def save():
        ck.save(root, state, global_step=1, save_async=save_async)
        ck.maybe_wait_for_async_save()

    out = {"save": _outcome(save)}
    dist.barrier()
    out["entries"] = sorted(n for n in os.listdir(root) if not n.startswith(".lease")) if os.path.isdir(root) else []
    out["save_again"] = _outcome(lambda: ck.save(root, run.state(), global_step=1))
    fresh = TrainRun(CFG)
    target = fresh.state(target=True)
    out["load"] = _outcome(lambda: ck.load_latest(root, target))
    return out


class _SignalOnStateDict:
    """A ``Stateful`` whose ``state_dict()`` -- called inside the load, after its first checks --
    sends SIGINT to this process on ``rank``: an interrupt in the middle of a load, deterministically."""

    def __init__(self, inner: dict, rank: int) -> None:
        self.inner, self.rank = inner, rank

    def state_dict(self) -> dict:
        if dist.get_rank() == self.rank:
            os.kill(os.getpid(), signal.SIGINT)
        return self.inner

    def load_state_dict(self, sd: dict) -> None:
        self.inner.update(sd)


def interrupted_load(root: str, rank_interrupted: int) -> dict:
    """Save step 1, then ``load_latest`` it into a fresh state with SIGINT on one rank in the middle
    of the load; then load again with the same checkpointer. What each rank saw, and whether the
    interrupted load left the state exactly as it was."""
    old = signal.getsignal(signal.SIGINT)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        run = TrainRun(CFG)
        run.train_to(1)
        ck = DistributedCheckpointer(timeout=60)
        ck.save(root, run.state(), global_step=1)
        fresh = TrainRun(CFG)
        target = fresh.state(target=True)
        before = {k: v.clone() for k, v in target["model"].items()}
        target["model"] = _SignalOnStateDict(target["model"], rank_interrupted)
        out: dict[str, Any] = {"load": _outcome(lambda: ck.load_latest(root, target))}
        out["after"] = _outcome(lambda: None)
        out["unchanged"] = all(torch.equal(before[k], v) for k, v in target["model"].inner.items())
        target["model"] = target["model"].inner
        out["again"] = _outcome(lambda: ck.load_latest(root, target))
        out["loaded"] = not all(torch.equal(before[k], v) for k, v in target["model"].items())
        return out
    finally:
        signal.signal(signal.SIGINT, old)


class _BlockAt(FileIO):
    """Holds the background save at ``point`` until ``release`` is set (at most 60 s)."""

    def __init__(self, point: str) -> None:
        import threading

        self.point, self.reached, self.release = point, threading.Event(), threading.Event()

    def mark(self, point, **info) -> None:
        if str(point) == self.point and not self.release.is_set():
            self.reached.set()
            self.release.wait(60)


def fork_during_save(root: str) -> dict:
    """Save step 1; start an async save of step 2 held in its writes; fork. The child makes its own
    checkpointer and resumes (``load_latest``) under a 30 s alarm; the parent then lets its save
    finish. The child's exit status, and whether the parent's step 2 is published."""
    run = TrainRun(CFG)
    run.train_to(1)
    DistributedCheckpointer(timeout=60).save(root, {"model": run.state()["model"]}, global_step=1)
    io = _BlockAt(str(SavePoint.SHARDS))
    ck = DistributedCheckpointer(io=io, timeout=60)
    run.train_to(2)
    ck.save(root, {"model": run.state()["model"]}, global_step=2, save_async=True)
    assert io.reached.wait(60), "the async save never reached its writes"
    pid = os.fork()
    if pid == 0:  # the child: no pytest, no world; its status is its answer
        code = 3
        try:
            signal.alarm(30)
            child = DistributedCheckpointer(timeout=30)
            target = {"model": TrainRun(CFG).state(target=True)["model"]}
            path = child.load_latest(root, target)
            code = 0 if path is not None and path.endswith("global_step_1") else 4
        except BaseException:  # noqa: BLE001 - reported by the status
            code = 5
        finally:
            os._exit(code)
    t0 = time.monotonic()
    _, status = os.waitpid(pid, 0)
    out: dict[str, Any] = {"child_status": status, "child_seconds": time.monotonic() - t0}
    io.release.set()
    out["save"] = _outcome(ck.maybe_wait_for_async_save)
    dist.barrier()
    out["step2_complete"] = os.path.isfile(os.path.join(root, "global_step_2", ".metadata"))
    return out


def rank_that_never_answers(root: str, absent: int, timeout: float, saved_before: bool) -> dict[str, Any]:
    """Rank ``absent`` never calls ``save`` of step 2 (it died, hung, or is still in an earlier
    step); every other rank's save waits at most ``timeout`` and names it, then the broken group
    makes the next save and load of the same object raise at once. ``saved_before``: every rank
    saved step 1 first (the checkpointer's group exists; else step 2 is its first collective)."""
    from refckpt.errors import CollectiveError

    ck = DistributedCheckpointer(timeout=timeout)
    state = {"model": {"w": torch.arange(8, dtype=torch.float32)}}
    if saved_before:
        ck.save(root, state, global_step=1)
    if dist.get_rank() == absent:
        return {"absent": True}
    out: dict[str, Any] = {}
    for what, call in (("save", lambda: ck.save(root, state, global_step=2)),
                       ("again", lambda: ck.save(root, state, global_step=3)),
                       ("load", lambda: ck.load_latest(root, {"model": {"w": torch.zeros(8)}}))):
        r = _outcome(call)
        r["collective_error"] = r["raised"] == CollectiveError.__name__
        out[what] = r
    out["entries"] = sorted(os.listdir(root)) if os.path.isdir(root) else []
    return out
