"""The one error root of refckpt.

Every error subclasses :class:`CheckpointError` *and* the builtin a caller would
already catch (``FileNotFoundError``, ``ValueError``, ...), so code written
against the builtins keeps working. Messages name the path or setting and the
fix; causes are chained with ``raise ... from e``.
"""

from __future__ import annotations

__all__ = [
    "CheckpointError",
    "CheckpointNotFoundError",
    "IncompleteCheckpointError",
    "CorruptCheckpointError",
    "CheckpointExistsError",
    "MissingKeysError",
    "MissingTrainingStateError",
    "ShapeMismatchError",
    "UnsafeCheckpointError",
    "InvalidCheckpointPathError",
    "SaveFailedError",
    "AsyncSaveFailedError",
    "ConfigError",
    "CollectiveError",
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


class MissingKeysError(CheckpointError, KeyError):
    """Keys the load asked for are absent from the checkpoint."""

    def __str__(self) -> str:  # KeyError quotes its message; keep it readable.
        return str(self.args[0]) if self.args else ""


class MissingTrainingStateError(CheckpointError, KeyError):
    """The load asked for optimizer or extra state that the checkpoint does not have."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class ShapeMismatchError(CheckpointError, ValueError):
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


class ConfigError(CheckpointError, ValueError):
    """Contradictory or invalid configuration."""


class CollectiveError(CheckpointError, RuntimeError):
    """A checkpoint collective failed: a peer rank died, hung past the timeout, or lost its connection."""
