"""Per-rank commit records: which one each rank loads, and a reader that loads it.

``torch.distributed.checkpoint.save(..., use_collectives=False)`` -- the spelling some
family checkpointers use for rank-local state -- has no global ``.metadata``: every rank
writes ``__R.metadata`` describing its own items only (``__R_0.distcp``). Plain DCP loads
such a checkpoint rank by rank: rank R reads ``__R.metadata``. Reading ``__0.metadata`` on
every rank instead restores rank 0's values everywhere, silently, whenever the per-rank
states differ (found by ``tests/test_interop.py``; refckpt's reader did exactly that).

Rules here (one decision, taken alike on every rank before any collective):

* ``.metadata`` present: every rank reads it (the normal case).
* only ``__0.metadata`` .. ``__{N-1}.metadata``: rank R reads ``__R.metadata``. A world
  larger than N has ranks without a record -- refused on every rank with
  :class:`~refckpt.errors.MissingTrainingStateError` (a mismatch, not damage, so
  ``load_latest`` does not fall back from it). A smaller world reads its own ranks' records,
  as plain DCP does, and logs which records it leaves unread.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from .errors import MissingTrainingStateError
from .layout import METADATA_FILE, StepStatus, safe_relpath
from .safeload import load_metadata
from .storage import SafetensorsReader

__all__ = ["metadata_for_rank", "RankRecordReader"]

log = logging.getLogger(__name__)


def metadata_for_rank(st: StepStatus, rank: int, world: int) -> Any:
    """The commit record (DCP ``Metadata``) that ``rank`` of ``world`` loads from the complete step ``st``."""
    records = st.commit_records
    if not records or records[0] == METADATA_FILE:
        return st.metadata
    if world > len(records):
        raise MissingTrainingStateError(
            f"{st.path}: committed per rank by {len(records)} rank(s) ({', '.join(records)}; DCP "
            f"use_collectives=False), and each record covers its own rank's state only; this world has "
            f"{world} ranks, so ranks {len(records)}..{world - 1} have nothing to load. Load at "
            f"{len(records)} rank(s), or re-save the checkpoint with a global .metadata."
        )
    if world < len(records) and rank == 0:
        log.warning("%s: per-rank commit records %s are not read by a world of %d ranks",
                    st.path, list(records[world:]), world)
    if records[rank] in st.record_metadata:  # read, checked and validated by check_step_dir
        return st.record_metadata[records[rank]]
    return st.metadata if rank == 0 else load_metadata(safe_relpath(st.path, records[rank]))


class RankRecordReader(SafetensorsReader):
    """:class:`~refckpt.storage.SafetensorsReader` that reads ``rank``'s own commit record.

    DCP asks ``read_metadata()`` without a rank first; the base reader answers that with
    ``__0.metadata`` when there is no ``.metadata``. Answering with this rank's record keeps
    DCP on its normal path, and each rank's plan names only the files its record lists.
    """

    def __init__(self, path: str | os.PathLike, rank: int, **kwargs: Any) -> None:
        super().__init__(path, **kwargs)
        self.rank = rank

    def read_metadata(self, *args: Any, **kwargs: Any):
        return super().read_metadata(rank=self.rank)
