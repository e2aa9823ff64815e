"""The baseline operations the benchmark times beside refckpt.

Each is what it says and nothing more: the timing, barriers and cache drops are
:mod:`benchmarks.measure`'s.
"""

from __future__ import annotations

import os

from .probes import fsync_dir

MiB = 1 << 20
CHUNK = 64 * MiB


def _bytes(buf) -> memoryview:
    """A writable byte view of a contiguous CPU uint8 tensor's memory (no copy)."""
    return memoryview(buf.numpy()).cast("B")


def raw_write(path: str, buf) -> None:
    """``buf``'s bytes to ``path`` in large unbuffered writes, fsync of the file and its directory: the ceiling."""
    view = _bytes(buf)
    with open(path, "wb", buffering=0) as f:
        pos = 0
        while pos < len(view):
            pos += f.write(view[pos:pos + CHUNK])
        os.fsync(f.fileno())
    fsync_dir(os.path.dirname(path))


def raw_read(path: str, buf) -> None:
    """``path`` into the preallocated ``buf`` in large unbuffered reads."""
    view = _bytes(buf)
    with open(path, "rb", buffering=0) as f:
        pos = 0
        while pos < len(view):
            n = f.readinto(view[pos:pos + CHUNK])
            if not n:
                raise OSError(f"{path}: short read at {pos} of {len(view)}")
            pos += n


def raw_read_files(paths: list[str], buf) -> None:
    """Every byte of ``paths`` into ``buf`` (a preallocated, already touched uint8 tensor, reused for
    every read: allocating it here would bill its page faults, 64 MiB's worth, to the read), large
    unbuffered reads."""
    view = _bytes(buf)
    for path in paths:
        with open(path, "rb", buffering=0) as f:
            while f.readinto(view):
                pass


def torch_save(path: str, state) -> None:
    import torch

    with open(path, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    fsync_dir(os.path.dirname(path))


def st_save(path: str, tensors: dict) -> None:
    from safetensors.torch import save_file

    save_file(tensors, path)
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    fsync_dir(os.path.dirname(path))


def staging_held_bytes(ckpt) -> int | None:
    """Bytes of host staging buffers ``ckpt`` keeps between async saves (private; None if not visible)."""
    held = getattr(getattr(ckpt, "_stager", None), "held_bytes", None)
    return held if isinstance(held, int) else None
