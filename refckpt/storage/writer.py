"""The shard writer: a DCP ``StorageWriter`` that writes steps 3 and 5 of the save protocol
(:mod:`refckpt.commit`): each rank's extra state and safetensors shard, then the coordinator's
commit record."""

from __future__ import annotations

import dataclasses
import io
import json
import os
import pickle
import struct
from typing import Any, BinaryIO, cast

import torch
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from ..durable import DEFAULT_IO, FileIO, durable_write
from ..errors import CheckpointError
from ..layout import METADATA_FILE, safe_relpath
from ..protocol import SavePoint
from ..record import (
    MANIFEST_ATTR,
    RECORD_FOOTER_LEN,
    FileRecord,
    Manifest,
    collector_paused,
    encode_record,
    tensor_summary,
)
from . import crc as _crc
from .checksums import DEFAULT_CHECKSUM, checksum_fn
from .crc import CrcPipe, blocks
from .shards import BYTES_KEY_PREFIX, SHARD_SUFFIX, StepDirStorage, tensor_bytes

__all__ = ["SafetensorsWriter"]

_FILE_RECORD_FQN = "__refckpt_file__/"
_DCP_VERSION = "1.0.0"
_BATCH_VIEWS = 512  # tensors per writev (Linux takes up to 1,024 buffers)

_ST_DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL",
}
for _name, _code in (("float8_e4m3fn", "F8_E4M3"), ("float8_e5m2", "F8_E5M2"),
                     ("uint16", "U16"), ("uint32", "U32"), ("uint64", "U64")):
    if hasattr(torch, _name):
        _ST_DTYPES[getattr(torch, _name)] = _code



class SafetensorsWriter(StepDirStorage, StorageWriter):
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
        manifest_extra: the save's own manifest fields (:attr:`refckpt.record.Manifest.info`: world
            size, step, extra-state layout, writer token).
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
        #: the planner keeps the global Metadata for its next save (DCP's plan caching): finish
        #: must then leave the object whole (see :meth:`finish`)
        self._planner_keeps_metadata = False

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
        self._planner_keeps_metadata = bool(getattr(planner, "_enable_plan_caching", False))
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
        # Below the staging directory only, never the staging directory itself: if another writer
        # renamed it aside (refckpt.commit), making it again would publish a step without the
        # files written before (seen in the fault matrix: an acknowledged step missing a rank's
        # extra state). Then this write fails, and so does the save, on every rank.
        sub = os.path.dirname(full)
        parts = os.path.relpath(sub, self.path).split(os.sep) if sub != self.path else []
        for i in range(len(parts)):
            self.io.mkdir(os.path.join(self.path, *parts[: i + 1]), parents=False)
        durable_write(full, data, self.io, atomic=False, sync=self.sync_files,
                      sync_dirs=(os.path.dirname(full), self.path))
        # One block over the whole file, checksummed even when checksums are off (as always written).
        return FileRecord(rel, len(data), ((0, len(data), checksum_fn(DEFAULT_CHECKSUM)(data, 0)),))

    def _write_shard(self, file_name: str, plan: SavePlan, planner: SavePlanner) -> list[WriteResult]:
        entries: list[tuple[str, Any, str, list[int], memoryview]] = []
        keep_alive: list[torch.Tensor] = []  # views below point into these tensors' memory
        used: set[str] = set()
        sharding: dict[str, dict] = {}
        for item in plan.items:
            fqn = item.index.fqn
            if item.type == WriteItemType.BYTE_IO:
                data = cast(io.BytesIO, planner.resolve_data(item))  # DCP's resolve_data: a BytesIO for every BYTE_IO item
                view = memoryview(data.getbuffer())
                key, dtype, shape = BYTES_KEY_PREFIX + fqn, "U8", [len(view)]
                sharding[key] = {"saved_offsets": [0]}  # HuggingFaceStorageReader wants every key here
            else:
                t = cast(torch.Tensor, planner.resolve_data(item)).detach()  # a tensor item resolves to a tensor
                if t.device.type != "cpu":
                    t = t.to("cpu")
                t = t.contiguous()
                code = _ST_DTYPES.get(t.dtype)
                if code is None:
                    raise CheckpointError(
                        f"{fqn}: dtype {t.dtype} has no safetensors encoding; convert it "
                        f"(e.g. view a complex tensor as real) before saving."
                    )
                dtype = code
                keep_alive.append(t)
                key, shape, view = fqn, list(t.shape), tensor_bytes(t)
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
        crc = CrcPipe(self.checksums)
        spans: list[tuple[int, int, int]] = []  # (offset, length, crc index)

        def write_body(f: BinaryIO) -> None:
            # Small tensors go out together, up to a block's worth in one writev (a 1,000-tensor
            # state was a 1,000 write calls); a tensor of a block or more is written block by block,
            # its checksum folded on the helper thread while the next block is written.
            batch: list[memoryview] = [memoryview(head)]
            queued = len(head)
            i = crc.start()
            crc.add(i, batch[0])
            spans.append((0, len(head), i))
            pos = data_start
            for _key, item, _dtype, _shape, view in entries:
                i = crc.start()
                n = len(view)
                if n >= _crc._IO_BLOCK:
                    if batch:
                        self.io.write_many(f, batch)
                        batch, queued = [], 0
                    for block in blocks(view):
                        self.io.write(f, block)
                        crc.add(i, block)
                else:
                    if n:
                        batch.append(view)
                        queued += n
                        crc.add(i, view)
                    if queued >= _crc._IO_BLOCK or len(batch) >= _BATCH_VIEWS:
                        self.io.write_many(f, batch)
                        batch, queued = [], 0
                spans.append((pos, n, i))
                results.append(WriteResult(index=item.index, size_in_bytes=n, storage_data=_storage_info(file_name, pos, n)))
                pos += n
            if batch:
                self.io.write_many(f, batch)

        try:  # the checksum thread works while the disk flushes (durable_write's fsync)
            durable_write(full, write_body, self.io, atomic=False, sync=self.sync_files, sync_dirs=(self.path,))
            crcs = crc.results()
        finally:
            crc.close()  # on error: wait for the worker before ``keep_alive`` lets the tensors go
        chunks = tuple((off, n, crcs[i]) for off, n, i in spans) if self.checksums else ()
        size = sum(n for _off, n, _i in spans)
        rec = FileRecord(file_name, size, chunks)
        results.append(WriteResult(index=MetadataIndex(_FILE_RECORD_FQN + file_name), size_in_bytes=size, storage_data=rec))
        return results

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """The coordinator writes the commit record: DCP's global ``metadata`` with every rank's
        storage entries and refckpt's manifest, pickled, footer appended, written durably.

        Then it empties ``metadata`` (its tensor, storage and key-path tables and the manifest;
        version and storage_meta stay): ``dcp.save`` broadcasts this very object to every rank
        (``finish_checkpoint``'s return value) and refckpt reads it nowhere, so without this every
        rank would receive and unpickle the whole record after every save (119 MiB at 4096 ranks,
        docs/scale.md); with it, a few hundred bytes. ``dcp.save`` therefore returns an empty
        ``Metadata`` on every rank; read the record (``refckpt.safeload.load_record``) instead.
        Left whole when the planner caches plans (DCP's ``enable_plan_caching``), which reuses the
        object for its next save. The garbage collector is paused while the record is built."""
        with collector_paused():
            storage_md: dict[MetadataIndex, Any] = {}
            files: dict[str, FileRecord] = {}
            for wr_list in results:
                for wr in wr_list:
                    if isinstance(wr.storage_data, FileRecord):
                        files[wr.storage_data.relative_path] = wr.storage_data
                    else:
                        storage_md[wr.index] = wr.storage_data
            metadata.storage_data = storage_md
            metadata.version = _DCP_VERSION
            metadata.storage_meta = StorageMeta(checkpoint_id=self.path)
            Manifest(files=files, checksum=DEFAULT_CHECKSUM if self.checksums else None,
                     tensors=tensor_summary(metadata), info=self.manifest_extra).attach(metadata)
        self.io.mark(SavePoint.COMMIT, rank=self.rank, path=os.path.join(self.path, METADATA_FILE))
        with collector_paused():
            data = encode_record(pickle.dumps(metadata, protocol=pickle.HIGHEST_PROTOCOL))
        self.record_footer = data[-RECORD_FOOTER_LEN:]  # publish checks the staged record is this one
        final = os.path.join(self.path, METADATA_FILE)
        durable_write(final, data, self.io, tmp=final + ".tmp", sync=self.sync_files, sync_dirs=(self.path,))
        if not self._planner_keeps_metadata:
            metadata.state_dict_metadata, metadata.storage_data, metadata.planner_data = {}, None, None
            vars(metadata).pop(MANIFEST_ATTR, None)

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self.path)


def _storage_info(relative_path: str, offset: int, length: int):
    # DCP's own record type, so DCP tooling reads the commit record unchanged.
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    return _StorageInfo(relative_path=relative_path, offset=offset, length=length)

