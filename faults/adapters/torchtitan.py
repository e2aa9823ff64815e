"""torchtitan 0.3.0's ``CheckpointManager`` (``torchtitan.components.checkpoint``, which
re-exports ``torchtitan.components.checkpointer.dcp.CheckpointManager``).

:class:`TorchTitan` maps the harness contract (:mod:`faults.contract`) onto torchtitan's own
``CheckpointManager.save(curr_step)`` / ``load(step)`` / ``maybe_wait_for_staging()`` /
``maybe_wait_for_saving()`` and its step search, the calls torchtitan's ``Trainer`` makes. It adds
no checkpointing logic: no commit protocol, fsync, checksum, validation, retry, fallback or error
translation beyond torchtitan's (and DCP's, which torchtitan calls with its own planner and
storage choices: ``dcp.save``/``dcp.async_save``/``dcp.load`` with ``checkpoint_id`` only, so
DCP's default ``FileSystemWriter``/``Reader`` and default planners).

Building the manager
--------------------
One ``CheckpointManager`` per checkpoint root and async mode, built on first use exactly as
``Trainer`` builds it (``config.checkpoint.build(...)`` is ``CheckpointManager(config, ...)``).
torchtitan fixes the async mode per manager, in its config; the contract picks it per save, so a
root gets a manager for its sync saves and another for its async ones (both retain in the same
folder; loads and the step search use the sync one). Rather than switch ``async_mode`` on a live
manager, each is a manager configured for its mode:

* ``CheckpointManager.Config(enable=True, folder=<root, absolute>, interval=1,
  keep_latest_k=<keep_last or 0>, async_mode=<"disabled" or "async">,
  initial_load_model_only=False)``, every other field at torchtitan's default;
  ``base_folder=""`` (the trainer's ``dump_folder``; ``filesystem.join("", root)`` is ``root``).
  ``interval=1``: torchtitan saves a step when ``curr_step % interval == 0``, so every contract
  ``save`` is a torchtitan save. ``keep_latest_k=0`` ("retain all") without ``keep_last``: the
  contract keeps every step unless asked (torchtitan's default is 10).
  ``initial_load_model_only=False`` only silences a log warning: it has no effect without an
  ``initial_load_path``.
* ``dataloader`` and ``lr_schedulers``: ``Stateful`` objects with an empty state dict (what
  torchtitan's own unit tests pass; the contract's training state has neither: data position
  and schedules live in its extra state), so they save and load nothing. ``model_parts=[]`` and
  ``optimizers=<the same empty Stateful>``: the real ones are bound per call (below).
  ``states={}`` (the trainer passes ``{"train_state": trainer}``), ``sd_adapter=None``.
* Process group: torchtitan creates its own gloo group for async saves (``dist.new_group(
  backend="gloo")`` in ``__init__`` when ``async_mode != "disabled"``) and asks ``dist.get_rank()``
  before retention (``keep_latest_k > 0``); both need the *default* process group initialized,
  as torchtitan's ``Trainer`` always does (``dist_utils.init_distributed``, also at one rank).
  In a process without one (a single-process test), the adapter creates a 1-rank gloo group
  first (:func:`faults.adapters.ensure_process_group`), as ``torchrun --nproc-per-node=1``
  would; in a world it uses the world's. In a forked child (the suite resumes in forked
  children) it builds fresh managers: the parent's hold a gloo group whose threads did not
  survive the fork.

The contract hands over state dicts per call; torchtitan holds ``Stateful`` objects for its
lifetime. So before each ``save``/``load`` the adapter points the manager's ``states`` entries at
that call's dicts: ``states["model"] = ModelWrapper([part])`` (a fresh torchtitan
``ModelWrapper``, which is what ``CheckpointManager.__init__`` puts there: its storage cache
then never copies one call's tensors into another's), and ``states[key] = <Stateful>`` for every
other entry of ``state`` (``"optimizer"``, ``"fp32_main_params"``, ``"extra_state"``), whose
``state_dict()`` returns the caller's dict (or list of optimizer dicts) itself and whose
``load_state_dict()`` receives it back, filled in place by DCP. torchtitan's own code then
does the rest: ``_flattened_model_states_sd`` (model keys flattened to the top level of the DCP
state dict, the other entries nested under their names), ``dcp_save``, ``dcp_load``,
``ModelWrapper.load_state_dict``.

Step directory names
--------------------
torchtitan names steps ``<folder>/step-<N>``; the contract wants ``<root>/global_step_<N>``.
``folder`` is the root, and a subclass of ``CheckpointManager`` overrides exactly three methods:

* ``_create_checkpoint_id(step, folder="")`` -- torchtitan's one hook that composes a step
  path (used by ``_save``, ``_save_last_step`` and ``_load``):
  ``filesystem.join(folder, f"global_step_{step}")`` instead of ``f"step-{step}"``.
* ``_find_load_step(folder="")`` and ``_purge_stale_checkpoints()`` -- these do not call that
  hook: each has the pattern ``r"step-(\\d+)"`` written inline (``re.search`` over
  ``filesystem.listdir(folder)``), so no hook can change it. Each override is torchtitan's body
  with that one literal replaced by ``r"global_step_(\\d+)"``, nothing else changed
  (``tests/test_adapter_torchtitan.py`` compares the syntax trees with the installed torchtitan,
  so a change there fails the test instead of drifting silently). ``re.search`` stays, as in
  torchtitan: a name that merely *contains* ``global_step_<N>`` counts.

What each contract call does (``m`` = the manager of ``dirname(path)``)
---------------------------------------------------------------------
``save(path, state, global_step=N, save_async=False)``
    ``path`` must be ``<root>/global_step_<N>`` with ``N == global_step`` (torchtitan derives the
    directory from the step; ``ValueError`` otherwise). First ``maybe_wait_for_async_save()``
    (below). Then, on the root's ``async_mode="disabled"`` manager (sync) or ``"async"`` manager
    (async), the states are bound and ``m.save(N)`` runs torchtitan's ``_save``:
    ``maybe_wait_for_saving()``, ``dcp_save(<flattened states>, checkpoint_id=<root>/
    global_step_<N>, ...)`` -- sync: ``dcp.save``; async: ``dcp.async_save(..., process_group=
    <its gloo group>)``, which copies the state to CPU before it returns (DCP's default stager),
    the future kept in ``m.save_future`` -- then ``_purge_stale_checkpoints()`` (``keep_last``).
    Then ``m.maybe_wait_for_staging()``, which torchtitan's trainer calls before the next
    optimizer step (a no-op in ``"async"`` mode, whose staging is done when ``async_save``
    returns). No pointer file is written (torchtitan has none). ``save_async=True`` uses
    ``"async"``, the mode torchtitan's config documentation recommends ("For most users,
    "async" should suffice"); ``"async_with_pinned_mem"`` (a CUDA-stream, shared-memory, separate
    process stager) is torchtitan's option for near-zero checkpoint times; the class attribute
    ``async_mode`` names the mode, and only ``"async"`` is exercised here.
``load(path, state, strict_model=True, extra_state_skeleton=None)``
    ``m.load(step=N)`` on the root's sync-mode manager (loading does not depend on the async
    mode): torchtitan's ``_load`` -- ``FileNotFoundError`` when the root or
    ``<root>/global_step_<N>`` is not there, else ``dcp_load``: ``dcp.load(<flattened states>,
    checkpoint_id=...)`` with DCP's default planner, then ``ModelWrapper.load_state_dict``. The
    bound states are every entry of ``state`` except ``"extra_state"``, plus ``"extra_state":
    copy.deepcopy(extra_state_skeleton)`` when a skeleton is given; what torchtitan loaded into
    the extra-state entry becomes ``state["extra_state"]``. Without a skeleton, extra state is not
    loaded and ``state["extra_state"]`` is left alone. Returns ``state``.

    ``strict_model`` is not mapped: torchtitan has no partial load of the model (its
    ``exclude_from_loading`` refuses ``"model"``), and DCP's default planner raises on *any*
    missing key, model or optimizer; so ``strict_model=False`` loads as strictly. Step 0 is
    torchtitan's seed checkpoint: ``_load`` restores only the model from it (``model_only =
    step == 0``), and the extra state is then not restored.
``find_latest_checkpoint(root)``
    What ``load(step=-1)`` does to pick its step: ``None`` unless ``filesystem.exists(root)``;
    ``m._find_load_step()`` -- the highest ``N`` among entries whose name matches, whose
    ``.metadata`` (DCP's) or ``model.safetensors.index.json`` is a file; ``-1`` -> ``None``; else
    ``m._create_checkpoint_id(N)``, i.e. ``<root>/global_step_<N>``.
``maybe_wait_for_async_save()``
    ``maybe_wait_for_staging()`` then ``maybe_wait_for_saving()`` of every manager this adapter
    made -- what torchtitan runs before its next save: ``save_future.result()`` (the failure
    raises), then ``save_future = None``. torchtitan clears the future only after ``result()``
    returned, so a *failed* async save stays pending in its manager and raises again from every
    later wait, poll and save of that manager; the adapter does not clear it.
``raise_for_failed_async_save()``
    torchtitan has no non-blocking check; the thinnest one over its state: for each manager whose
    ``save_future`` is done, ``maybe_wait_for_saving()`` (raises a failure; forgets a success).
    A running save is left alone.
``close()``
    Not in the contract: ``close()`` of every manager (torchtitan's: joins the purge thread,
    closes a pinned-memory stager). It does not wait for an async save, as torchtitan's doesn't.

Extra state and capabilities
----------------------------
``state["extra_state"]`` is one more entry of torchtitan's ``states`` (as the trainer's
``"train_state"`` is). DCP keeps one copy of a replicated non-tensor or tensor value, so extra
state must be rank-invariant: ``per_rank_extra_state`` is not declared. Declared: ``keep_last``
(``factory(keep_last=k)`` -> ``keep_latest_k=k``: after each save, rank 0 queues all but the
``k`` highest-numbered matching directories -- complete or not, including the step just saved,
whose async write may still be running -- for deletion by torchtitan's background purge
thread). torchtitan refuses ``keep_latest_k=1`` ("We need to maintain at least 2 checkpoint
replicas, as the last one may be in the process of being saved"): ``factory(keep_last=1)``
raises that ``ValueError``. Not declared: ``overwrite`` (no such concept: a save of an existing
step is written over in place by DCP), ``root_save`` (``save`` takes the step directory),
``load_latest``, ``embedded_extra_state`` (one layout only) and ``priming`` (this adapter gets
state dicts, not an optimizer).

Importing
---------
``pip install --no-deps torchtitan==0.3.0`` then ``pip install tyro==1.0.17`` (pure Python; it
pulls ``docstring-parser`` 0.18.0 and ``typeguard`` 4.6.1; torchtitan requires ``tyro``
unpinned). ``torchtitan.config`` imports ``tyro`` for its command line, and that is the only
missing import on the way to ``CheckpointManager``; nothing is stubbed.
"""

from __future__ import annotations

import copy
import os
import re
from typing import Any

from ..contract import step_dir_name, step_of
from . import Unavailable, ensure_process_group
from .dcp import DCP_READER_FINDINGS

PACKAGE = "torchtitan"
VERSION = "0.3.0"

try:
    import torch.nn as nn
    from torch.distributed.checkpoint.stateful import Stateful
    from torchtitan.components.checkpoint import MODEL, CheckpointManager, ModelWrapper
    from torchtitan.components.checkpointer.base import DATALOADER, LR_SCHEDULER
    from torchtitan.tools import filesystem
except Exception as e:
    raise Unavailable(
        f"torchtitan cannot be imported ({type(e).__name__}: {e}); the torchtitan adapter wants "
        f"torchtitan=={VERSION} (pip install --no-deps 'torchtitan=={VERSION}' && pip install 'tyro==1.0.17')") from e

__all__ = ["TorchTitan", "PACKAGE", "FINDINGS"]

#: Diagnoses of what ``python -m faults audit --checkpointer torchtitan`` finds in torchtitan
#: 0.3.0, read from its source (``"[severity:]PROPERTY[|REASON]"`` fnmatch patterns -> the
#: defect; see :func:`faults.audit.explain`). torchtitan saves and loads with DCP's defaults,
#: so most are DCP's, reached through torchtitan's choices.
FINDINGS = {
    **DCP_READER_FINDINGS,
    "violation:test_any_acknowledged_step_number_is_found_and_restored*|*did not restore state[[]'extra_state'[]]*":
        "step 0 is model-only: CheckpointManager.load sets model_only = step == 0 (checkpointer/dcp.py), so the "
        "optimizer and extra state saved at step 0 are never restored and the load still returns normally",
    "violation:test_interrupted_saves_leave_bounded_disk*|*interrupted saves*":
        "leaks disk: CheckpointManager saves through dcp.save straight into step-N; a save killed before its "
        ".metadata leaves the directory, which neither later saves nor purging (complete steps only) remove",
    "violation:test_an_interrupt_during_a_save_leaves_ranks_agreeing*|*came out as*CheckpointException*":
        "interrupts change type: DCP runs each rank's local save steps under `except BaseException` (_DistWrapper) "
        "and re-raises every failure as CheckpointException, an Exception, so a KeyboardInterrupt or a SIGTERM "
        "handler's SystemExit during torchtitan's save (dcp.save) is swallowed "
        "by a trainer's `except Exception`: a preemption ignored",
    "violation:test_acknowledged_save_survives_power_loss*":
        "not durable: torchtitan saves with DCP's default FileSystemWriter, which fsyncs each file but never "
        "the step directory or the directory after renaming .metadata into place",
    "violation:test_corrupt_payload_never_loads_silently":
        "no checksums: a flipped bit in a tensor loads as a different value",
    "violation:test_damaged_record_or_file_falls_back_without_hanging[[]fifo_in_step[]]":
        "hangs: DCP's reader opens payload files with a plain open(), which blocks on a FIFO; "
        "_find_load_step checks only that .metadata exists",
    "violation:test_damaged_record_or_file_falls_back_without_hanging*":
        "damaged steps are chosen: _find_load_step takes the highest step with a .metadata file and nothing "
        "validates the record or the files it names, so resume stops at the damaged newest step although the "
        "previous one is intact",
    "violation:test_each_kind_of_damage_falls_back_to_the_previous_step*":
        "damaged steps are chosen: _find_load_step checks only that .metadata exists, so a step with a missing "
        "or truncated payload is picked and its load raises",
    "violation:test_resume_lands_on_newest_complete_step":
        "damaged steps are chosen (_find_load_step checks only .metadata), or the strict load refuses partial "
        "optimizer state (see the round trip)",
    "violation:test_training_run_state_machine*":
        "damaged steps are chosen (_find_load_step checks only .metadata): resume lands on, or fails at, a step "
        "the suite damaged",
    "violation:test_multi_rank_round_trip*":
        "partial optimizer state refused: torchtitan loads with DCP's strict default planner, so optimizer "
        "state the checkpoint lacks (a module that never had a gradient) raises 'Missing key in checkpoint "
        "state_dict'; the contract lets optimizer state be partial",
    "violation:test_round_trip_is_bitwise":
        "partial optimizer state refused: DCP's strict default planner (see the multi-rank round trip)",
    "violation:test_no_code_runs_from_checkpoint_bytes[[]commit_record[]]":
        "code execution: .metadata is unpickled with pickle.load (DCP's FileSystemReader)",
    "violation:test_no_code_runs_from_checkpoint_bytes[[]shard[]]":
        "code execution: non-tensor items are read with torch.load(weights_only=False) (DCP's planner)",
    "violation:test_two_writers_of_different_steps_never_fail_each_other*":
        "retention takes a live writer's step: _purge_stale_checkpoints lists every step-N directory, complete or "
        "not, and deletes all but the newest keep_latest_k, including a step another job is still writing "
        "(its dcp.save then fails on a file that vanished)",
    "test_a_reader_in_another_pid_namespace_is_never_deleted_under*":
        "deletes under a reader: retention (the purge thread) knows nothing of readers; a step being loaded is "
        "removed file by file and the load fails with FileNotFoundError inside CheckpointException",
    "violation:test_two_writers_in_one_root*":
        "acknowledged save lost: two jobs saving one step both succeed, writing into one directory in place",
    "advisory:test_deep_tree*":
        "retention gives up silently: the purge thread deletes with shutil.rmtree(ignore_errors=True), which "
        "in Python 3.11 recurses once per directory level, so a deep tree raises RecursionError and is left",
    "advisory:test_two_writers_in_one_root*":
        "DCP's CheckpointException, a BaseException, reaches the caller: `except Exception` misses it",
    "advisory:test_failed_async_save_is_raised_and_never_published*":
        "DCP's CheckpointException, a BaseException, reaches the caller: `except Exception` misses it",
    "advisory:test_saving_over_a_complete_step_is_refused_or_safe":
        "no overwrite concept: DCP's writer rewrites an existing step in place",
    "advisory:test_step_directory_linked_out_of_the_root|*changed or deleted files*":
        "no overwrite concept: DCP's writer rewrites an existing step in place, here through the link",
    "advisory:test_*linked_out_of_the_root*":
        "follows links: files are opened by path with a plain open()",
    "violation:test_extra_state_users_keep_round_trips_exactly_or_is_refused_at_save*":
        "extra state restored differently: it is one more entry of torchtitan's states, saved by DCP, which DCP "
        "flattens to dotted string keys (int and tuple keys come back as str, empty dicts and lists vanish) and saves"
        " tensor by tensor (views come back as separate tensors), and nothing refuses at save what the load will "
        "change",
    "violation:test_drawn_extra_state_round_trips_exactly_or_is_refused_at_save":
        "extra state restored differently: DCP flattens it (non-str keys, empty containers, views are lost) and "
        "nothing refuses at save what the load will change",
    "violation:test_hostile_bytes_stay_within_a_memory_bound[[]record_of_objects[]]":
        "unbounded parse: FileSystemReader.read_metadata unpickles .metadata with pickle.load, with no bound on the "
        "objects it builds (4 MiB of EMPTY_SET: about 1 GiB) and no checksum to refuse it first",
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

class _GlobalStepCheckpointManager(CheckpointManager):
    """torchtitan's ``CheckpointManager`` with ``global_step_<N>`` step directories in place of
    ``step-<N>``; the two overridden scans are torchtitan's bodies with only the pattern changed
    (see the module docstring)."""

    def _create_checkpoint_id(self, step: int, folder: str = "") -> str:
        folder = folder or self.folder
        return filesystem.join(folder, f"global_step_{step}")

    def _find_load_step(self, folder: str = "") -> int:
        folder = folder or self.folder
        if not filesystem.isdir(folder):
            return -1

        pattern = r"global_step_(\d+)"
        valid_steps = []

        for filename in filesystem.listdir(folder):
            match = re.search(pattern, filename)
            if not match:
                continue

            # A checkpoint is valid only if it contains core metadata
            checkpoint_path = filesystem.join(folder, filename)
            is_dcp = filesystem.isfile(filesystem.join(checkpoint_path, ".metadata"))
            is_hf = filesystem.isfile(
                filesystem.join(checkpoint_path, "model.safetensors.index.json")
            )

            if is_dcp or is_hf:
                valid_steps.append(int(match.group(1)))

        return max(valid_steps) if valid_steps else -1

    def _purge_stale_checkpoints(self):
        if self._should_purge():
            discovered_checkpoints = []
            for filename in filesystem.listdir(self.folder):
                match = re.search(r"global_step_(\d+)", filename)
                if match:
                    path = filesystem.join(self.folder, filename)
                    discovered_checkpoints.append((int(match.group(1)), path))

            discovered_checkpoints.sort()
            to_delete = discovered_checkpoints[: -1 * self.keep_latest_k]

            for _, path in to_delete:
                assert self.purge_thread is not None
                self.purge_queue.put(path)


class _ModelPart(nn.Module):
    """A model part (an entry of torchtitan's ``model_parts``) whose state dict is the
    contract's ``state["model"]``: ``state_dict()`` returns its entries (the caller's tensors),
    ``load_state_dict(sd, strict=False)`` (what ``ModelWrapper`` calls with the whole flattened
    checkpoint dict) puts back any value DCP replaced rather than filled in place."""

    def __init__(self, model_state: dict[str, Any]) -> None:
        super().__init__()
        self.model_state = model_state

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:  # type: ignore[override]
        return dict(self.model_state)

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        for key, value in self.model_state.items():
            if key in state_dict and state_dict[key] is not value:
                self.model_state[key] = state_dict[key]


class _Entry(Stateful):
    """One non-model entry of the contract's state as a torchtitan ``states`` object:
    ``state_dict()`` is the caller's dict (or list) itself, ``load_state_dict()`` keeps what DCP
    filled and notes that it was loaded."""

    def __init__(self, value: Any) -> None:
        self.value = value
        self.loaded = False

    def state_dict(self) -> Any:
        return self.value

    def load_state_dict(self, state_dict: Any) -> None:
        self.value = state_dict
        self.loaded = True


class _Nothing(Stateful):
    """``dataloader`` / ``lr_schedulers``: the contract's state has neither (an empty state
    dict saves and loads nothing)."""

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        pass


class TorchTitan:
    """:class:`faults.contract.Checkpointer` over torchtitan's ``CheckpointManager`` (see the
    module docstring for the exact mapping)."""

    capabilities: tuple[str, ...] = ("keep_last",)
    #: the ``async_mode`` of the managers that run ``save_async=True`` saves.
    async_mode: str = "async"

    def __init__(self, *, keep_last: int | None = None) -> None:
        self._keep = 0 if keep_last is None else keep_last
        # torchtitan's own checks of the options (keep_latest_k >= 0 and != 1), at the factory call
        self._config("checkpoint", "disabled")
        self._managers: dict[tuple[str, bool], CheckpointManager] = {}
        self._pid = os.getpid()

    # -- the managers ----------------------------------------------------------------------

    def _config(self, root: str, mode: str) -> CheckpointManager.Config:
        return CheckpointManager.Config(enable=True, folder=root, interval=1, keep_latest_k=self._keep,
                                        async_mode=mode, initial_load_model_only=False)

    def _manager(self, root: str, save_async: bool) -> CheckpointManager:
        ensure_process_group()
        if self._pid != os.getpid():  # a forked child: the parent's managers (their gloo group) are not usable
            self._pid, self._managers = os.getpid(), {}
        key = (os.path.normpath(os.path.abspath(root)), save_async)
        m = self._managers.get(key)
        if m is None:
            m = _GlobalStepCheckpointManager(
                self._config(key[0], self.async_mode if save_async else "disabled"),
                dataloader=_Nothing(), model_parts=[], optimizers=_Nothing(), lr_schedulers=_Nothing(),
                states={}, sd_adapter=None, base_folder="")
            self._managers[key] = m
        return m

    @staticmethod
    def _bind(m: CheckpointManager, state: dict[str, Any]) -> dict[str, _Entry]:
        """Point ``m.states`` at this call's ``state`` (see the module docstring)."""
        states = m.states
        for key in [k for k in states if k not in (DATALOADER, LR_SCHEDULER)]:
            del states[key]
        entries: dict[str, _Entry] = {}
        for key, value in state.items():
            if key == MODEL:
                states[MODEL] = ModelWrapper([_ModelPart(value)])
            else:
                states[key] = entries[key] = _Entry(value)
        return entries

    @staticmethod
    def _split(path: str) -> tuple[str, int]:
        """``<root>/global_step_<N>`` -> (root, N), for names torchtitan (mapped) writes."""
        path = os.path.normpath(os.path.abspath(path))
        root, name = os.path.split(path)
        step = step_of(name)
        if step is None or name != step_dir_name(step):
            raise ValueError(f"{path!r} is not a step directory <root>/global_step_<N>")
        return root, step

    # -- saving ----------------------------------------------------------------------------

    def save(self, path: str, state: dict[str, Any], *, global_step: int, save_async: bool = False) -> None:
        root, step = self._split(path)
        if step != global_step:
            raise ValueError(f"save({path!r}, global_step={global_step}): torchtitan names the step "
                             f"directory after the step (global_step_{global_step})")
        self.maybe_wait_for_async_save()
        m = self._manager(root, save_async)
        self._bind(m, state)
        m.save(global_step)
        m.maybe_wait_for_staging()

    def _live(self) -> list[CheckpointManager]:
        """This process's managers (none in a forked child until it makes its own)."""
        return list(self._managers.values()) if self._pid == os.getpid() else []

    def maybe_wait_for_async_save(self) -> None:
        for m in self._live():
            m.maybe_wait_for_staging()
            m.maybe_wait_for_saving()

    def raise_for_failed_async_save(self) -> None:
        for m in self._live():
            if m.save_future is not None and m.save_future.done():
                m.maybe_wait_for_saving()

    def close(self) -> None:
        for m in self._live():
            m.close()

    # -- loading ---------------------------------------------------------------------------

    def load(self, path: str, state: dict[str, Any], *, strict_model: bool = True,
             extra_state_skeleton: dict[str, Any] | None = None) -> dict[str, Any]:
        del strict_model  # torchtitan has no partial model load (see the module docstring)
        root, step = self._split(path)
        m = self._manager(root, False)
        want = dict(state)
        want.pop("extra_state", None)
        if extra_state_skeleton is not None:
            want["extra_state"] = copy.deepcopy(extra_state_skeleton)
        entries = self._bind(m, want)
        m.load(step=step)
        for key, entry in entries.items():
            if entry.loaded:
                state[key] = entry.value
        return state

    # -- what load(step=-1) uses to pick its step ------------------------------------------

    def find_latest_checkpoint(self, checkpoint_dir: str) -> str | None:
        m = self._manager(checkpoint_dir, False)
        if not filesystem.exists(m.folder):
            return None
        step = m._find_load_step()
        return None if step == -1 else m._create_checkpoint_id(step)
