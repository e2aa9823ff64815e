"""``DistributedCheckpointer``: the save protocol of :mod:`refckpt.protocol` on top of DCP."""

from __future__ import annotations

import concurrent.futures
import copy
import datetime
import errno
import hashlib
import io as _io
import logging
import os
import secrets
import threading
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

from .durable import DEFAULT_IO, FileIO, atomic_write_bytes, tmp_prefix
from .errors import (
    AsyncSaveFailedError,
    CheckpointError,
    CheckpointExistsError,
    CheckpointNotFoundError,
    CollectiveError,
    ConfigError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    InvalidCheckpointPathError,
    MissingKeysError,
    MissingTrainingStateError,
    SaveFailedError,
    ShapeMismatchError,
    UnsafeCheckpointError,
    os_error_hint,
)
from .interop import RankRecordReader, metadata_for_rank
from .layout import (
    EXTRA_STATE_DIR,
    LATEST_CHECKPOINT_FILE,
    MANIFEST_ATTR,
    METADATA_FILE,
    STEP_PREFIX,
    check_step_dir,
    complete_steps_newest_first,
    extra_state_file_name,
    find_latest_checkpoint,
    list_step_dirs,
    parse_step_dir_name,
    safe_relpath,
    staging_dir_name,
    staging_step,
    step_dir_name,
)
from .planner import EXTRA_STATE_KEY, MAIN_PARAMS_KEY, OPTIMIZER_KEY, RefLoadPlanner, format_keys
from .protocol import SavePoint
from .record import read_record_bytes, split_record
from .safeload import load_record, open_regular, safe_torch_load
from .staging import Stager, accelerator_available
from .storage import SafetensorsWriter, checksum_fn

__all__ = ["DistributedCheckpointer", "EXTRA_STATE_PER_RANK", "EXTRA_STATE_EMBEDDED"]

log = logging.getLogger(__name__)

EXTRA_STATE_PER_RANK = "per_rank"
EXTRA_STATE_EMBEDDED = "embedded"
_LEASE_PREFIX = ".lease."

# One dedicated gloo group per process for checkpoint collectives: async saves run
# their collectives on a background thread, which must never interleave with the
# training loop's collectives on the default group, and DCP needs a CPU backend.
_GROUPS: dict[tuple[int, float], Any] = {}
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
    key = (id(dist.group.WORLD), timeout_s)
    with _GROUPS_LOCK:
        if key not in _GROUPS:
            _GROUPS[key] = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
        return _GROUPS[key]


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
        checksums: record a checksum (CRC-32C) for every item at save. Readers verify what is recorded.
        verify_checksums: verify recorded checksums when bytes are read.
        sync_files: fsync step files and directories. False forfeits power-loss safety (the small
            pointer file is still written with tmp + fsync + rename).
        main_params_key: top-level key of a mixed-precision fp32 main-parameter branch.
        safe_globals: extra classes allowed when unpickling non-tensor items and
            extra state (``torch.load(weights_only=True)`` allow-list), e.g. numpy types.
        pin_memory: stage async saves into pinned host memory (default: when an accelerator
            (CUDA, NPU, ...) is available).
        reuse_staging: keep the host buffers an async save stages into for the next async save
            (one host copy of the state stays allocated between saves; re-mapping fresh memory
            on every save made staging several times slower). False frees them after each save;
            :meth:`close` frees them too.
    """

    #: What this checkpointer offers beyond the seed's contract (docs/contract: the capability
    #: names a judge such as ``faults.suite`` reads; plain strings, so nothing is imported for it).
    capabilities = ("root_save", "overwrite", "keep_last", "load_latest", "per_rank_extra_state",
                    "embedded_extra_state", "priming")

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
        self._stager = Stager(pin=self.pin_memory, reuse=reuse_staging)
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
        """Every rank's failure (rank, message); empty when all succeeded."""
        rank, world = self._rank_world(group)
        mine = None if err is None else f"{type(err).__name__}: {err}"
        if world == 1:
            allv = [mine]
        else:
            allv = [None] * world
            try:
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
    def save(self, path: str | os.PathLike, state: dict[str, Any], *, global_step: int, save_async: bool = False) -> None:
        """Save ``state`` as step ``global_step`` under the root ``path`` (or into ``path`` = ``.../global_step_N``).

        Sync: returns once the step is committed, published and the pointer written
        on every rank -- the save is then *acknowledged*: no later crash takes it away.
        Async: returns once tensors are staged in host memory; the rest runs in the
        background and is acknowledged by :meth:`maybe_wait_for_async_save`.
        Every rank raises the same :class:`SaveFailedError` if any rank fails;
        nothing is published then and the previous checkpoint stays the newest.
        """
        self.io.mark(SavePoint.WAIT_PREVIOUS)
        self.maybe_wait_for_async_save()
        _wait_for_other_instances()
        _check_state(state, "save")
        root, step_dir = self._root_and_step_dir(path, global_step)
        group = self._group()
        rank, world = self._rank_world(group)
        layout = None
        extra = state.get(EXTRA_STATE_KEY)
        if extra is not None:
            if not isinstance(extra, dict):
                raise ConfigError(f"state['extra_state'] must be a dict, got {type(extra).__name__}.")
            extra = dict(extra)
            extra.setdefault("global_step", global_step)
            layout = EXTRA_STATE_PER_RANK if self.extra_state_per_rank else EXTRA_STATE_EMBEDDED
        try:
            staging, writer = self._coordinated(group, lambda: self._prepare(root, step_dir, global_step))
        except OSError as e:
            if isinstance(e, CheckpointError):
                raise
            raise SaveFailedError(f"save of step {global_step}: cannot prepare a staging directory under the "
                                  f"checkpoint root {root} ({type(e).__name__}: {e}); nothing was written, the "
                                  f"previous checkpoint stays the newest complete one.{os_error_hint(e, root)}") from e

        payload: tuple[tuple[str, bytes], ...] = ()
        dcp_state = {k: v for k, v in state.items() if k != EXTRA_STATE_KEY}
        if layout == EXTRA_STATE_PER_RANK:
            buf = _io.BytesIO()
            torch.save(extra, buf)
            payload = ((f"{EXTRA_STATE_DIR}/{extra_state_file_name(rank)}", buf.getvalue()),)
        elif layout == EXTRA_STATE_EMBEDDED:
            self._check_rank_invariant(group, extra, step_dir)
            dcp_state[EXTRA_STATE_KEY] = extra
        manifest_extra = {"world_size": world, "global_step": global_step, "extra_state": layout, "writer": writer}
        if save_async:
            self.io.mark(SavePoint.STAGING, rank=rank)
            dcp_state = self._stager.stage(dcp_state)
            self.io.mark(SavePoint.STAGED, rank=rank)
            if self._executor is None:
                self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="refckpt-async")
            self._pending_step = global_step
            self._pending = self._executor.submit(
                self._persist, group, root, step_dir, staging, global_step, dcp_state, payload, manifest_extra
            )
            _track(self._pending)
            return
        self._persist(group, root, step_dir, staging, global_step, dcp_state, payload, manifest_extra)

    def _prepare(self, root: str, step_dir: str, step: int) -> tuple[str, str]:
        """(staging directory, writer token) of this save, made on the coordinator.

        The token names this save's own staging directory and goes into its manifest, so that
        publish can tell its own commit record from another writer's (see :meth:`_publish`)."""
        writer = secrets.token_hex(8)
        staging = os.path.join(root, staging_dir_name(step, writer))
        self.io.mark(SavePoint.PREPARE, path=staging)
        if os.path.exists(root) and not os.path.isdir(root):
            raise InvalidCheckpointPathError(f"{root}: exists and is not a directory; pass a directory as checkpoint root.")
        self.io.mkdir(root)
        pointer = os.path.join(root, LATEST_CHECKPOINT_FILE)
        if os.path.isdir(pointer) and not os.path.islink(pointer):  # os.replace could never publish over it
            raise InvalidCheckpointPathError(f"{pointer}: is a directory where refckpt keeps its pointer file; "
                                             f"remove or rename it, then save again. Nothing was written.")
        if os.path.lexists(step_dir):
            st = check_step_dir(step_dir, root)
            if st.complete and not self.overwrite:
                raise CheckpointExistsError(
                    f"{step_dir}: a complete checkpoint of step {step} exists; refusing to overwrite it. "
                    f"Pass DistributedCheckpointer(overwrite=True) to replace it (the old one stays "
                    f"resumable until the new one is committed), or save under another step."
                )
            if not st.complete:
                log.warning("removing incomplete %s (%s) before saving step %d", step_dir, st.reason, step)
                self._remove(step_dir)
        self._sweep(root, step)
        self.io.mkdir(staging)
        # The coordinator's writer fsyncs the root (the staging entry) before any shard, in the
        # background for an async save: its caller does not wait for a directory fsync.
        return staging, writer

    def _sweep(self, root: str, step: int) -> None:
        """Remove what a crashed save or retention left in the root: pointer tmp files, steps
        already renamed aside for deletion, and staging directories of this step (an earlier
        attempt's, or a writer that is still running and must not publish a mix: its publish then
        fails, naming this). None is a checkpoint or can become one. A leftover that cannot be
        removed is named and left: it never blocks this save."""
        ptmp = tmp_prefix(os.path.join(root, LATEST_CHECKPOINT_FILE))
        for name in os.listdir(root):
            doomed = (name.startswith(ptmp) or staging_step(name) == step
                      or (name.startswith(f".{STEP_PREFIX}") and name.endswith((".deleting", ".old"))))
            if not doomed:
                continue
            path = os.path.join(root, name)
            log.warning("removing %s left by an interrupted save or retention", path)
            try:
                self._remove(path)
            except (OSError, RecursionError) as e:
                log.warning("could not remove %s (%s: %s); it is not a checkpoint and is left as it is: "
                            "remove it by hand", path, type(e).__name__, e)

    def _remove(self, path: str) -> None:
        if os.path.islink(path) or not os.path.isdir(path):
            self.io.unlink(path)
        else:
            self.io.rmtree(path)

    def _check_rank_invariant(self, group, extra: dict, step_dir: str) -> None:
        rank, world = self._rank_world(group)
        if world == 1:
            return
        buf = _io.BytesIO()
        torch.save(extra, buf)
        digest = hashlib.sha256(buf.getvalue()).hexdigest()
        allv: list[Any] = [None] * world
        try:
            dist.all_gather_object(allv, (digest, sorted(extra)), group=group)
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

    def _persist(self, group, root, step_dir, staging, step, dcp_state, payload, manifest_extra) -> None:
        rank, world = self._rank_world(group)
        writer = SafetensorsWriter(
            staging, io=self.io, sync_files=self.sync_files, checksums=self.checksums,
            extra_payload=payload, manifest_extra=manifest_extra,
        )
        try:
            dcp.save(
                dcp_state, storage_writer=writer, planner=DefaultSavePlanner(),
                process_group=group, no_dist=group is None,
            )
        except CheckpointException as e:
            bad_rank, exc = _unwrap(e)
            self._cleanup_staging(rank, staging)
            raise SaveFailedError(
                f"save of step {step} to {step_dir} failed on rank(s) {sorted(e.failures)}; rank "
                f"{bad_rank}: {type(exc).__name__}: {exc}. Nothing was published; the previous "
                f"checkpoint stays the newest complete one.{os_error_hint(exc, root)}"
            ) from exc
        except Exception as e:
            self._cleanup_staging(rank, staging)
            raise SaveFailedError(
                f"save of step {step} to {step_dir} failed on rank {rank}: {type(e).__name__}: {e}. "
                f"Nothing was published.{os_error_hint(e, root)}"
            ) from e
        self.io.mark(SavePoint.AGREE, rank=rank)
        try:
            self._coordinated(group, lambda: self._publish(root, step_dir, staging, step, manifest_extra["writer"],
                                                           writer.record_footer))
        except CheckpointError:
            raise
        except Exception as e:
            if not os.path.lexists(staging) and os.path.isdir(step_dir):  # the rename happened
                raise SaveFailedError(
                    f"step {step} is committed at {step_dir} (resume finds it), but a later part of the save "
                    f"failed: {type(e).__name__}: {e}. Save again to be sure the pointer and retention ran."
                ) from e
            raise SaveFailedError(
                f"publishing step {step} at {step_dir} failed: {type(e).__name__}: {e}. The commit record "
                f"is in {staging}; the previous checkpoint stays the newest complete one."
            ) from e
        self.io.mark(SavePoint.DONE, rank=rank)

    def _cleanup_staging(self, rank: int, staging: str) -> None:
        # Best effort: the next save removes it anyway (readers ignore hidden staging dirs).
        if rank == 0:
            try:
                if os.path.lexists(staging):
                    self._remove(staging)
            except OSError as e:
                log.warning("could not remove %s after a failed save: %s", staging, e)

    def _publish(self, root: str, step_dir: str, staging: str, step: int, writer: str,
                 footer: bytes | None = None) -> None:
        self.io.mark(SavePoint.PUBLISH, path=step_dir)
        self._check_own_record(staging, writer, step, footer)
        if os.path.lexists(step_dir) and self.overwrite:
            if self.io.exchange(staging, step_dir):
                self._fsync_published(root, step_dir, step)
                self._remove_after_publish(staging, step_dir, step)  # now holds the old step
            else:  # pragma: no cover - file systems without RENAME_EXCHANGE
                old = os.path.join(root, f".{os.path.basename(step_dir)}.{writer}.old")
                log.warning("no atomic exchange on this file system; replacing %s with two renames", step_dir)
                self.io.replace(step_dir, old)
                self.io.replace(staging, step_dir)
                if self.sync_files:
                    self.io.fsync_dir(root)
                self._remove_after_publish(old, step_dir, step)
        else:
            # rename(2) of a directory never replaces a non-empty one: if another writer published
            # this step since prepare, this fails (ENOTEMPTY/EEXIST) and this save is not acknowledged.
            try:
                self.io.replace(staging, step_dir)
            except OSError as e:
                if e.errno not in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR, errno.EISDIR):
                    raise
                self._cleanup_staging(0, staging)
                raise SaveFailedError(
                    f"save of step {step}: {step_dir} appeared while this save was written (another job or "
                    f"an older incarnation of this one saves into the same root {root}); this save was not "
                    f"published and the step on disk is the other writer's. Give each job its own checkpoint "
                    f"root, and make sure no earlier incarnation of the job is still running.") from e
            self._fsync_published(root, step_dir, step)
        pointer = os.path.join(root, LATEST_CHECKPOINT_FILE)
        self.io.mark(SavePoint.POINTER, path=pointer)
        try:
            atomic_write_bytes(pointer, f"{step}\n".encode(), self.io)
        except OSError as e:  # the step is already published: say so, not "nothing was published"
            raise SaveFailedError(f"step {step} is committed at {step_dir} (resume finds it), but writing the "
                                  f"pointer {pointer} failed ({type(e).__name__}: {e}); the pointer is only a "
                                  f"hint, so nothing is lost.{os_error_hint(e, root)}") from e
        if self.keep_last is not None:
            self.io.mark(SavePoint.RETENTION, path=root)
            try:
                self._retain(root, step)
            except Exception as e:  # noqa: BLE001 - the save is committed; retention failing must not undo that
                log.warning("step %d is committed at %s; retention failed (%s: %s) and is retried by the next save",
                            step, step_dir, type(e).__name__, e)

    def _check_own_record(self, staging: str, writer: str, step: int, footer: bytes | None) -> None:
        """The staging directory about to be published must hold this save's own commit record,
        intact: never publish a directory another writer wrote into or replaced. ``footer``: the
        record footer (length and SHA-256) this save's writer wrote; the file must end with it and
        its bytes must match it -- a read and a hash, no parse. Without one (the writer ran in
        another process), the record is parsed and its writer token compared."""
        path = os.path.join(staging, METADATA_FILE)
        try:
            if footer is not None:
                data = read_record_bytes(path)
                ok = data.endswith(footer) and split_record(data, path)[1] is not None
                theirs = writer if ok else "another writer's record"
            else:
                md, checksum = load_record(path)
                manifest = getattr(md, MANIFEST_ATTR, None)
                theirs = manifest.get("writer") if isinstance(manifest, dict) and checksum else None
        except (CheckpointError, OSError) as e:
            theirs = f"unreadable ({e})"
        if theirs != writer:
            raise SaveFailedError(
                f"save of step {step}: the staging directory {staging} does not hold this save's commit record "
                f"(found: {theirs}; this save is {writer!r}); another process writes into the same root. "
                f"Nothing was published. Give each job its own checkpoint root.")

    def _remove_after_publish(self, path: str, step_dir: str, step: int) -> None:
        try:
            self._remove(path)
        except (OSError, RecursionError) as e:
            log.warning("step %d is committed at %s; the replaced copy %s could not be removed (%s: %s); the next "
                        "save removes it", step, step_dir, path, type(e).__name__, e)

    def _fsync_published(self, root: str, step_dir: str, step: int) -> None:
        """Make the rename that published ``step_dir`` durable. It is visible already, so a failure
        must not claim the previous checkpoint is still the newest."""
        if not self.sync_files:
            return
        try:
            self.io.fsync_dir(root)
        except OSError as e:
            raise SaveFailedError(
                f"step {step} is committed and visible at {step_dir}, but making its directory entry "
                f"durable (fsync of {root}) failed ({type(e).__name__}: {e}): resume on this machine finds it; "
                f"after a power loss it may be gone and resume takes the previous step. Save again to be "
                f"sure.{os_error_hint(e, root)}"
            ) from e

    def _retain(self, root: str, just_saved: int) -> None:
        kept = 0
        for step, path in list_step_dirs(root):
            st = check_step_dir(path, root)
            if st.complete and kept < self.keep_last:
                kept += 1
                continue
            if not st.complete and step >= just_saved:
                continue  # not ours to judge: newer than what we committed
            if _leased(root, os.path.basename(path)):
                log.info("retention: keeping %s, a reader holds a lease on it", path)
                continue
            try:
                doomed = os.path.join(root, f".{os.path.basename(path)}.{secrets.token_hex(4)}.deleting")
                self.io.replace(path, doomed)  # readers see the step vanish whole, never half-deleted
                self._remove(doomed)
            except (OSError, RecursionError) as e:
                # One failed deletion must not fail the save that was already committed.
                log.warning("retention could not delete %s: %s", path, e)

    # -- async -------------------------------------------------------------------
    def raise_for_failed_async_save(self) -> None:
        """Raise :class:`AsyncSaveFailedError` if the background save failed. Never blocks."""
        fut = self._pending
        if fut is None or not fut.done():
            return
        self._pending = None
        exc = fut.exception()
        if exc is not None:
            raise AsyncSaveFailedError(f"async save of step {self._pending_step} failed: {exc}") from exc

    def maybe_wait_for_async_save(self) -> None:
        """Block until the in-flight async save (if any) is durable; raise if it failed."""
        fut = self._pending
        if fut is None:
            return
        try:
            fut.result()
        except Exception as exc:
            raise AsyncSaveFailedError(f"async save of step {self._pending_step} failed: {exc}") from exc
        finally:
            self._pending = None

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

        ``state["model"]`` must be complete in the checkpoint unless ``strict_model=False``.
        ``state["extra_state"]`` (if present) is replaced, in place, by the saved extra state;
        ``extra_state_skeleton`` restricts an embedded restore to its keys.
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
            if st.reason.startswith("no commit record") and list_step_dirs(step_dir):
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
        layout = (manifest or {}).get("extra_state") if manifest else None
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
        saved_world = (manifest or {}).get("world_size")
        if want_extra and layout == EXTRA_STATE_PER_RANK and isinstance(saved_world, int) and saved_world != world:
            # Decided alike on every rank before any collective; not damage, so load_latest must not fall back.
            # Both directions: growing leaves new ranks without state, shrinking silently drops the
            # state of the ranks that are gone (their data positions, RNG streams).
            raise MissingTrainingStateError(
                f"{step_dir}: per-rank extra state was saved by {saved_world} ranks; this world has {world}. "
                f"Per-rank extra state cannot be resharded: load without 'extra_state' "
                f"(model and optimizer reshard), save with extra_state_per_rank=False, or load at the saved world size."
            )
        load_state = {k: v for k, v in state.items() if k != EXTRA_STATE_KEY}
        if want_extra and layout == EXTRA_STATE_EMBEDDED:
            load_state[EXTRA_STATE_KEY] = (
                copy.deepcopy(extra_state_skeleton) if extra_state_skeleton is not None
                else _skeleton_from_metadata(md, EXTRA_STATE_KEY)
            )
        reader = RankRecordReader(step_dir, rank, verify_checksums=self.verify_checksums, safe_globals=self.safe_globals)
        planner = RefLoadPlanner(
            checkpoint_path=step_dir, strict_model=strict_model,
            main_params_key=self.main_params_key, safe_globals=self.safe_globals,
        )
        try:
            dcp.load(load_state, storage_reader=reader, planner=planner, process_group=group, no_dist=group is None)
        except CheckpointException as e:
            bad_rank, exc = _unwrap(e)
            if isinstance(exc, CheckpointError):
                raise exc
            raise CorruptCheckpointError(
                f"{step_dir}: load failed on rank {bad_rank}: {type(exc).__name__}: {exc}"
            ) from exc
        except RuntimeError as e:  # DCP's own plan exchange failed: a peer, not the bytes
            raise _collective_error(f"loading {step_dir}", self.timeout, e) from e
        if not want_extra:
            return state
        if layout == EXTRA_STATE_PER_RANK:
            extra = self._read_extra_per_rank(step_dir, rank, world, manifest)
        else:
            extra = load_state[EXTRA_STATE_KEY]
        if extra_state_skeleton is not None:
            missing = set(extra_state_skeleton) - set(extra)
            if missing:
                raise MissingKeysError(f"{step_dir}: extra_state lacks {format_keys(missing)} named by extra_state_skeleton.")
        if not isinstance(extra, dict) or "global_step" not in extra:
            raise MissingTrainingStateError(
                f"{step_dir}: extra_state has no 'global_step'; nothing trustworthy was restored. "
                f"To load weights only, pass a state without 'extra_state'."
            )
        target = state.get(EXTRA_STATE_KEY)
        if isinstance(target, dict):
            target.clear()
            target.update(extra)
        else:
            state[EXTRA_STATE_KEY] = extra
        return state

    def _read_extra_per_rank(self, step_dir: str, rank: int, world: int, manifest: dict | None) -> dict:
        rel = f"{EXTRA_STATE_DIR}/{extra_state_file_name(rank)}"
        full = safe_relpath(step_dir, rel)
        try:
            with open_regular(full) as f:  # a FIFO planted here must not hang the load
                data = f.read()
        except FileNotFoundError as e:
            saved_world = (manifest or {}).get("world_size")
            hint = (f" The checkpoint was saved by {saved_world} ranks and this is rank {rank} of {world}; per-rank "
                    f"extra state cannot be resharded: load without 'extra_state' or at the saved world size."
                    if saved_world and saved_world != world else "")
            raise IncompleteCheckpointError(f"{full}: per-rank extra state missing.{hint}") from e
        if manifest is not None and self.verify_checksums and manifest.get("checksum"):
            rec = manifest["files"].get(rel)
            if rec is None:
                raise CorruptCheckpointError(f"{full}: not listed in the commit record; refusing to trust it.")
            chunks = rec.get("chunks") or []
            algo = manifest["checksum"]
            if len(data) != rec["size"] or (chunks and checksum_fn(algo)(data, 0) != chunks[0][2]):
                raise CorruptCheckpointError(
                    f"{full}: size or {algo} differs from the commit record; the extra state is corrupt. "
                    f"Resume from an older step (load_latest falls back by itself)."
                )
        extra = safe_torch_load(data, full, self.safe_globals)
        if not isinstance(extra, dict):
            raise CorruptCheckpointError(f"{full}: extra state is a {type(extra).__name__}, not a dict.")
        return extra

    def load_latest(self, checkpoint_dir: str | os.PathLike, state: dict[str, Any], **load_kwargs: Any) -> str | None:
        """Load the newest complete checkpoint; on a corrupt one, all ranks fall back together.

        Returns the step directory loaded, or None when ``checkpoint_dir`` has no complete checkpoint.
        Errors that are not about damaged bytes (a model that does not match, missing
        training state) are raised, not fallen back from.
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
            lease = _take_lease(root, os.path.basename(cand))
            try:
                self.load(cand, state, **load_kwargs)
            except (MissingKeysError, MissingTrainingStateError, ShapeMismatchError, ConfigError, CollectiveError):
                raise  # not damage: falling back would not help
            except (CheckpointError, OSError) as e:
                err = e
            finally:
                _drop_lease(lease)
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


def _lease_name(step_name: str) -> str:
    return f"{_LEASE_PREFIX}{step_name}.{os.getpid()}"


def _take_lease(root: str, step_name: str) -> str | None:
    """Mark ``step_name`` as being read by this process, so retention on this host skips it."""
    path = os.path.join(root, _lease_name(step_name))
    try:
        with open(path, "w"):
            pass
        return path
    except OSError:
        return None  # read-only root: nothing to protect against anyway


def _drop_lease(path: str | None) -> None:
    if path:
        try:
            os.unlink(path)
        except OSError:
            pass


def _leased(root: str, step_name: str) -> bool:
    prefix = f"{_LEASE_PREFIX}{step_name}."
    try:
        names = [n for n in os.listdir(root) if n.startswith(prefix)]
    except OSError:
        return False
    for n in names:
        pid = n[len(prefix):]
        if not pid.isdigit():
            continue
        try:
            os.kill(int(pid), 0)
            return True
        except ProcessLookupError:
            continue
        except PermissionError:
            return True
    return False
