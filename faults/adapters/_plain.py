"""What the adapters of single-file, rank-0-writes checkpointers (``torchsave``, ``lightning``,
``deepspeed``) share: the live objects those packages expect, made over the contract's state dicts.

The contract hands over state dicts (``get_state_dict`` output); a hand-written trainer, Lightning
and DeepSpeed take an ``nn.Module`` and call ``module.state_dict()`` to save and
``module.load_state_dict(sd, strict=...)`` to load. :func:`module_over` is such a module whose
tensors *are* the caller's (registered, not copied), so ``load_state_dict`` is PyTorch's own --
its strictness (missing and unexpected keys), its shape checks, its in-place ``copy_`` -- and
fills the caller's tensors, as it fills a live model's.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from ..contract import step_of

__all__ = ["SyncSaves", "module_over", "refuse_dtensors", "rank_and_world", "barrier", "highest_step_with"]


class SyncSaves:
    """The two async calls of a checkpointer that saves synchronously (each save has ended, and
    raised its failure, when it returns): nothing is ever pending, so both do nothing."""

    def maybe_wait_for_async_save(self) -> None:
        pass

    def raise_for_failed_async_save(self) -> None:
        pass


def module_over(flat: dict[str, Any]) -> torch.nn.Module:
    """An ``nn.Module`` whose ``state_dict()`` keys are ``flat``'s (dotted names become submodules)
    and whose tensors are ``flat``'s own tensors, registered as buffers (so a parameter of the
    caller's is filled in place by ``load_state_dict``, never replaced). Non-tensor entries (none
    in a model state dict) are refused."""
    root = torch.nn.Module()
    for key, value in flat.items():
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"model state entry {key!r} is a {type(value).__name__}, not a tensor")
        *path, leaf = key.split(".")
        m = root
        for part in path:
            child = m._modules.get(part)
            if child is None:
                child = torch.nn.Module()
                m.add_module(part, child)
            m = child
        m.register_buffer(leaf, value)
    return root


def refuse_dtensors(state: dict[str, Any], who: str) -> None:
    """``TypeError`` when ``state`` holds a DTensor (an FSDP2 or TP shard): these checkpointers
    write rank 0's objects, so a sharded state would be saved as rank 0's shards only. What a
    hand-written trainer of a sharded model would do is not what is judged here."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch without distributed
        return

    def walk(obj: Any, where: str) -> None:
        if isinstance(obj, DTensor):
            raise TypeError(f"{who}: {where} is a DTensor; this checkpointer saves rank 0's plain tensors only "
                            "(replicated, data-parallel state), not sharded (FSDP2) state")
        if isinstance(obj, dict):
            for k, v in obj.items():
                walk(v, f"{where}[{k!r}]")
        elif isinstance(obj, (list, tuple)):
            for i, v in enumerate(obj):
                walk(v, f"{where}[{i}]")

    for key in ("model", "optimizer", "fp32_main_params"):
        if key in state:
            walk(state[key], f"state[{key!r}]")


def rank_and_world() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def barrier() -> None:
    """``dist.barrier()`` when a process group is initialized (what a trainer calls after rank 0 saved)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def highest_step_with(root: str, file_name: str) -> str | None:
    """``<root>/global_step_<N>`` with the highest ``N`` whose ``file_name`` is a file; None if none
    (or ``root`` is not a directory). Nothing is read or validated: the file's presence is all."""
    try:
        names = os.listdir(root)
    except OSError:
        return None
    best: tuple[int, str] | None = None
    for name in names:
        step = step_of(name)
        if step is None:
            continue
        path = os.path.join(root, name)
        if os.path.isfile(os.path.join(path, file_name)) and (best is None or step > best[0]):
            best = (step, path)
    return None if best is None else best[1]
