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

from ..errors import CheckpointError, CorruptCheckpointError
from ..layout import METADATA_FILE, safe_relpath
from ..record import Manifest
from ..safeload import load_metadata, open_regular, safe_torch_load
from .checksums import DEFAULT_CHECKSUM, checksum_fn
from .crc import CrcPipe, blocks
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
        self.manifest: Manifest | None = None
        self._chunk_crc: dict[tuple[str, int], tuple[int, int]] = {}
        self._algo = DEFAULT_CHECKSUM
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
        self.manifest = Manifest.of(metadata, self.path)
        self._chunk_crc = {}
        self._algo = (self.manifest.checksum if self.manifest is not None else None) or DEFAULT_CHECKSUM
        if self.manifest is not None and self.manifest.checksum:
            checksum_fn(self._algo)  # an unknown algorithm is refused before anything is read
            self._chunk_crc = self.manifest.block_checksums()
        elif is_coordinator and self.verify_checksums:
            log.info("%s: no checksums recorded (not written by refckpt); sizes are checked only", self.path)

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def _expected_crc(self, rel: str, full: str, off: int, length: int, what: str) -> int | None:
        """The checksum recorded for the item at ``off`` (None when nothing is to be verified)."""
        if not self.verify_checksums or self.manifest is None or not self.manifest.checksum:
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
        raise CorruptCheckpointError(f"{self.path}: no chunk of {index.fqn} at offset {tuple(index.offset or ())}")

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
        crc = CrcPipe(type(planner).commit_tensor is DefaultLoadPlanner.commit_tensor, self._algo)
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
                        self._read_tensor_into(f, tensor_bytes(target), rel, full, off, what, crc, pending)
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
