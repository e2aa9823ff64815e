"""The CRC pipe: checksums of byte ranges folded on one helper thread while the caller goes on
writing or reading, and the block size that I/O and checksums proceed in."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor

from .checksums import DEFAULT_CHECKSUM, ChecksumFn, checksum_fn

__all__ = ["CrcPipe", "blocks"]

_IO_BLOCK = 16 << 20  # tensors are written and read in blocks this size, checksummed as they go
_INLINE_CRC = 256 << 10  # smaller items are checksummed on the calling thread (no hand-off)
#: views handed to the helper thread go in batches of at least this many bytes: one hand-off (a
#: thread wake-up and a GIL round trip, ~0.3 ms on a busy 2-core machine) per batch, not per block
_BATCH = 16 << 20


def blocks(view: memoryview) -> Iterator[memoryview]:
    """``view`` in consecutive pieces of at most the I/O block size."""
    for pos in range(0, len(view), _IO_BLOCK):
        yield view[pos:pos + _IO_BLOCK]


class CrcPipe:
    """Checksums of byte ranges on one helper thread while the caller goes on writing or reading.

    ``crc32c``/``zlib.crc32`` and file I/O release the GIL, so on two or more cores checksumming
    block *k* overlaps the I/O of block *k+1* (and the fsync after the last write) instead
    of adding to it: measured by ``python -m benchmarks`` as checksum overhead. The one
    worker runs jobs in submission order, so the blocks of an item fold into one checksum in
    order. Small items are folded on the calling thread: a hand-off costs more than them; larger
    views are handed over in batches of at least 16 MiB (:meth:`fence` and :meth:`results` hand
    over what is left).
    Callers must call :meth:`results` or :meth:`close` before the memory they handed in goes
    away (both wait for the worker)."""

    def __init__(self, enabled: bool, algorithm: str = DEFAULT_CHECKSUM) -> None:
        self.enabled = enabled
        self._fn: ChecksumFn | None = checksum_fn(algorithm) if enabled else None
        self._vals: list[int] = []
        self._ex: ThreadPoolExecutor | None = None
        self._futs: list[Future[None]] = []
        self._queued: set[int] = set()
        self._batch: list[tuple[int, memoryview]] = []
        self._batch_bytes = 0

    def start(self) -> int:
        """A new checksum (of one item); returns its index into :meth:`results`."""
        self._vals.append(0)
        return len(self._vals) - 1

    def add(self, i: int, view: memoryview) -> None:
        """Fold ``view`` into checksum ``i`` (after everything added to it before). The memory behind
        ``view`` must stay as it is until :meth:`fence`'s future (taken after this call) is done."""
        fn = self._fn
        if fn is None or not len(view):
            return
        if len(view) < _INLINE_CRC and i not in self._queued:  # nothing of item i is queued
            self._vals[i] = fn(view, self._vals[i])
            return
        self._queued.add(i)
        self._batch.append((i, view))
        self._batch_bytes += len(view)
        if self._batch_bytes >= _BATCH:
            self._hand_over()

    def _hand_over(self) -> None:
        if not self._batch or self._fn is None:
            return
        if self._ex is None:
            self._ex = ThreadPoolExecutor(1, thread_name_prefix="refckpt-crc")
        batch, self._batch, self._batch_bytes = self._batch, [], 0
        self._futs.append(self._ex.submit(self._fold, self._fn, batch))

    def fence(self) -> Future[None] | None:
        """The future of the last batch handed to the helper thread (None: nothing was), after handing
        over what was added since: once it is done, the helper thread holds no view added before this
        call (it folds in submission order)."""
        self._hand_over()
        return self._futs[-1] if self._futs else None

    def _fold(self, fn: ChecksumFn, batch: list[tuple[int, memoryview]]) -> None:
        vals = self._vals
        for i, view in batch:
            vals[i] = fn(view, vals[i])

    def results(self) -> list[int]:
        self._hand_over()
        for fut in self._futs:
            fut.result()
        self.close()
        return self._vals

    def close(self) -> None:
        if self._ex is not None:
            self._ex.shutdown(wait=True, cancel_futures=True)
            self._ex = None
        self._futs = []
        self._queued = set()
        self._batch, self._batch_bytes = [], 0
