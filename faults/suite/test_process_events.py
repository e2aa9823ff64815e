"""Process events every cluster produces, for any checkpointer: interrupts during a save, one
rank's bad state, interpreter exit with an async save in flight, fork during a save.

Real signals, sent by the rank to itself at a file-system operation of the save (the ``nth``
one the checkpointer makes, counted on a save of its own: no knowledge of its protocol), with
Python's SIGINT handler and a SIGTERM handler that calls ``sys.exit(143)`` (what trainers
install for a preemption notice). Real interpreters for the exit, a real ``os.fork`` for the fork.

Properties (docs/design.md, "Agreement"):

* no rank acknowledges a step that is not complete on disk;
* every rank that was not interrupted has the same outcome (all acknowledged, or all raised);
* an interrupt stays an interrupt on the rank it reached: it propagates as ``KeyboardInterrupt``
  / ``SystemExit`` (by the end of the call), never swallowed and never turned into an
  ``Exception`` a trainer's ``except Exception`` would swallow;
* no wait exceeds a deadline (20 s here, plus 15 s before a rank that never answers is reported: a
  peer left waiting for a collective waits its timeout);
* after the event the *same* checkpointer objects save the next step and a restarted job resumes
  it bitwise;
* an async save in flight at exit is published, or the process exits non-zero -- never lost
  with status 0; a child forked during a save resumes on its own, and the parent's save completes.
"""

from __future__ import annotations

import uuid

import pytest

from faults import training as T
from faults.events import exit_problems, fork_problems

from ._common import Completeness, config_for, need_async, same_path, step_path

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

#: the deadline of one save in these tests: a tiny state saves in well under a second, and a peer
#: left waiting in a collective waits for the checkpointer's timeout (minutes by default) instead
DEADLINE_S = 20.0
#: case -> (which operation: first, middle or last of the save's; the signal; the ranks it reaches)
INTERRUPT_CASES = {
    "sigint-first-op-rank0": ("first", "SIGINT", "rank0"),
    "sigterm-middle-op-rank1": ("middle", "SIGTERM", "rank1"),
    "sigint-middle-op-all": ("middle", "SIGINT", "all"),
    "sigint-last-op-rank0": ("last", "SIGINT", "rank0"),
    "sigterm-last-op-all": ("last", "SIGTERM", "all"),
}


def _world2(world_factory, suite_world_size):
    if suite_world_size < 2:
        pytest.skip("an event on one rank of several needs at least 2 ranks")
    return world_factory.get(suite_world_size)


def _bounded(world, fn, *args) -> tuple[list, list[str]]:
    """``world.run(fn, *args)`` within the deadline plus a margin: each rank's result, and a
    problem for each rank that raised inside the harness or never answered (it waits for a peer
    that has left the save: the job would stall for the checkpointer's whole timeout)."""
    from faults.errors import WorldTimeout

    results = world.run(fn, *args, timeout=DEADLINE_S + 15, collect_failures=True)
    problems = []
    for rank, r in enumerate(results):
        if isinstance(r, WorldTimeout):
            problems.append(f"rank {rank}: no answer within {DEADLINE_S + 15:.0f} s: it waits for a peer that left "
                            "the save (the job stalls for the checkpointer's whole timeout, or forever)")
        elif isinstance(r, BaseException):
            problems.append(f"rank {rank}: {type(r).__name__}: {str(r).strip()[-600:]}")
    return results, problems


def _again_and_resume(world, run_id, cfg, spec, root, n) -> list[str]:
    """The same checkpointer objects save the next step; a restarted job resumes it bitwise."""
    problems = []
    steps = world.run(T.r_train, run_id, 1, timeout=120)
    step = steps[0][0]
    errors = world.run(T.r_save, run_id, root, False, timeout=120)
    if errors != [None] * n:
        problems.append(f"after the event, the same checkpointer objects could not save step {step}: {errors}")
    else:
        for rank, r in enumerate(world.run(T.r_resume, run_id, cfg, spec, {}, root, False, timeout=120)):
            if r["error"] is not None or not same_path(r["path"], step_path(root, step)):
                problems.append(f"rank {rank}: resume after the event: {r['error'] or r['path']}")
            elif r["digest"] != r["reference"]:
                problems.append(f"rank {rank}: step {step} saved after the event resumes a different state")
    world.run(T.r_drop, run_id, timeout=120)
    return problems


@pytest.mark.parametrize("case", list(INTERRUPT_CASES))
def test_an_interrupt_during_a_save_leaves_ranks_agreeing(checkpointer_spec, checkpointer_factory, world_factory,
                                                          suite_world_size, tmp_path, case):
    where, signame, who = INTERRUPT_CASES[case]
    world = _world2(world_factory, suite_world_size)
    complete = Completeness(checkpointer_factory)
    n = suite_world_size
    ranks = (0,) if who == "rank0" else (1,) if who == "rank1" else tuple(range(n))
    cfg = config_for(checkpointer_factory, T.RunConfig())
    run_id, root = uuid.uuid4().hex, str(tmp_path / "root")
    world.run(T.r_start, run_id, cfg, checkpointer_spec, {}, timeout=120)
    world.run(T.r_train, run_id, 1, timeout=120)
    world.run(T.r_save, run_id, root, False, timeout=120)  # step 1: the first save (it may make the root)
    world.run(T.r_train, run_id, 1, timeout=120)
    counts = world.run(T.r_count_save_ops, run_id, root, timeout=120)  # step 2, acknowledged: a save like the next
    ops = min(counts[r] for r in ranks)
    if ops == 0:
        pytest.skip("the checkpointer's save made no file-system operation this harness can observe on that rank")
    nth = {"first": 1, "middle": max(1, ops // 2), "last": ops}[where]
    world.run(T.r_train, run_id, 1, timeout=120)
    results, problems = _bounded(world, T.r_interrupted_save, run_id, root, nth, signame, ranks)
    assert not problems, f"{signame} at operation {nth} of {ops} on rank(s) {list(ranks)}: " + "\n".join(problems)
    if not any(r["fired"] for r in results):
        pytest.skip(f"the checkpointer made fewer than {nth} file-system operations in this save than in the one counted "
                    f"before it ({ops}): the {signame} was never sent (nothing to judge)")
    others = [r for rank, r in enumerate(results) if rank not in ranks]
    for rank, r in enumerate(results):
        if r["seconds"] > DEADLINE_S:
            problems.append(f"rank {rank}: its save took {r['seconds']:.0f} s (waited for a peer that had left?)")
        if rank in ranks and r["fired"]:
            if r["raised"] is None:
                problems.append(f"rank {rank}: the {signame} was swallowed: save returned and no interrupt surfaced")
            elif not r["interrupt"]:
                problems.append(f"rank {rank}: the {signame} came out as {r['raised']}, not as KeyboardInterrupt/"
                                f"SystemExit: a trainer's `except Exception` would swallow a preemption "
                                f"({r['message'][:200]})")
        if r["raised"] is None and not complete(root, 3):
            problems.append(f"rank {rank}: save of step 3 acknowledged, but step 3 is not complete on disk")
    acked = {r["raised"] is None for r in others}
    if len(acked) > 1:
        problems.append("ranks that were not interrupted disagree: some acknowledged step 3, some raised "
                        f"({[(r['raised'], r.get('message', '')[:120]) for r in others]})")
    problems += _again_and_resume(world, run_id, cfg, checkpointer_spec, root, n)
    assert not problems, f"{signame} at operation {nth} of {ops} on rank(s) {list(ranks)}: " + "\n".join(problems)


def test_one_ranks_bad_state_fails_every_rank_quickly(checkpointer_spec, checkpointer_factory, world_factory,
                                                      suite_world_size, tmp_path):
    """Only rank 1's extra state cannot be pickled: every rank raises an Exception within the
    deadline, none acknowledges, and the same objects then save and resume."""
    world = _world2(world_factory, suite_world_size)
    complete = Completeness(checkpointer_factory)
    n = suite_world_size
    cfg = config_for(checkpointer_factory, T.RunConfig())
    run_id, root = uuid.uuid4().hex, str(tmp_path / "root")
    world.run(T.r_start, run_id, cfg, checkpointer_spec, {}, timeout=120)
    world.run(T.r_train, run_id, 1, timeout=120)
    results, problems = _bounded(world, T.r_save_with_bad_extra, run_id, root, 1)
    assert not problems, "only rank 1's extra state is unpicklable: " + "\n".join(problems)
    for rank, r in enumerate(results):
        if r["seconds"] > DEADLINE_S:
            problems.append(f"rank {rank}: waited {r['seconds']:.0f} s for rank 1, which had raised at once")
        if r["raised"] is None and not complete(root, 1):
            problems.append(f"rank {rank}: acknowledged step 1, which is not complete on disk")
    if len({r["raised"] is None for r in results}) > 1:
        problems.append(f"ranks disagree: {[(r['raised'], r.get('message', '')[:120]) for r in results]}")
    problems += _again_and_resume(world, run_id, cfg, checkpointer_spec, root, n)
    assert not problems, "only rank 1's extra state is unpicklable: " + "\n".join(problems)


@pytest.mark.parametrize("how", ["plain", "atexit"])
def test_an_async_save_in_flight_at_exit_is_published_or_the_exit_fails(checkpointer_spec, checkpointer_factory,
                                                                          tmp_path, how):
    """The interpreter exits while an async save is in flight (held in its background file-system
    calls until the exit has begun), at the end of a plain script or of one that registered
    ``atexit.register(ck.maybe_wait_for_async_save)``: it is published, or the process exits non-zero."""
    need_async(checkpointer_factory)
    cfg = config_for(checkpointer_factory, T.RunConfig())
    problems = exit_problems(checkpointer_factory, checkpointer_spec, str(tmp_path / "root"), cfg, how)
    assert not problems, "\n".join(problems)


def test_a_child_forked_during_a_save_resumes_on_its_own(checkpointer_spec, checkpointer_factory, tmp_path):
    """Fork while an async save is in flight: the child's own checkpointer resumes step 1 within
    30 s (not blocked on state inherited from the parent), and the parent's save of step 2 completes."""
    need_async(checkpointer_factory)
    cfg = config_for(checkpointer_factory, T.RunConfig())
    problems = fork_problems(checkpointer_spec, str(tmp_path / "root"), cfg)
    assert not problems, "\n".join(problems)
