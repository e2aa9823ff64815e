"""Mutants of :class:`tests.independent_ckpt.IndependentCheckpointer`, each breaking ONE protocol rule.

The resilience suite must fail every one of them (and pass the unmutated checkpointer).
Each mutant still saves and loads a plain round trip correctly: the bugs only show under
the fault, crash or situation its ``detectable_by`` names:

* ``"process-crash"``: kill the saver at some point inside ``save`` (every completed
  ``write()`` survives) and check the on-disk invariants / what resume finds;
* ``"power-loss"``: a crash-state explorer that drops everything not fsynced
  (file data *and* directory entries);
* ``"disk-fault"``: damage a committed step (delete/truncate/bit-flip a file, garble the pointer);
* ``"pointer"``: torn, garbage, stale or dangling pointer;
* ``"hostile"``: crafted checkpoint bytes;
* ``"async"``: an async save that fails in the background / tensors mutated after it returns;
* ``"multi-rank"``: at least 2 ranks whose extra state differs;
* ``"fresh-optimizer"``: loading into an optimizer state dict with no state yet;
* ``"retention"`` / ``"overwrite"``: ``keep_last`` / saving twice to the same step;
* ``"fallback"``: ``load_latest`` past a damaged step, into a state that a failed load must leave
  as it was, or a caller's mistake it must not fall back from;
* ``"extra-state"``: extra state a weights-only reader cannot restore;
* ``"memory"``: hostile bytes whose parsing costs far more memory than their size;
* ``"process-event"``: a signal during a save, interpreter exit with an async save in flight, a
  fork during a save (:mod:`faults.suite.test_process_events`);
* ``"shared-root"``: readers in other pid namespaces beside retention, interrupted saves of many
  steps, two writers in one root (:mod:`faults.suite.test_shared_root`).

``MUTANTS`` maps a name to a factory taking the same keyword arguments as
:func:`tests.independent_ckpt.make`; usable as ``--checkpointer=tests.mutants:<name>``
through the module-level functions of the same name.
"""

from __future__ import annotations

import logging
import os
import pickle
import shutil
import threading
from collections.abc import Callable
from typing import Any

from torch.distributed.checkpoint.metadata import Metadata

from tests.independent_ckpt import (
    EXTRA_DIR,
    POINTER,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    IndependentCheckpointer,
    _LoadPlanner,
    _Reader,
    _RestrictedUnpickler,
)

log = logging.getLogger("independent_ckpt.mutants")


class PointerBeforeCommit(IndependentCheckpointer):
    """Breaks save step 7 (pointer only after publish): the pointer is written before staging is
    renamed into place, so a crash in between leaves a pointer naming a step that does not exist."""

    detectable_by = "process-crash"

    def _publish(self, root, step_dir, staging, step):
        self._sync_tree(staging)
        self._write_pointer(root, step)
        self._move_into_place(root, staging, step_dir)
        self._retain(root)


class TrustsPointer(IndependentCheckpointer):
    """Breaks "the pointer is a cache": resume goes wherever a parseable pointer says (dangling,
    stale, or naming an incomplete step), without checking completeness or newer steps."""

    detectable_by = "pointer"

    def find_latest_checkpoint(self, root):
        try:
            with open(os.path.join(os.fspath(root), POINTER)) as f:
                return os.path.join(os.path.abspath(os.fspath(root)), f"global_step_{int(f.read().strip())}")
        except (OSError, ValueError):
            return super().find_latest_checkpoint(root)


class NoCompletenessCheck(IndependentCheckpointer):
    """Breaks "complete iff the commit record exists": the newest ``global_step_N`` wins even
    without ``.metadata`` (a save never crashes into that state here, thanks to staging, so only a
    damaged or foreign step directory shows it)."""

    detectable_by = "disk-fault"

    def find_latest_checkpoint(self, root):
        steps = self._steps(os.path.abspath(os.fspath(root)))
        return steps[0][1] if steps else None


class NoSizeCheck(IndependentCheckpointer):
    """Breaks "every file the record covers exists with the recorded size": only ``.metadata`` is
    checked, so a missing or truncated shard is resumed from (and then fails to load)."""

    detectable_by = "disk-fault"

    def _required_files(self, md):
        return {}


class NoChecksum(IndependentCheckpointer):
    """Breaks "content checksums are verified when bytes are read, never skipped silently":
    a bit-flipped shard of the same size loads without complaint."""

    detectable_by = "disk-fault"

    def _verify(self, step_dir, rel, manifest):
        return None


class NoDirFsync(IndependentCheckpointer):
    """Breaks the fsync-the-directory half of steps 5-7: renames and new entries are never made
    durable, so after power loss an acknowledged step (or the pointer) can vanish. Invisible
    to a process crash: only a power-loss explorer that drops unsynced directory entries sees it."""

    detectable_by = "power-loss"

    def _fsync_dir(self, path):
        return None


class UnprimedOptimizer(IndependentCheckpointer):
    """Breaks "a fresh optimizer gets its state": when the target optimizer state dict has no
    ``state`` entries yet, the optimizer is not loaded at all, so training resumes with zeroed
    moments (exp_avg, exp_avg_sq, step) while the model and extra state look fine."""

    detectable_by = "fresh-optimizer"

    def _prepare_targets(self, md, load_state, strict_model):
        opt = load_state.get("optimizer")
        if isinstance(opt, dict) and opt.get("state") == {}:
            del load_state["optimizer"]
        super()._prepare_targets(md, load_state, strict_model)


class EmbeddedRankVariantExtra(IndependentCheckpointer):
    """Breaks "per-rank extra state stays per rank": extra state is embedded in the DCP payload,
    which DCP deduplicates to one copy, so every rank gets one rank's RNG/data position back."""

    detectable_by = "multi-rank"

    def _split_state(self, state, global_step):
        dcp_state = dict(state)
        if state.get("extra_state") is not None:
            dcp_state["extra_state"] = {"global_step": global_step, **state["extra_state"]}
        return dcp_state, None

    def _read_extra(self, step_dir, md, rank, world, skeleton):
        import torch
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint._traverse import set_element
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        holder: dict[str, Any] = {}
        for key, smd in md.state_dict_metadata.items():
            path = md.planner_data.get(key, ())
            if path and path[0] == "extra_state":
                value = torch.empty(smd.size, dtype=smd.properties.dtype) if isinstance(smd, TensorStorageMetadata) else None
                set_element(holder, path, value)
        if "extra_state" not in holder:
            raise KeyError(f"{step_dir}: checkpoint holds no extra state")
        group = self._group()
        dcp.load(holder, storage_reader=_Reader(step_dir, self), planner=_LoadPlanner(),
                 process_group=group, no_dist=group is None)
        return holder["extra_state"]


class SwallowedAsyncError(IndependentCheckpointer):
    """Breaks "a background failure is raised by raise_for_failed_async_save() and
    maybe_wait_for_async_save()": failures are logged and swallowed, so a lost save is acknowledged."""

    detectable_by = "async"

    def maybe_wait_for_async_save(self):
        try:
            super().maybe_wait_for_async_save()
        except Exception as e:  # noqa: BLE001 - the bug
            log.error("async save failed (ignored): %s", e)

    def raise_for_failed_async_save(self):
        try:
            super().raise_for_failed_async_save()
        except Exception as e:  # noqa: BLE001 - the bug
            log.error("async save failed (ignored): %s", e)


class PointerInPlace(IndependentCheckpointer):
    """Breaks step 7 (pointer via tmp -> fsync -> os.replace): the pointer is truncated and
    rewritten in place, in two write()s with an fsync between, so a crash in between leaves a
    torn pointer (empty, or a prefix of the digits naming another step)."""

    detectable_by = "process-crash"

    def _write_pointer(self, root, step):
        data = f"{step}\n".encode()
        with open(os.path.join(root, POINTER), "wb") as f:
            for part in (data[: len(data) // 2], data[len(data) // 2:]):
                f.write(part)
                f.flush()
                os.fsync(f.fileno())
        self._fsync_dir(root)


class RetentionDeletesNewest(IndependentCheckpointer):
    """Breaks step 8 ("never delete the newest complete step"): keep-last-k keeps the k OLDEST
    complete steps, deleting the one just saved."""

    detectable_by = "retention"

    def _retain(self, root):
        if self.keep_last is None:
            return
        complete = [p for _s, p in reversed(self._steps(root)) if self.check_step(p, root) is not None]
        for path in complete[self.keep_last:]:
            shutil.rmtree(path)


class OverwriteInPlace(IndependentCheckpointer):
    """Breaks step 2 ("never lose the old step N before the new one is committed"): with
    ``overwrite=True`` the complete old step is deleted before the new one is written, so a crash
    (or failure) during the re-save loses an acknowledged checkpoint."""

    detectable_by = "overwrite"  # plus a process crash during an overwriting save

    def _prepare(self, root, step_dir, staging):
        if self.overwrite and os.path.isdir(step_dir) and self.check_step(step_dir, root) is not None:
            shutil.rmtree(step_dir)
            self._fsync_dir(root)
        super()._prepare(root, step_dir, staging)


class OverwritesSilently(IndependentCheckpointer):
    """Breaks step 2 ("refuse to overwrite a complete step N unless asked"): a second save of
    the same step replaces the first without ``overwrite=True``."""

    detectable_by = "overwrite"

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.overwrite = True


class NoFallbackOnMissingExtra(IndependentCheckpointer):
    """Breaks "complete iff every file the record covers exists": per-rank extra-state files are
    not checked, so a step missing one is chosen for resume (and its load then fails)."""

    detectable_by = "disk-fault"

    def _required_files(self, md):
        return {rel: v for rel, v in super()._required_files(md).items() if not rel.startswith(EXTRA_DIR + "/")}


class AsyncNoSnapshot(IndependentCheckpointer):
    """Breaks "async save stages tensors to host memory on the caller's thread": the background
    writes the live tensors, so updates made after save() returned leak into the checkpoint.
    (The background persist -- a slow disk -- only starts once the caller waits for it, so the
    race is lost deterministically, without a sleep.)"""

    detectable_by = "async"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._release = threading.Event()

    def _snapshot(self, obj):
        return obj

    def _persist(self, *args, **kwargs):
        if threading.current_thread() is not threading.main_thread():  # the async save's thread
            self._release.wait()
        return super()._persist(*args, **kwargs)

    def maybe_wait_for_async_save(self):
        # only a wait for a pending save releases it: save() itself waits for the previous save
        # first, and releasing there let the persist race the caller's training (the mutant then
        # survived about one run in three)
        if getattr(self, "_pending", None) is not None:
            self._release.set()
        return super().maybe_wait_for_async_save()

    def raise_for_failed_async_save(self):
        self._release.set()  # a caller that polls for the outcome gets one, as from the original
        return super().raise_for_failed_async_save()


class UnsafeMetadataUnpickle(IndependentCheckpointer):
    """Breaks "the load path never executes code from the checkpoint": ``.metadata`` is read with
    plain ``pickle.load``, so a crafted commit record runs code (already in find_latest_checkpoint)."""

    detectable_by = "hostile"

    def _read_commit_record(self, path):
        with open(path, "rb") as f:
            return pickle.load(f)  # noqa: S301 - the bug


class RetentionFollowsLinks(IndependentCheckpointer):
    """Breaks "never delete outside the root": retention empties every step older than the kept
    ones file by file, following a step directory that is a symbolic link into whatever it
    points to (another run's checkpoint), then removes the link."""

    detectable_by = "retention"

    def _retain(self, root):
        if self.keep_last is None:
            return
        complete = [(s, p) for s, p in self._steps(root) if self.check_step(p, root) is not None]
        if len(complete) <= self.keep_last:
            return
        oldest_kept = complete[self.keep_last - 1][0]
        for s, path in self._steps(root):
            if s < oldest_kept:
                for dirpath, dirs, files in os.walk(path, topdown=False):  # the bug: follows ``path`` if a link
                    for f in files:
                        os.unlink(os.path.join(dirpath, f))
                    for d in dirs:
                        os.rmdir(os.path.join(dirpath, d))
                if os.path.islink(path):
                    os.unlink(path)
                else:
                    os.rmdir(path)


class LazyVerifyFallback(IndependentCheckpointer):
    """Breaks "a load that fails changes nothing": each file is verified only when DCP reads it and the
    extra state only after DCP filled the state, so a damaged extra-state file fails the load after the
    model and optimizer were written; ``load_latest``'s fallback to the previous step then leaves every
    entry that step does not hold (a parameter with no optimizer state yet) at the newer step's values."""

    detectable_by = "fallback"

    def _verify_all(self, step_dir, md):
        return set()

    def _read_extra_early(self, step_dir, md, rank, world, skeleton):
        return None


class UncheckedExtraState(IndependentCheckpointer):
    """Breaks "save refuses what load cannot restore": extra state is written without checking that the
    weights-only reader reads it back, so a numpy RNG state (``np.random.get_state()``) is acknowledged
    and the step then never resumes."""

    detectable_by = "extra-state"

    def _check_readable(self, data):
        return None


class CallerErrorFallsBack(IndependentCheckpointer):
    """Breaks "only damage falls back": ``load_latest`` takes any error of ``load`` for damage, so a
    caller's mistake (``None`` where a tensor was saved) walks back through every older step and ends
    as "every step failed to load"."""

    detectable_by = "fallback"

    def load_latest(self, root, state, **load_kwargs):
        root = os.path.abspath(os.fspath(root))
        tried = []
        for _step, path in self._steps(root):
            if self.check_step(path, root) is None:
                continue
            try:
                self.load(path, state, **load_kwargs)
                return path
            except Exception as e:  # noqa: BLE001 - the bug
                log.warning("%s failed to load (%s); falling back", path, e)
                tried.append(path)
        if tried:
            raise RuntimeError(f"{root}: every complete step failed to load: {tried}")
        return None


class UnboundedRecord(IndependentCheckpointer):
    """Breaks "memory is bounded by the bytes read": a commit record without its sha256 trailer (plain
    DCP's) is accepted and parsed by the unpickler with no bound on the objects it builds, so 8 MiB of
    object-creating opcodes take gigabytes; the extra state of such a step is loaded as it is."""

    detectable_by = "memory"

    def _read_commit_record(self, path):
        try:
            return super()._read_commit_record(path)
        except CorruptCheckpointError:
            import io as _io

            if not os.path.isfile(path) or os.path.getsize(path) > 1 << 30:
                raise
            with open(path, "rb") as f:
                md = _RestrictedUnpickler(_io.BytesIO(f.read())).load()  # the bug: no bound, no checksum
            if not isinstance(md, Metadata):
                raise
            return md


class InterruptBecomesException(IndependentCheckpointer):
    """Breaks "an interrupt stays an interrupt": a KeyboardInterrupt or SystemExit during a save is
    wrapped into a RuntimeError (the save is still completed alike on every rank), which a
    trainer's ``except Exception`` swallows: a preemption ignored."""

    detectable_by = "process-event"

    def save(self, path, state: dict, *, global_step: int, save_async: bool = False) -> None:
        try:
            super().save(path, state, global_step=global_step, save_async=save_async)
        except (KeyboardInterrupt, SystemExit) as e:  # the bug
            raise RuntimeError(f"save interrupted: {type(e).__name__}") from e


class DaemonAsyncSave(IndependentCheckpointer):
    """Breaks "an async save in flight at exit completes or the exit fails": the background save
    runs in a daemon thread, which the interpreter abandons at exit: the save is lost and the
    process exits 0."""

    detectable_by = "process-event"

    class _DaemonPool:
        def submit(self, fn, *args, **kwargs):
            import concurrent.futures

            fut: concurrent.futures.Future = concurrent.futures.Future()

            def body() -> None:
                try:
                    fut.set_result(fn(*args, **kwargs))
                except BaseException as e:  # noqa: BLE001 - the future carries it
                    fut.set_exception(e)

            threading.Thread(target=body, daemon=True).start()
            return fut

        def shutdown(self, wait: bool = True) -> None:
            pass

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._executor = self._DaemonPool()  # type: ignore[assignment]


class UnagreedCallerError(IndependentCheckpointer):
    """Breaks "validate before the first collective, and agree": a rank whose state cannot be saved
    (extra state that cannot be pickled) raises at once without telling its peers, which wait for
    it in the next collective -- for the whole timeout, and the group is out of step after."""

    detectable_by = "process-event"

    def _split_state(self, state: dict, global_step: int):
        try:
            return super()._split_state(state, global_step)
        except Exception as e:  # the bug: raised here, before the agreement
            raise _Escape(e) from e

    def _save(self, path, state: dict, *, global_step: int, save_async: bool = False) -> None:
        try:
            super()._save(path, state, global_step=global_step, save_async=save_async)
        except _Escape as e:
            raise e.error from None


class _Escape(BaseException):
    """Carries a local error past the agreement's ``except Exception`` (UnagreedCallerError's bug)."""

    def __init__(self, error: Exception) -> None:
        super().__init__(str(error))
        self.error = error


class InterruptSkipsAgreement(IndependentCheckpointer):
    """Breaks "an interrupt becomes a vote, never a skipped collective": SIGINT and SIGTERM are not
    held during a save, so a KeyboardInterrupt or SystemExit raised on one rank in the middle of a
    coordinated step leaves it before the broadcast its peers wait in -- they wait for the timeout,
    or read that rank's next collective as the answer."""

    detectable_by = "process-event"

    def save(self, path, state: dict, *, global_step: int, save_async: bool = False) -> None:
        self._save(path, state, global_step=global_step, save_async=save_async)  # no _signals_after


_IN_FLIGHT: list[Any] = []  # every async save of the process, never reset after fork (the bug)


class ForkInheritsPending(IndependentCheckpointer):
    """Breaks "after fork, the child's checkpointers start clean": every checkpointer waits for
    every async save of the process before it reads, through a process-wide registry that a
    forked child inherits -- its futures never complete there, so the child's resume hangs."""

    detectable_by = "process-event"

    def save(self, path, state: dict, *, global_step: int, save_async: bool = False) -> None:
        super().save(path, state, global_step=global_step, save_async=save_async)
        if self._pending is not None:
            _IN_FLIGHT.append(self._pending)

    def find_latest_checkpoint(self, root) -> str | None:
        for fut in list(_IN_FLIGHT):
            fut.exception()  # waits
        return super().find_latest_checkpoint(root)


class LoadLatestNeverRelists(IndependentCheckpointer):
    """Breaks "resume lands on the newest complete step whatever retention does": ``load_latest``
    lists the root once; a step deleted by a running save's retention after the listing is skipped
    as if it were damaged, and with nothing older left the answer is None -- a restarted job trains
    from scratch while a newer complete step is on disk."""

    detectable_by = "shared-root"

    def load_latest(self, root, state: dict, **load_kwargs: Any) -> str | None:
        root = os.path.abspath(os.fspath(root))
        group = self._group()
        tried: list[str] = []
        for _step, path in self._coordinated_value(group, lambda: self._steps(root)):
            if self._coordinated_value(group, lambda p=path: self.check_step(p, root) is not None) is False:
                continue
            try:
                self.load(path, state, **load_kwargs)
                return path
            except (CorruptCheckpointError, IncompleteCheckpointError) as e:  # a vanished step falls back too
                log.warning("%s failed to load (%s); falling back", path, e)
                tried.append(path)
        if tried:
            raise CorruptCheckpointError(f"{root}: every complete step failed to load: {tried}")
        return None


class FsyncBeforeFlush(IndependentCheckpointer):
    """Breaks "fsync covers the bytes": each file is written through Python's buffer and fsynced
    before the buffer is flushed, so a small file's bytes reach the kernel only at close, after the
    fsync -- a power cut after the save was acknowledged can empty it; the coordinator then trusts
    "fsynced when written" and does not fsync those files again (issue 29's buffered ``open_write``
    survivor: the power-loss model then counted fsync calls, not bytes)."""

    def _write_file(self, path: str, data: bytes) -> None:
        with open(path, "wb") as f:
            for i in range(0, len(data), 1024):  # as a serializer writes: piece by piece, through the buffer
                f.write(data[i:i + 1024])
            os.fsync(f.fileno())
        self._synced = getattr(self, "_synced", set()) | {os.path.basename(path)}

    def _fsync_file(self, path: str) -> None:
        if os.path.basename(path) not in getattr(self, "_synced", set()):  # "fsynced when written": trusted
            super()._fsync_file(path)


class RetentionLeaksDescriptors(IndependentCheckpointer):
    """Breaks "nothing grows with the number of saves": retention opens each doomed step to look at it
    and never closes the descriptor -- one leaked per deletion, until the job hits EMFILE (issue 29)."""

    def _retain(self, root: str) -> None:
        if self.keep_last is not None:
            complete = [p for _s, p in self._steps(root) if self.check_step(p, root) is not None]
            self._leaked = getattr(self, "_leaked", []) + [os.open(p, os.O_RDONLY) for p in complete[self.keep_last:]]
        super()._retain(root)


class RetentionKeepsTheOldest(IndependentCheckpointer):
    """Breaks "retention deletes what it does not keep": the oldest complete step is never deleted
    (a ``steps[1:]`` off by one): ``global_step_<first>`` stays for ever (issue 29's survivor)."""

    def _retain(self, root: str) -> None:
        if self.keep_last is None:
            return
        complete = [p for _s, p in self._steps(root) if self.check_step(p, root) is not None]
        for path in complete[self.keep_last:-1]:
            doomed = os.path.join(root, f".{os.path.basename(path)}.{os.getpid()}.deleting")
            os.rename(path, doomed)
            shutil.rmtree(doomed)


def _prepare_judging_staging(prepare: Callable[..., None], dead: Callable[[str], bool], *args: Any) -> None:
    """The independent checkpointer's preparation with ``dead`` as its judge of other steps' staging."""
    import tests.independent_ckpt as ic

    real = ic._dead_writers_staging
    ic._dead_writers_staging = dead
    try:
        prepare(*args)
    finally:
        ic._dead_writers_staging = real


class SweepsThisStepOnly(IndependentCheckpointer):
    """Breaks "leftovers are reclaimed": a save removes staging directories of its own step only;
    an interrupted save of any other step leaves its payload on disk for ever."""

    detectable_by = "shared-root"

    def _prepare(self, root: str, step_dir: str, staging: str) -> None:
        _prepare_judging_staging(super()._prepare, lambda name: False, root, step_dir, staging)


class SweepsLiveStaging(IndependentCheckpointer):
    """Breaks "never a live writer's": a save removes every staging directory in the root, of any
    step, whoever writes it -- a second job saving into the same root has its staging directory
    taken mid-save, and its save fails."""

    detectable_by = "shared-root"

    def _prepare(self, root: str, step_dir: str, staging: str) -> None:
        _prepare_judging_staging(super()._prepare, lambda name: name.startswith(".tmp_global_step_"), root, step_dir,
                                 staging)


_CLASSES: dict[str, type[IndependentCheckpointer]] = {
    "pointer_before_commit": PointerBeforeCommit,
    "trusts_pointer": TrustsPointer,
    "no_completeness_check": NoCompletenessCheck,
    "no_size_check": NoSizeCheck,
    "no_checksum": NoChecksum,
    "no_dir_fsync": NoDirFsync,
    "unprimed_optimizer": UnprimedOptimizer,
    "embedded_rank_variant_extra": EmbeddedRankVariantExtra,
    "swallowed_async_error": SwallowedAsyncError,
    "pointer_in_place": PointerInPlace,
    "retention_deletes_newest": RetentionDeletesNewest,
    "overwrite_in_place": OverwriteInPlace,
    "overwrites_silently": OverwritesSilently,
    "no_fallback_on_missing_extra": NoFallbackOnMissingExtra,
    "async_no_snapshot": AsyncNoSnapshot,
    "unsafe_metadata_unpickle": UnsafeMetadataUnpickle,
    "retention_follows_links": RetentionFollowsLinks,
    "lazy_verify_fallback": LazyVerifyFallback,
    "unchecked_extra_state": UncheckedExtraState,
    "caller_error_falls_back": CallerErrorFallsBack,
    "unbounded_record": UnboundedRecord,
    "interrupt_becomes_exception": InterruptBecomesException,
    "daemon_async_save": DaemonAsyncSave,
    "fork_inherits_pending": ForkInheritsPending,
    "unagreed_caller_error": UnagreedCallerError,
    "interrupt_skips_agreement": InterruptSkipsAgreement,
    "load_latest_never_relists": LoadLatestNeverRelists,
    "sweeps_this_step_only": SweepsThisStepOnly,
    "fsync_before_flush": FsyncBeforeFlush,
    "retention_leaks_descriptors": RetentionLeaksDescriptors,
    "retention_keeps_the_oldest": RetentionKeepsTheOldest,
    "sweeps_live_staging": SweepsLiveStaging,
}


def _factory(cls: type[IndependentCheckpointer]) -> Callable[..., IndependentCheckpointer]:
    def make(**kwargs: Any) -> IndependentCheckpointer:
        return cls(**kwargs)

    make.__doc__ = cls.__doc__
    return make


MUTANTS: dict[str, Callable[..., IndependentCheckpointer]] = {name: _factory(cls) for name, cls in _CLASSES.items()}
for _name, _fn in MUTANTS.items():
    _fn.__name__ = _fn.__qualname__ = _name  # picklable by reference as tests.mutants.<name>
globals().update(MUTANTS)  # ``tests.mutants:no_checksum`` etc. as factory specs
