"""Hostile checkpoint bytes that cost memory, not code: what a reader must bound by the bytes it reads.

* :func:`object_bomb_record` -- a commit record made of one object-creating pickle opcode repeated
  (``EMPTY_SET``: one byte of file, a 216-byte set on the unpickler's stack), with no checksum footer
  (an older or plain-DCP record as far as any reader can tell): 8 MiB of it asks for about 1.9 GiB.
* :func:`deflated_torch_save` -- a ``torch.save`` file (a zip archive) whose storage member is
  DEFLATE-compressed (``torch.save`` never writes those): about a two-hundredth of its inflated size,
  which ``torch.load`` (``weights_only=True`` or not) allocates whole when it extracts the member.

Each models a real attack on a shared checkpoint directory (or a checkpoint downloaded from
elsewhere); the suite places them where a checkpointer reads its commit record and its extra state
(:mod:`faults.suite.test_exact_resume`) and resumes under a memory bound."""

from __future__ import annotations

import functools
import io
import pickle
import struct
import zipfile
import zlib

__all__ = ["object_bomb_record", "deflated_torch_save", "MIB"]

MIB = 1 << 20


def object_bomb_record(size: int = 8 * MIB, opcode: bytes = pickle.EMPTY_SET) -> bytes:
    """``size`` bytes of a pickle (protocol 4 header, ``opcode`` repeated, STOP): every opcode
    pushes a new object that stays on the unpickler's stack until the end."""
    head = pickle.PROTO + bytes([4])
    return head + opcode * max(0, size - len(head) - 1) + pickle.STOP


_BLOCK = 16 * MIB


def _deflated_zeros(n: int) -> tuple[bytes, int]:
    """(a raw DEFLATE stream of ``n`` zero bytes, its CRC-32), built from one compressed block
    repeated: after a full flush the compressor holds no history, so every block is the same bytes."""
    assert n % _BLOCK == 0, "a whole number of blocks"
    block_c = zlib.compressobj(1, zlib.DEFLATED, -15)
    one = block_c.compress(bytes(_BLOCK)) + block_c.flush(zlib.Z_FULL_FLUSH)
    tail = zlib.compressobj(1, zlib.DEFLATED, -15).flush(zlib.Z_FINISH)
    crc, zero = 0, bytes(_BLOCK)
    for _ in range(n // _BLOCK):
        crc = zlib.crc32(zero, crc)
    return one * (n // _BLOCK) + tail, crc


def _zip(members: list[tuple[str, bytes, int, int, int]]) -> bytes:
    """A zip archive of ``(name, data, method, crc, uncompressed size)`` members, as written."""
    out, central = io.BytesIO(), io.BytesIO()
    for name, data, method, crc, size in members:
        raw = name.encode()
        offset = out.tell()
        out.write(struct.pack("<IHHHHHIIIHH", 0x04034B50, 20, 0, method, 0, 0x21, crc, len(data), size, len(raw), 0))
        out.write(raw)
        out.write(data)
        central.write(struct.pack("<IHHHHHHIIIHHHHHII", 0x02014B50, 20, 20, 0, method, 0, 0x21, crc, len(data), size,
                                  len(raw), 0, 0, 0, 0, 0, offset))
        central.write(raw)
    start = out.tell()
    out.write(central.getvalue())
    out.write(struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, len(members), len(members), central.tell(), start, 0))
    return out.getvalue()


@functools.lru_cache(maxsize=4)
def deflated_torch_save(inflated: int = 1024 * MIB, global_step: int = 3) -> bytes:
    """A ``torch.save`` of ``{"global_step": global_step, "pad": <uint8 tensor>}`` whose storage
    member holds ``inflated`` zero bytes (a multiple of 16 MiB) DEFLATE-compressed; every other member
    is deflated too. The tensor's own pickle asks for one byte: the member is what a loader extracts."""
    import torch

    small = io.BytesIO()
    torch.save({"global_step": global_step, "pad": torch.zeros(1, dtype=torch.uint8)}, small)
    members = []
    with zipfile.ZipFile(io.BytesIO(small.getvalue())) as src:
        for info in src.infolist():
            if info.filename.endswith("/data/0"):
                data, crc = _deflated_zeros(inflated)
                members.append((info.filename, data, zipfile.ZIP_DEFLATED, crc, inflated))
                continue
            plain = src.read(info.filename)
            c = zlib.compressobj(1, zlib.DEFLATED, -15)
            members.append((info.filename, c.compress(plain) + c.flush(), zipfile.ZIP_DEFLATED, zlib.crc32(plain),
                            len(plain)))
    return _zip(members)
