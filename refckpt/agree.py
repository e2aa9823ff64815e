"""Agreement: every cross-rank decision of a save or a load, in one place.

The contract of :class:`Agreement`: **every rank gets the same answer, or every rank raises.**

* :meth:`Agreement.vote` -- "did every rank succeed?" (the checks of the state before anything is
  written, the writes before the publish, the checks before a load commits). One all-reduce of a
  one-integer flag; only when a rank failed, one all-gather of the failures. Every rank then raises
  the decisive failure (a state partly written, then a caller error, then damage; the lowest rank
  among those), with its class and the rank it happened on. :meth:`Agreement.failures` is the
  same exchange returning the list (the fallback of ``load_latest``).
* :meth:`Agreement.decide` -- "what did the coordinator do?" (the staging directory it made, the
  publish, the next step to resume). The coordinator runs the function; one broadcast carries the
  value or the failure to every rank.

**Interrupts become votes before they propagate.** A save or a load runs inside
:meth:`Agreement.held`: on the main thread, the Python handlers of SIGINT and SIGTERM are replaced
by recorders for that time, so a ``KeyboardInterrupt`` or a ``SystemExit`` (a SIGTERM handler
calling ``sys.exit``) can never surface between two collectives of one decision, or inside DCP's
own collective phases, where the other ranks would read this rank's next collective as the answer
to the one it left. A held signal is handed to its own handler at the next decision: what the
handler raises becomes this rank's "interrupted" vote, every rank stops at that decision (nothing
is published; the coordinator removes the staging directory), the interrupted rank re-raises its
interrupt *as itself* and every other rank raises
:class:`~refckpt.errors.PeerInterruptedError` naming it. A signal held after the last decision
that could still stop the operation (the publish has happened) is delivered when the held
section ends: the step is then committed on every rank, and the interrupted rank raises its
interrupt after it. Only the delay of a signal changes: by at most one phase of the save (the
writes of this rank's shards).

**A deadline bounds every wait and names who did not answer.** Each rank marks, in the job's
store, the number of the decision it is entering before it enters it; a collective that times out
(the checkpointer's ``timeout``) reads the marks and names the ranks that never arrived.

**The process group stays usable, or says so at once.** No rank leaves a decision early, so a
failed or interrupted save leaves every collective matched. A timeout (a rank died or hung) can
leave gloo's group in an unknown state: the agreement is then *broken*, and every later call raises
:class:`~refckpt.errors.CollectiveError` at once, naming the failure and how to recover (restart
the job), instead of hanging or aborting in a mismatched collective.
"""

from __future__ import annotations

import contextlib
import pickle
import signal
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from . import errors as _errors
from .errors import (
    CallerError,
    CheckpointError,
    CollectiveError,
    CorruptCheckpointError,
    PartialLoadError,
    PeerInterruptedError,
    PeerInterruptedSaveError,
)

__all__ = ["Agreement", "INTERRUPTS", "agreement_for", "interrupted_name", "reset_after_fork"]

#: What a rank's own work may be stopped by that is not a failure of the work: re-raised as itself.
INTERRUPTS = (KeyboardInterrupt, SystemExit)
#: Signals whose Python handlers are held inside a save or load (main thread only).
HELD_SIGNALS = tuple(s for s in (getattr(signal, "SIGINT", None), getattr(signal, "SIGTERM", None)) if s is not None)

_OK, _FAILED, _INTERRUPTED = 0, 1, 2


def interrupted_name(e: BaseException) -> str:
    """``KeyboardInterrupt`` / ``SystemExit(<code>)``: how a vote names an interrupt."""
    return f"SystemExit({e.code!r})" if isinstance(e, SystemExit) else type(e).__name__


class Agreement:
    """The decisions of the checkpointers of one process group (None: a single process).

    One per group (:func:`agreement_for`): every checkpointer of the group takes its decisions in one
    sequence, and a group that failed is broken for all of them. ``timeout``: seconds any collective
    may wait (the group's own timeout); ``name``: what the marks in the job's store are kept under."""

    def __init__(self, group: Any, timeout: float, name: str = "") -> None:
        # weakly: the agreement must not keep a destroyed group alive (nor destroy one in a forked child)
        self._group = (lambda: None) if group is None else weakref.ref(group)
        self.timeout = float(timeout)
        self.name = name or "refckpt"
        self.rank, self.world = (0, 1) if group is None else (dist.get_rank(group), dist.get_world_size(group))
        self._seq = 0
        #: why the group can no longer be trusted (a collective failed); every later call raises it
        self.broken: str | None = None
        self._held: list[tuple[int, Any]] = []  # signals received while held: (signum, frame)
        self._originals: dict[int, Any] = {}  # their own handlers
        self._depth = 0

    @property
    def group(self) -> Any:
        group = self._group()
        if group is None and self.world > 1:
            raise CollectiveError("the checkpointer's process group was destroyed; make a new checkpointer "
                                  "after init_process_group.")
        return group

    # -- the decisions -----------------------------------------------------------------------------
    def failures(self, err: BaseException | None, what: str, *, during: str = "save",
                 interruptible: bool = True) -> list[tuple[int, str]]:
        """Every rank's failure as (rank, "Class: message"), the same list on every rank; empty when
        every rank succeeded. An interrupt on any rank is not a failure to list: every rank raises
        (the interrupted one its own interrupt, the others :class:`PeerInterruptedError`). A signal
        held since the last decision is this rank's interrupt (unless ``interruptible`` is false:
        then it waits for the end of the held section)."""
        if interruptible:
            err = self._pending_interrupt(err)
        self._check()
        if self.world == 1:
            if err is not None and isinstance(err, INTERRUPTS):
                raise err
            return [] if err is None else [(0, f"{type(err).__name__}: {err}")]
        status = _OK if err is None else _INTERRUPTED if isinstance(err, INTERRUPTS) else _FAILED
        with self.held():
            seq = self._enter(what)
            try:
                flag = torch.tensor([status], dtype=torch.int32)
                dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
                if not int(flag.item()):
                    return []
                mine = None if err is None else (interrupted_name(err) if status == _INTERRUPTED
                                                 else type(err).__name__, str(err), status)
                allv: list[Any] = [None] * self.world
                dist.all_gather_object(allv, mine, group=self.group)
            except RuntimeError as e:
                raise self._fail(what, seq, e) from e
        got = [(r, v) for r, v in enumerate(allv) if v is not None]
        interrupted = [(r, v) for r, v in got if v[2] == _INTERRUPTED]
        if interrupted:
            if err is not None and status == _INTERRUPTED:
                raise err  # an interrupt stays an interrupt, on the rank it reached
            r, (name, message, _) = interrupted[0]
            cls = PeerInterruptedSaveError if during == "save" else PeerInterruptedError
            raise cls(f"rank {r} was interrupted ({name}{': ' + message if message else ''}) during {what}; every "
                      f"rank stopped there and nothing of this {during} was committed"
                      f"{'' if during == 'save' else ' (the state is as it was)'}.")
        return [(r, f"{name}: {message}") for r, (name, message, _) in got]

    def vote(self, err: BaseException | None, what: str, *, during: str = "save", interruptible: bool = True) -> None:
        """Return on every rank when no rank failed; else raise on every rank: an interrupt (see
        :meth:`failures`), or the decisive failure (:func:`_decisive`) with its class, its message and
        the rank it happened on -- this rank's own exception object where it is this rank's."""
        if self.world == 1:
            if interruptible:
                err = self._pending_interrupt(err)
            self._check()
            if err is not None:
                raise err
            return
        mine = err
        got = self.failures(err, what, during=during, interruptible=interruptible)
        if not got:
            return
        r, text = _decisive(got)
        name, _, message = text.partition(": ")
        words = f"{message} (found on rank {r})"  # the same words on every rank
        if r == self.rank and isinstance(mine, CheckpointError):
            try:
                again = type(mine)(words)  # this rank's own class (a subclass the others cannot name)
            except Exception:  # noqa: BLE001 - a class whose constructor takes other arguments
                raise mine from None
            raise again from mine
        raise _error_class(name)(words) from (mine if r == self.rank else None)

    def decide(self, fn: Callable[[], Any], what: str, *, during: str = "save") -> Any:
        """``fn()`` on the coordinator; every rank returns its value or raises its failure. A signal
        held on the coordinator before ``fn`` runs is the answer instead (an interrupt: ``fn`` does not run)."""
        self._check()
        if self.world == 1:
            held = self._pending_interrupt(None)
            if held is not None:
                raise held
            return fn()
        out: list[Any] = [None]
        interrupt: BaseException | None = None
        if self.rank == 0:
            try:
                held = self._pending_interrupt(None)
                if held is not None:
                    raise held
                out[0] = ("ok", fn())
            except INTERRUPTS as e:  # an interrupt becomes the answer every rank gets
                interrupt = e
                out[0] = ("interrupted", interrupted_name(e), str(e))
            except Exception as e:  # noqa: BLE001 - re-raised on every rank below
                out[0] = ("err", _portable(e))
            try:
                pickle.dumps(out[0])
            except Exception as e:  # noqa: BLE001 - a value that cannot travel would desynchronise the ranks
                out[0] = ("err", CheckpointError(f"{what}: the coordinator's answer cannot be sent to the other "
                                                 f"ranks ({type(e).__name__}: {e})"))
        with self.held():
            seq = self._enter(what)
            try:
                dist.broadcast_object_list(out, src=dist.get_global_rank(self.group, 0), group=self.group)
            except RuntimeError as e:
                raise self._fail(what, seq, e) from e
        kind = out[0][0]
        if kind == "ok":
            return out[0][1]
        if kind == "err":
            raise out[0][1]
        if interrupt is not None:
            raise interrupt
        cls = PeerInterruptedSaveError if during == "save" else PeerInterruptedError
        raise cls(f"rank 0 was interrupted ({out[0][1]}{': ' + out[0][2] if out[0][2] else ''}) during {what}; "
                  f"every rank stopped there and nothing of this {during} was committed.")

    # -- holding signals ---------------------------------------------------------------------------
    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """Hold SIGINT and SIGTERM inside the block (main thread only; reentrant): their Python
        handlers are replaced by a recorder. A held signal is handed to its own handler at the next
        :meth:`vote` or :meth:`decide` -- which turn what it raises into an interrupted vote -- or,
        if none comes, when the outermost block ends (raising there)."""
        if threading.current_thread() is not threading.main_thread():
            yield  # Python runs signal handlers on the main thread only: nothing to hold here
            return
        if self._depth == 0:
            self._originals = {}
            for sig in HELD_SIGNALS:
                handler = signal.getsignal(sig)
                if callable(handler):  # a Python handler (default_int_handler, a user's): hold it
                    self._originals[sig] = handler
                    signal.signal(sig, self._record)
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1
            if self._depth == 0:
                for sig, handler in self._originals.items():
                    signal.signal(sig, handler)
                self._deliver()

    def _record(self, signum: int, frame: Any) -> None:
        self._held.append((signum, frame))

    def _deliver(self) -> None:
        """Run the held signals' own handlers now (raising what they raise)."""
        held, self._held = self._held, []
        for signum, frame in held:
            handler = self._originals.get(signum, signal.getsignal(signum))
            if callable(handler):
                handler(signum, frame)

    def _pending_interrupt(self, err: BaseException | None) -> BaseException | None:
        """A signal held since the last decision becomes this rank's failure (what its handler raises).
        On the main thread only: a background save never runs the main thread's handlers."""
        if not self._held or threading.current_thread() is not threading.main_thread():
            return err
        try:
            self._deliver()
        except INTERRUPTS as e:
            return err if err is not None else e
        return err

    # -- deadlines and marks -------------------------------------------------------------------
    def _check(self) -> None:
        if self.broken is not None:
            raise CollectiveError(self.broken)

    def _enter(self, what: str) -> int:
        """Mark, in the job's store, that this rank entered decision number ``seq`` (``what``)."""
        self._check()
        self._seq += 1
        store = _store()
        if store is not None:
            try:
                store.set(f"{self.name}/arrived/{self.rank}", str(self._seq))
            except RuntimeError:  # pragma: no cover - the store is gone: the collective will say so
                pass
        return self._seq

    def _fail(self, what: str, seq: int, e: BaseException) -> CollectiveError:
        """The collective of decision ``seq`` failed: name the ranks that never arrived, and break."""
        missing = self._missing(seq)
        who = (f"rank(s) {missing} never reached it (died, hung, or still in an earlier step)" if missing
               else "every rank reached it; the connection failed")
        self.broken = (f"a checkpoint collective failed while {what} ({type(e).__name__}: {e}); {who}. The "
                       f"checkpointer's process group is not usable any more: every later save and load raises this. "
                       f"Restart the job (torchrun restarts it) and resume with load_latest.")
        return CollectiveError(self.broken)

    def _missing(self, seq: int) -> list[int]:
        store = _store()
        if store is None:
            return []
        late = []
        for r in range(self.world):
            key = f"{self.name}/arrived/{r}"
            try:
                if not store.check([key]) or int(store.get(key)) < seq:
                    late.append(r)
            except (RuntimeError, ValueError):  # pragma: no cover - the store itself is gone
                return []
        return late


_AGREEMENTS: dict[int, tuple[Any, Agreement]] = {}  # id(group) -> (weakref to it, its agreement)
_AGREEMENTS_LOCK = threading.Lock()
_SINGLE: dict[float, Agreement] = {}


def agreement_for(group: Any, timeout: float) -> Agreement:
    """The one :class:`Agreement` of ``group`` (None: this process alone)."""
    with _AGREEMENTS_LOCK:
        if group is None:
            return _SINGLE.setdefault(float(timeout), Agreement(None, timeout))
        entry = _AGREEMENTS.get(id(group))
        if entry is not None and entry[0]() is group:
            return entry[1]
        agr = Agreement(group, timeout, getattr(group, "group_name", "") or "refckpt")
        _AGREEMENTS[id(group)] = (weakref.ref(group), agr)
        return agr


#: what a forked child forgot: kept, never freed there (freeing can run a destructor that waits
#: for the parent's threads, which do not exist in the child)
_FORGOTTEN: list[Any] = []


def reset_after_fork() -> None:
    """In a forked child: forget every agreement (the parent's groups are not the child's)."""
    global _AGREEMENTS_LOCK
    _AGREEMENTS_LOCK = threading.Lock()
    _FORGOTTEN.append((dict(_AGREEMENTS), dict(_SINGLE)))
    _AGREEMENTS.clear()
    _SINGLE.clear()


def _portable(e: BaseException) -> BaseException:
    """``e`` if the other ranks can rebuild it (it pickles, and its class takes back its ``args``,
    which is how an exception is unpickled), else a :class:`CheckpointError` of its words."""
    try:
        pickle.dumps(e)
        type(e)(*e.args)
        return e
    except Exception:  # noqa: BLE001 - an exception with arguments its class cannot take back
        cls = type(e) if isinstance(e, CheckpointError) else CheckpointError
        try:
            out = cls(f"{type(e).__name__}: {e}")
            pickle.dumps(out)
            return out
        except Exception:  # noqa: BLE001
            return CheckpointError(f"{type(e).__name__}: {e}")


def _store() -> Any:
    """The job's key-value store (the default group's), or None without one."""
    try:
        return dist.distributed_c10d._get_default_store()
    except (RuntimeError, AttributeError, ValueError):
        return None


def _decisive(failures: list[tuple[int, str]]) -> tuple[int, str]:
    """The failure every rank raises: a state partly written first (no fallback may start from it),
    then a caller error (falling back cannot fix the call), then damage; the lowest rank among those."""
    def order(item: tuple[int, str]) -> tuple[int, int]:
        cls = _error_class(item[1].partition(": ")[0])
        return (1 if issubclass(cls, PartialLoadError) else 2 if issubclass(cls, CallerError) else 3), item[0]

    return min(failures, key=order)


def _error_class(name: str) -> type[CheckpointError]:
    """The refckpt error class called ``name`` (another rank's); damage for anything else."""
    cls = getattr(_errors, name, None)
    if cls is None:
        from . import extra as _extra

        cls = getattr(_extra, name, None)
    if isinstance(cls, type) and issubclass(cls, CheckpointError):
        return cls
    return CorruptCheckpointError

