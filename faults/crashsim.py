"""Recording what a save does to the file system, and what of it survives a power cut.

Persistence model (the rules a crash-consistency checker must assume of a POSIX file system
after power loss or a kernel crash; stricter than what ext4 with ``data=ordered`` gives,
matching what ALICE (OSDI 2014) and LazyFS assume):

* A file's data is durable only after ``fsync``/``fdatasync`` of that file.
* A new, renamed or removed directory entry is durable only after ``fsync`` of the directory
  that holds it (for a rename: the new name after an fsync of the destination directory, the
  removal of the old name after an fsync of the source directory).
* Everything not yet made durable may be lost at a crash.

A SIGKILL keeps the page cache, so a save that survives every process crash may still lose an
acknowledged checkpoint to a power cut: the usual bug is a missing directory fsync.

:func:`record` traces, in the calling process, the operations a checkpointer performs through
``os`` and ``open`` (create, mkdir, rename/replace, unlink/rmdir, rmtree, fsync of files and
directories) with the inode numbers involved and a monotonic timestamp, so traces of several
ranks on one host merge in order. It needs no cooperation from the checkpointer. Not seen:
renames done by raw syscalls (refckpt's ``renameat2(RENAME_EXCHANGE)`` for overwriting saves
goes through ctypes) and writes (data durability is judged per file: fsynced after creation).

:func:`acknowledged_not_durable` replays a trace under the model and lists what a power cut
right after the save was acknowledged could take away from a committed step.
"""

from __future__ import annotations

import builtins
import contextlib
import dataclasses
import io
import os
import shutil
import stat
import threading
import time
from typing import Callable, Iterator

__all__ = ["Op", "record", "snapshot_tree", "snapshot_states", "DurableView", "acknowledged_not_durable"]


@dataclasses.dataclass(frozen=True)
class Op:
    """One recorded operation. ``dir``/``name`` locate the entry changed (by the directory's
    inode, which survives renames of the directory itself), ``ino`` is the inode it names."""

    t: int
    kind: str          # create | truncate | mkdir | rename | unlink | rmtree | fsync_file | fsync_dir
    path: str
    dir: int = 0
    name: str = ""
    ino: int = 0
    dir2: int = 0      # rename: the destination directory
    name2: str = ""
    rank: int = 0


def _ino(path) -> int:
    try:
        return os.stat(path, follow_symlinks=False).st_ino
    except OSError:
        return 0


def _parent(path) -> tuple[int, str]:
    p = os.path.abspath(os.fspath(path))
    return _ino(os.path.dirname(p)), os.path.basename(p)


_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT


@contextlib.contextmanager
def record(rank: int = 0, on_op: Callable[[Op], None] | None = None) -> Iterator[list[Op]]:
    """Trace this process's file-system operations (all threads) until the block exits.

    ``on_op(op)`` runs right after each operation, in the thread that did it, with recording
    paused (so it may itself touch the file system, e.g. :func:`snapshot_states` copying the
    tree: the state a SIGKILL at that moment would leave, page cache intact)."""
    trace: list[Op] = []
    local = threading.local()
    lock = threading.Lock()
    orig = {"open": builtins.open, "os_open": os.open, "fsync": os.fsync, "fdatasync": os.fdatasync,
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
            d, n = _parent(path)
            add("create", path, dir=d, name=n, ino=_ino(path))

    def open_(file, mode="r", *a, **k):
        writing = isinstance(file, (str, bytes, os.PathLike)) and any(c in mode for c in "wax+")
        existed = writing and os.path.lexists(file)
        f = orig["open"](file, mode, *a, **k)
        if writing:
            created(file, existed)
            if existed and "w" in mode:  # truncated in place: a crash now leaves it empty
                d, n = _parent(file)
                add("truncate", file, dir=d, name=n, ino=_ino(file))
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
            add(kind, f"<fd {fd if isinstance(fd, int) else fd.fileno()}>", ino=st.st_ino)
            return out
        return inner

    def rename_(which):
        def inner(src, dst, *a, **k):
            if k.get("src_dir_fd") is not None or k.get("dst_dir_fd") is not None:
                return orig[which](src, dst, *a, **k)
            sd, sn = _parent(src)
            ino = _ino(src)
            out = orig[which](src, dst, *a, **k)
            dd, dn = _parent(dst)
            add("rename", dst, dir=sd, name=sn, ino=ino, dir2=dd, name2=dn)
            return out
        return inner

    def mkdir_(path, *a, **k):
        if k.get("dir_fd") is not None:
            return orig["mkdir"](path, *a, **k)
        out = orig["mkdir"](path, *a, **k)
        d, n = _parent(path)
        add("mkdir", path, dir=d, name=n, ino=_ino(path))
        return out

    def remove_(which, kind):
        def inner(path, *a, **k):
            if k.get("dir_fd") is not None:
                return orig[which](path, *a, **k)
            d, n = _parent(path)
            ino = _ino(path)
            out = orig[which](path, *a, **k)
            add(kind, path, dir=d, name=n, ino=ino)
            return out
        return inner

    def rmtree_(path, *a, **k):
        d, n = _parent(path)
        ino = _ino(path)
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
    shutil.rmtree = rmtree_
    try:
        yield trace
    finally:
        builtins.open = io.open = orig["open"]
        os.open, os.fsync, os.fdatasync = orig["os_open"], orig["fsync"], orig["fdatasync"]
        os.replace, os.rename, os.mkdir = orig["replace"], orig["rename"], orig["mkdir"]
        os.unlink, os.remove, os.rmdir, shutil.rmtree = orig["unlink"], orig["remove"], orig["rmdir"], orig["rmtree"]


def snapshot_tree(root: str) -> dict[tuple[int, str], int]:
    """The directory entries under ``root`` (inclusive of ``root`` itself), all taken as durable."""
    root = os.path.abspath(root)
    entries = {_parent(root): _ino(root)}
    for dirpath, dirs, files in os.walk(root):
        d = _ino(dirpath)
        for n in dirs + files:
            entries[(d, n)] = _ino(os.path.join(dirpath, n))
    return entries


class DurableView:
    """Replays a trace under the persistence model: what a power cut would leave."""

    def __init__(self, before: dict[tuple[int, str], int]) -> None:
        self.entries = dict(before)            # durable (dir inode, name) -> inode
        self.pending: dict[int, list] = {}     # dir inode -> entry changes awaiting its fsync
        self.data_durable = set(before.values())  # inodes whose data is durable
        self.created: set[int] = set()

    def apply(self, op: Op) -> None:
        if op.kind in ("create", "mkdir"):
            self.pending.setdefault(op.dir, []).append(("set", op.name, op.ino))
            self.created.add(op.ino)
            if op.kind == "mkdir":
                self.data_durable.add(op.ino)  # a directory's "data" is its entries, tracked above
            else:
                self.data_durable.discard(op.ino)
        elif op.kind == "rename":
            self.pending.setdefault(op.dir2, []).append(("set", op.name2, op.ino))
            self.pending.setdefault(op.dir, []).append(("del", op.name, op.ino))
        elif op.kind in ("unlink", "rmtree"):
            self.pending.setdefault(op.dir, []).append(("del", op.name, op.ino))
        elif op.kind == "fsync_dir":
            for what, name, ino in self.pending.pop(op.ino, []):
                if what == "set":
                    self.entries[(op.ino, name)] = ino
                elif self.entries.get((op.ino, name)) == ino:
                    del self.entries[(op.ino, name)]
        elif op.kind == "truncate":
            self.data_durable.discard(op.ino)
        elif op.kind == "fsync_file":
            self.data_durable.add(op.ino)

    def resolve(self, root_key: tuple[int, str], rel: str) -> int | None:
        ino = self.entries.get(root_key)
        for part in [p for p in rel.split("/") if p]:
            if ino is None:
                return None
            ino = self.entries.get((ino, part))
        return ino


def acknowledged_not_durable(before: dict[tuple[int, str], int], trace: list[Op], root: str,
                             step_dir: str) -> list[str]:
    """What of the committed ``step_dir`` (as it is on disk now) a power cut at the end of
    ``trace`` could lose: entries whose directory was never fsynced after they appeared, and
    files never fsynced after creation. Empty when the save is durable."""
    view = DurableView(before)
    for op in sorted(trace, key=lambda o: o.t):
        view.apply(op)
    root = os.path.abspath(root)
    root_key = _parent(root)
    problems = []
    rel_step = os.path.relpath(step_dir, root)
    live = [rel_step]
    for dirpath, dirs, files in os.walk(step_dir):
        live += [os.path.relpath(os.path.join(dirpath, n), root) for n in dirs + files]
    for rel in live:
        got = view.resolve(root_key, rel)
        want = _ino(os.path.join(root, rel))
        if got != want:
            problems.append(f"{rel}: directory entry not durable (its directory was not fsynced after it appeared)")
        elif want in view.created and want not in view.data_durable:
            problems.append(f"{rel}: data not durable (never fsynced after it was created)")
    return problems


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
