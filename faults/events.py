"""Process events that need a whole interpreter: exit with an async save in flight, and ``fork``
during a save. The scripts run any checkpointer (``package.module:factory``) in a real ``python -c``;
:func:`exit_problems` and :func:`fork_problems` judge what they did. Used by ``faults.suite``
(tests/test_process_events.py there) and by the fault matrix's cells of these kinds.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import textwrap
from typing import Any

__all__ = ["EXIT_SCRIPT", "FORK_SCRIPT", "run_script", "exit_problems", "fork_problems"]

PRELUDE = textwrap.dedent('''
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
        """Every file-system call of a thread other than the main one waits for ``event``; a daemon
        thread's then waits on until the main thread waits for something (joins a daemon thread,
        waits on an Event, a Future, a queue: a Condition) after ``event``. A daemon thread that no
        one waits for is thus still held when the interpreter abandons it, on a loaded machine as on
        an idle one, instead of racing the interpreter's exit (60 s at most per wait)."""
        waited = threading.Event()
        real_join, real_cwait = threading.Thread.join, threading.Condition.wait

        def main_waits():
            if event.is_set() and threading.current_thread() is threading.main_thread():
                waited.set()

        def join(self, *a, **k):
            if self.daemon:
                main_waits()
            return real_join(self, *a, **k)

        def cwait(self, *a, **k):
            main_waits()
            return real_cwait(self, *a, **k)

        threading.Thread.join, threading.Condition.wait = join, cwait

        def wrap(fn):
            def inner(*a, **k):
                me = threading.current_thread()
                if me is not threading.main_thread():
                    event.wait(60)
                    if me.daemon:
                        waited.wait(60)
                return fn(*a, **k)
            return inner
        for n, fn in _real.items():
            setattr(os, n, wrap(fn))
''')

EXIT_SCRIPT = PRELUDE + textwrap.dedent('''
    import atexit
    save(1, False)
    if sys.argv[4] == "atexit":
        atexit.register(ck.maybe_wait_for_async_save)  # what a careful trainer registers
    hold_background_until(exiting)  # in flight until the exit has begun
    save(2, True)
    # the script ends here: the interpreter exits with the async save of step 2 in flight
''')

FORK_SCRIPT = PRELUDE + textwrap.dedent('''
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



def run_script(body: str, spec: str, root: str, cfg: Any, *extra: str, timeout: float = 180) -> subprocess.CompletedProcess:
    """Run ``body`` in a fresh interpreter with the checkpointer ``spec``, ``root`` and the run config."""
    return subprocess.run([sys.executable, "-c", body, spec, root, pickle.dumps(cfg).hex(), *extra],
                          capture_output=True, text=True, timeout=timeout, cwd=os.getcwd())


def exit_problems(factory: Any, spec: str, root: str, cfg: Any, how: str) -> list[str]:
    """The interpreter exits while an async save of step 2 is in flight (held in its background
    file-system calls until the exit has begun), at the end of a plain script (``how="plain"``) or of
    one that registered ``atexit.register(ck.maybe_wait_for_async_save)`` (``"atexit"``): step 2 must
    be published and resume bitwise, or the process must exit with a non-zero status (death by a
    signal with step 2 lost is a violation: that is a thread abandoned at exit, not a failed exit).
    Where the script itself waits for the save at exit (``"atexit"``), nothing is wrong with the
    save, and the caller asked for it to finish, a failed exit is no excuse: step 2 must be
    published (issue 29: a checkpointer whose own exit hook gave up on the save before the
    caller's wait ran -- a timeout it could not compute -- exited 1 and lost it)."""
    from .suite._common import Completeness, resume, same_path, step_path
    from .training import reference_digest

    committed = Completeness(factory)
    p = run_script(EXIT_SCRIPT, spec, root, cfg, how)
    out = (p.stdout + p.stderr)[-3000:]
    if not committed(root, 1):
        return [f"step 1 (a sync save) is not on disk: the script failed ({_last_line(p)}):\n{out}"]
    if p.returncode > 0 and how != "atexit":  # the exit failed: the loss (if any) was reported
        return []
    if not committed(root, 2) and p.returncode > 0:
        return [f"the async save of step 2, in flight at exit, was lost although the script waited for it "
                f"(atexit.register(ck.maybe_wait_for_async_save)) and nothing failed it: the process exited "
                f"with status {p.returncode} instead of finishing it:\n{out}"]
    if not committed(root, 2):
        # Death by a signal is not a failed exit: a daemon thread the interpreter abandons while it
        # runs C++ code aborts the process ("terminate called without an active exception") or not,
        # by timing. Either way the save was lost without the exit saying so.
        ended = ("exited with status 0" if p.returncode == 0 else
                 f"died of {_signal_name(-p.returncode)} at exit instead of failing its exit")
        return ["the async save of step 2, in flight when the interpreter exited, was lost "
                f"and the process {ended}:\n{out}"]
    path, run = resume(factory(), root, cfg)
    if not same_path(path, step_path(root, 2)) or run.digest() != reference_digest(cfg, 2):
        return [f"the async save of step 2 published at exit resumes {path}, not step 2 bitwise"]
    return []


def fork_problems(spec: str, root: str, cfg: Any, factory: Any = None) -> list[str]:
    """Fork while an async save of step 2 is in flight: the child's own checkpointer resumes step 1
    within 30 s (not blocked on state inherited from the parent), and the parent's save completes."""
    from .suite._common import Completeness
    from .training import load_factory

    committed = Completeness(factory if factory is not None else load_factory(spec))
    p = run_script(FORK_SCRIPT, spec, root, cfg, "-")
    out = (p.stdout + p.stderr)[-3000:]
    status = next((int(line.split()[1]) for line in p.stdout.splitlines() if line.startswith("CHILD ")), None)
    if status is None:
        return [f"the script did not fork ({_last_line(p)}):\n{out}"]
    if not (os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0):
        return [f"the child forked during a save did not resume step 1 on its own (status {status}: "
                f"{'killed by its 30 s alarm: it hung' if os.WIFSIGNALED(status) else 'see its output'}):\n{out}"]
    if not (p.returncode == 0 and "PARENT SAVED" in p.stdout and committed(root, 2)):
        return [f"the parent's async save of step 2 did not complete after the fork:\n{out}"]
    return []


def _signal_name(signum: int) -> str:
    """``SIGABRT`` for 6; ``signal 99`` for a number that names no signal."""
    import signal

    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def _last_line(p: subprocess.CompletedProcess) -> str:
    """The script's last line of output (its error, where it failed), for a one-line finding."""
    lines = [ln.strip() for ln in (p.stderr or p.stdout or "").splitlines() if ln.strip()]
    return lines[-1][:300] if lines else f"exit status {p.returncode}, no output"
