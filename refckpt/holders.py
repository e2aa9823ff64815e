"""Who holds something in a checkpoint root, judged from any host: reader leases, writer claims.

A checkpoint root on a shared file system is used by processes on several hosts (and in several
pid namespaces on one host: containers). A file that says "pid 4242 holds this" means nothing on
another host, and on this one only until pid 4242 is reused. So a holder file names its holder in a
way every host can judge (docs/design.md, "Readers and leftovers on a shared root"):

* :class:`Holder`: host name, boot id, pid namespace, pid and the process's start time (clock
  ticks since boot, from ``/proc``), plus ``ttl``, the holder's promise to renew the file's mtime
  at least every ``ttl`` seconds while it holds it (:class:`_Renewer`, a daemon thread touches
  every held file every ``ttl/4``).
* :func:`judge`: a holder on *this machine* (same host, boot and pid namespace) is alive while a
  process with its pid and start time exists -- a dead or reused pid is seen at once. A holder
  elsewhere is alive until its file's mtime is older than its ``ttl`` (at most :data:`MAX_TTL_S`),
  measured against the file system's own clock (:func:`fs_now`: the mtime of a file created in the
  root just now), never against a host's clock: hosts may disagree by minutes, the file server
  stamps both. A dead holder on another host therefore pins at most ``ttl`` seconds (default
  :data:`DEFAULT_TTL_S`; ``REFCKPT_LEASE_TTL_S`` in the environment sets it).

Kinds of holder files in a root:

* ``.lease.<step>.<token>``: a reader of step directory ``<step>`` (:func:`take_lease`);
  retention never deletes a step a live lease names (:mod:`refckpt.commit`).
* ``.claim.<writer>``: the save that writes staging directory ``.global_step_N.<writer>.partial``;
  any save's preparation removes a staging directory whose claim is dead or expired.
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import json
import logging
import os
import secrets
import socket
import stat
import threading

__all__ = [
    "DEFAULT_TTL_S",
    "MAX_TTL_S",
    "Holder",
    "me",
    "judge",
    "fs_now",
    "Clock",
    "read_holder",
    "write_holder",
    "release",
    "take_lease",
    "drop_lease",
    "LEASE_PREFIX",
    "CLAIM_PREFIX",
]

log = logging.getLogger(__name__)

#: How long a holder on another host pins what it holds after it stops renewing (seconds).
DEFAULT_TTL_S = 60.0
#: The most any holder file may declare: a garbled or hostile ``ttl`` cannot pin longer.
MAX_TTL_S = 3600.0
#: Largest holder file read (bytes): anything bigger is not one of ours and is judged by its age.
_MAX_HOLDER_BYTES = 4096

LEASE_PREFIX = ".lease."
CLAIM_PREFIX = ".claim."
_CLOCK_PREFIX = ".clock."


def default_ttl() -> float:
    """``REFCKPT_LEASE_TTL_S`` (clamped to [0.5, :data:`MAX_TTL_S`]) or :data:`DEFAULT_TTL_S`."""
    raw = os.environ.get("REFCKPT_LEASE_TTL_S")
    try:
        ttl = float(raw) if raw else DEFAULT_TTL_S
    except ValueError:
        log.warning("REFCKPT_LEASE_TTL_S=%r is not a number; using %s s", raw, DEFAULT_TTL_S)
        ttl = DEFAULT_TTL_S
    return min(max(ttl, 0.5), MAX_TTL_S)


@dataclasses.dataclass(frozen=True)
class Holder:
    host: str
    boot: str
    pidns: str
    pid: int
    #: the process's start time, clock ticks since boot (``/proc/PID/stat`` field 22); 0 unknown.
    start: int
    ttl: float

    @property
    def machine(self) -> tuple[str, str, str]:
        """Where the pid means something: host, boot, pid namespace."""
        return (self.host, self.boot, self.pidns)

    def describe(self) -> str:
        return f"pid {self.pid} on {self.host}" + ("" if self.machine == _machine() else " (another host or container)")


def _read_small(path: str) -> str:
    try:
        with open(path, encoding="ascii", errors="replace") as f:
            return f.read(256).strip()
    except OSError:
        return ""


_MACHINE: tuple[str, str, str] | None = None


def _machine() -> tuple[str, str, str]:
    global _MACHINE
    if _MACHINE is None:
        try:
            pidns = os.readlink("/proc/self/ns/pid")
        except OSError:
            pidns = ""
        _MACHINE = (socket.gethostname(), _read_small("/proc/sys/kernel/random/boot_id"), pidns)
    return _MACHINE


def machine_key() -> str:
    """A short name for this host + boot + pid namespace (for names of short-lived temp files)."""
    return hashlib.sha1("|".join(_machine()).encode()).hexdigest()[:12]


def _start_time(pid: int | str) -> int:
    """Start time of process ``pid`` ("self" for this one), clock ticks since boot; -1 if none."""
    raw = _read_small(f"/proc/{pid}/stat")
    if not raw:
        return -1
    try:  # the command name (field 2) may hold spaces and parentheses: split after the last ')'
        return int(raw[raw.rindex(")") + 2:].split()[19])
    except (ValueError, IndexError):
        return 0


def me(ttl: float | None = None) -> Holder:
    """This process as a holder (recomputed after a fork: the pid and start time change)."""
    pid = os.getpid()
    start = _start_time("self")
    return Holder(*_machine(), pid, max(start, 0), default_ttl() if ttl is None else float(ttl))


def encode(holder: Holder) -> bytes:
    return json.dumps(dataclasses.asdict(holder), sort_keys=True).encode()


def decode(data: bytes) -> Holder | None:
    """The holder in ``data``, or None when it is not one (torn, foreign, hostile: judged by age)."""
    try:
        d = json.loads(data.decode("utf-8"))
        h = Holder(str(d["host"]), str(d["boot"]), str(d["pidns"]), int(d["pid"]), int(d["start"]), float(d["ttl"]))
    except (ValueError, KeyError, TypeError, UnicodeDecodeError, RecursionError):
        return None
    if not (h.ttl == h.ttl and h.ttl > 0):  # NaN or non-positive: not a promise anyone can keep
        return None
    return dataclasses.replace(h, ttl=min(h.ttl, MAX_TTL_S))


def read_holder(path: str) -> tuple[Holder | None, float] | None:
    """(holder, mtime) of the holder file ``path``; None when it is gone. Regular files only, bounded."""
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        return None
    except OSError as e:
        if e.errno == errno.ELOOP:  # a link planted under a holder's name: judged by its own age
            try:
                return None, os.lstat(path).st_mtime
            except OSError:
                return None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return None, st.st_mtime
        data = os.read(fd, _MAX_HOLDER_BYTES + 1)
    finally:
        os.close(fd)
    return (decode(data) if len(data) <= _MAX_HOLDER_BYTES else None), st.st_mtime


def fs_now(root: str) -> float | None:
    """The file system's clock: the mtime of a file created in ``root`` just now (then removed).
    None where ``root`` cannot be written (a read-only root: nothing there is removed anyway)."""
    path = os.path.join(root, f"{_CLOCK_PREFIX}{secrets.token_hex(8)}")
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o644)
    except OSError:
        return None
    try:
        return os.fstat(fd).st_mtime
    finally:
        os.close(fd)
        _unlink_quietly(path)


class Clock:
    """:func:`fs_now` of one root, read at most once and only when a verdict needs it (a holder on
    this machine is judged by its pid: most sweeps and retentions never write a probe file)."""

    def __init__(self, root: str) -> None:
        self.root = root
        self._now: float | None = None
        self._read = False

    def now(self) -> float | None:
        if not self._read:
            self._now, self._read = fs_now(self.root), True
        return self._now


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # alive, another user's
    except (OverflowError, ValueError):
        return False
    return True


@dataclasses.dataclass(frozen=True)
class Verdict:
    alive: bool
    #: why, for people: "held by pid 12 on h1", "pid 12 on h1 exited", "not renewed for 75 s (ttl 60 s)"
    reason: str
    #: seconds (file system clock) until an unrenewed holder elsewhere expires; None when judged by pid.
    expires_in: float | None = None


def judge(holder: Holder | None, mtime: float, clock: Clock, *, default_ttl_s: float | None = None) -> Verdict:
    """Is the holder of a file with ``mtime`` alive? (see the module docstring). ``clock`` is read only
    for a holder elsewhere; a file system whose time cannot be read keeps such a holder alive."""
    if holder is not None and holder.machine == _machine():
        if not pid_alive(holder.pid):
            return Verdict(False, f"{holder.describe()} exited")
        start = _start_time(holder.pid)
        if holder.start and start > 0 and start != holder.start:
            return Verdict(False, f"{holder.describe()} exited (the pid now names another process)")
        return Verdict(True, f"held by {holder.describe()}")
    ttl = holder.ttl if holder is not None else (default_ttl() if default_ttl_s is None else default_ttl_s)
    who = holder.describe() if holder is not None else "an unreadable holder file"
    now = clock.now()
    if now is None:
        return Verdict(True, f"held by {who} (the file system's time could not be read)")
    age = now - mtime
    if age > ttl:
        return Verdict(False, f"{who}: not renewed for {age:.0f} s (ttl {ttl:.0f} s)")
    return Verdict(True, f"held by {who}", expires_in=ttl - age)


# -- holding files: write, renew, release -------------------------------------------------------
class _Renewer:
    """One daemon thread per process touching every file this process holds every ``ttl/4``."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: dict[str, float] = {}
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None

    def add(self, path: str, ttl: float) -> None:
        with self._lock:
            self._held[path] = ttl
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="refckpt-lease-renewer", daemon=True)
                self._thread.start()
        self._wake.set()

    def remove(self, path: str) -> None:
        with self._lock:
            self._held.pop(path, None)

    def _run(self) -> None:
        while True:
            with self._lock:
                if not self._held:
                    self._thread = None
                    return
                period = max(0.1, min(self._held.values()) / 4)
                paths = list(self._held)
            for p in paths:
                try:
                    os.utime(p)  # mtime := now, by the file system's clock
                except FileNotFoundError:
                    self.remove(p)  # removed under us (a sweep judged us dead: we were stopped too long)
                    log.warning("%s: held by this process but removed by another; no longer renewed", p)
                except OSError as e:
                    log.warning("could not renew %s: %s", p, e)
            self._wake.wait(period)
            self._wake.clear()

    def after_fork_in_child(self) -> None:
        """A forked child holds nothing: its parent renews (and releases) what it held."""
        self._lock = threading.Lock()
        self._held = {}
        self._wake = threading.Event()
        self._thread = None


_RENEWER = _Renewer()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_RENEWER.after_fork_in_child)


def write_holder(path: str, ttl: float | None = None) -> bool:
    """Create holder file ``path`` naming this process, renewed until :func:`release`. False when it
    cannot be written (a read-only root: nothing there can be deleted under a reader anyway)."""
    holder = me(ttl)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o644)
    except OSError:
        return False
    try:
        os.write(fd, encode(holder))
    except OSError:
        os.close(fd)
        release(path)
        return False
    os.close(fd)
    _RENEWER.add(path, holder.ttl)
    return True


def release(path: str | None) -> None:
    """Stop renewing and remove holder file ``path`` (gone already is fine)."""
    if not path:
        return
    _RENEWER.remove(path)
    _unlink_quietly(path)


# -- reader leases ------------------------------------------------------------------------------
def take_lease(root: str, step_name: str, ttl: float | None = None) -> str | None:
    """Mark step directory ``step_name`` under ``root`` as being read by this process: retention (of
    any writer, on any host) keeps it while the lease is alive. Returns the lease for
    :func:`drop_lease`; None where none can be written (a read-only root)."""
    path = os.path.join(root, f"{LEASE_PREFIX}{step_name}.{secrets.token_hex(8)}")
    return path if write_holder(path, ttl) else None


def drop_lease(path: str | None) -> None:
    release(path)


def _is_token(s: str) -> bool:
    return len(s) == 16 and all(c in "0123456789abcdef" for c in s)


def lease_step(name: str) -> str | None:
    """The step directory name a lease file name is for, else None."""
    if not name.startswith(LEASE_PREFIX):
        return None
    step_name, _, token = name[len(LEASE_PREFIX):].rpartition(".")
    return step_name if step_name and token else None


def judge_lease(root: str, name: str, clock: Clock) -> Verdict | None:
    """The verdict on lease file ``name`` in ``root``; None when it is gone. A lease of the format
    before holders (``.lease.<step>.<pid>``, empty) is judged by its pid on this machine."""
    path = os.path.join(root, name)
    got = read_holder(path)
    if got is None:
        return None
    holder, mtime = got
    if holder is None:
        token = name.rpartition(".")[2]
        try:
            size = os.lstat(path).st_size
        except OSError:
            return None
        if size == 0 and token.isdigit():
            alive = pid_alive(int(token))
            return Verdict(alive, f"pid {token} on this host {'holds it' if alive else 'exited'} (an older lease)")
        if size == 0 and not _is_token(token):
            return Verdict(False, f"{name}: not a lease (no holder, no pid)")
    return judge(holder, mtime, clock)


def live_leases(root: str, names: list[str], clock: Clock, *, remove_dead: bool = False) -> dict[str, str]:
    """Step names that a live lease in ``names`` (one listing of ``root``) holds, with the holder;
    ``remove_dead``: unlink the dead and expired lease files found on the way."""
    out: dict[str, str] = {}
    for n in names:
        step_name = lease_step(n)
        if step_name is None:
            continue
        try:
            v = judge_lease(root, n, clock)
        except OSError as e:
            log.warning("could not read lease %s: %s; keeping %s", os.path.join(root, n), e, step_name)
            out.setdefault(step_name, "an unreadable lease")
            continue
        if v is None:
            continue
        if v.alive:
            out.setdefault(step_name, v.reason)
        elif remove_dead:
            log.info("removing lease %s: %s", os.path.join(root, n), v.reason)
            _unlink_quietly(os.path.join(root, n))
    return out

