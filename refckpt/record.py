"""The commit record: encoded self-verifying, parsed within bounds, checked for structure before use.

A step's commit record (``.metadata``) is DCP's pickled ``Metadata`` with refckpt's manifest
as an extra attribute: a plain dict on disk, parsed once into a :class:`Manifest` of
:class:`FileRecord` entries (every file of the step with its size and checksummed blocks) that
every reader and writer of the record uses. Everything resume does is driven by it -- which bytes of which file
hold which chunk of which tensor -- so a record that is damaged but still parses would
load a silently different state (a weight left at its fresh-init values when a chunk's
offsets change, Adam's moments left at zero when an optimizer key changes). Three layers
stop that, in this order, before anything in the record is used:

1. **Its own checksum.** :func:`encode_record` appends a fixed 56-byte footer to the pickle:
   ``RECORD_MAGIC`` (16 bytes), the pickle's length (8 bytes, little-endian) and its SHA-256
   (32 bytes). :func:`split_record` checks the footer before parsing a byte. Plain
   ``pickle.load`` (what DCP's own reader does) stops at the pickle's STOP opcode and ignores
   the footer, so DCP tooling still reads the record. A record without the footer is either
   written before refckpt added it (manifest format ``refckpt/1``, or plain DCP): it loads
   and ``ls``/``verify`` say it carries no record checksum -- or it is a ``refckpt/2`` record
   whose footer was damaged: corrupt.
2. **Bounded parsing.** :func:`scan_pickle` interprets the opcodes over abstract values (it
   builds no object) and estimates, per opcode, an upper bound of what CPython's C unpickler
   allocates: the objects, stack and memo slots, container growth, a copy per memo reference a
   call or BUILD copies. A record whose estimate exceeds ``ALLOC_FACTOR * size + ALLOC_BASE``
   (32 x its size + 1 MiB) is refused before a byte is unpickled: 8 MiB of EMPTY_SET would take
   1.9 GiB. It also refuses memo indices beyond the data's length (CPython's unpickler sizes its
   memo array from the index: one flipped bit asked for 9 GB), declared lengths past the end of
   the data, and trailing bytes after STOP. The file itself is read only if it is a regular file
   no larger than :data:`MAX_RECORD_BYTES`. refckpt's own records estimate at 21-25 times their
   size (the unpickler's measured peak: 11-14 times).
3. **Structure.** :func:`validate_record` checks what the record says against itself, the
   manifest and the files' sizes: every tensor's chunks tile its shape exactly (no gap, no
   overlap, nothing out of bounds), every chunk and byte item has a storage entry naming a
   file of the step whose recorded size holds ``offset + length``, each chunk's length is
   what its shape and dtype need, the manifest's checksummed blocks tile every file
   (:meth:`Manifest.from_dict`, :meth:`Manifest.sizes`), and the manifest's tensor summary
   agrees with the record's dtypes and shapes. So no allocation sized from a record field can
   exceed the files' real sizes.

A violation is :class:`~refckpt.errors.CorruptCheckpointError`: the step is not complete,
and resume falls back to the previous one. A record that passes all three is trusted, so
a tensor whose shape then differs from the caller's is the caller's model
(:class:`~refckpt.errors.ShapeMismatchError`, no fallback).
"""

from __future__ import annotations

import _compat_pickle
import contextlib
import dataclasses
import gc
import hashlib
import io
import os
import pickletools
import reprlib
import stat
import struct
from collections.abc import Callable, Iterator
from typing import Any, Generic, TypeGuard, TypeVar

import torch

from .errors import CorruptCheckpointError, UnsafeCheckpointError

__all__ = [
    "RECORD_MAGIC",
    "RECORD_FOOTER_LEN",
    "RECORD_CHECKSUM",
    "MAX_RECORD_BYTES",
    "encode_record",
    "split_record",
    "scan_pickle",
    "read_record_bytes",
    "validate_record",
    "MANIFEST_ATTR",
    "MANIFEST_FORMAT",
    "FileRecord",
    "Manifest",
    "collector_paused",
]

RECORD_MAGIC = b"REFCKPT-RECORD\x00\x01"
RECORD_FOOTER_LEN = len(RECORD_MAGIC) + 8 + 32
#: Name of the record checksum, as ``ls``, ``verify`` and ``inspect`` report it.
RECORD_CHECKSUM = "sha256"
#: Largest commit record read (bytes). A model with a million tensors records well under this.
MAX_RECORD_BYTES = int(os.environ.get("REFCKPT_MAX_RECORD_BYTES", 1 << 30))

_MEMO_PUTS = {"PUT", "BINPUT", "LONG_BINPUT"}
_MEMO_GETS = {"GET", "BINGET", "LONG_BINGET"}


def encode_record(pickled: bytes) -> bytes:
    """``pickled`` followed by its footer (magic, length, SHA-256)."""
    return pickled + RECORD_MAGIC + struct.pack("<Q", len(pickled)) + hashlib.sha256(pickled).digest()


def split_record(data: bytes, source: str) -> tuple[bytes, str | None]:
    """(pickle bytes, ``"sha256"``) for a record with a valid footer, ``(data, None)`` for one
    without a footer; a footer that does not match its bytes raises :class:`CorruptCheckpointError`."""
    if len(data) < RECORD_FOOTER_LEN or data[-RECORD_FOOTER_LEN:-40] != RECORD_MAGIC:
        return data, None
    body, footer = data[:-RECORD_FOOTER_LEN], data[-40:]
    (length,) = struct.unpack("<Q", footer[:8])
    if length != len(body) or hashlib.sha256(body).digest() != footer[8:]:
        raise CorruptCheckpointError(
            f"{source}: the commit record fails its own checksum ({RECORD_CHECKSUM} over {len(body)} bytes); "
            f"it was damaged after it was written. This step is not used; resume falls back to the previous "
            f"complete step (load_latest does so by itself). Delete this step directory or restore it from a copy."
        )
    return body, RECORD_CHECKSUM


_FIXED, _LINE, _TWO_LINES, _LEN1, _LEN4, _LEN4U, _LEN8U = range(7)


def _opcode_table() -> list:
    """opcode byte -> (name, how its argument is laid out, fixed size), from pickletools' own table."""
    how = {pickletools.UP_TO_NEWLINE: _LINE, pickletools.TAKEN_FROM_ARGUMENT1: _LEN1,
           pickletools.TAKEN_FROM_ARGUMENT4: _LEN4, pickletools.TAKEN_FROM_ARGUMENT4U: _LEN4U,
           pickletools.TAKEN_FROM_ARGUMENT8U: _LEN8U}
    table: list = [None] * 256
    for op in pickletools.opcodes:
        n = op.arg.n if op.arg is not None else 0
        kind = _FIXED if n >= 0 else how[n]
        if kind == _LINE and op.name in ("GLOBAL", "INST"):  # module and name: two lines
            kind = _TWO_LINES
        table[ord(op.code)] = (op.name, kind, max(n, 0))
    return table


_OPCODES = _opcode_table()
_LEN_SIZE = {_LEN1: 1, _LEN4: 4, _LEN4U: 4, _LEN8U: 8}


# -- bounded parsing: what unpickling a pickle may allocate ------------------------------------
#: The allocation bound: parsing (scanning, then unpickling) a pickle of ``n`` bytes allocates at
#: most ``ALLOC_FACTOR * n + ALLOC_BASE`` bytes; :func:`scan_pickle` refuses a pickle whose
#: estimate exceeds it. refckpt's own records estimate at 21-25 times their size, and the C unpickler's
#: measured peak is 11-14 times (docs/design.md, "The memory bound").
ALLOC_FACTOR = 32
#: The fixed part of the bound (bytes): small pickles (a few hundred bytes) have fixed costs.
ALLOC_BASE = 1 << 20


_FROM_TYPE = "torch._tensor._rebuild_from_type_v2"
_BYTEARRAY = "builtins.bytearray"


class _Callee:
    """A global a pickle names (GLOBAL, STACK_GLOBAL, INST, EXT*): what calling it may allocate.

    A call (REDUCE, NEWOBJ, NEWOBJ_EX, OBJ, INST) costs ``factor * weight(args) + base`` bytes, where
    the weight of a value bounds the bytes a copy of what it references takes (8 per reference,
    4 per character, 1 per byte; a tuple adds its items' weights). ``mutable``: the result is a
    container or an instance that later opcodes can grow. ``refused``: calling it allocates memory
    sized by an integer argument (``torch.Tensor(n)``, ``bytearray(n)``), which no bound by bytes
    covers; the pickle is refused."""

    __slots__ = ("name", "factor", "base", "new_factor", "new_base", "mutable", "refused", "plain", "tensor")

    def __init__(self, name: str, factor: int, base: int, mutable: bool, refused: str | None = None,
                 new: tuple[int, int] | None = None, tensor: bool = False) -> None:
        self.name, self.factor, self.base, self.mutable, self.refused = name, factor, base, mutable, refused
        self.tensor = tensor  # its result is a tensor: a BUILD of it would call tensor.set_(*state)
        # NEWOBJ calls cls.__new__(cls, *args): for a dataclass, object.__new__ (an empty instance)
        self.new_factor, self.new_base = new if new is not None else (factor, base)
        self.plain = refused is None and not tensor and name not in (_FROM_TYPE, _BYTEARRAY)  # the formula alone


class _Tuple:
    """A tuple whose items a call needs to see (the torch reader: what ``_rebuild_from_type_v2`` calls)."""

    __slots__ = ("w", "items")

    def __init__(self, w: int, items: list) -> None:
        self.w, self.items = w, items


@dataclasses.dataclass(frozen=True)
class PickleReader:
    """An unpickler as :func:`scan_pickle` prices it: bytes per opcode family (upper bounds on
    64-bit CPython 3.10-3.13, measured), what each callable global may allocate, and how a
    refusal is worded."""

    name: str
    slot: int        # one value on the unpickler's stack (8 bytes, grown by 1/8, realloc)
    mark: int        # MARK (C: one entry of the marks array; Python: a new list)
    memo_slot: int   # per slot up to the highest memo index (C: an array grown to 2 x the index)
    memo_put: int    # per filled memo slot (Python: a dict entry and its int key)
    obj: int         # an int, float or other fixed-size scalar object
    text: int        # fixed part of a str or bytes object
    empty_list: int  # (and the scan's own one-item list standing for it, 72 bytes with its slot)
    empty_dict: int
    empty_set: int
    tuple_: int      # a tuple's header (plus 8 per item)
    list_item: int   # per item appended to a list (slot, growth, realloc)
    set_item: int    # per item added to a set
    build: int       # BUILD, fixed part (materialising the instance dict; its table: _dict_growth)
    persid: int      # a persistent id resolved (torch: a storage object; the bytes are the zip's)
    keep_tuples: bool  # keep tuples holding globals as _Tuple (calls that receive callables)
    calls: dict[str, _Callee]
    default: _Callee
    subject: str     # what the pickle is, in messages
    fix: str         # what to do, in messages


def _calls(table: dict[tuple[int, int, bool], list[str]], refused: dict[str, str] | None = None,
           instances: tuple[str, ...] = (), tensors: tuple[str, ...] = ()) -> dict[str, _Callee]:
    out = {name: _Callee(name, f, b, m, tensor=name in tensors) for (f, b, m), names in table.items()
           for name in names}
    for name in instances:  # dataclasses: REDUCE runs __init__ (its attributes), NEWOBJ makes an empty instance
        out[name] = _Callee(name, 24, 80 + 176, True, new=(0, 80))
    for name, why in (refused or {}).items():
        out[name] = _Callee(name, 0, 0, False, why)
    return out


_DCP_MD = "torch.distributed.checkpoint.metadata"
_DCP_CLASSES = [f"{_DCP_MD}.{n}" for n in ("Metadata", "TensorStorageMetadata", "BytesStorageMetadata",
                                            "ChunkStorageMetadata", "TensorProperties", "MetadataIndex", "StorageMeta")] + [
    "torch.distributed.checkpoint.filesystem._StorageInfo", "torch.distributed.checkpoint._hf_utils._HFStorageInfo"]

#: CPython's C unpickler reading a commit record with the allow-list of :class:`refckpt.safeload.MetadataUnpickler`.
RECORD_READER = PickleReader(
    name="record", slot=10, mark=16, memo_slot=16, memo_put=0, obj=32, text=160,
    empty_list=72, empty_dict=72, empty_set=232, tuple_=48, list_item=20, set_item=112,
    build=80, persid=64, keep_tuples=False,
    calls=_calls({
        (1, 64, False): ["torch.Size", "builtins.slice", "builtins.complex", "torch.device",
                         "torch.serialization._get_layout", f"{_DCP_MD}._MEM_FORMAT_ENCODING"],
        (12, 1024, False): [f"pathlib.{n}" for n in ("Path", "PosixPath", "PurePosixPath", "WindowsPath",
                                                     "PureWindowsPath")],
        (14, 256, True): ["builtins.set"],
        (14, 256, False): ["builtins.frozenset"],
        (25, 384, True): ["collections.OrderedDict"],
    }, instances=tuple(_DCP_CLASSES)),
    default=_Callee("?", 25, 1024, True),
    subject="the commit record",
    fix="the step is not a usable checkpoint. Resume from an older step or delete it",
)


def _torch_refused() -> dict[str, str]:
    """Globals torch's weights-only unpickler allows whose call allocates memory sized by an integer
    argument (a tensor or storage of n elements, a quantized tensor of a shape, a dtype conversion
    of a whole storage): torch.save never writes such a call for plain tensors and Python data."""
    why = "allocates memory sized by an integer argument"
    out = {f"{t.__module__}.{t.__name__}": why for t in torch._tensor_classes}
    out["torch.Tensor"] = why
    out.update({f"{s.__module__}.{s.__name__}": why for s in torch._storage_classes})
    for f in ("_rebuild_qtensor", "_rebuild_device_tensor_from_numpy", "_rebuild_device_tensor_from_cpu_tensor",
              "_rebuild_xla_tensor", "_rebuild_mtia_tensor"):
        out[f"torch._utils.{f}"] = "allocates a new tensor (a quantized or converted copy), not a view of the file's bytes"
    return out


_REBUILD = [f"torch._utils.{f}" for f in ("_rebuild_tensor", "_rebuild_tensor_v2", "_rebuild_tensor_v3", "_rebuild_parameter",
                                          "_rebuild_parameter_with_state", "_rebuild_meta_tensor_no_storage",
                                          "_rebuild_wrapper_subclass", "_rebuild_sparse_tensor", "_rebuild_nested_tensor")]

#: torch's pure-Python weights-only unpickler (``torch.load(weights_only=True)``) reading a
#: ``torch.save`` pickle (``data.pkl``): its stack is a list and MARK starts a new one, its memo a dict.
TORCH_READER = PickleReader(
    name="torch", slot=10, mark=72, memo_slot=0, memo_put=112, obj=32, text=96,
    empty_list=72, empty_dict=72, empty_set=232, tuple_=48, list_item=20, set_item=112,
    build=512, persid=1024, keep_tuples=True,
    calls=_calls({
        (1, 96, False): ["torch.Size", "builtins.complex", "torch.device", "torch.serialization._get_layout"],
        (2, 128, False): ["_codecs.encode"],
        (1, 160, False): [_BYTEARRAY],
        (14, 256, True): ["builtins.set"],
        (25, 384, True): ["collections.OrderedDict"],
        (40, 384, True): ["collections.Counter"],
        (4, 2048, True): _REBUILD + ["torch.nn.parameter.Parameter", _FROM_TYPE],
    }, _torch_refused(), tensors=(*_REBUILD, "torch.nn.parameter.Parameter", _FROM_TYPE)),
    default=_Callee("?", 25, 2048, True),
    subject="the torch.save pickle",
    fix="it is not a file refckpt or torch.save wrote (damaged or crafted); restore it from a copy",
)


class _Bad(Exception):
    def __init__(self, what: str, at: int) -> None:
        super().__init__(what)
        self.what, self.at = what, at


_CAP = 1 << 62  # weights saturate here: a crafted pickle can double one per opcode
#: A mutable value is a list ``[weight]`` (a dict or an instance), ``[weight, kind]`` otherwise.
_LIST, _SET, _TENSOR = 1, 2, 3
_U32 = struct.Struct("<I")


def _weight(v: Any, seal: bool = False) -> int:
    """The weight of an abstract value; ``seal``: a container captured by a tuple may not grow after."""
    t = v.__class__
    if t is int:
        return v
    if t is bytes:  # a str, as its UTF-8 bytes: at most 4 bytes per character decoded
        return 4 * len(v)
    if t is list:  # a mutable container or instance: [weight], ~weight once sealed
        w = v[0]
        if w < 0:
            return ~w
        if seal:
            v[0] = ~w
        return w
    if t is _Tuple:
        return v.w
    return 0  # a global (_Callee): a reference to an existing object


def _state_weight(state: Any) -> int:
    """The weight of a BUILD's state: a dict, a tuple (``(state, slotstate)``, ``__setstate__``'s), a str."""
    if state.__class__ is list and len(state) > 1:  # C: an error; torch's: update(state) or set_(*state)
        raise _Bad("a BUILD whose state is a list or set", -1)
    return _weight(state)


def _tuple(items: list, R: PickleReader) -> Any:
    """The abstract value of a tuple of ``items``: its weight, or a _Tuple where calls need the items."""
    w = 8 * len(items)
    keep = False
    for v in items:
        w += _weight(v, seal=True)
        if v.__class__ is _Callee or v.__class__ is _Tuple:
            keep = True
    w = min(w, _CAP)
    return _Tuple(w, items) if keep and R.keep_tuples else w


def _call(f: Any, args: Any, R: PickleReader, depth: int = 0, new: bool = False) -> tuple[int, Any]:
    """(bytes a call of ``f`` with ``args`` may allocate, the abstract value of its result);
    ``new``: NEWOBJ's ``cls.__new__(cls, *args)``."""
    if f.__class__ is not _Callee:
        f = R.default  # a call of something that is not a global fails; price it as the worst one
    if f.refused is not None:
        raise _Bad(f"a call of {f.name}, which {f.refused}", -1)
    if args.__class__ is list:  # C: an error; torch's unpickler calls func(*args) with what it holds
        raise _Bad(f"a call of {f.name} whose arguments are a list, dict or instance, not a tuple", -1)
    w = _weight(args)
    factor = f.new_factor if new else f.factor
    cost = factor * w + (f.new_base if new else f.base)
    if f.name == _BYTEARRAY and w == 8:  # bytearray(n): one argument of no weight (a number)
        raise _Bad(f"a call of {_BYTEARRAY} with one scalar argument, which allocates that many bytes", -1)
    if f.name == _FROM_TYPE:  # _rebuild_from_type_v2(func, new_type, args, state): calls func(*args)
        if depth > 4:
            raise _Bad(f"{_FROM_TYPE} nested more than 4 deep", -1)
        if args.__class__ is _Tuple and len(args.items) == 4:
            inner, _ = _call(args.items[0], args.items[2], R, depth + 1)
            cost += inner + R.build + _dict_growth(0, _weight(args.items[3]) >> 4)
    w = min(factor * w, _CAP)
    return cost, ([w, _TENSOR] if f.tensor else [w] if f.mutable else w)


def _callee(module: Any, name: Any, R: PickleReader, cache: dict) -> _Callee:
    """The callee a global names (``module`` and ``name``: a str's UTF-8 bytes, as the scan keeps them)."""
    if module.__class__ is not bytes or name.__class__ is not bytes:
        return R.default
    raw = (module, name)
    got = cache.get(raw)
    if got is None:
        key = (module.decode("utf-8", "replace"), name.decode("utf-8", "replace"))
        if key in _compat_pickle.NAME_MAPPING:  # Python 2 names, as the unpicklers map them
            key = _compat_pickle.NAME_MAPPING[key]
        elif key[0] in _compat_pickle.IMPORT_MAPPING:
            key = (_compat_pickle.IMPORT_MAPPING[key[0]], key[1])
        got = cache[raw] = R.calls.get(f"{key[0]}.{key[1]}", R.default)
    return got


def _line(data: bytes, i: int, what: str) -> int:
    j = data.find(b"\n", i)
    if j < 0:
        raise _Bad(f"{what} without its newline", i)
    return j


def scan_pickle(data: bytes, source: str, reader: PickleReader = RECORD_READER, *, size: int | None = None) -> int:
    """Refuse a pickle whose parsing could allocate more than ``ALLOC_FACTOR * size + ALLOC_BASE``
    bytes; return the estimate (bytes) for one that passes. ``size``: the bytes read for it
    (default ``len(data)``; a torch.save file's ``data.pkl`` is bounded by the whole file's size,
    whose members hold the storages its tensors view).

    Interprets the opcodes over abstract values, building no object: every value on the stack and
    in the memo is its weight (the bytes a copy of what it references takes), a mutable container
    or instance a one-item list holding its weight (so memo references see it grow), a global the
    callable it names. Each opcode adds an upper bound of what ``reader`` allocates for it
    (:data:`RECORD_READER`: CPython's C unpickler; :data:`TORCH_READER`: torch's weights-only
    unpickler): the object it creates, the stack slot, the container slot and growth where it is
    stored (APPENDS, SETITEMS, ADDITEMS, for every memo reference stored), MARK, the memo array
    up to the highest index; a call (REDUCE, NEWOBJ...) ``factor x weight(args) + base`` by
    callable, a BUILD a copy of its state into the instance. So a container built once and
    referenced a million times from the memo costs a million copies where a call or BUILD copies
    it, and a million stack slots where it is only referenced.

    Also refused: memo indices beyond the data's length or never filled, declared lengths and
    frames past the end of the data, unknown opcodes, anything after STOP, a container changed
    after it was put into a tuple (only a self-referencing structure does that), and (``reader``)
    calls that allocate by an integer argument. Errors are :class:`CorruptCheckpointError`
    naming ``source``."""
    try:
        with collector_paused():  # the scan's boxes are container objects, none of them garbage
            return _scan(data, reader, len(data) if size is None else max(size, len(data)))
    except _Bad as e:
        where = f" at byte {e.at}" if e.at >= 0 else ""
        raise CorruptCheckpointError(
            f"{source}: cannot parse {reader.subject} ({e.what}{where}): parsing it could allocate "
            f"without bound; {reader.fix}.") from None


def _scan(data: bytes, R: PickleReader, size: int) -> int:  # noqa: C901 - one loop over the opcodes, by frequency
    n = len(data)
    limit = ALLOC_FACTOR * size + ALLOC_BASE
    st: list = []
    push = st.append
    pop = st.pop
    marks: list[int] = []
    memo: list = []
    memo_len = 0
    cache: dict = {}
    SLOT, TEXT, MARK, TUP = R.slot, R.text, R.mark, R.tuple_
    SLOT_OBJ, SLOT_DICT, SLOT_LIST, SLOT_SET = R.slot + R.obj, R.slot + R.empty_dict, R.slot + R.empty_list, R.slot + R.empty_set
    LIST_ITEM, BUILD = R.list_item, R.build
    u32 = _U32.unpack_from
    est = n  # the unpickler's input buffer
    i = 0
    try:
        while True:
            c = data[i]
            if c == 0x94:  # MEMOIZE
                if memo_len == len(memo):
                    memo.append(st[-1])
                    memo_len += 1
                else:
                    memo_len = _memo_put(memo, memo_len, memo_len, st[-1], n, i)
                i += 1
            elif c == 0x6A or c == 0x68:  # LONG_BINGET, BINGET
                if c == 0x68:
                    idx = data[i + 1]
                    i += 2
                else:
                    idx = u32(data, i + 1)[0]
                    i += 5
                if idx >= len(memo) or memo[idx] is None:
                    raise _Bad(f"a memo reference to slot {idx}, which holds nothing", i)
                push(memo[idx])
                est += SLOT
            elif c == 0x4A:  # BININT
                push(0)
                est += SLOT_OBJ
                i += 5
            elif c == 0x28:  # MARK
                marks.append(len(st))
                est += MARK
                i += 1
            elif c == 0x75:  # SETITEMS
                k = marks.pop()
                pairs = (len(st) - k + 1) >> 1
                del st[k:]
                t = st[-1]
                if t.__class__ is list:
                    w = t[0]
                    if w < 0:
                        raise _Bad("a dict changed after it was put into a tuple", i)
                    t[0] = w + 16 * pairs
                    e1 = (w >> 4) + pairs
                    if e1 <= 5:  # a small dict's first table
                        if w == 0:
                            est += 176
                    else:
                        est += _dict_table(e1) - _dict_table(w >> 4)
                else:
                    est += _dict_table(pairs)
                i += 1
            elif c == 0x7D:  # EMPTY_DICT
                push([0])
                est += SLOT_DICT
                if est > limit:
                    break
                i += 1
            elif c == 0x29 or c == 0x4E or c == 0x89 or c == 0x88:  # EMPTY_TUPLE, NONE, NEWFALSE, NEWTRUE
                push(0)
                est += SLOT
                i += 1
            elif c == 0x81 or c == 0x52:  # NEWOBJ, REDUCE
                args = pop()
                f = st[-1]
                if f.__class__ is _Callee and args.__class__ is int and f.plain:
                    if c == 0x52:
                        w = f.factor * args
                        est += w + f.base
                    else:
                        w = f.new_factor * args
                        est += w + f.new_base
                    st[-1] = [w] if f.mutable else w
                else:
                    cost, st[-1] = _call(f, args, R, new=c == 0x81)
                    est += cost
                if est > limit:
                    break
                i += 1
            elif c == 0x62:  # BUILD
                state = pop()
                t = st[-1]
                w = state if state.__class__ is int else _state_weight(state)
                if t.__class__ is list:
                    if len(t) > 1 and t[1] == _TENSOR:
                        raise _Bad("a BUILD of a tensor (tensor.set_(*state): torch.save's pre-1.0 layout)", i)
                    w0 = t[0]
                    if w0 < 0:
                        raise _Bad("an instance changed after it was put into a tuple", i)
                    t[0] = w1 = min(w0 + w, _CAP)
                    if w1 <= 80:  # at most 5 attributes: the first table, once
                        est += BUILD + 176 if w0 < 16 <= w1 else BUILD
                    else:
                        est += BUILD + _dict_table(w1 >> 4) - _dict_table(w0 >> 4)
                else:
                    est += BUILD + _dict_growth(0, w >> 4)
                if est > limit:
                    break
                i += 1
            elif c == 0x4B:  # BININT1 (0..255: cached)
                push(0)
                est += SLOT
                i += 2
            elif c == 0x85:  # TUPLE1
                v = st[-1]
                st[-1] = (8 + v if v < _CAP else _CAP) if v.__class__ is int else _tuple([v], R)
                est += TUP
                i += 1
            elif c == 0x4D:  # BININT2
                push(0)
                est += SLOT_OBJ
                i += 3
            elif c == 0x86:  # TUPLE2
                b = pop()
                a = st[-1]
                if a.__class__ is int and b.__class__ is int:
                    w = 16 + a + b
                    st[-1] = w if w < _CAP else _CAP
                else:
                    st[-1] = _tuple([a, b], R)
                est += TUP + 8
                i += 1
            elif c == 0x5D:  # EMPTY_LIST
                push([0, _LIST])
                est += SLOT_LIST
                if est > limit:
                    break
                i += 1
            elif c == 0x65:  # APPENDS
                k = marks.pop()
                cnt = len(st) - k
                del st[k:]
                t = st[-1]
                if t.__class__ is list:
                    if t[0] < 0:
                        raise _Bad("a list changed after it was put into a tuple", i)
                    t[0] += 8 * cnt
                est += LIST_ITEM * cnt
                i += 1
            elif c == 0x8A:  # LONG1
                size = data[i + 1]
                push(0)
                est += SLOT_OBJ + size + (size >> 3)
                i += 2 + size
            elif c == 0x8C:  # SHORT_BINUNICODE
                size = data[i + 1]
                if size > n - i - 2:
                    raise _Bad(f"SHORT_BINUNICODE declares {size} bytes, {n - i - 2} remain", i)
                v = data[i + 2:i + 2 + size]  # a str's UTF-8 bytes: decoded only to name a global
                push(v)
                est += SLOT + TEXT + (size if v.isascii() else 6 * size)
                i += 2 + size
            elif c == 0x71 or c == 0x72:  # BINPUT, LONG_BINPUT
                if c == 0x71:
                    idx = data[i + 1]
                    i += 2
                else:
                    idx = u32(data, i + 1)[0]
                    i += 5
                memo_len = _memo_put(memo, memo_len, idx, st[-1], n, i)
            elif c == 0x95:  # FRAME
                size = int.from_bytes(data[i + 1:i + 9], "little")
                if size > n - i - 9:
                    raise _Bad("a frame longer than the data", i)
                i += 9
            elif c == 0x80:  # PROTO
                i += 2
            elif c == 0x2E:  # STOP
                if i + 1 != n:
                    raise _Bad(f"{n - i - 1} bytes after the end", i + 1)
                break
            # the rest: rare in what torch and refckpt write, frequent in what floods a reader
            elif c == 0x74:  # TUPLE
                k = marks.pop()
                items = st[k:]
                del st[k:]
                cnt = len(items)
                try:
                    w = sum(items, 8 * cnt)
                except TypeError:
                    w = _tuple(items, R)
                push(w)
                est += TUP + 8 * cnt
                i += 1
            elif c == 0x32:  # DUP
                push(st[-1])
                est += SLOT
                i += 1
            elif c == 0x30:  # POP
                if marks and marks[-1] == len(st):
                    marks.pop()
                else:
                    pop()
                i += 1
            elif c == 0x61 or c == 0x73:  # APPEND, SETITEM
                if c == 0x73:
                    pop()
                pop()
                t = st[-1]
                if c == 0x61:
                    _grow(t, 8, i)
                    est += LIST_ITEM
                else:
                    e0 = _weight(t) >> 4
                    _grow(t, 16, i)
                    est += _dict_growth(e0, e0 + 1) if t.__class__ is list else _dict_table(1)
                i += 1
            elif c == 0x8F:  # EMPTY_SET
                push([0, _SET])
                est += SLOT_SET
                if est > limit:
                    break
                i += 1
            elif c == 0x47:  # BINFLOAT
                push(0)
                est += SLOT_OBJ
                i += 9
            else:
                i, est, memo_len = _rare(data, i, c, st, marks, memo, memo_len, est, R, cache, limit)
                if est > limit:
                    break
    except IndexError:
        if i >= n:
            raise _Bad("no STOP opcode", n) from None
        raise _Bad(f"opcode {data[i]:#04x} on an empty stack or without its MARK, or cut short", i) from None
    except _Bad as e:
        if e.at < 0:
            e.at = i
        raise
    est += R.memo_slot * len(memo) + R.memo_put * memo_len
    if est > limit:
        raise _Bad(f"an estimated {est >> 20} MiB to parse {n} bytes, more than {ALLOC_FACTOR} x {size} bytes "
                   f"+ {ALLOC_BASE >> 20} MiB", i)
    return est


def _dict_table(entries: int) -> int:
    """Bytes of a dict's table holding ``entries`` (CPython 3.10-3.13, 64-bit; measured: 168 bytes up
    to 5 entries, 296 up to 10, 575 up to 21), then at most 104 per entry, which covers the old table
    alive while a resize copies it (the old table of a small dict's resize: within ALLOC_BASE)."""
    return 0 if entries <= 0 else 176 if entries <= 5 else 304 if entries <= 10 else 584 if entries <= 21 else 104 * entries


def _dict_growth(e0: int, e1: int) -> int:
    """What growing a dict (or an instance's attributes) from ``e0`` to ``e1`` entries may allocate."""
    return _dict_table(e1) - _dict_table(e0)


def _memo_put(memo: list, memo_len: int, idx: int, v: Any, n: int, at: int) -> int:
    """Store ``v`` at memo slot ``idx``; the number of filled slots after."""
    if idx < len(memo):
        if memo[idx] is None:
            memo_len += 1
        memo[idx] = v
        return memo_len
    if idx > n:  # CPython sizes its memo array from the index: one flipped bit asked for 9 GB
        raise _Bad(f"memo slot {idx} in {n} bytes", at)
    memo.extend([None] * (idx - len(memo)))
    memo.append(v)
    return memo_len + 1


def _pop_mark(st: list, marks: list) -> list:
    k = marks.pop()
    items = st[k:]
    del st[k:]
    return items


def _grow(t: Any, w: int, at: int) -> None:
    if t.__class__ is list:
        if t[0] < 0:
            raise _Bad("a container changed after it was put into a tuple", at)
        t[0] = min(t[0] + w, _CAP)


def _length(data: bytes, i: int, width: int, name: str, signed: bool = False) -> int:
    n = len(data)
    if i + 1 + width > n:
        raise _Bad(f"{name} cut short", i)
    size = int.from_bytes(data[i + 1:i + 1 + width], "little", signed=signed)
    if size < 0 or size > n - i - 1 - width:
        raise _Bad(f"{name} declares {size} bytes, {n - i - 1 - width} remain", i)
    return size


def _rare(data: bytes, i: int, c: int, st: list, marks: list, memo: list, memo_len: int, est: int,
          R: PickleReader, cache: dict, limit: int) -> tuple[int, int, int]:  # noqa: C901 - one branch per opcode
    """Every opcode the loop in :func:`_scan` does not handle inline: (next position, estimate, memo_len)."""
    info = _OPCODES[c]
    if info is None:
        raise _Bad(f"unknown opcode {c:#04x}", i)
    name = info[0]
    push, slot, n = st.append, R.slot, len(data)
    if name in ("BINUNICODE", "BINUNICODE8"):
        size = _length(data, i, 4 if name == "BINUNICODE" else 8, name)
        start = i + 1 + (4 if name == "BINUNICODE" else 8)
        est += slot + R.text + 6 * size + (size >> 6)  # UTF-8 decoded to UCS-4, and the decoder's buffers
        if est > limit:  # refused: before the scan copies it itself
            return start + size, est, memo_len
        v = data[start:start + size]
        push(v)
        if v.isascii():  # decoded in place: the str object only
            est -= 5 * size + (size >> 6)
        return start + size, est, memo_len
    if name in ("BINBYTES", "SHORT_BINBYTES", "BINBYTES8", "BYTEARRAY8", "BINSTRING", "SHORT_BINSTRING"):
        width = {"SHORT_BINBYTES": 1, "SHORT_BINSTRING": 1, "BINBYTES": 4, "BINSTRING": 4}.get(name, 8)
        size = _length(data, i, width, name, signed=name == "BINSTRING")
        text = name.endswith("STRING")  # Python 2 str: decoded to str with the unpickler's encoding
        push(4 * size if text else size)
        est += slot + R.text + (6 * size + (size >> 6) if text else size)
        return i + 1 + width + size, est, memo_len
    if name in ("STRING", "UNICODE", "INT", "LONG", "FLOAT"):
        j = _line(data, i + 1, name)
        size = j - i - 1
        push(4 * size if name in ("STRING", "UNICODE") else 0)
        est += slot + R.text + 6 * size + (size >> 6)
        return j + 1, est, memo_len
    if name == "LONG4":
        size = _length(data, i, 4, name, signed=True)
        est += slot + R.obj + size + (size >> 3)
        push(0)
        return i + 5 + size, est, memo_len
    if name in ("ADDITEMS", "TUPLE3", "LIST", "DICT", "FROZENSET", "POP_MARK"):
        if name == "TUPLE3":
            if len(st) < 3:
                raise _Bad(f"TUPLE3 on a stack of {len(st)}", i)
            items = st[-3:]
            del st[-3:]
        else:
            items = _pop_mark(st, marks)
        cnt = len(items)
        if name == "ADDITEMS":
            _grow(st[-1], 8 * cnt, i)
            est += R.set_item * cnt
        elif name == "TUPLE3":
            push(_tuple(items, R))
            est += R.tuple_ + 8 * cnt
        elif name == "LIST":
            push([8 * cnt, _LIST])
            est += R.empty_list + 8 * cnt + 8
        elif name == "DICT":
            push([8 * cnt])
            est += R.empty_dict + _dict_table((cnt + 1) >> 1)
        elif name == "FROZENSET":
            push(8 * cnt)
            est += R.empty_set + R.set_item * cnt
        return i + 1, est, memo_len
    if name in ("GET", "PUT"):
        j = _line(data, i + 1, name)
        try:
            idx = int(data[i + 1:j])
        except ValueError:
            raise _Bad(f"{name} with index {data[i + 1:j][:40]!r}", i) from None
        if idx < 0:
            raise _Bad(f"{name} of memo slot {idx}", i)
        if name == "PUT":
            return j + 1, est, _memo_put(memo, memo_len, idx, st[-1], n, i)
        if idx >= len(memo) or memo[idx] is None:
            raise _Bad(f"a memo reference to slot {idx}, which holds nothing", i)
        push(memo[idx])
        return j + 1, est + slot, memo_len
    if name in ("GLOBAL", "INST"):
        j = _line(data, i + 1, name)
        k = _line(data, j + 1, name)
        f = _callee(data[i + 1:j], data[j + 1:k], R, cache)
        est += slot + R.text + 2 * (k - i)
        if name == "GLOBAL":
            push(f)
        else:
            cost, res = _call(f, _tuple(_pop_mark(st, marks), R), R)
            push(res)
            est += cost
        return k + 1, est, memo_len
    if name == "STACK_GLOBAL":
        nm = st.pop()
        st[-1] = _callee(st[-1], nm, R, cache)
        return i + 1, est + R.text, memo_len
    if name in ("EXT1", "EXT2", "EXT4"):
        push(R.default)
        return i + 1 + info[2], est + slot + R.text, memo_len
    if name in ("OBJ", "NEWOBJ_EX"):
        if name == "OBJ":
            items = _pop_mark(st, marks)
            f, args = items[0], _tuple(items[1:], R)
            cost, res = _call(f, args, R)
            push(res)
        else:
            kwargs = st.pop()
            args = st.pop()
            cost, st[-1] = _call(st[-1], min(_weight(args) + _weight(kwargs), _CAP), R, new=True)
        return i + 1, est + cost + slot, memo_len
    if name in ("PERSID", "BINPERSID"):
        if name == "PERSID":
            j = _line(data, i + 1, name)
            push(0)
            return j + 1, est + slot + R.persid + 2 * (j - i), memo_len
        st[-1] = 0
        return i + 1, est + R.persid, memo_len
    if name in ("NEXT_BUFFER", "READONLY_BUFFER"):
        if name == "NEXT_BUFFER":
            push(0)
        return i + 1, est + slot + R.obj, memo_len
    raise _Bad(f"opcode {name} where it cannot be", i)  # pragma: no cover - every opcode is handled above


class _Seen:
    """A small LRU set of records already scanned (and validated): the scan is the costly part
    of reading a record (pure Python, ~0.15 s per MB), and resume reads the same record up to
    three times (listing, load, DCP's own read_metadata). A key is the record file's identity
    (device, inode, size, mtime_ns, ctime_ns) -- any rewrite changes ctime, which no user can
    set back -- plus, for validation, the sizes it was checked against."""

    def __init__(self, size: int = 64) -> None:
        import collections
        import threading

        self._keys: collections.OrderedDict[Any, None] = collections.OrderedDict()
        self._size = size
        self._lock = threading.Lock()

    def __contains__(self, key: Any) -> bool:
        with self._lock:
            if key in self._keys:
                self._keys.move_to_end(key)
                return True
            return False

    def add(self, key: Any) -> None:
        with self._lock:
            self._keys[key] = None
            while len(self._keys) > self._size:
                self._keys.popitem(last=False)


SCANNED = _Seen()
VALIDATED = _Seen()


def record_identity(st: os.stat_result) -> tuple:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def read_record_bytes(path: str, limit: int | None = None, identity: list | None = None) -> bytes:
    """The whole of a commit record file: regular files only (a FIFO or device never blocks),
    at most ``limit`` (default :data:`MAX_RECORD_BYTES`) bytes. ``identity``, if a list, gets
    the file's :func:`record_identity` appended (taken from the descriptor that was read)."""
    limit = MAX_RECORD_BYTES if limit is None else limit
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
    fd = os.open(path, flags)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise CorruptCheckpointError(
                f"{path}: the commit record is not a regular file; a checkpoint holds only regular files. "
                f"Remove this step directory.")
        if st.st_size > limit:
            raise CorruptCheckpointError(
                f"{path}: the commit record is {st.st_size} bytes, more than the {limit} refckpt reads "
                f"(REFCKPT_MAX_RECORD_BYTES); it is corrupt or not a commit record.")
        chunks, got = [], 0
        while got <= st.st_size:  # one read past the size: a file that grew is refused too
            b = os.read(fd, min(st.st_size - got + 1, 64 << 20) or 1)
            if not b:
                break
            chunks.append(b)
            got += len(b)
        if got != st.st_size:
            raise CorruptCheckpointError(f"{path}: commit record changed size while being read ({st.st_size} -> {got}).")
        after = os.fstat(fd)
        if identity is not None and record_identity(after) == record_identity(st):
            identity.append(record_identity(st))
        return b"".join(chunks)
    finally:
        os.close(fd)


# -- structure ----------------------------------------------------------------------------------
def _r(v: Any) -> str:
    """``repr`` bounded in depth and length: a crafted record may nest a value 100,000 deep."""
    return reprlib.repr(v)


def _bad(source: str, what: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(
        f"{source}: {what}. The commit record is inconsistent (damaged or crafted); this step is not "
        f"used and resume falls back to the previous complete step. Delete it or restore it from a copy.")


def _is_int(v: Any) -> TypeGuard[int]:
    return isinstance(v, int) and not isinstance(v, bool)


def _dims(v: Any, source: str, what: str) -> tuple[int, ...]:
    if not isinstance(v, (torch.Size, tuple, list)) or not all(_is_int(x) and x >= 0 for x in v):
        raise _bad(source, f"{what} is {_r(v)}, not a list of non-negative integers")
    return tuple(v)


def _volume(dims: tuple[int, ...]) -> int:
    n = 1
    for d in dims:
        n *= d
    return n


def _check_tiling(fqn: str, size: tuple[int, ...], boxes: list, whole: bool, source: str,
                  bad: Callable[[str, str], Exception] = _bad) -> None:
    """Chunks inside ``size``, pairwise disjoint, and (``whole``) covering it: an exact tiling.

    In time linear in the number of chunks, whatever a crafted record holds: the distinct chunk
    boundaries of every dimension cut the tensor into a grid of cells. Sharding (DTensor on any
    mesh, FSDP, TP) makes chunks that are unions of cells, and about as many cells as chunks; more
    than ``16 x chunks + 64`` cells is refused. Otherwise each chunk marks its cells: a cell marked
    twice is an overlap, and (``whole``) the chunks' volumes must add up to the tensor's.

    ``bad(source, what)`` makes the error (default: a corrupt record). The save planner
    (:class:`refckpt.planner.RefSavePlanner`) runs the same check on DCP's global save plan, so a
    save refuses exactly the chunk tables a load would."""
    for off, sz in boxes:
        if len(off) != len(size) or len(sz) != len(size):
            raise bad(source, f"{fqn}: a chunk has {len(off)}-d offsets and {len(sz)}-d sizes for a {len(size)}-d tensor")
        if any(o < 0 for o in off) or any(s < 0 for s in sz):
            raise bad(source, f"{fqn}: chunk at {list(off)} of size {list(sz)} has a negative offset or size")
        if any(o + s > d for o, s, d in zip(off, sz, size)):
            raise bad(source, f"{fqn}: chunk at {list(off)} of size {list(sz)} reaches outside shape {list(size)}")
    live = [b for b in boxes if _volume(b[1])]
    if not size:
        if len(live) > 1:
            raise bad(source, f"{fqn}: {len(live)} chunks of one scalar")
    elif len(live) > 1:
        cuts = [sorted({o for b in live for o in (b[0][k], b[0][k] + b[1][k])}) for k in range(len(size))]
        index = [{c: n for n, c in enumerate(dim_cuts)} for dim_cuts in cuts]
        shape = [len(c) - 1 for c in cuts]
        cells = _volume(tuple(shape))
        if cells > 16 * len(live) + 64:
            raise bad(source, f"{fqn}: {len(live)} chunks cut it into {cells} cells; no sharding does that")
        strides = [_volume(tuple(shape[k + 1:])) for k in range(len(shape))]
        marked = bytearray(cells)
        for off, sz in live:
            flat = [0]
            for k in range(len(size)):
                flat = [f + i * strides[k] for f in flat for i in range(index[k][off[k]], index[k][off[k] + sz[k]])]
            for f in flat:
                if marked[f]:
                    raise bad(source, f"{fqn}: the chunk at {list(off)} overlaps another chunk")
                marked[f] = 1
    if whole and sum(_volume(b[1]) for b in live) != _volume(size):
        raise bad(source, f"{fqn}: its chunks cover {sum(_volume(b[1]) for b in live)} of its "
                           f"{_volume(size)} elements; a part of the tensor has no saved bytes")


# -- the manifest -------------------------------------------------------------------------------
#: Attribute of DCP's ``Metadata`` that carries refckpt's manifest (file sizes and checksums).
#: Plain DCP ignores unknown attributes, so the commit record stays readable by DCP.
MANIFEST_ATTR = "refckpt_manifest"
#: refckpt/2: the record ends with a footer holding its own SHA-256, and the manifest lists every
#: tensor's dtype and shape. refckpt/1 records (no footer) still load.
MANIFEST_FORMAT = "refckpt/2"


@dataclasses.dataclass(frozen=True)
class FileRecord:
    """One file of a step as the manifest records it: its size and the checksummed blocks that tile
    it, ``((offset, length, checksum), ...)`` (the algorithm is the manifest's ``checksum``). Also
    what a rank sends the coordinator about each file it wrote (in a DCP ``WriteResult``).
    On disk: ``{"size": size, "chunks": [[offset, length, checksum], ...]}``."""

    relative_path: str
    size: int
    chunks: tuple[tuple[int, int, int], ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {"size": self.size, "chunks": [list(c) for c in self.chunks]}


_T = TypeVar("_T")


class _InfoField(Generic[_T]):
    """A typed read of one field of :attr:`Manifest.info`: its value if it has the type, else None."""

    def __init__(self, kind: type[_T]) -> None:
        self.kind = kind
        self.name = ""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, obj: Manifest | None, owner: type | None = None) -> _T | None:
        v = obj.info.get(self.name) if obj is not None else None
        return v if isinstance(v, self.kind) else None


@dataclasses.dataclass(frozen=True)
class Manifest:
    """refckpt's manifest: the attribute :data:`MANIFEST_ATTR` of the DCP
    ``Metadata`` in a commit record, parsed once (:meth:`of`) into typed fields.

    ``info`` holds the save's own fields in the order the writer gave them (``world_size``,
    ``global_step``, ``extra_state``, ``writer``); the properties read them, ``None`` where a
    field is absent or of the wrong type. :meth:`to_dict` is the on-disk encoding."""

    files: dict[str, FileRecord]
    #: checksum algorithm of every block (a name of :func:`refckpt.storage.checksum_fn`); None: sizes only.
    checksum: str | None = None
    #: ``"refckpt/2"``; ``"refckpt"`` for a record that names none.
    format: str = MANIFEST_FORMAT
    #: the algorithm of the record's own footer (``"sha256"``), as the writer declared it.
    record_checksum: Any = RECORD_CHECKSUM
    #: ``{fqn: [dtype, shape]}`` of every tensor (:func:`tensor_summary`); checked by :func:`validate_record`.
    tensors: Any = None
    info: dict[str, Any] = dataclasses.field(default_factory=dict)

    _CORE = ("format", "checksum", "files", "record_checksum", "tensors")

    @staticmethod
    def is_manifest(raw: Any) -> bool:
        """Whether ``raw`` has a manifest's shape at all (a dict with a file table)."""
        return isinstance(raw, dict) and isinstance(raw.get("files"), dict)

    @staticmethod
    def declares_footer(md: Any) -> bool:
        """Whether the manifest of ``md`` says its record was written with a checksum footer
        (read before anything else is checked: a record that lost its footer is corrupt)."""
        raw = getattr(md, MANIFEST_ATTR, None)
        return isinstance(raw, dict) and bool(raw.get("record_checksum"))

    @classmethod
    def of(cls, md: Any, source: str) -> Manifest | None:
        """The manifest of the DCP ``Metadata`` ``md``; None for a record refckpt did not write."""
        raw = getattr(md, MANIFEST_ATTR, None)
        return None if raw is None else cls.from_dict(raw, source)

    @classmethod
    def from_dict(cls, raw: Any, source: str) -> Manifest:
        """Parse the on-disk manifest. Every file entry must be well formed and its checksummed
        blocks must follow each other from byte 0 (:meth:`sizes` checks that they cover the file);
        otherwise :class:`~refckpt.errors.CorruptCheckpointError` names the entry."""
        if not cls.is_manifest(raw):
            raise _bad(source, "the manifest is malformed (no file table)")
        files: dict[str, FileRecord] = {}
        for rel, rec in raw["files"].items():
            if not isinstance(rel, str) or not isinstance(rec, dict) or not _is_int(rec.get("size")) or rec["size"] < 0:
                raise _bad(source, f"manifest entry {_r(rel)} is malformed")
            chunks = rec.get("chunks", [])
            if not isinstance(chunks, (list, tuple)):
                raise _bad(source, f"manifest entry {_r(rel)} has malformed checksum blocks")
            pos = 0
            for c in chunks:
                if (not isinstance(c, (list, tuple)) or len(c) != 3 or not all(_is_int(x) for x in c)
                        or c[0] != pos or c[1] < 0):
                    raise _bad(source, f"{rel}: checksum blocks do not tile the file (at byte {pos}: {_r(c)})")
                pos += c[1]
            files[rel] = FileRecord(rel, rec["size"], tuple((c[0], c[1], c[2]) for c in chunks))
        return cls(files=files, checksum=raw.get("checksum") or None, format=str(raw.get("format", "refckpt")),
                   record_checksum=raw.get("record_checksum"), tensors=raw.get("tensors"),
                   info={k: v for k, v in raw.items() if k not in cls._CORE})

    def to_dict(self) -> dict[str, Any]:
        """The on-disk encoding (key order and types as refckpt has always written them)."""
        return {"format": self.format, "checksum": self.checksum,
                "files": {rel: rec.to_dict() for rel, rec in self.files.items()},
                "record_checksum": self.record_checksum, "tensors": self.tensors, **self.info}

    def attach(self, md: Any) -> None:
        """Put this manifest into the DCP ``Metadata`` ``md`` (plain DCP ignores the attribute)."""
        setattr(md, MANIFEST_ATTR, self.to_dict())

    def sizes(self, source: str) -> dict[str, int]:
        """Expected size of every file the step holds, after checking that checksummed blocks
        cover each file they describe."""
        for rel, rec in self.files.items():
            covered = sum(c[1] for c in rec.chunks)
            if self.checksum and rec.chunks and covered != rec.size:
                raise _bad(source, f"{rel}: checksum blocks cover {covered} of its {rec.size} bytes")
        return {rel: rec.size for rel, rec in self.files.items()}

    def block_checksums(self) -> dict[tuple[str, int], tuple[int, int]]:
        """``{(file, offset): (length, checksum)}`` of every recorded block: what a reader verifies each
        item it reads against. Blocks are recorded whatever ``checksums=`` the save used (without, the
        extra-state files' only), and every recorded block is verified."""
        return {(rel, off): (length, crc) for rel, rec in self.files.items() for off, length, crc in rec.chunks}

    #: the world size of the save; the step it saved; where it keeps its extra state
    #: (``"per_rank"``, ``"embedded"``; None: it holds none); the token of the save that wrote the
    #: record (:class:`refckpt.commit.StagedStep`). Each None where absent or of the wrong type.
    world_size = _InfoField(int)
    global_step = _InfoField(int)
    extra_state = _InfoField(str)
    writer = _InfoField(str)


def validate_record(md: Any, manifest: Manifest | None, sizes: dict[str, int], source: str, *, whole: bool) -> None:
    """Check the structure of a parsed commit record (see the module docstring).

    ``sizes``: the size of every file the step holds that storage entries may name (the
    manifest's, already compared with the disk, or the real sizes for a plain-DCP step).
    ``whole``: the record covers every rank (``.metadata``), so chunks must cover each tensor;
    a per-rank ``__R.metadata`` covers its own rank's chunks only."""
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        ChunkStorageMetadata,
        MetadataIndex,
        StorageMeta,
        TensorStorageMetadata,
    )

    if not isinstance(getattr(md, "storage_meta", None), (StorageMeta, type(None))):
        raise _bad(source, f"the record's storage_meta is {type(md.storage_meta).__name__}, not StorageMeta")
    if not isinstance(getattr(md, "version", None), (str, type(None))):
        raise _bad(source, "the record's version is not a string")
    sdm = getattr(md, "state_dict_metadata", None)
    storage = getattr(md, "storage_data", None)
    if not isinstance(sdm, dict):
        raise _bad(source, "the record has no state table")
    if storage is None:
        storage = {}
    if not isinstance(storage, dict):
        raise _bad(source, "the record's storage table is malformed")
    planner_data = getattr(md, "planner_data", None)
    if planner_data is not None:
        if not isinstance(planner_data, dict) or not all(
                isinstance(k, str) and isinstance(v, (tuple, list)) and v and all(isinstance(p, (str, int)) for p in v)
                for k, v in planner_data.items()):
            raise _bad(source, "the record's key paths (planner_data) are malformed")
    where: dict[tuple[str, tuple | None], Any] = {}
    for idx, info in storage.items():
        if not isinstance(idx, MetadataIndex) or not isinstance(idx.fqn, str):
            raise _bad(source, f"storage key {_r(idx)} is malformed")
        rel = getattr(info, "relative_path", None)
        off, length = getattr(info, "offset", None), getattr(info, "length", None)
        if not isinstance(rel, str) or not _is_int(off) or not _is_int(length) or off < 0 or length < 0:
            raise _bad(source, f"storage entry of {idx.fqn} is malformed ({_r(info)})")
        if rel not in sizes:
            raise _bad(source, f"{idx.fqn} is stored in {_r(rel)}, which is not a file of this step")
        if off + length > sizes[rel]:
            raise _bad(source, f"{idx.fqn} is recorded at bytes {off}..{off + length} of {rel}, "
                               f"which has {sizes[rel]} bytes")
        key = (idx.fqn, None if idx.offset is None else _dims(idx.offset, source, f"offset of {idx.fqn}"))
        where[key] = info
    summary = manifest.tensors if manifest is not None else None
    if summary is not None and not isinstance(summary, dict):
        raise _bad(source, "the manifest's tensor table is malformed")
    for fqn, smd in sdm.items():
        if not isinstance(fqn, str):
            raise _bad(source, f"state key {_r(fqn)} is not a string")
        if isinstance(smd, BytesStorageMetadata):
            if (fqn, None) not in where and (fqn, ()) not in where:
                raise _bad(source, f"item {fqn} has no storage entry")
            continue
        if not isinstance(smd, TensorStorageMetadata):
            raise _bad(source, f"{fqn}: entry of type {type(smd).__name__}")
        dtype = getattr(getattr(smd, "properties", None), "dtype", None)
        if not isinstance(dtype, torch.dtype):
            raise _bad(source, f"{fqn}: dtype {_r(dtype)} is not a torch dtype")
        size = _dims(smd.size, source, f"shape of {fqn}")
        if not isinstance(smd.chunks, list) or not all(isinstance(c, ChunkStorageMetadata) for c in smd.chunks):
            raise _bad(source, f"{fqn}: chunk list is malformed")
        boxes = [(_dims(c.offsets, source, f"{fqn} chunk offsets"), _dims(c.sizes, source, f"{fqn} chunk sizes"))
                 for c in smd.chunks]
        _check_tiling(fqn, size, boxes, whole, source)
        elem = torch._utils._element_size(dtype)
        for off, sz in boxes:
            info = where.get((fqn, off))
            if info is None:
                raise _bad(source, f"{fqn}: chunk at {list(off)} has no storage entry")
            need = _volume(sz) * elem
            raw = info.relative_path.endswith(".safetensors")
            if getattr(info, "transform_descriptors", None):
                continue  # compressed/transformed by a DCP extension: the reader refuses it by name
            if (raw and info.length != need) or info.length < need:
                raise _bad(source, f"{fqn}: chunk at {list(off)} of shape {list(sz)} ({dtype}) needs {need} "
                                   f"bytes, its storage entry records {info.length}")
        if summary is not None:
            want = summary.get(fqn)
            if want != [str(dtype).replace("torch.", ""), list(size)]:
                raise _bad(source, f"{fqn}: the record says {dtype} {list(size)}, the manifest says {_r(want)}")
    if summary is not None and len(summary) != sum(isinstance(v, TensorStorageMetadata) for v in sdm.values()):
        raise _bad(source, "the manifest's tensor table and the record list different tensors")


def tensor_summary(md: Any) -> dict[str, list]:
    """``{fqn: [dtype, shape]}`` of every tensor a record holds: the manifest keeps it beside
    the record so that the two are checked against each other."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    return {fqn: [str(smd.properties.dtype).replace("torch.", ""), list(smd.size)]
            for fqn, smd in md.state_dict_metadata.items() if isinstance(smd, TensorStorageMetadata)}


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off inside the block, back to its previous state after.

    Building or parsing a commit record allocates millions of small objects (a list per checksum
    block, a chunk and a storage entry per tensor per rank), none of them cyclic garbage: each
    automatic collection then walks the whole heap and finds nothing, which made the coordinator's
    record build superlinear in ranks and unpickling 4-7 times slower (docs/scale.md). Collection
    is only delayed; process-wide while the block runs (seconds at 4096 ranks)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def unpickle_record(data: bytes, source: str, unpickler_cls, identity: tuple | None = None) -> Any:
    """Scan (unless the record with this ``identity`` was scanned already), then unpickle
    ``data`` with ``unpickler_cls`` (the allow-list unpickler)."""
    if identity is None or identity not in SCANNED:
        scan_pickle(data, source)
        if identity is not None:
            SCANNED.add(identity)
    try:
        with collector_paused():  # millions of small acyclic objects: collections would find nothing
            return unpickler_cls(io.BytesIO(data), source).load()
    except (UnsafeCheckpointError, CorruptCheckpointError, MemoryError):
        raise  # out of memory says nothing about the record: the scan bounds what parsing it takes
    except (Exception, RecursionError) as e:  # noqa: BLE001 - anything a damaged record raises
        raise CorruptCheckpointError(
            f"{source}: cannot parse the commit record ({type(e).__name__}: {e}); the step is not a "
            f"usable checkpoint. Resume from an older step or delete this directory.") from e

