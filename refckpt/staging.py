"""Host copies of a state tree for async saves: what the caller of ``save(save_async=True)`` waits for.

An async save returns once every tensor has been copied to host memory the caller can no
longer reach; the background thread then writes from those copies while training mutates the
originals. The copy is the whole of the caller's cost, so it is made cheap:

* **Buffers are reused across saves** (``reuse=True``): a fresh ``torch.empty`` of the
  state's size pays one page fault per 4 KiB page on first touch, which on the 2-core
  reference machine made a clone of the state 3-6x slower than copying into memory that is
  already mapped (``python -m benchmarks``: ``memcpy`` vs ``refckpt_async_blocked``).
  The price is one host copy of the state held between saves, as DCP's cached stager and
  torchtitan's pinned-memory async mode do; ``reuse=False`` frees it after each save.
* **CPU copies run on several threads** (tensor copies release the GIL): one thread does not
  saturate memory bandwidth on common machines; large tensors are split into pieces.
* **Device tensors go to pinned host memory** with non-blocking copies and one synchronize
  per device type at the end, so device-to-host transfers run at full DMA speed.

A buffer is reused only for a tensor at the same place in the tree with the same shape, dtype,
strides and pinning; anything else gets a new buffer. The previous save's background write
must have finished before :meth:`Stager.stage` runs (``save`` waits for it first).
"""

from __future__ import annotations

import concurrent.futures
import copy
import os
from typing import Any

import torch

__all__ = ["Stager", "accelerator_available"]

_PIECE = 8 << 20  # bytes per parallel copy job
_SMALL = 1 << 20  # tensors below this are copied on the calling thread


def accelerator_available() -> bool:
    """Whether a CUDA/NPU/other accelerator is present (pinned staging then pays off)."""
    acc = getattr(torch, "accelerator", None)
    if acc is not None and hasattr(acc, "is_available"):
        try:
            return bool(acc.is_available())
        except RuntimeError:  # pragma: no cover - broken driver installs
            return False
    return torch.cuda.is_available()  # pragma: no cover - torch without torch.accelerator


class Stager:
    """Copies state trees to host memory; see the module docstring."""

    def __init__(self, *, pin: bool, reuse: bool = True, threads: int | None = None) -> None:
        self.pin = pin
        self.reuse = reuse
        self.threads = max(1, min(4, os.cpu_count() or 1) if threads is None else threads)
        self._bufs: dict[tuple, torch.Tensor] = {}
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None

    @property
    def held_bytes(self) -> int:
        """Host memory kept for the next save."""
        return sum(b.numel() * b.element_size() for b in self._bufs.values())

    def stage(self, obj: Any) -> Any:
        """A copy of ``obj`` whose tensors live in host memory owned by the stager."""
        big: list[tuple[torch.Tensor, torch.Tensor]] = []
        devices: set[str] = set()
        seen: dict[tuple, torch.Tensor] = {}
        out = self._walk(obj, (), big, devices, seen)
        self._copy_parallel(big)
        for dev in devices:
            mod = getattr(torch, dev, None)
            if mod is not None and hasattr(mod, "synchronize"):
                mod.synchronize()
        self._bufs = seen if self.reuse else {}
        return out

    def release(self) -> None:
        """Free the reused buffers and the copy threads."""
        self._bufs = {}
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    # -- internals ------------------------------------------------------------------------
    def _buffer(self, path: tuple, t: torch.Tensor) -> torch.Tensor:
        pin = self.pin and t.device.type != "cpu"
        old = self._bufs.get(path)
        if (old is not None and old.shape == t.shape and old.dtype == t.dtype
                and old.stride() == t.stride() and old.is_pinned() == pin):
            return old
        return torch.empty_like(t, device="cpu", pin_memory=pin)

    def _walk(self, obj: Any, path: tuple, big: list, devices: set, seen: dict) -> Any:
        from torch.distributed.tensor import DTensor

        if isinstance(obj, DTensor):
            local = self._walk(obj.to_local(), path + ("<local>",), big, devices, seen)
            return DTensor.from_local(local, obj.device_mesh, obj.placements, run_check=False,
                                      shape=obj.shape, stride=obj.stride())
        if isinstance(obj, torch.Tensor):
            t = obj.detach()
            out = self._buffer(path, t)
            seen[path] = out
            if t.device.type != "cpu":
                devices.add(t.device.type)
                out.copy_(t, non_blocking=out.is_pinned())
            elif t.numel() * t.element_size() >= _SMALL and t.is_contiguous() and out.is_contiguous():
                big.append((out, t))
            else:
                out.copy_(t)
            return out
        if isinstance(obj, dict):
            items = {k: self._walk(v, path + (k,), big, devices, seen) for k, v in obj.items()}
            return items if type(obj) is dict else type(obj)(items.items())
        if isinstance(obj, list):
            return [self._walk(v, path + (i,), big, devices, seen) for i, v in enumerate(obj)]
        if isinstance(obj, tuple):
            return tuple(self._walk(v, path + (i,), big, devices, seen) for i, v in enumerate(obj))
        return copy.deepcopy(obj)

    def _copy_parallel(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        if not pairs:
            return
        if self.threads == 1:
            for dst, src in pairs:
                dst.copy_(src)
            return
        jobs = []
        for dst, src in pairs:
            d, s = dst.view(-1).view(torch.uint8), src.view(-1).view(torch.uint8)
            for pos in range(0, d.numel(), _PIECE):
                jobs.append((d[pos:pos + _PIECE], s[pos:pos + _PIECE]))
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(self.threads, thread_name_prefix="refckpt-stage")
        for fut in [self._pool.submit(d.copy_, s) for d, s in jobs]:
            fut.result()
