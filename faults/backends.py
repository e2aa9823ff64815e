"""Choosing a world's process-group backend and each rank's device: gloo on CPUs, NCCL on CUDA
devices, HCCL on Ascend NPUs (``torch_npu``).

:func:`select_backend` resolves ``--backend`` (``auto`` included) for a world size, or says why it
cannot (:class:`~faults.errors.BackendUnavailable`, whose reason the plugin skips with); the
hardware probes are module functions a test may replace, so the logic runs anywhere.
:func:`device_for_rank` is the device a rank puts its tensors on. In a job ``torchrun`` launched,
:func:`select_local_backend` resolves the backend for this node's ranks, each on the device of its
``LOCAL_RANK``, and :func:`process_group_backend` is what the default group is created with. torch
is imported inside the functions, never at import time.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from .errors import BackendUnavailable

if TYPE_CHECKING:  # pragma: no cover - typing only
    import torch

__all__ = ["BACKENDS", "BackendChoice", "GLOO", "NCCL", "HCCL", "select_backend", "device_for_rank",
           "select_local_backend", "process_group_backend"]

#: Values accepted by :func:`select_backend` (and by the plugin's ``--backend``).
BACKENDS = ("gloo", "nccl", "hccl", "auto")


@dataclasses.dataclass(frozen=True)
class BackendChoice:
    """A process-group backend and the device type its ranks put tensors on."""

    backend: str
    """``'gloo'``, ``'nccl'`` or ``'hccl'``."""
    device_type: str
    """``'cpu'``, ``'cuda'`` or ``'npu'``."""


GLOO = BackendChoice("gloo", "cpu")
NCCL = BackendChoice("nccl", "cuda")
HCCL = BackendChoice("hccl", "npu")
_BY_NAME = {c.backend: c for c in (GLOO, NCCL, HCCL)}


def _cuda_count() -> int:
    import torch
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_nccl_available():
        return 0
    return torch.cuda.device_count()


def _npu_probe() -> tuple[bool, int, str]:
    """Return (torch_npu importable, NPU count, why not importable)."""
    try:
        import torch
        import torch_npu  # noqa: F401  (registers torch.npu)
    except Exception as e:  # ImportError, or a broken CANN install raising anything
        return False, 0, f"{type(e).__name__}: {e}"
    try:
        return True, int(torch.npu.device_count()), ""  # type: ignore[attr-defined]  # torch_npu adds it
    except Exception as e:  # pragma: no cover - needs a broken Ascend install
        return True, 0, f"{type(e).__name__}: {e}"


def select_backend(
    requested: str,
    world_size: int,
    *,
    cuda_count: int | None = None,
    npu_available: bool | None = None,
    npu_count: int | None = None,
) -> BackendChoice:
    """Resolve ``--backend`` for a world of ``world_size`` ranks (one device per rank).

    gloo always works. nccl needs ``world_size`` CUDA devices; hccl needs ``torch_npu`` and
    ``world_size`` NPUs. ``'auto'`` picks nccl if there are enough CUDA devices, else hccl if
    there are enough NPUs, else gloo, and never raises.

    The keyword arguments replace the hardware probes (``torch.cuda.device_count()``,
    ``import torch_npu``, ``torch.npu.device_count()``) so this logic is testable anywhere.

    Raises:
        ValueError: unknown backend name or a world size below 1.
        BackendUnavailable: the request cannot be met; the reason says how to run anyway.
    """
    if requested not in BACKENDS:
        raise ValueError(f"unknown backend {requested!r}; choose one of {', '.join(BACKENDS)}")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if requested == "gloo":
        return GLOO

    if requested in ("nccl", "auto"):
        found = _cuda_count() if cuda_count is None else cuda_count
        if found >= world_size:
            return NCCL
        if requested == "nccl":
            raise BackendUnavailable(
                f"nccl needs {world_size} CUDA devices, found {found}; run with --backend gloo"
            )

    # requested is "hccl" or "auto" without enough CUDA devices.
    if npu_available is None:
        available, probed, why = _npu_probe()
    else:
        available, probed, why = npu_available, 0, "torch_npu not available"
    found = (probed if npu_count is None else npu_count) if available else 0
    if available and found >= world_size:
        return HCCL
    if requested == "auto":
        return GLOO
    if not available:
        raise BackendUnavailable(
            f"hccl needs torch_npu, which cannot be imported ({why}); run with --backend gloo"
        )
    raise BackendUnavailable(
        f"hccl needs {world_size} NPUs, found {found}; run with --backend gloo"
    )


def device_for_rank(choice: BackendChoice, rank: int) -> torch.device:
    """The device rank ``rank`` uses: ``cuda:rank``, ``npu:rank`` or ``cpu``."""
    import torch

    if choice.device_type == "cpu":
        return torch.device("cpu")
    if choice.device_type == "npu":
        try:  # the "npu" device type exists only once torch_npu has registered it
            import torch_npu  # noqa: F401
        except Exception as e:
            raise BackendUnavailable(
                f"device 'npu:{rank}' needs torch_npu, which cannot be imported "
                f"({type(e).__name__}: {e}); run with --backend gloo"
            ) from e
    return torch.device(choice.device_type, rank)


def select_local_backend(
    requested: str,
    local_rank: int,
    local_world_size: int,
    *,
    cuda_count: int | None = None,
    npu_available: bool | None = None,
    npu_count: int | None = None,
) -> BackendChoice:
    """Resolve ``requested`` for one rank of a job ``torchrun`` launched (``LOCAL_RANK`` of
    ``LOCAL_WORLD_SIZE`` ranks on this node): one device per rank of the node, the rank's being
    ``cuda:LOCAL_RANK`` / ``npu:LOCAL_RANK`` (:func:`device_for_rank` with ``local_rank``).

    The node needs ``local_world_size`` devices, whatever the job's world size: the other nodes
    bring their own. ``'auto'`` is resolved per node, so a job over nodes of different hardware
    must name its backend. The keyword arguments replace the hardware probes, as in
    :func:`select_backend`.

    Raises:
        ValueError: an unknown backend, or ``local_rank`` outside ``[0, local_world_size)``.
        BackendUnavailable: this node cannot give every local rank its device; the reason names
            ``LOCAL_RANK``/``LOCAL_WORLD_SIZE`` and what is missing.
    """
    if local_world_size < 1 or not 0 <= local_rank < local_world_size:
        raise ValueError(f"LOCAL_RANK={local_rank} is not a rank of LOCAL_WORLD_SIZE={local_world_size}")
    try:
        return select_backend(requested, local_world_size, cuda_count=cuda_count,
                              npu_available=npu_available, npu_count=npu_count)
    except BackendUnavailable as e:
        raise BackendUnavailable(
            f"torchrun rank with LOCAL_RANK={local_rank} of LOCAL_WORLD_SIZE={local_world_size} on this "
            f"node (one device per local rank): {e.reason}") from e


def process_group_backend(choice: BackendChoice) -> str:
    """The backend string a torchrun world's default group is created with: ``'gloo'``, or for a
    device backend ``'cpu:gloo,cuda:nccl'`` / ``'cpu:gloo,npu:hccl'``, so that device tensors go
    over NCCL/HCCL and CPU tensors (the harness's training runs and result exchange, a
    checkpointer's CPU metadata) over gloo in the same group."""
    if choice.device_type == "cpu":
        return choice.backend
    return f"cpu:gloo,{choice.device_type}:{choice.backend}"


def as_choice(backend: str | BackendChoice) -> BackendChoice:
    """A concrete backend's :class:`BackendChoice` (what ``World(backend=...)`` accepts); ``'auto'``
    must be resolved with :func:`select_backend` first."""
    if isinstance(backend, BackendChoice):
        return backend
    if backend == "auto":
        raise ValueError("World needs a concrete backend; resolve 'auto' with select_backend()")
    try:
        return _BY_NAME[backend]
    except KeyError:
        raise ValueError(
            f"unknown backend {backend!r}; choose one of gloo, nccl, hccl"
        ) from None
