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
from .checksums import DEFAULT_CHECKSUM, checksum_fn

__all__ = ["verify_step_files", "verify_file_bytes"]

_READ_BLOCK = 64 << 20


def _algorithms(manifest: Manifest) -> tuple[str, ...]:
    """The algorithm(s) the manifest's recorded blocks may use. A manifest names one when the save
    recorded every item's; a save with ``checksums=False`` names none, but its extra-state files'
    blocks are recorded all the same: CRC-32C, or zlib's CRC-32 in checkpoints written before
    refckpt switched (both are tried: the chance of a damaged block matching either is 2**-31)."""
    return (manifest.checksum,) if manifest.checksum else (DEFAULT_CHECKSUM, "crc32")


def _matches(data, crc: int, algos: tuple[str, ...]) -> bool:
    return any(checksum_fn(a)(data, 0) == crc for a in algos)


def verify_file_bytes(manifest: Manifest, rel: str, data: bytes, full: str) -> None:
    """Raise :class:`~refckpt.errors.CorruptCheckpointError` unless ``data``, the whole content of
    the step's file ``rel`` (at ``full``), is what the manifest records: listed, of its size, and
    (a small file is one block) of its checksum. Recorded checksums are always verified, whatever
    ``checksums=`` the save used."""
    rec = manifest.files.get(rel)
    if rec is None:
        raise CorruptCheckpointError(f"{full}: not listed in the commit record; refusing to trust it.")
    algos = _algorithms(manifest)
    if len(data) != rec.size or (rec.chunks and not _matches(data, rec.chunks[0][2], algos)):
        raise CorruptCheckpointError(
            f"{full}: size or {algos[0]} differs from the commit record; the extra state is corrupt. "
            f"Resume from an older step (load_latest falls back by itself)."
        )


def verify_step_files(step_dir: str, manifest: Manifest,
                      on_bytes: Callable[[int, str], None] | None = None) -> list[str]:
    """Re-read every byte of every file the manifest covers; return a list of problems (empty = good).
    A file whose blocks the manifest records is checked against them (whatever ``checksums=`` the save
    used); one without recorded blocks, by its size.

    ``on_bytes(n, rel)`` is called after every block read (for progress bars)."""
    problems: list[str] = []
    algos = _algorithms(manifest)
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
        if not rec.chunks:
            if on_bytes is not None:
                on_bytes(size, rel)
            continue
        try:
            f = open_regular(full, buffering=0)  # a FIFO swapped in since the stat never blocks verify
        except (OSError, CheckpointError) as e:
            problems.append(f"{full}: {e}")
            continue
        fns = [checksum_fn(a) for a in algos]
        with f:
            for off, length, crc in rec.chunks:
                f.seek(off)
                c, left = [0] * len(fns), length
                while left:
                    b = f.read(min(left, _READ_BLOCK))
                    if not b:
                        break
                    c = [fn(b, v) for fn, v in zip(fns, c)]
                    left -= len(b)
                    if on_bytes is not None:
                        on_bytes(len(b), rel)
                if left or crc not in c:
                    problems.append(f"{full}: bytes {off}..{off + length} fail their {algos[0]}")
    return problems
