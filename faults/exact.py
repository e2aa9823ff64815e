"""Exact comparison of restored state, written for the suite and independent of any checkpointer.

"Exact" is what a resumed job needs to continue as if nothing happened: the same types (an int key
is not a str key, a tuple is not a list, ``True`` is not ``1``, an ``OrderedDict`` is not a
``dict``), the same keys in the same order, empty containers kept, floats and complex numbers bit
for bit (NaN payloads and ``-0.0`` included), tensors with the same dtype, shape, ``requires_grad``
and bytes, numpy arrays and scalars with the same dtype, shape and values (byte order aside: numpy's own
unpickling makes a big-endian array native), and
tensors that were views of one another still views of one another (the same storage sharing, at
the same offsets and strides).

:func:`first_difference` returns a description of the first difference (a path such as
``['sched'][3]``, and what differs), or None."""

from __future__ import annotations

import struct
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["first_difference", "flatten", "tensors_of"]


def _path(path: str, key: Any) -> str:
    return f"{path}[{key!r}]"


def _float_bits(x: float) -> bytes:
    return struct.pack("<d", x)


def _np():
    try:
        import numpy
    except ImportError:  # pragma: no cover - numpy comes with torch's object collectives
        return None
    return numpy


def first_difference(want: Any, got: Any, path: str = "") -> str | None:
    """The first way ``got`` differs from ``want`` (see the module docstring), or None."""
    out = _values(want, got, path)
    if out is not None:
        return out
    return _views(want, got)


def _values(want: Any, got: Any, path: str) -> str | None:  # noqa: C901 - one case per kind of value
    if type(want) is not type(got):
        return f"{path or 'value'}: {type(want).__name__} saved, {type(got).__name__} restored"
    np = _np()
    if isinstance(want, torch.Tensor):
        return _tensor(want, got, path)
    if np is not None and isinstance(want, np.ndarray):
        # numpy's own unpickling returns a big-endian array in native byte order: the same values,
        # which is what a resumed job needs, so byte order alone is not a difference
        a, b = _native(want), _native(got)
        if a.dtype != b.dtype or a.shape != b.shape:
            return f"{path}: array {want.dtype} {want.shape} saved, {got.dtype} {got.shape} restored"
        if a.dtype.hasobject:
            return _values(a.tolist(), b.tolist(), path)
        if a.tobytes() != b.tobytes():
            return f"{path}: array bytes differ"
        return None
    if np is not None and isinstance(want, np.generic):
        if want.dtype != got.dtype or want.tobytes() != got.tobytes():
            return f"{path}: numpy scalar {want!r} saved, {got!r} restored"
        return None
    if isinstance(want, dict):
        if list(want) != list(got):
            return f"{path or 'dict'}: keys {list(want)!r} saved, {list(got)!r} restored"
        for (k1, v1), (k2, v2) in zip(want.items(), got.items()):
            if type(k1) is not type(k2):
                return f"{_path(path, k1)}: key of type {type(k1).__name__} restored as {type(k2).__name__}"
            d = _values(v1, v2, _path(path, k1))
            if d is not None:
                return d
        return None
    if isinstance(want, (list, tuple)):
        if len(want) != len(got):
            return f"{path or 'sequence'}: {len(want)} items saved, {len(got)} restored"
        for i, (a, b) in enumerate(zip(want, got)):
            d = _values(a, b, _path(path, i))
            if d is not None:
                return d
        return None
    if isinstance(want, (set, frozenset)):
        return None if want == got else f"{path}: set {want!r} saved, {got!r} restored"
    if isinstance(want, float):
        return None if _float_bits(want) == _float_bits(got) else f"{path}: {want!r} saved, {got!r} restored"
    if isinstance(want, complex):
        same = _float_bits(want.real) == _float_bits(got.real) and _float_bits(want.imag) == _float_bits(got.imag)
        return None if same else f"{path}: {want!r} saved, {got!r} restored"
    try:
        equal = bool(want == got)
    except Exception:  # noqa: BLE001 - a value that cannot even compare itself
        equal = repr(want) == repr(got)
    return None if equal else f"{path}: {want!r} saved, {got!r} restored"


def _native(a: Any) -> Any:
    native = a.dtype.newbyteorder("=") if a.dtype.byteorder not in ("=", "|") else a.dtype
    return a.astype(native) if native != a.dtype else a


def _tensor(want: torch.Tensor, got: torch.Tensor, path: str) -> str | None:
    if want.dtype != got.dtype or tuple(want.shape) != tuple(got.shape):
        return f"{path}: tensor {want.dtype} {tuple(want.shape)} saved, {got.dtype} {tuple(got.shape)} restored"
    if want.requires_grad != got.requires_grad:
        return f"{path}: requires_grad {want.requires_grad} saved, {got.requires_grad} restored"
    if want.device.type == "meta" or got.device.type == "meta":
        return None if want.device == got.device else f"{path}: device {want.device} saved, {got.device} restored"
    a = _bits(want)
    b = _bits(got)
    if not torch.equal(a, b):
        return f"{path}: tensor bytes differ"
    return None


def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    if hasattr(t, "full_tensor"):
        t = t.full_tensor()
    t = t.to("cpu").contiguous().reshape(-1)
    if t.numel() == 0:
        return torch.empty(0, dtype=torch.uint8)
    return t.view(torch.uint8)


def tensors_of(obj: Any, path: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor in ``obj``'s dicts, lists and tuples, with its path, in traversal order."""
    if isinstance(obj, torch.Tensor):
        yield path, obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from tensors_of(v, _path(path, k))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from tensors_of(v, _path(path, i))


def _views(want: Any, got: Any) -> str | None:
    """Tensors that shared storage when saved share it when restored, at the same offsets, and
    tensors that did not, do not."""
    a = list(tensors_of(want))
    b = list(tensors_of(got))
    if len(a) != len(b):  # pragma: no cover - _values compared the structure already
        return "the restored value holds another number of tensors"
    storage_map: dict[int, int] = {}
    reverse: dict[int, int] = {}
    for (p, x), (_q, y) in zip(a, b):
        if x.device.type == "meta" or x.numel() == 0:
            continue
        sx, sy = _storage(x), _storage(y)
        if sx in storage_map or sy in reverse:
            if storage_map.get(sx) != sy or reverse.get(sy) != sx:
                return (f"{p}: was a view of another saved tensor (shared storage) and is not one restored, "
                        f"or the other way round")
            if x.storage_offset() != y.storage_offset() or x.stride() != y.stride():
                return f"{p}: a view restored at another offset or stride of its storage"
        storage_map[sx], reverse[sy] = sy, sx
    return None


def _storage(t: torch.Tensor) -> int:
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # pragma: no cover - tensors without storage
        return id(t)


def flatten(obj: Any, path: str = "") -> dict[str, Any]:
    """``{path: leaf}`` of a state tree's dicts and lists (tuples and other values are leaves)."""
    out: dict[str, Any] = {}
    if isinstance(obj, dict):
        for k, v in obj.items():
            out.update(flatten(v, _path(path, k)))
    elif isinstance(obj, list):
        if not obj:
            out[path] = []
        for i, v in enumerate(obj):
            out.update(flatten(v, _path(path, i)))
    else:
        out[path] = obj
    return out

