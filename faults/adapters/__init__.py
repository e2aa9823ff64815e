"""Adapters that map third-party checkpointers onto :class:`faults.contract.Checkpointer`, so that
``faults.suite`` and ``python -m faults audit`` can judge them.

Each adapter lives in its own module, imports its package at module import, and raises
:class:`Unavailable` (an ``ImportError``) when the package cannot be imported; the suite then
skips with that reason. No adapter reimplements checkpointing: each says in its docstring
exactly what it maps (paths, state keys, async) and what it adds only because the contract
needs a method the package lacks.

* ``faults.adapters.dcp:PlainDCP`` -- ``torch.distributed.checkpoint`` as PyTorch documents it.
* ``faults.adapters.torchtitan:TorchTitan`` -- torchtitan's ``CheckpointManager``.
* ``faults.adapters.veomni:VeOmni`` -- VeOmni's (hyper_parallel family) DCP checkpointer;
  ``faults.adapters.veomni:VeOmniAcceleratorHost`` -- the same as on a GPU/NPU host (on a CPU
  host every VeOmni sync save fails on a missing ``torch.cpu.empty_cache``, hiding the rest).
* ``faults.adapters.torchsave:TorchSave`` -- a hand-written trainer's ``torch.save`` of one state
  dict per step (rank 0 writes ``<step>/checkpoint.pt``; ``torch.load(weights_only=False)``);
  ``faults.adapters.torchsave:TorchSaveWeightsOnly`` -- the same with torch's safe default load.
* ``faults.adapters.lightning:LightningFabric`` -- Lightning's ``Fabric.save`` / ``Fabric.load``;
  ``faults.adapters.lightning_trainer:LightningTrainer`` -- the ``Trainer``'s
  ``ModelCheckpoint(save_top_k)`` and its ``ckpt_path`` restore.
* ``faults.adapters.deepspeed:DeepSpeed`` -- DeepSpeed's ``engine.save_checkpoint`` /
  ``load_checkpoint`` and its ``latest`` file (CPU accelerator, gloo).
* ``faults.adapters.megatron:MegatronCore`` -- Megatron-Core's ``dist_checkpointing.save`` /
  ``load``; ``Unavailable`` on a host without CUDA (its save strategy calls CUDA).

``faults.adapters._plain`` holds what the rank-0-writes adapters share: an ``nn.Module`` over the
contract's model state dict (so ``load_state_dict`` is PyTorch's own and fills the caller's
tensors), the refusal of DTensor state, the highest step holding a file.

Each module's ``FINDINGS`` diagnoses what ``python -m faults audit`` finds for its package.
"""

from __future__ import annotations

__all__ = ["Unavailable"]


class Unavailable(ImportError):
    """The adapted package is not installed or cannot be imported here; the reason says which."""



_OWNED_PG: dict[str, int] = {}


def ensure_process_group() -> None:
    """A 1-rank gloo process group when none is initialized: what a user of a package that
    needs one does for a single-process job (``torchrun --nproc-per-node=1``). Packages such
    as VeOmni and torchtitan call collectives even at world size 1; refckpt and plain DCP do
    not need this. Inside a world started by the harness or by torchrun, the existing group is
    used and nothing is created.

    A group created here is recreated in a forked child (the suite resumes in forked children
    so that a hang or a crash cannot take the test run with it): gloo's worker threads do not
    survive ``fork``, so the parent's group would hang the child's first collective."""
    import os

    import torch.distributed as dist

    if dist.is_initialized():
        if _OWNED_PG.get("pid", os.getpid()) == os.getpid():
            return
        import torch.distributed.distributed_c10d as c10d

        c10d._world = c10d._World()  # the parent's group: unusable here, and never destroyed (its threads are gone)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    _OWNED_PG["pid"] = os.getpid()


def release_process_group() -> None:
    """Destroy the group :func:`ensure_process_group` created in this process, if any (the
    suite's plugin calls it after each test, so that a single-process test of an adapter never
    leaves a process group behind for the next test, which may judge another checkpointer)."""
    import os

    import torch.distributed as dist

    if _OWNED_PG.get("pid") == os.getpid() and dist.is_initialized():
        dist.destroy_process_group()
    _OWNED_PG.clear()
