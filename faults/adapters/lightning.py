"""Lightning 2.6.6's ``Fabric.save`` / ``Fabric.load`` (``lightning.fabric``; the same code ships
as ``lightning_fabric``).

:class:`LightningFabric` maps the harness contract (:mod:`faults.contract`) onto the two calls
Lightning documents for checkpointing with Fabric ("Saving and Loading Checkpoints"):
``fabric.save(path, state)`` and ``remainder = fabric.load(path, state)``, with Fabric's default
``CheckpointIO`` (``TorchCheckpointIO``: ``torch.save`` into a buffer, written through an
``fsspec`` transaction; ``torch.load`` with ``weights_only=None``, torch's default). It adds no
checkpointing logic: no commit protocol, fsync, checksum, validation, retry, fallback or error
translation beyond Lightning's own.

Building Fabric
---------------
One ``Fabric`` per process and world, as a script has one:

* without a process group, or in a world of one rank: ``Fabric(accelerator="cpu", devices=1)``
  (Lightning's ``SingleDeviceStrategy``; its ``barrier`` does nothing);
* in a world of ``n > 1`` ranks (started by the harness or by torchrun):
  ``Fabric(accelerator="cpu", devices=n, strategy="ddp", plugins=[<cluster environment>])`` and
  ``fabric.launch()``. The cluster environment is Lightning's documented way to run under a
  launcher it does not know (a ``ClusterEnvironment`` subclass): it reports the live default
  group's rank and size and says that processes are created externally, so ``launch()`` spawns
  nothing, and ``DDPStrategy.setup_environment`` finds the group initialized and keeps it
  (``_init_dist_connection`` returns early). No environment variable is set.

A forked child (the suite resumes in forked children) builds its own Fabric.

Step directory and file
-----------------------
Fabric saves to a file path it is given. The contract's step directory ``<root>/global_step_<N>``
holds one file, ``checkpoint.ckpt`` (the name Lightning's Fabric examples use); Fabric creates
the directory (``fs.makedirs(dirname, exist_ok=True)`` in ``TorchCheckpointIO``).

What each contract call does
----------------------------
``save(path, state, global_step=N, save_async=False)``
    ``fabric.save(path/checkpoint.ckpt, {"model": <module>, "optimizer": state["optimizer"],
    ["fp32_main_params": <module>,] ["extra_state": state["extra_state"],] "global_step": N})``.
    ``<module>`` is an ``nn.Module`` whose tensors are the caller's state dict's
    (:func:`faults.adapters._plain.module_over`): Fabric takes ``module.state_dict()`` of a module
    as it does of a user's model. The optimizer entry is the caller's optimizer state dict itself
    (what Fabric's ``optimizer.state_dict()`` would give; Fabric saves a plain value as it is).
    Fabric then writes on global rank 0 only and calls ``fabric.barrier()`` on every rank.

    ``save_async=True`` saves synchronously: Fabric has no async save (Lightning's
    ``AsyncCheckpointIO`` is a Trainer plugin), so a Fabric script saves now.
    ``maybe_wait_for_async_save()`` and ``raise_for_failed_async_save()`` do nothing.

    Plain tensors only: a state holding a DTensor (FSDP2) is refused with ``TypeError`` before
    anything is written (Fabric's DDP strategy saves rank 0's objects; its FSDP strategies need
    Fabric-wrapped models, which the contract's state dicts are not).
``load(path, state, strict_model=True, extra_state_skeleton=None)``
    ``fabric.load(path/checkpoint.ckpt, want, strict=strict_model)`` where ``want`` is
    ``{"model": <module>, "optimizer": ..., ["fp32_main_params": <module>,]}`` plus
    ``"extra_state"`` when a skeleton is given. Fabric ``torch.load``s the file on every rank,
    checks that every requested key is in the checkpoint (``strict``), loads each module with
    ``module.load_state_dict(sd, strict=strict)`` (so the caller's model tensors are filled in
    place) and replaces every plain entry with the checkpoint's; those replacements become
    ``state["optimizer"]`` and ``state["extra_state"]``. Without a skeleton, extra state is not
    requested and ``state["extra_state"]`` is left alone.
``find_latest_checkpoint(root)``
    Fabric has no such helper (a Fabric script keeps its own file names). The one piece of logic
    the adapter supplies because the contract needs it: the ``global_step_<N>`` directory with
    the highest ``N`` that holds a ``checkpoint.ckpt`` file; nothing is read or validated.

Capabilities
------------
None: no root save, retention (``Fabric`` has none; ``ModelCheckpoint(save_top_k)`` is the
Trainer's), overwrite refusal (a save over an existing file replaces it), ``load_latest``, async
save, per-rank extra state (rank 0 writes the one copy) or priming. What it lacks that the suite
would otherwise draw: :data:`LIMITATIONS`.

Importing
---------
``pip install --no-deps lightning==2.6.6`` and its pure-Python imports ``lightning-utilities==0.15.3``
and ``torchmetrics==1.9.0`` (also ``--no-deps``: it requires torch), beside the already
installed ``fsspec``, ``packaging``, ``PyYAML``, ``tqdm`` and ``typing-extensions``.
``import lightning.fabric`` imports ``torchmetrics`` (through ``lightning.fabric.utilities``);
nothing is stubbed.
"""

from __future__ import annotations

import os
from typing import Any

from . import Unavailable
from ._plain import highest_step_with, module_over, refuse_dtensors

PACKAGE = "lightning"
VERSION = "2.6.6"

try:
    import torch
    from lightning.fabric import Fabric
    from lightning.fabric.plugins.environments import ClusterEnvironment
except Exception as e:
    raise Unavailable(
        f"lightning cannot be imported ({type(e).__name__}: {e}); the Lightning adapter wants lightning=={VERSION} "
        f"(pip install --no-deps 'lightning=={VERSION}' 'lightning-utilities==0.15.3' 'torchmetrics==1.9.0')") from e

__all__ = ["LightningFabric", "PACKAGE", "FINDINGS", "FILE_NAME", "LIMITATIONS"]

#: The one file of a step.
FILE_NAME = "checkpoint.ckpt"
#: What this checkpointer lacks (the names of ``faults.contract.Limitation`` where the suite has
#: them): no async save, no sharded state (here), no commit record, no pointer file.
LIMITATIONS = ("sync_only", "plain_tensors_only", "no_commit_record", "no_pointer")

#: Diagnoses of what ``python -m faults audit --checkpointer lightning`` finds in Lightning 2.6.6,
#: read from its source (``"[severity:]PROPERTY[|REASON]"`` fnmatch patterns -> the defect; see
#: :func:`faults.audit.explain`).
FINDINGS: dict[str, str] = {}


class _LiveGroup(ClusterEnvironment):
    """A Lightning cluster environment for processes that are already a world: the live default
    process group's rank and size (one node), processes created externally."""

    @property
    def creates_processes_externally(self) -> bool:
        return True

    @property
    def main_address(self) -> str:
        return os.environ.get("MASTER_ADDR", "127.0.0.1")

    @property
    def main_port(self) -> int:
        return int(os.environ.get("MASTER_PORT", "0"))

    @staticmethod
    def detect() -> bool:
        import torch.distributed as dist

        return dist.is_available() and dist.is_initialized()

    def world_size(self) -> int:
        import torch.distributed as dist

        return dist.get_world_size()

    def set_world_size(self, size: int) -> None:
        pass

    def global_rank(self) -> int:
        import torch.distributed as dist

        return dist.get_rank()

    def set_global_rank(self, rank: int) -> None:
        pass

    def local_rank(self) -> int:
        return self.global_rank()

    def node_rank(self) -> int:
        return 0


_FABRIC: dict[tuple[int, Any], Fabric] = {}


def _fabric() -> Fabric:
    """This process's Fabric for the live world (see the module docstring)."""
    import torch.distributed as dist

    group = dist.group.WORLD if dist.is_available() and dist.is_initialized() else None
    key = (os.getpid(), group)
    fabric = _FABRIC.get(key)
    if fabric is None:
        _FABRIC.clear()
        n = dist.get_world_size() if group is not None else 1
        if n == 1:
            fabric = Fabric(accelerator="cpu", devices=1)
        else:
            fabric = Fabric(accelerator="cpu", devices=n, strategy="ddp", plugins=[_LiveGroup()])
            fabric.launch()
        _FABRIC[key] = fabric
    return fabric


class LightningFabric:
    """:class:`faults.contract.Checkpointer` over ``Fabric.save`` / ``Fabric.load`` (see the
    module docstring for the exact mapping)."""

    capabilities: tuple[str, ...] = LIMITATIONS

    # -- saving ----------------------------------------------------------------------------

    def save(self, path: str, state: dict[str, Any], *, global_step: int, save_async: bool = False) -> None:
        del save_async  # Fabric has no async save (see the module docstring)
        refuse_dtensors(state, "LightningFabric")
        fabric = _fabric()
        to_save: dict[str, Any] = {}
        for key, value in state.items():
            to_save[key] = module_over(value) if key in ("model", "fp32_main_params") else value
        to_save["global_step"] = global_step
        fabric.save(os.path.join(path, FILE_NAME), to_save)

    def maybe_wait_for_async_save(self) -> None:
        pass

    def raise_for_failed_async_save(self) -> None:
        pass

    # -- loading ---------------------------------------------------------------------------

    def load(self, path: str, state: dict[str, Any], *, strict_model: bool = True,
             extra_state_skeleton: dict[str, Any] | None = None) -> dict[str, Any]:
        want: dict[str, Any] = {}
        for key, value in state.items():
            if key in ("model", "fp32_main_params"):
                want[key] = module_over(value)
            elif key != "extra_state":
                want[key] = value
        if extra_state_skeleton is not None:
            want["extra_state"] = extra_state_skeleton
        _fabric().load(os.path.join(path, FILE_NAME), want, strict=strict_model)
        for key, value in want.items():
            if not isinstance(value, torch.nn.Module):
                state[key] = value
        return state

    # -- the one piece of logic a Fabric script writes itself ---------------------------------

    def find_latest_checkpoint(self, checkpoint_dir: str) -> str | None:
        return highest_step_with(checkpoint_dir, FILE_NAME)
