"""What each file of a step is, learned from the checkpointer's behaviour, never from its name.

:func:`opened_during` records, with Linux ``inotify``, every file any process opens under a
directory while a call runs -- Python's ``open``, C and Rust readers (``safetensors``' mmap) and
other processes alike -- in the order of their first opening. :func:`learn` saves nothing itself:
given a step a checkpointer wrote and the state it was saved from, it traces one ``load`` to learn
which files the load reads (and in which order), and finds in each file the raw bytes of the
saved tensors to learn what state it holds (model parameters, optimizer moments, extra state
such as RNG states), or none (an index, a record, metadata). A format that compresses or
encodes tensors shows no state bytes; the role then says so ("no state bytes found"), and the
damage of that file is still judged, by what resume returns.

``faults.suite.test_file_roles`` damages each file the load reads, one at a time, and names the
file and this role in every finding (issue 28: the largest file is no longer "the payload").
"""

from __future__ import annotations

import ctypes
import ctypes.util
import dataclasses
import errno
import os
import struct
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

__all__ = ["FileRole", "opened_during", "learn", "state_files", "state_regions", "InotifyUnavailable"]

_IN_OPEN = 0x00000020
_IN_ISDIR = 0x40000000
_IN_NONBLOCK = 0o4000
_IN_CLOEXEC = 0o2000000
_EVENT = struct.Struct("iIII")
#: tensors smaller than this are not searched for (a few bytes match anywhere)
MIN_TENSOR_BYTES = 16


class InotifyUnavailable(OSError):
    """This system offers no inotify (not Linux, or the watch limit is reached)."""


@dataclasses.dataclass(frozen=True)
class FileRole:
    """One file of a step: its path relative to the step, size, the order in which a load first
    opened it (None: the load never opened it), and the state whose bytes it holds."""

    rel: str
    size: int
    read_order: int | None
    holds: tuple[str, ...]

    @property
    def holds_state(self) -> bool:
        return bool(self.holds)

    def describe(self) -> str:
        order = ("not read by load" if self.read_order is None
                 else f"read {_ordinal(self.read_order + 1)} by load")
        what = ("holds " + ", ".join(self.holds)) if self.holds else "no state bytes found (metadata, an index or a record)"
        return f"{self.rel} ({self.size} bytes; {order}; {what})"


def _ordinal(n: int) -> str:
    return f"{n}{'th' if 10 <= n % 100 <= 20 else {1: 'st', 2: 'nd', 3: 'rd'}.get(n % 10, 'th')}"


def _libc() -> Any:
    lib = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    lib.inotify_init1.argtypes = [ctypes.c_int]
    lib.inotify_add_watch.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_uint32]
    return lib


@contextmanager
def opened_during(top: str) -> Iterator[list[str]]:
    """Yield a list that, once the block ends, holds every regular file under ``top`` (relative
    paths, first opening first) that any process opened while the block ran. Directories that
    exist when the block starts are watched (a step the load reads is not created by it)."""
    try:
        lib = _libc()
        fd = lib.inotify_init1(_IN_NONBLOCK | _IN_CLOEXEC)
    except (OSError, AttributeError) as e:
        raise InotifyUnavailable(f"inotify: {e}") from None
    if fd < 0:
        raise InotifyUnavailable(f"inotify_init1: {os.strerror(ctypes.get_errno())}")
    out: list[str] = []
    try:
        dirs: dict[int, str] = {}
        for dirpath, dirnames, _files in os.walk(top):
            dirnames[:] = [d for d in dirnames if not os.path.islink(os.path.join(dirpath, d))]
            wd = lib.inotify_add_watch(fd, os.fsencode(dirpath), _IN_OPEN)
            if wd < 0:
                raise InotifyUnavailable(f"inotify_add_watch({dirpath}): {os.strerror(ctypes.get_errno())}")
            dirs[wd] = os.path.relpath(dirpath, top)
        yield out
        seen: set[str] = set()
        while True:
            try:
                data = os.read(fd, 1 << 16)
            except OSError as e:
                if e.errno in (errno.EAGAIN, errno.EWOULDBLOCK):
                    break
                raise
            if not data:
                break
            i = 0
            while i + _EVENT.size <= len(data):
                wd, mask, _cookie, length = _EVENT.unpack_from(data, i)
                name = data[i + _EVENT.size:i + _EVENT.size + length].rstrip(b"\0").decode("utf-8", "replace")
                i += _EVENT.size + length
                if mask & _IN_ISDIR or not name or wd not in dirs:
                    continue
                rel = os.path.normpath(os.path.join(dirs[wd], name))
                if rel not in seen:
                    seen.add(rel)
                    out.append(rel)
    finally:
        os.close(fd)


def _tensors(obj: Any, where: str, out: list[tuple[str, bytes]]) -> None:
    import torch

    if isinstance(obj, torch.Tensor):
        t = obj.detach()
        if hasattr(t, "to_local"):
            t = t.to_local()
        if t.device.type == "cpu" and t.numel() and t.element_size() * t.numel() >= MIN_TENSOR_BYTES:
            out.append((where, t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()))
    elif isinstance(obj, dict):
        for v in obj.values():
            _tensors(v, where, out)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            _tensors(v, where, out)


#: the parts of the contract's state a file may hold, as the roles name them
PARTS = {"model": "model parameters", "optimizer": "optimizer state", "fp32_main_params": "fp32 main parameters",
         "extra_state": "extra state"}


def state_regions(data: bytes, state: dict[str, Any]) -> list[tuple[str, int, int]]:
    """Where in ``data`` the bytes of ``state``'s tensors are: ``(part, start, end)`` for each
    tensor found (its first occurrence), ``part`` as :data:`PARTS` names it."""
    found: list[tuple[str, int, int]] = []
    for key, label in PARTS.items():
        chunks: list[tuple[str, bytes]] = []
        _tensors(state.get(key), label, chunks)
        for where, raw in chunks:
            at = data.find(raw)
            if at >= 0:
                found.append((where, at, at + len(raw)))
    return found


def state_files(step_dir: str, state: dict[str, Any]) -> set[str]:
    """The files under ``step_dir`` (relative paths) that hold bytes of ``state``'s tensors."""
    out = set()
    for dirpath, dirnames, files in os.walk(step_dir):
        dirnames[:] = [d for d in dirnames if not os.path.islink(os.path.join(dirpath, d))]
        for name in files:
            path = os.path.join(dirpath, name)
            if os.path.islink(path) or not os.path.isfile(path):
                continue
            with open(path, "rb") as f:
                if state_regions(f.read(), state):
                    out.add(os.path.relpath(path, step_dir))
    return out


def learn(step_dir: str, state: dict[str, Any], load: Callable[[], Any]) -> list[FileRole]:
    """The roles of every regular file under ``step_dir``: ``load()`` (a resume that reads this
    step) runs once under :func:`opened_during`; ``state`` is what was saved (its tensors' bytes
    are looked for in each file). Files the load read come first, in the order it opened them."""
    with opened_during(step_dir) as opened:
        load()
    order = {rel: i for i, rel in enumerate(opened)}
    roles = []
    for dirpath, dirnames, files in os.walk(step_dir):
        dirnames[:] = [d for d in dirnames if not os.path.islink(os.path.join(dirpath, d))]
        for name in files:
            path = os.path.join(dirpath, name)
            if os.path.islink(path) or not os.path.isfile(path):
                continue
            rel = os.path.relpath(path, step_dir)
            with open(path, "rb") as f:
                data = f.read()
            parts = sorted({part for part, _a, _b in state_regions(data, state)})
            roles.append(FileRole(rel, len(data), order.get(rel), tuple(parts)))
    return sorted(roles, key=lambda r: (r.read_order is None, r.read_order or 0, r.rel))
