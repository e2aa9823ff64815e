"""DeepSpeed 0.19.8's ``engine.save_checkpoint`` / ``engine.load_checkpoint`` (``deepspeed.runtime.
engine.DeepSpeedEngine``), on DeepSpeed's CPU accelerator with gloo.

:class:`DeepSpeed` maps the harness contract (:mod:`faults.contract`) onto the two calls DeepSpeed
documents for checkpointing ("Model Checkpointing": ``model_engine.save_checkpoint(save_dir, tag,
client_state=...)`` on every rank, ``_, client_state = model_engine.load_checkpoint(load_dir, tag)``)
and onto DeepSpeed's own choice of step (the ``latest`` file). It adds no checkpointing logic: no
commit protocol, fsync, checksum, validation, retry, fallback or error translation beyond
DeepSpeed's (``TorchCheckpointEngine``: ``torch.save`` / ``torch.load(weights_only=False)``).

The engine
----------
DeepSpeed checkpoints an engine, which wraps a live ``nn.Module``; the contract hands over state
dicts. So each ``save`` and ``load`` builds an engine, as a script does once:
``deepspeed.initialize(model=<module>, config={"train_batch_size": <world size>})`` -- ZeRO off
(DeepSpeed's default, stage 0), no DeepSpeed optimizer, fp32 (no ``fp16``/``bf16`` section: the
module's own dtypes are kept) -- where ``<module>`` is an ``nn.Module`` whose tensors *are* the
caller's ``state["model"]`` (:func:`faults.adapters._plain.module_over`, registered, not
copied). DeepSpeed's ``module_state_dict()`` is then that module's ``state_dict()`` and its
``load_module_state_dict`` is the module's ``load_state_dict(strict=load_module_strict)``, which
fills the caller's tensors in place. A new engine per call costs about 2 ms (after the first) and
creates no process group.

What the contract has beyond the model goes where DeepSpeed puts a script's own training state:
``client_state`` (saved into the same ``mp_rank_00_model_states.pt`` beside DeepSpeed's keys, and
returned by ``load_checkpoint``). ``"optimizer"`` is one of DeepSpeed's own keys (the engine's
optimizer, ``None`` here) and would be dropped on load, so the contract's optimizer state dict is
client key ``"optimizer_state_dict"``; ``"fp32_main_params"``, ``"extra_state"`` and
``"global_step"`` are client keys of those names. DeepSpeed's own optimizer paths (a DeepSpeed
or client optimizer in the engine, ZeRO's partitioned ``*_optim_states.pt`` files) are therefore
not exercised: the contract's optimizer state may span several torch optimizers, which one
engine cannot hold.

Process group and launcher: DeepSpeed needs ``torch.distributed`` initialized (it builds its
``deepspeed.comm`` backend over the live default group, ``init_distributed``'s "the user
initialized torch.dist themselves" path) and asserts ``"LOCAL_RANK" in os.environ`` ("If using a
different launcher please ensure LOCAL_RANK is set prior to initializing deepspeed"). In a
process without a group (a single-process test) the adapter creates a 1-rank gloo group
(:func:`faults.adapters.ensure_process_group`); ``LOCAL_RANK`` is set to the rank while the
engine is built, and put back as it was right after, so nothing else in the process sees it.
``DS_ACCELERATOR=cpu`` is set (unless already set) before ``deepspeed`` is imported: on a host
without CUDA DeepSpeed picks its CPU accelerator anyway, with a warning. DeepSpeed's CPU
shared-memory collective op (``deepspeed_shm_comm``, a faster CPU all-reduce that checkpointing
never calls) is marked incompatible before the first engine, so DeepSpeed uses ``torch.distributed``
for its collectives instead of JIT-compiling the op: that build takes about 50 s, and a process
killed during it (the suite kills ranks) leaves the build's lock file under
``~/.cache/torch_extensions``, on which every later engine of the machine then waits forever
(``torch.utils.file_baton``) -- how a CI run once hung.

What each contract call does
----------------------------
``save(path, state, global_step=N, save_async=False)``
    ``path`` is ``<root>/global_step_<N>``: ``save_dir = <root>``, ``tag = "global_step_<N>"``
    (DeepSpeed's default tag is ``global_step<N>``, without the underscore). The engine (above),
    then ``engine.save_checkpoint(root, tag=tag, client_state={...})`` on every rank: rank 0
    ``makedirs(root)``, barrier, the tag checked equal across ranks, ``makedirs(root/tag)``,
    ``torch.save`` of ``{"module": ..., DeepSpeed's metadata, client state}`` to
    ``root/tag/mp_rank_00_model_states.pt`` by data-parallel rank 0, then rank 0 writes the tag
    into ``root/latest`` (``open(..., "w").write(tag)``), barrier.

    ``save_async=True`` saves synchronously: DeepSpeed's async checkpoint engines (Nebula,
    ``FastCheckpointEngine``, the decoupled engine) are configured per engine and need
    accelerator or service support; the default engine is synchronous.
    ``maybe_wait_for_async_save()`` and ``raise_for_failed_async_save()`` do nothing.

    Plain tensors only: a DTensor (FSDP2) state is refused with ``TypeError`` before anything is
    written (DeepSpeed shards with ZeRO, not with DTensors).
``load(path, state, strict_model=True, extra_state_skeleton=None)``
    The engine over ``state["model"]``, then ``engine.load_checkpoint(root, tag=basename(path),
    load_module_strict=strict_model)``: ``torch.load(..., weights_only=False)`` of
    ``root/tag/mp_rank_00_model_states.pt``, ``module.load_state_dict(checkpoint["module"],
    strict=...)``; the returned ``client_state`` gives ``state["optimizer"]`` (and
    ``state["fp32_main_params"]`` when the caller has one) and, with a skeleton only,
    ``state["extra_state"]``. A missing ``root/tag`` is DeepSpeed's error.
``find_latest_checkpoint(root)``
    What ``load_checkpoint(root, tag=None)`` does to pick its step: when ``root/latest`` is a
    file, its text (stripped) is the tag, and ``root/<tag>`` is returned -- whether or not it
    exists or is complete (DeepSpeed does not look); otherwise None (DeepSpeed warns and
    returns ``(None, None)``).

Capabilities
------------
None: no root save in the contract's sense (``save_checkpoint`` takes the root, but the tag is
the step directory's name), no retention, no overwrite refusal (a save of an existing tag writes
over its files), no ``load_latest`` (``load_checkpoint(tag=None)`` has no fallback), no async
save, no per-rank extra state (data-parallel rank 0 writes the one file), no priming. What it
lacks is declared in its ``capabilities``, so that the suite does not draw it: :data:`LIMITATIONS`
(it has a pointer, ``latest``, but not the contract's ``latest_checkpoint_iteration.txt``).

Importing
---------
``DS_BUILD_OPS=0 pip install --no-deps --no-build-isolation deepspeed==0.19.8`` (an sdist whose
``setup.py`` imports torch: with build isolation pip would fetch another torch to build it),
then its imported pure-Python dependencies ``pip install hjson==3.1.0 einops==0.8.2
msgpack==1.2.4 psutil py-cpuinfo==9.0.0`` (``pydantic``, ``packaging``, ``numpy``, ``tqdm`` are
already there). ``ninja`` is not needed: torch's extension builder falls back to setuptools.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

from . import Unavailable, ensure_process_group
from ._plain import SyncSaves, module_over, rank_and_world, refuse_dtensors

PACKAGE = "deepspeed"
VERSION = "0.19.8"

os.environ.setdefault("DS_ACCELERATOR", "cpu")
try:
    import deepspeed
except Exception as e:
    raise Unavailable(
        f"deepspeed cannot be imported ({type(e).__name__}: {e}); the DeepSpeed adapter wants deepspeed=={VERSION} "
        f"(DS_BUILD_OPS=0 pip install --no-deps --no-build-isolation 'deepspeed=={VERSION}' && "
        "pip install hjson==3.1.0 einops==0.8.2 msgpack==1.2.4 psutil py-cpuinfo==9.0.0)") from e

__all__ = ["DeepSpeed", "PACKAGE", "FINDINGS", "LATEST_FILE", "MODEL_STATES", "LIMITATIONS"]

#: DeepSpeed's pointer file in the save directory (``save_latest=True``).
LATEST_FILE = "latest"
#: The one file of a step at ZeRO stage 0 without model parallelism (``_get_ckpt_name``).
MODEL_STATES = "mp_rank_00_model_states.pt"
#: The client-state keys of the contract's entries (``"optimizer"`` is DeepSpeed's own key).
CLIENT_KEYS = {"optimizer": "optimizer_state_dict", "fp32_main_params": "fp32_main_params",
               "extra_state": "extra_state"}
#: What this checkpointer lacks, declared as its ``capabilities`` (``faults.contract.Limitation``
#: names: the suite draws no such case and skips what needs it):
#: no async save, no sharded (DTensor) state, no commit record, no contract pointer.
LIMITATIONS = ("sync_only", "plain_tensors_only", "no_commit_record", "no_pointer")

#: Diagnoses of what ``python -m faults audit --checkpointer deepspeed`` finds in DeepSpeed 0.19.8,
#: read from its source (``"[severity:]PROPERTY[|REASON]"`` fnmatch patterns -> the defect; see
#: :func:`faults.audit.explain`).
FINDINGS: dict[str, str] = {
    "violation:test_any_acknowledged_step_number_is_found_and_restored*":
        "a step that cannot be resumed is acknowledged: save_checkpoint takes any tag (global_step_-1 too) and "
        "writes it into `latest`; see the reason for what resume then found",
    "violation:test_acknowledged_save_survives_power_loss*":
        "not durable: TorchCheckpointEngine.save is a plain torch.save and rank 0 writes `latest` with "
        "open(..., 'w'); nothing is fsynced (files, the tag directory, the save directory)",
    "violation:test_an_interrupt_during_a_save_leaves_ranks_agreeing*|*no answer within*":
        "an interrupt on one rank stalls the others: save_checkpoint runs collectives (a barrier after makedirs, "
        "the tag check's all_reduce, a barrier after `latest`) with nothing that makes the ranks agree on the "
        "outcome; a rank that leaves early leaves its peers waiting for the process group's whole timeout",
    "violation:test_one_ranks_bad_state_fails_every_rank_quickly*|*no answer within*":
        "one rank's failure stalls the others: only data-parallel rank 0 torch.saves, and a failure there raises "
        "before the final barrier the other ranks wait in",
    "violation:test_corrupt_payload_never_loads_silently":
        "no checksums: torch.load does not check the zip records' CRC-32, so a flipped bit in "
        "mp_rank_00_model_states.pt loads as a different value",
    "violation:test_damage_to_each_file_the_load_reads[[]bitflip[]]":
        "no checksums: a flipped bit in a file torch.load still reads loads as a different value (or a different "
        "tag in `latest`)",
    "violation:test_a_fallback_never_mixes_two_steps":
        "no checksums: a flipped bit that torch.load still reads resumes a different state silently",
    "violation:test_find_latest_beside_a_saver_with_retention|*never a saved step*":
        "the pointer is torn while it is written: rank 0 writes `latest` in place with open(..., 'w') (truncate, "
        "then write), so a reader beside a saver can read an empty tag, and load_checkpoint(tag=None) then names "
        "the save directory itself",
    "violation:test_a_save_of_an_older_step_never_moves_the_pointer_back":
        "the pointer moves back: every save_checkpoint writes its own tag into `latest`, so saving an older step "
        "makes load_checkpoint(tag=None) resume it instead of the newer one",
    "violation:test_each_kind_of_damage_falls_back_to_the_previous_step[[]missing_payload[]]":
        "a missing model states file fails a bare `assert len(self.ckpt_list) > 0` (SDLoaderBase.check_ckpt_list: "
        "an AssertionError with no message, skipped under python -O) and load_checkpoint has no fallback",
    "violation:test_every_crash_state_of_a_save_resumes*|*problems in the*":
        "a crash leaves a torn pointer: rank 0 writes `latest` in place (open(..., 'w'): created or truncated, "
        "then written), so a crash in between leaves it empty; load_checkpoint(tag=None) then looks for "
        "mp_rank_00_model_states.pt in the save directory itself and fails a bare assert (AssertionError). (The "
        "'acknowledged step lost' lines of this finding are the suite's: see the state machine's)",
    "violation:test_each_kind_of_pointer_damage*":
        "no fallback past the pointer: load_checkpoint(tag=None) trusts `latest` (absent: no checkpoint at all; "
        "stale, torn or naming a missing tag: that tag), and never looks at the tag directories",
    "violation:test_damage_to_each_file_the_load_reads*":
        "damaged steps are chosen: `latest` names the newest tag whatever its state, nothing validates "
        "mp_rank_00_model_states.pt, so the load raises or returns other values although the previous step is "
        "intact",
    "violation:test_each_kind_of_damage_falls_back_to_the_previous_step*":
        "damaged steps are chosen: `latest` names the newest tag whatever its state and load_checkpoint has no "
        "fallback",
    "violation:test_damaged_record_or_file_falls_back_without_hanging[[]fifo_in_step[]]":
        "hangs: torch.load opens mp_rank_00_model_states.pt with a plain open(), which blocks on a FIFO; `latest` "
        "picks the step without looking at its files",
    "violation:test_damaged_record_or_file_falls_back_without_hanging*":
        "damaged steps are chosen: `latest` names the newest tag and torch.load opens its file with a plain open()",
    "violation:test_resume_lands_on_newest_complete_step":
        "damaged steps are chosen: `latest` names the tag last saved, complete or not",
    "violation:test_every_crash_state_of_a_save_resumes*":
        "a crash leaves a torn step or pointer: the model states file and `latest` are written in place, "
        "without a temporary file and rename",
    "violation:test_interrupted_saves_leave_bounded_disk*":
        "leaks disk: save_checkpoint makes the tag directory first and nothing removes one whose save was "
        "interrupted",
    "violation:test_no_code_runs_from*":
        "code execution: TorchCheckpointEngine.load reads every checkpoint file with torch.load(weights_only=False)",
    "violation:test_hostile_bytes_stay_within_a_memory_bound*":
        "unbounded parse: torch.load(weights_only=False) unpickles the model states file with no bound and no "
        "checksum to refuse it first",
    "violation:test_two_writers_in_one_root[[]different_steps[]]":
        "acknowledged save lost: two jobs share one `latest`, and the job that saved last names its own, older, "
        "tag there, so the newer step is no longer the one resumed",
    "violation:test_two_writers_in_one_root*":
        "acknowledged save lost: two jobs saving one tag both succeed, torch.save rewriting the same file in place; "
        "nothing detects the other writer",
    "violation:test_two_writers_of_different_steps_never_fail_each_other*":
        "two writers of one save directory share one `latest`: each save writes its own tag there, so the other "
        "job's newer step is no longer the one resumed",
    "advisory:test_saving_over_a_complete_step_is_refused_or_safe":
        "no overwrite concept: a save of an existing tag rewrites its files in place",
    "advisory:test_step_directory_linked_out_of_the_root*":
        "follows links: makedirs(exist_ok=True) and torch.save follow a tag directory linked out of the save "
        "directory",
    "advisory:test_*linked_out_of_the_root*":
        "follows links: files are opened by path with a plain open()",
    "advisory:test_one_ranks_mistake_in_a_world*|*raised and the others returned*":
        "ranks disagree on a load: deepspeed.initialize moves the module to the device, which fails for meta "
        "tensors on the one rank that has them, and nothing shares one rank's failure with the others, which "
        "resume",
    "advisory:test_*mistake*[[]*dtype[]]|*casting*":
        "a load into another dtype casts silently: load_module_state_dict is module.load_state_dict, whose copy_ "
        "converts",
    "advisory:test_*mistake*[[]*tied[]]*":
        "tied destinations are filled one key at a time: module.load_state_dict copies both keys into the one "
        "memory, which holds whichever was copied last",
    "advisory:test_*mistake*[[]*meta[]]*":
        "meta destinations are not filled: module.load_state_dict's copy into a meta tensor is a no-op with a "
        "warning, so the state stays on the meta device",
    "advisory:test_*mistake*":
        "a destination that cannot receive a tensor fails in module.load_state_dict (its RuntimeError names the "
        "key) or in the caller's apply",
}


@contextlib.contextmanager
def _local_rank(rank: int) -> Iterator[None]:
    """``LOCAL_RANK`` set while DeepSpeed builds an engine, put back as it was after."""
    old = os.environ.get("LOCAL_RANK")
    os.environ["LOCAL_RANK"] = str(rank)
    try:
        yield
    finally:
        if old is None:
            del os.environ["LOCAL_RANK"]
        else:
            os.environ["LOCAL_RANK"] = old


#: (pid, default group) that DeepSpeed's process-wide communication state was made for.
_WORLD: list = [None]


def _ready() -> None:
    """A default process group, and DeepSpeed's process-wide communication state made for it.

    DeepSpeed keeps, for the life of the process, its communication backend (``deepspeed.comm.
    comm.cdb``, made over the default group on the first ``initialize``) and a clone of the world
    group (``deepspeed.utils.groups._WORLD_GROUP``, made by ``dist.new_group`` on first use) -- a
    DeepSpeed job has one default group for its whole life. The harness replaces the default
    group (a forked child makes its own; a single-process test's 1-rank group is destroyed after
    the test), so when the group is not the one DeepSpeed's state was made for, that state is
    forgotten and DeepSpeed makes it again on the next ``initialize``, as in a fresh process."""
    import torch.distributed as dist
    from deepspeed.comm import comm as ds_comm
    from deepspeed.utils import groups as ds_groups

    ensure_process_group()
    world = (os.getpid(), dist.group.WORLD)
    if _WORLD[0] != world:
        if _WORLD[0] is not None:
            ds_comm.cdb = None
            ds_groups._WORLD_GROUP = None
        _WORLD[0] = world


#: DeepSpeed's name of its CPU shared-memory collective op (``ShareMemCommBuilder.NAME``).
SHM_OP = "deepspeed_shm_comm"


def _no_shm_op() -> None:
    """Mark :data:`SHM_OP` incompatible, so that ``deepspeed.comm``'s backend skips its JIT build
    (``build_shm_op`` returns None for an incompatible op; see the module docstring)."""
    compatible = deepspeed.ops.__compatible_ops__  # probed once per process, then a plain dict
    compatible[SHM_OP] = False


def _engine(model_state: dict[str, Any]) -> Any:
    """A DeepSpeed engine over a module whose tensors are ``model_state``'s (see the module docstring)."""
    _ready()
    _no_shm_op()
    rank, world = rank_and_world()
    with _local_rank(rank):
        engine, _, _, _ = deepspeed.initialize(model=module_over(model_state), config={"train_batch_size": world})
    return engine


class DeepSpeed(SyncSaves):
    """:class:`faults.contract.Checkpointer` over DeepSpeed's ``save_checkpoint`` /
    ``load_checkpoint`` (see the module docstring for the exact mapping)."""

    capabilities: tuple[str, ...] = LIMITATIONS

    # -- saving ----------------------------------------------------------------------------

    def save(self, path: str, state: dict[str, Any], *, global_step: int, save_async: bool = False) -> None:
        del save_async  # DeepSpeed's default checkpoint engine is synchronous
        refuse_dtensors(state, "DeepSpeed")
        root, tag = os.path.split(os.path.normpath(path))
        client_state: dict[str, Any] = {CLIENT_KEYS[k]: v for k, v in state.items() if k in CLIENT_KEYS}
        client_state["global_step"] = global_step
        _engine(state["model"]).save_checkpoint(root, tag=tag, client_state=client_state)

    # -- loading ---------------------------------------------------------------------------

    def load(self, path: str, state: dict[str, Any], *, strict_model: bool = True,
             extra_state_skeleton: dict[str, Any] | None = None) -> dict[str, Any]:
        root, tag = os.path.split(os.path.normpath(path))
        _, client_state = _engine(state["model"]).load_checkpoint(root, tag=tag, load_module_strict=strict_model)
        for key in ("optimizer", "fp32_main_params"):
            if key in state:
                state[key] = client_state[CLIENT_KEYS[key]]
        if extra_state_skeleton is not None:
            state["extra_state"] = client_state[CLIENT_KEYS["extra_state"]]
        return state

    # -- what load_checkpoint(tag=None) does to pick its step ---------------------------------

    def find_latest_checkpoint(self, checkpoint_dir: str) -> str | None:
        latest_path = os.path.join(checkpoint_dir, LATEST_FILE)
        if not os.path.isfile(latest_path):
            return None
        with open(latest_path) as fd:
            tag = fd.read().strip()
        return os.path.join(checkpoint_dir, tag)
