"""The baseline operations the benchmark times beside refckpt, and the small training loop.

Each is what it says and nothing more: the timing, barriers and cache drops are
:mod:`benchmarks.measure`'s.
"""

from __future__ import annotations

import os
import time

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


def raw_read_files(paths: list[str]) -> None:
    """Every byte of ``paths`` into one reused buffer, large unbuffered reads."""
    buf = bytearray(CHUNK)
    view = memoryview(buf)
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


def train_setup(seed: int = 1234):
    """A small MLP, its optimizer and a batch: the training loop an async save runs beside."""
    import torch

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 256))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(64, 256)
    return model, opt, x


def train_step(model, opt, x, ws: int) -> float:
    """One step (gradients all-reduced over the default group at world size > 1); its seconds."""
    import torch.distributed as dist

    t0 = time.perf_counter()
    loss = model(x).pow(2).mean()
    opt.zero_grad(set_to_none=True)
    loss.backward()
    if ws > 1:
        for p in model.parameters():
            dist.all_reduce(p.grad)
    opt.step()
    return time.perf_counter() - t0


def any_rank(flag: bool, ws: int) -> bool:
    if ws == 1:
        return flag
    import torch
    import torch.distributed as dist

    t = torch.tensor([int(flag)])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def async_in_flight(ckpt) -> bool | None:
    """Whether ``ckpt``'s background save is still running; None where that cannot be seen.

    Measurement only, through a private attribute (the public API can only wait): None if the
    library renamed it, and the caller says so in the report instead of guessing."""
    if not hasattr(ckpt, "_pending"):
        return None
    fut = ckpt._pending
    return fut is not None and not fut.done()


def staging_held_bytes(ckpt) -> int | None:
    """Bytes of host staging buffers ``ckpt`` keeps between async saves (private; None if not visible)."""
    held = getattr(getattr(ckpt, "_stager", None), "held_bytes", None)
    return held if isinstance(held, int) else None
