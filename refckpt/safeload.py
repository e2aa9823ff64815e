"""Reading checkpoint bytes without executing them.

DCP stores its ``.metadata`` with :mod:`pickle` and its default load planner
unpickles non-tensor items without restriction too: both run whatever
code a crafted file names. refckpt never does that:

* ``.metadata`` goes through :class:`MetadataUnpickler`, which resolves only an
  allow-list of DCP's metadata classes and torch's dtype/size/layout names;
* non-tensor items and extra-state files go through
  ``torch.load(weights_only=True)``, torch's own restricted unpickler.

Anything else is an :class:`~refckpt.errors.UnsafeCheckpointError` naming the
file and the global it tried to load.

Nor does reading allocate more than the bytes read allow (:func:`refckpt.record.scan_pickle`):
every pickle is scanned before it is parsed, the commit record's against CPython's C
unpickler, a ``torch.save`` file's ``data.pkl`` against torch's weights-only unpickler. A
``torch.save`` file is a zip archive whose members torch.save stores uncompressed:
:func:`check_torch_save` reads its central directory (no member is decompressed) and refuses
compressed, overlapping, duplicate or oversized members before ``torch.load`` sees the file,
so a member cannot inflate to more memory than the file's size; the legacy (pre-1.6, not a
zip) format, whose storages are allocated at the sizes its pickle declares, is refused.

Checkpoint files are opened with :func:`open_regular`: a FIFO or device planted
under a checkpoint name would otherwise block ``open()`` or ``read()`` forever
(resume hangs instead of skipping the step).
"""

from __future__ import annotations

import io
import os
import pickle
import stat
import struct
import zipfile
from collections.abc import Iterable
from typing import Any, BinaryIO

import torch

from .errors import CorruptCheckpointError, UnsafeCheckpointError

__all__ = ["load_metadata", "load_record", "safe_torch_load", "check_torch_save", "open_regular",
           "METADATA_ALLOWED_GLOBALS"]

_DCP = "torch.distributed.checkpoint"

#: (module, name) pairs a DCP ``.metadata`` legitimately references.
METADATA_ALLOWED_GLOBALS: frozenset[tuple[str, str]] = frozenset(
    {(f"{_DCP}.metadata", n) for n in (
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
        "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING",
    )}
    | {(f"{_DCP}.filesystem", "_StorageInfo"), (f"{_DCP}._hf_utils", "_HFStorageInfo")}
    | {("torch", "Size"), ("torch", "device"), ("torch.serialization", "_get_layout")}
    | {("collections", "OrderedDict"), ("builtins", "set"), ("builtins", "frozenset"),
       ("builtins", "slice"), ("builtins", "complex")}
    # DCP's FileSystemWriter records StorageMeta.checkpoint_id as a pathlib path; building one
    # only stores strings (no I/O), so plain-DCP checkpoints stay readable.
    | {("pathlib", n) for n in ("Path", "PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath")}
)

_TORCH_ATTRS_OK = (torch.dtype, torch.layout, torch.memory_format)

#: Module prefix of hyper_parallel's own DCP implementation (MindSpore/torch), whose
#: ``.metadata`` pickles its own classes: a different format, named as such when refused.
_HYPER_PARALLEL_DCP = "hyper_parallel."


def open_regular(path: str, *, follow_symlinks: bool = True, buffering: int = -1) -> BinaryIO:
    """Open ``path`` for reading if it is a regular file; otherwise raise without blocking.

    ``O_NONBLOCK`` makes ``open()`` of a FIFO return at once (it has no effect on regular
    files), and the ``fstat`` of the open descriptor decides, so the check cannot race
    with a rename. ``follow_symlinks=False`` refuses a symlink too (``ELOOP``).
    Missing files raise ``FileNotFoundError`` as ``open()`` does.
    """
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
    if not follow_symlinks:
        flags |= getattr(os, "O_NOFOLLOW", 0)
    fd = os.open(path, flags)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            kind = "directory" if stat.S_ISDIR(mode) else "FIFO" if stat.S_ISFIFO(mode) else "device or socket"
            raise CorruptCheckpointError(
                f"{path}: is a {kind}, not a regular file; a checkpoint holds only regular files. "
                f"Remove it (or the step directory that holds it)."
            )
        return os.fdopen(fd, "rb", buffering=buffering)
    except BaseException:
        os.close(fd)
        raise


class MetadataUnpickler(pickle.Unpickler):
    """An unpickler that resolves only DCP metadata classes and torch enum-like names."""

    def __init__(self, file: BinaryIO, source: str) -> None:
        super().__init__(file)
        self._source = source

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in METADATA_ALLOWED_GLOBALS:
            return super().find_class(module, name)
        if module == "torch":
            obj = getattr(torch, name, None)
            if isinstance(obj, _TORCH_ATTRS_OK):
                return obj
        if module.startswith(_HYPER_PARALLEL_DCP):
            raise UnsafeCheckpointError(
                f"{self._source}: commit record written by hyper_parallel's own DCP implementation "
                f"({module}.{name}), not by torch.distributed.checkpoint; refckpt reads torch DCP "
                f"checkpoints only and never unpickles other classes. Save with torch.distributed."
                f"checkpoint (or refckpt), or convert the checkpoint with hyper_parallel first."
            )
        raise UnsafeCheckpointError(
            f"{self._source}: refusing to load global {module}.{name!r}; a DCP .metadata "
            f"references only checkpoint metadata classes. The file is corrupt or crafted; "
            f"do not load it with pickle. Delete this step directory or restore it from a copy."
        )


def load_record(path: str) -> tuple[Any, str | None]:
    md, checksum, _identity = read_record(path)
    return md, checksum


def read_record(path: str) -> tuple[Any, str | None, tuple | None]:
    """Read a commit record (``.metadata`` or ``__R.metadata``) without executing code from it:
    ``(Metadata, record checksum)``, the checksum ``"sha256"`` when the record carries a valid
    footer, None for a record written without one (plain DCP, refckpt before ``refckpt/2``).

    The file must be a regular file within :data:`refckpt.record.MAX_RECORD_BYTES`; its footer
    is checked before a byte is parsed, the pickle is scanned (:func:`refckpt.record.scan_pickle`:
    parsing it may allocate at most ``ALLOC_FACTOR`` times its size), and
    only an allow-list of classes is resolved. A ``refckpt/2`` record that lost its footer is
    corrupt. Structure is checked separately (:func:`refckpt.record.validate_record`)."""
    from torch.distributed.checkpoint.metadata import Metadata

    from .record import Manifest, read_record_bytes, split_record, unpickle_record

    identity: list = []
    data = read_record_bytes(path, identity=identity)
    body, checksum = split_record(data, path)
    md = unpickle_record(body, path, MetadataUnpickler, identity[0] if identity else None)
    if not isinstance(md, Metadata):
        raise CorruptCheckpointError(
            f"{path}: commit record holds {type(md).__name__}, not DCP Metadata; delete this step."
        )
    if checksum is None and Manifest.declares_footer(md):
        raise CorruptCheckpointError(
            f"{path}: this refckpt commit record was written with a checksum footer, which is gone or "
            f"damaged; the record cannot be trusted. Resume falls back to the previous complete step."
        )
    return md, checksum, (identity[0] if identity else None)


def load_metadata(path: str) -> Any:
    """The DCP ``Metadata`` of a commit record, read as :func:`load_record` does."""
    return load_record(path)[0]


_ZIP_LOCAL = b"PK\x03\x04"
#: The least a zip member takes: its local header (30 bytes) and central directory entry (46)
#: with a one-byte name each.
_ZIP_MEMBER_MIN = 78


def check_torch_save(f: BinaryIO, source: str) -> None:
    """Refuse a ``torch.save`` file whose loading could allocate more than its bytes allow, reading
    only its headers and its pickles; ``f`` is left where it was.

    The file must be a zip archive (torch.save's format since torch 1.6) whose central directory
    (read with :mod:`zipfile`, which decompresses nothing) lists members that are all stored
    uncompressed (torch.save never compresses: a DEFLATE member of 0.5 MiB inflates to 512 MiB),
    unencrypted, with equal stored and declared sizes, distinct names (case-insensitively, as
    torch's zip reader looks them up), local headers where the directory says, and byte ranges
    that neither overlap each other nor the directory; so their sizes add up to at most the
    file's and a member count beyond what the file can hold is refused. The ``data.pkl`` member
    is then scanned (:func:`refckpt.record.scan_pickle` with :data:`~refckpt.record.TORCH_READER`):
    parsing it may allocate at most :data:`~refckpt.record.ALLOC_FACTOR` times the file's size
    plus :data:`~refckpt.record.ALLOC_BASE`, and every storage torch then reads is one member's
    bytes, read once (torch checks each against the size the pickle declares).

    The legacy format (a pickle stream, torch < 1.6) allocates each storage at the size its pickle
    declares before reading a byte of it: :class:`~refckpt.errors.UnsafeCheckpointError`, re-save
    it with torch >= 1.6. Anything else wrong is a :class:`~refckpt.errors.CorruptCheckpointError`
    naming ``source`` and the member."""
    from .record import TORCH_READER, scan_pickle

    start = f.tell()
    try:
        head = f.read(4)
        if head != _ZIP_LOCAL:
            if head[:1] == b"\x80":  # a pickle's PROTO opcode: torch.save's legacy format, or a bare pickle
                raise UnsafeCheckpointError(
                    f"{source}: refusing to unpickle a pickle stream (torch.save's legacy format, before torch 1.6, "
                    f"or a bare pickle): its storages are allocated at the sizes the pickle declares, whatever the "
                    f"file holds, so reading it could take any amount of memory. Load it with a torch you trust and "
                    f"re-save it with torch >= 1.6 (torch.save's zip format).")
            raise CorruptCheckpointError(
                f"{source}: cannot read (not a torch.save zip archive: it starts with {head!r}). The file is "
                f"damaged or is not a torch.save file; restore it from a copy.")
        size = f.seek(0, os.SEEK_END) - start
        f.seek(start)
        try:
            infos = zipfile.ZipFile(f).infolist()  # the central directory only; nothing is decompressed
        except (zipfile.BadZipFile, zipfile.LargeZipFile, EOFError, OSError, ValueError, NotImplementedError) as e:
            raise CorruptCheckpointError(
                f"{source}: cannot read (a damaged torch.save zip archive: {e}). Restore it from a copy.") from e
        pickles = _check_members(f, start, size, infos, source)
        for name, offset, length in pickles:
            f.seek(start + offset)
            scan_pickle(f.read(length), f"{source} ({name})", TORCH_READER, size=size)
    finally:
        f.seek(start)


def _check_members(f: BinaryIO, start: int, size: int, infos: list[zipfile.ZipInfo], source: str) -> list:
    """The zip members' rules of :func:`check_torch_save`; returns ``(name, data offset, length)`` of
    every ``data.pkl`` member."""

    def bad(what: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(
            f"{source}: refusing to read this torch.save file: {what}. torch.save never writes that (every member "
            f"stored uncompressed, once, within the file); the file is crafted or was rewritten by another tool, "
            f"and loading it could allocate more memory than its {size} bytes. Restore it from a copy, or load it "
            f"with a torch you trust and re-save it with torch.save.")

    if not infos:
        raise bad("the archive has no members")
    if len(infos) > size // _ZIP_MEMBER_MIN:
        raise bad(f"{len(infos)} members in {size} bytes")
    packed = [i for i in infos if i.compress_type != zipfile.ZIP_STORED]
    if packed:
        worst = max(packed, key=lambda i: i.file_size)
        method = {zipfile.ZIP_DEFLATED: "DEFLATE", zipfile.ZIP_BZIP2: "BZIP2", zipfile.ZIP_LZMA: "LZMA"}.get(
            worst.compress_type, f"method {worst.compress_type}")
        raise bad(f"{len(packed)} of its {len(infos)} members are compressed, e.g. {worst.filename!r} ({method}: "
                  f"{worst.compress_size} bytes that inflate to {worst.file_size})")
    seen: set[str] = set()
    spans = []
    pickles = []
    for info in infos:
        name = info.filename
        if info.flag_bits & 0x1:
            raise bad(f"member {name!r} is encrypted")
        if info.file_size != info.compress_size:
            raise bad(f"member {name!r} declares {info.file_size} bytes but stores {info.compress_size}")
        key = name.lower()
        if key in seen:
            raise bad(f"member {name!r} appears twice")
        seen.add(key)
        f.seek(start + info.header_offset)
        local = f.read(30)
        if len(local) < 30 or local[:4] != _ZIP_LOCAL or struct.unpack("<H", local[8:10])[0] != zipfile.ZIP_STORED:
            raise bad(f"member {name!r} has no stored local header at byte {info.header_offset}")
        name_len, extra_len = struct.unpack("<HH", local[26:30])
        data_at = info.header_offset + 30 + name_len + extra_len
        spans.append((info.header_offset, data_at + info.compress_size, name))
        if key.rsplit("/", 1)[-1] == "data.pkl":  # the pickle torch.load parses (any archive name)
            pickles.append((name, data_at, info.compress_size))
    spans.sort()
    end_of_data = size - 22  # the end-of-central-directory record, at least
    for (a_start, a_end, a_name), (b_start, _b_end, b_name) in zip(spans, spans[1:] + [(end_of_data, 0, "")]):
        if a_end > b_start:
            what = f"the central directory at byte {b_start}" if not b_name else f"member {b_name!r} at byte {b_start}"
            raise bad(f"member {a_name!r} (bytes {a_start}..{a_end}) overlaps {what}")
    return pickles


def safe_torch_load(data: bytes | BinaryIO, source: str, extra_globals: Iterable[Any] = ()) -> Any:
    """``torch.load(weights_only=True)`` with errors that name the file, after
    :func:`check_torch_save` (no compressed members, a bounded pickle: no more memory than the
    bytes read allow).

    ``extra_globals`` are classes the caller trusts (for example numpy's RNG
    state types); they are allowed for this call only.
    """
    buf = io.BytesIO(data) if isinstance(data, (bytes, bytearray, memoryview)) else data
    check_torch_save(buf, source)
    try:
        if extra_globals:
            with torch.serialization.safe_globals(list(extra_globals)):
                return torch.load(buf, map_location="cpu", weights_only=True)
        return torch.load(buf, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        if "Unsupported global" not in str(e) and "GLOBAL" not in str(e):  # not a refused class: garbage
            raise CorruptCheckpointError(f"{source}: cannot read ({type(e).__name__}: {e}).") from e
        raise UnsafeCheckpointError(
            f"{source}: refusing to unpickle ({e}). Only tensors and plain Python data load; "
            f"if you trust this file and it holds your own classes, pass them as "
            f"DistributedCheckpointer(safe_globals=[...])."
        ) from e
    except (RuntimeError, EOFError, ValueError) as e:
        raise CorruptCheckpointError(f"{source}: cannot read ({type(e).__name__}: {e}).") from e
