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
* :data:`DISK_FAULTS` corrupt files on disk between save and resume: the pointer, payload
  files, extra state, the commit record itself (a flipped bit, a truncation, a changed field
  with a stale or a recomputed checksum), FIFOs and device nodes in place of payload files,
  and a directory tree too deep for recursive walks.

Everything random takes a ``random.Random`` so a fault is reproducible from its seed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import io
import json
import os
import pickle
import random
import shutil
import signal
import stat
import struct
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

# The record footer's layout and the allow-list unpickler are refckpt's own: the harness splits,
# re-encodes and reads commit records with them, never with a copy.
from refckpt.record import RECORD_FOOTER_LEN as RECORD_FOOTER_SIZE
from refckpt.record import RECORD_MAGIC, encode_record
from refckpt.safeload import MetadataUnpickler

from .contract import (
    COMMIT_RECORD,
    EXTRA_STATE_DIR,
    POINTER_FILE,
    RANK_RECORD_RE,
    SHARD_SUFFIXES,
    TMP_SUFFIX,
    extra_state_file_name,
    is_commit_record,
    rank_record_name,
    step_numbers,
    step_of,
)
from .points import POINTS_BY_NAME, CrashPoint, FaultKind, Role, classify

__all__ = [
    "Action",
    "FaultSpec",
    "FaultyIO",
    "patch_os",
    "kill_on_event",
    "DISK_FAULTS",
    "DiskFault",
    "FaultNotApplicable",
    "NoCommitRecord",
    "RECORD_MAGIC",
    "RECORD_FOOTER_SIZE",
    "record_path",
    "split_record",
    "record_footer",
    "read_record",
    "mutate_record",
    "RECORD_FIELDS",
    "STRUCTURAL_RECORD_FIELDS",
    "make_deep_tree",
    "DEEP_TREE_LEVELS",
    "remove_tree",
    "crash_spec",
    "io_error_spec",
    "rewrite_record",
]


class Action:
    KILL = "kill"      # SIGKILL this process (a real, uncatchable death)
    EMIT = "emit"      # tell the parent; it SIGKILLs the target ranks from outside
    ENOSPC = "enospc"  # raise OSError(ENOSPC)
    EIO = "eio"        # raise OSError(EIO)
    HANG = "hang"      # block forever (a stuck NFS write, a deadlock)
    SIGINT = "sigint"  # a real SIGINT to this process (Ctrl-C; KeyboardInterrupt where Python's handler is set)
    SIGTERM = "sigterm"  # a real SIGTERM to this process (a preemption notice; trainers' handlers sys.exit)


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
    elif spec.action in (Action.SIGINT, Action.SIGTERM):
        # Delivered to this process; Python runs its handler on the main thread at the next bytecode.
        os.kill(os.getpid(), signal.SIGINT if spec.action == Action.SIGINT else signal.SIGTERM)
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

    def mkdir(self, path, *, parents=True):
        return self._around("mkdir", classify(path), path, lambda: super(FaultyIO, self).mkdir(path, parents=parents))

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
    orig: dict[str, Any] = {
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
    shutil.rmtree = wrap("rmtree", lambda p, *r: (str(classify(p)), str(p)), orig["rmtree"])  # type: ignore[assignment]
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


def _write(path: str, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)


def _pointer_step(step_dir: str) -> int:
    step = step_of(os.path.basename(step_dir))
    if step is None:
        raise ValueError(f"{step_dir} is not a step directory")
    return step


def _shard(step_dir: str, rank: int) -> str:
    names = sorted(n for n in os.listdir(step_dir) if n.endswith(SHARD_SUFFIXES))
    mine = [n for n in names if n.startswith(f"__{rank}_")]
    return os.path.join(step_dir, (mine or names)[0])


def _extra(step_dir: str, rank: int) -> str:
    return os.path.join(step_dir, EXTRA_STATE_DIR, extra_state_file_name(rank))


def _torn(root, step_dir, rank, rng):
    full = f"{_pointer_step(step_dir)}\n".encode()
    cut = rng.randrange(1, len(full) - 1) if len(full) > 2 else 0
    _write(os.path.join(root, POINTER_FILE), full[:cut])
    return f"pointer torn to {full[:cut]!r}"


def _empty(root, step_dir, rank, rng):
    _write(os.path.join(root, POINTER_FILE), b"")
    return "pointer emptied"


def _garbage(root, step_dir, rank, rng):
    data = bytes(rng.randrange(33, 127) for _ in range(rng.randrange(1, 24)))
    data = b"x" + data  # never a valid step number
    _write(os.path.join(root, POINTER_FILE), data)
    return f"pointer garbage {data!r}"


def _nul(root, step_dir, rank, rng):
    _write(os.path.join(root, POINTER_FILE), b"\x00" * rng.randrange(1, 8))
    return "pointer NUL bytes"


def _dangling(root, step_dir, rank, rng):
    missing = _pointer_step(step_dir) + 1000 + rng.randrange(1000)
    _write(os.path.join(root, POINTER_FILE), f"{missing}\n".encode())
    return f"pointer names missing step {missing}"


def _stale(root, step_dir, rank, rng):
    older = [s for s in step_numbers(root) if s < _pointer_step(step_dir)]
    _write(os.path.join(root, POINTER_FILE), f"{older[0] if older else 0}\n".encode())
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
    path = record_path(step_dir, rank)  # NoCommitRecord where the checkpointer writes none
    os.unlink(path)
    return f"deleted {os.path.basename(path)}"


def _missing_extra(root, step_dir, rank, rng):
    os.unlink(_extra(step_dir, rank))
    return f"deleted {extra_state_file_name(rank)}"


def _corrupt_extra(root, step_dir, rank, rng):
    p = _extra(step_dir, rank)
    size = os.path.getsize(p)
    _write(p, bytes(rng.randrange(256) for _ in range(size)))
    return f"overwrote {extra_state_file_name(rank)} with {size} random bytes"


class FaultNotApplicable(Exception):
    """This machine cannot inject the fault (``mknod`` not permitted, ...), or the checkpointer's
    layout has nothing it applies to: callers skip the check and say why, instead of passing or
    failing it."""


class NoCommitRecord(FaultNotApplicable, FileNotFoundError):
    """The step holds no commit record the harness recognises (``.metadata``, ``__R.metadata``):
    a checkpointer without one is not judged by the faults that damage a record."""


# -- the commit record ------------------------------------------------------------------------
#
# refckpt's commit record is self-verifying: the pickle, then a 56-byte footer (magic, the
# pickle's length as 8 bytes little-endian, the pickle's SHA-256). A record without that
# footer (an older refckpt, plain DCP, another checkpointer) is a bare pickle. The faults
# below work on both: what they change is the pickle; whether a checksum is kept, left stale
# or recomputed is the fault's choice.

def record_path(step_dir: str, rank: int = 0) -> str:
    """The commit record of ``step_dir``: ``.metadata``; without one, ``rank``'s own
    ``__R.metadata`` (DCP ``use_collectives=False``), else the lowest rank's."""
    top = os.path.join(step_dir, COMMIT_RECORD)
    if os.path.lexists(top):
        return top
    ranks = sorted(int(m.group(1)) for n in os.listdir(step_dir) if (m := RANK_RECORD_RE.fullmatch(n)))
    if not ranks:
        found = _parses_as_record(step_dir)
        if found is not None:
            return found
        raise NoCommitRecord(f"{step_dir}: no commit record ({COMMIT_RECORD} or __R{COMMIT_RECORD}): the "
                             f"checkpointer writes none, so the faults that damage one do not apply")
    return os.path.join(step_dir, rank_record_name(rank if rank in ranks else ranks[0]))


#: files larger than this are not tried as a record by name-less discovery (records are small)
RECORD_PROBE_MAX = 16 << 20


def _parses_as_record(step_dir: str) -> str | None:
    """A file of ``step_dir`` (its top level, by name) that parses as a commit record (DCP
    ``Metadata``, with or without refckpt's footer), whatever it is called: a checkpointer that
    keeps its record under another name is still given the record faults. Parsed with the
    restricted unpickler (no code runs); None when no file parses."""
    for name in sorted(os.listdir(step_dir)):
        path = os.path.join(step_dir, name)
        try:
            if os.path.islink(path) or not os.path.isfile(path) or os.path.getsize(path) > RECORD_PROBE_MAX:
                continue
            _read_record(path)
        except Exception:  # noqa: BLE001 - not a record
            continue
        return path
    return None


def split_record(data: bytes) -> tuple[bytes, bytes | None]:
    """``(pickle, footer)`` when ``data`` ends with a footer whose magic and length fit, else
    ``(data, None)``. The footer's checksum is not checked here (a stale one still splits)."""
    if len(data) >= RECORD_FOOTER_SIZE:
        tail = data[-RECORD_FOOTER_SIZE:]
        n = len(data) - RECORD_FOOTER_SIZE
        if tail[:len(RECORD_MAGIC)] == RECORD_MAGIC and struct.unpack_from("<Q", tail, len(RECORD_MAGIC))[0] == n:
            return data[:n], tail
    return data, None


def record_footer(body: bytes) -> bytes:
    """The footer refckpt writes after a record's pickle ``body``."""
    return encode_record(body)[len(body):]


def read_record(path: str) -> tuple[Any, bytes | None]:
    """``(Metadata, footer or None)`` of a commit record the harness saved itself."""
    md, footer, _rest = _read_record(path)
    return md, footer


def _read_record(path: str) -> tuple[Any, bytes | None, bytes]:
    """``(Metadata, refckpt footer or None, bytes after the pickle that are not a refckpt footer)``:
    a checkpointer with a record format of its own (a checksum trailer the harness cannot
    recompute) leaves the last non-empty."""
    with open(path, "rb") as f:
        body, footer = split_record(f.read())
    bio = io.BytesIO(body)
    md = MetadataUnpickler(bio, path).load()  # only DCP's metadata classes, as refckpt reads records
    return md, footer, body[bio.tell():]


#: Fields :func:`mutate_record` changes. ``chunk_offsets`` and ``storage_length`` leave a record
#: that structural validation can reject (chunks that do not tile their tensor, a length past
#: the end of its file); ``optimizer_key`` (two optimizer entries' storage swapped) is
#: structurally perfect: only a checksum over the record catches it.
RECORD_FIELDS = ("chunk_offsets", "storage_length", "optimizer_key")
STRUCTURAL_RECORD_FIELDS = ("chunk_offsets", "storage_length")


def _storage(md: Any) -> dict:
    return md.storage_data if isinstance(md.storage_data, dict) else {}


def mutate_record(md: Any, field: str, step_dir: str, rng: random.Random) -> str:
    """Change one ``field`` of the commit record ``md`` in place (see :data:`RECORD_FIELDS`),
    keeping it a well-formed DCP ``Metadata``; returns what was changed."""
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, TensorStorageMetadata

    storage = _storage(md)
    if field == "chunk_offsets":
        cands = sorted(k for k, v in md.state_dict_metadata.items()
                       if isinstance(v, TensorStorageMetadata) and len(v.size) >= 1 and v.size[0] >= 1 and v.chunks)
        if not cands:
            raise FaultNotApplicable("the commit record holds no tensor with a dimension to shift a chunk along")
        fqn = cands[rng.randrange(len(cands))]
        tmd = md.state_dict_metadata[fqn]
        j = rng.randrange(len(tmd.chunks))
        old = tmd.chunks[j]
        shift = 1 + rng.randrange(max(1, int(tmd.size[0])))
        new_off = type(old.offsets)([int(old.offsets[0]) + shift, *(int(o) for o in old.offsets[1:])])
        tmd.chunks[j] = ChunkStorageMetadata(offsets=new_off, sizes=old.sizes)
        for key in [k for k in storage if getattr(k, "fqn", None) == fqn and tuple(k.offset or ()) == tuple(old.offsets)]:
            storage[dataclasses.replace(key, offset=new_off)] = storage.pop(key)
        return (f"shifted chunk {j} of {fqn} (size {list(tmd.size)}) from offsets {list(old.offsets)} to "
                f"{list(new_off)}: the chunks no longer tile the tensor")
    if field == "storage_length":
        keys = sorted(storage, key=lambda k: (storage[k].relative_path, storage[k].offset, k.fqn))
        if not keys:
            raise FaultNotApplicable("the commit record lists no storage entries")
        key = keys[rng.randrange(len(keys))]
        info = storage[key]
        try:
            size = os.stat(os.path.join(step_dir, info.relative_path)).st_size
        except OSError:
            size = int(info.offset) + int(info.length)
        new_len = size - int(info.offset) + 1 + rng.randrange(64)
        storage[key] = dataclasses.replace(info, length=new_len)
        return (f"length of {key.fqn} in {info.relative_path} {info.length} -> {new_len}: runs past the end of "
                f"the {size}-byte file")
    if field == "optimizer_key":
        by_param: dict[tuple, list] = {}
        for k in storage:
            fqn = getattr(k, "fqn", "")
            tmd = md.state_dict_metadata.get(fqn)
            if fqn.startswith("optimizer.state.") and isinstance(tmd, TensorStorageMetadata):
                by_param.setdefault((fqn.rsplit(".", 1)[0], tuple(tmd.size), str(tmd.properties.dtype)), []).append(k)
        pairs = sorted((sorted(v, key=lambda k: k.fqn) for v in by_param.values() if len(v) >= 2), key=lambda v: v[0].fqn)
        if not pairs:
            raise FaultNotApplicable("the commit record has no two optimizer entries of one parameter and shape to swap")
        group = pairs[rng.randrange(len(pairs))]
        a, b = rng.sample(group, 2)
        storage[a], storage[b] = storage[b], storage[a]
        return f"swapped where {a.fqn} and {b.fqn} are stored: a well-formed record that restores the wrong moments"
    raise ValueError(f"unknown record field {field!r}; choose from {RECORD_FIELDS}")


def rewrite_record(step_dir: str, rank: int, rng: random.Random, field: str | None, *, forge: bool) -> str:
    """Re-pickle the commit record with ``field`` changed (``None``: unchanged, a control).

    ``forge=False`` keeps the old footer (its checksum, and maybe its length, now stale);
    ``forge=True`` appends a footer recomputed over the new pickle. A record that had no
    footer gets none either way."""
    path = record_path(step_dir, rank)
    try:
        md, footer, rest = _read_record(path)
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, IndexError) as e:
        raise FaultNotApplicable(f"{os.path.basename(path)} is not a DCP pickle the harness can rewrite "
                                 f"({type(e).__name__}: {e})") from e
    if not hasattr(md, "state_dict_metadata"):
        raise FaultNotApplicable(f"{os.path.basename(path)} holds {type(md).__name__}, not DCP Metadata")
    if rest and field is None:
        raise FaultNotApplicable(f"{os.path.basename(path)} ends with {len(rest)} bytes of the checkpointer's own "
                                 f"format after the pickle (a checksum the harness cannot recompute): no unchanged "
                                 f"rewrite is possible, so there is no control to run")
    what = "unchanged" if field is None else mutate_record(md, field, step_dir, rng)
    body = pickle.dumps(md, protocol=pickle.DEFAULT_PROTOCOL)
    tail = b"" if footer is None else (record_footer(body) if forge else footer)
    _write(path, body + tail)
    how = ("the checkpointer's own trailer dropped" if rest else "no checksum footer") if footer is None \
        else ("checksum recomputed" if forge else "checksum left stale")
    return f"{os.path.basename(path)}: {what} ({how})"


def _bitflip_record(root, step_dir, rank, rng):
    p = record_path(step_dir, rank)
    with open(p, "r+b") as f:
        data = f.read()
        pos, bit = rng.randrange(len(data)), rng.randrange(8)
        f.seek(pos)
        f.write(bytes([data[pos] ^ (1 << bit)]))
    return f"flipped bit {bit} of byte {pos} of {os.path.basename(p)} ({len(data)} bytes)"


def _truncated_record(root, step_dir, rank, rng):
    p = record_path(step_dir, rank)
    size = os.path.getsize(p)
    new = rng.randrange(1, size)
    os.truncate(p, new)
    return f"truncated {os.path.basename(p)} {size} -> {new}"


def _rewrite_some_field(step_dir: str, rank: int, rng: random.Random, fields: tuple[str, ...], *, forge: bool) -> str:
    """Change one of ``fields`` of the record, drawn at random among those the record has: an
    SGD-momentum record has no two optimizer entries of one parameter to swap, but its chunks can
    still be shifted. Raises :class:`FaultNotApplicable` only when no field applies."""
    order = list(fields)
    rng.shuffle(order)
    for field in order[:-1]:
        try:
            return rewrite_record(step_dir, rank, rng, field, forge=forge)
        except FaultNotApplicable:
            continue
    return rewrite_record(step_dir, rank, rng, order[-1], forge=forge)


def _corrupt_record_field(root, step_dir, rank, rng):
    return _rewrite_some_field(step_dir, rank, rng, RECORD_FIELDS, forge=False)


def _forged_record_field(root, step_dir, rank, rng):
    return _rewrite_some_field(step_dir, rank, rng, STRUCTURAL_RECORD_FIELDS, forge=True)


def _payload_files(step_dir: str) -> list[str]:
    """Regular files of a step other than its commit records (shards, extra state), sorted:
    the files a record lists. Two levels deep at most (the contract's layout), no walk."""
    out: list[str] = []
    for name in sorted(os.listdir(step_dir)):
        p = os.path.join(step_dir, name)
        if is_commit_record(name) or name.endswith(TMP_SUFFIX):
            continue
        if os.path.isdir(p) and not os.path.islink(p):
            out.extend(os.path.join(p, n) for n in sorted(os.listdir(p)) if os.path.isfile(os.path.join(p, n)))
        elif os.path.isfile(p):
            out.append(p)
    return out


def _pick_payload(step_dir: str, rank: int, rng: random.Random) -> str:
    files = _payload_files(step_dir)
    if not files:
        raise FaultNotApplicable(f"{step_dir}: no payload file to replace")
    return files[rng.randrange(len(files))]


def _fifo_in_step(root, step_dir, rank, rng):
    p = _pick_payload(step_dir, rank, rng)
    os.unlink(p)
    os.mkfifo(p, 0o600)
    return f"replaced {os.path.relpath(p, step_dir)} with a FIFO"


def _device_in_step(root, step_dir, rank, rng):
    p = _pick_payload(step_dir, rank, rng)
    tmp = p + ".faults-node"
    try:
        os.mknod(tmp, stat.S_IFCHR | 0o600, os.makedev(1, 3))
    except (PermissionError, OSError) as e:
        if isinstance(e, PermissionError) or e.errno in (errno.EPERM, errno.EACCES, errno.EROFS):
            raise FaultNotApplicable(f"cannot create a character device node here ({e}): mknod needs root or "
                                     f"CAP_MKNOD (an unprivileged user or container cannot)") from e
        raise
    os.replace(tmp, p)
    return f"replaced {os.path.relpath(p, step_dir)} with a character device (1, 3: /dev/null's numbers)"


#: Depth of :func:`make_deep_tree`'s tree: beyond CPython's default recursion limit (1,000)
#: with room to spare, so anything that recurses per level fails on it.
DEEP_TREE_LEVELS = 1200
_DIR_FLAGS = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)


def make_deep_tree(parent: str, levels: int = DEEP_TREE_LEVELS, name: str = "d") -> str:
    """Create ``parent/name/name/...`` ``levels`` deep without recursion, each level made and
    entered through a directory fd (``mkdir``/``open`` with ``dir_fd``), so no path the harness
    uses grows with the depth. Returns the top of the tree."""
    top = os.path.join(parent, name)
    fd = os.open(parent, _DIR_FLAGS)
    try:
        for _ in range(levels):
            os.mkdir(name, 0o755, dir_fd=fd)
            nfd = os.open(name, _DIR_FLAGS, dir_fd=fd)
            os.close(fd)
            fd = nfd
        with open(os.open("leaf", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644, dir_fd=fd), "wb") as f:
            f.write(b"deep\n")
    finally:
        os.close(fd)
    return top


def remove_tree(path: str) -> None:
    """Remove ``path`` and everything under it, at any depth, without recursion (what
    ``shutil.rmtree`` cannot do for :func:`make_deep_tree`'s tree on Python < 3.12): refckpt's
    own iterative remover. Symlinks are removed, never followed. A missing ``path`` is fine."""
    from refckpt.durable import remove_tree as remove_dir

    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISDIR(st.st_mode):
        remove_dir(path)
    else:
        os.unlink(path)


def _deep_tree(root, step_dir, rank, rng):
    top = make_deep_tree(step_dir)
    return f"made a {DEEP_TREE_LEVELS}-level directory tree {os.path.relpath(top, root)}/d/... in the step"


#: kind -> fault. Pointer faults leave the newest step the answer; payload and record faults,
#: and FIFOs or devices in a step, make it fall back; a deep tree is damage the record does not
#: list (the newest step stays the answer; what breaks is deleting it, which the matrix checks).
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
    FaultKind.BITFLIP_RECORD: DiskFault(FaultKind.BITFLIP_RECORD, _bitflip_record, True),
    FaultKind.TRUNCATED_RECORD: DiskFault(FaultKind.TRUNCATED_RECORD, _truncated_record, True),
    FaultKind.CORRUPT_RECORD_FIELD: DiskFault(FaultKind.CORRUPT_RECORD_FIELD, _corrupt_record_field, True),
    FaultKind.FORGED_RECORD_FIELD: DiskFault(FaultKind.FORGED_RECORD_FIELD, _forged_record_field, True),
    FaultKind.FIFO_IN_STEP: DiskFault(FaultKind.FIFO_IN_STEP, _fifo_in_step, True),
    FaultKind.DEVICE_IN_STEP: DiskFault(FaultKind.DEVICE_IN_STEP, _device_in_step, True),
    # Damage the record does not list: resume still lands on the step; the check is that
    # retention can delete it and the saves after it work (faults.matrix runs them).
    FaultKind.DEEP_TREE: DiskFault(FaultKind.DEEP_TREE, _deep_tree, False),
}
