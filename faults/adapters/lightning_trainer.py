"""Lightning 2.6.6's ``Trainer`` checkpointing: ``ModelCheckpoint(save_top_k=k)`` writing through
``Trainer.save_checkpoint``, and a restore through ``ckpt_path=``.

:class:`LightningTrainer` maps the harness contract (:mod:`faults.contract`) onto what a
``LightningModule`` user gets from the Trainer (Lightning's "Checkpointing" pages): the
``ModelCheckpoint`` callback saves, keeps the top ``k`` and deletes the rest; a restart passes
``ckpt_path=`` to ``trainer.fit`` / ``validate`` and the Trainer restores the module (its
``on_load_checkpoint`` hook and ``load_state_dict`` with the module's ``strict_loading``) and the
callbacks' state. The checkpoint I/O is Lightning's default ``TorchCheckpointIO`` (``torch.save``
through an ``fsspec`` transaction; ``torch.load`` with ``weights_only`` as the Trainer passes it). It
adds no checkpointing logic: no commit protocol, fsync, checksum, validation, retry, fallback or
error translation beyond Lightning's own.

Building the Trainer
--------------------
One ``Trainer`` per checkpointer instance (its ``ModelCheckpoint`` keeps the top-``k`` bookkeeping,
as one training job's callback does), for the live world:

* without a process group, or in a world of one rank: ``Trainer(accelerator="cpu", devices=1)``;
* in a world of ``n > 1`` ranks: ``Trainer(accelerator="cpu", devices=n, strategy="ddp",
  plugins=[<cluster environment>])`` with the cluster environment of the Fabric adapter
  (:class:`faults.adapters.lightning._LiveGroup`: the live default group's rank and size,
  processes created externally, so nothing is spawned and the group is kept).

Logging, progress bars and the model summary are off; nothing else is configured.

Step directory and file
-----------------------
``ModelCheckpoint(dirpath=<root>, filename="global_step_{step}/checkpoint", monitor="step",
mode="max", save_top_k=k, auto_insert_metric_name=False, enable_version_counter=False)``: the file
of step ``N`` is ``<root>/global_step_N/checkpoint.ckpt`` and the top ``k`` are the ``k`` highest
steps (the newest, in a run whose steps grow). ``save_top_k=-1`` (keep all) without ``keep_last``.
Lightning creates the directory (``fs.makedirs`` in ``TorchCheckpointIO``); when ``ModelCheckpoint``
deletes a file that fell out of the top ``k`` it leaves its (now empty) directory, which the
adapter removes with ``os.rmdir`` -- the one step a user of this naming adds so that the root
holds only steps.

What each contract call does
----------------------------
``save(path, state, global_step=N, save_async=False)``
    The module (a ``LightningModule`` whose ``state_dict()`` is the caller's model tensors,
    registered not copied: :func:`faults.adapters._plain.module_over`) is connected to the Trainer
    (``trainer.strategy.connect``); the ``ModelCheckpoint`` is told the monitored value
    ``{"step": N}`` and runs its own top-``k`` save (``_save_topk_checkpoint``, what its
    ``on_train_batch_end`` / ``on_validation_end`` hooks call): ``trainer.save_checkpoint`` of the
    Trainer's checkpoint dict, which holds the module's ``state_dict`` and what the module's
    ``on_save_checkpoint`` hook adds: the optimizer state dict (``"optimizer"``; the contract hands
    over a state dict, not a ``torch.optim.Optimizer`` the Trainer would own), ``fp32_main_params``
    and extra state when present. Rank 0 writes; every rank then waits in the strategy's barrier.
    ``path`` must be ``<root>/global_step_<N>`` (``ModelCheckpoint`` names the file; any other path
    is refused with ``ValueError`` before anything is written).

    ``save_async=True`` saves synchronously (the Trainer's ``AsyncCheckpointIO`` plugin is
    experimental and not what ``ModelCheckpoint`` uses by default); ``maybe_wait_for_async_save()``
    and ``raise_for_failed_async_save()`` do nothing. Plain tensors only (a DTensor is refused with
    ``TypeError`` before anything is written).
``load(path, state, strict_model=True, extra_state_skeleton=None)``
    ``trainer.validate(module, dataloaders=<empty>, ckpt_path=path/checkpoint.ckpt)``: the Trainer
    loads the file, calls the module's ``on_load_checkpoint`` (which takes the optimizer state,
    ``fp32_main_params`` and -- only with a skeleton -- extra state) and then
    ``module.load_state_dict(checkpoint["state_dict"], strict=module.strict_loading)``
    (``strict_loading = strict_model``), which fills the caller's tensors in place; the callbacks'
    state is restored too. No batch runs.
``find_latest_checkpoint(root)``
    The Trainer has no such helper (a user passes ``ckpt_path="last"`` or a path they chose). The
    one piece of logic the contract needs: the ``global_step_<N>`` directory with the highest
    ``N`` that holds ``checkpoint.ckpt``; nothing is read or validated.

Capabilities
------------
``keep_last`` (``factory(keep_last=k)`` is ``save_top_k=k``). What it lacks is declared:
:data:`LIMITATIONS`.

Importing
---------
As the Fabric adapter (:mod:`faults.adapters.lightning`): ``lightning==2.6.6`` with
``lightning-utilities`` and ``torchmetrics``, ``--no-deps``. ``import lightning.pytorch`` imports
``torchmetrics``; nothing is stubbed.
"""

from __future__ import annotations

import os
import re
import warnings
from typing import Any

from . import Unavailable
from ._plain import SyncSaves, highest_step_with, module_over, refuse_dtensors
from .lightning import _LiveGroup  # raises Unavailable, saying why, where lightning cannot be imported

PACKAGE = "lightning"
VERSION = "2.6.6"

try:
    import torch
    from lightning.pytorch import LightningModule, Trainer
    from lightning.pytorch.callbacks import ModelCheckpoint
except Exception as e:
    raise Unavailable(
        f"lightning cannot be imported ({type(e).__name__}: {e}); the Lightning Trainer adapter wants "
        f"lightning=={VERSION} (pip install --no-deps 'lightning=={VERSION}' 'lightning-utilities==0.15.3' "
        "'torchmetrics==1.9.0')") from e

__all__ = ["LightningTrainer", "PACKAGE", "FINDINGS", "FILE_NAME", "LIMITATIONS"]

#: The one file of a step (``ModelCheckpoint`` appends ``.ckpt`` to its ``filename``).
FILE_NAME = "checkpoint.ckpt"
#: Declared as missing: no async save, no sharded state (here), no commit record, no pointer file.
LIMITATIONS = ("sync_only", "plain_tensors_only", "no_commit_record", "no_pointer")
_STEP_DIR = re.compile(r"global_step_(\d+)")
#: the validation data of a restore: none, so no batch runs
_NO_BATCHES: Any = []

#: Diagnoses of what ``python -m faults audit --checkpointer lightning-trainer`` finds, read from
#: Lightning 2.6.6's source (see :data:`faults.adapters.lightning.FINDINGS` for the shared I/O).
FINDINGS: dict[str, str] = {
    "violation:test_repeated_saves_and_loads_leak_nothing*|*retention never deletes*":
        "the checkpoint resumed from is never deleted: ModelCheckpoint._should_remove_checkpoint returns False for "
        "trainer.ckpt_path, so each restore through ckpt_path pins that step beyond save_top_k",
    "violation:test_one_ranks_mistake_in_a_world*|*did not answer*":
        "one rank's error stalls the others: a load that fails on one rank (a meta destination) leaves the other in "
        "the DDP strategy's collectives of trainer.validate; nothing makes the ranks agree on the outcome",
    "advisory:test_a_reader_in_another_pid_namespace_is_never_deleted_under*":
        "retention deletes under a reader: ModelCheckpoint removes the file that left the top k with no notion of "
        "a job still reading it",
    "advisory:test_deep_tree_in_a_step_breaks_neither_resume_nor_retention_nor_later_saves":
        "ModelCheckpoint removes the file only; the emptied directory is removed by the adapter's os.rmdir, which "
        "leaves a directory holding anything else",
    "advisory:test_retention_keeps_the_older_save_it_just_acknowledged":
        "a save outside the top k is never written: ModelCheckpoint._save_topk_checkpoint skips it "
        "(check_monitor_top_k) and returns normally, so a save of an older step than the kept ones is acknowledged "
        "and not on disk",
    "violation:test_acknowledged_save_survives_power_loss*":
        "not durable: TorchCheckpointIO._atomic_save writes through an fsspec transaction (a temporary file, then "
        "shutil.move) and nothing is fsynced, neither the file nor the step directory",
    "violation:test_an_interrupt_during_a_save_leaves_ranks_agreeing*|*no answer within*":
        "an interrupt on one rank stalls the others: rank 0 writes, then every rank waits in the strategy's "
        "barrier; nothing makes the ranks agree on the outcome",
    "violation:test_one_ranks_bad_state_fails_every_rank_quickly*":
        "one rank's failure is not shared: only global rank 0 writes, so only it sees a save error",
    "violation:test_corrupt_payload_never_loads_silently":
        "no checksums: torch.load (pl_load) does not check the zip records' CRC-32, so a flipped bit in a tensor's "
        "bytes loads as a different value",
    "violation:test_damage_to_each_file_the_load_reads[[]bitflip*":
        "no checksums: a flipped bit in checkpoint.ckpt that torch.load still reads loads as a different value",
    "violation:test_a_fallback_never_mixes_two_steps":
        "no checksums: a flipped bit that torch.load still reads resumes a different state silently",
    "violation:test_damage_to_each_file_the_load_reads*":
        "damaged steps are chosen: ckpt_path names one file and nothing validates it first; the Trainer raises "
        "although the previous step is intact",
    "violation:test_each_kind_of_damage_falls_back_to_the_previous_step*":
        "damaged steps are chosen: a truncated checkpoint.ckpt is picked and torch.load raises although the "
        "previous step is intact",
    "violation:test_resume_lands_on_newest_complete_step":
        "damaged steps are chosen: 'checkpoint.ckpt exists' is the only completeness signal there is",
    "violation:test_training_run_state_machine*":
        "damaged steps are chosen, or an acknowledged step is deleted: see the reason",
    "violation:test_every_crash_state_of_a_save_resumes*":
        "a crash leaves a step that is chosen: the step directory is created before the file is moved in, and "
        "shutil.move from the system's temporary directory is a copy when that is another file system",
    "violation:test_interrupted_saves_leave_bounded_disk*":
        "leaks disk: the step directory (and fsspec's temporary file) are made before the bytes are moved in; "
        "nothing removes what an interrupted save left",
    "violation:test_retention*":
        "top-k is by the monitored value, not by completeness: ModelCheckpoint deletes the file that fell out of "
        "its in-memory top k (best_k_models) whether or not the kept ones are intact, and a fresh Trainer knows "
        "only what the restored callback state says",
    "violation:test_two_writers_in_one_root*":
        "acknowledged save lost: two jobs saving one step both succeed, the later move replacing the earlier "
        "file; nothing detects the other writer",
    "violation:test_no_code_runs_from*":
        "code execution: see the reason (the Trainer's load passes weights_only as its caller does)",
    "violation:test_hostile_bytes_stay_within_a_memory_bound*":
        "unbounded parse: torch.load extracts checkpoint.ckpt with no bound on what it builds",
    "violation:test_*extra_state*round_trips_exactly_or_is_refused_at_save*|*Weights only load failed*":
        "extra state refused at load, not at save: the Trainer's save pickles any value, its load uses torch's "
        "safe unpickler by default, which refuses numpy values and RNG objects",
    "advisory:test_saving_over_a_complete_step_is_refused_or_safe":
        "no overwrite concept: a save over an existing checkpoint.ckpt replaces it",
    "advisory:test_*linked_out_of_the_root*":
        "follows links: checkpoint.ckpt is opened and moved by path",
    "advisory:test_*mistake*":
        "a destination that cannot receive a tensor is filled by module.load_state_dict's copy_ (casting, one "
        "memory for tied keys, a no-op for meta) or fails there naming the key",
}


class _Holder(LightningModule):
    """The user's ``LightningModule``: the model (and ``fp32_main_params``) as submodules over the
    caller's tensors; the optimizer state and extra state through the checkpoint hooks."""

    def __init__(self, state: dict[str, Any], extra_state_skeleton: dict[str, Any] | None, *, saving: bool) -> None:
        super().__init__()
        self.model = module_over(state["model"])
        if "fp32_main_params" in state:
            self.fp32_main_params = module_over(state["fp32_main_params"])
        self._state = state
        self._saving = saving
        self._skeleton = extra_state_skeleton
        self.loaded: dict[str, Any] = {}

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        for key, value in self._state.items():
            if key not in ("model", "fp32_main_params"):
                checkpoint[key] = value

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        for key in self._state:
            if key not in ("model", "fp32_main_params", "extra_state"):
                if key not in checkpoint:
                    raise KeyError(f"{key!r} is not in the checkpoint")
                self.loaded[key] = checkpoint[key]
        if self._skeleton is not None:
            if "extra_state" not in checkpoint:
                raise KeyError("'extra_state' is not in the checkpoint")
            self.loaded["extra_state"] = checkpoint["extra_state"]

    def validation_step(self, batch: Any, batch_idx: int) -> None:  # pragma: no cover - no batch runs
        return None


class LightningTrainer(SyncSaves):
    """:class:`faults.contract.Checkpointer` over ``ModelCheckpoint(save_top_k)`` and the Trainer's
    ``ckpt_path`` restore (see the module docstring for the exact mapping)."""

    capabilities: tuple[str, ...] = ("keep_last", *LIMITATIONS)

    def __init__(self, keep_last: int | None = None) -> None:
        if keep_last is not None and keep_last < 1:
            raise ValueError(f"keep_last must be >= 1, got {keep_last}")
        self._keep_last = keep_last
        self._trainer: Trainer | None = None
        self._callback: ModelCheckpoint | None = None
        self._root: str | None = None

    def _trainer_for(self, root: str | None) -> tuple[Trainer, ModelCheckpoint]:
        if self._trainer is not None and (root is None or root == self._root):
            assert self._callback is not None
            return self._trainer, self._callback
        import torch.distributed as dist

        n = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        callback = ModelCheckpoint(dirpath=root, filename="global_step_{step}/checkpoint", monitor="step",
                                   mode="max", save_top_k=self._keep_last if self._keep_last is not None else -1,
                                   auto_insert_metric_name=False, enable_version_counter=False)
        kwargs: dict[str, Any] = {"accelerator": "cpu", "devices": n, "logger": False, "enable_progress_bar": False,
                                  "enable_model_summary": False, "enable_checkpointing": True,
                                  "callbacks": [callback], "limit_val_batches": 0}
        if n > 1:
            kwargs.update(strategy="ddp", plugins=[_LiveGroup()])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer = Trainer(**kwargs)
        self._trainer, self._callback, self._root = trainer, callback, root
        return trainer, callback

    # -- saving ----------------------------------------------------------------------------

    def save(self, path: str, state: dict[str, Any], *, global_step: int, save_async: bool = False) -> None:
        del save_async  # no async save (see the module docstring)
        refuse_dtensors(state, "LightningTrainer")
        path = os.path.abspath(path)
        root, name = os.path.split(path)
        if _STEP_DIR.fullmatch(name) is None or int(name.split("_")[-1]) != global_step:
            raise ValueError(f"LightningTrainer saves global_step_{global_step} under a root "
                             f"(ModelCheckpoint names the file), not {path!r}")
        trainer, callback = self._trainer_for(root)
        holder = _Holder(state, None, saving=True)
        trainer.strategy.connect(holder)
        before = set(_step_dirs(root))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            callback._save_topk_checkpoint(trainer, {"step": torch.tensor(global_step)})
        # ModelCheckpoint removes a file that left the top k, not its directory
        for name in before:
            d = os.path.join(root, name)
            if not os.path.exists(os.path.join(d, FILE_NAME)):
                try:
                    os.rmdir(d)
                except OSError:
                    pass

    # -- loading ---------------------------------------------------------------------------

    def load(self, path: str, state: dict[str, Any], *, strict_model: bool = True,
             extra_state_skeleton: dict[str, Any] | None = None) -> dict[str, Any]:
        from torch.utils.data import DataLoader

        trainer, _callback = self._trainer_for(os.path.dirname(os.path.abspath(path)))
        holder = _Holder(state, extra_state_skeleton, saving=False)
        holder.strict_loading = strict_model
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.validate(holder, dataloaders=DataLoader(_NO_BATCHES), ckpt_path=os.path.join(path, FILE_NAME),
                             verbose=False)
        state.update(holder.loaded)
        return state

    # -- the one piece of logic a Trainer user writes themselves -------------------------------

    def find_latest_checkpoint(self, checkpoint_dir: str) -> str | None:
        return highest_step_with(checkpoint_dir, FILE_NAME)


def _step_dirs(root: str) -> list[str]:
    try:
        return [n for n in os.listdir(root) if _STEP_DIR.fullmatch(n)]
    except OSError:
        return []
