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

**Inside a torchrun job.** :class:`TorchrunWorld` (``World.from_env()``) is the same interface
over a world ``torchrun`` already launched (env:// rendezvous: ``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``, read by :func:`torchrun_env`, which refuses an
inconsistent environment). There is no parent: every rank runs the caller's code in lock-step,
``run(fn)`` calls ``fn`` in this very process and exchanges the results, so every rank gets every
rank's result (or the same error) and takes the same next step. Faults that kill ranks are not
available there (``emit``/``on_event`` raise): the ranks are torchrun's to kill and restart.
"""

from __future__ import annotations

import dataclasses
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
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import Any

# Backend selection and the errors live in modules of their own; their public names are this
# module's too (``faults.world.World``, ``faults.world.RankDied``, ``faults.world.select_backend``).
from .backends import (
    BACKENDS,
    BackendChoice,
    as_choice,
    device_for_rank,
    process_group_backend,
    select_backend,
    select_local_backend,
)
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
    "TorchrunEnv",
    "TorchrunEnvError",
    "TorchrunExchangeError",
    "TorchrunWorld",
    "World",
    "WorldCloseError",
    "WorldError",
    "WorldTimeout",
    "device_for_rank",
    "emit",
    "run_world",
    "select_backend",
    "select_local_backend",
    "torchrun_env",
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
        raise RuntimeError("faults.world.emit() called outside a World rank (a TorchrunWorld has no parent to "
                           "report to: faults at an emitted moment need a spawned World)")
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

    def abandon(self) -> None:
        """Kill every rank without the closing barrier: for a world whose process groups a test broke
        on purpose (a collective that timed out leaves gloo's pairs closed, so the barrier cannot run)."""
        self._closed = True
        self._kill()

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

    @staticmethod
    def from_env(backend: str | BackendChoice = "gloo", timeout: float = 120.0, *,
                 environ: Mapping[str, str] | None = None) -> TorchrunWorld:
        """The world of the job ``torchrun`` launched this process in (see :class:`TorchrunWorld`)."""
        return TorchrunWorld.from_env(backend, timeout, environ=environ)

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


# --------------------------------------------------------------------------------------
# Inside a job torchrun launched
# --------------------------------------------------------------------------------------

#: Variables whose presence says "this process is a rank torchrun launched" (one is enough).
TORCHRUN_MARKERS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "TORCHELASTIC_RUN_ID")
#: Variables an env:// rendezvous needs (``LOCAL_RANK`` picks the rank's device).
TORCHRUN_REQUIRED = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


class TorchrunEnvError(WorldError, ValueError):
    """The environment looks like a torchrun rank's (one of :data:`TORCHRUN_MARKERS` is set) but
    is not a consistent one, or this process's process group disagrees with it. The message
    names the variables and their values."""


class TorchrunExchangeError(WorldError, RuntimeError):
    """This rank could not collect the other ranks' results of a :meth:`TorchrunWorld.run` (a
    peer never arrived, or left): the world is dead, as a :class:`World` is after a fault."""


@dataclasses.dataclass(frozen=True)
class TorchrunEnv:
    """What torchrun told this rank, checked for consistency by :func:`torchrun_env`."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str
    master_port: int
    restart_count: int = 0
    """``TORCHELASTIC_RESTART_COUNT``: which incarnation of the job this is."""
    group_rank: int | None = None
    """``GROUP_RANK``: this node's (agent's) rank, when torchrun gives it."""

    @property
    def store_prefix(self) -> str:
        """Prefix of every key this incarnation's default group puts in the rendezvous store.

        Since torch 2.5 torchrun's ranks share the agent's TCPStore across restarts, so without
        it a restarted incarnation can read the dead one's keys (peer addresses of ranks that
        are gone: pytorch/pytorch#135712)."""
        return f"faults/torchrun/restart_{self.restart_count}/"


def torchrun_env(environ: Mapping[str, str] | None = None) -> TorchrunEnv | None:
    """The torchrun rank this process is, from ``environ`` (default ``os.environ``); None when
    no variable of :data:`TORCHRUN_MARKERS` is set (not under torchrun).

    Raises:
        TorchrunEnvError: some are set but not a consistent set: a variable of
            :data:`TORCHRUN_REQUIRED` missing or empty, a number that is not a non-negative
            integer, ``RANK >= WORLD_SIZE``, ``LOCAL_RANK >= LOCAL_WORLD_SIZE``,
            ``LOCAL_RANK > RANK``, ``LOCAL_WORLD_SIZE > WORLD_SIZE``, or a port outside 1-65535.
    """
    env = os.environ if environ is None else environ
    present = [k for k in TORCHRUN_MARKERS if env.get(k)]
    if not present:
        return None
    shown = ", ".join(f"{k}={env[k]!r}" for k in (*TORCHRUN_REQUIRED, "LOCAL_WORLD_SIZE", "TORCHELASTIC_RESTART_COUNT")
                      if k in env)
    fix = ("launch with torchrun (it sets all of them), or unset them to let the harness spawn its own worlds")

    def bad(why: str) -> TorchrunEnvError:
        return TorchrunEnvError(f"this process looks like a torchrun rank ({', '.join(present)} set) but {why} "
                                f"[{shown or 'nothing else set'}]; {fix}")

    missing = [k for k in TORCHRUN_REQUIRED if not env.get(k)]
    if missing:
        raise bad(f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not set")

    def number(key: str, default: int | None = None) -> int:
        raw = env.get(key)
        if raw is None or raw == "":
            if default is None:
                raise bad(f"{key} is not set")
            return default
        try:
            value = int(raw)
        except ValueError:
            raise bad(f"{key}={raw!r} is not an integer") from None
        if value < 0:
            raise bad(f"{key}={raw!r} is negative")
        return value

    rank, world_size, local_rank = number("RANK"), number("WORLD_SIZE"), number("LOCAL_RANK")
    local_world_size = number("LOCAL_WORLD_SIZE", world_size)
    port = number("MASTER_PORT")
    if world_size < 1:
        raise bad("WORLD_SIZE is 0")
    if rank >= world_size:
        raise bad(f"RANK={rank} is not a rank of WORLD_SIZE={world_size}")
    if not 1 <= local_world_size <= world_size:
        raise bad(f"LOCAL_WORLD_SIZE={local_world_size} is not between 1 and WORLD_SIZE={world_size}")
    if local_rank >= local_world_size:
        raise bad(f"LOCAL_RANK={local_rank} is not a rank of LOCAL_WORLD_SIZE={local_world_size}")
    if local_rank > rank:
        raise bad(f"LOCAL_RANK={local_rank} is above RANK={rank} (a node's ranks are numbered within the job's)")
    if not 1 <= port <= 65535:
        raise bad(f"MASTER_PORT={port} is not a TCP port")
    group_rank = number("GROUP_RANK") if env.get("GROUP_RANK") else None
    return TorchrunEnv(rank, world_size, local_rank, local_world_size, env["MASTER_ADDR"], port,
                       number("TORCHELASTIC_RESTART_COUNT", 0), group_rank)


def _r_identity(value: Any) -> Any:
    return value


class TorchrunWorld:
    """A :class:`World`'s interface over the world ``torchrun`` launched this process in.

    Every rank of the job makes one (``World.from_env()`` / :meth:`from_env`) and runs the same
    code in lock-step. :meth:`run` calls ``fn`` here, on this rank, then exchanges every rank's
    outcome over a gloo group of its own (so a rank whose ``fn`` raised never meets a peer's
    collective inside ``fn``): every rank returns the same list in rank order, or raises the
    same :class:`RankError`. That is what makes verdicts agree: each rank judges the same results.

    :meth:`start` joins the default process group: ``init_process_group`` over the env://
    rendezvous store with this incarnation's :attr:`TorchrunEnv.store_prefix`, the device of
    ``LOCAL_RANK`` set first for NCCL/HCCL (:func:`faults.backends.process_group_backend`); a
    group the process already has is adopted if its rank and size are torchrun's, and then left
    to its owner at :meth:`close`. ``timeout`` is the default group's collective timeout; the
    exchange waits up to twice as long, so a peer whose collective inside ``fn`` timed out still
    reports. ``run(timeout=...)`` is accepted for the :class:`World` interface; these deadlines
    are what bound a run.

    Not available: ``on_event`` (and :func:`emit` in ``fn``) -- faults at an emitted moment kill
    ranks from a parent, and a torchrun job's ranks are torchrun's to kill and restart.
    """

    def __init__(self, env: TorchrunEnv, backend: str | BackendChoice = "gloo", timeout: float = 120.0) -> None:
        if timeout <= 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout}")
        self.env = env
        self.world_size = env.world_size
        self.rank = env.rank
        self.local_rank = env.local_rank
        self.choice = (select_local_backend(backend, env.local_rank, env.local_world_size)
                       if isinstance(backend, str) and backend == "auto" else as_choice(backend))
        self.timeout = float(timeout)
        self._side: Any = None
        self._owns_group = False
        self._started = False
        self._dead = False
        self._closed = False

    @classmethod
    def from_env(cls, backend: str | BackendChoice = "gloo", timeout: float = 120.0, *,
                 environ: Mapping[str, str] | None = None) -> TorchrunWorld:
        """This process's torchrun world (not started). ``backend``: ``gloo``, ``nccl``, ``hccl``
        or ``auto``, resolved for this node's ranks (:func:`select_local_backend`).

        Raises:
            TorchrunEnvError: not under torchrun, or an inconsistent torchrun environment.
            BackendUnavailable: this node has no device of ``LOCAL_RANK`` for the backend.
        """
        env = torchrun_env(environ)
        if env is None:
            raise TorchrunEnvError(
                "not a torchrun rank: none of " + ", ".join(TORCHRUN_MARKERS) + " is set; launch with "
                "torchrun --nnodes=N --nproc-per-node=M --rdzv-backend=c10d --rdzv-endpoint=HOST:PORT ...")
        if isinstance(backend, str):
            backend = select_local_backend(backend, env.local_rank, env.local_world_size)
        return cls(env, backend, timeout)

    @property
    def backend(self) -> str:
        return self.choice.backend

    @property
    def device(self) -> Any:
        """This rank's device: ``cuda:LOCAL_RANK``, ``npu:LOCAL_RANK`` or ``cpu``."""
        return device_for_rank(self.choice, self.local_rank)

    @property
    def alive(self) -> bool:
        if not self._started or self._dead or self._closed:
            return False
        import torch.distributed as dist

        return dist.is_initialized()

    def start(self) -> TorchrunWorld:
        """Join (or adopt) the default process group and make the exchange group."""
        if self._started:
            raise RuntimeError("TorchrunWorld.start() called twice")
        self._started = True
        import torch
        import torch.distributed as dist

        env = self.env
        pg_timeout = timedelta(seconds=self.timeout)
        if dist.is_initialized():
            got = (dist.get_rank(), dist.get_world_size())
            if got != (env.rank, env.world_size):
                self._dead = True
                raise TorchrunEnvError(
                    f"this process's default process group is rank {got[0]} of {got[1]}, but torchrun set "
                    f"RANK={env.rank} WORLD_SIZE={env.world_size}; initialise it from the environment (env://) "
                    "or let the harness do it")
        else:
            try:
                if self.choice.device_type == "cuda":
                    torch.cuda.set_device(env.local_rank)
                elif self.choice.device_type == "npu":
                    import torch_npu  # noqa: F401

                    torch.npu.set_device(env.local_rank)  # type: ignore[attr-defined]  # registered by torch_npu
                store, rank, world_size = next(dist.rendezvous("env://", timeout=pg_timeout))
                dist.init_process_group(process_group_backend(self.choice),
                                        store=dist.PrefixStore(env.store_prefix, store),
                                        rank=rank, world_size=world_size, timeout=pg_timeout)
            except BaseException:
                self._dead = True
                raise
            self._owns_group = True
        try:
            self._side = dist.new_group(backend="gloo", timeout=2 * pg_timeout)
        except BaseException:
            self._dead = True
            raise
        return self

    def run(
        self,
        fn: Callable[..., Any],
        *args: Any,
        timeout: float | None = None,
        on_event: Callable[[int, Any], None] | None = None,
        collect_failures: bool = False,
        **kwargs: Any,
    ) -> list[Any]:
        """Run ``fn(*args, **kwargs)`` on this rank; return every rank's result, in rank order.

        Every rank of the job must call it with the same ``fn`` (arguments may differ: each rank
        passes its own). Like :meth:`World.run`: a rank that raised makes every rank raise the
        same :class:`RankError` (``collect_failures=True``: its entry is that error instead).

        Raises:
            RankError: a rank's ``fn`` raised (the world stays usable: every rank answered).
            TorchrunExchangeError: the results could not be exchanged (the world is dead).
            NotImplementedError: ``on_event`` was given.
            RuntimeError: the world is not alive.
        """
        if on_event is not None:
            raise NotImplementedError(
                "on_event: a torchrun world has no parent to kill ranks at an emitted moment (its ranks are "
                "torchrun's to kill and restart); run faults that kill ranks in a spawned World")
        if not self._started:
            self.start()
        if not self.alive:
            raise RuntimeError(f"{self!r} is not alive")
        import torch.distributed as dist

        what = _describe(fn)
        try:
            out: tuple[Any, ...] = (_MSG_OK, fn(*args, **kwargs))
            pickle.dumps(out)  # an unpicklable result is this rank's error, reported to every rank
        except BaseException as e:  # SystemExit/KeyboardInterrupt in fn are errors too
            out = (_MSG_ERR, type(e).__name__, str(e), "".join(traceback.format_exception(type(e), e, e.__traceback__)))
        gathered: list[Any] = [None] * self.world_size
        try:
            dist.all_gather_object(gathered, out, group=self._side)
        except BaseException as e:
            self._dead = True
            mine = "returned" if out[0] == _MSG_OK else f"raised {out[1]}: {out[2]}"
            raise TorchrunExchangeError(
                f"rank {self.rank} could not collect the results of {what} from every rank within "
                f"{2 * self.timeout:g} s ({type(e).__name__}: {e}); its own call {mine}. A peer did not arrive "
                "(stuck, or gone); this world is dead -- end the job and let torchrun restart it") from e
        errors = {r: (o[1], o[2], o[3]) for r, o in enumerate(gathered) if o[0] == _MSG_ERR}
        if collect_failures:
            return [RankError(r, *errors[r], errors=errors, what=what) if r in errors else o[1]
                    for r, o in enumerate(gathered)]
        if errors:
            first = min(errors)
            raise RankError(first, *errors[first], errors=errors, what=what)
        return [o[1] for o in gathered]

    def agree(self, value: Any) -> list[Any]:
        """Every rank's ``value``, in rank order (a collective: every rank calls it)."""
        return self.run(_r_identity, value)

    def close(self) -> None:
        """End in lock-step: a barrier on the exchange group, then destroy it and, if this world
        created it, the default group. Idempotent; a dead world only forgets its groups."""
        if self._closed:
            return
        self._closed = True
        if not self._started:
            return
        import torch.distributed as dist

        if self._dead:
            return
        try:
            dist.barrier(group=self._side)
            dist.destroy_process_group(self._side)
            if self._owns_group:
                dist.destroy_process_group()
        except BaseException as e:
            self._dead = True
            raise WorldCloseError(f"torchrun world (rank {self.rank} of {self.world_size}) did not close cleanly: "
                                  f"{type(e).__name__}: {e}") from e

    def __enter__(self) -> TorchrunWorld:
        if not self._started:
            self.start()
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            self.close()
        else:
            try:
                self.close()
            except WorldError:
                pass

    def __repr__(self) -> str:
        state = "alive" if self.alive else "closed" if self._closed else "dead" if self._dead else "new"
        return (f"TorchrunWorld(rank={self.rank}, world_size={self.world_size}, local_rank={self.local_rank}, "
                f"backend={self.backend!r}, {state})")


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
