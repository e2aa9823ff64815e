"""The shard reader: a DCP ``StorageReader`` for refckpt checkpoints and plain DCP ``.distcp`` ones,
every item verified against the checksums of the commit record as it is read."""

from __future__ import annotations

import io
import logging
import os
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from ..durable import IOV_MAX
from ..errors import CheckpointError, CorruptCheckpointError, PartialLoadError
from ..layout import METADATA_FILE, safe_relpath
from ..record import Manifest
from ..safeload import load_metadata, open_regular, safe_torch_load
from . import crc as _crc
from .checksums import DEFAULT_CHECKSUM, checksum_fn
from .crc import _IO_BLOCK, CrcPipe, blocks
from .fastio import MappedFile, preadv_exact
from .shards import SHARD_SUFFIX, StepDirStorage, tensor_bytes

__all__ = ["SafetensorsReader"]

log = logging.getLogger(__name__)


def _read_exact_into(f, view: memoryview, source: str, offset: int) -> None:
    got = 0
    while got < len(view):
        n = f.readinto(view[got:])
        if not n:
            raise CorruptCheckpointError(
                f"{source}: truncated: wanted {len(view)} bytes at offset {offset}, file ends after {got}. "
                f"This step is damaged; resume from an older one (load_latest falls back by itself)."
            )
        got += n


class SafetensorsReader(StepDirStorage, StorageReader):
    """A DCP ``StorageReader`` for refckpt checkpoints and plain DCP ``.distcp`` checkpoints.

    * The commit record is read with a restricted unpickler, never ``pickle.load``.
    * Every item read from a refckpt shard is checked against the checksum its commit record holds
      (whatever ``checksums=`` the save used: a file whose blocks are recorded is verified); a
      mismatch raises :class:`CorruptCheckpointError` naming the file, byte range and key.
    * DCP ``.distcp`` items are ``torch.save`` blobs: read with ``weights_only=True``.
      Such checkpoints carry no checksums; that is logged once, not skipped silently.

    ``transactional=True`` (what :class:`refckpt.DistributedCheckpointer` uses): ``read_data`` writes
    nothing into the caller's tensors. It reads and verifies every byte the plan needs (pass 1:
    sequential reads into a few reused buffers, checksums on a helper thread), fills only what the
    planner itself owns (scratch tensors, non-tensor items, which the planner keeps in its own
    containers), and records where each of the caller's tensors gets its bytes. :meth:`commit`
    then copies them in (pass 2: from the page cache, the bytes checked again). A load that fails
    in pass 1, on any rank, has changed nothing; the checkpointer calls :meth:`commit` only once
    every rank has verified everything (DCP's own gather of the read phase, then its vote).
    """

    #: reused read buffers of pass 1: the checksum thread folds one while the next is read.
    RING = 3
    #: bytes of each (4 MiB: large sequential reads, and 12 MiB allocated per load, not 48)
    RING_BLOCK = 4 << 20
    #: deferred items closer than this in a file are verified with one sequential read through the gap.
    COALESCE_GAP = 256 << 10
    #: pass 1 of a shard it can map: bytes populated (read into the page cache) per step while the
    #: checksum thread folds the step before, then unmapped; False: read through the ring buffers instead
    MAP_WINDOW: int | bool = 4 << 20
    #: a run of bytes smaller than this many windows gets windows of 1/MAP_SPLIT of it (at least 1 MiB,
    #: or MAP_WINDOW where that is smaller): pass 1's RSS growth stays a small share of a small shard
    MAP_SPLIT = 32
    #: windows mapped at once (the one being read, the ones being checksummed): pass 1's RSS growth
    #: stays within MAP_HELD x MAP_WINDOW, not the shard's size
    MAP_HELD = 2
    #: a run spanning fewer bytes is read through the ring instead of mapped: populating a page of a
    #: mapping may map far more (a large page-cache folio: 2 MiB), which unmapping that page alone
    #: does not give back -- a few scattered bytes (another rank's share of the step counters) grew a
    #: load's RSS by 2 MiB per run, 67 MiB at world size 2 on a 512 MiB state
    MAP_MIN = 1 << 20
    # No POSIX_FADV_WILLNEED past the window (the mapping's MADV_SEQUENTIAL readahead only): issue 30's
    # second profile found the advice blocking the reading thread (23% of a cold 256 MiB load in
    # posix_fadvise itself); a cold load took 0.203 s with it against 0.167 s without (median of 9,
    # few-large, this VM). The knob that kept it was removed when a mutant showed it dead (issue 29).

    def __init__(self, path: str | os.PathLike, *, verify_checksums: bool = True, safe_globals=(),
                 transactional: bool = False, metadata: Metadata | None = None,
                 manifest: Manifest | None = None) -> None:
        super().__init__()
        self.path = os.fspath(path)
        #: the commit record the caller already read and checked (``read_metadata`` answers with it, so
        #: the record is parsed once per load and what was checked is what is read), and its manifest
        self._given = (metadata, manifest if metadata is not None else None)
        #: per saved chunk (``MetadataIndex``): its dtype, sizes and bytes, looked up once per load
        self._chunks: dict[tuple[str, tuple], tuple[torch.dtype, torch.Size, int]] = {}
        self.verify_checksums = verify_checksums
        self.safe_globals = tuple(safe_globals)
        self.transactional = transactional
        self.storage_data: dict = {}
        self.manifest: Manifest | None = None
        self._chunk_crc: dict[tuple[str, int], tuple[int, int]] = {}
        self._algo = DEFAULT_CHECKSUM
        self._md: Metadata | None = None
        self._planner: LoadPlanner | None = None
        #: pass 2, per file: the requests whose destination is the caller's memory (transactional)
        self._deferred: dict[str, list] = {}
        self._ring: list[bytearray] = []
        #: per ring buffer: the future after which the checksum thread holds no view of it
        self._fences: list[Any] = []
        self._next_slot = 0
        self.bytes_read = 0
        #: pass 1's mappings of the shards (rel -> mapping, None where a shard cannot be mapped)
        self._maps: dict[str, MappedFile | None] = {}
        #: items pass 2 read straight into the caller's tensors with vectored reads, and the rest
        #: (a layout or dtype that differs: DCP's resharding, read through a buffer)
        self.direct_items = 0
        self.general_items = 0

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id:
            self.path = os.fspath(checkpoint_id)
        self.storage_data = {}
        self._deferred = {}

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if self._given[0] is not None:
            return self._given[0]
        rank = kwargs.get("rank")
        name = METADATA_FILE
        if not os.path.exists(os.path.join(self.path, name)) and os.path.exists(os.path.join(self.path, "__0.metadata")):
            name = f"__{rank if rank is not None else 0}.metadata"
        md = load_metadata(os.path.join(self.path, name))
        if getattr(md, "storage_meta", None) is None:
            md.storage_meta = StorageMeta()
        return md

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self._md = metadata
        self.storage_data = metadata.storage_data or {}
        given, manifest = self._given
        self.manifest = manifest if metadata is given and manifest is not None else Manifest.of(metadata, self.path)
        self._chunk_crc = {}
        self._chunks = {}
        self._algo = (self.manifest.checksum if self.manifest is not None else None) or DEFAULT_CHECKSUM
        if self.manifest is not None:
            checksum_fn(self._algo)  # an unknown algorithm is refused before anything is read
            self._chunk_crc = self.manifest.block_checksums()
        unchecked = self.manifest is None or any(
            not rec.chunks for rel, rec in self.manifest.files.items() if rel.endswith(SHARD_SUFFIX))
        if is_coordinator and self.verify_checksums and unchecked:
            log.info("%s: no checksums recorded for its shards (not written by refckpt, or saved with "
                     "checksums=False); sizes are checked only", self.path)

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def _expected_crc(self, rel: str, full: str, off: int, length: int, what: str) -> int | None:
        """The checksum recorded for the item at ``off`` (None when nothing is to be verified: checks
        switched off by the caller, or a file whose commit record records no blocks)."""
        if not self.verify_checksums or self.manifest is None:
            return None
        rec = self.manifest.files.get(rel)
        if rec is None or not rec.chunks:
            return None
        got = self._chunk_crc.get((rel, off))
        if got is None or got[0] != length:
            raise CorruptCheckpointError(
                f"{full}: no checksum recorded for {what} at offset {off}; the commit record and the "
                f"shard disagree. This step is damaged; resume from an older one."
            )
        return got[1]

    def _compare(self, crc: int, want: int, full: str, off: int, length: int, what: str) -> None:
        if crc != want:
            raise CorruptCheckpointError(
                f"{full}: checksum mismatch for {what} (bytes {off}..{off + length}: {self._algo} "
                f"{crc:#010x}, commit record says {want:#010x}). The shard is corrupt; resume "
                f"from an older step (load_latest falls back by itself) or restore it from a copy."
            )

    def _check(self, rel: str, full: str, off: int, view: memoryview, what: str) -> None:
        want = self._expected_crc(rel, full, off, len(view), what)
        if want is not None:
            self._compare(checksum_fn(self._algo)(view, 0), want, full, off, len(view), what)

    def _chunk(self, index: MetadataIndex) -> tuple[torch.dtype, torch.Size, int]:
        """The saved chunk ``index`` names: its dtype, sizes and byte count (each fqn's chunks are
        indexed once per load: a tensor sharded N ways is not searched N times per item)."""
        key = (index.fqn, index.offset or ())  # a torch.Size hashes as the tuple it is (C, not a dataclass's hash)
        got = self._chunks.get(key)
        if got is not None:
            return got
        assert self._md is not None
        tmd = self._md.state_dict_metadata[index.fqn]
        size = torch._utils._element_size(tmd.properties.dtype)  # type: ignore[union-attr]
        for chunk in tmd.chunks:  # type: ignore[union-attr]
            self._chunks.setdefault((index.fqn, tuple(chunk.offsets)),
                                    (tmd.properties.dtype, chunk.sizes, chunk.sizes.numel() * size))  # type: ignore[union-attr]
        got = self._chunks.get(key)
        if got is None:
            raise CorruptCheckpointError(f"{self.path}: no chunk of {index.fqn} at offset {tuple(key[1])}")
        return got

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        per_file: dict[str, list] = {}
        for req in plan.items:
            info = self.storage_data[req.storage_index]
            per_file.setdefault(info.relative_path, []).append(req)
        self._planner = planner
        self._deferred = {}
        # Tensor bytes are verified on a helper thread while the next ones are read; every
        # item is checked before read_data returns, so a corrupt step fails the load.
        # A planner that commits by copying out of a buffer it may reuse gets its items verified
        # before each commit instead (DCP's default commit is a no-op: data lands in place).
        crc = CrcPipe(type(planner).commit_tensor is DefaultLoadPlanner.commit_tensor, self._algo)
        pending: list[tuple[int, int, str, int, int, str]] = []  # (crc index, expected, where)
        try:
            with torch.no_grad():  # as in commit(): destinations resolve without autograd
                for rel, reqs in per_file.items():
                    self._read_file(rel, reqs, planner, crc, pending)
            vals = crc.results()
        finally:
            crc.close()  # the checksum thread holds no view of a mapping now
            maps, self._maps = self._maps, {}
            for m in maps.values():
                if m is not None:
                    m.close()
        for i, want, full, off, length, what in pending:
            self._compare(vals[i], want, full, off, length, what)
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    def commit(self) -> None:
        """Pass 2 of a transactional load: copy the verified bytes into the caller's tensors.

        Reads each file again in offset order (from the page cache after pass 1) straight into the
        destinations where the layout allows, checking every item's checksum again. A mismatch now
        means the file changed since pass 1 (nothing refckpt does: published steps are never
        written in place), and some of the caller's tensors already hold the new bytes:
        :class:`~refckpt.errors.PartialLoadError`, which no fallback follows."""
        deferred, self._deferred = self._deferred, {}
        planner = self._planner
        if not deferred or planner is None:
            return
        crc = CrcPipe(type(planner).commit_tensor is DefaultLoadPlanner.commit_tensor, self._algo)
        pending: list[tuple[int, int, str, int, int, str]] = []
        # no_grad (here and in read_data, which reads non-deferred items in place): a DTensor's
        # to_local() then returns its local tensor instead of going through autograd (~40 us per
        # item); the copies into the caller's tensors record no graph either way
        try:
            with torch.no_grad():
                for rel, reqs in deferred.items():
                    full = safe_relpath(self.path, rel)
                    with open_regular(full, buffering=0) as f:
                        if rel.endswith(SHARD_SUFFIX) and crc.enabled:
                            self._commit_shard(f, rel, full, reqs, planner, crc, pending)
                            continue
                        for req, _off, _length in reqs:
                            self.general_items += 1
                            self._read_tensor_req(f, rel, full, req, planner, crc, pending)
            vals = crc.results()
        except (CheckpointError, OSError) as e:
            raise PartialLoadError(self._partial(f"{type(e).__name__}: {e}")) from e
        finally:
            crc.close()
        for i, want, full, off, length, what in pending:
            if vals[i] != want:
                raise PartialLoadError(self._partial(
                    f"{full}: {what}, bytes {off}..{off + length}, no longer match their {self._algo}"))

    def _direct_target(self, req: Any, planner: LoadPlanner, full: str) -> torch.Tensor | None:
        """The caller's tensor that ``req`` fills whole, with the saved layout (the same sharding: a
        contiguous CPU tensor of the saved chunk's dtype and shape), or None (read through a buffer)."""
        if req.type == LoadItemType.BYTE_IO:
            return None
        dtype, sizes, _nbytes = self._chunk(req.storage_index)  # the length was checked in pass 1
        if req.lengths != sizes or any(req.storage_offsets):
            return None
        target = planner.resolve_tensor(req).detach()
        if (target.device.type == "cpu" and target.dtype == dtype and target.is_contiguous()
                and target.shape == sizes):
            return target
        return None

    def _commit_shard(self, f, rel: str, full: str, reqs: list, planner: LoadPlanner, crc: CrcPipe,
                      pending: list) -> None:
        """Pass 2 for one safetensors shard: every item whose destination has the saved layout is read
        straight into it, consecutive items together (one ``preadv`` of up to a block's bytes), large
        ones block by block; each item's checksum is folded as its bytes land (the helper thread takes
        the large ones). Items of another layout go through :meth:`_read_tensor_req`."""
        fd = f.fileno()
        group: list[tuple[Any, torch.Tensor, int, int]] = []  # (req, target, offset, length)
        gbytes = 0

        def flush() -> None:
            nonlocal group, gbytes
            if not group:
                return
            views = [tensor_bytes(t) for _req, t, _off, _n in group]
            self.bytes_read += preadv_exact(fd, views, group[0][2], full)
            for (req, target, off, n), view in zip(group, views):
                want = self._expected_crc(rel, full, off, n, req.storage_index.fqn)
                if want is not None:
                    i = crc.start()
                    crc.add(i, view)
                    pending.append((i, want, full, off, n, req.storage_index.fqn))
                planner.commit_tensor(req, target)
            group, gbytes = [], 0

        for req, off, length in reqs:
            target = self._direct_target(req, planner, full)
            if target is None:
                flush()
                self.general_items += 1
                self._read_tensor_req(f, rel, full, req, planner, crc, pending)
                continue
            self.direct_items += 1
            if length >= _crc._IO_BLOCK:  # block by block: the checksum thread folds one while the next is read
                flush()
                i, view = crc.start(), tensor_bytes(target)
                want = self._expected_crc(rel, full, off, length, req.storage_index.fqn)
                done = 0
                for block in blocks(view):
                    self.bytes_read += preadv_exact(fd, [block], off + done, full)
                    done += len(block)
                    if want is not None:
                        crc.add(i, block)
                if want is not None:
                    pending.append((i, want, full, off, length, req.storage_index.fqn))
                planner.commit_tensor(req, target)
                continue
            if group and (off != group[-1][2] + group[-1][3] or gbytes + length > _crc._IO_BLOCK
                          or len(group) >= IOV_MAX):
                flush()
            group.append((req, target, off, length))
            gbytes += length
        flush()

    def _partial(self, why: str) -> str:
        return (f"{self.path}: the checkpoint changed while it was loaded ({why}) after every byte had been "
                f"verified, so part of the state to load into now holds it. Build a fresh state (model and "
                f"optimizer) before loading again: load_latest then skips this step if it stays damaged.")

    def _deferred_target(self, planner: LoadPlanner, req: Any) -> bool:
        """Whether ``req`` writes the caller's memory, so that a transactional load copies it only in
        :meth:`commit` (planners that do not say are treated as the caller's memory)."""
        if not self.transactional:
            return False
        owns = getattr(planner, "owns_destination", None)
        return not (callable(owns) and owns(req.dest_index.fqn))

    def _read_tensor_into(self, f, view: memoryview, rel: str, full: str, off: int, what: str,
                          crc: CrcPipe, pending: list) -> None:
        want = self._expected_crc(rel, full, off, len(view), what)
        if not crc.enabled:
            _read_exact_into(f, view, full, off)
            if want is not None:
                self._compare(checksum_fn(self._algo)(view, 0), want, full, off, len(view), what)
            self.bytes_read += len(view)
            return
        i = crc.start()
        done = 0
        for block in blocks(view):
            _read_exact_into(f, block, full, off + done)
            done += len(block)
            if want is not None:
                crc.add(i, block)
        if want is not None:
            pending.append((i, want, full, off, len(view), what))
        self.bytes_read += len(view)

    def _read_file(self, rel: str, reqs: list, planner: LoadPlanner, crc: CrcPipe, pending: list) -> None:
        full = safe_relpath(self.path, rel)
        reqs.sort(key=lambda r: self.storage_data[r.storage_index].offset)
        later: list = []  # the caller's destinations: verified here, copied by commit()
        run: list = []  # consecutive deferred items, verified with one sequential read
        run_end = 0
        with open_regular(full, buffering=0) as f:  # a FIFO or device here must not block the load
            for req in reqs:
                info = self.storage_data[req.storage_index]
                if getattr(info, "transform_descriptors", None):
                    raise CheckpointError(
                        f"{full}: item {req.storage_index.fqn} uses DCP stream extensions "
                        f"{info.transform_descriptors}; refckpt reads plain items only."
                    )
                if req.type != LoadItemType.BYTE_IO and self._deferred_target(planner, req):
                    item = (req, int(info.offset), int(info.length))
                    later.append(item)
                    if run and item[1] > run_end + self.COALESCE_GAP:
                        self._verify_run(f, rel, full, run, crc, pending)
                        run = []
                    run.append(item)
                    run_end = max(run_end if len(run) > 1 else 0, item[1] + item[2])
                    continue
                if run:
                    self._verify_run(f, rel, full, run, crc, pending)
                    run = []
                off, length = int(info.offset), int(info.length)
                what = req.storage_index.fqn
                if req.type == LoadItemType.BYTE_IO:
                    f.seek(off)
                    buf = bytearray(length)
                    _read_exact_into(f, memoryview(buf), full, off)
                    self._check(rel, full, off, memoryview(buf), what)  # before anything parses it
                    self.bytes_read += length
                    planner.load_bytes(req, io.BytesIO(bytes(buf)))
                    continue
                self._read_tensor_req(f, rel, full, req, planner, crc, pending)
            if run:
                self._verify_run(f, rel, full, run, crc, pending)
        if later:
            self._deferred[rel] = later

    def _verify_run(self, f, rel: str, full: str, run: list, crc: CrcPipe, pending: list) -> None:
        """Pass 1 for the caller's destinations: read the bytes of ``run`` (items in offset order, close
        together in the file) sequentially in blocks through a few reused buffers, and fold each item's
        checksum, without touching any destination. Items without a recorded checksum are checked in
        form only (a ``.distcp`` tensor is parsed and dropped); sizes were checked with the record."""
        items: dict[tuple[int, int], tuple[str, int | None]] = {}  # (offset, length) -> (key, expected crc)
        for req, off, length in run:
            if (off, length) in items:
                continue  # one saved chunk feeding several destinations (resharding): checked once
            what = req.storage_index.fqn
            if not rel.endswith(SHARD_SUFFIX):
                f.seek(off)
                buf = bytearray(length)
                _read_exact_into(f, memoryview(buf), full, off)
                self.bytes_read += length
                self._tensor_from_blob(buf, full, what)
                items[(off, length)] = (what, None)
                continue
            self._chunk_length(req, length, full, what)
            items[(off, length)] = (what, self._expected_crc(rel, full, off, length, what))
        checked = sorted((off, length, what, want) for (off, length), (what, want) in items.items() if want is not None)
        if not checked:
            return
        if not crc.enabled:  # a planner that copies out of its own buffers: verified inline, no helper thread
            for off, length, what, want in checked:
                buf = bytearray(length)
                f.seek(off)
                _read_exact_into(f, memoryview(buf), full, off)
                self.bytes_read += length
                self._compare(checksum_fn(self._algo)(memoryview(buf), 0), want, full, off, length, what)
            return
        index = {(off, length): crc.start() for off, length, _what, _want in checked}
        for off, length, what, want in checked:
            pending.append((index[(off, length)], want, full, off, length, what))
        start, end = checked[0][0], max(off + length for off, length, _w, _c in checked)
        mapped = self._mapped(f, rel, full) if end - start >= self.MAP_MIN else None
        if mapped is not None:  # the checksums read the page cache where the disk put it: no copy
            pos, first = start, 0
            held: list[tuple[int, int, Any]] = []  # windows mapped: (start, end, the fence after them)
            window = min(int(self.MAP_WINDOW), max(1 << 20, (end - start) // self.MAP_SPLIT))
            while pos < end:
                while len(held) >= self.MAP_HELD:  # the checksum thread is done with it: unmap it (RSS)
                    lo, hi, fence = held.pop(0)
                    if fence is not None:
                        fence.result()
                    mapped.release(lo, hi)
                stop = min(end, pos + window)
                view = mapped.populate(pos, stop)
                self.bytes_read += stop - pos
                while first < len(checked) and checked[first][0] + checked[first][1] <= pos:
                    first += 1
                for off, length, _what, _want in checked[first:]:
                    if off >= stop:
                        break
                    lo, hi = max(off, pos), min(off + length, stop)
                    if hi > lo:
                        crc.add(index[(off, length)], view[lo - pos:hi - pos])
                held.append((pos, stop, crc.fence()))
                pos = stop
            for _lo, _hi, fence in held:
                if fence is not None:
                    fence.result()
            # the checksum thread holds no view of the mapping now: unmap all of it, not only the
            # windows' whole pages (the large folios around their ends stayed mapped, run after run)
            mapped.release(0, mapped.size)
            return
        want = min(self.RING_BLOCK, _IO_BLOCK, max(end - start, 1))
        if not self._ring or len(self._ring[0]) < want:  # sized by the first run, grown for a longer one
            for fence in self._fences:
                if fence is not None:
                    fence.result()  # the checksum thread is done with the buffers replaced
            self._ring = [bytearray(want) for _ in range(self.RING)]
            self._fences = [None] * self.RING
        fences = self._fences  # the reader's, not this run's: the checksum thread may still fold a view of
        pos, k, first = start, 0, 0  # a buffer an earlier run (another file) filled
        f.seek(start)
        k = self._next_slot
        while pos < end:
            slot = k % len(self._ring)
            if fences[slot] is not None:
                fences[slot].result()  # the checksum thread is done with this buffer
            buf = self._ring[slot]
            n = min(len(buf), end - pos)
            view = memoryview(buf)[:n]
            _read_exact_into(f, view, full, pos)
            self.bytes_read += n
            while first < len(checked) and checked[first][0] + checked[first][1] <= pos:
                first += 1
            for off, length, _what, _want in checked[first:]:
                if off >= pos + n:
                    break
                lo, hi = max(off, pos), min(off + length, pos + n)
                if hi > lo:
                    crc.add(index[(off, length)], view[lo - pos:hi - pos])
            fences[slot] = crc.fence()
            pos += n
            k += 1
        self._next_slot = k % len(self._ring)  # the next run starts at the buffer filled longest ago

    def _mapped(self, f, rel: str, full: str) -> MappedFile | None:
        """Pass 1's read-only mapping of shard ``rel`` (made once per load), or None: mapping switched
        off (``MAP_WINDOW``), not a safetensors shard, or not available here (then the ring reads)."""
        if not self.MAP_WINDOW or not rel.endswith(SHARD_SUFFIX):
            return None
        if rel not in self._maps:
            self._maps[rel] = MappedFile.open(f.fileno(), os.fstat(f.fileno()).st_size, full)
        return self._maps[rel]

    def _chunk_length(self, req: Any, length: int, full: str, what: str) -> tuple[torch.dtype, torch.Size]:
        dtype, sizes, nbytes = self._chunk(req.storage_index)
        if nbytes != length:
            raise CorruptCheckpointError(
                f"{full}: {what} records {length} bytes, shape {tuple(sizes)} of {dtype} needs {nbytes}"
            )
        return dtype, sizes

    def _tensor_from_blob(self, buf: bytearray, full: str, what: str) -> torch.Tensor:
        tensor = safe_torch_load(bytes(buf), f"{full} ({what})", self.safe_globals)
        if not isinstance(tensor, torch.Tensor):
            raise CorruptCheckpointError(f"{full}: item {what} is not a tensor")
        return tensor

    def _read_tensor_req(self, f, rel: str, full: str, req: Any, planner: LoadPlanner, crc: CrcPipe,
                         pending: list) -> None:
        """Read one tensor item into its destination (straight into it where the layout allows)."""
        from torch.distributed._shard._utils import narrow_tensor_by_index

        info = self.storage_data[req.storage_index]
        off, length = int(info.offset), int(info.length)
        what = req.storage_index.fqn
        f.seek(off)
        target = planner.resolve_tensor(req).detach()
        if not rel.endswith(SHARD_SUFFIX):
            buf = bytearray(length)
            _read_exact_into(f, memoryview(buf), full, off)
            self.bytes_read += length
            tensor = narrow_tensor_by_index(self._tensor_from_blob(buf, full, what), req.storage_offsets, req.lengths)
        else:
            dtype, sizes = self._chunk_length(req, length, full, what)
            whole = tuple(req.lengths) == tuple(sizes) and not any(req.storage_offsets)
            if (whole and target.device.type == "cpu" and target.dtype == dtype
                    and target.is_contiguous() and tuple(target.shape) == tuple(sizes)):
                # Fast path: read straight into the destination, verified on the side.
                self._read_tensor_into(f, tensor_bytes(target), rel, full, off, what, crc, pending)
                planner.commit_tensor(req, target)
                return
            buf = bytearray(length)
            self._read_tensor_into(f, memoryview(buf), rel, full, off, what, crc, pending)
            # length > 0: DCP plans a read only where a saved chunk and the destination share elements
            tensor = torch.frombuffer(buf, dtype=dtype).reshape(sizes)
            tensor = narrow_tensor_by_index(tensor, req.storage_offsets, req.lengths)
        if target.size() != tensor.size():
            raise CorruptCheckpointError(
                f"{full}: {what} has shape {tuple(tensor.size())}, the state expects {tuple(target.size())}"
            )
        target.copy_(tensor)
        planner.commit_tensor(req, target)

