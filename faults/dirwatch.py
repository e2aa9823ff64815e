"""Wait for a directory to change, driven by the kernel's notification (Linux ``inotify``), not by
polling: the suite's retention property waits this way for a checkpointer that deletes old steps
in a background thread (torchtitan's purge thread) to finish -- it wakes on the deletion itself,
and gives up at a deadline that is only a bound.

:func:`wait_until` re-checks its predicate after each batch of events (and once before waiting), so a
change that happened before the watch was set is never missed. Where ``inotify`` is unavailable (not
Linux, or the C library lacks it) it raises :class:`OSError`: the caller decides then, rather than
falling back to a timed loop."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import select
import time
from collections.abc import Callable

__all__ = ["wait_until"]

_IN_CLOEXEC = 0o2000000
_IN_NONBLOCK = 0o4000
# what removing, renaming or creating an entry of the watched directory sends
_MASK = 0x00000040 | 0x00000080 | 0x00000100 | 0x00000200 | 0x00000400 | 0x00000800 | 0x00000004


def _libc() -> ctypes.CDLL:
    name = ctypes.util.find_library("c") or "libc.so.6"
    libc = ctypes.CDLL(name, use_errno=True)
    if not hasattr(libc, "inotify_init1"):
        raise OSError(f"{name} has no inotify_init1: cannot wait for a directory to change")
    return libc


def wait_until(directory: str, predicate: Callable[[], bool], timeout: float) -> bool:
    """Block until ``predicate()`` is true, re-checking it whenever an entry of ``directory`` is
    created, removed or renamed; False if still false after ``timeout`` seconds."""
    libc = _libc()
    fd = libc.inotify_init1(_IN_NONBLOCK | _IN_CLOEXEC)
    if fd < 0:
        e = ctypes.get_errno()
        raise OSError(e, f"inotify_init1: {os.strerror(e)}")
    try:
        if libc.inotify_add_watch(fd, os.fsencode(directory), _MASK) < 0:
            e = ctypes.get_errno()
            raise OSError(e, f"inotify_add_watch({directory!r}): {os.strerror(e)}")
        deadline = time.monotonic() + timeout
        while True:
            if predicate():
                return True
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            ready, _, _ = select.select([fd], [], [], left)
            if ready:
                try:
                    while os.read(fd, 65536):  # drain this batch; the predicate is what is judged
                        pass
                except BlockingIOError:
                    pass
    finally:
        os.close(fd)
