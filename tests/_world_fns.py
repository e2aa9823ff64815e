"""Rank functions for ``tests/test_world.py``.

They live at module level in their own module because a :class:`faults.world.World` pickles
the function by reference and the spawned ranks import it from here.
"""

from __future__ import annotations

import os
import signal
import threading

import torch
import torch.distributed as dist

from faults.world import BackendChoice, device_for_rank, emit

# What device a backend's collectives take (gloo: CPU tensors; nccl/hccl: the rank's device).
_DEVICE_TYPE = {"gloo": "cpu", "nccl": "cuda", "hccl": "npu"}


def whoami() -> tuple[int, int, int]:
    """(rank, world size, pid) as the process group sees it."""
    return dist.get_rank(), dist.get_world_size(), os.getpid()


def echo(*args: object, **kwargs: object) -> tuple[int, tuple, dict]:
    return dist.get_rank(), args, kwargs


def all_reduce_rank_plus(offset: float) -> list[float]:
    """Every rank contributes ``rank + offset``; returns the reduced tensor."""
    backend = dist.get_backend()
    device = device_for_rank(BackendChoice(backend, _DEVICE_TYPE[backend]), dist.get_rank())
    t = torch.tensor([dist.get_rank() + offset, 1.0], dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return t.cpu().tolist()


def raise_on(rank: int, message: str) -> int:
    """Rank ``rank`` raises ValueError(message); the others return their rank."""
    if dist.get_rank() == rank:
        _raising_helper(message)
    return dist.get_rank()


def _raising_helper(message: str) -> None:
    raise ValueError(message)


def raise_on_then_barrier(rank: int, message: str) -> int:
    """Rank ``rank`` raises; the others block in a barrier the failed rank never joins."""
    if dist.get_rank() == rank:
        raise ValueError(message)
    dist.barrier()
    return dist.get_rank()


def sigkill_self_on(rank: int) -> int:
    """Rank ``rank`` SIGKILLs itself (models an OOM kill); the others wait in a barrier."""
    if dist.get_rank() == rank:
        os.kill(os.getpid(), signal.SIGKILL)
    dist.barrier()
    return dist.get_rank()


def exit_on(rank: int, code: int) -> int:
    """Rank ``rank`` leaves through ``os._exit(code)`` (a hard exit, no exception)."""
    if dist.get_rank() == rank:
        os._exit(code)
    dist.barrier()
    return dist.get_rank()


def hang_on(rank: int) -> int:
    """Rank ``rank`` blocks forever; the others block in a barrier it never joins."""
    if dist.get_rank() == rank:
        threading.Event().wait()
    dist.barrier()
    return dist.get_rank()


def emit_then_barrier(rank: int) -> int:
    """Rank ``rank`` emits an event (the parent may kill it there), then all ranks barrier."""
    if dist.get_rank() == rank:
        emit({"rank": dist.get_rank(), "pid": os.getpid(), "moment": "before-barrier"})
    dist.barrier()
    return dist.get_rank()


def emit_count(n: int) -> int:
    """Every rank emits ``n`` events in order, then returns ``n``."""
    for i in range(n):
        emit(i)
    return n


def num_threads() -> tuple[int, str | None]:
    return torch.get_num_threads(), os.environ.get("OMP_NUM_THREADS")


def unpicklable_result() -> object:
    return threading.Lock()


def break_exit_on(rank: int, how: str) -> None:
    """Make rank ``rank`` end badly when the world closes: ``how`` is an exit code such as
    ``"5"``, or ``"SIGABRT"`` (what gloo's C++ teardown does when a peer exits first).

    Replaces the worker's exit routine in this rank only, so the parent's exit-code check
    at ``close()`` is exercised for real.
    """
    import faults.world as world

    if dist.get_rank() != rank:
        return
    if how.isdigit():
        world._flush_and_exit = lambda code: os._exit(int(how))
    else:
        sig = getattr(signal, how)
        world._flush_and_exit = lambda code: os.kill(os.getpid(), sig)


def last_rank_dies_others_barrier() -> str:
    """The last rank SIGKILLs itself; the others wait for it in a barrier and report what happened."""
    if dist.get_rank() == dist.get_world_size() - 1:
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        dist.barrier()
    except Exception as e:  # noqa: BLE001 - the survivor reports the failure it saw
        return f"raised {type(e).__name__}"
    return "passed the barrier"
