"""The commit record: encoded self-verifying, parsed within bounds, checked for structure before use.

A step's commit record (``.metadata``) is DCP's pickled ``Metadata`` with refckpt's manifest
as an extra attribute: a plain dict on disk, parsed once into a :class:`Manifest` of
:class:`FileRecord` entries (every file of the step with its size and checksummed blocks) that
every reader and writer of the record uses. Everything resume does is driven by it -- which bytes of which file
hold which chunk of which tensor -- so a record that is damaged but still parses would
load a silently different state (a weight left at its fresh-init values when a chunk's
offsets change, Adam's moments left at zero when an optimizer key changes). Three layers
stop that, in this order, before anything in the record is used:

1. **Its own checksum.** :func:`encode_record` appends a fixed 56-byte footer to the pickle:
   ``RECORD_MAGIC`` (16 bytes), the pickle's length (8 bytes, little-endian) and its SHA-256
   (32 bytes). :func:`split_record` checks the footer before parsing a byte. Plain
   ``pickle.load`` (what DCP's own reader does) stops at the pickle's STOP opcode and ignores
   the footer, so DCP tooling still reads the record. A record without the footer is either
   written before refckpt added it (manifest format ``refckpt/1``, or plain DCP): it loads
   and ``ls``/``verify`` say it carries no record checksum -- or it is a ``refckpt/2`` record
   whose footer was damaged: corrupt.
2. **Bounded parsing.** :func:`scan_pickle` walks the opcodes (``pickletools.genops``, which
   builds no objects) and refuses memo indices beyond the opcode count (CPython's unpickler
   sizes its memo array from the index: one flipped bit asked for 9 GB), declared lengths
   past the end of the data, more opcodes than bytes, and trailing bytes after STOP. The
   file itself is read only if it is a regular file no larger than :data:`MAX_RECORD_BYTES`.
   Objects the unpickler then builds are bounded by the opcode count, so by the file size.
3. **Structure.** :func:`validate_record` checks what the record says against itself, the
   manifest and the files' sizes: every tensor's chunks tile its shape exactly (no gap, no
   overlap, nothing out of bounds), every chunk and byte item has a storage entry naming a
   file of the step whose recorded size holds ``offset + length``, each chunk's length is
   what its shape and dtype need, the manifest's checksummed blocks tile every file
   (:meth:`Manifest.from_dict`, :meth:`Manifest.sizes`), and the manifest's tensor summary
   agrees with the record's dtypes and shapes. So no allocation sized from a record field can
   exceed the files' real sizes.

A violation is :class:`~refckpt.errors.CorruptCheckpointError`: the step is not complete,
and resume falls back to the previous one. A record that passes all three is trusted, so
a tensor whose shape then differs from the caller's is the caller's model
(:class:`~refckpt.errors.ShapeMismatchError`, no fallback).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import hashlib
import io
import os
import pickletools
import reprlib
import stat
import struct
from collections.abc import Callable, Iterator
from typing import Any, Generic, TypeGuard, TypeVar

import torch

from .errors import CorruptCheckpointError, UnsafeCheckpointError

__all__ = [
    "RECORD_MAGIC",
    "RECORD_FOOTER_LEN",
    "RECORD_CHECKSUM",
    "MAX_RECORD_BYTES",
    "encode_record",
    "split_record",
    "scan_pickle",
    "read_record_bytes",
    "validate_record",
    "MANIFEST_ATTR",
    "MANIFEST_FORMAT",
    "FileRecord",
    "Manifest",
    "collector_paused",
]

RECORD_MAGIC = b"REFCKPT-RECORD\x00\x01"
RECORD_FOOTER_LEN = len(RECORD_MAGIC) + 8 + 32
#: Name of the record checksum, as ``ls``, ``verify`` and ``inspect`` report it.
RECORD_CHECKSUM = "sha256"
#: Largest commit record read (bytes). A model with a million tensors records well under this.
MAX_RECORD_BYTES = int(os.environ.get("REFCKPT_MAX_RECORD_BYTES", 1 << 30))

_MEMO_PUTS = {"PUT", "BINPUT", "LONG_BINPUT"}
_MEMO_GETS = {"GET", "BINGET", "LONG_BINGET"}


def encode_record(pickled: bytes) -> bytes:
    """``pickled`` followed by its footer (magic, length, SHA-256)."""
    return pickled + RECORD_MAGIC + struct.pack("<Q", len(pickled)) + hashlib.sha256(pickled).digest()


def split_record(data: bytes, source: str) -> tuple[bytes, str | None]:
    """(pickle bytes, ``"sha256"``) for a record with a valid footer, ``(data, None)`` for one
    without a footer; a footer that does not match its bytes raises :class:`CorruptCheckpointError`."""
    if len(data) < RECORD_FOOTER_LEN or data[-RECORD_FOOTER_LEN:-40] != RECORD_MAGIC:
        return data, None
    body, footer = data[:-RECORD_FOOTER_LEN], data[-40:]
    (length,) = struct.unpack("<Q", footer[:8])
    if length != len(body) or hashlib.sha256(body).digest() != footer[8:]:
        raise CorruptCheckpointError(
            f"{source}: the commit record fails its own checksum ({RECORD_CHECKSUM} over {len(body)} bytes); "
            f"it was damaged after it was written. This step is not used; resume falls back to the previous "
            f"complete step (load_latest does so by itself). Delete this step directory or restore it from a copy."
        )
    return body, RECORD_CHECKSUM


_FIXED, _LINE, _TWO_LINES, _LEN1, _LEN4, _LEN4U, _LEN8U = range(7)


def _opcode_table() -> list:
    """opcode byte -> (name, how its argument is laid out, fixed size), from pickletools' own table."""
    how = {pickletools.UP_TO_NEWLINE: _LINE, pickletools.TAKEN_FROM_ARGUMENT1: _LEN1,
           pickletools.TAKEN_FROM_ARGUMENT4: _LEN4, pickletools.TAKEN_FROM_ARGUMENT4U: _LEN4U,
           pickletools.TAKEN_FROM_ARGUMENT8U: _LEN8U}
    table: list = [None] * 256
    for op in pickletools.opcodes:
        n = op.arg.n if op.arg is not None else 0
        kind = _FIXED if n >= 0 else how[n]
        if kind == _LINE and op.name in ("GLOBAL", "INST"):  # module and name: two lines
            kind = _TWO_LINES
        table[ord(op.code)] = (op.name, kind, max(n, 0))
    return table


_OPCODES = _opcode_table()
_LEN_SIZE = {_LEN1: 1, _LEN4: 4, _LEN4U: 4, _LEN8U: 8}


def scan_pickle(data: bytes, source: str) -> None:
    """Refuse a pickle whose parsing could allocate more than a small multiple of its size.

    Steps over the opcodes without building objects (a loop over pickletools' opcode table,
    five times faster than ``pickletools.genops``): memo indices must stay below the number of
    opcodes seen (CPython grows its memo array to the index), every declared length and frame
    must fit in the data (CPython allocates the buffer before reading it), every opcode must
    be known, and nothing may follow STOP."""
    n = len(data)
    i = ops = 0

    def bad(what: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(
            f"{source}: cannot parse the commit record ({what} at byte {i}); the step is not a usable "
            f"checkpoint (parsing it could allocate without bound). Resume from an older step or delete it.")

    while i < n:
        info = _OPCODES[data[i]]
        if info is None:
            raise bad(f"unknown opcode {data[i]:#04x}")
        name, kind, size = info
        i += 1
        ops += 1
        arg_at = i
        if kind == _FIXED:
            i += size
        elif kind == _LINE or kind == _TWO_LINES:
            for _ in range(1 if kind == _LINE else 2):
                j = data.find(b"\n", i)
                if j < 0:
                    raise bad(f"{name} without its newline")
                i = j + 1
        else:
            width = _LEN_SIZE[kind]
            if i + width > n:
                raise bad(f"{name} cut short")
            length = int.from_bytes(data[i:i + width], "little", signed=kind == _LEN4)
            if length < 0 or length > n - i - width:
                raise bad(f"{name} declares {length} bytes, {n - i - width} remain")
            i += width + length
        if i > n:
            raise bad(f"{name} cut short")
        if name in _MEMO_PUTS or name in _MEMO_GETS:
            raw = data[arg_at:i]
            try:
                idx = int(raw) if kind == _LINE else int.from_bytes(raw, "little")
            except ValueError:
                raise bad(f"{name} with index {raw[:40]!r}") from None
            if idx < 0 or idx > ops:
                raise bad(f"{name} of memo slot {idx} after {ops} opcodes")
        elif name == "FRAME" and int.from_bytes(data[arg_at:i], "little") > n - i:
            raise bad("a frame longer than the data")
        elif name == "STOP":
            if i != n:
                raise bad(f"{n - i} bytes after the end")
            return
    raise bad("no STOP opcode")


class _Seen:
    """A small LRU set of records already scanned (and validated): the scan is the costly part
    of reading a record (pure Python, ~0.15 s per MB), and resume reads the same record up to
    three times (listing, load, DCP's own read_metadata). A key is the record file's identity
    (device, inode, size, mtime_ns, ctime_ns) -- any rewrite changes ctime, which no user can
    set back -- plus, for validation, the sizes it was checked against."""

    def __init__(self, size: int = 64) -> None:
        import collections
        import threading

        self._keys: collections.OrderedDict[Any, None] = collections.OrderedDict()
        self._size = size
        self._lock = threading.Lock()

    def __contains__(self, key: Any) -> bool:
        with self._lock:
            if key in self._keys:
                self._keys.move_to_end(key)
                return True
            return False

    def add(self, key: Any) -> None:
        with self._lock:
            self._keys[key] = None
            while len(self._keys) > self._size:
                self._keys.popitem(last=False)


SCANNED = _Seen()
VALIDATED = _Seen()


def record_identity(st: os.stat_result) -> tuple:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def read_record_bytes(path: str, limit: int | None = None, identity: list | None = None) -> bytes:
    """The whole of a commit record file: regular files only (a FIFO or device never blocks),
    at most ``limit`` (default :data:`MAX_RECORD_BYTES`) bytes. ``identity``, if a list, gets
    the file's :func:`record_identity` appended (taken from the descriptor that was read)."""
    limit = MAX_RECORD_BYTES if limit is None else limit
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
    fd = os.open(path, flags)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise CorruptCheckpointError(
                f"{path}: the commit record is not a regular file; a checkpoint holds only regular files. "
                f"Remove this step directory.")
        if st.st_size > limit:
            raise CorruptCheckpointError(
                f"{path}: the commit record is {st.st_size} bytes, more than the {limit} refckpt reads "
                f"(REFCKPT_MAX_RECORD_BYTES); it is corrupt or not a commit record.")
        chunks, got = [], 0
        while got <= st.st_size:  # one read past the size: a file that grew is refused too
            b = os.read(fd, min(st.st_size - got + 1, 64 << 20) or 1)
            if not b:
                break
            chunks.append(b)
            got += len(b)
        if got != st.st_size:
            raise CorruptCheckpointError(f"{path}: commit record changed size while being read ({st.st_size} -> {got}).")
        after = os.fstat(fd)
        if identity is not None and record_identity(after) == record_identity(st):
            identity.append(record_identity(st))
        return b"".join(chunks)
    finally:
        os.close(fd)


# -- structure ----------------------------------------------------------------------------------
def _r(v: Any) -> str:
    """``repr`` bounded in depth and length: a crafted record may nest a value 100,000 deep."""
    return reprlib.repr(v)


def _bad(source: str, what: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(
        f"{source}: {what}. The commit record is inconsistent (damaged or crafted); this step is not "
        f"used and resume falls back to the previous complete step. Delete it or restore it from a copy.")


def _is_int(v: Any) -> TypeGuard[int]:
    return isinstance(v, int) and not isinstance(v, bool)


def _dims(v: Any, source: str, what: str) -> tuple[int, ...]:
    if not isinstance(v, (torch.Size, tuple, list)) or not all(_is_int(x) and x >= 0 for x in v):
        raise _bad(source, f"{what} is {_r(v)}, not a list of non-negative integers")
    return tuple(v)


def _volume(dims: tuple[int, ...]) -> int:
    n = 1
    for d in dims:
        n *= d
    return n


def _check_tiling(fqn: str, size: tuple[int, ...], boxes: list, whole: bool, source: str,
                  bad: Callable[[str, str], Exception] = _bad) -> None:
    """Chunks inside ``size``, pairwise disjoint, and (``whole``) covering it: an exact tiling.

    In time linear in the number of chunks, whatever a crafted record holds: the distinct chunk
    boundaries of every dimension cut the tensor into a grid of cells. Sharding (DTensor on any
    mesh, FSDP, TP) makes chunks that are unions of cells, and about as many cells as chunks; more
    than ``16 x chunks + 64`` cells is refused. Otherwise each chunk marks its cells: a cell marked
    twice is an overlap, and (``whole``) the chunks' volumes must add up to the tensor's.

    ``bad(source, what)`` makes the error (default: a corrupt record). The save planner
    (:class:`refckpt.planner.RefSavePlanner`) runs the same check on DCP's global save plan, so a
    save refuses exactly the chunk tables a load would."""
    for off, sz in boxes:
        if len(off) != len(size) or len(sz) != len(size):
            raise bad(source, f"{fqn}: a chunk has {len(off)}-d offsets and {len(sz)}-d sizes for a {len(size)}-d tensor")
        if any(o < 0 for o in off) or any(s < 0 for s in sz):
            raise bad(source, f"{fqn}: chunk at {list(off)} of size {list(sz)} has a negative offset or size")
        if any(o + s > d for o, s, d in zip(off, sz, size)):
            raise bad(source, f"{fqn}: chunk at {list(off)} of size {list(sz)} reaches outside shape {list(size)}")
    live = [b for b in boxes if _volume(b[1])]
    if not size:
        if len(live) > 1:
            raise bad(source, f"{fqn}: {len(live)} chunks of one scalar")
    elif len(live) > 1:
        cuts = [sorted({o for b in live for o in (b[0][k], b[0][k] + b[1][k])}) for k in range(len(size))]
        index = [{c: n for n, c in enumerate(dim_cuts)} for dim_cuts in cuts]
        shape = [len(c) - 1 for c in cuts]
        cells = _volume(tuple(shape))
        if cells > 16 * len(live) + 64:
            raise bad(source, f"{fqn}: {len(live)} chunks cut it into {cells} cells; no sharding does that")
        strides = [_volume(tuple(shape[k + 1:])) for k in range(len(shape))]
        marked = bytearray(cells)
        for off, sz in live:
            flat = [0]
            for k in range(len(size)):
                flat = [f + i * strides[k] for f in flat for i in range(index[k][off[k]], index[k][off[k] + sz[k]])]
            for f in flat:
                if marked[f]:
                    raise bad(source, f"{fqn}: the chunk at {list(off)} overlaps another chunk")
                marked[f] = 1
    if whole and sum(_volume(b[1]) for b in live) != _volume(size):
        raise bad(source, f"{fqn}: its chunks cover {sum(_volume(b[1]) for b in live)} of its "
                           f"{_volume(size)} elements; a part of the tensor has no saved bytes")


# -- the manifest -------------------------------------------------------------------------------
#: Attribute of DCP's ``Metadata`` that carries refckpt's manifest (file sizes and checksums).
#: Plain DCP ignores unknown attributes, so the commit record stays readable by DCP.
MANIFEST_ATTR = "refckpt_manifest"
#: refckpt/2: the record ends with a footer holding its own SHA-256, and the manifest lists every
#: tensor's dtype and shape. refckpt/1 records (no footer) still load.
MANIFEST_FORMAT = "refckpt/2"


@dataclasses.dataclass(frozen=True)
class FileRecord:
    """One file of a step as the manifest records it: its size and the checksummed blocks that tile
    it, ``((offset, length, checksum), ...)`` (the algorithm is the manifest's ``checksum``). Also
    what a rank sends the coordinator about each file it wrote (in a DCP ``WriteResult``).
    On disk: ``{"size": size, "chunks": [[offset, length, checksum], ...]}``."""

    relative_path: str
    size: int
    chunks: tuple[tuple[int, int, int], ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {"size": self.size, "chunks": [list(c) for c in self.chunks]}


_T = TypeVar("_T")


class _InfoField(Generic[_T]):
    """A typed read of one field of :attr:`Manifest.info`: its value if it has the type, else None."""

    def __init__(self, kind: type[_T]) -> None:
        self.kind = kind
        self.name = ""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, obj: Manifest | None, owner: type | None = None) -> _T | None:
        v = obj.info.get(self.name) if obj is not None else None
        return v if isinstance(v, self.kind) else None


@dataclasses.dataclass(frozen=True)
class Manifest:
    """refckpt's manifest: the attribute :data:`MANIFEST_ATTR` of the DCP
    ``Metadata`` in a commit record, parsed once (:meth:`of`) into typed fields.

    ``info`` holds the save's own fields in the order the writer gave them (``world_size``,
    ``global_step``, ``extra_state``, ``writer``); the properties read them, ``None`` where a
    field is absent or of the wrong type. :meth:`to_dict` is the on-disk encoding."""

    files: dict[str, FileRecord]
    #: checksum algorithm of every block (a name of :func:`refckpt.storage.checksum_fn`); None: sizes only.
    checksum: str | None = None
    #: ``"refckpt/2"``; ``"refckpt"`` for a record that names none.
    format: str = MANIFEST_FORMAT
    #: the algorithm of the record's own footer (``"sha256"``), as the writer declared it.
    record_checksum: Any = RECORD_CHECKSUM
    #: ``{fqn: [dtype, shape]}`` of every tensor (:func:`tensor_summary`); checked by :func:`validate_record`.
    tensors: Any = None
    info: dict[str, Any] = dataclasses.field(default_factory=dict)

    _CORE = ("format", "checksum", "files", "record_checksum", "tensors")

    @staticmethod
    def is_manifest(raw: Any) -> bool:
        """Whether ``raw`` has a manifest's shape at all (a dict with a file table)."""
        return isinstance(raw, dict) and isinstance(raw.get("files"), dict)

    @staticmethod
    def declares_footer(md: Any) -> bool:
        """Whether the manifest of ``md`` says its record was written with a checksum footer
        (read before anything else is checked: a record that lost its footer is corrupt)."""
        raw = getattr(md, MANIFEST_ATTR, None)
        return isinstance(raw, dict) and bool(raw.get("record_checksum"))

    @classmethod
    def of(cls, md: Any, source: str) -> Manifest | None:
        """The manifest of the DCP ``Metadata`` ``md``; None for a record refckpt did not write."""
        raw = getattr(md, MANIFEST_ATTR, None)
        return None if raw is None else cls.from_dict(raw, source)

    @classmethod
    def from_dict(cls, raw: Any, source: str) -> Manifest:
        """Parse the on-disk manifest. Every file entry must be well formed and its checksummed
        blocks must follow each other from byte 0 (:meth:`sizes` checks that they cover the file);
        otherwise :class:`~refckpt.errors.CorruptCheckpointError` names the entry."""
        if not cls.is_manifest(raw):
            raise _bad(source, "the manifest is malformed (no file table)")
        files: dict[str, FileRecord] = {}
        for rel, rec in raw["files"].items():
            if not isinstance(rel, str) or not isinstance(rec, dict) or not _is_int(rec.get("size")) or rec["size"] < 0:
                raise _bad(source, f"manifest entry {_r(rel)} is malformed")
            chunks = rec.get("chunks", [])
            if not isinstance(chunks, (list, tuple)):
                raise _bad(source, f"manifest entry {_r(rel)} has malformed checksum blocks")
            pos = 0
            for c in chunks:
                if (not isinstance(c, (list, tuple)) or len(c) != 3 or not all(_is_int(x) for x in c)
                        or c[0] != pos or c[1] < 0):
                    raise _bad(source, f"{rel}: checksum blocks do not tile the file (at byte {pos}: {_r(c)})")
                pos += c[1]
            files[rel] = FileRecord(rel, rec["size"], tuple((c[0], c[1], c[2]) for c in chunks))
        return cls(files=files, checksum=raw.get("checksum") or None, format=str(raw.get("format", "refckpt")),
                   record_checksum=raw.get("record_checksum"), tensors=raw.get("tensors"),
                   info={k: v for k, v in raw.items() if k not in cls._CORE})

    def to_dict(self) -> dict[str, Any]:
        """The on-disk encoding (key order and types as refckpt has always written them)."""
        return {"format": self.format, "checksum": self.checksum,
                "files": {rel: rec.to_dict() for rel, rec in self.files.items()},
                "record_checksum": self.record_checksum, "tensors": self.tensors, **self.info}

    def attach(self, md: Any) -> None:
        """Put this manifest into the DCP ``Metadata`` ``md`` (plain DCP ignores the attribute)."""
        setattr(md, MANIFEST_ATTR, self.to_dict())

    def sizes(self, source: str) -> dict[str, int]:
        """Expected size of every file the step holds, after checking that checksummed blocks
        cover each file they describe."""
        for rel, rec in self.files.items():
            covered = sum(c[1] for c in rec.chunks)
            if self.checksum and rec.chunks and covered != rec.size:
                raise _bad(source, f"{rel}: checksum blocks cover {covered} of its {rec.size} bytes")
        return {rel: rec.size for rel, rec in self.files.items()}

    def block_checksums(self) -> dict[tuple[str, int], tuple[int, int]]:
        """``{(file, offset): (length, checksum)}`` of every recorded block (empty without checksums):
        what a reader verifies each item it reads against."""
        if not self.checksum:
            return {}
        return {(rel, off): (length, crc) for rel, rec in self.files.items() for off, length, crc in rec.chunks}

    #: the world size of the save; the step it saved; where it keeps its extra state
    #: (``"per_rank"``, ``"embedded"``; None: it holds none); the token of the save that wrote the
    #: record (:class:`refckpt.commit.StagedStep`). Each None where absent or of the wrong type.
    world_size = _InfoField(int)
    global_step = _InfoField(int)
    extra_state = _InfoField(str)
    writer = _InfoField(str)


def validate_record(md: Any, manifest: Manifest | None, sizes: dict[str, int], source: str, *, whole: bool) -> None:
    """Check the structure of a parsed commit record (see the module docstring).

    ``sizes``: the size of every file the step holds that storage entries may name (the
    manifest's, already compared with the disk, or the real sizes for a plain-DCP step).
    ``whole``: the record covers every rank (``.metadata``), so chunks must cover each tensor;
    a per-rank ``__R.metadata`` covers its own rank's chunks only."""
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        ChunkStorageMetadata,
        MetadataIndex,
        StorageMeta,
        TensorStorageMetadata,
    )

    if not isinstance(getattr(md, "storage_meta", None), (StorageMeta, type(None))):
        raise _bad(source, f"the record's storage_meta is {type(md.storage_meta).__name__}, not StorageMeta")
    if not isinstance(getattr(md, "version", None), (str, type(None))):
        raise _bad(source, "the record's version is not a string")
    sdm = getattr(md, "state_dict_metadata", None)
    storage = getattr(md, "storage_data", None)
    if not isinstance(sdm, dict):
        raise _bad(source, "the record has no state table")
    if storage is None:
        storage = {}
    if not isinstance(storage, dict):
        raise _bad(source, "the record's storage table is malformed")
    planner_data = getattr(md, "planner_data", None)
    if planner_data is not None:
        if not isinstance(planner_data, dict) or not all(
                isinstance(k, str) and isinstance(v, (tuple, list)) and v and all(isinstance(p, (str, int)) for p in v)
                for k, v in planner_data.items()):
            raise _bad(source, "the record's key paths (planner_data) are malformed")
    where: dict[tuple[str, tuple | None], Any] = {}
    for idx, info in storage.items():
        if not isinstance(idx, MetadataIndex) or not isinstance(idx.fqn, str):
            raise _bad(source, f"storage key {_r(idx)} is malformed")
        rel = getattr(info, "relative_path", None)
        off, length = getattr(info, "offset", None), getattr(info, "length", None)
        if not isinstance(rel, str) or not _is_int(off) or not _is_int(length) or off < 0 or length < 0:
            raise _bad(source, f"storage entry of {idx.fqn} is malformed ({_r(info)})")
        if rel not in sizes:
            raise _bad(source, f"{idx.fqn} is stored in {_r(rel)}, which is not a file of this step")
        if off + length > sizes[rel]:
            raise _bad(source, f"{idx.fqn} is recorded at bytes {off}..{off + length} of {rel}, "
                               f"which has {sizes[rel]} bytes")
        key = (idx.fqn, None if idx.offset is None else _dims(idx.offset, source, f"offset of {idx.fqn}"))
        where[key] = info
    summary = manifest.tensors if manifest is not None else None
    if summary is not None and not isinstance(summary, dict):
        raise _bad(source, "the manifest's tensor table is malformed")
    for fqn, smd in sdm.items():
        if not isinstance(fqn, str):
            raise _bad(source, f"state key {_r(fqn)} is not a string")
        if isinstance(smd, BytesStorageMetadata):
            if (fqn, None) not in where and (fqn, ()) not in where:
                raise _bad(source, f"item {fqn} has no storage entry")
            continue
        if not isinstance(smd, TensorStorageMetadata):
            raise _bad(source, f"{fqn}: entry of type {type(smd).__name__}")
        dtype = getattr(getattr(smd, "properties", None), "dtype", None)
        if not isinstance(dtype, torch.dtype):
            raise _bad(source, f"{fqn}: dtype {_r(dtype)} is not a torch dtype")
        size = _dims(smd.size, source, f"shape of {fqn}")
        if not isinstance(smd.chunks, list) or not all(isinstance(c, ChunkStorageMetadata) for c in smd.chunks):
            raise _bad(source, f"{fqn}: chunk list is malformed")
        boxes = [(_dims(c.offsets, source, f"{fqn} chunk offsets"), _dims(c.sizes, source, f"{fqn} chunk sizes"))
                 for c in smd.chunks]
        _check_tiling(fqn, size, boxes, whole, source)
        elem = torch._utils._element_size(dtype)
        for off, sz in boxes:
            info = where.get((fqn, off))
            if info is None:
                raise _bad(source, f"{fqn}: chunk at {list(off)} has no storage entry")
            need = _volume(sz) * elem
            raw = info.relative_path.endswith(".safetensors")
            if getattr(info, "transform_descriptors", None):
                continue  # compressed/transformed by a DCP extension: the reader refuses it by name
            if (raw and info.length != need) or info.length < need:
                raise _bad(source, f"{fqn}: chunk at {list(off)} of shape {list(sz)} ({dtype}) needs {need} "
                                   f"bytes, its storage entry records {info.length}")
        if summary is not None:
            want = summary.get(fqn)
            if want != [str(dtype).replace("torch.", ""), list(size)]:
                raise _bad(source, f"{fqn}: the record says {dtype} {list(size)}, the manifest says {_r(want)}")
    if summary is not None and len(summary) != sum(isinstance(v, TensorStorageMetadata) for v in sdm.values()):
        raise _bad(source, "the manifest's tensor table and the record list different tensors")


def tensor_summary(md: Any) -> dict[str, list]:
    """``{fqn: [dtype, shape]}`` of every tensor a record holds: the manifest keeps it beside
    the record so that the two are checked against each other."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    return {fqn: [str(smd.properties.dtype).replace("torch.", ""), list(smd.size)]
            for fqn, smd in md.state_dict_metadata.items() if isinstance(smd, TensorStorageMetadata)}


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off inside the block, back to its previous state after.

    Building or parsing a commit record allocates millions of small objects (a list per checksum
    block, a chunk and a storage entry per tensor per rank), none of them cyclic garbage: each
    automatic collection then walks the whole heap and finds nothing, which made the coordinator's
    record build superlinear in ranks and unpickling 4-7 times slower (docs/scale.md). Collection
    is only delayed; process-wide while the block runs (seconds at 4096 ranks)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def unpickle_record(data: bytes, source: str, unpickler_cls, identity: tuple | None = None) -> Any:
    """Scan (unless the record with this ``identity`` was scanned already), then unpickle
    ``data`` with ``unpickler_cls`` (the allow-list unpickler)."""
    if identity is None or identity not in SCANNED:
        scan_pickle(data, source)
        if identity is not None:
            SCANNED.add(identity)
    try:
        with collector_paused():  # millions of small acyclic objects: collections would find nothing
            return unpickler_cls(io.BytesIO(data), source).load()
    except (UnsafeCheckpointError, CorruptCheckpointError):
        raise
    except (Exception, RecursionError) as e:  # noqa: BLE001 - anything a damaged record raises
        raise CorruptCheckpointError(
            f"{source}: cannot parse the commit record ({type(e).__name__}: {e}); the step is not a "
            f"usable checkpoint. Resume from an older step or delete this directory.") from e

