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

Checkpoint files are opened with :func:`open_regular`: a FIFO or device planted
under a checkpoint name would otherwise block ``open()`` or ``read()`` forever
(resume hangs instead of skipping the step).
"""

from __future__ import annotations

import io
import os
import pickle
import stat
from collections.abc import Iterable
from typing import Any, BinaryIO

import torch

from .errors import CorruptCheckpointError, UnsafeCheckpointError

__all__ = ["load_metadata", "load_record", "safe_torch_load", "open_regular", "METADATA_ALLOWED_GLOBALS"]

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
    is checked before a byte is parsed, the pickle is scanned for unbounded allocations, and
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


def safe_torch_load(data: bytes | BinaryIO, source: str, extra_globals: Iterable[Any] = ()) -> Any:
    """``torch.load(weights_only=True)`` with errors that name the file.

    ``extra_globals`` are classes the caller trusts (for example numpy's RNG
    state types); they are allowed for this call only.
    """
    buf = io.BytesIO(data) if isinstance(data, (bytes, bytearray, memoryview)) else data
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
