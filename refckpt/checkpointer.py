"""``DistributedCheckpointer``: the public API on top of DCP, and the collectives around the commit
(the save protocol is the docstring of :mod:`refckpt.commit`)."""

from __future__ import annotations

import concurrent.futures
import copy
import datetime
import hashlib
import logging
import os
import secrets
import socket
import threading
import warnings
import weakref
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import BytesStorageMetadata
from torch.distributed.checkpoint.stateful import Stateful

from . import errors as _errors
from .commit import StagedStep, drop_lease, retain, take_lease
from .durable import DEFAULT_IO, FileIO
from .errors import (
    AsyncSaveFailedError,
    CallerError,
    CheckpointError,
    CheckpointNotFoundError,
    CollectiveError,
    ConfigError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    InvalidCheckpointPathError,
    MissingKeysError,
    MissingTrainingStateError,
    PartialLoadError,
    SaveFailedError,
    StateMismatchError,
    UnsafeCheckpointError,
    os_error_hint,
)
from .extra import decode_extra_state, encode_extra_state
from .interop import RankRecordReader, metadata_for_rank
from .layout import (
    EXTRA_STATE_DIR,
    STEP_PREFIX,
    StepState,
    check_step_dir,
    complete_steps_newest_first,
    extra_state_file_name,
    find_latest_checkpoint,
    list_step_dirs,
    parse_step_dir_name,
    safe_relpath,
    step_dir_name,
)
from .planner import EXTRA_STATE_KEY, MAIN_PARAMS_KEY, OPTIMIZER_KEY, RefLoadPlanner, RefSavePlanner, format_keys
from .protocol import SavePoint
from .record import Manifest
from .safeload import open_regular
from .staging import DeferredCopy, Stager, accelerator_available
from .storage import SafetensorsWriter, verify_file_bytes

__all__ = ["DistributedCheckpointer", "EXTRA_STATE_PER_RANK", "EXTRA_STATE_EMBEDDED", "SNAPSHOT_COPY",
           "SNAPSHOT_DEFERRED"]

log = logging.getLogger(__name__)

EXTRA_STATE_PER_RANK = "per_rank"
EXTRA_STATE_EMBEDDED = "embedded"

#: async snapshot modes (``save(..., save_async=True, snapshot=...)``)
SNAPSHOT_COPY = "copy"
SNAPSHOT_DEFERRED = "deferred"

# One dedicated gloo group per process for checkpoint collectives: async saves run
# their collectives on a background thread, which must never interleave with the
# training loop's collectives on the default group, and DCP needs a CPU backend.
# Held weakly (per timeout: the default group it was made under, and the group): c10d's
# registry keeps it alive until ``destroy_process_group``, which then frees it while the
# interpreter is whole. A strong reference here kept it to interpreter exit, where a gloo
# group's destruction can abort the process ("terminate called without an active
# exception", exit code -6 after a clean run), and after a new ``init_process_group`` it
# could hand out a group that was shut down.
_GROUPS: dict[float, tuple[weakref.ref, weakref.ref]] = {}
_GROUPS_LOCK = threading.Lock()


# Async saves in flight in this process, of any checkpointer instance. They all use the
# cached group above, so a second instance must not start collectives while one persists.
_PENDING: set[concurrent.futures.Future] = set()
_PENDING_LOCK = threading.Lock()


def _track(fut: concurrent.futures.Future) -> None:
    with _PENDING_LOCK:
        _PENDING.add(fut)

    def done(f: concurrent.futures.Future) -> None:
        with _PENDING_LOCK:
            _PENDING.discard(f)

    fut.add_done_callback(done)


def _wait_for_other_instances() -> None:
    """Let other checkpointers' background saves finish first (their errors stay theirs to report).

    Called after the instance's own :meth:`~DistributedCheckpointer.maybe_wait_for_async_save`,
    so whatever is still pending belongs to other instances."""
    with _PENDING_LOCK:
        others = list(_PENDING)
    if others:
        concurrent.futures.wait(others)


def _ckpt_group(timeout_s: float):
    if not (dist.is_available() and dist.is_initialized()):
        return None
    world = dist.group.WORLD
    with _GROUPS_LOCK:
        entry = _GROUPS.get(timeout_s)
        pg = entry[1]() if entry is not None and entry[0]() is world else None
        if pg is None:
            warn_shared_agent_store()
            pg = _new_gloo_group(datetime.timedelta(seconds=timeout_s))
            _GROUPS[timeout_s] = (weakref.ref(world), weakref.ref(pg))
        return pg


_WARNED_AGENT_STORE = False


def warn_shared_agent_store(environ: Mapping[str, str] | None = None) -> bool:
    """Warn (once per process) when torchrun may restart this job on its shared store.

    Since torch 2.5 the workers of a torchrun job use the agent's TCPStore, and a restarted
    incarnation uses the *same* store, unprefixed: a rank that reaches ``init_process_group``
    before a late peer reads the dead incarnation's address of that peer and fails ("Gloo
    connectFullMesh failed ... Connection refused", or NCCL's unique id of the previous attempt;
    pytorch/pytorch#135712). refckpt cannot fix the job's default group (it exists before refckpt
    runs); ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` in the agents' environment gives every
    incarnation a fresh store. Returns whether the hazard is present (warned or not)."""
    global _WARNED_AGENT_STORE
    env = os.environ if environ is None else environ
    try:
        restarts = int(env.get("TORCHELASTIC_MAX_RESTARTS", "0"))
    except ValueError:
        restarts = 0
    hazard = env.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and restarts > 0
    if hazard and not _WARNED_AGENT_STORE:
        _WARNED_AGENT_STORE = True
        log.warning("refckpt: this torchrun job may be restarted (--max-restarts=%d) on torchrun's shared store: "
                    "a restarted incarnation's init_process_group can read the dead incarnation's peer addresses "
                    "and fail to connect (pytorch/pytorch#135712). Launch torchrun with "
                    "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in its environment (see docs/design.md, "
                    "'Running across nodes').", restarts)
    return hazard


def _new_gloo_group(timeout: datetime.timedelta) -> Any:
    """The checkpointer's own gloo group, under a name (and so store keys) of this incarnation only.

    ``dist.new_group`` names groups by a per-process counter, so a job that torchrun restarts
    after a failure creates a group of the same name as the dead incarnation's, whose rendezvous
    keys (peer addresses) are still in the launcher's store: a rank that arrives early reads the
    dead peers' addresses and fails to connect ("Gloo connectFullMesh failed ... Connection
    refused"). Here rank 0 draws a random token, every rank receives it over the default group
    (the one collective the job just rendezvoused for, so it is this incarnation's), and the group
    is created under ``refckpt-<token>``: a restarted incarnation never reads a dead one's keys,
    whatever order its ranks arrive in. Uses c10d's group constructor with an explicit name (the
    public ``new_group`` takes none); where that private API is missing, falls back to
    ``new_group`` with a warning."""
    token = [secrets.token_hex(8) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(token, src=0)
    name = f"refckpt-{token[0]}"
    c10d = dist.distributed_c10d
    ranks = list(range(dist.get_world_size()))
    try:
        pg, _ = c10d._new_process_group_helper(len(ranks), dist.get_rank(), ranks, "gloo",
                                               c10d._get_default_store(), c10d.GroupName(name), timeout=timeout,
                                               group_desc="refckpt")
        c10d._world.pg_group_ranks[pg] = {r: r for r in ranks}
    except (AttributeError, TypeError) as e:  # pragma: no cover - a torch without these internals
        log.warning("refckpt: cannot name its process group per incarnation on this torch (%s); "
                    "a job restarted by torchrun may fail to rendezvous it", e)
        pg = dist.new_group(backend="gloo", timeout=timeout)
    return pg


def _collective_error(what: str, timeout: float, e: BaseException) -> CollectiveError:
    return CollectiveError(
        f"checkpoint collective failed while {what} ({type(e).__name__}: {e}); a peer rank died, "
        f"hung for more than timeout={timeout:g}s, or lost its connection. Every surviving rank "
        f"raises this; restart the job and resume with load_latest."
    )


def _unwrap(e: CheckpointException) -> tuple[int, BaseException]:
    failures = e.failures
    rank = min(failures)
    exc = failures[rank][0]
    return rank, exc


class DistributedCheckpointer:
    """Save and load training state as ``<root>/global_step_N/`` checkpoints with DCP.

    Args:
        extra_state_per_rank: write ``extra_state`` to one file per rank (always
            correct: RNG states and data positions differ across ranks). False embeds
            it in the DCP payload, which keeps one copy, so a save refuses extra
            state that differs across ranks.
        keep_last: keep the newest ``k`` complete steps (retention runs after the
            pointer is published); None keeps everything.
        overwrite: allow saving over a complete step; the old one stays resumable
            until the new one is committed.
        io: the write-side I/O layer (wrap it to inject faults or record a trace).
        timeout: seconds a checkpoint collective may wait for a peer before every
            surviving rank raises (a dead or hung rank never hangs the others).
        checksums: record a checksum (CRC-32C) for every item at save (the extra-state files' are
            recorded either way). Readers verify every checksum that is recorded.
        verify_checksums: verify recorded checksums when bytes are read (an explicit opt-out; the
            default verifies).
        sync_files: fsync step files and directories. False forfeits power-loss safety (the small
            pointer file is still written with tmp + fsync + rename).
        main_params_key: top-level key of a mixed-precision fp32 main-parameter branch.
        safe_globals: classes of your own that you trust in non-tensor items and extra state
            (``torch.load(weights_only=True)`` allow-list), at save (extra state that a load could not
            restore is refused there) and at load. numpy arrays and scalars need none (:mod:`refckpt.extra`).
        pin_memory: stage async saves into pinned host memory (default: when an accelerator
            (CUDA, NPU, ...) is available).
        reuse_staging: keep the host buffers an async save stages into for the next async save
            (one host copy of the state stays allocated between saves; re-mapping fresh memory
            on every save made staging several times slower). False frees them after each save;
            :meth:`close` frees them too.
        async_snapshot: how an async save takes its snapshot when ``save`` does not say
            (``snapshot=``): ``"copy"`` (the default: ``save`` returns once every tensor is copied)
            or ``"deferred"`` (``save`` returns at once and the copy runs in the background,
            guarded; see :meth:`save`).
    """

    #: What this checkpointer offers beyond the seed's contract (``faults/contract.py``: the capability
    #: names a judge such as ``faults.suite`` reads; plain strings, so nothing is imported for it).
    capabilities = ("root_save", "overwrite", "keep_last", "load_latest", "per_rank_extra_state",
                    "embedded_extra_state", "priming", "deferred_snapshot")

    def __init__(
        self,
        extra_state_per_rank: bool = True,
        *,
        keep_last: int | None = None,
        overwrite: bool = False,
        io: FileIO | None = None,
        timeout: float = 600.0,
        checksums: bool = True,
        verify_checksums: bool = True,
        sync_files: bool = True,
        main_params_key: str = MAIN_PARAMS_KEY,
        safe_globals: tuple | list = (),
        pin_memory: bool | None = None,
        reuse_staging: bool = True,
        async_snapshot: str = SNAPSHOT_COPY,
    ) -> None:
        if keep_last is not None and (not isinstance(keep_last, int) or keep_last < 1):
            raise ConfigError(f"keep_last={keep_last!r}: must be None (keep all) or an integer >= 1.")
        if not timeout or timeout <= 0:
            raise ConfigError(f"timeout={timeout!r}: must be a positive number of seconds.")
        if not sync_files:
            warnings.warn("DistributedCheckpointer(sync_files=False): checkpoints are not power-loss safe.", stacklevel=2)
        if verify_checksums and not checksums:
            log.info("checksums=False: new checkpoints carry no checksums; verification applies to older ones only")
        self.extra_state_per_rank = bool(extra_state_per_rank)
        self.keep_last = keep_last
        self.overwrite = overwrite
        self.io = io or DEFAULT_IO
        self.timeout = float(timeout)
        self.checksums = checksums
        self.verify_checksums = verify_checksums
        self.sync_files = sync_files
        self.main_params_key = main_params_key
        self.safe_globals = tuple(safe_globals)
        self.pin_memory = accelerator_available() if pin_memory is None else bool(pin_memory)
        self.async_snapshot = _snapshot_mode(async_snapshot, "async_snapshot")
        self._stager = Stager(pin=self.pin_memory, reuse=reuse_staging)
        self._deferred: DeferredCopy | None = None  # a deferred snapshot whose guards are installed
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._pending: concurrent.futures.Future | None = None
        self._pending_step: int | None = None

    # -- distributed helpers ---------------------------------------------------
    def _group(self):
        return _ckpt_group(self.timeout)

    @staticmethod
    def _rank_world(group) -> tuple[int, int]:
        if group is None:
            return 0, 1
        return dist.get_rank(group), dist.get_world_size(group)

    def _coordinated(self, group, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` on the coordinator; every rank returns its result or raises its error."""
        rank, world = self._rank_world(group)
        out: list[Any] = [None]
        if rank == 0:
            try:
                out[0] = ("ok", fn())
            except Exception as e:  # noqa: BLE001 - re-raised on every rank below
                out[0] = ("err", e)
        if world > 1:
            try:
                dist.broadcast_object_list(out, src=dist.get_global_rank(group, 0), group=group)
            except RuntimeError as e:
                raise _collective_error("waiting for the coordinator", self.timeout, e) from e
        kind, value = out[0]
        if kind == "err":
            raise value
        return value

    def _all_ok(self, group, err: BaseException | None) -> list[tuple[int, str]]:
        """Every rank's failure (rank, message); empty when all succeeded.

        One all-reduce of a one-element integer (did any rank fail?); only when one did, an
        all-gather of the messages. So when all is well a rank sends and receives a few bytes
        whatever the world size, not one object per rank (docs/scale.md)."""
        rank, world = self._rank_world(group)
        mine = None if err is None else f"{type(err).__name__}: {err}"
        if world == 1:
            allv = [mine]
        else:
            try:
                flag = torch.tensor([0 if mine is None else 1], dtype=torch.int32)
                dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
                if not int(flag.item()):
                    return []
                allv = [None] * world
                dist.all_gather_object(allv, mine, group=group)
            except RuntimeError as e:
                raise _collective_error("agreeing on the outcome", self.timeout, e) from e
        return [(r, m) for r, m in enumerate(allv) if m is not None]

    # -- paths -------------------------------------------------------------------
    @staticmethod
    def _root_and_step_dir(path: str | os.PathLike, global_step: int) -> tuple[str, str]:
        path = os.path.abspath(os.fspath(path))
        name = step_dir_name(global_step)
        base = os.path.basename(path)
        parsed = parse_step_dir_name(base)
        if parsed is not None:
            if parsed != global_step:
                raise InvalidCheckpointPathError(
                    f"{path}: the directory names step {parsed} but global_step={global_step}; pass the "
                    f"checkpoint root (the directory that holds {STEP_PREFIX}N/) or a matching step directory."
                )
            return os.path.dirname(path), path
        if base.startswith(STEP_PREFIX):
            raise InvalidCheckpointPathError(
                f"{path}: {base!r} looks like a step directory but is not {STEP_PREFIX}<digits>; pass the checkpoint root."
            )
        return path, os.path.join(path, name)

    # -- save ----------------------------------------------------------------------
    def save(self, path: str | os.PathLike, state: dict[str, Any], *, global_step: int, save_async: bool = False,
             snapshot: str | None = None) -> None:
        """Save ``state`` as step ``global_step`` under the root ``path`` (or into ``path`` = ``.../global_step_N``).

        Sync: returns once the step is committed, published and the pointer written
        on every rank -- the save is then *acknowledged*: no later crash takes it away.
        Async: the rest runs in the background and is acknowledged by
        :meth:`maybe_wait_for_async_save`. When ``save`` returns depends on ``snapshot``
        (default: the constructor's ``async_snapshot``, itself ``"copy"`` by default):

        * ``"copy"``: once every tensor is copied to host memory; the caller may then change
          anything at once.
        * ``"deferred"`` (zero-stall): once the save has recorded which tensors to copy (and
          each one's version counter), with no collective call: the copy into the reused host
          buffers runs in the background, then the rest of the save, including what needs the
          other ranks (the staging directory, the embedded extra state's rank-invariance check),
          whose errors :meth:`maybe_wait_for_async_save` raises. Between ``save()`` and the copy's end you may
          run forward and backward; the next ``optimizer.step()`` waits for the copy, and the
          forward of a module whose subtree owns buffers not yet copied (BatchNorm's running
          statistics, at any depth) copies those first; any other in-place change to a saved tensor fails the save with
          :class:`~refckpt.errors.SnapshotChangedError` (raised, wrapped, by
          :meth:`raise_for_failed_async_save` / :meth:`maybe_wait_for_async_save`, naming the
          tensor; nothing is published, on any rank). Call :meth:`maybe_wait_for_async_save`
          before such a change, or use ``"copy"``. Writes that bypass autograd's version counter
          (through ``tensor.data``, a ``.numpy()`` view, a DTensor parameter's own ``to_local()``,
          an in-place collective into a saved tensor) are neither waited for nor detected: make
          them after the wait. The global hooks that wait are removed by the next
          :meth:`raise_for_failed_async_save`, :meth:`maybe_wait_for_async_save`, ``save`` or
          :meth:`close` after the copy.

        Extra state that a load could not restore exactly is refused before anything is written
        (:class:`~refckpt.extra.ExtraStateError`, naming the key), on every rank. Every rank raises
        the same :class:`SaveFailedError` if any rank fails; nothing is published then and the
        previous checkpoint stays the newest.
        """
        if snapshot is not None:
            snapshot = _snapshot_mode(snapshot, "snapshot")
            if not save_async:
                raise ConfigError(f"save(snapshot={snapshot!r}) applies to async saves only; pass save_async=True "
                                  f"or leave snapshot out.")
        mode = snapshot or self.async_snapshot
        self.io.mark(SavePoint.WAIT_PREVIOUS)
        self.maybe_wait_for_async_save()
        _wait_for_other_instances()
        _check_state(state, "save")
        root, step_dir = self._root_and_step_dir(path, global_step)
        group = self._group()
        rank, world = self._rank_world(group)
        layout = None
        encoded: bytes | None = None
        extra = state.get(EXTRA_STATE_KEY)
        # A deferred save makes no collective call on the caller's path: the staging directory (a
        # broadcast from the coordinator, the shared-root all-reduce) and the embedded extra
        # state's rank-invariance check (an all-gather) run in the background, after the copy.
        deferred_mode = save_async and mode == SNAPSHOT_DEFERRED
        err: BaseException | None = None
        try:
            if extra is not None:
                if not isinstance(extra, dict):
                    raise ConfigError(f"state['extra_state'] must be a dict, got {type(extra).__name__}.")
                extra = copy.copy(extra)  # a shallow copy of its own type (an OrderedDict stays one)
                extra.setdefault("global_step", global_step)
                layout = EXTRA_STATE_PER_RANK if self.extra_state_per_rank else EXTRA_STATE_EMBEDDED
                # What load cannot restore exactly is refused here, before anything is written.
                encoded = encode_extra_state(extra, safe_globals=self.safe_globals)
        except CheckpointError as e:
            err = e
        if not deferred_mode:  # every rank refuses, or none does: before any rank writes or waits
            self._agree(group, err, f"checking the state to save as step {global_step}")
        elif err is not None:
            raise err
        staged = None if deferred_mode else self._stage_or_fail(group, root, step_dir, global_step)

        payload: tuple[tuple[str, bytes], ...] = ()
        dcp_state = {k: v for k, v in state.items() if k != EXTRA_STATE_KEY}
        if layout == EXTRA_STATE_PER_RANK:
            assert encoded is not None
            payload = ((f"{EXTRA_STATE_DIR}/{extra_state_file_name(rank)}", encoded),)
        elif layout == EXTRA_STATE_EMBEDDED and encoded is not None:
            if not deferred_mode:
                self._check_rank_invariant(group, encoded, step_dir)
            dcp_state[EXTRA_STATE_KEY] = encoded  # one non-tensor item: restored exactly (refckpt.extra)
        manifest_extra = {"world_size": world, "global_step": global_step, "extra_state": layout}
        if save_async:
            if self._executor is None:
                self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="refckpt-async")
            self._pending_step = global_step
            if deferred_mode:
                deferred = self._stager.plan(dcp_state)
                deferred.install_guards()
                self._deferred = deferred
                try:
                    self._pending = self._executor.submit(
                        self._copy_then_persist, deferred, rank, group, (root, step_dir, global_step), payload,
                        manifest_extra, layout == EXTRA_STATE_EMBEDDED and extra is not None)
                except BaseException:
                    self._release_guards(force=True)
                    raise
            else:
                self.io.mark(SavePoint.STAGING, rank=rank)
                dcp_state = self._stager.stage(dcp_state)
                assert staged is not None
                self._pending = self._executor.submit(self._persist, group, staged, dcp_state, payload,
                                                      manifest_extra | {"writer": staged.writer})
            _track(self._pending)
            return
        assert staged is not None
        self._persist(group, staged, dcp_state, payload, manifest_extra | {"writer": staged.writer})

    def _stage_or_fail(self, group, root: str, step_dir: str, step: int) -> StagedStep:
        """:meth:`_stage`, an OSError there turned into a :class:`SaveFailedError` that says nothing was written."""
        try:
            return self._stage(group, root, step_dir, step)
        except OSError as e:
            if isinstance(e, CheckpointError):
                raise
            raise SaveFailedError(f"save of step {step}: cannot prepare a staging directory under the "
                                  f"checkpoint root {root} ({type(e).__name__}: {e}); nothing was written, the "
                                  f"previous checkpoint stays the newest complete one.{os_error_hint(e, root)}") from e

    def _stage(self, group, root: str, step_dir: str, step: int) -> StagedStep:
        """Protocol step 2 on the coordinator; every rank gets its :class:`StagedStep` (staging
        directory and writer token from the coordinator: the I/O layer need not be picklable)."""

        def create() -> tuple[str, str]:
            staged = StagedStep.create(root, step_dir, step, io=self.io, sync_files=self.sync_files,
                                       overwrite=self.overwrite)
            return staged.path, staged.writer

        path, writer = self._coordinated(group, create)
        staged = StagedStep(root, step_dir, step, writer, path, io=self.io, sync_files=self.sync_files)
        self._check_shared_root(group, staged)
        return staged

    def _check_shared_root(self, group, staged: StagedStep) -> None:
        """Every rank must see the staging directory the coordinator just made, under the root it
        was given itself: a root that is node-local on some nodes (or different roots passed on
        different nodes) would otherwise publish a step whose shards only some nodes can see.
        One one-integer all-reduce per save (:meth:`_all_ok`; the messages are gathered only on a
        mismatch); on a mismatch every rank raises and nothing is written."""
        mine = os.path.join(staged.root, os.path.basename(staged.path))
        try:
            seen = os.path.isdir(mine) and os.path.samefile(mine, staged.path)
        except OSError:
            seen = False
        err = None if seen else OSError(
            f"{mine} does not exist on host {socket.gethostname()} (the coordinator created {staged.path})")
        failures = self._all_ok(group, err)
        if not failures:
            return
        if self._rank_world(group)[0] == 0:
            staged.abort()
        raise SaveFailedError(
            f"save of step {staged.step}: the checkpoint root is not one shared directory: rank(s) "
            f"{[r for r, _ in failures]} cannot see the staging directory rank 0 created "
            f"({'; '.join(f'rank {r}: {m}' for r, m in failures)}). Pass every rank the same root on a file "
            f"system all nodes share (NFS, Lustre, GPFS, a mounted bucket), not a node-local disk. "
            f"Nothing was written.")

    def _check_rank_invariant(self, group, encoded: bytes, step_dir: str) -> None:
        rank, world = self._rank_world(group)
        if world == 1:
            return
        digest = hashlib.sha256(encoded).hexdigest()
        allv: list[Any] = [None] * world
        try:
            dist.all_gather_object(allv, (digest,), group=group)
        except RuntimeError as e:
            raise _collective_error("comparing embedded extra state across ranks", self.timeout, e) from e
        differ = [r for r, v in enumerate(allv) if v[0] != allv[0][0]]
        if differ:
            raise ConfigError(
                f"{step_dir}: extra_state differs between rank 0 and rank(s) {differ}, but "
                f"DistributedCheckpointer(extra_state_per_rank=False) embeds one copy in the DCP payload "
                f"and would silently restore rank 0's values everywhere. Use extra_state_per_rank=True "
                f"for per-rank state (RNG, data position)."
            )

    def _copy_then_persist(self, deferred: DeferredCopy, rank: int, group, where: tuple[str, str, int],
                           payload: tuple[tuple[str, bytes], ...], manifest_extra: dict[str, Any],
                           embedded_extra: bool) -> None:
        """A deferred snapshot, in the background: the copy (protocol step 2a) and its check, then
        what a deferred save keeps off the caller's path because it is collective (the embedded
        extra state's rank-invariance check and step 2, the staging directory), then steps 3-9.
        A failed copy fails the save inside DCP's planning, which every rank takes part in, so
        every rank raises and the coordinator removes the staging directory."""
        failed: Exception | None = None
        try:
            self.io.mark(SavePoint.STAGING, rank=rank)
            deferred.copy()
        except Exception as e:  # noqa: BLE001 - fails the save on every rank, in _persist
            failed = e
        finally:
            deferred.end()  # whatever happened, nothing waits for this copy any more
        root, step_dir, step = where
        if embedded_extra:  # the values at the call: copied when the save was recorded
            self._check_rank_invariant(group, deferred.tree[EXTRA_STATE_KEY], step_dir)
        staged = self._stage_or_fail(group, root, step_dir, step)
        self._persist(group, staged, deferred.tree, payload, manifest_extra | {"writer": staged.writer}, failed=failed)

    def _persist(self, group, staged: StagedStep, dcp_state: dict[str, Any], payload: tuple[tuple[str, bytes], ...],
                 manifest_extra: dict[str, Any], failed: Exception | None = None) -> None:
        """Protocol steps 3-9 (:mod:`refckpt.commit`): DCP writes and agrees, the coordinator commits,
        publishes and retains, every rank learns the outcome."""
        rank, _world = self._rank_world(group)
        root, step_dir, step = staged.root, staged.step_dir, staged.step
        writer = SafetensorsWriter(
            staged.path, io=self.io, sync_files=self.sync_files, checksums=self.checksums,
            extra_payload=payload, manifest_extra=manifest_extra,
        )
        try:
            dcp.save(
                dcp_state, storage_writer=writer,
                planner=RefSavePlanner() if failed is None else _FailingPlanner(failed),
                process_group=group, no_dist=group is None,
            )
        except CheckpointException as e:
            bad_rank, exc = _unwrap(e)
            if rank == 0:
                staged.abort()
            raise SaveFailedError(
                f"save of step {step} to {step_dir} failed on rank(s) {sorted(e.failures)}; rank "
                f"{bad_rank}: {type(exc).__name__}: {exc}. Nothing was published; the previous "
                f"checkpoint stays the newest complete one.{os_error_hint(exc, root)}"
            ) from exc
        except Exception as e:
            if rank == 0:
                staged.abort()
            raise SaveFailedError(
                f"save of step {step} to {step_dir} failed on rank {rank}: {type(e).__name__}: {e}. "
                f"Nothing was published.{os_error_hint(e, root)}"
            ) from e

        def publish() -> None:
            staged.publish(writer.record_footer, overwrite=self.overwrite)
            if self.keep_last is not None:
                try:
                    retain(root, self.keep_last, step, self.io)
                except Exception as e:  # noqa: BLE001 - the save is committed; retention failing must not undo that
                    log.warning("step %d is committed at %s; retention failed (%s: %s) and is retried by the next "
                                "save", step, step_dir, type(e).__name__, e)

        try:
            self._coordinated(group, publish)
        except CheckpointError:
            raise
        except Exception as e:
            if not os.path.lexists(staged.path) and os.path.isdir(step_dir):  # the rename happened
                raise SaveFailedError(
                    f"step {step} is committed at {step_dir} (resume finds it), but a later part of the save "
                    f"failed: {type(e).__name__}: {e}. Save again to be sure the pointer and retention ran."
                ) from e
            raise SaveFailedError(
                f"publishing step {step} at {step_dir} failed: {type(e).__name__}: {e}. The commit record "
                f"is in {staged.path}; the previous checkpoint stays the newest complete one."
            ) from e
        self.io.mark(SavePoint.DONE, rank=rank)

    # -- async -------------------------------------------------------------------
    def _release_guards(self, force: bool = False) -> None:
        """Remove a deferred snapshot's global hooks once its copy has ended (on the caller's
        thread: see :mod:`refckpt.staging`)."""
        deferred = self._deferred
        if deferred is not None and (force or deferred.done):
            self._deferred = None
            deferred.remove_guards()

    def raise_for_failed_async_save(self) -> None:
        """Raise :class:`AsyncSaveFailedError` if the background save failed. Never blocks."""
        fut = self._pending
        if fut is None or not fut.done():
            self._release_guards()
            return
        self._pending = None
        self._release_guards(force=True)
        exc = fut.exception()
        if exc is not None:
            raise AsyncSaveFailedError(f"async save of step {self._pending_step} failed: {exc}") from exc

    def maybe_wait_for_async_save(self) -> None:
        """Block until the in-flight async save (if any) is durable; raise if it failed."""
        fut = self._pending
        if fut is None:
            self._release_guards(force=True)
            return
        try:
            fut.result()
        except Exception as exc:
            raise AsyncSaveFailedError(f"async save of step {self._pending_step} failed: {exc}") from exc
        finally:
            self._pending = None
            self._release_guards(force=True)

    # -- load ----------------------------------------------------------------------
    def find_latest_checkpoint(self, checkpoint_dir: str | os.PathLike) -> str | None:
        """Path of the newest complete checkpoint under ``checkpoint_dir`` (local; no collectives)."""
        return find_latest_checkpoint(os.fspath(checkpoint_dir))

    def load(
        self,
        path: str | os.PathLike,
        state: dict[str, Any],
        *,
        strict_model: bool = True,
        extra_state_skeleton: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """Load the checkpoint at step directory ``path`` into ``state`` in place; returns ``state``.

        A transaction: the load fills ``state`` completely from this step, or raises and leaves it
        exactly as it was (every tensor's bytes, every container's entries). Every byte is read and
        verified, and every rank agrees that all is well, before anything of ``state`` is written.

        ``state["model"]`` must be complete in the checkpoint unless ``strict_model=False``.
        ``state["extra_state"]`` (if present) is replaced, in place, by the saved extra state, exactly
        as it was saved (:mod:`refckpt.extra`); ``extra_state_skeleton`` names keys it must hold.
        A state that cannot receive the checkpoint (meta tensors, a dtype or shape that differs, entries
        sharing memory that the checkpoint holds apart, something other than a tensor where a tensor was
        saved, a tensor that overlaps itself) raises :class:`StateMismatchError`, a caller error, on every
        rank (see :mod:`refckpt.planner`). A file that changes in place between the verification and the
        copy is a :class:`~refckpt.errors.PartialLoadError` (the state is then partly written).
        """
        self.maybe_wait_for_async_save()
        _wait_for_other_instances()
        _check_state(state, "load")
        step_dir = os.path.abspath(os.fspath(path))
        group = self._group()
        rank, world = self._rank_world(group)
        if not os.path.isdir(step_dir):
            raise CheckpointNotFoundError(
                f"{step_dir}: no such checkpoint directory. Pass a step directory such as "
                f"find_latest_checkpoint(root), or call load_latest(root, state)."
            )
        st = check_step_dir(step_dir)
        if not st.complete:
            if st.state is StepState.INCOMPLETE and not st.commit_records and list_step_dirs(step_dir):  # no record, steps
                raise CheckpointNotFoundError(
                    f"{step_dir}: is a checkpoint root, not a step directory; call load_latest({step_dir!r}, state) "
                    f"or load(find_latest_checkpoint(root), state)."
                )
            if st.damaged:
                raise (UnsafeCheckpointError if st.unsafe else CorruptCheckpointError)(
                    f"{step_dir}: damaged, not loaded: {st.reason}")
            raise IncompleteCheckpointError(f"{step_dir}: not a complete checkpoint: {st.reason}.")
        md, manifest = metadata_for_rank(st, rank, world), st.manifest
        saved_tops = {k.split(".", 1)[0] for k in md.state_dict_metadata}
        layout = manifest.extra_state if manifest is not None else None
        if manifest is None:  # plain DCP / family checkpoint: detect
            if os.path.isdir(os.path.join(step_dir, EXTRA_STATE_DIR)):
                layout = EXTRA_STATE_PER_RANK
            elif EXTRA_STATE_KEY in saved_tops:
                layout = EXTRA_STATE_EMBEDDED
        want_extra = EXTRA_STATE_KEY in state or extra_state_skeleton is not None
        if want_extra and layout is None:
            raise MissingTrainingStateError(
                f"{step_dir}: checkpoint holds no extra_state (training state such as global_step). "
                f"To load weights only, pass a state without 'extra_state' and 'optimizer', e.g. "
                f"load(path, {{'model': model_state_dict}})."
            )
        if OPTIMIZER_KEY in state and OPTIMIZER_KEY not in saved_tops:
            raise MissingTrainingStateError(
                f"{step_dir}: checkpoint holds no optimizer state. To load weights only, pass a state "
                f"without 'optimizer', e.g. load(path, {{'model': model_state_dict}})."
            )
        saved_world = manifest.world_size if manifest is not None else None
        if want_extra and layout == EXTRA_STATE_PER_RANK and saved_world is not None and saved_world != world:
            # Decided alike on every rank before any collective; not damage, so load_latest must not fall back.
            # Both directions: growing leaves new ranks without state, shrinking silently drops the
            # state of the ranks that are gone (their data positions, RNG streams).
            raise MissingTrainingStateError(
                f"{step_dir}: per-rank extra state was saved by {saved_world} ranks; this world has {world}. "
                f"Per-rank extra state cannot be resharded: load without 'extra_state' "
                f"(model and optimizer reshard), save with extra_state_per_rank=False, or load at the saved world size."
            )
        # A transactional load (docs/design.md, "Load"): DCP fills a copy of the state's containers,
        # whose leaves are the caller's own tensors; the reader verifies every byte without writing
        # any of the caller's tensors (pass 1), the ranks agree that all is well, and only then are
        # the bytes copied in and the containers' new values (non-tensor items, optimizer entries
        # the load creates) put into the caller's dicts. A load that fails has changed nothing.
        load_state, statefuls = _load_view(state)
        embedded_blob = layout == EXTRA_STATE_EMBEDDED and isinstance(md.state_dict_metadata.get(EXTRA_STATE_KEY),
                                                                       BytesStorageMetadata)
        if want_extra and layout == EXTRA_STATE_EMBEDDED:
            if embedded_blob:  # one encoded blob (refckpt.extra), read as one non-tensor item
                load_state[EXTRA_STATE_KEY] = b""
            else:  # older refckpt: the extra state's entries embedded one by one
                load_state[EXTRA_STATE_KEY] = (
                    copy.deepcopy(extra_state_skeleton) if extra_state_skeleton is not None
                    else _skeleton_from_metadata(md, EXTRA_STATE_KEY)
                )
        reader = RankRecordReader(step_dir, rank, verify_checksums=self.verify_checksums, safe_globals=self.safe_globals,
                                  transactional=True)
        planner = RefLoadPlanner(
            checkpoint_path=step_dir, strict_model=strict_model,
            main_params_key=self.main_params_key, safe_globals=self.safe_globals,
            caller_tensors=_tensor_ids(load_state),
        )
        failed: CheckpointError | None = None
        try:
            dcp.load(load_state, storage_reader=reader, planner=planner, process_group=group, no_dist=group is None)
        except CheckpointException as e:
            bad_rank, exc = _unwrap(e)
            if not isinstance(exc, CheckpointError):
                raise CorruptCheckpointError(
                    f"{step_dir}: load failed on rank {bad_rank}: {type(exc).__name__}: {exc}"
                ) from exc
            failed = exc  # refckpt's own error (this rank's or a peer's): raised as it is, below
        except RuntimeError as e:  # DCP's own plan exchange failed: a peer, not the bytes
            raise _collective_error(f"loading {step_dir}", self.timeout, e) from e
        if failed is not None:
            raise failed
        # Every rank has read and verified everything DCP reads (DCP gathered the read phase). What
        # is left to check before anything of the caller's changes: tied destinations and the extra
        # state. One vote, so that every rank commits or every rank raises the same error.
        extra: Any = None
        err: BaseException | None = None
        try:
            mismatch = planner.tie_mismatch()
            if mismatch is not None:
                raise StateMismatchError(mismatch)
            if want_extra:
                extra = self._read_extra(step_dir, rank, world, manifest, layout, load_state.pop(EXTRA_STATE_KEY, None),
                                         embedded_blob, extra_state_skeleton)
        except (CheckpointError, OSError) as e:
            err = e
        self._agree(group, err, f"loading {step_dir}")
        err = None
        try:
            reader.commit()  # pass 2: the verified bytes into the caller's tensors
            planner.commit()
        except (CheckpointError, OSError) as e:
            err = e if isinstance(e, PartialLoadError) else PartialLoadError(f"{step_dir}: {type(e).__name__}: {e}")
        _merge_containers(state, load_state, statefuls)
        self._agree(group, err, f"loading {step_dir}")
        if want_extra:
            target = state.get(EXTRA_STATE_KEY)
            if isinstance(target, dict):
                target.clear()
                target.update(extra)
            else:
                state[EXTRA_STATE_KEY] = extra
        return state

    def _agree(self, group, err: BaseException | None, what: str) -> None:
        """Every rank raises, or none does: the failure that decides (:func:`_decisive`) is raised on
        every rank, with its class and message and the rank it happened on (chained to this rank's own
        exception where it is that one)."""
        rank, world = self._rank_world(group)
        if world == 1:
            if err is not None:
                raise err
            return
        mine = None if err is None else (type(err).__name__, str(err))
        try:
            flag = torch.tensor([0 if mine is None else 1], dtype=torch.int32)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
            if not int(flag.item()):
                return
            allv: list[Any] = [None] * world
            dist.all_gather_object(allv, mine, group=group)
        except RuntimeError as e:
            raise _collective_error(f"agreeing on the outcome of {what}", self.timeout, e) from e
        r, (name, message) = _decisive([(r, v) for r, v in enumerate(allv) if v is not None])
        decided = _error_class(name)(f"{message} (found on rank {r})")  # the same words on every rank
        raise decided from (err if r == rank else None)

    def _read_extra(self, step_dir: str, rank: int, world: int, manifest: Manifest | None, layout: str | None,
                    loaded: Any, embedded_blob: bool, skeleton: dict[str, Any] | None) -> dict:
        """This rank's extra state, read and checked (nothing of the caller's is touched here)."""
        if layout == EXTRA_STATE_PER_RANK:
            extra = self._read_extra_per_rank(step_dir, rank, world, manifest)
        elif embedded_blob:
            if not isinstance(loaded, (bytes, bytearray)):
                raise CorruptCheckpointError(f"{step_dir}: the embedded extra state is a {type(loaded).__name__}, "
                                             f"not an encoded blob.")
            extra = decode_extra_state(bytes(loaded), f"{step_dir} (embedded extra_state)", self.safe_globals)
        else:
            extra = loaded
        if not isinstance(extra, dict):
            raise CorruptCheckpointError(f"{step_dir}: extra state is a {type(extra).__name__}, not a dict.")
        if skeleton is not None:
            missing = set(skeleton) - set(extra)
            if missing:
                raise MissingKeysError(f"{step_dir}: extra_state lacks {format_keys(map(str, missing))} named by "
                                       f"extra_state_skeleton.")
        if "global_step" not in extra:
            raise MissingTrainingStateError(
                f"{step_dir}: extra_state has no 'global_step'; nothing trustworthy was restored. "
                f"To load weights only, pass a state without 'extra_state'."
            )
        return extra

    def _read_extra_per_rank(self, step_dir: str, rank: int, world: int, manifest: Manifest | None) -> dict:
        rel = f"{EXTRA_STATE_DIR}/{extra_state_file_name(rank)}"
        full = safe_relpath(step_dir, rel)
        try:
            with open_regular(full) as f:  # a FIFO planted here must not hang the load
                data = f.read()
        except FileNotFoundError as e:
            saved_world = manifest.world_size if manifest is not None else None
            hint = (f" The checkpoint was saved by {saved_world} ranks and this is rank {rank} of {world}; per-rank "
                    f"extra state cannot be resharded: load without 'extra_state' or at the saved world size."
                    if saved_world and saved_world != world else "")
            raise IncompleteCheckpointError(f"{full}: per-rank extra state missing.{hint}") from e
        if manifest is not None and self.verify_checksums:
            verify_file_bytes(manifest, rel, data, full)
        extra = decode_extra_state(data, full, self.safe_globals)
        if not isinstance(extra, dict):
            raise CorruptCheckpointError(f"{full}: extra state is a {type(extra).__name__}, not a dict.")
        return extra

    def load_latest(self, checkpoint_dir: str | os.PathLike, state: dict[str, Any], **load_kwargs: Any) -> str | None:
        """Load the newest complete checkpoint; on a corrupt one, all ranks fall back together.

        Returns the step directory loaded, or None when ``checkpoint_dir`` has no complete checkpoint.
        A caller error (:class:`~refckpt.errors.CallerError`: a state that does not fit the checkpoint
        -- meta tensors, tied entries the checkpoint holds apart, a dtype or shape that differs, missing
        keys -- or missing training state, a bad setting) is raised at once, on every rank, with no
        fallback: every step would fail alike and none is damaged. Only damage falls back.
        """
        self.maybe_wait_for_async_save()
        _wait_for_other_instances()
        root = os.path.abspath(os.fspath(checkpoint_dir))
        group = self._group()
        failed: list[str] = []
        below: list[int | None] = [None]

        def next_candidate() -> str | None:
            # Lazily, newest first: a root of many steps costs one record check when the newest loads.
            return next((st.path for st in complete_steps_newest_first(root, below=below[0])), None)

        while (cand := self._coordinated(group, next_candidate)) is not None:
            below[0] = parse_step_dir_name(os.path.basename(cand))
            err: BaseException | None = None
            lease = take_lease(root, os.path.basename(cand))
            try:
                self.load(cand, state, **load_kwargs)
            except (CallerError, CollectiveError, PartialLoadError):
                raise  # not damage (or the state is no longer as it was): falling back would not help
            except (CheckpointError, OSError) as e:
                err = e
            finally:
                drop_lease(lease)
            bad = self._all_ok(group, err)
            if not bad:
                if failed:
                    log.warning("resumed from %s after skipping damaged %s", cand, failed)
                return cand
            msg = (f"refckpt: checkpoint {cand} failed to load on rank(s) {[r for r, _ in bad]} "
                   f"({bad[0][1]}); ALL ranks fall back to the previous complete checkpoint.")
            warnings.warn(msg, stacklevel=2)
            log.error(msg)
            failed.append(cand)
        if failed:
            raise CorruptCheckpointError(
                f"{root}: every complete checkpoint failed to load ({failed}); restore one from a copy."
            )
        return None

    def close(self) -> None:
        """Wait for an in-flight async save, stop the background thread, free staging buffers."""
        try:
            self.maybe_wait_for_async_save()
        finally:
            if self._executor is not None:
                self._executor.shutdown(wait=True)
                self._executor = None
            self._stager.release()


def _snapshot_mode(mode: Any, what: str) -> str:
    if mode not in (SNAPSHOT_COPY, SNAPSHOT_DEFERRED):
        raise ConfigError(f"{what}={mode!r}: choose {SNAPSHOT_COPY!r} (save returns once the state is copied) or "
                          f"{SNAPSHOT_DEFERRED!r} (save returns at once; the copy runs in the background, guarded).")
    return str(mode)


class _FailingPlanner(RefSavePlanner):
    """Fails this rank's part of a save inside DCP's planning, which every rank takes part in:
    every rank then raises, the coordinator aborts the staging directory, nothing is published."""

    def __init__(self, error: Exception) -> None:
        super().__init__()
        self.error = error

    def set_up_planner(self, state_dict: Any, storage_meta: Any = None, is_coordinator: bool = False) -> None:
        raise self.error


def _check_state(state: Any, op: str) -> None:
    if not isinstance(state, dict):
        raise ConfigError(f"{op}: state must be a dict like {{'model': ..., 'optimizer': ..., 'extra_state': ...}}, "
                          f"got {type(state).__name__}.")


def _skeleton_from_metadata(md: Any, top: str) -> dict:
    """Rebuild a nested container for the keys under ``top`` from DCP metadata (planner_data paths)."""
    from torch.distributed.checkpoint._traverse import set_element
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    mappings = md.planner_data if isinstance(md.planner_data, dict) else {}
    root: dict[str, Any] = {}
    for key, smd in md.state_dict_metadata.items():
        path = mappings.get(key) or tuple(key.split("."))
        if not path or str(path[0]) != top:
            continue
        if isinstance(smd, TensorStorageMetadata):
            value: Any = torch.empty(smd.size, dtype=smd.properties.dtype)
        else:
            value = None
        set_element(root, path, value)
    return root.get(top, {})


# -- the transactional load's containers ------------------------------------------------------------
def _copy_containers(obj: Any) -> Any:
    """``obj`` with every dict and list copied (recursively) and every other value the same object:
    what DCP may change in a state's containers (non-tensor items set, optimizer entries created)
    happens in the copy; the tensors are the caller's own, filled in place only at the commit."""
    if isinstance(obj, dict):
        if type(obj) is dict:
            out: dict = {}
        else:  # OrderedDict and the like keep their type
            try:
                out = copy.copy(obj)
                out.clear()
            except Exception:  # noqa: BLE001 - a dict subclass that cannot be copied: a plain dict
                out = {}
        for k, v in obj.items():
            out[k] = _copy_containers(v)
        return out
    if isinstance(obj, list):
        return [_copy_containers(v) for v in obj]
    return obj


def _load_view(state: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(what DCP loads into: the state without extra state, containers copied; the ``Stateful`` values
    by key, whose ``state_dict()`` was taken here and whose ``load_state_dict`` runs at the commit)."""
    view: dict[str, Any] = {}
    statefuls: dict[str, Any] = {}
    for k, v in state.items():
        if k == EXTRA_STATE_KEY:
            continue
        if isinstance(v, Stateful) and not isinstance(v, (dict, list)):
            statefuls[k] = v
            v = v.state_dict()
        view[k] = _copy_containers(v)
    return view, statefuls


def _tensor_ids(obj: Any, out: set[int] | None = None) -> set[int]:
    """ids of the tensors (DTensors as themselves) held in ``obj``'s dicts, lists and tuples."""
    out = set() if out is None else out
    stack = [obj]
    while stack:
        o = stack.pop()
        if isinstance(o, torch.Tensor):
            out.add(id(o))
        elif isinstance(o, dict):
            stack.extend(o.values())
        elif isinstance(o, (list, tuple)):
            stack.extend(o)
    return out


_MISSING = object()


def _merge_into(orig: Any, new: Any) -> None:
    """Put what DCP changed in the copied containers ``new`` (a dict or list) into the caller's
    ``orig`` of the same shape: containers merged in place, any other changed value set."""
    for k, v in (new.items() if isinstance(new, dict) else enumerate(new)):
        o = orig.get(k, _MISSING) if isinstance(orig, dict) else orig[k]
        if o is v:
            continue
        if (isinstance(o, dict) and isinstance(v, dict)) or (isinstance(o, list) and isinstance(v, list)
                                                             and len(o) == len(v)):
            _merge_into(o, v)
        else:
            orig[k] = v


def _merge_containers(state: dict[str, Any], view: dict[str, Any], statefuls: dict[str, Any]) -> None:
    """The commit of a load's containers: :func:`_merge_into`, and ``load_state_dict`` of the
    ``Stateful`` values (their ``state_dict()`` is what was loaded into)."""
    for k, st in statefuls.items():
        st.load_state_dict(view[k])
    _merge_into(state, {k: v for k, v in view.items() if k not in statefuls})


# -- agreeing on an outcome --------------------------------------------------------------------------
def _decisive(failures: list[tuple[int, tuple[str, str]]]) -> tuple[int, tuple[str, str]]:
    """The failure every rank raises when some failed: a state partly written first (no fallback may
    start from it), then a caller error (falling back cannot fix the call), then damage; the lowest
    rank among those."""
    def rank_of(item: tuple[int, tuple[str, str]]) -> tuple[int, int]:
        cls = _error_class(item[1][0])
        order = 0 if issubclass(cls, PartialLoadError) else 1 if issubclass(cls, CallerError) else 2
        return order, item[0]

    return min(failures, key=rank_of)


def _error_class(name: str) -> type[CheckpointError]:
    """The refckpt error class called ``name`` (another rank's); damage for anything else."""
    cls = getattr(_errors, name, None)
    if cls is None:
        from . import extra as _extra

        cls = getattr(_extra, name, None)
    if isinstance(cls, type) and issubclass(cls, CheckpointError):
        return cls
    return CorruptCheckpointError
