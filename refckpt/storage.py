"""DCP storage layer: safetensors shards, a checksummed commit record, and a safe reader.

Write protocol of one step (numbered as in DESIGN.md; fault points are named after them):

3. (all ranks) :meth:`SafetensorsWriter.write_data` streams each rank's items into
   one ``__R_0.safetensors`` file -- header first, then every tensor's bytes straight
   from its memory (no whole-state serialisation into a buffer), a CRC-32C per item
   computed on the same memory -- fsyncs the file and the directory.
4. (all ranks) DCP gathers every rank's write results on the coordinator; a rank
   that raised makes every rank raise.
5. (coordinator) :meth:`SafetensorsWriter.finish` writes the commit record
   ``.metadata``: DCP's own ``Metadata`` (so DCP tooling still reads the
   checkpoint) with an extra attribute holding refckpt's manifest -- every file
   of the step with its size and checksums -- via tmp -> fsync -> rename -> fsync dir.

Why one safetensors file per rank with raw bytes: each shard opens on its own
with ``safetensors.safe_open`` and DCP's ``HuggingFaceStorageReader``; ``.metadata``
records ``(file, offset, length)`` of each item so the reader fetches exactly
the bytes it needs. Non-tensor items (param-group hyperparameters, embedded
extra state) are stored as ``U8`` entries under ``__bytes__/<fqn>``, so they do
not break the safetensors format; their bytes are ``torch.save`` output read
back only with ``weights_only=True``.
"""

from __future__ import annotations

import ctypes
import dataclasses
import io
import json
import logging
import os
import pickle
import stat
import struct
import zlib
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    SavePlan,
    SavePlanner,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future

from .durable import DEFAULT_IO, FileIO
from .errors import CheckpointError, CorruptCheckpointError, UnsafeCheckpointError
from .layout import MANIFEST_ATTR, METADATA_FILE, safe_relpath
from .protocol import SavePoint
from .record import RECORD_CHECKSUM, RECORD_FOOTER_LEN, encode_record, tensor_summary
from .safeload import load_metadata, open_regular, safe_torch_load

__all__ = [
    "SafetensorsWriter",
    "SafetensorsReader",
    "FileRecord",
    "BYTES_KEY_PREFIX",
    "MANIFEST_FORMAT",
    "file_record",
    "verify_step_files",
    "tensor_bytes",
    "tensor_to_bytes",
]

log = logging.getLogger(__name__)

SHARD_SUFFIX = ".safetensors"
BYTES_KEY_PREFIX = "__bytes__/"
#: refckpt/2: the record ends with a footer holding its own SHA-256 (refckpt.record), and the
#: manifest lists every tensor's dtype and shape. refckpt/1 records (no footer) still load.
MANIFEST_FORMAT = "refckpt/2"
_FILE_RECORD_FQN = "__refckpt_file__/"
_DCP_VERSION = "1.0.0"
_READ_BLOCK = 64 << 20
_IO_BLOCK = 16 << 20  # tensors are written and read in blocks this size, checksummed as they go

#: Checksum algorithms by the name a manifest records: ``fn(data, running) -> int``. New
#: checkpoints use CRC-32C (Castagnoli): with SSE4.2/ARMv8 CRC instructions the ``crc32c``
#: package folds 11.5 GB/s here against zlib's 3.8 GB/s for CRC-32, which at world size 2 on
#: two cores (no idle core to hide it on) decided whether checksums cost a third of a load or
#: a tenth. "crc32" (zlib) stays readable: checkpoints written before refckpt switched carry it.
DEFAULT_CHECKSUM = "crc32c"


def checksum_fn(name: str):
    """The function for the checksum algorithm ``name`` recorded in a manifest."""
    if name == "crc32":
        return zlib.crc32
    if name == "crc32c":
        try:
            import crc32c
        except ImportError as e:  # pragma: no cover - a declared dependency
            raise CheckpointError("this checkpoint's checksums are CRC-32C; pip install crc32c to verify them") from e
        return crc32c.crc32c
    raise CorruptCheckpointError(f"unknown checksum algorithm {name!r} in the commit record")
_INLINE_CRC = 256 << 10  # smaller items are checksummed on the calling thread (no hand-off)

_ST_DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL",
}
for _name, _code in (("float8_e4m3fn", "F8_E4M3"), ("float8_e5m2", "F8_E5M2"),
                     ("uint16", "U16"), ("uint32", "U32"), ("uint64", "U64")):
    if hasattr(torch, _name):
        _ST_DTYPES[getattr(torch, _name)] = _code


@dataclasses.dataclass(frozen=True)
class FileRecord:
    """Size and checksummed chunks of one file, sent from the rank that wrote it to the coordinator.

    ``chunks`` tile the file: ``[(offset, length, checksum), ...]`` (the algorithm is the manifest's ``checksum``).
    """

    relative_path: str
    size: int
    chunks: tuple[tuple[int, int, int], ...]


class _CrcPipe:
    """Checksums of byte ranges on one helper thread while the caller goes on writing or reading.

    ``crc32c``/``zlib.crc32`` and file I/O release the GIL, so on two or more cores checksumming
    block *k* overlaps the I/O of block *k+1* (and the fsync after the last write) instead
    of adding to it: measured by ``python -m refckpt.bench`` as checksum overhead. The one
    worker runs jobs in submission order, so the blocks of an item fold into one checksum in
    order. Small items are folded on the calling thread: a hand-off costs more than them.
    Callers must call :meth:`results` or :meth:`close` before the memory they handed in goes
    away (both wait for the worker)."""

    def __init__(self, enabled: bool, algorithm: str = DEFAULT_CHECKSUM) -> None:
        self.enabled = enabled
        self._fn = checksum_fn(algorithm) if enabled else None
        self._vals: list[int] = []
        self._ex: ThreadPoolExecutor | None = None
        self._futs: list = []
        self._queued: set[int] = set()

    def start(self) -> int:
        self._vals.append(0)
        return len(self._vals) - 1

    def add(self, i: int, view: memoryview) -> None:
        if not self.enabled or not len(view):
            return
        if len(view) < _INLINE_CRC and i not in self._queued:  # nothing of item i is queued
            self._vals[i] = self._fn(view, self._vals[i])
            return
        if self._ex is None:
            self._ex = ThreadPoolExecutor(1, thread_name_prefix="refckpt-crc")
        self._queued.add(i)
        self._futs.append(self._ex.submit(self._fold, i, view))

    def _fold(self, i: int, view: memoryview) -> None:
        self._vals[i] = self._fn(view, self._vals[i])

    def results(self) -> list[int]:
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


def _blocks(view: memoryview):
    for pos in range(0, len(view), _IO_BLOCK):
        yield view[pos:pos + _IO_BLOCK]


def file_record(relative_path: str, data: bytes) -> FileRecord:
    return FileRecord(relative_path, len(data), ((0, len(data), checksum_fn(DEFAULT_CHECKSUM)(data, 0)),))


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The raw bytes of a contiguous CPU tensor, without a copy (writable: reads land in ``t``).

    Through ctypes rather than ``Tensor.numpy()``: numpy is not a dependency of torch, and
    bfloat16/float8 have no numpy dtype anyway. The view does not keep ``t`` alive; callers hold it.
    """
    if not t.is_contiguous() or t.device.type != "cpu":
        raise ValueError("tensor_bytes needs a contiguous CPU tensor")
    n = t.numel() * t.element_size()
    if n == 0:
        return memoryview(b"")
    return memoryview((ctypes.c_char * n).from_address(t.data_ptr())).cast("B")


_bytes_view = tensor_bytes


def tensor_to_bytes(t: torch.Tensor) -> bytes:
    """A copy of any tensor's raw bytes (CPU, contiguous first): for digests and comparisons."""
    cpu = t.detach().to("cpu").contiguous()  # bound: a copy must outlive the view bytes() reads
    return bytes(tensor_bytes(cpu))


class SafetensorsWriter(StorageWriter):
    """A DCP ``StorageWriter``: one safetensors file per rank and a checksummed ``.metadata``.

    Args:
        path: the (staging) directory of this step; created by the coordinator, whose
            ``write_data`` first fsyncs its parent (so the entry is durable before any shard).
        io: the write-side I/O layer (wrap it to inject faults or trace operations).
        sync_files: fsync files and directories. Turning it off forfeits durability
            under power loss; only benchmarks of the unsynced cost should.
        checksums: record a checksum (CRC-32C) of every item. Readers verify whatever is recorded.
        extra_payload: ``(relative_path, bytes)`` of this rank's extra-state file(s),
            written (and fsynced) before the shard and listed in the commit record
            so that completeness covers them.
        manifest_extra: additional manifest fields (world size, extra-state layout).
    """

    def __init__(
        self,
        path: str,
        *,
        io: FileIO = DEFAULT_IO,
        sync_files: bool = True,
        checksums: bool = True,
        extra_payload: tuple[tuple[str, bytes], ...] = (),
        manifest_extra: dict | None = None,
    ) -> None:
        super().__init__()
        self.path = os.fspath(path)
        self.io = io
        self.sync_files = sync_files
        self.checksums = checksums
        self.extra_payload = tuple(extra_payload)
        self.manifest_extra = dict(manifest_extra or {})
        self.rank = 0
        self.is_coordinator = False
        #: footer (length, SHA-256) of the commit record this writer wrote (coordinator, after finish)
        self.record_footer: bytes | None = None

    # -- DCP StorageWriter protocol ------------------------------------------------
    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id:
            self.path = os.fspath(checkpoint_id)

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator
        self.rank = int(kwargs.get("rank") or 0)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return [dataclasses.replace(p, storage_data=f"__{i}_") for i, p in enumerate(plans)]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        prefix = plan.storage_data if isinstance(plan.storage_data, str) else f"__{self.rank}_"
        file_name = f"{prefix}0{SHARD_SUFFIX}"
        if self.is_coordinator and self.sync_files:  # the staging directory's entry in the root
            self.io.fsync_dir(os.path.dirname(os.path.normpath(self.path)))
        records = [self._write_extra(rel, data) for rel, data in self.extra_payload]
        self.io.mark(SavePoint.SHARDS, rank=self.rank, path=os.path.join(self.path, file_name))
        results = self._write_shard(file_name, plan, planner)
        results.extend(
            WriteResult(index=MetadataIndex(_FILE_RECORD_FQN + r.relative_path), size_in_bytes=r.size, storage_data=r)
            for r in records
        )
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def _write_extra(self, rel: str, data: bytes) -> FileRecord:
        full = safe_relpath(self.path, rel)
        self.io.mark(SavePoint.EXTRA_STATE, rank=self.rank, path=full)
        self.io.mkdir(os.path.dirname(full))
        f = self.io.open_write(full)
        try:
            self.io.write(f, data)
            if self.sync_files:
                self.io.fsync(f)
        finally:
            self.io.close(f)
        if self.sync_files:
            self.io.fsync_dir(os.path.dirname(full))
            self.io.fsync_dir(self.path)
        return file_record(rel, data)

    def _write_shard(self, file_name: str, plan: SavePlan, planner: SavePlanner) -> list[WriteResult]:
        entries: list[tuple[str, Any, str, list[int], memoryview]] = []
        keep_alive: list[torch.Tensor] = []  # views below point into these tensors' memory
        used: set[str] = set()
        sharding: dict[str, dict] = {}
        for item in plan.items:
            fqn = item.index.fqn
            if item.type == WriteItemType.BYTE_IO:
                data = planner.resolve_data(item)
                view = memoryview(data.getbuffer() if isinstance(data, io.BytesIO) else bytes(data))
                key, dtype, shape = BYTES_KEY_PREFIX + fqn, "U8", [len(view)]
                sharding[key] = {"saved_offsets": [0]}  # HuggingFaceStorageReader wants every key here
            else:
                t = planner.resolve_data(item).detach()
                if t.device.type != "cpu":
                    t = t.to("cpu")
                t = t.contiguous()
                dtype = _ST_DTYPES.get(t.dtype)
                if dtype is None:
                    raise CheckpointError(
                        f"{fqn}: dtype {t.dtype} has no safetensors encoding; convert it "
                        f"(e.g. view a complex tensor as real) before saving."
                    )
                keep_alive.append(t)
                key, shape, view = fqn, list(t.shape), _bytes_view(t)
                offsets = list(item.tensor_data.chunk.offsets) if item.tensor_data else [0] * len(shape)
                if key in used:
                    key = f"{fqn}@{','.join(map(str, offsets))}"
                sharding[key] = {"saved_offsets": offsets}
            used.add(key)
            entries.append((key, item, dtype, shape, view))

        header: dict[str, Any] = {}
        pos = 0
        for key, _item, dtype, shape, view in entries:
            header[key] = {"dtype": dtype, "shape": shape, "data_offsets": [pos, pos + len(view)]}
            pos += len(view)
        header["__metadata__"] = {
            "DCP_SHARDING_INFO": json.dumps(sharding),
            "DCP_VERSION": "1.0",
            "format": "pt",
        }
        hjson = json.dumps(header, separators=(",", ":")).encode()
        hjson += b" " * (-(len(hjson) + 8) % 8)  # data section 8-byte aligned, as safetensors does
        head = struct.pack("<Q", len(hjson)) + hjson
        data_start = len(head)

        full = os.path.join(self.path, file_name)
        results: list[WriteResult] = []
        crc = _CrcPipe(self.checksums)
        spans: list[tuple[int, int, int]] = []  # (offset, length, crc index)
        f = self.io.open_write(full)
        try:
            i = crc.start()
            self.io.write(f, head)
            crc.add(i, memoryview(head))
            spans.append((0, len(head), i))
            pos = data_start
            for key, item, _dtype, _shape, view in entries:
                i = crc.start()
                n = 0
                for block in _blocks(view):
                    n += self.io.write(f, block)
                    crc.add(i, block)
                spans.append((pos, n, i))
                results.append(
                    WriteResult(
                        index=item.index,
                        size_in_bytes=n,
                        storage_data=_storage_info(file_name, pos, n),
                    )
                )
                pos += n
            if self.sync_files:
                self.io.fsync(f)  # the checksum thread works while the disk flushes
            crcs = crc.results()
        finally:
            crc.close()  # on error: wait for the worker before ``keep_alive`` lets the tensors go
            self.io.close(f)
        if self.sync_files:
            self.io.fsync_dir(self.path)
        chunks = tuple((off, n, crcs[i]) for off, n, i in spans) if self.checksums else ()
        rec = FileRecord(file_name, pos, chunks)
        results.append(WriteResult(index=MetadataIndex(_FILE_RECORD_FQN + file_name), size_in_bytes=pos, storage_data=rec))
        return results

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        storage_md: dict[MetadataIndex, Any] = {}
        files: dict[str, dict] = {}
        for wr_list in results:
            for wr in wr_list:
                if isinstance(wr.storage_data, FileRecord):
                    rec = wr.storage_data
                    files[rec.relative_path] = {"size": rec.size, "chunks": [list(c) for c in rec.chunks]}
                else:
                    storage_md[wr.index] = wr.storage_data
        metadata.storage_data = storage_md
        metadata.version = _DCP_VERSION
        metadata.storage_meta = StorageMeta(checkpoint_id=self.path)
        manifest = {
            "format": MANIFEST_FORMAT,
            "checksum": DEFAULT_CHECKSUM if self.checksums else None,
            "files": files,
            "record_checksum": RECORD_CHECKSUM,
            "tensors": tensor_summary(metadata),
            **self.manifest_extra,
        }
        setattr(metadata, MANIFEST_ATTR, manifest)
        self.io.mark(SavePoint.COMMIT, rank=self.rank, path=os.path.join(self.path, METADATA_FILE))
        data = encode_record(pickle.dumps(metadata, protocol=pickle.HIGHEST_PROTOCOL))
        self.record_footer = data[-RECORD_FOOTER_LEN:]  # publish checks the staged record is this one
        tmp = os.path.join(self.path, METADATA_FILE + ".tmp")
        f = self.io.open_write(tmp)
        try:
            self.io.write(f, data)
            if self.sync_files:
                self.io.fsync(f)
        finally:
            self.io.close(f)
        self.io.replace(tmp, os.path.join(self.path, METADATA_FILE))
        if self.sync_files:
            self.io.fsync_dir(self.path)

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self.path)

    @property
    def checkpoint_id(self) -> str:
        return self.path

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return True


def _storage_info(relative_path: str, offset: int, length: int):
    # DCP's own record type, so DCP tooling reads the commit record unchanged.
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    return _StorageInfo(relative_path=relative_path, offset=offset, length=length)


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


class SafetensorsReader(StorageReader):
    """A DCP ``StorageReader`` for refckpt checkpoints and plain DCP ``.distcp`` checkpoints.

    * The commit record is read with a restricted unpickler, never ``pickle.load``.
    * Every item read from a refckpt shard is checked against its checksum; a
      mismatch raises :class:`CorruptCheckpointError` naming the file, byte range and key.
    * DCP ``.distcp`` items are ``torch.save`` blobs: read with ``weights_only=True``.
      Such checkpoints carry no checksums; that is logged once, not skipped silently.
    """

    def __init__(self, path: str | os.PathLike, *, verify_checksums: bool = True, safe_globals=()) -> None:
        super().__init__()
        self.path = os.fspath(path)
        self.verify_checksums = verify_checksums
        self.safe_globals = tuple(safe_globals)
        self.storage_data: dict = {}
        self.manifest: dict | None = None
        self._chunk_crc: dict[tuple[str, int], tuple[int, int]] = {}
        self._md: Metadata | None = None
        self.bytes_read = 0

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id:
            self.path = os.fspath(checkpoint_id)
        self.storage_data = {}

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
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
        self.manifest = getattr(metadata, MANIFEST_ATTR, None)
        self._chunk_crc = {}
        self._algo = (self.manifest or {}).get("checksum") or DEFAULT_CHECKSUM
        if self.manifest is not None and self.manifest.get("checksum"):
            checksum_fn(self._algo)  # an unknown algorithm is refused before anything is read
            for rel, rec in self.manifest["files"].items():
                for off, length, crc in rec.get("chunks", ()):
                    self._chunk_crc[(rel, int(off))] = (int(length), int(crc))
        elif is_coordinator and self.verify_checksums:
            log.info("%s: no checksums recorded (not written by refckpt); sizes are checked only", self.path)

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def _expected_crc(self, rel: str, full: str, off: int, length: int, what: str) -> int | None:
        """The checksum recorded for the item at ``off`` (None when nothing is to be verified)."""
        if not self.verify_checksums or self.manifest is None or not self.manifest.get("checksum"):
            return None
        rec = self._chunk_crc.get((rel, off))
        if rec is None or rec[0] != length:
            raise CorruptCheckpointError(
                f"{full}: no checksum recorded for {what} at offset {off}; the commit record and the "
                f"shard disagree. This step is damaged; resume from an older one."
            )
        return rec[1]

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

    def _chunk_sizes(self, index: MetadataIndex) -> tuple[torch.dtype, torch.Size]:
        assert self._md is not None
        tmd = self._md.state_dict_metadata[index.fqn]
        for chunk in tmd.chunks:  # type: ignore[union-attr]
            if tuple(chunk.offsets) == tuple(index.offset or ()):
                return tmd.properties.dtype, chunk.sizes  # type: ignore[union-attr]
        raise CorruptCheckpointError(f"{self.path}: no chunk of {index.fqn} at offset {tuple(index.offset)}")

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        per_file: dict[str, list] = {}
        for req in plan.items:
            info = self.storage_data[req.storage_index]
            per_file.setdefault(info.relative_path, []).append(req)
        # Tensor bytes are verified on a helper thread while the next ones are read; every
        # item is checked before read_data returns, so a corrupt step still fails the load
        # (load_latest then falls back and overwrites whatever was read).
        # A planner that commits by copying out of a buffer it may reuse gets its items verified
        # before each commit instead (DCP's default commit is a no-op: data lands in place).
        crc = _CrcPipe(type(planner).commit_tensor is DefaultLoadPlanner.commit_tensor, self._algo)
        pending: list[tuple[int, int, str, int, int, str]] = []  # (crc index, expected, where)
        try:
            for rel, reqs in per_file.items():
                self._read_file(rel, reqs, planner, crc, pending)
            vals = crc.results()
        finally:
            crc.close()
        for i, want, full, off, length, what in pending:
            self._compare(vals[i], want, full, off, length, what)
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    def _read_tensor_into(self, f, view: memoryview, rel: str, full: str, off: int, what: str,
                          crc: _CrcPipe, pending: list) -> None:
        want = self._expected_crc(rel, full, off, len(view), what)
        if not crc.enabled:
            _read_exact_into(f, view, full, off)
            if want is not None:
                self._compare(checksum_fn(self._algo)(view, 0), want, full, off, len(view), what)
            self.bytes_read += len(view)
            return
        i = crc.start()
        done = 0
        for block in _blocks(view):
            _read_exact_into(f, block, full, off + done)
            done += len(block)
            if want is not None:
                crc.add(i, block)
        if want is not None:
            pending.append((i, want, full, off, len(view), what))
        self.bytes_read += len(view)

    def _read_file(self, rel: str, reqs: list, planner: LoadPlanner, crc: _CrcPipe, pending: list) -> None:
        from torch.distributed._shard._utils import narrow_tensor_by_index

        full = safe_relpath(self.path, rel)
        reqs.sort(key=lambda r: self.storage_data[r.storage_index].offset)
        with open_regular(full, buffering=0) as f:  # a FIFO or device here must not block the load
            for req in reqs:
                info = self.storage_data[req.storage_index]
                if getattr(info, "transform_descriptors", None):
                    raise CheckpointError(
                        f"{full}: item {req.storage_index.fqn} uses DCP stream extensions "
                        f"{info.transform_descriptors}; refckpt reads plain items only."
                    )
                off, length = int(info.offset), int(info.length)
                what = req.storage_index.fqn
                f.seek(off)
                if req.type == LoadItemType.BYTE_IO:
                    buf = bytearray(length)
                    _read_exact_into(f, memoryview(buf), full, off)
                    self._check(rel, full, off, memoryview(buf), what)  # before anything parses it
                    self.bytes_read += length
                    planner.load_bytes(req, io.BytesIO(bytes(buf)))
                    continue
                target = planner.resolve_tensor(req).detach()
                if not rel.endswith(SHARD_SUFFIX):
                    buf = bytearray(length)
                    _read_exact_into(f, memoryview(buf), full, off)
                    self.bytes_read += length
                    tensor = safe_torch_load(bytes(buf), f"{full} ({what})", self.safe_globals)
                    if not isinstance(tensor, torch.Tensor):
                        raise CorruptCheckpointError(f"{full}: item {what} is not a tensor")
                    tensor = narrow_tensor_by_index(tensor, req.storage_offsets, req.lengths)
                else:
                    dtype, sizes = self._chunk_sizes(req.storage_index)
                    nbytes = sizes.numel() * torch._utils._element_size(dtype)
                    if nbytes != length:
                        raise CorruptCheckpointError(
                            f"{full}: {what} records {length} bytes, shape {tuple(sizes)} of {dtype} needs {nbytes}"
                        )
                    whole = tuple(req.lengths) == tuple(sizes) and not any(req.storage_offsets)
                    if (whole and target.device.type == "cpu" and target.dtype == dtype
                            and target.is_contiguous() and tuple(target.shape) == tuple(sizes)):
                        # Fast path: read straight into the destination, verified on the side.
                        self._read_tensor_into(f, _bytes_view(target), rel, full, off, what, crc, pending)
                        planner.commit_tensor(req, target)
                        continue
                    buf = bytearray(length)
                    self._read_tensor_into(f, memoryview(buf), rel, full, off, what, crc, pending)
                    tensor = (torch.frombuffer(buf, dtype=dtype) if length else torch.empty(0, dtype=dtype)).reshape(sizes)
                    tensor = narrow_tensor_by_index(tensor, req.storage_offsets, req.lengths)
                if target.size() != tensor.size():
                    raise CorruptCheckpointError(
                        f"{full}: {what} has shape {tuple(tensor.size())}, the state expects {tuple(target.size())}"
                    )
                target.copy_(tensor)
                planner.commit_tensor(req, target)

    @property
    def checkpoint_id(self) -> str:
        return self.path

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return True


def verify_step_files(step_dir: str, manifest: dict, on_bytes=None) -> list[str]:
    """Re-read every byte of every file the manifest covers; return a list of problems (empty = good).

    ``on_bytes(n, rel)`` is called after every block read (for progress bars)."""
    problems: list[str] = []
    algo = manifest.get("checksum")
    fn = checksum_fn(algo) if algo else None
    for rel, rec in sorted(manifest.get("files", {}).items()):
        try:
            full = safe_relpath(step_dir, rel)
        except UnsafeCheckpointError as e:
            problems.append(str(e))
            continue
        try:
            info = os.stat(full)
        except OSError as e:
            problems.append(f"{full}: missing ({e.strerror})")
            continue
        if not stat.S_ISREG(info.st_mode):
            problems.append(f"{full}: not a regular file (a FIFO, device, socket or directory)")
            continue
        size = info.st_size
        if size != rec["size"]:
            problems.append(f"{full}: {size} bytes, commit record says {rec['size']}")
            continue
        if fn is None:
            if on_bytes is not None:
                on_bytes(size, rel)
            continue
        try:
            f = open_regular(full, buffering=0)  # a FIFO swapped in since the stat never blocks verify
        except (OSError, CheckpointError) as e:
            problems.append(f"{full}: {e}")
            continue
        with f:
            for off, length, crc in rec["chunks"]:
                f.seek(off)
                c, left = 0, length
                while left:
                    b = f.read(min(left, _READ_BLOCK))
                    if not b:
                        break
                    c = fn(b, c)
                    left -= len(b)
                    if on_bytes is not None:
                        on_bytes(len(b), rel)
                if left or c != crc:
                    problems.append(f"{full}: bytes {off}..{off + length} fail their {algo}")
    return problems
