"""Recording what a save does to the file system, and what of it survives a power cut.

Persistence model (the rules a crash-consistency checker must assume of a POSIX file system
after power loss or a kernel crash; stricter than what ext4 with ``data=ordered`` gives,
matching what ALICE (OSDI 2014) and LazyFS assume):

* A file's data is durable only after ``fsync``/``fdatasync`` of that file.
* A new, renamed or removed directory entry is durable only after ``fsync`` of the directory
  that holds it (for a rename: the new name after an fsync of the destination directory, the
  removal of the old name after an fsync of the source directory).
* Everything not yet made durable may be lost at a crash, independently and in any order
  (a later operation may persist while an earlier one is lost).
* A single write may be torn: only a prefix of it at sector (512 B) or page (4 KiB)
  granularity persists, while the file's size already covers the whole range (the rest reads
  as zeros).

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

The explorer (second half of this module) works on traces *with the bytes written*: recorded
through refckpt's I/O layer (:func:`recording_io`) or, with no cooperation from the
checkpointer, under ``strace -f`` (:func:`strace_record`). :class:`Model` replays a trace on
an inode/entry model of the root; :func:`crash_states` enumerates, for every crash point, the
prefix state, everything pending dropped, pending operations dropped while later ones
persist (all subsets when few are pending), and torn writes -- exhaustively for small saves, a
seeded stratified sample beyond a budget; :meth:`Model.materialise` writes a state into a real
directory for the real checkpointer to resume from (:mod:`faults.powerloss`).
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
from collections.abc import Callable, Iterator

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


# == power-loss crash-state explorer ========================================================
#
# Recorded operations (:class:`FOp`, path based, with the bytes written) are replayed on a
# model of the root directory (inodes, directory entries) into inode-level operations
# (:class:`IOp`). At each crash point k (between operation k-1 and k) every IOp before k is
# either *covered* -- a later fsync of its file (data) or of its directory (entries) happened
# before k, so it survives -- or *pending*, which the persistence model lets the machine lose.
# A crash state is the initial tree plus every covered IOp plus a chosen subset of the pending
# ones, applied in order; a pending write may also be torn (only its first 512·j or 4096·j
# bytes persisted, the rest of the range zeros, size already extended).


@dataclasses.dataclass(frozen=True)
class FOp:
    """One recorded file-system operation. ``fd`` is a handle id unique in the trace."""

    t: int
    kind: str   # open | write | truncate | fsync | fsync_dir | mkdir | rename | exchange | unlink | rmdir | rmtree
    path: str = ""
    path2: str = ""
    fd: int = -1
    offset: int = 0
    data: bytes = b""
    size: int = 0
    create: bool = False
    trunc: bool = False
    rank: int = 0


@dataclasses.dataclass(frozen=True)
class IOp:
    kind: str   # set | del | rename | exchange | data | trunc | sync_file | sync_dir
    dir: int = 0
    name: str = ""
    ino: int = 0
    dir2: int = 0
    name2: str = ""
    ino2: int = 0
    offset: int = 0
    data: bytes = b""
    size: int = 0
    src: int = -1  # index of the FOp it came from

    def covered_by(self, sync: IOp) -> bool:
        if self.kind in ("data", "trunc"):
            return sync.kind == "sync_file" and sync.ino == self.ino
        if sync.kind != "sync_dir":
            return False
        return sync.ino in {self.dir} | ({self.dir2} if self.kind in ("rename", "exchange") else set())


class Model:
    """The root's tree as inodes and entries; :meth:`replay` turns a trace into IOps."""

    def __init__(self, root: str) -> None:
        self.root = os.path.abspath(root)
        self.next_ino = 1
        self.is_dir: dict[int, bool] = {}
        self.content: dict[int, bytes] = {}
        self.entries: dict[tuple[int, str], int] = {}
        self.root_ino = self._new(True)
        self._load(self.root, self.root_ino)
        self.initial_entries = dict(self.entries)
        self.initial_content = dict(self.content)

    def _new(self, is_dir: bool) -> int:
        ino = self.next_ino
        self.next_ino += 1
        self.is_dir[ino] = is_dir
        if not is_dir:
            self.content[ino] = b""
        return ino

    def _load(self, path: str, ino: int) -> None:
        for name in sorted(os.listdir(path)):
            full = os.path.join(path, name)
            if os.path.isdir(full) and not os.path.islink(full):
                child = self._new(True)
                self._load(full, child)
            else:
                child = self._new(False)
                with open(full, "rb") as f:
                    self.content[child] = f.read()
            self.entries[(ino, name)] = child

    def _split(self, path: str) -> tuple[int, str] | None:
        """(directory inode, name) of ``path`` in the current tree; None outside the root."""
        p = os.path.abspath(path)
        if p == self.root or not p.startswith(self.root + os.sep):
            return None
        parts = os.path.relpath(p, self.root).split(os.sep)
        d = self.root_ino
        for part in parts[:-1]:
            d = self.entries.get((d, part))
            if d is None:
                return None
        return d, parts[-1]

    def _ino(self, path: str) -> int | None:
        if os.path.abspath(path) == self.root:
            return self.root_ino
        loc = self._split(path)
        return None if loc is None else self.entries.get(loc)

    def replay(self, trace: list[FOp]) -> list[IOp]:
        """Turn the trace into inode operations (the model's ``entries``/``content`` follow)."""
        out: list[IOp] = []
        fds: dict[int, int] = {}
        for i, op in enumerate(trace):
            new: list[IOp] = []
            if op.kind == "open":
                ino = self._ino(op.path)
                if ino is None and op.create:
                    loc = self._split(op.path)
                    if loc is not None:
                        ino = self._new(False)
                        new.append(IOp("set", loc[0], loc[1], ino, src=i))
                elif ino is not None and op.trunc and not self.is_dir[ino]:
                    new.append(IOp("trunc", ino=ino, size=0, src=i))
                if ino is not None:
                    fds[op.fd] = ino
            elif op.kind == "write" and op.fd in fds:
                new.append(IOp("data", ino=fds[op.fd], offset=op.offset, data=op.data, src=i))
            elif op.kind == "truncate" and op.fd in fds:
                new.append(IOp("trunc", ino=fds[op.fd], size=op.size, src=i))
            elif op.kind == "fsync" and op.fd in fds:
                ino = fds[op.fd]
                new.append(IOp("sync_dir" if self.is_dir[ino] else "sync_file", ino=ino, src=i))
            elif op.kind == "fsync_dir":
                ino = self._ino(op.path)
                if ino is not None:
                    new.append(IOp("sync_dir", ino=ino, src=i))
            elif op.kind == "mkdir":
                loc = self._split(op.path)
                if loc is not None and loc not in self.entries:
                    new.append(IOp("set", loc[0], loc[1], self._new(True), src=i))
            elif op.kind in ("rename", "exchange"):
                a, b = self._split(op.path), self._split(op.path2)
                ia = self.entries.get(a) if a else None
                ib = self.entries.get(b) if b else None
                if a is not None and b is not None and ia is not None:
                    if op.kind == "rename":
                        new.append(IOp("rename", a[0], a[1], ia, b[0], b[1], ib or 0, src=i))
                    elif ib is not None:
                        new.append(IOp("exchange", a[0], a[1], ia, b[0], b[1], ib, src=i))
                elif b is not None and ia is None and a is None and ib is not None:
                    pass  # renamed in from outside the root: not modelled
            elif op.kind in ("unlink", "rmdir", "rmtree"):
                loc = self._split(op.path)
                if loc is not None and loc in self.entries:
                    new.append(IOp("del", loc[0], loc[1], self.entries[loc], src=i))
            for iop in new:
                _apply(self.entries, self.content, iop)
            out += new
        return out

    def state(self, iops: list[IOp], keep) -> tuple[dict, dict]:
        """Initial tree plus the IOps ``keep(index, iop)`` selects (an IOp, or None to drop it)."""
        entries, content = dict(self.initial_entries), dict(self.initial_content)
        for j, iop in enumerate(iops):
            chosen = keep(j, iop)
            if chosen is not None:
                _apply(entries, content, chosen)
        return entries, content

    def final_tree_problems(self, real_root: str) -> list[str]:
        """Where the model's replay of the whole trace differs from ``real_root`` (the live
        tree after the save). Empty when the recording and the replay are faithful; anything
        else is a recorder problem (an operation not seen, or misordered), not a finding."""
        got = {}
        children: dict[int, list[tuple[str, int]]] = {}
        for (d, name), ino in self.entries.items():
            children.setdefault(d, []).append((name, ino))

        def walk(d: int, rel: str, depth: int) -> None:
            for name, ino in children.get(d, []):
                r = f"{rel}/{name}".lstrip("/")
                if self.is_dir.get(ino):
                    got[r + "/"] = None
                    if depth < 16:
                        walk(ino, r, depth + 1)
                else:
                    got[r] = self.content.get(ino, b"")

        walk(self.root_ino, "", 0)
        want = {}
        for dirpath, dirs, files in os.walk(real_root):
            rel = os.path.relpath(dirpath, real_root)
            for n in dirs:
                want[os.path.normpath(os.path.join(rel, n)) + "/"] = None
            for n in files:
                with open(os.path.join(dirpath, n), "rb") as f:
                    want[os.path.normpath(os.path.join(rel, n))] = f.read()
        problems = [f"{k}: on disk, not in the replay" for k in sorted(set(want) - set(got))]
        problems += [f"{k}: in the replay, not on disk" for k in sorted(set(got) - set(want))]
        problems += [f"{k}: content differs" for k in sorted(set(got) & set(want)) if got[k] != want[k]]
        return problems

    def materialise(self, entries: dict, content: dict, dest: str) -> None:
        os.makedirs(dest, exist_ok=True)
        children: dict[int, list[tuple[str, int]]] = {}
        for (d, name), ino in entries.items():
            children.setdefault(d, []).append((name, ino))

        def walk(d: int, path: str, depth: int) -> None:
            for name, ino in sorted(children.get(d, [])):
                full = os.path.join(path, name)
                if self.is_dir.get(ino):
                    if depth < 16:
                        os.makedirs(full, exist_ok=True)
                        walk(ino, full, depth + 1)
                else:
                    with open(full, "wb") as f:
                        f.write(content.get(ino, b""))

        walk(self.root_ino, dest, 0)


def _apply(entries: dict, content: dict, iop: IOp) -> None:
    k = iop.kind
    if k == "set":
        entries[(iop.dir, iop.name)] = iop.ino
    elif k == "del":
        if entries.get((iop.dir, iop.name)) == iop.ino:
            del entries[(iop.dir, iop.name)]
    elif k == "rename":
        if entries.get((iop.dir, iop.name)) == iop.ino:
            del entries[(iop.dir, iop.name)]
        entries[(iop.dir2, iop.name2)] = iop.ino
    elif k == "exchange":
        entries[(iop.dir, iop.name)], entries[(iop.dir2, iop.name2)] = iop.ino2, iop.ino
    elif k == "data":
        old = content.get(iop.ino, b"")
        end = iop.offset + len(iop.data)
        buf = bytearray(old) + bytearray(max(0, end - len(old)))
        buf[iop.offset:end] = iop.data
        content[iop.ino] = bytes(buf)
    elif k == "trunc":
        old = content.get(iop.ino, b"")
        content[iop.ino] = old[: iop.size] + bytes(max(0, iop.size - len(old)))


@dataclasses.dataclass(frozen=True)
class CrashState:
    kind: str                 # prefix | dropped | reordered | torn
    point: int                # crash between FOp point-1 and point (len(trace): after the last)
    lost: tuple[int, ...]     # indexes (into the IOps) of pending operations that did not persist
    torn: tuple[int, int] | None = None  # (IOp index, bytes of it that persisted)

    def describe(self, trace: list[FOp], iops: list[IOp]) -> str:
        last = trace[self.point - 1] if self.point else None
        at = f"after op {self.point - 1} ({last.kind} {last.path}{' -> ' + last.path2 if last.path2 else ''})" if last else "before the first op"
        lost = ", ".join(_iop_text(iops[j], trace) for j in self.lost) or "nothing"
        tear = f"; torn: {_iop_text(iops[self.torn[0]], trace)} kept {self.torn[1]} bytes" if self.torn else ""
        return f"{self.kind} crash {at}; not persisted: {lost}{tear}"


def _iop_text(iop: IOp, trace: list[FOp]) -> str:
    op = trace[iop.src]
    what = {"set": "new entry", "del": "removal", "rename": "rename", "exchange": "exchange", "data": "data",
            "trunc": "truncate"}.get(iop.kind, iop.kind)
    target = op.path + (f" -> {op.path2}" if op.path2 else "")
    return f"{what} of {target}" + (f" [{iop.offset}:{iop.offset + len(iop.data)}]" if iop.kind == "data" else "")


def crash_states(trace: list[FOp], iops: list[IOp], *, budget: int = 2000, exhaustive_upto: int = 8,
                 seed: int = 0) -> list[CrashState]:
    """Every crash point; per point the prefix state, everything pending dropped, each pending
    operation dropped alone while later ones persist (reordered), all subsets when at most
    ``exhaustive_upto`` are pending, and each pending write torn at 512 B and 4 KiB
    boundaries. Beyond ``budget`` states, a seeded sample (prefix states and the states at the
    end of the trace always kept)."""
    import itertools
    import random

    by_src: dict[int, list[int]] = {}
    for j, iop in enumerate(iops):
        by_src.setdefault(iop.src, []).append(j)
    states: list[CrashState] = []
    for point in range(len(trace) + 1):
        issued = [j for j, iop in enumerate(iops) if iop.src < point]
        syncs = [j for j in issued if iops[j].kind.startswith("sync")]
        pending = [j for j in issued if not iops[j].kind.startswith("sync")
                   and not any(s > j and iops[j].covered_by(iops[s]) for s in syncs)]
        states.append(CrashState("prefix", point, ()))
        if not pending:
            continue
        if len(pending) <= exhaustive_upto:
            subsets = itertools.chain.from_iterable(itertools.combinations(pending, r) for r in range(1, len(pending) + 1))
        else:
            subsets = [tuple(pending)] + [(j,) for j in pending]
        for lost in subsets:
            lost = tuple(lost)
            kept_after = any(j > min(lost) for j in pending if j not in lost)
            states.append(CrashState("reordered" if kept_after else "dropped", point, lost))
        for j in pending:
            iop = iops[j]
            if iop.kind == "data" and len(iop.data) > 512:
                cuts = sorted({c for c in (512, 4096, (len(iop.data) // 2) // 512 * 512) if 0 < c < len(iop.data)})
                for c in cuts:
                    states.append(CrashState("torn", point, (), (j, c)))
    if len(states) > budget:
        # Seeded and stratified: every prefix state and every state at the acknowledgement (the
        # end of the trace: what "no acknowledged save is lost" is about), then the other
        # kinds in equal shares.
        rng = random.Random(seed)
        end = len(trace)
        prefix = [s for s in states if s.kind == "prefix" or s.point == end]
        pools = {k: [s for s in states if s.kind == k and s.point != end] for k in ("dropped", "reordered", "torn")}
        left, chosen = max(0, budget - len(prefix)), []
        while left > 0 and any(pools.values()):
            for k in [k for k, v in pools.items() if v]:
                if left == 0:
                    break
                chosen.append(pools[k].pop(rng.randrange(len(pools[k]))))
                left -= 1
        states = prefix + sorted(chosen, key=lambda s: (s.point, s.kind, s.lost, s.torn or ()))
    return states


def build_state(model: Model, iops: list[IOp], cs: CrashState) -> tuple[dict, dict]:
    lost = set(cs.lost)

    def keep(j: int, iop: IOp):
        if iop.src >= cs.point or j in lost or iop.kind.startswith("sync"):
            return None
        if cs.torn is not None and cs.torn[0] == j:
            n = cs.torn[1]
            return dataclasses.replace(iop, data=iop.data[:n] + bytes(len(iop.data) - n))
        return iop

    return model.state(iops, keep)


def state_key(entries: dict, content: dict, model: Model) -> str:
    """A digest of what a state looks like from the root (for deduplication)."""
    import hashlib

    h = hashlib.sha256()
    children: dict[int, list[tuple[str, int]]] = {}
    for (d, name), ino in entries.items():
        children.setdefault(d, []).append((name, ino))

    def walk(d: int, prefix: str, depth: int) -> None:
        for name, ino in sorted(children.get(d, [])):
            h.update(f"{prefix}/{name}".encode())
            if model.is_dir.get(ino):
                h.update(b"/")
                if depth < 16:
                    walk(ino, f"{prefix}/{name}", depth + 1)
            else:
                h.update(hashlib.sha256(content.get(ino, b"")).digest())

    walk(model.root_ino, "", 0)
    return h.hexdigest()


# -- recorders with data ---------------------------------------------------------------------

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

        def mkdir(self, path):
            with step():  # under the lock, "missing" is exactly what this call creates
                missing, p = [], os.path.abspath(path)
                while p and not os.path.lexists(p):
                    missing.append(p)
                    p = os.path.dirname(p)
                super().mkdir(path)
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


_STRACE_CALLS = ("openat,open,creat,write,pwrite64,lseek,ftruncate,fsync,fdatasync,rename,renameat,renameat2,"
                 "unlink,unlinkat,mkdir,mkdirat,rmdir,close")


def strace_record(argv: list[str], *, env: dict | None = None, cwd: str | None = None, timeout: float = 600) -> list[FOp]:
    """Run ``argv`` under ``strace -f`` and return its file-system operations: the recorder that
    needs no cooperation from the checkpointer. Single-process savers (threads included):
    descriptors are tracked per traced process group as one table."""
    import glob
    import shutil as _sh
    import subprocess
    import tempfile

    if _sh.which("strace") is None:
        raise RuntimeError("strace is not installed (apt-get install strace); use recording_io() for refckpt")
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "trace")
        cmd = ["strace", "-f", "-ff", "-qq", "--seccomp-bpf", "-ttt", "-xx", "-s", str(1 << 24), "-e", f"trace={_STRACE_CALLS}",
               "-o", out] + list(argv)
        proc = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)
        if proc.returncode != 0:
            raise RuntimeError(f"traced command failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
        lines = []
        for path in glob.glob(out + ".*"):
            with open(path, errors="replace") as f:
                lines += [ln for ln in f if ln.strip()]
    return parse_strace(lines, cwd or os.getcwd())


def _unhex(s: str) -> bytes:
    """strace ``-xx`` string literal (every byte as \\xNN) to bytes."""
    out = bytearray()
    i = 0
    while i < len(s):
        if s[i] == "\\" and i + 3 < len(s) + 1 and s[i + 1] == "x":
            out.append(int(s[i + 2:i + 4], 16))
            i += 4
        else:  # pragma: no cover - -xx escapes every byte
            out += s[i].encode()
            i += 1
    return bytes(out)


def _args(text: str) -> list[str]:
    """Split a syscall's argument list at top-level commas (strings and brackets kept whole)."""
    out, cur, depth, in_str = [], [], 0, False
    i = 0
    while i < len(text):
        c = text[i]
        if in_str:
            cur.append(c)
            if c == "\\":
                cur.append(text[i + 1])
                i += 1
            elif c == '"':
                in_str = False
        elif c == '"':
            in_str = True
            cur.append(c)
        elif c in "[{(":
            depth += 1
            cur.append(c)
        elif c in "]})":
            depth -= 1
            cur.append(c)
        elif c == "," and depth == 0:
            out.append("".join(cur).strip())
            cur = []
        else:
            cur.append(c)
        i += 1
    if cur:
        out.append("".join(cur).strip())
    return out


def parse_strace(lines: list[str], cwd: str) -> list[FOp]:
    """strace ``-ttt -xx`` lines (``TIMESTAMP call(args) = ret``) to :class:`FOp`, in time order."""
    import re

    pat = re.compile(r"^(\d+\.\d+) (\w+)\((.*)\) += (-?\d+|0x[0-9a-f]+)")
    calls = []
    for ln in lines:
        m = pat.match(ln.strip())
        if m and not m.group(4).startswith("-"):
            calls.append((float(m.group(1)), m.group(2), _args(m.group(3)), int(m.group(4), 0)))
    calls.sort(key=lambda c: c[0])
    fdpath: dict[int, str] = {}
    pos: dict[int, int] = {}
    handle: dict[int, int] = {}
    nxt = iter(range(1, 1 << 30))
    ops: list[FOp] = []

    def s(arg: str) -> str:
        return _unhex(arg[1:-1]).decode("utf-8", "surrogateescape") if arg.startswith('"') else arg

    def at(dirfd: str, path: str) -> str:
        if os.path.isabs(path):
            return os.path.normpath(path)
        base = cwd if dirfd == "AT_FDCWD" else fdpath.get(int(dirfd), cwd)
        return os.path.normpath(os.path.join(base, path))

    for t, name, a, ret in calls:
        ts = int(t * 1e9)
        if name in ("openat", "open", "creat"):
            dirfd, path, flags = ("AT_FDCWD", s(a[0]), a[1] if len(a) > 1 else "") if name != "openat" else (a[0], s(a[1]), a[2])
            if name == "creat":
                flags = "O_CREAT|O_TRUNC|O_WRONLY"
            full = at(dirfd, path)
            fdpath[ret], pos[ret] = full, 0
            handle[ret] = next(nxt)
            writing = "O_WRONLY" in flags or "O_RDWR" in flags
            if writing or "O_CREAT" in flags:
                ops.append(FOp(ts, "open", full, fd=handle[ret], create="O_CREAT" in flags, trunc="O_TRUNC" in flags))
            else:
                ops.append(FOp(ts, "open", full, fd=handle[ret]))
        elif name in ("write", "pwrite64"):
            fd = int(a[0])
            data = _unhex(a[1][1:-1])[:ret]
            off = int(a[3]) if name == "pwrite64" else pos.get(fd, 0)
            if name == "write":
                pos[fd] = off + ret
            if fd in handle:
                ops.append(FOp(ts, "write", fdpath.get(fd, ""), fd=handle[fd], offset=off, data=data))
        elif name == "lseek":
            pos[int(a[0])] = ret
        elif name == "ftruncate":
            fd = int(a[0])
            if fd in handle:
                ops.append(FOp(ts, "truncate", fdpath.get(fd, ""), fd=handle[fd], size=int(a[1])))
        elif name in ("fsync", "fdatasync"):
            fd = int(a[0])
            if fd in handle:
                ops.append(FOp(ts, "fsync", fdpath.get(fd, ""), fd=handle[fd]))
        elif name == "close":
            fd = int(a[0])
            fdpath.pop(fd, None), pos.pop(fd, None), handle.pop(fd, None)
        elif name in ("rename", "renameat", "renameat2"):
            if name == "rename":
                src, dst, flags = at("AT_FDCWD", s(a[0])), at("AT_FDCWD", s(a[1])), ""
            else:
                src, dst = at(a[0], s(a[1])), at(a[2], s(a[3]))
                flags = a[4] if len(a) > 4 else ""
            ops.append(FOp(ts, "exchange" if "RENAME_EXCHANGE" in flags else "rename", src, dst))
        elif name in ("unlink", "unlinkat", "rmdir"):
            if name == "unlinkat":
                ops.append(FOp(ts, "rmdir" if "AT_REMOVEDIR" in a[2] else "unlink", at(a[0], s(a[1]))))
            else:
                ops.append(FOp(ts, "rmdir" if name == "rmdir" else "unlink", at("AT_FDCWD", s(a[0]))))
        elif name in ("mkdir", "mkdirat"):
            path = at(a[0], s(a[1])) if name == "mkdirat" else at("AT_FDCWD", s(a[0]))
            ops.append(FOp(ts, "mkdir", path))
    return ops
