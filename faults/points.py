"""The fault vocabulary: named crash points of the save protocol and named fault kinds.

Crash points are named after the steps of ``refckpt.protocol`` (never after line numbers)
and are observed through the I/O layer a checkpointer writes with: an operation (``write``,
``fsync``, ``fsync_dir``, ``replace``, ...) on a file of a given *role* (shard, commit record,
pointer, ...), before or after it, or a protocol mark (``FileIO.mark``). A point therefore
means the same thing in any checkpointer that writes through an observable layer -- refckpt's
:class:`refckpt.durable.FileIO`, or the ``os`` functions patched by :mod:`faults.inject`.

Each point says which ranks reach it (every rank, or the coordinator only) and where it lies
relative to the publish of the step: under the **process-crash model** (SIGKILL, OOM-kill,
preemption: completed writes survive in the page cache) a crash at or after the point where
the step directory is renamed into place leaves the step complete; a crash before leaves the
previous step the newest complete one. That is the oracle the crash tests check.
"""

from __future__ import annotations

import dataclasses
import os

from refckpt._enum import StrEnum

from .contract import (
    COMMIT_RECORD,
    DELETING_SUFFIX,
    EXTRA_STATE_DIR,
    POINTER_FILE,
    SHARD_SUFFIXES,
    STAGING_SUFFIX,
    STEP_PREFIX,
    STEP_RE,
    TMP_SUFFIX,
    is_commit_record,
)

__all__ = [
    "Role",
    "Target",
    "CrashPoint",
    "CRASH_POINTS",
    "POINTS_BY_NAME",
    "FaultKind",
    "classify",
    "target_ranks",
]


class Role(StrEnum):
    """What a path is, in the on-disk contract."""

    STAGING = "staging"          # .global_step_N.partial/ (the directory itself)
    EXTRA_STATE = "extra_state"  # extra_state/extra_state_rank_R.pt
    SHARD = "shard"              # payload files (*.safetensors, *.distcp)
    COMMIT_TMP = "commit_tmp"    # .metadata.tmp
    COMMIT = "commit"            # .metadata / __R.metadata (as a rename destination)
    PUBLISH = "publish"          # rename of the staging dir to global_step_N
    POINTER_TMP = "pointer_tmp"  # temp file of the pointer
    POINTER = "pointer"          # latest_checkpoint_iteration.txt (as a rename destination)
    RETENTION = "retention"      # a step being deleted
    ROOT = "root"                # the checkpoint root directory
    OTHER = "other"



def classify(path: str, dst: str | None = None) -> Role:
    """Role of ``path`` (for renames, of the pair ``path -> dst``) from names alone."""
    p = os.path.normpath(os.fspath(path))
    base = os.path.basename(p)
    if dst is not None:
        d = os.path.normpath(os.fspath(dst))
        dbase = os.path.basename(d)
        if dbase == POINTER_FILE:
            return Role.POINTER
        if is_commit_record(dbase):
            return Role.COMMIT
        if dbase.endswith(DELETING_SUFFIX) or base.endswith(DELETING_SUFFIX):
            return Role.RETENTION
        if STEP_RE.fullmatch(dbase) or (STEP_RE.fullmatch(base) and STAGING_SUFFIX in dbase):
            return Role.PUBLISH
        return Role.OTHER
    if base.endswith(DELETING_SUFFIX):
        return Role.RETENTION
    if base.startswith("." + POINTER_FILE) or base == POINTER_FILE:
        return Role.POINTER_TMP
    if base.startswith(COMMIT_RECORD) or is_commit_record(base.removesuffix(TMP_SUFFIX)):
        return Role.COMMIT_TMP
    parts = p.split(os.sep)
    if EXTRA_STATE_DIR in parts[-2:]:
        return Role.EXTRA_STATE
    if base.endswith(SHARD_SUFFIXES):
        return Role.SHARD
    if base.endswith(STAGING_SUFFIX) and base.startswith("." + STEP_PREFIX):
        return Role.STAGING
    return Role.OTHER


class Target(StrEnum):
    """Which ranks a fault hits."""

    COORDINATOR = "coordinator"          # rank 0
    NON_COORDINATOR = "non-coordinator"  # the last rank
    ALL = "all"                          # every rank: the whole job dies



def target_ranks(target: Target, world_size: int) -> list[int]:
    if target is Target.COORDINATOR:
        return [0]
    if target is Target.NON_COORDINATOR:
        if world_size < 2:
            raise ValueError("a world of 1 rank has no non-coordinator")
        return [world_size - 1]
    return list(range(world_size))


@dataclasses.dataclass(frozen=True)
class CrashPoint:
    """A moment in the save protocol where a process can die.

    ``op`` is an I/O operation or ``"mark"`` (a protocol step announced by the I/O layer);
    ``role`` the role of the path (for ``fsync_dir``: the role of the operation it follows);
    ``when`` is ``"before"`` or ``"after"``; ``nth`` counts matching events on one rank.
    ``publishes`` is True when, under the process-crash model, the step being saved is
    complete after a crash here.
    """

    name: str
    step: str
    op: str
    role: str
    when: str
    doc: str
    nth: int = 1
    coordinator_only: bool = False
    publishes: bool = False
    needs_retention: bool = False
    async_only: bool = False


_P = CrashPoint
#: Every crash point of the reference save protocol, in protocol order.
CRASH_POINTS: tuple[CrashPoint, ...] = (
    _P("prepare", "2-prepare", "mark", "2-prepare", "before",
       "Coordinator dies before the staging directory exists: nothing of the new step on disk.",
       coordinator_only=True),
    _P("staging.mkdir", "2-prepare", "mkdir", Role.STAGING, "after",
       "Coordinator dies right after creating the empty staging directory (a leftover the next save must clean).",
       coordinator_only=True),
    _P("staging", "2a-staging", "mark", "2a-staging", "before",
       "A rank dies while an async save copies its tensors to host memory (the caller's thread).",
       async_only=True),
    _P("extra_state.write", "3-extra-state", "write", Role.EXTRA_STATE, "before",
       "A rank dies with its extra-state file created but empty (preemption mid-write)."),
    _P("extra_state.fsync", "3-extra-state", "fsync", Role.EXTRA_STATE, "after",
       "A rank dies with its extra state durable but no shard written yet."),
    _P("shard.write", "3-shards", "write", Role.SHARD, "before",
       "A rank dies with its shard file created but empty (OOM-kill as writing starts)."),
    _P("shard.between_tensors", "3-shards", "write", Role.SHARD, "after",
       "A rank dies between two tensor writes of its shard: a torn, short payload file.", nth=2),
    _P("shard.fsync", "3-shards", "fsync", Role.SHARD, "before",
       "A rank dies with its shard fully written but not fsynced."),
    _P("shard.fsynced", "3-shards", "fsync", Role.SHARD, "after",
       "A rank dies right after its shard is durable, before the ranks agree."),
    _P("commit", "5-commit", "mark", "5-commit", "before",
       "Coordinator dies after every rank succeeded but before writing the commit record.",
       coordinator_only=True),
    _P("commit.tmp_fsync", "5-commit", "fsync", Role.COMMIT_TMP, "after",
       "Coordinator dies with the commit record durable in its tmp file, not yet renamed.",
       coordinator_only=True),
    _P("commit.rename", "5-commit", "replace", Role.COMMIT, "before",
       "Coordinator dies just before renaming the commit record into place.", coordinator_only=True),
    _P("commit.renamed", "5-commit", "replace", Role.COMMIT, "after",
       "Coordinator dies with the commit record in the (unpublished) staging directory.",
       coordinator_only=True),
    _P("commit.dirfsync", "5-commit", "fsync_dir", Role.COMMIT, "after",
       "Coordinator dies with the staged step fully durable but not published.", coordinator_only=True),
    _P("publish", "6-publish", "replace", Role.PUBLISH, "before",
       "Coordinator dies just before the rename that publishes the step.", coordinator_only=True),
    _P("published", "6-publish", "replace", Role.PUBLISH, "after",
       "Coordinator dies right after publishing (rename done, root not fsynced, pointer stale).",
       coordinator_only=True, publishes=True),
    _P("publish.dirfsync", "6-publish", "fsync_dir", Role.PUBLISH, "after",
       "Coordinator dies with the step published durably but the pointer still naming the previous step.",
       coordinator_only=True, publishes=True),
    _P("pointer.tmp_write", "7-pointer", "write", Role.POINTER_TMP, "before",
       "Coordinator dies with an empty pointer tmp file (the pointer itself untouched).",
       coordinator_only=True, publishes=True),
    _P("pointer.rename", "7-pointer", "replace", Role.POINTER, "before",
       "Coordinator dies with the new pointer durable in its tmp file, not yet renamed.",
       coordinator_only=True, publishes=True),
    _P("pointer.renamed", "7-pointer", "replace", Role.POINTER, "after",
       "Coordinator dies right after the pointer rename, before fsyncing the root.",
       coordinator_only=True, publishes=True),
    _P("retention.delete", "8-retention", "replace", Role.RETENTION, "before",
       "Coordinator dies as retention starts deleting an old step.",
       coordinator_only=True, publishes=True, needs_retention=True),
    _P("retention.rmtree", "8-retention", "rmtree", Role.RETENTION, "before",
       "Coordinator dies with an old step renamed aside for deletion but not yet removed.",
       coordinator_only=True, publishes=True, needs_retention=True),
    _P("done", "9-done", "mark", "9-done", "before",
       "A rank dies after the step is published but before its save call returns (not yet acknowledged).",
       publishes=True),
)
POINTS_BY_NAME = {p.name: p for p in CRASH_POINTS}
assert len(POINTS_BY_NAME) == len(CRASH_POINTS)


class FaultKind(StrEnum):
    """Every failure the harness injects, with the real failure it models (``describe``)."""

    CRASH = "crash"
    TORN_POINTER = "torn_pointer"
    EMPTY_POINTER = "empty_pointer"
    GARBAGE_POINTER = "garbage_pointer"
    NUL_POINTER = "nul_pointer"
    DANGLING_POINTER = "dangling_pointer"
    STALE_POINTER = "stale_pointer"
    MISSING_SHARD = "missing_shard"
    TRUNCATED_SHARD = "truncated_shard"
    BITFLIP_SHARD = "bitflip_shard"
    MISSING_COMMIT = "missing_commit"
    MISSING_EXTRA_STATE = "missing_extra_state"
    CORRUPT_EXTRA_STATE = "corrupt_extra_state"
    PARTIAL_OPTIMIZER = "partial_optimizer"
    PARTIAL_MAIN_PARAMS = "partial_main_params"
    ENOSPC_WRITE = "enospc_write"
    ENOSPC_FSYNC = "enospc_fsync"
    EIO_WRITE = "eio_write"
    EIO_FSYNC = "eio_fsync"
    RANK_DIES_IN_COLLECTIVE = "rank_dies_in_collective"
    RANK_HANGS_IN_COLLECTIVE = "rank_hangs_in_collective"
    ASYNC_PERSIST_FAILS = "async_persist_fails"
    ASYNC_PERSIST_KILLED = "async_persist_killed"
    BITFLIP_RECORD = "bitflip_record"
    TRUNCATED_RECORD = "truncated_record"
    CORRUPT_RECORD_FIELD = "corrupt_record_field"
    FORGED_RECORD_FIELD = "forged_record_field"
    FIFO_IN_STEP = "fifo_in_step"
    SIGINT_IN_SAVE = "sigint_in_save"
    SIGTERM_IN_SAVE = "sigterm_in_save"
    CALLER_ERROR_ONE_RANK = "caller_error_one_rank"
    EXIT_WITH_ASYNC_SAVE = "exit_with_async_save"
    FORK_DURING_SAVE = "fork_during_save"
    DEVICE_IN_STEP = "device_in_step"
    DEEP_TREE = "deep_tree"
    SECOND_WRITER = "second_writer"


    @property
    def describe(self) -> str:
        return _DESCRIBE[self]


#: Process events: judged for any checkpointer by ``faults.suite.test_process_events`` (and refckpt's
#: own tests/test_agreement.py, tests/test_exit.py), not cells of ``python -m faults matrix``.
PROCESS_EVENTS = frozenset({FaultKind.SIGINT_IN_SAVE, FaultKind.SIGTERM_IN_SAVE, FaultKind.CALLER_ERROR_ONE_RANK,
                            FaultKind.EXIT_WITH_ASYNC_SAVE, FaultKind.FORK_DURING_SAVE})

_DESCRIBE = {
    FaultKind.CRASH: "SIGKILL of a rank, the coordinator or every rank at a crash point (preemption, OOM-kill).",
    FaultKind.TORN_POINTER: "pointer holds a prefix of its content: an in-place write cut short by a crash.",
    FaultKind.EMPTY_POINTER: "pointer truncated to 0 bytes: O_TRUNC done, data never written back.",
    FaultKind.GARBAGE_POINTER: "pointer holds non-numeric bytes: a stray write or a different tool's file.",
    FaultKind.NUL_POINTER: "pointer holds NUL bytes: size extended by the journal but data lost (ext4 data=writeback).",
    FaultKind.DANGLING_POINTER: "pointer names a step that does not exist: deleted by hand or by another job's retention.",
    FaultKind.STALE_POINTER: "pointer names an older complete step: crash between publish and pointer, or a restored backup.",
    FaultKind.MISSING_SHARD: "a shard file is gone: lost object, partial copy, manual cleanup.",
    FaultKind.TRUNCATED_SHARD: "a shard is shorter than recorded: partial copy, disk full during a transfer.",
    FaultKind.BITFLIP_SHARD: "one bit of tensor data flipped, size intact: silent media or memory corruption.",
    FaultKind.MISSING_COMMIT: "the commit record is gone: a save that never finished, or a copy without hidden files.",
    FaultKind.MISSING_EXTRA_STATE: "a rank's extra-state file is gone.",
    FaultKind.CORRUPT_EXTRA_STATE: "a rank's extra-state file has the right size but wrong bytes.",
    FaultKind.PARTIAL_OPTIMIZER: "optimizer entries missing for some parameters: frozen, never-grad, saved before the "
                                 "first step.",
    FaultKind.PARTIAL_MAIN_PARAMS: "the fp32 main-parameter branch present for only some parameters.",
    FaultKind.ENOSPC_WRITE: "disk full on write (ENOSPC).",
    FaultKind.ENOSPC_FSYNC: "disk full discovered at writeback (ENOSPC from fsync, thin provisioning, NFS).",
    FaultKind.EIO_WRITE: "I/O error on write (EIO: failing disk, lost network mount).",
    FaultKind.EIO_FSYNC: "I/O error at writeback (EIO from fsync: the data never reached the disk).",
    FaultKind.RANK_DIES_IN_COLLECTIVE: "a rank dies while peers wait for it in a collective (node loss).",
    FaultKind.RANK_HANGS_IN_COLLECTIVE: "a rank hangs while peers wait for it (stuck NFS write, deadlock, GPU hang).",
    FaultKind.ASYNC_PERSIST_FAILS: "the background persist of an async save fails (I/O error after the call returned).",
    FaultKind.ASYNC_PERSIST_KILLED: "the process dies while an async save persists in the background.",
    FaultKind.BITFLIP_RECORD: "one bit of the commit record flipped, size intact: silent media or memory corruption "
                              "of the one file that says what the step holds.",
    FaultKind.TRUNCATED_RECORD: "the commit record cut short (1 to size-1 bytes kept): a partial copy or a torn write "
                                "of the record by a tool that does not rename.",
    FaultKind.CORRUPT_RECORD_FIELD: "one field of the commit record changed (a chunk's offsets, a storage entry's length, "
                                    "an optimizer state key), still a valid pickle, record checksum stale: a tool that "
                                    "rewrote the record, or a bug in a writer.",
    FaultKind.FORGED_RECORD_FIELD: "the same changed field with the record checksum recomputed over it, so only "
                                   "structural validation can tell: chunks that no longer tile their tensor, a length "
                                   "that runs past its file.",
    FaultKind.FIFO_IN_STEP: "a recorded payload file replaced by a FIFO of the same name: a stray mkfifo, a broken "
                            "restore; opening it for reading without O_NONBLOCK blocks forever.",
    FaultKind.SIGINT_IN_SAVE: "SIGINT (Ctrl-C, KeyboardInterrupt) at a file-system operation of a save, on one rank or "
                              "on every rank: an operator's Ctrl-C, a launcher forwarding it.",
    FaultKind.SIGTERM_IN_SAVE: "SIGTERM with a handler that calls sys.exit (what trainers install for a preemption "
                               "notice) at a file-system operation of a save, on one rank or every rank.",
    FaultKind.CALLER_ERROR_ONE_RANK: "one rank's state cannot be saved (unpicklable extra state) while the others' "
                                     "can: a bug on one rank's data path.",
    FaultKind.EXIT_WITH_ASYNC_SAVE: "the interpreter exits normally (end of the script, sys.exit) while an async save "
                                    "is in flight.",
    FaultKind.FORK_DURING_SAVE: "the process forks (a data loader's workers) while a save is in flight, and the "
                                "child makes its own checkpointer and resumes.",
    FaultKind.DEVICE_IN_STEP: "a recorded payload file replaced by a character device node (/dev/null's numbers): a "
                              "restore from an archive that carried device nodes; reads end at once with 0 bytes.",
    FaultKind.DEEP_TREE: "a directory tree 1,200 levels deep inside a step, not listed by its record: a runaway job "
                         "or a hostile user; recursive walks and deletions (shutil.rmtree, os.walk) hit Python's "
                         "recursion limit.",
    FaultKind.SECOND_WRITER: "two jobs save into one root at the same time (a restarted job whose old incarnation "
                             "still runs, two launches of one config): same or different steps.",
}
