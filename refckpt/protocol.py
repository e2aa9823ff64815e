"""The save protocol's named steps. Fault points are named after these, never after line numbers.

1. (all ranks)   ``WAIT_PREVIOUS``   wait for any in-flight async save; saves never overlap.
2. (coordinator) ``PREPARE``         make ``.global_step_N.partial/``; refuse to overwrite a complete
                                     step N unless asked; remove a stale staging or incomplete step N.
3. (all ranks)   ``EXTRA_STATE``     write per-rank extra state, fsync;
                 ``SHARDS``          write the rank's safetensors shard, fsync file and directory.
4. (all ranks)   ``AGREE``           DCP gathers every rank's write results (any failure: all raise).
5. (coordinator) ``COMMIT``          write ``.metadata`` (tmp -> fsync -> rename -> fsync dir).
6. (coordinator) ``PUBLISH``         rename the staging directory to ``global_step_N`` (atomic exchange
                                     when overwriting), fsync the root.
7. (coordinator) ``POINTER``         ``latest_checkpoint_iteration.txt``: tmp -> fsync -> replace -> fsync.
8. (coordinator) ``RETENTION``       keep-last-k: delete older steps, never the newest complete one,
                                     never one a live reader holds a lease on.
   (all ranks)   ``DONE``            every rank learns the outcome; ``save`` returns or raises everywhere.

Async save runs 1-2 and stages tensors to host memory on the caller's thread
(``STAGING`` marks the start of the copy, ``STAGED`` the moment the caller may mutate its
tensors again); 3-8 run in the background.
"""

from __future__ import annotations

import enum

__all__ = ["SavePoint"]


class SavePoint(str, enum.Enum):
    WAIT_PREVIOUS = "1-wait-previous"
    PREPARE = "2-prepare"
    STAGING = "2a-staging"
    STAGED = "2a-staged"
    EXTRA_STATE = "3-extra-state"
    SHARDS = "3-shards"
    AGREE = "4-agree"
    COMMIT = "5-commit"
    PUBLISH = "6-publish"
    POINTER = "7-pointer"
    RETENTION = "8-retention"
    DONE = "9-done"

    def __str__(self) -> str:
        return self.value
