"""Durable file-system operations: the only place refckpt touches the disk to write.

Everything a save writes goes through one :class:`FileIO` object, so that

* the protocol is auditable in one file (what is fsynced, when, and why), and
* the fault harness can wrap this layer (ENOSPC/EIO, crash points, a recorder of
  operations for the power-loss explorer) without editing the checkpointer.

Durable publish is the classic sequence (python-atomicwrites' ``_replace_atomic``):
write tmp -> fsync file -> ``os.replace`` -> fsync the parent directory. The
rename is atomic only within one file system: callers keep tmp files beside
their destination.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import logging
import os
import shutil
from typing import BinaryIO

__all__ = ["FileIO", "DEFAULT_IO", "atomic_write_bytes", "tmp_prefix"]

log = logging.getLogger(__name__)

_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _load_renameat2():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):  # pragma: no cover - non-glibc platforms
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_renameat2 = _load_renameat2()


class FileIO:
    """The write-side I/O layer. Subclass or wrap it to inject faults or record a trace.

    Each method is one file-system operation with the name a crash-state
    explorer would give it. ``fsync`` is the only barrier: nothing is durable
    until it has been called on the file (data) and on its parent (entry).
    """

    def mark(self, point: str, **info) -> None:
        """Called when the save protocol reaches a named step (see ``refckpt.protocol.SavePoint``).

        A no-op here; fault injectors override it to crash, stall or fail at
        that exact step, and recorders use it to label the trace.
        """

    def open_write(self, path: str) -> BinaryIO:
        """Create (or truncate) ``path`` for writing, unbuffered."""
        return open(path, "wb", buffering=0)

    def write(self, f: BinaryIO, data) -> int:
        """Write all of ``data`` (a bytes-like object) to ``f``; returns bytes written."""
        view = memoryview(data).cast("B")
        total = 0
        while total < len(view):
            n = f.write(view[total:])
            if n is None or n <= 0:  # pragma: no cover - raw files never do this
                raise OSError(errno.EIO, f"short write to {getattr(f, 'name', f)}")
            total += n
        return total

    def fsync(self, f: BinaryIO) -> None:
        """Make a file's data durable."""
        os.fsync(f.fileno())

    def close(self, f: BinaryIO) -> None:
        f.close()

    def fsync_dir(self, path: str) -> None:
        """Make the directory entries (creations, renames, removals) in ``path`` durable."""
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def mkdir(self, path: str) -> None:
        os.makedirs(path, exist_ok=True)

    def replace(self, src: str, dst: str) -> None:
        """Atomically rename ``src`` over ``dst`` (same file system)."""
        os.replace(src, dst)

    def exchange(self, a: str, b: str) -> bool:
        """Atomically swap two existing paths (Linux ``renameat2(RENAME_EXCHANGE)``).

        Returns False when the platform or file system cannot do it; the caller
        then falls back to two renames and says so.
        """
        if _renameat2 is None:  # pragma: no cover - non-glibc platforms
            return False
        rc = _renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE)
        if rc == 0:
            return True
        err = ctypes.get_errno()
        if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):  # pragma: no cover - fs-specific
            return False
        raise OSError(err, os.strerror(err), a)

    def unlink(self, path: str) -> None:
        os.unlink(path)

    def rmtree(self, path: str) -> None:
        shutil.rmtree(path)


DEFAULT_IO = FileIO()


def atomic_write_bytes(path: str, data: bytes, io: FileIO = DEFAULT_IO) -> None:
    """tmp -> fsync -> replace -> fsync parent. A reader sees the old or the new content, never a mix.

    Precondition: ``path``'s directory exists; the tmp file is created beside it
    so the rename stays within one file system.
    """
    parent = os.path.dirname(os.path.abspath(path))
    tmp = os.path.join(parent, f"{tmp_prefix(path)}{os.getpid()}")
    f = io.open_write(tmp)
    try:
        try:
            io.write(f, data)
            io.fsync(f)
        finally:
            io.close(f)
        io.replace(tmp, path)
    except BaseException:
        try:  # a failed write must not leave its tmp file behind (a crash may: see tmp_prefix)
            os.unlink(tmp)
        except OSError:
            pass
        raise
    io.fsync_dir(parent)


def tmp_prefix(path: str) -> str:
    """Name prefix of :func:`atomic_write_bytes`' tmp files for ``path`` (to sweep crash leftovers)."""
    return f".{os.path.basename(path)}.tmp."
