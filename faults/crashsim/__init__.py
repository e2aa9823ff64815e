"""Recording what a save does to the file system, and what of it survives a power cut.

* :mod:`faults.crashsim.model`: the persistence model (what a power cut may take: unsynced data,
  unsynced directory entries, torn writes), replayed on a recorded trace -- what an acknowledged
  save could lose, and every crash state of a save.
* :mod:`faults.crashsim.recorder`: traces of a save in the saving process -- ``os``-level
  operations (:func:`record`), the tree after each (:class:`snapshot_states`), or every
  operation with its bytes through refckpt's I/O layer (:func:`recording_io`).
* :mod:`faults.crashsim.strace`: the same trace of any checkpointer's save, under ``strace -f``.

The names below are re-exported here, so ``faults.crashsim.X`` names each of them.
"""

from __future__ import annotations

from .model import (
    CrashState,
    DurableView,
    FOp,
    IOp,
    Model,
    Op,
    acknowledged_not_durable,
    build_state,
    crash_states,
    snapshot_tree,
    state_key,
)
from .recorder import record, recording_io, snapshot_states
from .strace import parse_strace, strace_record

__all__ = ["Op", "record", "snapshot_tree", "snapshot_states", "DurableView", "acknowledged_not_durable",
           "FOp", "IOp", "Model", "CrashState", "crash_states", "build_state", "state_key", "recording_io",
           "strace_record", "parse_strace"]
