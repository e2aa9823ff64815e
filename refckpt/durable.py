"""Durable file-system operations: the only place refckpt touches the disk to write.

Everything a save writes goes through one :class:`FileIO` object, so that

* every write, fsync and rename of a save is one call of one layer, in the order the save
  protocol (:mod:`refckpt.commit`) makes them, and
* the fault harness can wrap this layer (ENOSPC/EIO, crash points, a recorder of
  operations for the power-loss explorer) without editing the checkpointer.

Every durable write is :func:`durable_write`, the classic sequence (python-atomicwrites'
``_replace_atomic``): write tmp -> fsync file -> ``os.replace`` -> fsync the parent directory.
The rename is atomic only within one file system: tmp files are kept beside their destination.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import io
import os
import stat
from collections.abc import Callable, Sequence
from typing import BinaryIO

__all__ = ["FileIO", "DEFAULT_IO", "durable_write", "tmp_prefix", "remove_tree", "tree_size"]

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


IOV_MAX = 1024  # the most buffers one readv/writev takes on Linux


def writev_all(fd: int, views: Sequence[memoryview]) -> int:
    """Write every byte of ``views`` (in order) at ``fd``'s position with as few ``writev`` calls
    as the kernel allows; returns the bytes written."""
    bufs = [v for v in views if len(v)]
    total, k = 0, 0
    while k < len(bufs):
        n = os.writev(fd, bufs[k:k + IOV_MAX])
        if n <= 0:  # pragma: no cover - regular files never do this
            raise OSError(errno.EIO, "short write")
        total += n
        k = advance_iov(bufs, k, n)
    return total


def advance_iov(bufs: list[memoryview], k: int, n: int) -> int:
    """After a vectored call moved ``n`` bytes of ``bufs[k:]``: the index of the first buffer not
    done, with a partly done one trimmed in place to what is left."""
    while k < len(bufs) and n >= len(bufs[k]):
        n -= len(bufs[k])
        k += 1
    if n:
        bufs[k] = bufs[k][n:]
    return k


class FileIO:
    """The write-side I/O layer. Subclass or wrap it to inject faults or record a trace.

    Each method is one file-system operation with the name a crash-state
    explorer would give it. ``fsync`` is the only barrier: nothing is durable
    until it has been called on the file (data) and on its parent (entry).
    """

    def mark(self, point: str, **info) -> None:
        """Called when the save protocol (:mod:`refckpt.commit`) reaches a named step
        (:class:`refckpt.protocol.SavePoint`), in protocol order.

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

    def write_many(self, f: BinaryIO, views: list) -> int:
        """Write every byte of ``views`` (bytes-like objects, in order) to ``f``; returns bytes written.

        One ``writev`` for up to 1,024 of them (the shard writer hands many small tensors at once).
        A subclass that overrides :meth:`write` (a fault injector, a tracer) sees each view as one
        :meth:`write` call instead, exactly as before this method existed."""
        if type(self).write is not FileIO.write or not isinstance(f, io.FileIO):
            return sum(self.write(f, v) for v in views)
        return writev_all(f.fileno(), [memoryview(v).cast("B") for v in views])

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

    def mkdir(self, path: str, *, parents: bool = True) -> None:
        """Make ``path`` (fine if it exists). ``parents=False``: only ``path`` itself, so that a
        parent that vanished (a staging directory another writer renamed aside) fails the call
        instead of being made again, empty, under the old name."""
        if parents:
            os.makedirs(path, exist_ok=True)
            return
        try:
            os.mkdir(path)
        except FileExistsError:
            if not os.path.isdir(path):
                raise

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
        remove_tree(path)


DEFAULT_IO = FileIO()


def durable_write(
    path: str,
    payload: bytes | bytearray | memoryview | Callable[[BinaryIO], None],
    io: FileIO = DEFAULT_IO,
    *,
    atomic: bool = True,
    tmp: str | None = None,
    sync: bool = True,
    sync_dirs: Sequence[str] | None = None,
) -> None:
    """The one durable write: [tmp ->] write -> fsync -> close [-> rename] -> fsync the directory.

    ``payload``: the bytes, or a function that writes the open file itself through ``io`` (a file
    streamed in pieces). ``atomic``: write a tmp file beside ``path`` (``tmp``, by default
    :func:`tmp_prefix` + the pid) and rename it over ``path``, so that a reader sees the old content
    or the new, never a mix; a failed write removes its tmp file (a crash may leave it: callers
    sweep :func:`tmp_prefix`). ``atomic=False`` writes ``path`` in place: for files inside a staging
    directory that no reader looks at before the directory itself is renamed into place.
    ``sync``: fsync the file, then each of ``sync_dirs`` (default: ``path``'s directory); False
    forfeits durability. Precondition: the directory exists (the rename stays in one file system).
    Every step is one :class:`FileIO` call, so fault injectors and recorders see each.
    """
    parent = os.path.dirname(os.path.abspath(path))
    target = path
    if atomic:
        target = tmp or os.path.join(parent, f"{tmp_prefix(path)}{os.getpid()}")
    f = io.open_write(target)
    try:
        try:
            if callable(payload):
                payload(f)
            else:
                io.write(f, payload)
            if sync:
                io.fsync(f)
        finally:
            io.close(f)
        if target != path:
            io.replace(target, path)
    except BaseException:
        if target != path:
            try:  # a failed write must not leave its tmp file behind (a crash may: see tmp_prefix)
                os.unlink(target)
            except OSError:
                pass
        raise
    if sync:
        for d in (parent,) if sync_dirs is None else sync_dirs:
            io.fsync_dir(d)


def tmp_prefix(path: str) -> str:
    """Name prefix of :func:`durable_write`'s tmp files for ``path`` (to sweep crash leftovers)."""
    return f".{os.path.basename(path)}.tmp."


_DIR_FLAGS = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)

# Trees under a checkpoint root are untrusted: a crashed tool, a bad copy or an attacker can
# leave one nested thousands of levels deep. shutil.rmtree and os.walk recurse in Python 3.11
# (RecursionError near 1,000 levels) and join ever longer paths (ENAMETOOLONG past PATH_MAX).
# The two walkers below use neither: a loop with an explicit stack, directories entered by
# name relative to their parent's descriptor and left through "..", which is checked against
# the inode they were entered from, so a tree renamed underneath raises instead of walking
# somewhere else. At most two directory descriptors are open at any depth; symlinks are
# never followed (a link is removed or counted as the link itself).


def _enter(fd: int, name: str, ids: list[tuple[int, int]]) -> int:
    here = os.fstat(fd)
    sub = os.open(name, _DIR_FLAGS, dir_fd=fd)
    os.close(fd)
    ids.append((here.st_dev, here.st_ino))
    return sub


def _leave(fd: int, ids: list[tuple[int, int]], top: str) -> int:
    parent = os.open("..", _DIR_FLAGS, dir_fd=fd)
    os.close(fd)
    st = os.fstat(parent)
    if (st.st_dev, st.st_ino) != ids.pop():
        os.close(parent)
        raise OSError(errno.ESTALE, f"{top}: the tree was moved while it was walked; nothing more was touched", top)
    return parent


def remove_tree(path: str) -> None:
    """Remove the directory ``path`` and everything under it, at any depth, never following a
    symlink (iterative, descriptor-relative: see above). Raises ``OSError`` on the first entry
    that cannot be removed, leaving the rest."""
    fd = os.open(path, _DIR_FLAGS)
    names: list[str] = []  # the directory entered at each level
    ids: list[tuple[int, int]] = []
    try:
        while True:
            child = None
            with os.scandir(fd) as it:
                for entry in it:
                    if entry.is_dir(follow_symlinks=False):
                        child = entry.name
                        break
                    os.unlink(entry.name, dir_fd=fd)
            if child is not None:
                fd = _enter(fd, child, ids)
                names.append(child)
                continue
            if not names:
                break
            fd = _leave(fd, ids, path)
            os.rmdir(names.pop(), dir_fd=fd)
    finally:
        os.close(fd)
    os.rmdir(path)


def tree_size(path: str) -> int:
    """Bytes of every non-directory entry under ``path`` (symlinks as themselves), at any depth
    (iterative, descriptor-relative: see above). Entries that vanish while it walks (retention
    of a concurrent job) are skipped; a file or symlink ``path`` is its own size."""
    try:
        st = os.lstat(path)
        if not stat.S_ISDIR(st.st_mode):
            return st.st_size
        fd = os.open(path, _DIR_FLAGS)
    except OSError:
        return 0
    total = 0
    ids: list[tuple[int, int]] = []

    def scan(fd: int) -> list[str]:
        nonlocal total
        subdirs = []
        with os.scandir(fd) as it:
            for entry in it:
                try:
                    st = entry.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue
                if stat.S_ISDIR(st.st_mode):
                    subdirs.append(entry.name)
                else:
                    total += st.st_size
        return subdirs

    try:
        pending = [scan(fd)]  # subdirectories still to visit, per level
        while pending:
            if pending[-1]:
                name = pending[-1].pop()
                try:
                    fd = _enter(fd, name, ids)
                except (FileNotFoundError, NotADirectoryError):
                    continue
                pending.append(scan(fd))
                continue
            pending.pop()
            if pending:
                fd = _leave(fd, ids, path)
    except OSError:
        pass  # the tree moved or vanished underneath: what was counted so far
    finally:
        os.close(fd)
    return total
