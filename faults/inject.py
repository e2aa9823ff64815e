"""Injecting faults for real, without editing the checkpointer under test.

Four ways, each modelling a real failure:

* :class:`FaultyIO` wraps the I/O layer refckpt writes through (``refckpt.durable.FileIO``):
  at a crash point it SIGKILLs its own process, asks the parent to kill ranks from outside
  (:func:`faults.world.emit`), raises ``ENOSPC``/``EIO``, or hangs.
* :func:`patch_os` does the same to any checkpointer by patching ``os.fsync``, ``os.replace``,
  ``os.rename``, ``os.makedirs``/``os.mkdir``, ``os.unlink`` and ``shutil.rmtree`` inside the
  target process (writes through Python file objects cannot be intercepted this way, so
  write-level points need a cooperating I/O layer).
* Killing ranks from outside at observed moments: :func:`kill_on_event` is an ``on_event``
  callback for :meth:`faults.world.World.run`.
* :data:`DISK_FAULTS` corrupt files on disk between save and resume.

Everything random takes a ``random.Random`` so a fault is reproducible from its seed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import os
import random
import shutil
import signal
import struct
import json
import threading
from collections import Counter
from typing import Any, Callable, Iterator

from .points import POINTS_BY_NAME, CrashPoint, FaultKind, Role, classify

__all__ = [
    "Action",
    "FaultSpec",
    "FaultyIO",
    "patch_os",
    "kill_on_event",
    "DISK_FAULTS",
    "DiskFault",
    "crash_spec",
    "io_error_spec",
]


class Action:
    KILL = "kill"      # SIGKILL this process (a real, uncatchable death)
    EMIT = "emit"      # tell the parent; it SIGKILLs the target ranks from outside
    ENOSPC = "enospc"  # raise OSError(ENOSPC)
    EIO = "eio"        # raise OSError(EIO)
    HANG = "hang"      # block forever (a stuck NFS write, a deadlock)


@dataclasses.dataclass(frozen=True)
class FaultSpec:
    """Where (op, role, before/after, nth occurrence), on which ranks, and what happens."""

    op: str
    role: str
    when: str
    action: str
    ranks: tuple[int, ...]
    nth: int = 1
    name: str = ""

    def matches(self, op: str, role: str, when: str) -> bool:
        """``op``/``role`` ``"*"`` match any: "the nth file-system operation", which needs no
        knowledge of the checkpointer's protocol (the resilience suite's crash points)."""
        return (self.op in ("*", op)) and (str(self.role) in ("*", str(role))) and when == self.when


def crash_spec(point: CrashPoint | str, ranks: tuple[int, ...], action: str = Action.KILL) -> FaultSpec:
    p = POINTS_BY_NAME[point] if isinstance(point, str) else point
    return FaultSpec(p.op, str(p.role), p.when, action, tuple(ranks), p.nth, p.name)


def io_error_spec(kind: FaultKind, role: Role, ranks: tuple[int, ...]) -> FaultSpec:
    op = "write" if kind in (FaultKind.ENOSPC_WRITE, FaultKind.EIO_WRITE) else "fsync"
    action = Action.ENOSPC if kind in (FaultKind.ENOSPC_WRITE, FaultKind.ENOSPC_FSYNC) else Action.EIO
    return FaultSpec(op, str(role), "before", action, tuple(ranks), 1, f"{kind}@{role}")


def _fire(spec: FaultSpec, rank: int, path: str) -> None:
    if spec.action == Action.KILL:
        os.kill(os.getpid(), signal.SIGKILL)
    elif spec.action == Action.EMIT:
        from .world import emit

        emit(("fault", spec.name, rank))
        # The parent kills target ranks while handling the event; a rank it spares goes on.
    elif spec.action == Action.ENOSPC:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)
    elif spec.action == Action.EIO:
        raise OSError(errno.EIO, os.strerror(errno.EIO), path)
    elif spec.action == Action.HANG:
        threading.Event().wait()
    else:  # pragma: no cover - spec validated by construction
        raise ValueError(f"unknown action {spec.action!r}")


class _Trigger:
    """Counts (op, role, when) events of one rank and fires the spec at its nth match."""

    def __init__(self, spec: FaultSpec | None, rank: int) -> None:
        self.spec = spec
        self.rank = rank
        self.counts: Counter = Counter()
        self.fired = False
        self.last_role: str = str(Role.OTHER)
        self.lock = threading.Lock()

    def event(self, op: str, role: str, when: str, path: str) -> None:
        spec = self.spec
        if spec is None or self.rank not in spec.ranks or not spec.matches(op, role, when):
            return
        key = (spec.op, str(spec.role), when) if "*" in (spec.op, str(spec.role)) else (op, str(role), when)
        with self.lock:
            self.counts[key] += 1
            hit = not self.fired and self.counts[key] == spec.nth
            if hit:
                self.fired = True
        if hit:
            _fire(spec, self.rank, path)


def _refckpt_fileio():
    from refckpt.durable import FileIO

    return FileIO


class FaultyIO(_refckpt_fileio()):  # type: ignore[misc]
    """refckpt's I/O layer with one fault armed. ``trace`` (if a list) records every operation.

    Each operation reports ``before`` and ``after`` events with the role of its path;
    ``fsync_dir`` takes the role of the operation it follows (the directory fsync after a
    commit-record rename is a ``commit`` point, the one after publishing a ``publish`` point).
    """

    def __init__(self, spec: FaultSpec | None, rank: int, trace: list | None = None) -> None:
        self._t = _Trigger(spec, rank)
        self.trace = trace

    @property
    def fired(self) -> bool:
        return self._t.fired

    def _around(self, op: str, role: Role | str, path: str, fn: Callable[[], Any]) -> Any:
        if self.trace is not None:
            self.trace.append((op, str(role), path))
        self._t.event(op, str(role), "before", path)
        out = fn()
        if op != "fsync_dir":
            self._t.last_role = str(role)
        self._t.event(op, str(role), "after", path)
        return out

    def mark(self, point, **info) -> None:
        self._around("mark", str(point), info.get("path", ""), lambda: None)

    def open_write(self, path):
        role = classify(path)
        f = self._around("open", role, path, lambda: super(FaultyIO, self).open_write(path))
        self._t.last_role = str(role)
        return f

    def write(self, f, data):
        path = getattr(f, "name", "")
        return self._around("write", classify(path), path, lambda: super(FaultyIO, self).write(f, data))

    def fsync(self, f):
        path = getattr(f, "name", "")
        return self._around("fsync", classify(path), path, lambda: super(FaultyIO, self).fsync(f))

    def fsync_dir(self, path):
        return self._around("fsync_dir", self._t.last_role, path, lambda: super(FaultyIO, self).fsync_dir(path))

    def mkdir(self, path):
        return self._around("mkdir", classify(path), path, lambda: super(FaultyIO, self).mkdir(path))

    def replace(self, src, dst):
        return self._around("replace", classify(src, dst), dst, lambda: super(FaultyIO, self).replace(src, dst))

    def exchange(self, a, b):
        return self._around("replace", classify(a, b), b, lambda: super(FaultyIO, self).exchange(a, b))

    def unlink(self, path):
        return self._around("unlink", classify(path), path, lambda: super(FaultyIO, self).unlink(path))

    def rmtree(self, path):
        return self._around("rmtree", classify(path), path, lambda: super(FaultyIO, self).rmtree(path))


@contextlib.contextmanager
def patch_os(spec: FaultSpec | None, rank: int) -> Iterator[_Trigger]:
    """Arm ``spec`` on the ``os``-level calls of *any* checkpointer in this process.

    Covers fsync (files and directories: an fd's path is read from /proc), replace/rename,
    mkdir/makedirs, unlink and rmtree. Restores the originals on exit.
    """
    t = _Trigger(spec, rank)
    orig = {
        "fsync": os.fsync, "replace": os.replace, "rename": os.rename, "mkdir": os.mkdir,
        "unlink": os.unlink, "rmtree": shutil.rmtree,
    }

    def fd_path(fd) -> str:
        fd = fd if isinstance(fd, int) else fd.fileno()
        try:
            return os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            return ""

    def wrap(op: str, role_of: Callable[..., tuple[str, str]], fn: Callable) -> Callable:
        def inner(*a, **k):
            op_name, role, path = (op,) + role_of(*a)
            t.event(op_name, role, "before", path)
            out = fn(*a, **k)
            if op_name != "fsync_dir":
                t.last_role = role
            t.event(op_name, role, "after", path)
            return out
        return inner

    def fsync_role(fd):
        path = fd_path(fd)
        if os.path.isdir(path):
            return t.last_role, path
        return str(classify(path)), path

    def fsync(fd):
        role, path = fsync_role(fd)
        op = "fsync_dir" if os.path.isdir(path) else "fsync"
        t.event(op, role, "before", path)
        out = orig["fsync"](fd)
        if op != "fsync_dir":
            t.last_role = role
        t.event(op, role, "after", path)
        return out

    os.fsync = fsync
    os.replace = wrap("replace", lambda s, d, *r: (str(classify(s, d)), str(d)), orig["replace"])
    os.rename = wrap("replace", lambda s, d, *r: (str(classify(s, d)), str(d)), orig["rename"])
    os.mkdir = wrap("mkdir", lambda p, *r: (str(classify(p)), str(p)), orig["mkdir"])
    os.unlink = wrap("unlink", lambda p, *r: (str(classify(p)), str(p)), orig["unlink"])
    shutil.rmtree = wrap("rmtree", lambda p, *r: (str(classify(p)), str(p)), orig["rmtree"])
    try:
        yield t
    finally:
        os.fsync, os.replace, os.rename = orig["fsync"], orig["replace"], orig["rename"]
        os.mkdir, os.unlink, shutil.rmtree = orig["mkdir"], orig["unlink"], orig["rmtree"]


def kill_on_event(world, ranks: list[int] | None = None) -> Callable[[int, Any], None]:
    """``on_event`` callback: SIGKILL ``ranks`` (default: every rank) of ``world`` from outside
    the moment any rank reports a fault event -- a whole-job preemption at an observed point."""

    def on_event(rank: int, payload: Any) -> None:
        if isinstance(payload, tuple) and payload and payload[0] == "fault":
            for r in (ranks if ranks is not None else range(world.world_size)):
                try:
                    os.kill(world.pids[r], signal.SIGKILL)
                except ProcessLookupError:
                    pass

    return on_event


# -- disk faults ---------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class DiskFault:
    """Damage done to a saved checkpoint. ``falls_back``: resume must land on the previous step
    (the newest is now incomplete or corrupt); otherwise it must still land on the newest."""

    kind: FaultKind
    apply: Callable[[str, str, int, random.Random], str]
    falls_back: bool

    def __call__(self, root: str, step_dir: str, rank: int, rng: random.Random) -> str:
        return self.apply(root, step_dir, rank, rng)


_POINTER = "latest_checkpoint_iteration.txt"


def _write(path: str, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)


def _pointer_step(step_dir: str) -> int:
    return int(os.path.basename(step_dir).rsplit("_", 1)[1])


def _shard(step_dir: str, rank: int) -> str:
    names = sorted(n for n in os.listdir(step_dir) if n.endswith((".safetensors", ".distcp")))
    mine = [n for n in names if n.startswith(f"__{rank}_")]
    return os.path.join(step_dir, (mine or names)[0])


def _extra(step_dir: str, rank: int) -> str:
    return os.path.join(step_dir, "extra_state", f"extra_state_rank_{rank}.pt")


def _torn(root, step_dir, rank, rng):
    full = f"{_pointer_step(step_dir)}\n".encode()
    cut = rng.randrange(1, len(full) - 1) if len(full) > 2 else 0
    _write(os.path.join(root, _POINTER), full[:cut])
    return f"pointer torn to {full[:cut]!r}"


def _empty(root, step_dir, rank, rng):
    _write(os.path.join(root, _POINTER), b"")
    return "pointer emptied"


def _garbage(root, step_dir, rank, rng):
    data = bytes(rng.randrange(33, 127) for _ in range(rng.randrange(1, 24)))
    data = b"x" + data  # never a valid step number
    _write(os.path.join(root, _POINTER), data)
    return f"pointer garbage {data!r}"


def _nul(root, step_dir, rank, rng):
    _write(os.path.join(root, _POINTER), b"\x00" * rng.randrange(1, 8))
    return "pointer NUL bytes"


def _dangling(root, step_dir, rank, rng):
    missing = _pointer_step(step_dir) + 1000 + rng.randrange(1000)
    _write(os.path.join(root, _POINTER), f"{missing}\n".encode())
    return f"pointer names missing step {missing}"


def _stale(root, step_dir, rank, rng):
    steps = sorted(int(n.rsplit("_", 1)[1]) for n in os.listdir(root) if n.startswith("global_step_"))
    older = [s for s in steps if s < _pointer_step(step_dir)]
    _write(os.path.join(root, _POINTER), f"{older[0] if older else 0}\n".encode())
    return f"pointer stale ({older[0] if older else 0})"


def _missing_shard(root, step_dir, rank, rng):
    p = _shard(step_dir, rank)
    os.unlink(p)
    return f"deleted {os.path.basename(p)}"


def _truncated_shard(root, step_dir, rank, rng):
    p = _shard(step_dir, rank)
    size = os.path.getsize(p)
    new = rng.randrange(0, size)
    os.truncate(p, new)
    return f"truncated {os.path.basename(p)} {size} -> {new}"


def _bitflip_shard(root, step_dir, rank, rng):
    p = _shard(step_dir, rank)
    with open(p, "r+b") as f:
        (hlen,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(hlen))
        spans = [v["data_offsets"] for k, v in header.items()
                 if k != "__metadata__" and not k.startswith("__bytes__/") and v["data_offsets"][1] > v["data_offsets"][0]]
        a, b = spans[rng.randrange(len(spans))]
        pos = 8 + hlen + rng.randrange(a, b)
        f.seek(pos)
        byte = f.read(1)[0]
        f.seek(pos)
        f.write(bytes([byte ^ (1 << rng.randrange(8))]))
    return f"flipped a bit at byte {pos} of {os.path.basename(p)}"


def _missing_commit(root, step_dir, rank, rng):
    os.unlink(os.path.join(step_dir, ".metadata"))
    return "deleted .metadata"


def _missing_extra(root, step_dir, rank, rng):
    os.unlink(_extra(step_dir, rank))
    return f"deleted extra_state_rank_{rank}.pt"


def _corrupt_extra(root, step_dir, rank, rng):
    p = _extra(step_dir, rank)
    size = os.path.getsize(p)
    _write(p, bytes(rng.randrange(256) for _ in range(size)))
    return f"overwrote extra_state_rank_{rank}.pt with {size} random bytes"


#: kind -> fault. Pointer faults leave the newest step the answer; payload faults make it fall back.
DISK_FAULTS: dict[FaultKind, DiskFault] = {
    FaultKind.TORN_POINTER: DiskFault(FaultKind.TORN_POINTER, _torn, False),
    FaultKind.EMPTY_POINTER: DiskFault(FaultKind.EMPTY_POINTER, _empty, False),
    FaultKind.GARBAGE_POINTER: DiskFault(FaultKind.GARBAGE_POINTER, _garbage, False),
    FaultKind.NUL_POINTER: DiskFault(FaultKind.NUL_POINTER, _nul, False),
    FaultKind.DANGLING_POINTER: DiskFault(FaultKind.DANGLING_POINTER, _dangling, False),
    FaultKind.STALE_POINTER: DiskFault(FaultKind.STALE_POINTER, _stale, False),
    FaultKind.MISSING_SHARD: DiskFault(FaultKind.MISSING_SHARD, _missing_shard, True),
    FaultKind.TRUNCATED_SHARD: DiskFault(FaultKind.TRUNCATED_SHARD, _truncated_shard, True),
    FaultKind.BITFLIP_SHARD: DiskFault(FaultKind.BITFLIP_SHARD, _bitflip_shard, True),
    FaultKind.MISSING_COMMIT: DiskFault(FaultKind.MISSING_COMMIT, _missing_commit, True),
    FaultKind.MISSING_EXTRA_STATE: DiskFault(FaultKind.MISSING_EXTRA_STATE, _missing_extra, True),
    FaultKind.CORRUPT_EXTRA_STATE: DiskFault(FaultKind.CORRUPT_EXTRA_STATE, _corrupt_extra, True),
}
