"""Whole-step verification: every byte of every file a commit record lists, against its checksums
(``refckpt verify``); and the check of a small file read whole (per-rank extra state) at load."""

from __future__ import annotations

import os
import stat
from collections.abc import Callable

from ..errors import CheckpointError, CorruptCheckpointError, UnsafeCheckpointError
from ..layout import safe_relpath
from ..record import Manifest
from ..safeload import open_regular
from .checksums import checksum_fn

__all__ = ["verify_step_files", "verify_file_bytes"]

_READ_BLOCK = 64 << 20


def verify_file_bytes(manifest: Manifest, rel: str, data: bytes, full: str) -> None:
    """Raise :class:`~refckpt.errors.CorruptCheckpointError` unless ``data``, the whole content of
    the step's file ``rel`` (at ``full``), is what the manifest records: listed, of its size, and
    (a small file is one block) of its checksum. Nothing to check without recorded checksums."""
    algo = manifest.checksum
    if not algo:
        return
    rec = manifest.files.get(rel)
    if rec is None:
        raise CorruptCheckpointError(f"{full}: not listed in the commit record; refusing to trust it.")
    if len(data) != rec.size or (rec.chunks and checksum_fn(algo)(data, 0) != rec.chunks[0][2]):
        raise CorruptCheckpointError(
            f"{full}: size or {algo} differs from the commit record; the extra state is corrupt. "
            f"Resume from an older step (load_latest falls back by itself)."
        )


def verify_step_files(step_dir: str, manifest: Manifest,
                      on_bytes: Callable[[int, str], None] | None = None) -> list[str]:
    """Re-read every byte of every file the manifest covers; return a list of problems (empty = good).

    ``on_bytes(n, rel)`` is called after every block read (for progress bars)."""
    problems: list[str] = []
    algo = manifest.checksum
    fn = checksum_fn(algo) if algo else None
    for rel, rec in sorted(manifest.files.items()):
        try:
            full = safe_relpath(step_dir, rel)
        except UnsafeCheckpointError as e:
            problems.append(str(e))
            continue
        try:
            info = os.stat(full)
        except OSError as e:
            problems.append(f"{full}: missing ({e.strerror})")
            continue
        if not stat.S_ISREG(info.st_mode):
            problems.append(f"{full}: not a regular file (a FIFO, device, socket or directory)")
            continue
        size = info.st_size
        if size != rec.size:
            problems.append(f"{full}: {size} bytes, commit record says {rec.size}")
            continue
        if fn is None:
            if on_bytes is not None:
                on_bytes(size, rel)
            continue
        try:
            f = open_regular(full, buffering=0)  # a FIFO swapped in since the stat never blocks verify
        except (OSError, CheckpointError) as e:
            problems.append(f"{full}: {e}")
            continue
        with f:
            for off, length, crc in rec.chunks:
                f.seek(off)
                c, left = 0, length
                while left:
                    b = f.read(min(left, _READ_BLOCK))
                    if not b:
                        break
                    c = fn(b, c)
                    left -= len(b)
                    if on_bytes is not None:
                        on_bytes(len(b), rel)
                if left or c != crc:
                    problems.append(f"{full}: bytes {off}..{off + length} fail their {algo}")
    return problems
