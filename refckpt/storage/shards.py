"""The shard format the writer and the reader share: one safetensors file per rank, raw tensor bytes.

Why one safetensors file per rank with raw bytes: each shard opens on its own with
``safetensors.safe_open`` and DCP's ``HuggingFaceStorageReader``; ``.metadata`` records
``(file, offset, length)`` of each item so the reader fetches exactly the bytes it needs.
Non-tensor items (param-group hyperparameters, embedded extra state) are stored as ``U8``
entries under ``__bytes__/<fqn>``, so they do not break the safetensors format; their bytes
are ``torch.save`` output read back only with ``weights_only=True``.
"""

from __future__ import annotations

import ctypes
import os

import torch

__all__ = ["SHARD_SUFFIX", "BYTES_KEY_PREFIX", "StepDirStorage", "tensor_bytes", "tensor_to_bytes"]

SHARD_SUFFIX = ".safetensors"
BYTES_KEY_PREFIX = "__bytes__/"


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The raw bytes of a contiguous CPU tensor, without a copy (writable: reads land in ``t``).

    Through ctypes rather than ``Tensor.numpy()``: numpy is not a dependency of torch, and
    bfloat16/float8 have no numpy dtype anyway. The view does not keep ``t`` alive; callers hold it.
    """
    if not t.is_contiguous() or t.device.type != "cpu":
        raise ValueError("tensor_bytes needs a contiguous CPU tensor")
    n = t.numel() * t.element_size()
    if n == 0:
        return memoryview(b"")
    return memoryview((ctypes.c_char * n).from_address(t.data_ptr())).cast("B")


def tensor_to_bytes(t: torch.Tensor) -> bytes:
    """A copy of any tensor's raw bytes (CPU, contiguous first): for digests and comparisons."""
    cpu = t.detach().to("cpu").contiguous()  # bound: a copy must outlive the view bytes() reads
    return bytes(tensor_bytes(cpu))


class StepDirStorage:
    """What the writer and the reader share as DCP storage: a step directory is the checkpoint id,
    and any path is accepted as one (the checkpointer has checked it)."""

    path: str

    @property
    def checkpoint_id(self) -> str:
        return self.path

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return True
