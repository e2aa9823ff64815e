"""The one error root of refckpt.

Every error subclasses :class:`CheckpointError` *and* the builtin a caller would
already catch (``FileNotFoundError``, ``ValueError``, ...), so code written
against the builtins keeps working. Messages name the path or setting and the
fix; causes are chained with ``raise ... from e``.
"""

from __future__ import annotations

import errno as _errno

__all__ = [
    "CheckpointError",
    "CheckpointNotFoundError",
    "IncompleteCheckpointError",
    "CorruptCheckpointError",
    "CheckpointExistsError",
    "CallerError",
    "StateMismatchError",
    "MissingKeysError",
    "MissingTrainingStateError",
    "ShapeMismatchError",
    "UnsafeCheckpointError",
    "InvalidCheckpointPathError",
    "SaveFailedError",
    "AsyncSaveFailedError",
    "SnapshotChangedError",
    "ConfigError",
    "CollectiveError",
    "PartialLoadError",
    "PeerInterruptedError",
    "PeerInterruptedSaveError",
    "os_error_hint",
]


class CheckpointError(Exception):
    """Root of every error refckpt raises on purpose."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """A path that should hold a checkpoint holds none."""


class IncompleteCheckpointError(CheckpointError, FileNotFoundError):
    """A step directory without a commit record, or with a file missing or of the wrong size."""


class CorruptCheckpointError(CheckpointError, ValueError):
    """Bytes on disk disagree with the checksum the commit record holds, or cannot be parsed."""


class CheckpointExistsError(CheckpointError, FileExistsError):
    """Saving over a complete step without ``overwrite=True``."""


class CallerError(CheckpointError):
    """The call is wrong, not the checkpoint: a state that does not fit it, missing training state
    asked for, an invalid setting. ``load_latest`` raises it at once, on every rank, and never falls
    back to an older step for it (every step would fail alike, and the step is intact)."""


class StateMismatchError(CallerError, ValueError):
    """The state to load into cannot receive the checkpoint, whose bytes are fine: tensors on the
    ``meta`` device (no storage), entries that share storage where the checkpoint holds different
    values for them, or a dtype or shape that differs (:class:`ShapeMismatchError`)."""


class MissingKeysError(CallerError, KeyError):
    """Keys the load asked for are absent from the checkpoint."""

    def __str__(self) -> str:  # KeyError quotes its message; keep it readable.
        return str(self.args[0]) if self.args else ""


class MissingTrainingStateError(CallerError, KeyError):
    """The load asked for optimizer or extra state that the checkpoint does not have."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class ShapeMismatchError(StateMismatchError):
    """The state to load into has tensors whose shape or dtype differs from the checkpoint's:
    the model (or optimizer) does not match, the bytes are fine."""


class UnsafeCheckpointError(CheckpointError, ValueError):
    """Checkpoint bytes that would execute code, or reach outside the checkpoint root."""


class InvalidCheckpointPathError(CheckpointError, ValueError):
    """A name or path that does not follow the on-disk contract."""


class SaveFailedError(CheckpointError, OSError):
    """A save failed on at least one rank; nothing was published."""


class AsyncSaveFailedError(SaveFailedError):
    """A background (async) save failed; raised on the next check."""


class SnapshotChangedError(SaveFailedError):
    """A deferred async save (``snapshot="deferred"``): a saved tensor was changed in place after
    ``save`` returned and before the background copy of it ended, so the save fails (nothing is
    published) rather than write a value that is not the one at the call."""


class ConfigError(CallerError, ValueError):
    """Contradictory or invalid configuration."""


class CollectiveError(CheckpointError, RuntimeError):
    """A checkpoint collective failed: a peer rank died, hung past the timeout, or lost its connection."""


class PeerInterruptedError(CheckpointError, RuntimeError):
    """Another rank was interrupted (``KeyboardInterrupt``, or ``SystemExit`` from a SIGTERM handler)
    during this save or load: every rank stopped at the same decision and nothing of it was committed
    (a load changed nothing). The interrupted rank itself re-raises its own interrupt; this is what
    the others raise. Not damage: ``load_latest`` does not fall back on it (docs/design.md, "Agreement")."""


class PeerInterruptedSaveError(PeerInterruptedError, SaveFailedError):
    """:class:`PeerInterruptedError` during a save (a :class:`SaveFailedError`: nothing was published)."""


class PartialLoadError(CheckpointError, RuntimeError):
    """A load whose bytes were all verified failed while copying them into the state (the file changed
    in place since it was verified, or an I/O error on reading it again): part of the state holds the
    checkpoint's values. No fallback follows (it would start from that mix); build a fresh state and
    load again."""


#: errno -> what to do about it, for save errors caused by the file system.
_OS_HINTS = {
    _errno.ENOSPC: "the file system holding {root} is full: free space there (or save to another root), then save again",
    _errno.EDQUOT: "the disk quota for {root} is exhausted: free space or raise the quota, then save again",
    _errno.EFBIG: ("a checkpoint file exceeds the file-size limit (ulimit -f / RLIMIT_FSIZE, or the file "
                   "system's maximum file size): raise the limit or shard the state across more ranks"),
    _errno.EROFS: "{root} is on a read-only file system: remount it read-write or pass a writable checkpoint root",
    _errno.EACCES: "{root} is not writable by this process: fix its permissions or pass a writable checkpoint root",
    _errno.EPERM: ("{root} refuses changes (permissions, or an immutable/append-only attribute, see lsattr): "
                   "make it writable or pass another checkpoint root"),
}


def os_error_hint(exc: BaseException | None, root: str) -> str:
    """`` <what to do>.`` for the first ``OSError`` in ``exc``'s cause chain whose errno is known
    (a full disk, a file-size limit, a read-only or unwritable root); ``""`` otherwise."""
    seen = 0
    while exc is not None and seen < 8:
        if isinstance(exc, OSError) and exc.errno in _OS_HINTS:
            return " " + _OS_HINTS[exc.errno].format(root=root) + "."
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return ""
