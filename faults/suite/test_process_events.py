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
* no wait exceeds a deadline (30 s here: a peer left waiting for a collective waits its timeout);
* after the event the *same* checkpointer objects save the next step and a restarted job resumes
  it bitwise;
* an async save in flight at exit is published, or the process exits non-zero -- never lost
  with status 0; a child forked during a save resumes on its own, and the parent's save completes.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import textwrap
import uuid

import pytest

from faults import training as T

from ._common import committed, config_for, same_path, step_path

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

#: the deadline of one save in these tests (a peer that waits for a dead collective waits longer)
DEADLINE_S = 30.0
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
    n = suite_world_size
    ranks = (0,) if who == "rank0" else (1,) if who == "rank1" else tuple(range(n))
    cfg = config_for(checkpointer_factory, T.RunConfig())
    run_id, root = uuid.uuid4().hex, str(tmp_path / "root")
    world.run(T.r_start, run_id, cfg, checkpointer_spec, {}, timeout=120)
    world.run(T.r_train, run_id, 1, timeout=120)
    counts = world.run(T.r_count_save_ops, run_id, root, timeout=120)  # step 1, acknowledged
    ops = min(counts[r] for r in ranks)
    if ops == 0:
        pytest.skip("the checkpointer's save made no file-system operation this harness can observe on that rank")
    nth = {"first": 1, "middle": max(1, ops // 2), "last": ops}[where]
    world.run(T.r_train, run_id, 1, timeout=120)
    results = world.run(T.r_interrupted_save, run_id, root, nth, signame, ranks, timeout=120)
    assert any(r["fired"] for r in results), f"the {signame} at operation {nth} was never sent"
    problems = []
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
        if r["raised"] is None and not committed(root, 2):
            problems.append(f"rank {rank}: save of step 2 acknowledged, but step 2 is not complete on disk")
    acked = {r["raised"] is None for r in others}
    if len(acked) > 1:
        problems.append("ranks that were not interrupted disagree: some acknowledged step 2, some raised "
                        f"({[(r['raised'], r.get('message', '')[:120]) for r in others]})")
    problems += _again_and_resume(world, run_id, cfg, checkpointer_spec, root, n)
    assert not problems, f"{signame} at operation {nth} of {ops} on rank(s) {list(ranks)}:\n" + "\n".join(problems)


def test_one_ranks_bad_state_fails_every_rank_quickly(checkpointer_spec, checkpointer_factory, world_factory,
                                                      suite_world_size, tmp_path):
    """Only rank 1's extra state cannot be pickled: every rank raises an Exception within the
    deadline, none acknowledges, and the same objects then save and resume."""
    world = _world2(world_factory, suite_world_size)
    n = suite_world_size
    cfg = config_for(checkpointer_factory, T.RunConfig())
    run_id, root = uuid.uuid4().hex, str(tmp_path / "root")
    world.run(T.r_start, run_id, cfg, checkpointer_spec, {}, timeout=120)
    world.run(T.r_train, run_id, 1, timeout=120)
    results = world.run(T.r_save_with_bad_extra, run_id, root, 1, timeout=120)
    problems = []
    for rank, r in enumerate(results):
        if r["seconds"] > DEADLINE_S:
            problems.append(f"rank {rank}: waited {r['seconds']:.0f} s for rank 1, which had raised at once")
        if r["raised"] is None and not committed(root, 1):
            problems.append(f"rank {rank}: acknowledged step 1, which is not complete on disk")
    if len({r["raised"] is None for r in results}) > 1:
        problems.append(f"ranks disagree: {[(r['raised'], r.get('message', '')[:120]) for r in results]}")
    problems += _again_and_resume(world, run_id, cfg, checkpointer_spec, root, n)
    assert not problems, "only rank 1's extra state is unpicklable:\n" + "\n".join(problems)


_PRELUDE = textwrap.dedent('''
    import os, pickle, signal, sys, threading
    from faults import training as T

    spec, root, cfg = sys.argv[1], sys.argv[2], pickle.loads(bytes.fromhex(sys.argv[3]))
    ck = T.load_factory(spec)()
    run = T.TrainRun(cfg)

    def save(step, save_async):
        run.train_to(step)
        ck.save(os.path.join(root, f"global_step_{step}"), run.state(), global_step=step, save_async=save_async)

    _real = {n: getattr(os, n) for n in ("fsync", "replace", "rename", "mkdir")}
    # Set by an exit hook registered after the checkpointer's module (and concurrent.futures) were
    # imported, so it runs before theirs (threading's exit hooks run last-registered first).
    import concurrent.futures.thread  # its exit hook (which joins pool threads) is registered before ours
    exiting = threading.Event()
    threading._register_atexit(exiting.set)

    def hold_background_until(event):
        """Every file-system call of a thread other than the main one waits for ``event`` (60 s at most)."""
        def wrap(fn):
            def inner(*a, **k):
                if threading.current_thread() is not threading.main_thread():
                    event.wait(60)
                return fn(*a, **k)
            return inner
        for n, fn in _real.items():
            setattr(os, n, wrap(fn))
''')

_EXIT = _PRELUDE + textwrap.dedent('''
    import atexit
    save(1, False)
    if sys.argv[4] == "atexit":
        atexit.register(ck.maybe_wait_for_async_save)  # what a careful trainer registers
    hold_background_until(exiting)  # in flight until the exit has begun
    save(2, True)
    # the script ends here: the interpreter exits with the async save of step 2 in flight
''')

_FORK = _PRELUDE + textwrap.dedent('''
    save(1, False)
    child_done = threading.Event()
    hold_background_until(child_done)  # the async save stays in flight until the child ended
    save(2, True)
    pid = os.fork()
    if pid == 0:
        code = 3
        try:
            signal.alarm(30)
            ck2 = T.load_factory(spec)()
            path = ck2.find_latest_checkpoint(root)
            fresh = T.TrainRun(cfg)
            state = fresh.state(target=True)
            skeleton = state.pop("extra_state")
            loaded = ck2.load(path, state, extra_state_skeleton=skeleton)
            fresh.apply(loaded if isinstance(loaded, dict) else state)
            code = 0 if fresh.step == 1 and fresh.digest() == T.reference_digest(cfg, 1) else 4
        except BaseException as e:
            print(f"child: {type(e).__name__}: {e}", flush=True)
            code = 5
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    child_done.set()
    print("CHILD", status, flush=True)
    ck.maybe_wait_for_async_save()
    print("PARENT SAVED", flush=True)
''')


def _script(body: str, spec: str, root: str, cfg, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", body, spec, root, pickle.dumps(cfg).hex(), *extra],
                          capture_output=True, text=True, timeout=180, cwd=os.getcwd())


@pytest.mark.parametrize("how", ["plain", "atexit"])
def test_an_async_save_in_flight_at_exit_is_published_or_the_exit_fails(checkpointer_spec, checkpointer_factory,
                                                                          tmp_path, how):
    """The interpreter exits while an async save is in flight (held in its background file-system
    calls until the exit has begun), at the end of a plain script or of one that registered
    ``atexit.register(ck.maybe_wait_for_async_save)``: it is published, or the process exits non-zero."""
    cfg = config_for(checkpointer_factory, T.RunConfig())
    root = str(tmp_path / "root")
    p = _script(_EXIT, checkpointer_spec, root, cfg, how)
    out = (p.stdout + p.stderr)[-3000:]
    assert committed(root, 1), f"step 1 (a sync save) is not on disk: the script failed:\n{out}"
    if p.returncode == 0:
        assert committed(root, 2), ("the async save of step 2, in flight when the interpreter exited, was lost "
                                    f"and the process exited with status 0:\n{out}")
        path, run = _resume(checkpointer_factory, root, cfg)
        assert same_path(path, step_path(root, 2)) and run.digest() == T.reference_digest(cfg, 2), path


def _resume(factory, root, cfg):
    from ._common import resume

    return resume(factory(), root, cfg)


def test_a_child_forked_during_a_save_resumes_on_its_own(checkpointer_spec, checkpointer_factory, tmp_path):
    """Fork while an async save is in flight: the child's own checkpointer resumes step 1 within
    30 s (not blocked on state inherited from the parent), and the parent's save of step 2 completes."""
    cfg = config_for(checkpointer_factory, T.RunConfig())
    root = str(tmp_path / "root")
    p = _script(_FORK, checkpointer_spec, root, cfg, "-")
    out = (p.stdout + p.stderr)[-3000:]
    status = next((int(line.split()[1]) for line in p.stdout.splitlines() if line.startswith("CHILD ")), None)
    assert status is not None, f"the script did not fork:\n{out}"
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, (
        f"the child forked during a save did not resume step 1 on its own (status {status}: "
        f"{'killed by its 30 s alarm: it hung' if os.WIFSIGNALED(status) else 'see its output'}):\n{out}")
    assert p.returncode == 0 and "PARENT SAVED" in p.stdout and committed(root, 2), (
        f"the parent's async save of step 2 did not complete after the fork:\n{out}")
