"""Large I/O for the shard reader and writer: vectored reads and writes of many tensors in one system
call, and a read-only mapping of a shard that pass 1 of a load checksums without copying it.

Why (docs/performance.md, "What made refckpt fast"): a checkpoint of a transformer holds a thousand
tensors, most of them small; one ``read``/``write`` per tensor cost more than their bytes, and on a
machine whose memory copies are as slow as its disk, pass 1 of a transactional load reading every
byte into a buffer cost as much as the disk itself. A mapping lets the checksum read the page cache
where the disk put it; pass 2 then copies each byte once, into the caller's tensors.

The mapping is made and populated through libc (``ctypes``, which releases the GIL: the checksum
thread folds one window while the next is read). ``MADV_POPULATE_READ`` reports a read error or a
range past the end of the file as an error (``OSError``), never as ``SIGBUS``; the reader checks
every range against the file's size before it touches it. A file truncated by another process
*between* the populate and the checksum of that window would still raise ``SIGBUS``: refckpt never
writes a published step, and the window is one populate long.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import mmap
import os
from collections.abc import Sequence

from ..durable import IOV_MAX, advance_iov
from ..errors import CorruptCheckpointError

__all__ = ["MappedFile", "preadv_exact"]

_PROT_READ = 1
_MAP_SHARED = 1
_MADV_SEQUENTIAL = 2
_MADV_DONTNEED = 4
_MADV_POPULATE_READ = 22  # Linux 5.14; older kernels answer EINVAL and the reader reads instead

_libc = None


def _lib():
    global _libc
    if _libc is None:
        lib = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        lib.mmap.restype = ctypes.c_void_p
        lib.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
        lib.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        lib.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        _libc = lib
    return _libc


class MappedFile:
    """A read-only shared mapping of an open file's first ``size`` bytes (``size`` > 0), populated
    window by window. :meth:`open` returns None where mapping or populating is not available (not
    Linux, an old kernel, a file system that cannot map): the caller reads instead."""

    def __init__(self, addr: int, size: int, source: str) -> None:
        self.addr, self.size, self.source = addr, size, source
        self._view: memoryview | None = memoryview((ctypes.c_char * size).from_address(addr)).cast("B")

    @classmethod
    def open(cls, fd: int, size: int, source: str) -> MappedFile | None:
        if size <= 0 or not hasattr(os, "preadv"):
            return None
        try:
            lib = _lib()
        except OSError:  # pragma: no cover - no libc
            return None
        addr = lib.mmap(None, size, _PROT_READ, _MAP_SHARED, fd, 0)
        if addr in (None, ctypes.c_void_p(-1).value):
            return None
        lib.madvise(addr, size, _MADV_SEQUENTIAL)
        m = cls(addr, size, source)
        if lib.madvise(addr, min(size, mmap.PAGESIZE), _MADV_POPULATE_READ) != 0:
            m.close()  # EINVAL: a kernel before 5.14 (or an I/O error: the reads that follow say which)
            return None
        return m

    def populate(self, start: int, end: int) -> memoryview:
        """Bytes ``[start, end)`` read into the page cache and mapped; returns a view of them.
        Raises :class:`CorruptCheckpointError` naming the file where they cannot be read."""
        if self._view is None:
            raise ValueError("mapping closed")
        if end > self.size:
            raise CorruptCheckpointError(
                f"{self.source}: truncated: wanted bytes {start}..{end}, the file ends at {self.size}. "
                f"This step is damaged; resume from an older one (load_latest falls back by itself).")
        lo = start - start % mmap.PAGESIZE
        if end > lo and _lib().madvise(self.addr + lo, end - lo, _MADV_POPULATE_READ) != 0:
            err = ctypes.get_errno()
            raise CorruptCheckpointError(
                f"{self.source}: cannot read bytes {start}..{end}: {os.strerror(err) or errno.errorcode.get(err, err)}. "
                f"This step is damaged or its storage failed; resume from an older one.")
        return self._view[start:end]

    def release(self, start: int, end: int) -> None:
        """Unmap the whole pages within ``[start, end)`` from this process (the page cache keeps them):
        a populated mapping counts in the process's RSS, so pass 1 lets go of each window once its
        checksums are folded. Touching them again would map them again from the page cache."""
        lo = -(-start // mmap.PAGESIZE) * mmap.PAGESIZE
        hi = end - end % mmap.PAGESIZE if end < self.size else self.size
        if self._view is not None and hi > lo:
            _lib().madvise(self.addr + lo, hi - lo, _MADV_DONTNEED)

    def close(self) -> None:
        """Unmap. Every view handed out must be done with (the checksum thread joined)."""
        if self._view is not None:
            self._view.release()
            self._view = None
            _lib().munmap(self.addr, self.size)


def preadv_exact(fd: int, views: Sequence[memoryview], offset: int, source: str) -> int:
    """Fill ``views`` (in order) from ``fd`` at ``offset`` with as few ``preadv`` calls as the
    kernel allows; a file that ends first raises :class:`CorruptCheckpointError` naming ``source``."""
    bufs = [v for v in views if len(v)]
    want = sum(len(v) for v in bufs)
    got, k = 0, 0
    while k < len(bufs):
        n = os.preadv(fd, bufs[k:k + IOV_MAX], offset + got)
        if n <= 0:
            raise CorruptCheckpointError(
                f"{source}: truncated: wanted {want} bytes at offset {offset}, file ends after {got}. "
                f"This step is damaged; resume from an older one (load_latest falls back by itself).")
        got += n
        k = advance_iov(bufs, k, n)
    return got
