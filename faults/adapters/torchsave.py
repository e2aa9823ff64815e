"""Plain ``torch.save`` of one state dict per step: the checkpointer most hand-written trainers have.

Nothing is installed for it: it is the pattern of PyTorch's own tutorials ("Saving and Loading a
General Checkpoint", the DDP tutorial's "Save and Load Checkpoints") and of most training scripts,
written the way such a script writes it -- not hardened. :class:`TorchSave` is that pattern behind
the harness contract (:mod:`faults.contract`); everything it does is listed here, and nothing
else is added: no temporary file and rename, no fsync, no checksum, no validation, no retry, no
fallback, no pointer file, no retention.

What each contract call does
----------------------------
``save(path, state, global_step=N, save_async=False)``
    ``path`` is the step directory ``<root>/global_step_<N>``. On rank 0 only (``dist.get_rank()``
    when a process group is initialized, else the one process)::

        os.makedirs(path, exist_ok=True)
        torch.save({"model": ..., "optimizer": ..., "extra_state": ..., "global_step": N},
                   os.path.join(path, "checkpoint.pt"))

    where the entries are the contract's ``state`` entries as they are (the model's and the
    optimizer's state dicts, what ``model.state_dict()`` / ``optimizer.state_dict()`` give a
    trainer; ``"fp32_main_params"`` too when present; ``"extra_state"`` when present) plus the
    step. Then every rank calls ``dist.barrier()`` (the DDP tutorial's "make sure rank 0 has
    saved before others load"), when a process group is initialized. A failure on rank 0 raises
    on rank 0 before the barrier -- the other ranks then wait in it, as a script's would.

    ``save_async=True`` saves synchronously, exactly as above: a hand-written trainer has no
    async save, and one that is asked for "a checkpoint now" writes it now. The contract's async
    calls are then trivially satisfied (the save is acknowledged when it returns).
    ``maybe_wait_for_async_save()`` and ``raise_for_failed_async_save()`` do nothing.

    Plain tensors only: a state holding a DTensor (FSDP2) is refused with ``TypeError`` before
    anything is written (rank 0 would save its own shards only; sharded models are not what this
    pattern is used for).
``load(path, state, strict_model=True, extra_state_skeleton=None)``
    Every rank: ``ckpt = torch.load(os.path.join(path, "checkpoint.pt"), map_location="cpu",
    weights_only=False)`` (see below), then what a script does with it:

    * ``model.load_state_dict(ckpt["model"], strict=strict_model)``, PyTorch's own, on a module
      whose tensors are the caller's ``state["model"]`` (:func:`faults.adapters._plain.module_over`),
      so they are filled in place (``copy_``), missing or unexpected keys raise ``RuntimeError``
      when ``strict_model``; the same for ``"fp32_main_params"`` when the caller has it;
    * ``optimizer.load_state_dict(ckpt["optimizer"])`` is the caller's (the contract's
      ``TrainRun.apply`` does it): ``state["optimizer"]`` becomes the loaded optimizer state dict;
    * extra state only with a skeleton: ``state["extra_state"] = ckpt["extra_state"]`` (the
      skeleton's values are not looked at: a script takes what it saved).

    ``weights_only=False`` is what trainers pass: before torch 2.6 it was the default, and
    scripts that save anything beyond tensors (numpy or Python RNG states, argparse namespaces,
    dataclasses) pass it explicitly since, because the safe unpickler refuses those.
    :class:`TorchSaveWeightsOnly` is the same with ``torch.load``'s own default since 2.6
    (``weights_only=True``).
``find_latest_checkpoint(root)``
    A script's "resume from the newest": the ``global_step_<N>`` directory with the highest
    ``N`` that holds a ``checkpoint.pt`` file (None when none). Nothing is read or validated.
    This is the one piece of logic the adapter supplies because the contract needs it and
    ``torch`` has none.

Capabilities
------------
None: no root save, no retention, no overwrite refusal (``torch.save`` writes over the file in
place), no ``load_latest``, no async save, no priming. Extra state is saved as the caller gives
it, by rank 0 only: per-rank extra state is not declared. What this checkpointer *lacks* that
the suite would otherwise draw is declared in ``capabilities``: :data:`LIMITATIONS`.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from ._plain import SyncSaves, barrier, highest_step_with, module_over, rank_and_world, refuse_dtensors

__all__ = ["TorchSave", "TorchSaveWeightsOnly", "PACKAGE", "FINDINGS", "FILE_NAME", "LIMITATIONS"]

PACKAGE = "torch"
#: The one file of a step.
FILE_NAME = "checkpoint.pt"
#: What this checkpointer lacks, declared as its ``capabilities`` (``faults.contract.Limitation``
#: names: the suite draws no such case and skips what needs it):
#: no async save, no sharded state, no commit record, no pointer file.
LIMITATIONS = ("sync_only", "plain_tensors_only", "no_commit_record", "no_pointer")

#: Diagnoses of what ``python -m faults audit --checkpointer torchsave`` finds, from the pattern
#: above and torch 2.13's ``torch.save``/``torch.load`` (``"[severity:]PROPERTY[|REASON]"``
#: fnmatch patterns -> the defect; see :func:`faults.audit.explain`).
FINDINGS: dict[str, str] = {
    "violation:test_any_acknowledged_step_number_is_found_and_restored*":
        "a step the search cannot find is acknowledged: save() writes any step directory it is given (global_step_-1 "
        "too; nothing checks global_step), but find-latest only matches global_step_<digits>",
    "violation:test_acknowledged_save_survives_power_loss*":
        "not durable: torch.save writes checkpoint.pt through a plain open() and nothing is fsynced (neither the "
        "file nor the step directory nor the root), so a power cut after save() returned can take the step",
    "violation:test_an_interrupt_during_a_save_leaves_ranks_agreeing*|*no answer within*":
        "an interrupt on one rank stalls the others: rank 0 leaves save() from inside torch.save before the "
        "dist.barrier() that the other ranks already wait in (or they leave it while rank 0 still writes), and "
        "nothing makes the ranks agree on the outcome; the peer waits for the process group's whole timeout",
    "violation:test_one_ranks_bad_state_fails_every_rank_quickly*":
        "one rank's failure is not shared: only rank 0 writes and only rank 0 sees a save error; the other ranks "
        "return from the barrier with the step acknowledged, or wait in it for the process group's timeout",
    "violation:test_corrupt_payload_never_loads_silently":
        "no checksums: torch.save records a CRC-32 per zip record but torch.load never checks it, so a flipped "
        "bit in a tensor's bytes loads as a different value",
    "violation:test_damage_to_each_file_the_load_reads[[]bitflip[]]":
        "no checksums: torch.load does not check the zip records' CRC-32, so a flipped bit in checkpoint.pt loads "
        "as a different value (or as a different pickle)",
    "violation:test_a_fallback_never_mixes_two_steps":
        "no checksums: a flipped bit that torch.load still reads resumes a different state silently",
    "violation:test_damage_to_each_file_the_load_reads*":
        "damaged steps are chosen: completeness is 'checkpoint.pt exists' (the script's find-latest), nothing "
        "validates the file, so a damaged newest step is picked and its load raises or returns other values",
    "violation:test_each_kind_of_damage_falls_back_to_the_previous_step*":
        "damaged steps are chosen: find-latest takes the highest step whose checkpoint.pt exists, so a truncated "
        "file is picked and torch.load raises (the zip reader's 'Invalid argument') although the previous step "
        "is intact",
    "violation:test_resume_lands_on_newest_complete_step":
        "damaged steps are chosen: find-latest takes the highest step whose checkpoint.pt exists, torn or not",
    "violation:test_training_run_state_machine*":
        "damaged or torn steps are chosen: torch.save writes checkpoint.pt in place (no temporary file and rename), "
        "so a crash leaves a torn file that find-latest ('checkpoint.pt exists') picks",
    "violation:test_every_crash_state_of_a_save_resumes*":
        "a crash leaves a torn step that is chosen: torch.save writes checkpoint.pt in place, without a temporary "
        "file and rename, and find-latest only asks whether the file exists",
    "violation:test_interrupted_saves_leave_bounded_disk*":
        "leaks disk: os.makedirs creates the step directory first and nothing ever removes one whose save was "
        "interrupted",
    "violation:test_no_code_runs_from*":
        "code execution: checkpoint.pt is read with torch.load(weights_only=False), a full unpickler (what "
        "trainers that keep numpy or Python objects in their checkpoints pass); TorchSaveWeightsOnly does not",
    "violation:test_hostile_bytes_stay_within_a_memory_bound*":
        "unbounded parse: torch.load extracts and unpickles checkpoint.pt with no bound on what it builds and no "
        "checksum to refuse it first",
    "violation:test_two_writers_in_one_root*":
        "acknowledged save lost: two jobs saving one step both succeed, torch.save rewriting the same "
        "checkpoint.pt in place; nothing detects the other writer",
    "violation:test_extra_state_users_keep_round_trips_exactly_or_is_refused_at_save*|*Weights only load failed*":
        "extra state refused at load, not at save: torch.load's safe unpickler (weights_only=True, torch's default "
        "since 2.6) refuses numpy values and RNG objects that torch.save wrote without a complaint",
    "violation:test_drawn_extra_state_round_trips_exactly_or_is_refused_at_save|*Weights only load failed*":
        "extra state refused at load, not at save: torch.load's safe unpickler refuses what torch.save accepted",
    "advisory:test_every_crash_state_of_a_save_resumes*|*thin coverage*":
        "torch.save(obj, path) opens and writes checkpoint.pt in C++ (PyTorchFileWriter), which faults.crashsim "
        "(Python's os calls) does not see: only the makedirs is a crash point, so the torn-file states are judged "
        "by the other crash and damage properties instead",
    "advisory:test_saving_over_a_complete_step_is_refused_or_safe":
        "no overwrite concept: torch.save truncates and rewrites checkpoint.pt in place; a crash in between loses "
        "the acknowledged step",
    "advisory:test_step_directory_linked_out_of_the_root*":
        "follows links: os.makedirs(exist_ok=True) and torch.save's open() follow a step directory linked out of "
        "the root (the save rewrites files there) and torch.load reads through it",
    "advisory:test_*linked_out_of_the_root*":
        "follows links: checkpoint.pt is opened by path with a plain open()",
    "advisory:test_*mistake*[[]*dtype[]]|*casting*":
        "a load into another dtype casts silently: load_state_dict copies each saved tensor with copy_, which "
        "converts",
    "advisory:test_*mistake*[[]*tied[]]*":
        "tied destinations are filled one key at a time: load_state_dict copies both keys into the one memory, "
        "which holds whichever was copied last",
    "advisory:test_*mistake*[[]*meta[]]*":
        "meta destinations are not filled: load_state_dict's copy into a meta tensor is a no-op with a warning "
        "and no error (assign=False), so the state stays on the meta device",
    "advisory:test_*mistake*":
        "a destination that cannot receive a tensor fails in load_state_dict's copy_ (its RuntimeError names the "
        "key) or in the caller's apply",
}


class TorchSave(SyncSaves):
    """:class:`faults.contract.Checkpointer` as a hand-written trainer's ``torch.save`` /
    ``torch.load`` (see the module docstring for the exact mapping)."""

    capabilities: tuple[str, ...] = LIMITATIONS
    #: ``torch.load``'s ``weights_only`` (None: torch's default, ``True`` since torch 2.6).
    weights_only: bool | None = False

    # -- saving ----------------------------------------------------------------------------

    def save(self, path: str, state: dict[str, Any], *, global_step: int, save_async: bool = False) -> None:
        del save_async  # a hand-written trainer saves now (see the module docstring)
        refuse_dtensors(state, "TorchSave")
        rank, _ = rank_and_world()
        if rank == 0:
            ckpt = {k: v for k, v in state.items()}
            ckpt["global_step"] = global_step
            os.makedirs(path, exist_ok=True)
            torch.save(ckpt, os.path.join(path, FILE_NAME))
        barrier()

    # -- loading ---------------------------------------------------------------------------

    def load(self, path: str, state: dict[str, Any], *, strict_model: bool = True,
             extra_state_skeleton: dict[str, Any] | None = None) -> dict[str, Any]:
        ckpt = torch.load(os.path.join(path, FILE_NAME), map_location="cpu", weights_only=self.weights_only)
        module_over(state["model"]).load_state_dict(ckpt["model"], strict=strict_model)
        if "fp32_main_params" in state:
            module_over(state["fp32_main_params"]).load_state_dict(ckpt["fp32_main_params"], strict=strict_model)
        if "optimizer" in state:
            state["optimizer"] = ckpt["optimizer"]
        if extra_state_skeleton is not None:
            state["extra_state"] = ckpt["extra_state"]
        return state

    # -- the one piece of logic a script writes itself ----------------------------------------

    def find_latest_checkpoint(self, checkpoint_dir: str) -> str | None:
        return highest_step_with(checkpoint_dir, FILE_NAME)


class TorchSaveWeightsOnly(TorchSave):
    """:class:`TorchSave` with ``torch.load``'s own default (``weights_only=True`` since torch
    2.6): the safe unpickler, which refuses anything but tensors, primitive types and containers."""

    weights_only = None
