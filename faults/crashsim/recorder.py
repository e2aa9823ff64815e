"""Recording what a save does to the file system, in the process that saves.

:func:`record` traces, in the calling process, the operations a checkpointer performs through
``os`` and ``open`` (create, mkdir, rename/replace, unlink/rmdir, rmtree, fsync of files and
directories) with the inode numbers involved and a monotonic timestamp, so traces of several
ranks on one host merge in order. It needs no cooperation from the checkpointer. Not seen:
renames done by raw syscalls (refckpt's ``renameat2(RENAME_EXCHANGE)`` for overwriting saves
goes through ctypes) and writes: data durability is judged per file by the size the *kernel* held
at its last fsync (``fstat``), so bytes still in a user-space buffer when ``fsync`` ran -- a file
opened buffered and fsynced before its buffer was flushed -- count as not durable.
:class:`snapshot_states` copies the tree after every operation: the process-crash states.

:func:`recording_io` records *with the bytes written*, through refckpt's I/O layer, for the
power-loss explorer of :mod:`faults.crashsim.model` (the recorder that needs no cooperation is
:func:`faults.crashsim.strace.strace_record`).
"""

from __future__ import annotations

import builtins
import contextlib
import io
import os
import shutil
import stat
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from .model import FOp, Op, entry_of, inode_of

__all__ = ["record", "snapshot_states", "recording_io"]


@contextlib.contextmanager
def record(rank: int = 0, on_op: Callable[[Op], None] | None = None) -> Iterator[list[Op]]:
    """Trace this process's file-system operations (all threads) until the block exits.

    ``on_op(op)`` runs right after each operation, in the thread that did it, with recording
    paused (so it may itself touch the file system, e.g. :func:`snapshot_states` copying the
    tree: the state a SIGKILL at that moment would leave, page cache intact)."""
    trace: list[Op] = []
    local = threading.local()
    lock = threading.Lock()
    orig: dict[str, Any] = {"open": builtins.open, "os_open": os.open, "fsync": os.fsync, "fdatasync": os.fdatasync,
            "replace": os.replace, "rename": os.rename, "mkdir": os.mkdir, "unlink": os.unlink,
            "remove": os.remove, "rmdir": os.rmdir, "rmtree": shutil.rmtree}

    def add(kind, path, **kw):
        if getattr(local, "quiet", False):
            return
        op = Op(time.monotonic_ns(), kind, os.fspath(path) if not isinstance(path, int) else str(path), rank=rank, **kw)
        with lock:
            trace.append(op)
        if on_op is not None:
            local.quiet = True
            try:
                on_op(op)
            finally:
                local.quiet = False

    def created(path, existed):
        if not existed:
            d, n = entry_of(path)
            add("create", path, dir=d, name=n, ino=inode_of(path))

    def open_(file, mode="r", *a, **k):
        writing = isinstance(file, (str, bytes, os.PathLike)) and any(c in mode for c in "wax+")
        existed = writing and os.path.lexists(file)
        f = orig["open"](file, mode, *a, **k)
        if writing:
            created(file, existed)
            if existed and "w" in mode:  # truncated in place: a crash now leaves it empty
                d, n = entry_of(file)
                add("truncate", file, dir=d, name=n, ino=inode_of(file))
        return f

    def os_open(path, flags, *a, **k):
        creating = bool(flags & os.O_CREAT) and k.get("dir_fd") is None
        existed = creating and os.path.lexists(path)
        fd = orig["os_open"](path, flags, *a, **k)
        if creating:
            created(path, existed)
        return fd

    def fsync_(which):
        def inner(fd):
            st = os.fstat(fd if isinstance(fd, int) else fd.fileno())
            out = orig[which](fd)
            kind = "fsync_dir" if stat.S_ISDIR(st.st_mode) else "fsync_file"
            # st_size from fstat is the kernel's: bytes still in a user-space buffer are not in it
            add(kind, f"<fd {fd if isinstance(fd, int) else fd.fileno()}>", ino=st.st_ino,
                **({} if kind == "fsync_dir" else {"size": st.st_size}))
            return out
        return inner

    def rename_(which):
        def inner(src, dst, *a, **k):
            if k.get("src_dir_fd") is not None or k.get("dst_dir_fd") is not None:
                return orig[which](src, dst, *a, **k)
            sd, sn = entry_of(src)
            ino = inode_of(src)
            out = orig[which](src, dst, *a, **k)
            dd, dn = entry_of(dst)
            add("rename", dst, dir=sd, name=sn, ino=ino, dir2=dd, name2=dn)
            return out
        return inner

    def mkdir_(path, *a, **k):
        if k.get("dir_fd") is not None:
            return orig["mkdir"](path, *a, **k)
        out = orig["mkdir"](path, *a, **k)
        d, n = entry_of(path)
        add("mkdir", path, dir=d, name=n, ino=inode_of(path))
        return out

    def remove_(which, kind):
        def inner(path, *a, **k):
            if k.get("dir_fd") is not None:
                return orig[which](path, *a, **k)
            d, n = entry_of(path)
            ino = inode_of(path)
            out = orig[which](path, *a, **k)
            add(kind, path, dir=d, name=n, ino=ino)
            return out
        return inner

    def rmtree_(path, *a, **k):
        d, n = entry_of(path)
        ino = inode_of(path)
        local.quiet = True
        try:
            out = orig["rmtree"](path, *a, **k)
        finally:
            local.quiet = False
        add("rmtree", path, dir=d, name=n, ino=ino)
        return out

    builtins.open = io.open = open_
    os.open = os_open
    os.fsync, os.fdatasync = fsync_("fsync"), fsync_("fdatasync")
    os.replace, os.rename = rename_("replace"), rename_("rename")
    os.mkdir = mkdir_
    os.unlink, os.remove, os.rmdir = remove_("unlink", "unlink"), remove_("remove", "unlink"), remove_("rmdir", "unlink")
    shutil.rmtree = rmtree_  # type: ignore[assignment]  # a plain function, without rmtree's attribute
    try:
        yield trace
    finally:
        builtins.open = io.open = orig["open"]
        os.open, os.fsync, os.fdatasync = orig["os_open"], orig["fsync"], orig["fdatasync"]
        os.replace, os.rename, os.mkdir = orig["replace"], orig["rename"], orig["mkdir"]
        os.unlink, os.remove, os.rmdir, shutil.rmtree = orig["unlink"], orig["remove"], orig["rmdir"], orig["rmtree"]


class snapshot_states:
    """``on_op`` for :func:`record`: copy ``root`` after every operation into ``into/NNNN``.

    Each copy is exactly what a SIGKILL of the saving process at that moment would leave on a
    healthy machine (every completed call visible, nothing more): the process-crash states of
    the save, every one of them, from a single run. (Writes are not operations here, so a
    crash between two writes to one file is not a separate state; what a crash between
    the writes and the next fsync could leave is.)"""

    def __init__(self, root: str, into: str) -> None:
        self.root, self.into = os.path.abspath(root), into
        self.states: list[tuple[str, Op | None]] = []
        self._lock = threading.Lock()
        self._take(None)

    def _take(self, op: Op | None) -> None:
        with self._lock:
            dst = os.path.join(self.into, f"{len(self.states):04d}")
            shutil.copytree(self.root, dst, symlinks=True)
            self.states.append((dst, op))

    def __call__(self, op: Op) -> None:
        self._take(op)


def recording_io(trace: list[FOp], rank: int = 0, lock_path: str | None = None):
    """A ``refckpt.durable.FileIO`` that appends every operation (with the bytes written) to
    ``trace``: the cooperating recorder, through the I/O layer refckpt writes with.

    Several ranks record into separate traces that are merged by timestamp afterwards. For the
    merge to be a true order of events, each operation and its timestamp must happen as one
    step: a rank preempted between its ``mkdir`` and the timestamp would otherwise be ordered
    after another rank that already saw the directory and created a file in it (observed: the
    replay then lost that file). So every recorded operation runs under one lock shared by all
    recording processes (``fcntl.flock`` on ``lock_path``, plus a thread lock for writer
    threads); saves are serialised while recording, which costs nothing that is measured here.
    With ``lock_path=None`` (one rank) only the thread lock is taken."""
    import fcntl

    from refckpt.durable import FileIO

    counter = iter(range(rank * 1_000_000 + 1, (rank + 1) * 1_000_000))
    tlock = threading.Lock()

    @contextlib.contextmanager
    def step():
        with tlock:
            if lock_path is None:
                yield
                return
            fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
                yield
            finally:
                os.close(fd)  # releases the flock

    class RecordingIO(FileIO):
        def __init__(self) -> None:
            self._fds: dict[int, int] = {}

        def _add(self, **kw) -> None:
            trace.append(FOp(time.monotonic_ns(), rank=rank, **kw))

        def open_write(self, path):
            with step():
                existed = os.path.lexists(path)
                f = super().open_write(path)
                fd = self._fds[id(f)] = next(counter)
                self._add(kind="open", path=os.path.abspath(path), fd=fd, create=not existed, trunc=True)
            return f

        def write(self, f, data):
            with step():
                off = f.tell()
                n = super().write(f, data)
                self._add(kind="write", fd=self._fds.get(id(f), -1), offset=off, data=bytes(memoryview(data).cast("B")[:n]))
            return n

        def fsync(self, f):
            with step():
                super().fsync(f)
                self._add(kind="fsync", fd=self._fds.get(id(f), -1))

        def fsync_dir(self, path):
            with step():
                super().fsync_dir(path)
                self._add(kind="fsync_dir", path=os.path.abspath(path))

        def mkdir(self, path, *, parents=True):
            with step():  # under the lock, "missing" is exactly what this call creates
                missing, p = [], os.path.abspath(path)
                while p and not os.path.lexists(p):
                    missing.append(p)
                    p = os.path.dirname(p)
                super().mkdir(path, parents=parents)
                for m in reversed(missing):
                    self._add(kind="mkdir", path=m)

        def replace(self, src, dst):
            with step():
                super().replace(src, dst)
                self._add(kind="rename", path=os.path.abspath(src), path2=os.path.abspath(dst))

        def exchange(self, a, b):
            with step():
                ok = super().exchange(a, b)
                if ok:
                    self._add(kind="exchange", path=os.path.abspath(a), path2=os.path.abspath(b))
            return ok

        def unlink(self, path):
            with step():
                super().unlink(path)
                self._add(kind="unlink", path=os.path.abspath(path))

        def rmtree(self, path):
            with step():
                super().rmtree(path)
                self._add(kind="rmtree", path=os.path.abspath(path))

    return RecordingIO()
