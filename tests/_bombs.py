"""Hostile checkpoint files for the memory-bound tests: pure functions of (kind, size) -> bytes.

Every generator is deterministic and builds its bytes without allocating what they would make a
reader allocate (a DEFLATE member that inflates to 512 MiB is written in 1 MiB pieces). Reuse them
anywhere a test needs a file whose parsing costs far more memory than its size:

* :func:`bomb_record` -- a commit record (``.metadata``, a pickle) of one opcode family, parsed by
  CPython's C unpickler with refckpt's allow-list (``refckpt.safeload.MetadataUnpickler``);
* :func:`torch_bomb` -- a ``torch.save`` zip whose ``data.pkl`` is parsed by torch's weights-only
  unpickler (extra-state files, non-tensor items);
* :func:`compressed_extra_state` -- a ``torch.save`` zip whose storage member is DEFLATE-compressed;
* :func:`torch_zip`, :func:`rezip`, :func:`patch_central` -- zip surgery for the structural checks.

``RECORD_BOMBS`` and ``TORCH_BOMBS`` name every kind with what it makes the unpickler build.
"""

from __future__ import annotations

import io
import struct
import zipfile

#: kind -> what parsing it builds (C unpickler, commit record).
RECORD_BOMBS: dict[str, str] = {
    "empty_set": "8 M EMPTY_SET: an empty set (216 bytes) per byte, kept on the stack",
    "empty_dict": "EMPTY_DICT per byte (64 bytes each)",
    "empty_list": "EMPTY_LIST per byte (56 bytes each)",
    "frozenset": "MARK, two small ints, FROZENSET: a 216-byte frozenset per 6 bytes",
    "tuple": "MARK + 4 x NONE + TUPLE: a 4-tuple per 6 bytes",
    "short_str": "distinct 8-character strings (SHORT_BINUNICODE)",
    "astral_str": "strings of one astral character and ASCII: stored as UCS-4, 4 bytes per byte read",
    "binint": "distinct ints (BININT): 32 bytes per 5",
    "float": "floats (BINFLOAT): 24 bytes per 9",
    "long": "8-byte ints (LONG1)",
    "get": "one memoized object pushed again and again (BINGET): a stack slot per 2 bytes",
    "dup": "DUP: a stack slot per byte",
    "memoize": "MEMOIZE of one object: a memo slot per byte",
    "sparse_memo": "one LONG_BINPUT to the highest index the scan allows: a memo array of 16 bytes per byte",
    "appends_get": "a list of memo references (APPENDS): a list slot per 2 bytes",
    "setitems_get": "a dict of distinct int keys to one memoized value (SETITEMS)",
    "additems": "a set of distinct ints (ADDITEMS)",
    "build_reuse": "one memoized 1000-key state dict BUILT into instance after instance (5 bytes each)",
    "set_reuse": "set() of one memoized 1000-item list, REDUCEd again and again",
    "frozenset_reuse": "frozenset() of one memoized 1000-item list, again and again",
    "odict_reuse": "OrderedDict() of one memoized list of 1000 pairs, again and again",
    "size_reuse": "torch.Size() of one memoized 1000-item list, again and again",
    "mdindex_reuse": "MetadataIndex(fqn, offset) whose offset is one memoized 1000-item list (copied to a Size)",
    "path_split": "PurePosixPath() of one memoized string of 2000 distinct parts, again and again",
    "path_nested": "p(k+1) = PurePosixPath(p(k), p(k)): parts double per 7 bytes",
}

#: kind -> what parsing it builds (torch's weights-only unpickler, a torch.save data.pkl).
TORCH_BOMBS: dict[str, str] = {
    "empty_set": "EMPTY_SET per byte",
    "set_reuse": "set() of one memoized 1000-item list, again and again",
    "tensor_views": "a tensor (about 600 bytes with its TensorImpl) per 9 bytes: _rebuild_tensor_v2 of memoized args",
    "bytearray": "bytearray(2**31): 2 GiB from 40 bytes",
    "tensor_new": "torch.Tensor(2**28): 1 GiB of floats from 30 bytes",
    "storage_new": "torch.UntypedStorage(2**31): 2 GiB from 40 bytes",
    "from_type": "_rebuild_from_type_v2(torch.Tensor, torch.Tensor, (2**28,), {}): the same through a rebuild",
}

_MD = "torch.distributed.checkpoint.metadata"


def _sbu(s: str) -> bytes:
    b = s.encode("utf-8")
    return b"\x8c" + bytes([len(b)]) + b


def _bu(s: str) -> bytes:
    b = s.encode("utf-8")
    return b"X" + struct.pack("<I", len(b)) + b


def _binint(v: int) -> bytes:
    return b"J" + struct.pack("<i", v)


def _global4(module: str, name: str) -> bytes:
    return _sbu(module) + _sbu(name) + b"\x93"


def _get(k: int) -> bytes:
    return b"h" + bytes([k]) if k < 256 else b"j" + struct.pack("<I", k)


def _fill(head: bytes, unit, size: int) -> bytes:
    """``head`` then units (``unit(k)`` bytes) up to ``size`` bytes in all, then STOP."""
    parts, n, k = [head], len(head) + 1, 0
    while True:
        u = unit(k)
        if n + len(u) > size:
            break
        parts.append(u)
        n += len(u)
        k += 1
    return b"".join(parts) + b"."


def _memo_list(count: int, first: int = 1000) -> bytes:
    """A list of ``count`` distinct ints, memoized (MEMOIZE)."""
    return b"](" + b"".join(_binint(first + k) for k in range(count)) + b"e\x94"


def bomb_record(kind: str, size: int) -> bytes:
    """A pickle of at most ``size`` bytes (protocol 4, no footer) of the opcode family ``kind``
    (:data:`RECORD_BOMBS`). Parsed whole it leaves no DCP ``Metadata``: the reader refuses it, but
    only after the unpickler has built everything it describes."""
    p = b"\x80\x04"
    if kind == "empty_set":
        return _fill(p, lambda k: b"\x8f", size)
    if kind == "empty_dict":
        return _fill(p, lambda k: b"}", size)
    if kind == "empty_list":
        return _fill(p, lambda k: b"]", size)
    if kind == "frozenset":
        return _fill(p, lambda k: b"(K\x01K\x02\x91", size)
    if kind == "tuple":
        return _fill(p, lambda k: b"(NNNNt", size)
    if kind == "short_str":
        return _fill(p, lambda k: _sbu(f"{k:08x}"), size)
    if kind == "astral_str":
        return _fill(p, lambda k: _sbu("\U0001f600" + f"{k:0200x}"), size)
    if kind == "binint":
        return _fill(p, lambda k: _binint(1000 + k), size)
    if kind == "float":
        return _fill(p, lambda k: b"G" + struct.pack(">d", k + 0.5), size)
    if kind == "long":
        return _fill(p, lambda k: b"\x8a\x08" + struct.pack("<q", (1 << 40) + k), size)
    if kind == "get":
        return _fill(p + b"N\x94", lambda k: b"h\x00", size)
    if kind == "dup":
        return _fill(p + b"N", lambda k: b"2", size)
    if kind == "memoize":
        return _fill(p + b"N", lambda k: b"\x94", size)
    if kind == "sparse_memo":
        return _fill(p + b"Nr" + struct.pack("<I", size - 16), lambda k: b"N0", size)
    if kind == "appends_get":
        return _fill(p + b"N\x94](", lambda k: b"h\x00", size - 1)[:-1] + b"e."
    if kind == "setitems_get":
        return _fill(p + b"N\x94}(", lambda k: _binint(k) + b"h\x00", size - 1)[:-1] + b"u."
    if kind == "additems":
        return _fill(p + b"\x8f(", lambda k: _binint(k), size - 1)[:-1] + b"\x90."
    if kind == "build_reuse":  # memo 0: the class, 1: the state dict
        state = b"}(" + b"".join(_sbu(f"k{k}") + b"N" for k in range(1000)) + b"u\x94"
        return _fill(p + _global4(_MD, "MetadataIndex") + b"\x94" + state, lambda k: b"h\x00)\x81h\x01b", size)
    if kind in ("set_reuse", "frozenset_reuse", "size_reuse"):  # memo 0: the list, 1: the callable, 2: args
        module, name = {"set_reuse": ("builtins", "set"), "frozenset_reuse": ("builtins", "frozenset"),
                        "size_reuse": ("torch", "Size")}[kind]
        head = p + _memo_list(1000) + _global4(module, name) + b"\x94h\x00\x85\x94"
        return _fill(head, lambda k: b"h\x01h\x02R", size)
    if kind == "odict_reuse":
        pairs = b"](" + b"".join(_binint(1000 + k) + b"N\x86" for k in range(1000)) + b"e\x94"
        head = p + pairs + _global4("collections", "OrderedDict") + b"\x94h\x00\x85\x94"
        return _fill(head, lambda k: b"h\x01h\x02R", size)
    if kind == "mdindex_reuse":  # MetadataIndex(fqn, offset=list): __post_init__ copies the list into a Size
        head = p + _memo_list(1000) + _global4(_MD, "MetadataIndex") + b"\x94" + _sbu("w") + b"h\x00N\x87\x94"
        return _fill(head, lambda k: b"h\x01h\x02R", size)
    if kind == "path_split":
        text = "/".join(f"p{k:05d}" for k in range(2000))
        head = p + _bu(text) + b"\x94" + _global4("pathlib", "PurePosixPath") + b"\x94h\x00\x85\x94"
        return _fill(head, lambda k: b"h\x01h\x02R", size)
    if kind == "path_nested":  # memo 0: the class, k: p(k)
        body = p + _global4("pathlib", "PurePosixPath") + b"\x94" + _sbu("a/b/c/d") + b"\x85R\x94"
        for k in range(1, max(2, min(200, (size - len(body)) // 12))):
            body += b"h\x00" + _get(k) + _get(k) + b"\x86R\x94"
        return body + b"."
    raise ValueError(f"unknown record bomb {kind!r}; one of {sorted(RECORD_BOMBS)}")


# -- torch.save files ----------------------------------------------------------------------------
def _tensor_pickle(numel: int, storage: str = "ByteStorage") -> bytes:
    """torch.save's pickle (protocol 2) of ``{"global_step": 1, "t": <uint8 tensor of numel>}``
    viewing storage ``data/0``."""
    n = _binint(numel)
    return (b"\x80\x02}q\x00(X\x0b\x00\x00\x00global_stepq\x01K\x01X\x01\x00\x00\x00tq\x02"
            b"ctorch._utils\n_rebuild_tensor_v2\nq\x03((X\x07\x00\x00\x00storageq\x04ctorch\n"
            + storage.encode() + b"\nq\x05X\x01\x00\x00\x000q\x06X\x03\x00\x00\x00cpuq\x07" + n
            + b"tq\x08QK\x00" + n + b"\x85q\tK\x01\x85q\n\x89ccollections\nOrderedDict\nq\x0b)Rq\x0ctq\rRq\x0eu.")


_SERIAL_ID = b"0" * 40


def torch_zip(pickle_bytes: bytes, storages: dict[str, bytes | int] | None = None,
              compress_type: int = zipfile.ZIP_STORED, archive: str = "archive") -> bytes:
    """A zip in torch.save's layout holding ``pickle_bytes`` as ``data.pkl`` and ``storages``
    (``{key: bytes, or a count of zero bytes written in 1 MiB pieces}``) as ``data/<key>``,
    every member written with ``compress_type``."""
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", compress_type) as z:
        def put(name: str, data: bytes | int) -> None:
            with z.open(f"{archive}/{name}", "w", force_zip64=isinstance(data, int) and data >= 1 << 31) as f:
                if isinstance(data, int):
                    piece = bytes(1 << 20)
                    for left in range(data, 0, -len(piece)):
                        f.write(piece[:left])
                else:
                    f.write(data)

        put("data.pkl", pickle_bytes)
        put(".format_version", b"1")
        put(".storage_alignment", b"64")
        put("byteorder", b"little")
        for key, data in (storages or {}).items():
            put(f"data/{key}", data)
        put("version", b"3\n")
        put(".data/serialization_id", _SERIAL_ID)
    return out.getvalue()


def compressed_extra_state(size: int) -> bytes:
    """An extra-state file (``{"global_step": 1, "t": uint8 tensor}``) whose storage member is
    ``size`` zero bytes, DEFLATE-compressed (about ``size / 1000`` bytes on disk); torch.save never
    compresses, torch.load inflates it whole."""
    return torch_zip(_tensor_pickle(size), {"0": size}, zipfile.ZIP_DEFLATED)


def plain_extra_state(size: int) -> bytes:
    """The same file, stored: what torch.save writes (``size`` bytes of storage)."""
    return torch_zip(_tensor_pickle(size), {"0": size})


def _torch_pickle(kind: str, size: int) -> bytes:
    p = b"\x80\x02"
    if kind == "empty_set":
        return _fill(p, lambda k: b"\x8f", size)
    if kind == "set_reuse":
        head = p + b"](" + b"".join(_binint(1000 + k) for k in range(1000)) + b"eq\x00c__builtin__\nset\nq\x01h\x00\x85q\x02"
        return _fill(head, lambda k: b"h\x01h\x02R", size)
    if kind == "tensor_views":  # the dict of _tensor_pickle, then tensors from memo 3 (the function) and 13 (its args)
        head = _tensor_pickle(1)[:-2]
        return _fill(head, lambda k: _binint(k) + b"h\x03h\rR", size - 1)[:-1] + b"u."
    if kind == "bytearray":
        return p + b"c__builtin__\nbytearray\n\x8a\x05\x00\x00\x00\x80\x00\x85R."
    if kind == "tensor_new":
        return p + b"ctorch\nTensor\nJ\x00\x00\x00\x10\x85R."
    if kind == "storage_new":
        return p + b"ctorch.storage\nUntypedStorage\n\x8a\x05\x00\x00\x00\x80\x00\x85R."
    if kind == "from_type":  # _rebuild_from_type_v2(Tensor, Tensor, (2**28,), {}): calls Tensor(2**28)
        return (p + b"ctorch._tensor\n_rebuild_from_type_v2\nctorch\nTensor\nq\x000(h\x00h\x00J\x00\x00\x00\x10"
                b"\x85}tR.")
    raise ValueError(f"unknown torch bomb {kind!r}; one of {sorted(TORCH_BOMBS)}")


def torch_bomb(kind: str, size: int) -> bytes:
    """A torch.save zip (members stored, as torch.save writes them) of about ``size`` bytes whose
    ``data.pkl`` is the bomb ``kind`` (:data:`TORCH_BOMBS`)."""
    return torch_zip(_torch_pickle(kind, max(64, size - 1024)), {"0": b"\x00"} if kind == "tensor_views" else None)


def rezip(data: bytes, compress_type: int = zipfile.ZIP_STORED, rename: dict[str, str] | None = None,
          extra: tuple[tuple[str, bytes], ...] = ()) -> bytes:
    """The zip ``data`` rewritten: every member with ``compress_type``, names mapped by ``rename``,
    then ``extra`` members (name, bytes) appended."""
    src = zipfile.ZipFile(io.BytesIO(data))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", compress_type) as z:
        for info in src.infolist():
            z.writestr((rename or {}).get(info.filename, info.filename), src.read(info.filename))
        for name, blob in extra:
            z.writestr(name, blob)
    return out.getvalue()


def patch_central(data: bytes, member: str, **fields: int) -> bytes:
    """The zip ``data`` with the central-directory entry of ``member`` changed: ``header_offset``,
    ``compress_size``, ``file_size`` or ``method`` (the local headers are left as they are)."""
    at = {"method": 10, "compress_size": 20, "file_size": 24, "header_offset": 42}
    width = {"method": "<H", "compress_size": "<I", "file_size": "<I", "header_offset": "<I"}
    buf = bytearray(data)
    pos = bytes(buf).find(b"PK\x01\x02")
    while pos >= 0:
        name_len, extra_len, comment_len = struct.unpack("<HHH", buf[pos + 28:pos + 34])
        name = bytes(buf[pos + 46:pos + 46 + name_len]).decode()
        if name == member:
            for field, value in fields.items():
                struct.pack_into(width[field], buf, pos + at[field], value)
            return bytes(buf)
        pos = bytes(buf).find(b"PK\x01\x02", pos + 46 + name_len + extra_len + comment_len)
    raise KeyError(member)
