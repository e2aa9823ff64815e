"""What repeated saves and loads leave behind: open file descriptors, files beside the steps, and
the steps retention should have deleted (issue 29: a descriptor leaked per retention deletion until
``EMFILE``, lease files and staging directories that pile up, ``global_step_0`` kept for ever all
passed the suite, which counted what was kept, never what was left).

One checkpointer object saves and resumes in rounds, as a long training job does. What one round
costs once (a thread pool, a process group, a cache) is allowed; what grows with the number of
rounds is a leak: a job that saves every few minutes for days runs out of descriptors or disk.
"""

from __future__ import annotations

import os
import uuid

import pytest

from faults import training as T
from faults.contract import POINTER_FILE, step_of
from faults.dirwatch import wait_until
from faults.training import RunConfig, TrainRun

from ._common import Stats, accepts, config_for, make, resume, save_step, step_path

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
CFG = RunConfig(extra_per_rank=False)
#: rounds before the first count (what a job allocates once) and between the two counts
WARMUP, ROUNDS = 2, 6
#: the same in a world (each round a collective save and load on every rank): a leak per call shows in 3
WORLD_WARMUP, WORLD_ROUNDS = 1, 3
#: growth allowed between the counts, for descriptors and for entries beside the steps
SLACK = 2
#: how long retention that deletes in the background may take to catch up
RETENTION_WAIT_S = 10.0


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _beside(root: str) -> list[str]:
    """Entries of the root that are neither step directories nor the pointer (staging, leases, tmp)."""
    return sorted(n for n in os.listdir(root) if step_of(n) is None and n != POINTER_FILE)


def _round(ck, root: str, cfg: RunConfig, run: TrainRun, stats: Stats) -> None:
    run.train_to(run.step + 1)
    save_step(ck, root, run)
    path, _resumed = resume(ck, root, cfg)
    assert path is not None, f"resume after the save of step {run.step} found nothing"
    stats.add("save/load rounds")


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counting descriptors needs /proc/self/fd (Linux)")
def test_repeated_saves_and_loads_leak_nothing(checkpointer_factory, tmp_path, request):
    """Descriptors and entries beside the steps do not grow with the number of save/load rounds;
    with ``keep_last=1`` (where declared), the steps older than the newest are deleted -- judged on
    what retention deletes as well as on what it keeps."""
    stats = Stats(request)
    options = {"keep_last": 1} if accepts(checkpointer_factory, keep_last=1) else {}
    ck = make(checkpointer_factory, **options)
    cfg = config_for(checkpointer_factory, CFG)
    root = str(tmp_path / "root")
    os.makedirs(root)
    run = TrainRun(cfg)
    for _ in range(WARMUP):
        _round(ck, root, cfg, run, stats)
    fds0, beside0 = _fds(), _beside(root)
    for _ in range(ROUNDS):
        _round(ck, root, cfg, run, stats)
    fds1, beside1 = _fds(), _beside(root)
    problems = []
    if fds1 - fds0 > SLACK:
        problems.append(f"open file descriptors grew from {fds0} to {fds1} over {ROUNDS} save/load rounds: a leak "
                        "per round runs a long job out of descriptors (EMFILE)")
    if len(beside1) - len(beside0) > SLACK:
        problems.append(f"entries beside the steps grew from {len(beside0)} to {len(beside1)} over {ROUNDS} rounds "
                        f"(new: {sorted(set(beside1) - set(beside0))[:8]}): leases, staging or temporary files left "
                        "behind pile up on the disk")
    if options:
        newest = run.step

        def older() -> list[int]:
            return sorted(s for s in map(step_of, os.listdir(root)) if s is not None and s < newest)

        # a checkpointer may delete in a background thread (torchtitan's purge thread): wake on the
        # deletions themselves (inotify); the deadline only bounds a retention that never deletes
        wait_until(root, lambda: not older(), RETENTION_WAIT_S)
        old = older()
        if old:
            problems.append(f"keep_last=1: steps {old[:8]} are still on disk {RETENTION_WAIT_S:.0f} s after step {newest} "
                            "was acknowledged (retention never deletes them)")
        if not os.path.isdir(step_path(root, newest)):
            problems.append(f"keep_last=1: the newest step {newest} is gone")
        stats.add("retention judged")
    assert not problems, "\n".join(problems)


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counting descriptors needs /proc/self/fd (Linux)")
def test_rounds_in_a_world_leak_no_descriptors_on_any_rank(checkpointer_spec, checkpointer_factory, world_factory,
                                                             suite_world_size, tmp_path):
    """The same rounds in a real world at every world size of ``--world-sizes``, one checkpointer
    object per rank: no rank's descriptors grow. What only a world shows: a process group made per
    save or load instead of once (gloo connects every rank to every peer: sockets on every rank,
    never freed while the job lives) -- a 1-rank group has no peers, so one process never sees it."""
    if suite_world_size < 2:
        pytest.skip("one rank: test_repeated_saves_and_loads_leak_nothing counts what a job of one leaves; a world "
                    "adds peers, whose connections are what this counts")
    cfg = config_for(checkpointer_factory, CFG)
    world = world_factory.get(suite_world_size)
    run_id, root = uuid.uuid4().hex, str(tmp_path)
    world.run(T.r_start, run_id, cfg, checkpointer_spec, {})
    counts = []
    try:
        for i in range(WORLD_WARMUP + WORLD_ROUNDS):
            outs = world.run(T.r_round, run_id, root)
            failed = [(rank, o["error"]) for rank, o in enumerate(outs) if o["error"]]
            assert not failed, f"round {i}: save, find_latest or load failed: {failed}"
            if i in (WORLD_WARMUP - 1, WORLD_WARMUP + WORLD_ROUNDS - 1):
                counts.append([o["fds"] for o in outs])
    finally:
        world.run(T.r_drop, run_id)
    (before, after) = counts
    grown = [(rank, a, b) for rank, (a, b) in enumerate(zip(before, after)) if b - a > SLACK]
    assert not grown, (f"open file descriptors grew over {WORLD_ROUNDS} save/load rounds in a world of {suite_world_size} "
                       f"(rank, before, after): {grown}: a leak per round runs a long job out of descriptors "
                       "(EMFILE), or of sockets where it is a process group per call")
