"""Real multi-process ``torch.distributed`` worlds for tests.

A :class:`World` is N spawned processes ("ranks") that share one process group and run
module-level functions on request, so a test can exercise a checkpointer exactly as a
training job would: every rank in its own interpreter, collectives over gloo, NCCL or HCCL.
This module is both sides of it: the rank's loop (:func:`_worker_main`, :func:`emit`) and the
parent's :class:`World`. Which backend and device (:mod:`faults.backends`) and the errors a
world raises (:mod:`faults.errors`) are modules of their own, re-exported here.

Why this shape (the fixtures built on it: ``docs/faults.md``, "Testing your own checkpointer with the plugin"):

* **spawn, never fork.** A pytest process has imported torch and started threads (OpenMP,
  gloo, hypothesis); forking it copies locks held by threads that do not exist in the child.
* **FileStore rendezvous in a fresh temp dir.** No fixed TCP port, so any number of worlds
  (pytest-xdist workers, several world sizes) can coexist on one machine.
* **Persistent ranks.** Spawning a rank that imports torch costs 1-2 s, so a world that no
  fault kills is reused across tests (``faults.plugin``'s ``world_factory``).
* **No test can hang.** Every wait has a deadline. A timeout, a rank error or a dead rank
  SIGKILLs every rank and marks the world dead (``alive`` is False): a rank that raised while
  its peers wait in a collective leaves those peers stuck, so the world cannot be trusted for
  the next test and a reusing fixture replaces it.
* **Deterministic teardown.** gloo's C++ teardown can abort a rank with SIGABRT ("terminate
  called without an active exception") when a peer exits first. :meth:`World.close` ends a
  world in lock-step: every rank joins a barrier, destroys its process group and acks; only
  when *all* ranks have acked are they told to exit, each with ``os._exit(0)`` (no C++ static
  destructors race a peer). The parent then checks every exit code, so a non-zero exit at
  close is an error, not noise: a green run means the ranks really ended cleanly.

torch is imported lazily (inside functions), so ``import faults.world`` is cheap and the
workers can pin ``OMP_NUM_THREADS`` before torch is first imported in them.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import os
import pickle
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

# Backend selection and the errors live in modules of their own; their public names are this
# module's too (``faults.world.World``, ``faults.world.RankDied``, ``faults.world.select_backend``).
from .backends import BACKENDS, BackendChoice, as_choice, device_for_rank, select_backend
from .errors import (
    BackendUnavailable,
    RankDied,
    RankError,
    WorldCloseError,
    WorldError,
    WorldTimeout,
    signal_name,
)

__all__ = [
    "BACKENDS",
    "BackendChoice",
    "BackendUnavailable",
    "RankDied",
    "RankError",
    "World",
    "WorldCloseError",
    "WorldError",
    "WorldTimeout",
    "device_for_rank",
    "emit",
    "run_world",
    "select_backend",
]

#: Seconds a run keeps collecting answers after the first rank error before it kills the
#: world. Peers of a failed rank are usually blocked in a collective that will only end at the
#: process-group timeout; waiting for that would make every error test as slow as a timeout.
DEFAULT_ERROR_GRACE = 2.0

# Messages on the parent <-> rank pipe (each message is one pickled tuple).
_MSG_READY = "ready"  # rank -> parent: process group initialised; payload: pid
_MSG_RUN = "run"  # parent -> rank: payload: pickled (fn, args, kwargs)
_MSG_OK = "ok"  # rank -> parent: payload: result
_MSG_ERR = "err"  # rank -> parent: exc type name, message, formatted traceback
_MSG_EVENT = "event"  # rank -> parent: payload from emit(); rank blocks for _MSG_ACK
_MSG_ACK = "ack"  # parent -> rank: the event was handled
_MSG_CLOSE = "close"  # parent -> rank: barrier, destroy the process group, then ack
_MSG_CLOSED = "closed"  # rank -> parent: process group destroyed
_MSG_EXIT = "exit"  # parent -> rank: every rank has closed; os._exit(0) now


#: The signal on which a rank writes every thread's Python stack (faulthandler) for a timeout report.
_STACK_SIGNAL = signal.SIGUSR1


# --------------------------------------------------------------------------------------
# Rank side
# --------------------------------------------------------------------------------------

_rank_conn: multiprocessing.connection.Connection | None = None


def emit(payload: Any = None) -> None:
    """Tell the parent that this rank reached an observed moment, and wait until it has
    handled it.

    The parent calls ``run(..., on_event=cb)``'s ``cb(rank, payload)`` before replying, so
    whatever ``cb`` does (SIGKILL this rank, corrupt a file) happens at exactly this point of
    the rank's function, not "some time later". Only callable inside a rank of a World.
    """
    conn = _rank_conn
    if conn is None:
        raise RuntimeError("faults.world.emit() called outside a World rank")
    conn.send_bytes(pickle.dumps((_MSG_EVENT, payload)))
    reply = pickle.loads(conn.recv_bytes())
    if reply[0] != _MSG_ACK:  # pragma: no cover - protocol bug
        raise RuntimeError(f"emit(): expected an ack from the parent, got {reply[0]!r}")


def _watch_parent() -> None:
    """Exit when the parent dies, so a killed pytest never leaves ranks behind."""
    parent = multiprocessing.parent_process()
    if parent is None:  # pragma: no cover - always set for spawned children
        return
    multiprocessing.connection.wait([parent.sentinel])
    os._exit(70)


def _flush_and_exit(code: int) -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # pragma: no cover - a closed stream must not block exit
            pass
    os._exit(code)


def _error_msg(e: BaseException) -> bytes:
    tb = "".join(traceback.format_exception(type(e), e, e.__traceback__))
    return pickle.dumps((_MSG_ERR, type(e).__name__, str(e), tb))


def _worker_main(
    rank: int,
    world_size: int,
    backend: str,
    device_type: str,
    init_method: str,
    timeout_s: float,
    conn: multiprocessing.connection.Connection,
    sys_path: list[str],
) -> None:
    """Body of one rank process: join the process group, then serve requests until told to
    exit. Always leaves through ``os._exit`` (see the module docstring)."""
    global _rank_conn
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    os.environ["OMP_NUM_THREADS"] = "1"  # before torch is imported here; 2-core CI boxes
    for p in reversed(sys_path):  # helper modules of tests must import here too
        if p not in sys.path:
            sys.path.insert(0, p)
    threading.Thread(target=_watch_parent, name="faults-watch-parent", daemon=True).start()
    _rank_conn = conn
    if init_method.startswith("file://"):  # the parent asks for every thread's stack on a timeout
        import faulthandler

        stack_file = open(os.path.join(os.path.dirname(init_method[len("file://"):]), f"stack.{rank}"), "w")
        faulthandler.register(_STACK_SIGNAL, file=stack_file, all_threads=True, chain=False)
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        if device_type == "cuda":
            torch.cuda.set_device(rank)
        elif device_type == "npu":
            import torch_npu  # noqa: F401

            torch.npu.set_device(rank)  # type: ignore[attr-defined]  # registered by torch_npu
        dist.init_process_group(
            backend,
            init_method=init_method,
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=timeout_s),
        )
    except BaseException as e:
        conn.send_bytes(_error_msg(e))
        _flush_and_exit(1)
    conn.send_bytes(pickle.dumps((_MSG_READY, os.getpid())))

    while True:
        try:
            msg = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):  # parent closed the pipe or died
            _flush_and_exit(3)
        kind = msg[0]
        if kind == _MSG_RUN:
            try:
                fn, args, kwargs = pickle.loads(msg[1])
                out = pickle.dumps((_MSG_OK, fn(*args, **kwargs)))
            except BaseException as e:  # SystemExit/KeyboardInterrupt in fn are errors too
                out = _error_msg(e)
            conn.send_bytes(out)
        elif kind == _MSG_CLOSE:
            try:
                dist.barrier()
                dist.destroy_process_group()
            except BaseException as e:
                conn.send_bytes(_error_msg(e))
                _flush_and_exit(1)
            conn.send_bytes(pickle.dumps((_MSG_CLOSED,)))
        elif kind == _MSG_EXIT:
            conn.close()
            _flush_and_exit(0)
        else:  # pragma: no cover - protocol bug
            bad = (_MSG_ERR, "RuntimeError", f"unknown message {kind!r}", "")
            conn.send_bytes(pickle.dumps(bad))


# --------------------------------------------------------------------------------------
# Parent side
# --------------------------------------------------------------------------------------


#: Modules the forkserver imports once, so that each forked rank starts in ~0.1 s instead of
#: re-importing torch (1-2 s on a 2-core machine). Worlds that a fault kills are fresh worlds,
#: so their start-up cost is what bounds how many crash cells a test run can afford.
FORKSERVER_PRELOAD = ["torch", "torch.distributed", "torch.distributed.checkpoint", "torch.distributed.checkpoint.state_dict",
                      "torch.optim", "torch._dynamo"]  # optimizers import torch._dynamo lazily: 1.4 s per rank
_forkserver_ready = False


def _context(start_method: str) -> Any:
    """``spawn`` (default) or ``forkserver``: a clean server process that imported torch once and
    started no threads forks each rank -- fork's speed without forking the (threaded) test process."""
    global _forkserver_ready
    ctx = multiprocessing.get_context(start_method)
    if start_method == "forkserver" and not _forkserver_ready:
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        ctx.set_forkserver_preload(list(FORKSERVER_PRELOAD))
        _forkserver_ready = True
    return ctx


def _describe(fn: Any) -> str:
    mod = getattr(fn, "__module__", None)
    name = getattr(fn, "__qualname__", None) or repr(fn)
    return f"{mod}.{name}" if mod else name


class World:
    """N spawned ranks sharing one process group, serving :meth:`run` requests.

    ``backend`` is ``'gloo'``, ``'nccl'``, ``'hccl'`` or a :class:`BackendChoice` (resolve
    ``'auto'`` with :func:`select_backend` first). ``timeout`` (seconds) bounds rendezvous,
    every :meth:`run` without its own timeout, and :meth:`close`; it is also the process
    group's collective timeout. ``error_grace`` is how long a run keeps collecting answers
    after the first rank error before it kills the world.

    Any error, timeout or dead rank kills every rank and leaves ``alive`` False; a world is
    never silently reused after a fault.
    """

    def __init__(
        self,
        world_size: int,
        backend: str | BackendChoice = "gloo",
        timeout: float = 120.0,
        *,
        error_grace: float = DEFAULT_ERROR_GRACE,
        start_method: str = "spawn",
    ) -> None:
        if start_method not in ("spawn", "forkserver"):
            raise ValueError(f"start_method must be 'spawn' or 'forkserver', got {start_method!r}")
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        if timeout <= 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout}")
        self.world_size = world_size
        self.choice = as_choice(backend)
        self.timeout = float(timeout)
        self.error_grace = float(error_grace)
        self.start_method = start_method
        self._procs: list[Any] = []
        self._conns: list[multiprocessing.connection.Connection] = []
        self._tmpdir: str | None = None
        self._started = False
        self._dead = False  # killed after a fault, or closed
        self._closed = False

    # -- lifecycle ---------------------------------------------------------------------

    @property
    def backend(self) -> str:
        return self.choice.backend

    @property
    def pids(self) -> list[int]:
        """Process ids of the ranks, in rank order (for injecting faults from outside)."""
        return [p.pid for p in self._procs]

    @property
    def exitcodes(self) -> list[int | None]:
        """Exit code of each rank in rank order (None while running; -N for signal N)."""
        return [p.exitcode for p in self._procs]

    @property
    def alive(self) -> bool:
        """True while the world is started, was never faulted, and every rank is running."""
        return (
            self._started
            and not self._dead
            and all(p.exitcode is None and p.is_alive() for p in self._procs)
        )

    def start(self) -> World:
        """Spawn the ranks and wait until all of them have joined the process group."""
        if self._started:
            raise RuntimeError("World.start() called twice")
        self._started = True
        ctx = _context(self.start_method)
        self._tmpdir = tempfile.mkdtemp(prefix="faults-world-")
        init_method = f"file://{os.path.join(self._tmpdir, 'store')}"
        try:
            for rank in range(self.world_size):
                parent_conn, child_conn = ctx.Pipe(duplex=True)
                proc = ctx.Process(
                    target=_worker_main,
                    name=f"faults-rank-{rank}",
                    args=(
                        rank,
                        self.world_size,
                        self.choice.backend,
                        self.choice.device_type,
                        init_method,
                        self.timeout,
                        child_conn,
                        list(sys.path),
                    ),
                    daemon=True,
                )
                proc.start()
                child_conn.close()
                self._procs.append(proc)
                self._conns.append(parent_conn)
            self._collect(self.timeout, None, "rendezvous (init_process_group)", expect=_MSG_READY)
        except BaseException:
            self._kill()
            raise
        return self

    def close(self) -> None:
        """End the world deterministically and check every rank exited with code 0.

        Idempotent. A world already killed by a fault is only cleaned up (its error was
        raised by the run that killed it).

        Raises:
            WorldCloseError: a rank failed to shut down, or exited non-zero.
        """
        if self._closed:
            return
        self._closed = True
        if not self._started or self._dead:
            self._kill()
            return
        what = "close (barrier + destroy_process_group)"
        try:
            for conn in self._conns:
                try:
                    conn.send_bytes(pickle.dumps((_MSG_CLOSE,)))
                except OSError:  # rank already dead; _collect names it and its signal
                    pass
            self._collect(self.timeout, None, what, expect=_MSG_CLOSED)
            # Only now may any rank exit: every process group is destroyed, so no rank's
            # gloo threads can observe a peer's socket closing.
            for conn in self._conns:
                conn.send_bytes(pickle.dumps((_MSG_EXIT,)))
            deadline = time.monotonic() + self.timeout
            for proc in self._procs:
                proc.join(max(0.0, deadline - time.monotonic()))
        except WorldError as e:
            raise WorldCloseError(
                f"world of {self.world_size} ranks did not close cleanly: {e}"
            ) from e
        except OSError as e:  # a rank's pipe broke between its ack and the exit message
            report = self._exit_report()
            self._kill()
            raise WorldCloseError(
                f"world of {self.world_size} ranks did not close cleanly: {report}"
            ) from e
        bad = [(r, p.exitcode) for r, p in enumerate(self._procs) if p.exitcode != 0]
        report = self._exit_report()
        self._kill()
        if bad:
            raise WorldCloseError(
                f"world of {self.world_size} ranks did not close cleanly: {report}"
            )

    def _exit_report(self) -> str:
        parts = []
        for r, p in enumerate(self._procs):
            code = p.exitcode
            sig = signal_name(code)
            if code is None:
                parts.append(f"rank {r}: running")
            else:
                parts.append(f"rank {r}: exit {code}" + (f" ({sig})" if sig else ""))
        return ", ".join(parts)

    def __enter__(self) -> World:
        if not self._started:
            self.start()
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            self.close()
        else:  # do not mask the test's own error with a teardown error
            try:
                self.close()
            except WorldError:
                pass

    def __repr__(self) -> str:
        if self.alive:
            state = "alive"
        else:
            state = "closed" if self._closed else "dead" if self._dead else "new"
        return f"World(world_size={self.world_size}, backend={self.backend!r}, {state})"

    # -- running -----------------------------------------------------------------------

    def run(
        self,
        fn: Callable[..., Any],
        *args: Any,
        timeout: float | None = None,
        on_event: Callable[[int, Any], None] | None = None,
        collect_failures: bool = False,
        **kwargs: Any,
    ) -> list[Any]:
        """Run ``fn(*args, **kwargs)`` on every rank; return the results in rank order.

        ``collect_failures=True`` is for tests of what *survivors* do when a peer dies or
        hangs: instead of raising at the first dead rank, the run keeps waiting for the others
        until ``timeout``; a dead rank's entry is its :class:`RankDied`, a rank that raised
        gives its :class:`RankError`, and a rank that never answered its
        :class:`WorldTimeout`. The world is killed afterwards if any of that happened.

        ``fn`` must be a picklable module-level function; it runs with the process group
        initialised. ``on_event(rank, payload)`` is called for every :func:`emit` while
        waiting, before the emitting rank resumes.

        Raises:
            RankError: a rank raised (the world is killed).
            RankDied: a rank exited or was killed by a signal (the world is killed).
            WorldTimeout: not every rank answered within ``timeout`` (the world is killed).
            RuntimeError: the world is not alive.
        """
        if not self._started:
            self.start()
        if not self.alive:
            raise RuntimeError(f"{self!r} is not alive; start a new World")
        # Pickle here so an unpicklable fn/argument fails in the caller, world untouched.
        payload = pickle.dumps((fn, args, kwargs))
        what = _describe(fn)
        for conn in self._conns:
            conn.send_bytes(pickle.dumps((_MSG_RUN, payload)))
        limit = self.timeout if timeout is None else timeout
        return self._collect(limit, on_event, what, expect=_MSG_OK, collect_failures=collect_failures)

    def _collect(
        self,
        timeout: float,
        on_event: Callable[[int, Any], None] | None,
        what: str,
        *,
        expect: str,
        collect_failures: bool = False,
    ) -> list[Any]:
        """Wait for one ``expect`` answer per rank; on any fault kill the world and raise."""
        results: list[Any] = [None] * self.world_size
        pending = set(range(self.world_size))
        errors: dict[int, tuple[str, str, str]] = {}
        first_error: int | None = None
        faulted = False
        deadline = time.monotonic() + timeout
        conn_rank = {id(c): r for r, c in enumerate(self._conns)}
        sentinel_rank = {p.sentinel: r for r, p in enumerate(self._procs)}

        def handle(rank: int) -> None:
            nonlocal first_error
            msg = pickle.loads(self._conns[rank].recv_bytes())
            kind = msg[0]
            if kind == _MSG_EVENT:
                try:
                    if on_event is not None:
                        on_event(rank, msg[1])
                finally:
                    # The callback may have killed this rank; then there is nobody to ack.
                    try:
                        self._conns[rank].send_bytes(pickle.dumps((_MSG_ACK,)))
                    except OSError:
                        pass
                return
            pending.discard(rank)
            if kind == expect:
                results[rank] = msg[1] if len(msg) > 1 else None
            elif kind == _MSG_ERR:
                errors[rank] = (msg[1], msg[2], msg[3])
                if first_error is None:
                    first_error = rank
            else:  # pragma: no cover - protocol bug
                errors[rank] = ("RuntimeError", f"unexpected message {kind!r} during {what}", "")
                if first_error is None:
                    first_error = rank

        try:
            while pending:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                waitables: list[Any] = []
                for r in pending:
                    waitables.append(self._conns[r])
                    waitables.append(self._procs[r].sentinel)
                ready = multiprocessing.connection.wait(waitables, timeout=remaining)
                dead: list[int] = []
                had_error = first_error
                for obj in ready:
                    if isinstance(obj, int):
                        dead.append(sentinel_rank[obj])
                        continue
                    rank = conn_rank[id(obj)]
                    if rank not in pending:
                        continue
                    try:
                        handle(rank)
                    except (EOFError, OSError):
                        dead.append(rank)
                for rank in sorted(set(dead)):
                    # Drain what the rank sent before it died (its answer may be there).
                    try:
                        while rank in pending and self._conns[rank].poll():
                            handle(rank)
                    except (EOFError, OSError):
                        pass
                    if rank in pending:
                        proc = self._procs[rank]
                        proc.join(5.0)  # the sentinel fired, so this returns at once
                        if not collect_failures:
                            raise RankDied(rank, proc.exitcode, what=what)
                        results[rank] = RankDied(rank, proc.exitcode, what=what)
                        pending.discard(rank)
                        faulted = True
                if collect_failures:
                    continue
                if had_error is None and first_error is not None:
                    # Peers of a failed rank are probably stuck in a collective with it;
                    # give the others a moment to answer, then kill the world.
                    deadline = min(deadline, time.monotonic() + self.error_grace)
        except BaseException:
            self._kill()
            raise

        if collect_failures:
            for rank, (exc_type, message, tb) in errors.items():
                results[rank] = RankError(rank, exc_type, message, tb, errors=errors, unanswered=sorted(pending), what=what)
            for rank in pending:
                results[rank] = WorldTimeout([rank], timeout, what=what)
            if faulted or errors or pending:
                self._kill()
            return results
        if first_error is not None:
            self._kill()
            exc_type, message, tb = errors[first_error]
            raise RankError(
                first_error,
                exc_type,
                message,
                tb,
                errors=errors,
                unanswered=sorted(pending),
                what=what,
            )
        if pending:
            stacks = self._stacks(sorted(pending))
            self._kill()
            raise WorldTimeout(sorted(pending), timeout, what=what, stacks=stacks)
        return results

    def _stacks(self, ranks: list[int]) -> dict[int, str]:
        """Every thread's Python stack of each of ``ranks`` (faulthandler, on a signal), before they
        are killed. Best effort: a rank stuck in C code with the GIL held writes nothing; each
        gets up to 2 s to finish writing (bounded; this is diagnostics, not synchronisation)."""
        if self._tmpdir is None:
            return {}
        out: dict[int, str] = {}
        for rank in ranks:
            path = os.path.join(self._tmpdir, f"stack.{rank}")
            try:
                os.kill(self._procs[rank].pid, _STACK_SIGNAL)
            except (OSError, TypeError):
                continue
            deadline, last = time.monotonic() + 2.0, -1
            while time.monotonic() < deadline:
                size = os.path.getsize(path) if os.path.exists(path) else 0
                if size and size == last:  # stopped growing: written out
                    break
                last = size
                time.sleep(0.05)
            try:
                with open(path, errors="replace") as f:
                    out[rank] = f.read()
            except OSError:
                pass
        return out

    def _kill(self) -> None:
        """SIGKILL every rank still running, reap them, and remove the rendezvous dir."""
        self._dead = True
        for proc in self._procs:
            if proc.exitcode is None:
                try:
                    proc.kill()
                except (OSError, ValueError):  # already reaped / never started
                    pass
        for proc in self._procs:
            try:
                proc.join(10.0)
            except (AssertionError, ValueError):  # never started
                pass
        for conn in self._conns:
            conn.close()
        if self._tmpdir is not None:
            shutil.rmtree(self._tmpdir, ignore_errors=True)
            self._tmpdir = None


def run_world(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    backend: str | BackendChoice = "gloo",
    timeout: float = 120.0,
    on_event: Callable[[int, Any], None] | None = None,
    start_method: str = "spawn",
    collect_failures: bool = False,
    **kwargs: Any,
) -> list[Any]:
    """Run ``fn`` once in a fresh world of ``world_size`` ranks, then close it.

    For tests whose faults kill ranks; a clean run also checks the world closed cleanly.
    ``start_method="forkserver"`` starts ranks in ~0.1 s (see :data:`FORKSERVER_PRELOAD`).
    """
    world = World(world_size, backend, timeout, start_method=start_method)
    with world:
        return world.run(fn, *args, timeout=timeout, on_event=on_event,
                         collect_failures=collect_failures, **kwargs)
