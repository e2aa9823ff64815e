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
is declared in its ``capabilities`` so that the suite does not draw it: :data:`LIMITATIONS`.

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
from ._plain import SyncSaves, highest_step_with, module_over, refuse_dtensors

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
#: What this checkpointer lacks, declared as its ``capabilities`` (``faults.contract.Limitation``
#: names: the suite draws no such case and skips what needs it):
#: no async save, no sharded state (here), no commit record, no pointer file.
LIMITATIONS = ("sync_only", "plain_tensors_only", "no_commit_record", "no_pointer")

#: Diagnoses of what ``python -m faults audit --checkpointer lightning`` finds in Lightning 2.6.6,
#: read from its source (``"[severity:]PROPERTY[|REASON]"`` fnmatch patterns -> the defect; see
#: :func:`faults.audit.explain`).
FINDINGS: dict[str, str] = {
    "violation:test_any_acknowledged_step_number_is_found_and_restored*":
        "a step the search cannot find is acknowledged: Fabric.save writes any path it is given (global_step_-1 "
        "too), but find-latest only matches global_step_<digits>",
    "violation:test_acknowledged_save_survives_power_loss*":
        "not durable: _atomic_save writes the torch.save bytes through an fsspec transaction (a temporary file, "
        "then shutil.move into place) and nothing is fsynced, neither the file nor the step directory",
    "violation:test_an_interrupt_during_a_save_leaves_ranks_agreeing*|*no answer within*":
        "an interrupt on one rank stalls the others: Fabric.save writes on global rank 0 only and then calls "
        "fabric.barrier(); a rank interrupted before the barrier leaves the others waiting in it for the process "
        "group's whole timeout (nothing makes the ranks agree on the outcome)",
    "violation:test_one_ranks_bad_state_fails_every_rank_quickly*":
        "one rank's failure is not shared: only global rank 0 writes, so only it sees a save error; the others "
        "return from Fabric's barrier with the step acknowledged, or wait in it for the process group's timeout",
    "violation:test_corrupt_payload_never_loads_silently":
        "no checksums: torch.load (through Lightning's _load) does not check the zip records' CRC-32, so a flipped "
        "bit in a tensor's bytes loads as a different value",
    "violation:test_damage_to_each_file_the_load_reads[[]bitflip[]]":
        "no checksums: a flipped bit in checkpoint.ckpt that torch.load still reads loads as a different value",
    "violation:test_a_fallback_never_mixes_two_steps":
        "no checksums: a flipped bit that torch.load still reads resumes a different state silently",
    "violation:test_damage_to_each_file_the_load_reads*":
        "damaged steps are chosen: Fabric has no step search; 'checkpoint.ckpt exists' (the script's find-latest) "
        "picks a damaged newest step and Fabric.load raises although the previous step is intact",
    "violation:test_each_kind_of_damage_falls_back_to_the_previous_step*":
        "damaged steps are chosen: nothing validates checkpoint.ckpt before Fabric.load, so a truncated file is "
        "picked and torch.load raises (the zip reader's 'Invalid argument') although the previous step is intact",
    "violation:test_resume_lands_on_newest_complete_step":
        "damaged steps are chosen: 'checkpoint.ckpt exists' is the only completeness signal there is",
    "violation:test_training_run_state_machine*":
        "damaged steps are chosen: 'checkpoint.ckpt exists' is the only completeness signal there is",
    "violation:test_every_crash_state_of_a_save_resumes*":
        "a crash leaves a step that is chosen: the step directory is created before the file is moved in, and "
        "shutil.move from the system's temporary directory is a copy (not a rename) when that is another file "
        "system, so a torn checkpoint.ckpt can be left in place",
    "violation:test_interrupted_saves_leave_bounded_disk*":
        "leaks disk: TorchCheckpointIO makes the step directory (and fsspec a temporary file in the system's "
        "temporary directory) before the bytes are moved in; nothing removes what an interrupted save left",
    "violation:test_failed_async_save_is_raised_and_never_published[[]rename[]]":
        "a failed move is acknowledged: fsspec's LocalFileOpener.commit swallows the PermissionError of "
        "shutil.move when the destination exists (an older file at that path), so the save reports success",
    "violation:test_no_code_runs_from*":
        "code execution: see the reason (Fabric.load passes weights_only=None, so torch's safe unpickler is used)",
    "violation:test_hostile_bytes_stay_within_a_memory_bound*":
        "unbounded parse: torch.load extracts checkpoint.ckpt with no bound on what it builds and no checksum to "
        "refuse it first",
    "violation:test_two_writers_in_one_root*":
        "acknowledged save lost: two jobs saving one step both succeed, the later shutil.move replacing the "
        "earlier checkpoint.ckpt; nothing detects the other writer",
    "violation:test_extra_state_users_keep_round_trips_exactly_or_is_refused_at_save*|*Weights only load failed*":
        "extra state refused at load, not at save: Fabric.save pickles any value with torch.save, but Fabric.load "
        "passes weights_only=None, i.e. torch's safe unpickler (torch >= 2.6), which refuses numpy values and RNG "
        "objects; the checkpoint cannot be resumed without weights_only=False",
    "violation:test_drawn_extra_state_round_trips_exactly_or_is_refused_at_save|*Weights only load failed*":
        "extra state refused at load, not at save: Fabric.save accepts any picklable value, Fabric.load's default "
        "(torch's safe unpickler) refuses numpy values and RNG objects",
    "advisory:test_saving_over_a_complete_step_is_refused_or_safe":
        "no overwrite concept: a save over an existing checkpoint.ckpt replaces it (shutil.move over it, a copy "
        "when the temporary file is on another file system)",
    "advisory:test_step_directory_linked_out_of_the_root*":
        "follows links: fs.makedirs and shutil.move follow a step directory linked out of the root (the save "
        "replaces the file there) and the load reads through it",
    "advisory:test_*linked_out_of_the_root*":
        "follows links: checkpoint.ckpt is opened by path (fsspec's LocalFileSystem.open)",
    "advisory:test_*mistake*[[]*dtype[]]|*casting*":
        "a load into another dtype casts silently: Fabric loads the model with module.load_state_dict, whose copy_ "
        "converts",
    "advisory:test_*mistake*[[]*tied[]]*":
        "tied destinations are filled one key at a time: module.load_state_dict copies both keys into the one "
        "memory, which holds whichever was copied last",
    "advisory:test_*mistake*[[]*meta[]]*":
        "meta destinations are not filled: module.load_state_dict's copy into a meta tensor is a no-op with a "
        "warning (assign=False), so the state stays on the meta device",
    "advisory:test_*mistake*":
        "a destination that cannot receive a tensor fails in module.load_state_dict (its RuntimeError names the "
        "key) or in the caller's apply",
}


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


class LightningFabric(SyncSaves):
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
