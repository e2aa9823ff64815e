"""The extra-state codec: ``load`` restores exactly what ``save`` accepted, or ``save`` refuses.

``state["extra_state"]`` (global step, RNG states, data-loader positions, scheduler state, metrics)
is written with ``torch.save`` and read back with ``torch.load(weights_only=True)``, which executes
no code from the file. The rules:

* **Accepted**: ``dict``, ``collections.OrderedDict`` (its attributes too, e.g. ``_metadata``),
  ``list``, ``tuple``, ``set``; ``None``, ``bool``, ``int`` (up to 2039 bits), ``float``,
  ``complex``, ``str``, ``bytes``, ``bytearray``, ``torch.dtype``/``device``/``layout``/``Size``;
  dense leaf tensors (``torch.Tensor``, ``torch.nn.Parameter``, any dtype, 0-dim and empty ones;
  restored on the CPU, without ``.grad``, as ``torch.save`` does); numpy ``ndarray`` and numpy
  scalars of bool, integer, float and complex dtypes (either byte order); instances of the
  caller's own classes named in ``safe_globals``. Keys and set elements: the hashable atoms above (including numpy
  scalars) and tuples of them. At most :data:`MAX_DEPTH` levels of nesting; shared sub-objects
  are fine, cycles are not.
* **Refused at save** (:class:`ExtraStateError`, naming the key path, the type and the fix):
  everything else -- functions and lambdas, other class instances, ``defaultdict``, namedtuples
  and other subclasses of the containers, tensor subclasses (DTensor), meta, sparse, quantized,
  nested and non-leaf tensors, numpy object/structured/string/datetime dtypes, ndarray subclasses
  (``np.matrix``, masked arrays), numpy arrays sharing memory with another array or a tensor of
  the state, tensors viewing one storage as different dtypes, ``frozenset`` and ints of 2040 bits
  or more (the reader cannot load them), nesting deeper than :data:`MAX_DEPTH`, cycles.
* **Exact**: :func:`encode_extra_state` decodes what it wrote and compares: same types (``bool``
  is not ``int``, ``tuple`` is not ``list``, ``OrderedDict`` is not ``dict``, numpy scalar types),
  same keys in the same order, floats and complex numbers bit for bit (NaN payloads, ``-0.0``),
  tensors with the same type, dtype, shape, strides, storage offset, ``requires_grad``,
  conjugate/negative bits and storage bytes, and the same storage sharing (views of one tensor
  stay views of one storage, at the same offsets); numpy arrays with the same dtype (byte order
  included), shape and bytes (they come back contiguous: numpy pickles a copy; numpy's own
  unpickler, e.g. ``torch.load(weights_only=False)``, swaps a non-native array to native order,
  same values). A difference the walk did not predict is still refused, naming where they differ.
* **numpy without code**: numpy pickles arrays through ``_reconstruct`` + ``ndarray.__setstate__``
  and dtypes through ``numpy.dtype`` + ``__setstate__``, whose unchecked state can turn a float
  dtype into an object dtype (raw bytes read as pointers). :func:`extra_safe_globals` maps the
  names numpy 1 and 2 pickle (``numpy.core`` and ``numpy._core``) to checked stand-ins: a dtype
  only of the kinds above, built from a state that only sets the byte order; an array only of
  subtype ``numpy.ndarray`` with exactly its bytes; scalars only of such dtypes. Any other numpy
  name, an object or structured dtype, another subtype or a malformed state is an
  :class:`~refckpt.errors.UnsafeCheckpointError`. ``builtins.bytes`` (how ``b''`` pickles) is
  allowed as ``bytes()`` only. Without numpy, files without numpy load.
"""

from __future__ import annotations

import functools
import importlib
import io
import math
import reprlib
import struct
import sys
import types
from collections import OrderedDict, defaultdict
from collections.abc import Iterable
from typing import Any

import torch

from .errors import CheckpointError, ConfigError, CorruptCheckpointError, UnsafeCheckpointError
from .safeload import safe_torch_load

__all__ = ["ExtraStateError", "MAX_DEPTH", "encode_extra_state", "decode_extra_state", "extra_safe_globals"]

#: Deepest nesting of containers (the extra-state dict itself is level 1) that save accepts.
MAX_DEPTH = 100

_SOURCE = "state['extra_state']"
_FIX = ("Convert it to tensors or plain Python data (dict, list, tuple, str, int, float, bool, None, numpy numeric "
        "arrays), or, for your own trusted class, pass DistributedCheckpointer(safe_globals=[TheClass]).")
_ATOMS = (type(None), bool, int, float, complex, str, bytes, bytearray, torch.dtype, torch.device, torch.layout)
_MAX_INT_BITS = 2039  # the weights-only reader reads LONG1 (up to 255 bytes), not LONG4


class ExtraStateError(ConfigError):
    """``state['extra_state']`` holds something the load could not restore exactly; nothing was written.
    ``path`` is the key path of the offending entry (None when the whole blob failed)."""

    def __init__(self, message: str, path: str | None = None) -> None:
        super().__init__(message)
        self.path = path


class _Refused(Exception):
    """A checked stand-in refused what the file asked for (passes through torch.load untouched)."""


def _tname(x: Any) -> str:
    t = type(x)
    return t.__qualname__ if t.__module__ == "builtins" else f"{t.__module__}.{t.__qualname__}"


_repr = reprlib.Repr()
_repr.maxstring = _repr.maxother = 40


def _at(path: str, key: Any) -> str:
    try:
        return f"{path}[{_repr.repr(key)}]"
    except Exception:  # a key whose repr fails
        return f"{path}[<{_tname(key)}>]"


def _show(x: Any) -> str:
    try:
        return f"{_repr.repr(x)} (type {_tname(x)})"
    except Exception:  # a repr that fails
        return f"a {_tname(x)}"


def _fail(path: str, message: str) -> ExtraStateError:
    return ExtraStateError(f"{path}: {message}", path)


def _dtype_problem(np: Any, d: Any) -> str | None:
    """Why numpy dtype ``d`` cannot round-trip through the checked allow-list; None if it can."""
    if d.kind not in "biufc" or d.hasobject or d.fields is not None or d.subdtype is not None or d.metadata is not None:
        return "it is not a plain bool, integer, float or complex dtype"
    if np.dtype(d.str).type is not d.type:
        return f"numpy pickles numpy.{d.type.__name__} as numpy.{np.dtype(d.str).type.__name__}, so it would come back as that"
    return None


def _refusal(x: Any) -> str:
    """What ``x`` is and why it cannot be extra state (its fix included), for the error message."""
    if isinstance(x, (types.FunctionType, types.BuiltinFunctionType, types.MethodType, functools.partial)):
        return "is a function, which is code (resume never runs code from a checkpoint); store the data it computes"
    if isinstance(x, type):
        return "is a class object; store its name"
    if isinstance(x, defaultdict):
        return "is a collections.defaultdict, whose default_factory is code; store dict(x)"
    if isinstance(x, tuple) and hasattr(type(x), "_fields"):
        return "is a namedtuple, which loads only through its class; store tuple(x) or x._asdict()"
    if type(x) is frozenset:
        return "is a frozenset, which torch's weights-only reader does not load; store set(x) or a sorted tuple"
    for base in (dict, list, tuple, set, frozenset, str, bytes, int, float, complex):
        if isinstance(x, base):
            return f"is a subclass of {base.__name__}, which would not come back as itself; store {base.__name__}(x)"
    return "is an instance of a class, which torch's weights-only reader loads only when trusted"


class _Walk:
    """Checks a structure against the rules before anything is written; collects tensors and arrays."""

    def __init__(self, user_types: frozenset) -> None:
        self.user_types = user_types
        self.np: Any = sys.modules.get("numpy")  # no numpy imported: no numpy object can be in the state
        self.active: set[int] = set()
        self.done: set[int] = set()
        self.tensors: list[tuple[str, torch.Tensor]] = []
        self.arrays: dict[int, tuple[str, Any]] = {}
        self.opaque: list[tuple[str, Any]] = []  # instances of user classes: only the round trip checks them

    def value(self, x: Any, path: str, depth: int) -> None:
        t = type(x)
        if t in _ATOMS:
            if t is int and abs(x).bit_length() > _MAX_INT_BITS:
                raise _fail(path, f"an int of {x.bit_length()} bits is more than torch's weights-only reader reads "
                                  f"({_MAX_INT_BITS}); store str(x).")
            return
        if t in (dict, OrderedDict, list, tuple, set, torch.Size):
            self.container(x, path, depth + 1)
        elif isinstance(x, torch.Tensor):
            self.tensor(x, path, depth)
        elif self.np is not None and isinstance(x, (self.np.ndarray, self.np.generic, self.np.dtype)):
            self.numpy(x, path)
        elif t in self.user_types:
            self.opaque.append((path, x))
        else:
            raise _fail(path, f"{_show(x)} {_refusal(x)}. {_FIX}")

    def container(self, x: Any, path: str, depth: int) -> None:
        if depth > MAX_DEPTH:
            raise _fail(path, f"nested deeper than {MAX_DEPTH} levels, the limit for extra state; flatten it.")
        if id(x) in self.active:
            raise _fail(path, "refers to a container that holds it (a cycle); extra state must be a tree "
                              "(shared sub-objects are fine, cycles are not).")
        if id(x) in self.done:
            return
        self.active.add(id(x))
        if isinstance(x, dict):
            for k, v in x.items():
                self.key(k, path, depth)
                self.value(v, _at(path, k), depth)
            self.attributes(x, path, depth)
        elif isinstance(x, set):
            for e in x:
                self.key(e, path, depth)
        else:
            for i, v in enumerate(x):
                self.value(v, f"{path}[{i}]", depth)
        self.active.discard(id(x))
        self.done.add(id(x))

    def key(self, k: Any, path: str, depth: int) -> None:
        np = self.np
        if type(k) is tuple and depth < MAX_DEPTH:
            for e in k:
                self.key(e, path, depth + 1)
            return
        if (type(k) in _ATOMS and type(k) is not bytearray) or (np is not None and isinstance(k, np.generic)):
            self.value(k, f"{path} (key {_repr.repr(k)})", depth)
            return
        raise _fail(path, f"has a key or set element of type {_tname(k)}; keys and set elements must be None, bool, int, "
                          f"float, complex, str, bytes, torch.dtype/device, numpy numeric scalars or tuples of them.")

    def attributes(self, x: Any, path: str, depth: int) -> None:
        for name, v in getattr(x, "__dict__", {}).items():  # OrderedDict._metadata, attributes set on a tensor
            self.value(v, f"{path}.{name}", depth)

    def tensor(self, x: torch.Tensor, path: str, depth: int) -> None:
        if type(x) not in (torch.Tensor, torch.nn.Parameter):
            problem = (f"is a tensor subclass ({_tname(x)}); only torch.Tensor and torch.nn.Parameter load without code: "
                       f"store a plain tensor (a DTensor: x.full_tensor() or x.to_local())")
        elif x.device.type == "meta":
            problem = "is a tensor on the meta device, which has no data; materialize it first"
        elif x.layout is not torch.strided or x.is_nested:
            problem = f"is a {'nested' if x.is_nested else x.layout} tensor; store x.to_dense() (or its components)"
        elif x.is_quantized:
            problem = "is a quantized tensor; store x.dequantize() and its quantization parameters"
        elif x.grad_fn is not None:
            problem = "is a tensor with autograd history (not a leaf), which would come back without it; store x.detach()"
        else:
            self.tensors.append((path, x))
            self.attributes(x, path, depth)
            return
        raise _fail(path, f"{problem} ({_tname(x)}, {x.dtype}).")

    def numpy(self, x: Any, path: str) -> None:
        np = self.np
        if isinstance(x, np.dtype):
            raise _fail(path, f"is a numpy dtype object ({_tname(x)}); store str(x) and rebuild it with np.dtype(s).")
        if isinstance(x, np.ndarray) and type(x) is not np.ndarray:
            raise _fail(path, f"is a numpy.ndarray subclass ({_tname(x)}), which loads only through code; store "
                              f"np.asarray(x) (a masked array: x.filled() and x.mask).")
        problem = _dtype_problem(np, x.dtype)
        if problem is None and isinstance(x, np.generic) and type(x) is not x.dtype.type:
            problem = f"it is not numpy's scalar type for {x.dtype}"
        if problem is not None:
            kind = "array" if isinstance(x, np.ndarray) else "scalar"
            raise _fail(path, f"is a numpy {kind} of dtype {x.dtype} ({_tname(x)}): {problem}. Only bool, integer, float and "
                              f"complex numpy dtypes load without unpickling code; store x.tolist() or x.astype(such a dtype).")
        if isinstance(x, np.ndarray):
            self.arrays[id(x)] = (path, x)

    def check_memory(self) -> None:
        """Storage sharing that torch.save and numpy's pickle cannot keep: refuse it before writing."""
        spans: list[tuple[str, int, int, str]] = []
        first: dict[int, tuple[str, torch.dtype]] = {}
        for path, t in self.tensors:
            s = t.untyped_storage()
            if s._cdata not in first:
                first[s._cdata] = (path, t.dtype)
                if s.nbytes():
                    spans.append((str(s.device), s.data_ptr(), s.data_ptr() + s.nbytes(), path))
            elif first[s._cdata][1] != t.dtype and s.nbytes():
                other, dtype = first[s._cdata]
                raise _fail(path, f"views the storage of {other} as {t.dtype} where that is {dtype}; torch.save cannot "
                                  f"write one storage as two dtypes: store x.clone().")
        if self.arrays:
            byte_bounds = getattr(self.np.lib, "array_utils", self.np).byte_bounds  # numpy 2, numpy 1
            for path, a in self.arrays.values():
                if a.nbytes:
                    spans.append(("cpu", *byte_bounds(a), path))
        last = None
        for span in sorted(spans):
            if last is not None and span[0] == last[0] and span[1] < last[2]:
                raise _fail(span[3], f"shares memory with {last[3]} but not one torch storage (a numpy view, t.numpy(), "
                                     f"torch.from_numpy): they would come back as independent copies. Store one of them, "
                                     f"or a .copy()/.clone() of the other.")
            if last is None or span[0] != last[0] or span[2] > last[2]:
                last = span


def _bits(x: float) -> bytes:
    return struct.pack("<d", x)


class _Compare:
    """``diff(a, b)``: where ``b`` (what the load gave) differs from ``a`` (what save was given), or None."""

    def __init__(self) -> None:
        self.seen: set[tuple[int, int]] = set()
        self.storage: dict[int, int] = {}
        self.storage_back: dict[int, int] = {}

    def diff(self, a: Any, b: Any, path: str) -> str | None:
        if type(a) is not type(b):
            return f"{path}: {_tname(a)} came back as {_tname(b)}"
        t = type(a)
        if t is float:
            same = _bits(a) == _bits(b)
        elif t is complex:
            same = _bits(a.real) + _bits(a.imag) == _bits(b.real) + _bits(b.imag)
        elif t in _ATOMS:
            same = a == b
        elif (id(a), id(b)) in self.seen:
            return None
        else:
            self.seen.add((id(a), id(b)))
            return self.compound(a, b, path)
        return None if same else f"{path}: {_repr.repr(a)} came back as {_repr.repr(b)}"

    def compound(self, a: Any, b: Any, path: str) -> str | None:
        if isinstance(a, torch.Tensor):
            return self.tensor(a, b, path) or self.diff(a.__dict__, b.__dict__, f"{path}.__dict__")
        np = sys.modules.get("numpy")
        if np is not None and isinstance(a, (np.ndarray, np.generic)):
            if a.dtype.str != b.dtype.str or a.dtype.type is not b.dtype.type or a.shape != b.shape or a.tobytes() != b.tobytes():
                return f"{path}: numpy {a.dtype.str} {a.shape} came back as {b.dtype.str} {b.shape} or with other bytes"
            return None
        if isinstance(a, (set, frozenset)):
            return None if len(a) == len(b) and {_fingerprint(e) for e in a} == {_fingerprint(e) for e in b} else \
                f"{path}: set came back with other elements"
        if isinstance(a, dict):
            ka, kb = list(a), list(b)
            if len(ka) != len(kb):
                return f"{path}: {len(ka)} keys came back as {len(kb)}"
            for i, (x, y) in enumerate(zip(ka, kb)):
                d = self.diff(x, y, f"{path} (key #{i})") or self.diff(a[x], b[y], _at(path, x))
                if d:
                    return d
        elif isinstance(a, (list, tuple)):
            if len(a) != len(b):
                return f"{path}: {len(a)} items came back as {len(b)}"
            for i, (x, y) in enumerate(zip(a, b)):
                d = self.diff(x, y, f"{path}[{i}]")
                if d:
                    return d
        elif not hasattr(a, "__dict__") and not hasattr(type(a), "__slots__"):
            return None if a == b else f"{path}: {_tname(a)} came back unequal"
        slots = getattr(type(a), "__slots__", ())
        for name in (slots,) if isinstance(slots, str) else slots:  # a user class: its attributes decide
            if name in ("__dict__", "__weakref__"):
                continue
            d = self.diff(getattr(a, name, None), getattr(b, name, None), f"{path}.{name}")
            if d:
                return d
        return self.diff(a.__dict__, b.__dict__, f"{path}.__dict__") if hasattr(a, "__dict__") else None

    def tensor(self, a: torch.Tensor, b: torch.Tensor, path: str) -> str | None:
        for what in ("dtype", "shape", "stride", "storage_offset", "requires_grad", "is_conj", "is_neg"):
            x, y = getattr(a, what), getattr(b, what)
            x, y = (x(), y()) if callable(x) else (x, y)
            if x != y:
                return f"{path}: tensor {what} {x} came back as {y}"
        sa, sb = a.untyped_storage(), b.untyped_storage()
        # torch.save writes one storage per StorageImpl (_cdata): views of one tensor share it.
        ka, kb = sa._cdata, sb._cdata
        if self.storage.setdefault(ka, kb) != kb or self.storage_back.setdefault(kb, ka) != ka:
            return f"{path}: tensor storage sharing differs (a view of another tensor came back as a copy, or the reverse)"
        if sa.nbytes() != sb.nbytes() or not torch.equal(_storage_bytes(sa), _storage_bytes(sb)):
            return f"{path}: tensor came back with other bytes"
        return None


def _storage_bytes(s: torch.UntypedStorage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=s.device).set_(s).cpu()


def _fingerprint(x: Any) -> Any:
    """A hashable stand-in for a set element that tells floats apart bit for bit."""
    if type(x) is float:
        return float, _bits(x)
    if type(x) is complex:
        return complex, _bits(x.real), _bits(x.imag)
    if type(x) is tuple:
        return tuple, tuple(_fingerprint(e) for e in x)
    if hasattr(x, "tobytes") and hasattr(x, "dtype"):  # a numpy scalar
        return type(x), x.dtype.str, x.tobytes()
    return type(x), x


def _user_types(safe_globals: Iterable[Any]) -> frozenset:
    return frozenset(c for c in (g[0] if isinstance(g, tuple) else g for g in safe_globals) if isinstance(c, type))


def encode_extra_state(extra: dict, *, source: str = _SOURCE, safe_globals: Iterable[Any] = ()) -> bytes:
    """``torch.save`` bytes of ``extra`` that :func:`decode_extra_state` restores exactly (see the module
    docstring), or :class:`ExtraStateError` naming the key path, its type and the fix."""
    safe_globals = tuple(safe_globals)
    if type(extra) not in (dict, OrderedDict):
        raise _fail(source, f"must be a dict, got {_tname(extra)}.")
    walk = _Walk(_user_types(safe_globals))
    walk.value(extra, source, 0)
    walk.check_memory()
    try:
        data, back = _round_trip(extra, source, safe_globals)
    except MemoryError:
        raise
    except Exception as e:
        raise _unpredicted(walk, safe_globals, f"{source}: cannot be saved and read back ({type(e).__name__}: {e})") from e
    difference = _Compare().diff(extra, back, source)
    if difference:
        raise _unpredicted(walk, safe_globals, difference)
    return data


def _round_trip(obj: Any, source: str, safe_globals: tuple) -> tuple[bytes, Any]:
    buf = io.BytesIO()
    torch.save(obj, buf)
    data = buf.getvalue()
    return data, decode_extra_state(data, source, safe_globals)


def _unpredicted(walk: _Walk, safe_globals: tuple, what: str) -> ExtraStateError:
    """The round trip failed where the walk saw nothing wrong: a trusted class's own pickling. Name which one."""
    for path, obj in walk.opaque:
        try:
            back = _round_trip({"x": obj}, path, safe_globals)[1]
            problem = _Compare().diff(obj, back["x"], path)
        except MemoryError:
            raise
        except Exception as e:
            problem = f"{type(e).__name__}: {e}"
        if problem:
            return _fail(path, f"{_tname(obj)} (trusted through safe_globals) does not come back exactly ({problem}); "
                               f"its pickling needs code or classes not in safe_globals, or drops state. {_FIX}")
    return ExtraStateError(f"{what}: torch.save and the weights-only reader would not restore it exactly. {_FIX}")


# -- decoding -----------------------------------------------------------------------------------

def decode_extra_state(data: bytes, source: str, safe_globals: Iterable[Any] = ()) -> Any:
    """Read an extra-state blob with :func:`~refckpt.safeload.safe_torch_load`, numpy going through the
    checked :func:`extra_safe_globals`. A refused numpy request is an UnsafeCheckpointError naming
    ``source``; bytes that do not parse, a CorruptCheckpointError."""
    allowed = [*extra_safe_globals(), *(g for g in safe_globals if _global_name(g) not in _OWN_NAMES
                                        and not _global_name(g).startswith("numpy.dtypes."))]
    try:
        return _Resolve(source).value(safe_torch_load(data, source, allowed), source, 0)
    except _Refused as e:
        raise _unsafe(source, e) from e
    except CheckpointError as e:
        cause: BaseException | None = e
        while cause is not None and not isinstance(cause, _Refused):
            cause = cause.__cause__ or cause.__context__
        if cause is not None:
            raise _unsafe(source, cause) from e
        raise
    except MemoryError:
        raise
    except Exception as e:  # a crafted file handing the allowed functions arguments they reject
        raise CorruptCheckpointError(f"{source}: cannot read ({type(e).__name__}: {e}).") from e


def _unsafe(source: str, e: BaseException) -> UnsafeCheckpointError:
    return UnsafeCheckpointError(
        f"{source}: refusing to load ({e}). Extra state rebuilds numpy arrays (numpy.ndarray only) and numpy scalars "
        f"of bool, integer, float and complex dtypes, and bytes only as b''; this file asks for something else, "
        f"so it is corrupt or crafted. Do not load it with weights_only=False."
    )


def _global_name(g: Any) -> str:
    if isinstance(g, tuple):
        return str(g[1]) if len(g) == 2 else ""
    return f"{getattr(g, '__module__', '')}.{getattr(g, '__qualname__', '')}"


class _Resolve:
    """Replaces the checked stand-ins the unpickler left in the result by the numpy objects they built."""

    def __init__(self, source: str) -> None:
        self.source = source
        self.memo: dict[int, tuple[Any, Any]] = {}  # id -> (object kept alive, its replacement)

    def value(self, x: Any, path: str, depth: int) -> Any:
        t = type(x)
        if t is _ArrayStandIn:
            return x.built(path)
        if t is _DTypeStandIn:
            raise _Refused(f"{path}: a numpy dtype outside an array or scalar")
        if t in _ATOMS or (t not in (dict, OrderedDict, list, tuple, set) and type(getattr(x, "__dict__", None)) is not dict):
            return x
        if id(x) in self.memo:
            return self.memo[id(x)][1]
        if depth > MAX_DEPTH:
            raise CorruptCheckpointError(f"{self.source}: {path} is nested deeper than {MAX_DEPTH} levels, which refckpt "
                                         f"never writes; the file was not written by refckpt's save.")
        self.memo[id(x)] = (x, x)  # a cycle (crafted: save refuses them) finds the object itself
        if t is tuple:
            new = tuple(self.value(v, f"{path}[{i}]", depth + 1) for i, v in enumerate(x))
            if any(n is not v for n, v in zip(new, x)):
                self.memo[id(x)] = (x, new)
                return new
        elif t is list:
            for i, v in enumerate(x):
                x[i] = self.value(v, f"{path}[{i}]", depth + 1)
        elif t is set:
            for e in x:
                self.key(e, path, depth + 1)
        elif isinstance(x, dict):
            for k, v in list(x.items()):
                self.key(k, path, depth + 1)
                x[k] = self.value(v, _at(path, k), depth + 1)
        attributes = getattr(x, "__dict__", None)
        if type(attributes) is dict:
            for name, v in list(attributes.items()):
                attributes[name] = self.value(v, f"{path}.{name}", depth + 1)
        return x

    def key(self, k: Any, path: str, depth: int) -> None:
        if self.value(k, path, depth) is not k:
            raise _Refused(f"{path}: a numpy array or dtype as a key or set element")


# -- the numpy allow-list -------------------------------------------------------------------------

def _numpy() -> Any:
    import numpy

    return numpy


@functools.lru_cache(maxsize=1)
def _multiarray() -> Any:
    try:
        return importlib.import_module("numpy._core.multiarray")  # numpy >= 2
    except ImportError:
        return importlib.import_module("numpy.core.multiarray")


def _same(a: tuple, b: tuple) -> bool:
    """``a == b`` item by item, types included, without calling ``==`` on anything unexpected."""
    return len(a) == len(b) and all(type(x) is type(y) and x == y for x, y in zip(a, b))


class _NDArrayToken:
    """What the name ``numpy.ndarray`` resolves to: the subtype argument of ``_reconstruct``, never built."""

    def __new__(cls, *args: Any, **kwargs: Any) -> _NDArrayToken:
        raise _Refused("numpy.ndarray called directly; only numpy's _reconstruct may name it")


class _DTypeStandIn:
    """``numpy.dtype(spec, align, copy)``, then BUILD: a numeric dtype whose state may set its byte order only."""

    def __init__(self, dtype: Any) -> None:
        self.dtype = dtype
        self.value: Any = None

    def __repr__(self) -> str:
        return f"numpy.dtype({self.dtype.str!r})"

    def __setstate__(self, state: Any) -> None:
        if (self.value is not None or type(state) is not tuple or len(state) != 8 or type(state[1]) is not str
                or state[1] not in ("<", ">", "|", "=") or not _same(state, (3, state[1], None, None, None, -1, -1, 0))):
            raise _Refused(f"numpy dtype {self.dtype} with state {_repr.repr(state)}; only a byte order may be set")
        self.value = self.dtype.newbyteorder(state[1])

    def built(self, what: str) -> Any:
        if self.value is None:
            raise _Refused(f"{what} with a numpy dtype that was never built")
        return self.value


def _np_dtype(*args: Any) -> _DTypeStandIn:
    np = _numpy()
    if len(args) != 3 or type(args[0]) is not str or len(args[0]) > 8 or args[1] is not False or type(args[2]) is not bool:
        raise _Refused(f"numpy.dtype{_repr.repr(args)}")
    try:
        dtype = np.dtype(args[0])
    except (TypeError, ValueError) as e:
        raise _Refused(f"numpy.dtype({args[0]!r})") from e
    problem = _dtype_problem(np, dtype)
    if problem:
        raise _Refused(f"numpy.dtype({args[0]!r}): {problem}")
    return _DTypeStandIn(dtype)


class _ArrayStandIn:
    """``_reconstruct(numpy.ndarray, (0,), b'b')``, then BUILD: an array of a checked dtype and exactly its bytes."""

    def __init__(self) -> None:
        self.value: Any = None

    def __setstate__(self, state: Any) -> None:
        if self.value is not None or type(state) is not tuple or len(state) != 5:
            raise _Refused(f"numpy array state {_repr.repr(state)}")
        version, shape, dtype, fortran, raw = state
        if (not _same((version,), (1,)) or type(shape) is not tuple or len(shape) > 64
                or any(type(n) is not int or not 0 <= n < 2**62 for n in shape)
                or type(dtype) is not _DTypeStandIn or type(fortran) is not bool or type(raw) is not bytes):
            raise _Refused(f"numpy array state {_repr.repr(state)}")
        dtype = dtype.built("a numpy array")
        if len(raw) != math.prod(shape) * dtype.itemsize:
            raise _Refused(f"numpy array of shape {shape} and dtype {dtype} with {len(raw)} bytes")
        # Not ndarray.__setstate__: it swaps a non-native array to native order; this keeps the dtype it names.
        order = "F" if fortran else "C"
        self.value = _numpy().frombuffer(raw, dtype=dtype).reshape(shape, order=order).copy(order=order)

    def built(self, path: str) -> Any:
        if self.value is None:
            raise _Refused(f"{path}: a numpy array that was never built")
        return self.value


def _np_reconstruct(subtype: Any, shape: Any, code: Any) -> _ArrayStandIn:
    if subtype is not _NDArrayToken:
        raise _Refused(f"numpy _reconstruct of subtype {_repr.repr(subtype)}; only numpy.ndarray loads")
    if not _same((shape, code), ((0,), b"b")) or not _same(shape, (0,)):
        raise _Refused(f"numpy _reconstruct with {_repr.repr(shape)}, {_repr.repr(code)}")
    return _ArrayStandIn()


def _np_scalar(dtype: Any, data: Any = None) -> Any:
    if type(dtype) is not _DTypeStandIn:
        raise _Refused(f"numpy scalar of {_repr.repr(dtype)}")
    real = dtype.built("a numpy scalar")
    if type(data) is not bytes or len(data) != real.itemsize:
        raise _Refused(f"numpy scalar of dtype {real} from {_repr.repr(data)}")
    return _multiarray().scalar(real, data)


_NUMPY_GLOBALS: tuple[tuple[Any, str], ...] = (
    *((f, f"{m}.{n}") for m in ("numpy.core.multiarray", "numpy._core.multiarray")
      for f, n in ((_np_reconstruct, "_reconstruct"), (_np_scalar, "scalar"))),
    (_NDArrayToken, "numpy.ndarray"),
    (_np_dtype, "numpy.dtype"),
    # BUILD applies __setstate__ only to instances of allow-listed types: the stand-ins are listed
    # under names no pickle can spell (GLOBAL reads module and name up to a newline), so a file
    # gets them only from the functions above.
    (_DTypeStandIn, "refckpt.extra\n_DTypeStandIn"),
    (_ArrayStandIn, "refckpt.extra\n_ArrayStandIn"),
)


def _empty_bytes(*args: Any) -> bytes:
    """``bytes()``: how protocol 2 pickles ``b''`` (an empty numpy array's data too); nothing else."""
    if args:
        raise _Refused(f"bytes{_repr.repr(args)}; only bytes() loads")
    return b""


_OWN_NAMES = frozenset(name for _f, name in _NUMPY_GLOBALS) | {"builtins.bytes"}


def extra_safe_globals() -> list[tuple[Any, str]]:
    """The checked ``(callable, "module.name")`` pairs :func:`decode_extra_state` adds to the weights-only
    reader (``torch.serialization.safe_globals`` takes them): ``bytes()`` for ``b''``, and numpy's
    array, dtype and scalar reconstruction (left out without numpy)."""
    try:
        _numpy()
    except ImportError:
        return [(_empty_bytes, "builtins.bytes")]
    return [(_empty_bytes, "builtins.bytes"), *_NUMPY_GLOBALS]
