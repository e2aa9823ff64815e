"""What of a save survives a power cut: the persistence model, and the crash states it allows.

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

Two replays of a trace under the model. :class:`DurableView` replays the operations
:func:`faults.crashsim.recorder.record` saw (:class:`Op`, no bytes): :func:`acknowledged_not_durable`
lists what a power cut right after the save was acknowledged could take away from a committed
step. The explorer works on traces *with the bytes written* (:class:`FOp`, from
:func:`faults.crashsim.recorder.recording_io` or :func:`faults.crashsim.strace.strace_record`):
:class:`Model` replays a trace on an inode/entry model of the root; :func:`crash_states`
enumerates, for every crash point, the prefix state, everything pending dropped, pending
operations dropped while later ones persist (all subsets when few are pending), and torn
writes -- exhaustively for small saves, a seeded stratified sample beyond a budget;
:meth:`Model.materialise` writes a state into a real directory for the real checkpointer to
resume from (:mod:`faults.powerloss`).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable

__all__ = ["Op", "snapshot_tree", "DurableView", "acknowledged_not_durable", "FOp", "IOp", "Model", "CrashState",
           "crash_states", "build_state", "state_key"]


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
    size: int = -1     # fsync_file: the file's size as the kernel saw it at the fsync (-1: unknown)


def inode_of(path) -> int:
    """The inode ``path`` names (not following a final symlink); 0 when there is none."""
    try:
        return os.stat(path, follow_symlinks=False).st_ino
    except OSError:
        return 0


def entry_of(path) -> tuple[int, str]:
    """The directory entry ``path`` is: (its directory's inode, its name)."""
    p = os.path.abspath(os.fspath(path))
    return inode_of(os.path.dirname(p)), os.path.basename(p)


def snapshot_tree(root: str) -> dict[tuple[int, str], int]:
    """The directory entries under ``root`` (inclusive of ``root`` itself), all taken as durable."""
    root = os.path.abspath(root)
    entries = {entry_of(root): inode_of(root)}
    for dirpath, dirs, files in os.walk(root):
        d = inode_of(dirpath)
        for n in dirs + files:
            entries[(d, n)] = inode_of(os.path.join(dirpath, n))
    return entries


class DurableView:
    """Replays a trace under the persistence model: what a power cut would leave."""

    def __init__(self, before: dict[tuple[int, str], int]) -> None:
        self.entries = dict(before)            # durable (dir inode, name) -> inode
        self.pending: dict[int, list] = {}     # dir inode -> entry changes awaiting its fsync
        self.data_durable = set(before.values())  # inodes whose data is durable
        self.created: set[int] = set()
        self.synced_size: dict[int, int] = {}  # inode -> its size the kernel held at its last fsync

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
            if op.size >= 0:
                self.synced_size[op.ino] = op.size

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
    root_key = entry_of(root)
    problems = []
    rel_step = os.path.relpath(step_dir, root)
    live = [rel_step]
    for dirpath, dirs, files in os.walk(step_dir):
        live += [os.path.relpath(os.path.join(dirpath, n), root) for n in dirs + files]
    for rel in live:
        got = view.resolve(root_key, rel)
        want = inode_of(os.path.join(root, rel))
        if got != want:
            problems.append(f"{rel}: directory entry not durable (its directory was not fsynced after it appeared)")
        elif want in view.created and want not in view.data_durable:
            problems.append(f"{rel}: data not durable (never fsynced after it was created)")
        elif want in view.created and view.synced_size.get(want, -1) >= 0:
            size = os.lstat(os.path.join(root, rel)).st_size
            if size > view.synced_size[want]:
                problems.append(f"{rel}: data not durable: {size - view.synced_size[want]} of its {size} bytes reached "
                                "the kernel after its last fsync (written through a buffer the fsync did not flush)")
    return problems


# == the power-loss crash-state explorer ====================================================
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
            child = self.entries.get((d, part))
            if child is None:
                return None
            d = child
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
        got: dict[str, bytes | None] = {}  # None: a directory
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
        want: dict[str, bytes | None] = {}
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
        at = (f"after op {self.point - 1} ({last.kind} {last.path}{' -> ' + last.path2 if last.path2 else ''})"
              if last else "before the first op")
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
        subsets: Iterable[tuple[int, ...]]
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
