"""Megatron-Core 0.16.1's distributed checkpointing (``megatron.core.dist_checkpointing``:
``save(sharded_state_dict, checkpoint_dir)`` / ``load(sharded_state_dict, checkpoint_dir)``), on CPU
with gloo.

:class:`MegatronCore` maps the harness contract (:mod:`faults.contract`) onto the two calls and onto
Megatron-Core's own completeness check (``check_is_distributed_checkpoint``), the way Megatron-LM's
``training/checkpointing.py`` uses them for its ``torch_dist`` format. It adds no checkpointing
logic: no commit protocol, fsync, checksum, validation, retry, fallback or error translation
beyond Megatron-Core's (and DCP's, which its default ``torch_dist`` strategy drives:
``TorchDistSaveShardedStrategy`` / ``TorchDistLoadShardedStrategy`` over DCP's
``FileSystemWriter``/``FileSystemReader``; the common part with ``torch.save``/``torch.load``).

The sharded state dict
----------------------
Megatron-Core saves a *sharded state dict*: a nested dict whose tensors to shard are
``ShardedTensor`` s (a local tensor with its global key, shape and offset, and a ``replica_id``)
and whose every other value is "common" state, written by rank 0 into ``common.pt``. The
contract's state dicts become one, as Megatron-LM's model and optimizer ``sharded_state_dict()``
make one:

* ``{"model": {fqn: ShardedTensor.from_rank_offsets("model." + fqn, t, replica_id=rank)}}`` for
  every tensor of ``state["model"]`` (and ``"fp32_main_params."`` for ``state["fp32_main_params"]``);
* ``{"optimizer": {"state": {fqn: {name: ShardedTensor.from_rank_offsets("optimizer.state." +
  fqn + "." + name, t, replica_id=rank)}}, "param_groups": [...]}}``: every tensor of the
  optimizer's per-parameter state a ``ShardedTensor`` (0-dim ``step`` tensors included), the param
  groups (and any non-tensor value) common;
* ``"extra_state"`` and ``"global_step"``: common (as Megatron-LM's ``iteration``, ``args`` and,
  without ``--ckpt-fully-parallel-save`` of RNG state, its RNG states).

The state is replicated (data parallel): every rank offers every tensor whole (no offsets), with
``replica_id=rank``, so rank 0's copy is the main replica and is the one written (Megatron-Core's
``validate_sharding_integrity`` requires exactly one main replica per shard). DTensor (FSDP2)
state is refused with ``TypeError`` before anything is written: mapping FSDP2's shards onto
``ShardedTensor`` offsets is what Megatron's own FSDP does, not what the contract's state is.

What each contract call does
----------------------------
``save(path, state, global_step=N, save_async=False)``
    ``path`` is the step directory ``<root>/global_step_<N>`` (Megatron-LM's is
    ``<save>/iter_<N:07d>``; the contract's name is used as is). Rank 0 ``os.makedirs(path,
    exist_ok=True)`` (Megatron-LM's ``ensure_directory_exists``; ``dist_checkpointing.save``
    needs the directory to exist), then ``dist_checkpointing.save(<sharded state dict>, path)``
    on every rank with every default: the ``torch_dist`` strategy, ``validate_access_integrity=
    True``. Megatron-Core then: rank 0 warns if the directory is not empty ("Overwriting old
    incomplete / corrupted checkpoint..."), checks the common state and the shard coverage
    across ranks, ``torch.save`` s ``common.pt`` (rank 0), has DCP write the shards (its
    ``__<R>_0.distcp`` files and ``.metadata``), and last writes ``metadata.json`` (rank 0) and
    runs a barrier. No pointer file is written (Megatron-LM writes
    ``latest_checkpointed_iteration.txt``; Megatron-Core has none).

    ``save_async=True`` saves synchronously: Megatron-Core's async save (``async_sharded_save=True``
    returns an ``AsyncRequest`` that the caller schedules on an ``AsyncCallsQueue``, which forks a
    writer process and finalizes with collectives) is Megatron-LM's machinery, not a call of
    ``dist_checkpointing``; it is not mapped here. ``maybe_wait_for_async_save()`` and
    ``raise_for_failed_async_save()`` do nothing.
``load(path, state, strict_model=True, extra_state_skeleton=None)``
    ``dist_checkpointing.load(<sharded state dict of state>, path, strict=...)`` -- the sharded
    state dict built from the caller's state as above (without ``"extra_state"``), ``strict=
    StrictHandling.ASSUME_OK_UNEXPECTED`` (Megatron-LM's strict load: a key asked for that the
    checkpoint lacks raises, from DCP) or, with ``strict_model=False``, ``StrictHandling.LOG_ALL``
    (Megatron-LM's non-strict load: such keys are logged and left out). Megatron-Core returns
    the common state (``common.pt``, ``torch.load`` with ``weights_only=False``) with the loaded
    tensors merged in. Then, as Megatron-LM does with it: ``model.load_state_dict(loaded["model"],
    strict=strict_model)`` on a module whose tensors are the caller's (:func:`faults.adapters.
    _plain.module_over`: filled in place), the same for ``"fp32_main_params"``;
    ``state["optimizer"] = loaded["optimizer"]`` (the caller's ``optimizer.load_state_dict``);
    with a skeleton only, ``state["extra_state"] = loaded["extra_state"]``.
``find_latest_checkpoint(root)``
    Megatron-Core has no step search (Megatron-LM reads its tracker file). The adapter supplies
    the one piece the contract needs: the ``global_step_<N>`` directory with the highest ``N``
    for which Megatron-Core's own ``check_is_distributed_checkpoint(dir)`` is true
    (``metadata.json`` exists: the file ``save`` writes last).

Capabilities
------------
None: no root save, no retention, no overwrite refusal (a save into an existing step directory
warns and writes over it), no ``load_latest``, no per-rank extra state (common state is rank 0's
and must agree across ranks), no priming. What it lacks is declared in its ``capabilities``, so
that the suite does not draw it: :data:`LIMITATIONS` (``no_commit_record`` is not among them: DCP's
``.metadata`` is in the step, and ``metadata.json``, written last, is Megatron-Core's own marker).

Importing
---------
``pip install --no-deps megatron-core==0.16.1`` (a binary wheel for CPython 3.11; it requires only
``numpy``, ``packaging`` and ``torch``, all already there). ``megatron.core`` warns that
Transformer Engine and Apex are missing and falls back to local implementations; nothing is
stubbed.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

from ..contract import step_of
from . import Unavailable, ensure_process_group
from ._plain import SyncSaves, module_over, rank_and_world, refuse_dtensors

PACKAGE = "megatron-core"
VERSION = "0.16.1"

try:
    import torch

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "Transformer Engine and Apex are not installed"
        from megatron.core import dist_checkpointing
        from megatron.core.dist_checkpointing import ShardedTensor
        from megatron.core.dist_checkpointing.validation import StrictHandling
except Exception as e:
    raise Unavailable(
        f"megatron-core cannot be imported ({type(e).__name__}: {e}); the Megatron-Core adapter wants "
        f"megatron-core=={VERSION} (pip install --no-deps 'megatron-core=={VERSION}')") from e

if not torch.cuda.is_available():
    try:
        torch.cuda.synchronize()
    except Exception as e:
        raise Unavailable(
            f"megatron-core {VERSION}'s dist_checkpointing.save cannot run on a host without CUDA: its torch_dist "
            "strategy calls torch.cuda.synchronize() after staging the shards (FileSystemWriterAsync.preload_tensors, "
            "non_blocking=True) and broadcasts its failure flag in a tensor on torch.cuda.current_device() "
            f"(save_state_dict_async_finalize); here torch.cuda.synchronize() raises {type(e).__name__}: {e}") from e

__all__ = ["MegatronCore", "PACKAGE", "FINDINGS", "LIMITATIONS"]

#: What this checkpointer lacks, declared as its ``capabilities`` (``faults.contract.Limitation``
#: names: the suite draws no such case and skips what needs it):
#: no async save (here), no sharded (DTensor) state (here), no pointer file.
LIMITATIONS = ("sync_only", "plain_tensors_only", "no_pointer")

#: Diagnoses of what ``python -m faults audit --checkpointer megatron`` would find in Megatron-Core
#: 0.16.1, read from its source (``"[severity:]PROPERTY[|REASON]"`` fnmatch patterns -> the
#: defect; see :func:`faults.audit.explain`). Not yet observed: on a host without CUDA the adapter
#: is unavailable (above), so the audit has run it nowhere yet; each is what the source does.
FINDINGS: dict[str, str] = {
    "violation:test_any_acknowledged_step_number_is_found_and_restored*":
        "a step the search cannot find is acknowledged: dist_checkpointing.save writes any directory it is given "
        "(global_step_-1 too), but find-latest only matches global_step_<digits>",
    "violation:test_acknowledged_save_survives_power_loss*":
        "not durable: the shard files are fsynced (use_fsync=True) but metadata.json is written with a plain "
        "open(..., 'w') after them, and no directory is fsynced; a power cut after save() returned can take the "
        "step's completeness marker",
    "violation:test_an_interrupt_during_a_save_leaves_ranks_agreeing*|*no answer within*":
        "an interrupt on one rank stalls the others: the save runs DCP's planning collectives, the integrity "
        "check's all_gather_object and a final barrier with nothing that makes the ranks agree on the outcome",
    "violation:test_corrupt_payload_never_loads_silently":
        "no checksums: DCP's .distcp shards and common.pt carry none that is checked, so a flipped bit in a tensor "
        "loads as a different value",
    "violation:test_damage_to_each_file_the_load_reads[[]bitflip[]]":
        "no checksums: a flipped bit in a shard, common.pt or .metadata that still parses loads as other values",
    "violation:test_damage_to_each_file_the_load_reads*":
        "damaged steps are chosen: completeness is check_is_distributed_checkpoint (metadata.json exists and "
        "parses); nothing validates the shards, common.pt or DCP's .metadata, so the load raises",
    "violation:test_each_kind_of_damage_falls_back_to_the_previous_step*":
        "damaged steps are chosen: metadata.json says nothing about the shards' integrity",
    "violation:test_damaged_record_or_file_falls_back_without_hanging*":
        "damaged steps are chosen, or find-latest raises: check_is_distributed_checkpoint json.loads metadata.json "
        "unguarded (a torn one raises JSONDecodeError instead of 'not a checkpoint'), and DCP's reader opens the "
        "shards with a plain open()",
    "violation:test_round_trip_is_bitwise":
        "partial optimizer state refused: the strict load (StrictHandling.ASSUME_OK_UNEXPECTED) leaves a key the "
        "checkpoint lacks to DCP, which raises; the contract lets optimizer state be partial",
    "violation:test_multi_rank_round_trip*":
        "partial optimizer state refused: a ShardedTensor the checkpoint lacks (optimizer state of a parameter that "
        "never had a gradient) fails the strict load",
    "violation:test_resume_lands_on_newest_complete_step":
        "damaged steps are chosen (metadata.json is the only completeness signal), or partial optimizer state is "
        "refused (see the round trip)",
    "violation:test_training_run_state_machine*":
        "damaged steps are chosen (metadata.json is the only completeness signal), or partial optimizer state is "
        "refused (see the round trip)",
    "violation:test_interrupted_saves_leave_bounded_disk*":
        "leaks disk: the step directory is made first and DCP writes into it in place; nothing removes what an "
        "interrupted save left (a later save into it only warns 'Overwriting old incomplete / corrupted "
        "checkpoint')",
    "violation:test_no_code_runs_from*":
        "code execution: common.pt is read with torch.load (weights_only=None: torch's safe default) but DCP's "
        ".metadata is unpickled with pickle.load and non-tensor items with torch.load(weights_only=False)",
    "violation:test_hostile_bytes_stay_within_a_memory_bound*":
        "unbounded parse: DCP's .metadata is unpickled with pickle.load, with no bound on what it builds",
    "violation:test_two_writers_in_one_root*":
        "acknowledged save lost: two jobs saving one step write into one directory in place (rank 0 only warns "
        "that it is not empty)",
    "advisory:test_saving_over_a_complete_step_is_refused_or_safe":
        "no overwrite concept: a save into an existing step directory warns and rewrites its files in place",
    "advisory:test_*linked_out_of_the_root*":
        "follows links: files are opened by path with a plain open()",
    "advisory:test_*mistake*[[]*dtype[]]|*casting*":
        "a load into another dtype casts silently: module.load_state_dict's copy_ converts",
    "advisory:test_*mistake*":
        "a destination that cannot receive a tensor fails in DCP's load or in module.load_state_dict",
}


def _sharded(state: dict[str, Any], rank: int) -> dict[str, Any]:
    """The sharded state dict of the contract's ``state`` (see the module docstring)."""

    def sh(key: str, t: torch.Tensor) -> Any:
        return ShardedTensor.from_rank_offsets(key, t, replica_id=rank)

    out: dict[str, Any] = {}
    for name in ("model", "fp32_main_params"):
        if name in state:
            out[name] = {fqn: sh(f"{name}.{fqn}", t) for fqn, t in state[name].items()}
    if "optimizer" in state:
        osd = state["optimizer"]
        opt: dict[str, Any] = {k: v for k, v in osd.items() if k != "state"}
        opt["state"] = {
            fqn: {k: sh(f"optimizer.state.{fqn}.{k}", v) if isinstance(v, torch.Tensor) else v
                  for k, v in per_param.items()}
            for fqn, per_param in osd.get("state", {}).items()}
        out["optimizer"] = opt
    return out


class MegatronCore(SyncSaves):
    """:class:`faults.contract.Checkpointer` over ``megatron.core.dist_checkpointing.save`` /
    ``load`` (see the module docstring for the exact mapping)."""

    capabilities: tuple[str, ...] = LIMITATIONS

    # -- saving ----------------------------------------------------------------------------

    def save(self, path: str, state: dict[str, Any], *, global_step: int, save_async: bool = False) -> None:
        del save_async  # Megatron-Core's async save is Megatron-LM's queue (see the module docstring)
        refuse_dtensors(state, "MegatronCore")
        ensure_process_group()
        rank, _ = rank_and_world()
        sharded = _sharded(state, rank)
        if "extra_state" in state:
            sharded["extra_state"] = state["extra_state"]
        sharded["global_step"] = global_step
        if rank == 0:
            os.makedirs(path, exist_ok=True)
        dist_checkpointing.save(sharded, path)

    # -- loading ---------------------------------------------------------------------------

    def load(self, path: str, state: dict[str, Any], *, strict_model: bool = True,
             extra_state_skeleton: dict[str, Any] | None = None) -> dict[str, Any]:
        ensure_process_group()
        rank, _ = rank_and_world()
        strict = StrictHandling.ASSUME_OK_UNEXPECTED if strict_model else StrictHandling.LOG_ALL
        loaded = dist_checkpointing.load(_sharded(state, rank), path, strict=strict)
        for name in ("model", "fp32_main_params"):
            if name in state:
                module_over(state[name]).load_state_dict(loaded[name], strict=strict_model)
        if "optimizer" in state:
            state["optimizer"] = loaded["optimizer"]
        if extra_state_skeleton is not None:
            state["extra_state"] = loaded["extra_state"]
        return state

    # -- the one piece of logic a Megatron-Core user writes itself ----------------------------

    def find_latest_checkpoint(self, checkpoint_dir: str) -> str | None:
        try:
            names = os.listdir(checkpoint_dir)
        except OSError:
            return None
        best: tuple[int, str] | None = None
        for name in names:
            step = step_of(name)
            if step is None:
                continue
            path = os.path.join(checkpoint_dir, name)
            if dist_checkpointing.check_is_distributed_checkpoint(path) and (best is None or step > best[0]):
                best = (step, path)
        return None if best is None else best[1]

