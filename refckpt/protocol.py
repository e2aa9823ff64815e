"""``SavePoint``: the names of the save protocol's steps; the protocol itself is the docstring of :mod:`refckpt.commit`."""

from __future__ import annotations

from ._enum import StrEnum

__all__ = ["SavePoint"]


class SavePoint(StrEnum):
    """A step of the save protocol (:mod:`refckpt.commit`), by the name fault points use.

    :meth:`FileIO.mark <refckpt.durable.FileIO.mark>` reports the marked steps, in protocol order:
    every one but ``EXTRA_STATE`` and ``RETENTION``, whose fault points are the file operations
    of those steps."""

    WAIT_PREVIOUS = "1-wait-previous"
    PREPARE = "2-prepare"
    STAGING = "2a-staging"
    EXTRA_STATE = "3-extra-state"
    SHARDS = "3-shards"
    COMMIT = "5-commit"
    PUBLISH = "6-publish"
    POINTER = "7-pointer"
    RETENTION = "8-retention"
    DONE = "9-done"

