"""VeOmni 0.1.12's DCP checkpointer (``veomni.checkpoint``, the seed family of the contract).

VeOmni builds its checkpointer with ``build_checkpointer(ckpt_manager="dcp", dist_backend=...)``,
which returns the class ``veomni.checkpoint.dcp_checkpointer.DistributedCheckpointer``: every
method is a classmethod and the pending async save (``save_future``) and the async process
group (``_async_process_group``) are *class* attributes, so all instances of this adapter in a
process share one pending save, as all of VeOmni's callers do. :class:`VeOmni` maps the harness
contract (:mod:`faults.contract`) onto that class the way VeOmni's own trainer
(``veomni.trainer.callbacks.checkpoint_callback.CheckpointerCallback``) calls it. It adds no
checkpointing logic: no commit protocol, fsync, checksum, validation, retry, fallback or error
translation beyond VeOmni's own.

Why ``save``/``load`` are not single calls
------------------------------------------
``DistributedCheckpointer.save``/``load`` take *live objects*: ``state["model"]`` must be an
``nn.Module`` and ``state["optimizer"]`` an optimizer; they wrap them in VeOmni's ``Stateful``
wrappers ``ModelState``/``OptimizerState``, whose ``state_dict()`` is
``get_model_state_dict(model)`` / ``get_optimizer_state_dict(model, optimizer)`` and whose
``load_state_dict()`` is ``set_model_state_dict`` / ``set_optimizer_state_dict(strict=False)``.
The contract hands over those state dicts instead (``get_state_dict(model, optimizers)``, already
taken) and applies the loaded ones itself (``TrainRun.apply``). So the adapter runs the body of
``DistributedCheckpointer.save``/``load`` for the arguments VeOmni's trainer passes, through the
class's own steps (``_create_checkpoint_dir``, ``_save_extra_state``, ``_create_storage_writer``,
``execute_save``, ``_create_storage_reader``, ``_ModelStrictLoadPlanner``, ``_load_extra_state``,
``wait_for_pending_save``), with the state dicts where VeOmni puts its wrappers. Nothing else
differs; ``tests/test_adapter_veomni.py`` checks that a checkpoint written by VeOmni's own
``save`` (live model and optimizer) and one written by this adapter load into the same state,
both ways. (VeOmni's ExtraParallel/MoE and ``MultiOptimizer`` paths of the wrappers, LoRA's
``trainable_only``, ``stage_dir`` and ``save_to_lowest_rank`` are not exercised: the trainer's
defaults are used.)

What each contract call does (``ck`` = ``DistributedCheckpointer``)
---------------------------------------------------------------------
Every call needs an initialized default process group, as VeOmni's trainer always has
(``BaseTrainer`` calls ``dist.init_process_group``): the extra-state steps call
``dist.get_rank()`` unguarded. In a process without one (a single-process test), the adapter
creates a 1-rank gloo group first (:func:`faults.adapters.ensure_process_group`), as
``torchrun --nproc-per-node=1`` would; in a world it uses the world's group. In a forked child
(the suite resumes in forked children), or once the default group was replaced, it also
forgets VeOmni's class-level async group and pending save, which belong to the old group.

``save(path, state, global_step=N, save_async=False)``
    ``path`` is the step directory ``<root>/global_step_<N>``, exactly what the trainer passes
    (``os.path.join(save_path, f"global_step_{step}")``, no ``global_steps`` argument;
    ``global_step`` is therefore unused here). As ``ck.save`` does: ``ValueError`` when
    ``"model"`` is missing; ``ck._create_checkpoint_dir(path)`` (``os.makedirs(exist_ok=True)``);
    ``ck._save_extra_state(path, state)`` -- ``torch.save(state["extra_state"],
    path/extra_state/extra_state_rank_<rank>.pt)`` on every rank, *before* the payload, or a
    warning and nothing when there is no ``"extra_state"``; then ``ck.execute_save(save_state,
    ck._create_storage_writer(path), save_async)`` with ``save_state = {"model":
    state["model"]}`` plus ``"optimizer": state["optimizer"]`` when present. Any other entry of
    ``state`` (``"fp32_main_params"``) is dropped, silently, as ``ck.save`` drops it. The writer
    is VeOmni's: ``FileSystemWriter(path, thread_count=16, single_file_per_rank=True,
    sync_files=False)``.

    * sync: ``dcp.save(save_state, storage_writer, planner=DefaultSavePlanner(
      dedup_save_to_lowest_rank=False))``, then ``dist.barrier()``, ``gc.collect()`` and
      VeOmni's ``empty_cache()`` and ``synchronize()`` (``torch.<cuda|npu|mlu|cpu>``). It does
      **not** wait for an earlier async save (VeOmni waits only before an async one). On a host
      without an accelerator, ``empty_cache()`` is ``torch.cpu.empty_cache``, which torch does not
      have: the sync save raises ``AttributeError`` *after* the step is committed. That is
      VeOmni's behaviour and is passed through.
    * async: ``ck.wait_for_pending_save()`` (the earlier async save; its failure raises here),
      then ``ck.save_future = dcp.async_save(save_state, storage_writer,
      process_group=<a gloo group VeOmni creates on first use>, planner=...)``. DCP's default
      stager copies the state before ``async_save`` returns.

    No pointer file is written (VeOmni's DCP checkpointer has none).
``load(path, state, strict_model=True, extra_state_skeleton=None)``
    As ``ck.load`` does: ``ValueError`` when ``state`` is None or has no ``"model"``; ``dcp.load(
    {"model": state["model"]} (+ "optimizer"), storage_reader=ck._create_storage_reader(path),
    process_group=None, planner=_ModelStrictLoadPlanner(strict_model=strict_model))`` -- DCP
    fills the dicts in place (VeOmni's planner allows partial optimizer state and, when
    ``strict_model``, raises on any missing model key; ``strict_model=False`` is VeOmni's
    ``trainable_only=True``). Extra state: VeOmni loads it when the state has an
    ``"extra_state"`` key (the trainer passes ``"extra_state": {}``) and *replaces* the value with
    ``torch.load(path/extra_state/extra_state_rank_<rank>.pt, weights_only=False)``. So with a
    skeleton: ``ck._load_extra_state(path, {"extra_state": skeleton})`` and its result goes into
    ``state["extra_state"]`` (the skeleton itself is not filled); without one, VeOmni's extra
    state step is not run and ``state["extra_state"]`` is left alone. Returns ``state``.
``find_latest_checkpoint(root)``
    VeOmni's finder is ``veomni.utils.checkpoint_utils.get_checkpoint_path(output_dir, ...,
    "dcp")``, which can only look in ``<output_dir>/checkpoints`` (the trainer's ``save_path``).
    The contract's root is that ``save_path``, under any name, so the adapter runs the body of
    ``dcp_get_last_iteration`` + ``get_checkpoint_path`` on ``root`` itself: ``None`` unless
    ``hdfs_io.exists(root)``; each entry of ``hdfs_io.listdir(root)`` goes through VeOmni's own
    ``_validate_dcp_checkpoint_entry(root, entry)`` (``global_step_`` prefix, ``int()`` of the
    rest, a directory, ``exists(.metadata)``); the highest step wins; ``get_checkpoint_path``'s
    ``if not iteration: return None`` (step 0 means "none"); the path returned is
    ``os.path.join(root, f"global_step_{step}")``, rebuilt from the number. The test checks
    that this equals ``get_checkpoint_path(dirname(root))`` for a root named ``checkpoints``.
``maybe_wait_for_async_save()``
    ``ck.wait_for_pending_save()``: ``save_future.result()`` (its failure raises), forget it,
    then ``dist.barrier()`` (only after a success). A no-op with nothing pending.
``raise_for_failed_async_save()``
    VeOmni has no non-blocking check; the thinnest one over its state: when ``ck.save_future``
    is done *and* holds an exception, ``ck.wait_for_pending_save()`` (which raises it once and
    forgets it). A running save, or one that succeeded, is left for the next wait or async save
    (whose barrier every rank must reach together).

Capabilities
------------
``per_rank_extra_state`` only: VeOmni writes one extra-state file per rank
(``extra_state_rank_<rank>.pt``) and each rank reads back its own. Not declared: ``root_save``
(the trainer passes the step directory; ``save(root, global_steps=N)`` exists but treats step 0
as "no step"), ``overwrite`` (no option: an existing step is written over in place), ``keep_last``
(no retention), ``load_latest`` (none), ``embedded_extra_state`` (no ``extra_state_per_rank``
switch: extra state is always per-rank files), ``priming`` (VeOmni's ``OptimizerState`` primes a
live optimizer through ``get_optimizer_state_dict``; this adapter gets state dicts, so priming
is the caller's, as the contract asks).

Importing
---------
``import veomni.checkpoint`` runs ``veomni/__init__.py``, which imports ``transformers`` (through
``veomni.ops``; VeOmni 0.1.12 does not list it as a dependency, and its generated model code says
"Based on: transformers==5.9.0"). ``pip install --no-deps 'veomni==0.1.12'`` plus ``pip install
'transformers==5.9.0'`` (which pulls no torch: transformers 5 has no torch requirement) is all
that importing the checkpoint package needs; nothing is stubbed and no import is bypassed. The
other declared dependencies of VeOmni (datasets, torchdata, wandb, ...) are not needed for it.
"""

from __future__ import annotations

import os
from typing import Any

from . import Unavailable, ensure_process_group
from .dcp import DCP_READER_FINDINGS

PACKAGE = "veomni"
VERSION = "0.1.12"

try:
    import torch.distributed.checkpoint as dcp
    from veomni.checkpoint import build_checkpointer
    from veomni.checkpoint import dcp_checkpointer as _vdcp
    from veomni.utils import checkpoint_utils as _vcu
except Exception as e:
    raise Unavailable(
        f"veomni cannot be imported ({type(e).__name__}: {e}); the VeOmni adapter wants veomni=={VERSION} "
        f"and transformers==5.9.0 (pip install --no-deps 'veomni=={VERSION}' && "
        "pip install 'transformers==5.9.0')") from e

__all__ = ["VeOmni", "VeOmniAcceleratorHost", "PACKAGE"]

#: Diagnoses of what ``python -m faults audit`` finds in VeOmni 0.1.12, read from its source
#: (``"[severity:]PROPERTY[|REASON]"`` fnmatch patterns -> the defect); see
#: :func:`faults.audit.explain`. :class:`VeOmni` on a CPU host adds the ``empty_cache`` one.
_DIAGNOSES = {
    **DCP_READER_FINDINGS,
    "violation:test_any_acknowledged_step_number_is_found_and_restored*|*global_step_True*":
        "a step the search cannot find is acknowledged: a bool (or negative) global_step is formatted into the "
        "directory name unchecked (global_step_True) and the latest-step search parses digits only",
    "violation:test_interrupted_saves_leave_bounded_disk*|*interrupted saves*":
        "leaks disk: the checkpointer saves through dcp.save straight into global_step_N; a save killed before "
        "its .metadata leaves the directory, and no later save removes it",
    "violation:test_an_interrupt_during_a_save_leaves_ranks_agreeing*|*came out as*CheckpointException*":
        "interrupts change type: DCP runs each rank's local save steps under `except BaseException` (_DistWrapper) "
        "and re-raises every failure as CheckpointException, an Exception, so a KeyboardInterrupt or a SIGTERM "
        "handler's SystemExit during VeOmni's save (dcp.save) is swallowed "
        "by a trainer's `except Exception`: a preemption ignored",
    "violation:test_an_interrupt_during_a_save_leaves_ranks_agreeing*|*no answer within*":
        "an interrupt on one rank stalls the others: VeOmni's save has no agreement, so the interrupted rank "
        "leaves before a collective of the save (its own extra-state gather, or DCP's) and its peer waits in it "
        "for the process group's whole timeout",
    "violation:test_one_ranks_bad_state_fails_every_rank_quickly*|*no answer within*":
        "one rank's caller error stalls the others: extra state that cannot be pickled raises on that rank alone, "
        "before any agreement, and the other ranks wait in the save's next collective for the process group's "
        "whole timeout",
    "violation:*|*empty_cache*":
        "every sync save fails on a host without an accelerator: it ends with torch.cpu.empty_cache(), which "
        "torch does not have, so it raises AttributeError after the step is committed (on GPU/NPU hosts this "
        "is torch.cuda/npu.empty_cache; VeOmniAcceleratorHost judges the rest)",
    "violation:test_acknowledged_save_survives_power_loss*":
        "not durable: VeOmni's FileSystemWriter runs with sync_files=False, so nothing (file or directory) is "
        "fsynced; a power cut after save() returned can take the step",
    "violation:test_corrupt_payload_never_loads_silently":
        "no checksums: a flipped bit in a tensor loads as a different value",
    "violation:test_damaged_record_or_file_falls_back_without_hanging[[]fifo_in_step[]]":
        "hangs: payload files are opened with a plain open(), which blocks on a FIFO; find-latest checks "
        "only that .metadata exists",
    "violation:test_damaged_record_or_file_falls_back_without_hanging*":
        "damaged steps are chosen: find-latest checks only that .metadata exists, nothing validates the record, "
        "so resume stops at the damaged newest step although the previous one is intact",
    "violation:test_each_kind_of_damage_falls_back_to_the_previous_step*":
        "damaged steps are chosen: find-latest checks only that .metadata exists, so a step with a missing or "
        "truncated payload or extra-state file is picked and its load raises",
    "violation:test_resume_lands_on_newest_complete_step":
        "damaged steps are chosen: find-latest checks only that .metadata exists",
    "violation:test_training_run_state_machine*":
        "damaged steps are chosen (find-latest checks only that .metadata exists), or a save failed (see the "
        "reason)",
    "violation:test_no_code_runs_from_checkpoint_bytes[[]extra_state[]]":
        "code execution: extra state is read with torch.load(weights_only=False)",
    "violation:test_no_code_runs_from_checkpoint_bytes[[]commit_record[]]":
        "code execution: .metadata is unpickled with pickle.load (DCP's FileSystemReader)",
    "violation:test_no_code_runs_from_checkpoint_bytes[[]shard[]]":
        "code execution: non-tensor items are read with torch.load(weights_only=False) (DCP's planner)",
    "violation:test_multi_rank_round_trip*bf16_main_fp32*":
        "state dropped silently: save() keeps only 'model' and 'optimizer', so the fp32 main parameters "
        "never reach disk and the resumed state differs",
    "violation:test_round_trip_is_bitwise":
        "state dropped silently: save() keeps only 'model' and 'optimizer' (fp32 main parameters are lost)",
    "violation:test_two_writers_in_one_root*":
        "acknowledged save lost: two jobs saving one step both succeed, writing into one directory in place",
    "violation:test_failed_async_save_is_raised_and_never_published*":
        "a failed save is acknowledged: VeOmni's 16-thread writer lets DCP lose exceptions raised in its worker "
        "threads, so a write that failed still commits .metadata and the save reports success",
    "violation:test_pointer_linked_out_of_the_root":
        "see the reason (VeOmni writes no pointer)",
    "advisory:test_failed_async_save_is_raised_and_never_published*":
        "DCP's CheckpointException, a BaseException, reaches the caller: `except Exception` misses it",
    "advisory:test_saving_over_a_complete_step_is_refused_or_safe":
        "no overwrite concept: an existing step is written over in place",
    "advisory:test_step_directory_linked_out_of_the_root|*changed or deleted files*":
        "no overwrite concept: an existing step is written over in place, here through the link",
    "advisory:test_*linked_out_of_the_root*":
        "follows links: files are opened by path with a plain open()",
    "violation:test_a_fallback_never_mixes_two_steps":
        'no checksums: a flipped bit in an extra-state file that torch.load still reads resumes a different extra state silently',
    "violation:test_hostile_bytes_stay_within_a_memory_bound[[]deflated_extra_state[]]":
        "unbounded parse: extra state is read with torch.load, which extracts a compressed zip member whole (1 GiB "
        "from 5 MB) before anything checks it",
    "violation:test_hostile_bytes_stay_within_a_memory_bound[[]record_of_objects[]]":
        "unbounded parse: .metadata is unpickled with pickle.load (DCP's FileSystemReader), with no bound on the "
        "objects it builds",
    "advisory:test_a_fallback_never_mixes_two_steps":
        "a failed load writes into the state: DCP's reader fills the caller's tensors as it reads them, so a load "
        "that then fails (damage further on) leaves part of the state changed; a caller that falls back into the same"
        " objects resumes a mix",
    "advisory:test_*mistake*[[]*dtype[]]|*casting*":
        "a load into another dtype casts silently: DCP's reader copies each saved tensor into its destination with "
        "copy_, which converts",
    "advisory:test_*mistake*[[]*tied[]]*":
        "tied destinations are filled one key at a time: DCP loads both keys into the one memory, so it holds "
        "whichever was read last",
    "advisory:test_*mistake*[[]*meta[]]|*replacing the meta tensors*":
        "meta destinations are replaced, not filled: DCP's planner gives a meta tensor a new one of its own, so the "
        "model the state came from stays on the meta device without an error",
    "advisory:test_*mistake*":
        "DCP's error for a destination that cannot receive a tensor is generic (its CheckpointException, a "
        "BaseException, or the AttributeError of the copy) and does not name the key or the cause",
}
#: (pid, default group) that VeOmni's class-level async group and pending save belong to.
_WORLD: list = [None]


class VeOmni:
    """:class:`faults.contract.Checkpointer` over VeOmni's ``DistributedCheckpointer`` (see the
    module docstring for the exact mapping)."""

    capabilities: tuple[str, ...] = ("per_rank_extra_state",)
    FINDINGS = _DIAGNOSES

    def __init__(self) -> None:
        # what CheckpointerCallback does, with VeOmni's default fsdp_mode ("ddp" gives the same class)
        self._ck = build_checkpointer(ckpt_manager="dcp", dist_backend="fsdp2")

    def _ready(self):
        """VeOmni's class, with a process group (see the module docstring)."""
        import torch.distributed as dist

        ensure_process_group()
        world = (os.getpid(), dist.group.WORLD)
        if _WORLD[0] != world:  # a forked child, or a new default group: the async group and pending save are stale
            _WORLD[0] = world
            self._ck.save_future = None
            self._ck._async_process_group = None
        return self._ck

    # -- saving: DistributedCheckpointer.save's body, state dicts in place of its wrappers ----

    def save(self, path: str, state: dict[str, Any], *, global_step: int, save_async: bool = False) -> None:
        del global_step  # VeOmni's trainer passes the step directory and no global_steps
        ck = self._ready()
        if "model" not in state:
            raise ValueError("Model must be provided to save a distributed checkpoint.")
        ck._create_checkpoint_dir(path)
        ck._save_extra_state(checkpoint_dir=path, state=state)
        save_state = {"model": state["model"]}
        if "optimizer" in state:
            save_state["optimizer"] = state["optimizer"]
        ck.execute_save(save_state=save_state, storage_writer=ck._create_storage_writer(path),
                        save_async=save_async, save_to_lowest_rank=False)

    def maybe_wait_for_async_save(self) -> None:
        self._ready().wait_for_pending_save()

    def raise_for_failed_async_save(self) -> None:
        future = self._ready().save_future
        if future is not None and future.done() and future.exception() is not None:
            self._ck.wait_for_pending_save()

    # -- loading: DistributedCheckpointer.load's body -----------------------------------------

    def load(self, path: str, state: dict[str, Any], *, strict_model: bool = True,
             extra_state_skeleton: dict[str, Any] | None = None) -> dict[str, Any]:
        ck = self._ready()
        if state is None:
            raise ValueError("State dict must be provided to load a distributed checkpoint.")
        if "model" not in state:
            raise ValueError("Model must be provided to load a distributed checkpoint.")
        load_state = {"model": state["model"]}
        if "optimizer" in state:
            load_state["optimizer"] = state["optimizer"]
        dcp.load(state_dict=load_state, storage_reader=ck._create_storage_reader(path), process_group=None,
                 planner=_vdcp._ModelStrictLoadPlanner(strict_model=strict_model))
        if extra_state_skeleton is not None:
            extra = {"extra_state": extra_state_skeleton}
            ck._load_extra_state(checkpoint_dir=path, state=extra)
            state["extra_state"] = extra["extra_state"]
        return state

    # -- dcp_get_last_iteration + get_checkpoint_path, on the root itself ----------------------

    def find_latest_checkpoint(self, checkpoint_dir: str) -> str | None:
        if not _vcu.exists(checkpoint_dir):
            return None
        valid_steps = []
        for entry in _vcu.listdir(checkpoint_dir):
            step = _vcu._validate_dcp_checkpoint_entry(checkpoint_dir, entry)
            if step is not None:
                valid_steps.append(step)
        if not valid_steps:
            return None
        iteration = max(valid_steps)
        if not iteration:
            return None
        return os.path.join(checkpoint_dir, f"{_vcu._GLOBAL_STEP_PREFIX}{iteration}")


class VeOmniAcceleratorHost(VeOmni):
    """:class:`VeOmni` as it runs on a GPU or NPU host, for judging the rest of its checkpointer
    on a CPU-only machine.

    On a host without an accelerator, VeOmni's device helpers resolve to ``torch.cpu``, and its
    sync save ends with ``torch.cpu.empty_cache()``, which torch does not have: every sync save
    raises ``AttributeError`` after the step is committed, and that one defect is all the
    suite sees of :class:`VeOmni` there. On an accelerator host the same call is
    ``torch.cuda.empty_cache()`` (or ``torch.npu``'s), which frees cached device memory and
    touches no file. This class supplies ``torch.cpu.empty_cache`` as a no-op -- the only
    difference from :class:`VeOmni` -- so that the audit shows what VeOmni's checkpointing
    itself does. It changes no checkpointing logic; on a host whose torch has the function, it
    changes nothing."""

    FINDINGS = {k: v for k, v in _DIAGNOSES.items() if "empty_cache" not in k}

    def __init__(self) -> None:
        import torch

        cpu: Any = torch.cpu  # the attribute is added where this torch lacks it
        if not hasattr(cpu, "empty_cache"):
            cpu.empty_cache = lambda: None
        super().__init__()
