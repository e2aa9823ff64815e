"""refckpt.extra: whatever encode_extra_state accepts, decode_extra_state restores exactly; whatever it
cannot restore, encode refuses (naming the key and the fix); numpy loads through a checked allow-list only.

Exactness is judged here by ``assert_same``, written independently of the module's own comparator.
Crafted files are written as torch.save zips whose pickle is built by hand (``_wrap``) or by objects
whose ``__reduce__`` names numpy's real functions with hostile arguments.
"""

from __future__ import annotations

import collections
import importlib
import io
import pickle
import random
import struct
import sys
import types
import warnings

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from refckpt import extra as X
from refckpt.errors import CallerError, ConfigError, CorruptCheckpointError, UnsafeCheckpointError
from refckpt.extra import MAX_DEPTH, ExtraStateError, decode_extra_state, encode_extra_state

try:
    MULTIARRAY = importlib.import_module("numpy._core.multiarray")  # numpy 2
except ImportError:
    MULTIARRAY = importlib.import_module("numpy.core.multiarray")
SRC = "state['extra_state']"


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Detected pickle protocol")
        warnings.filterwarnings("ignore", message="the matrix subclass", category=PendingDeprecationWarning)
        yield


# -- an independent judge of exactness ------------------------------------------------------------

def _pack(x: float) -> bytes:
    return struct.pack(">d", x)


class Same:
    """``Same()(a, b)`` raises AssertionError at the first difference; tensors' storage sharing is
    judged by storage data pointers (the module uses StorageImpl identity)."""

    def __init__(self, numpy_native: bool = False) -> None:
        self.ptrs: dict[int, int] = {}
        self.ptrs_back: dict[int, int] = {}
        self.numpy_native = numpy_native  # numpy's own unpickler swaps arrays to native byte order

    def __call__(self, a, b, path="x"):
        assert type(a) is type(b), f"{path}: {type(a)} vs {type(b)}"
        if isinstance(a, float):
            assert _pack(a) == _pack(b), f"{path}: {a!r} vs {b!r}"
        elif isinstance(a, complex):
            assert (_pack(a.real), _pack(a.imag)) == (_pack(b.real), _pack(b.imag)), path
        elif isinstance(a, torch.Tensor):
            self.tensor(a, b, path)
        elif isinstance(a, np.ndarray):
            if self.numpy_native and not a.dtype.isnative:
                a = a.astype(a.dtype.newbyteorder("="))
            assert (a.dtype.str, a.dtype.char, a.shape) == (b.dtype.str, b.dtype.char, b.shape), path
            assert a.tobytes() == b.tobytes(), path
        elif isinstance(a, np.generic):
            assert a.dtype.str == b.dtype.str and a.tobytes() == b.tobytes(), path
        elif isinstance(a, dict):
            assert len(a) == len(b), path
            for (ka, va), (kb, vb) in zip(a.items(), b.items()):
                self(ka, kb, f"{path} key {ka!r}")
                self(va, vb, f"{path}[{ka!r}]")
            if isinstance(a, collections.OrderedDict):
                self(dict(vars(a)), dict(vars(b)), f"{path}.__dict__")
        elif isinstance(a, (list, tuple)):
            assert len(a) == len(b), path
            for i, (u, v) in enumerate(zip(a, b)):
                self(u, v, f"{path}[{i}]")
        elif isinstance(a, set):
            def canon(s):
                return sorted((type(e).__name__, _pack(e) if isinstance(e, float) else repr(e)) for e in s)
            assert canon(a) == canon(b), path
        else:
            assert a == b, f"{path}: {a!r} vs {b!r}"

    def tensor(self, a, b, path):
        for f in (lambda t: t.dtype, lambda t: tuple(t.shape), lambda t: t.stride(), lambda t: t.storage_offset(),
                  lambda t: t.requires_grad, lambda t: t.is_conj(), lambda t: t.is_neg(), type):
            assert f(a) == f(b), f"{path}: {f(a)} vs {f(b)}"
        sa, sb = a.untyped_storage(), b.untyped_storage()
        assert sa.nbytes() == sb.nbytes() and sa.tolist() == sb.tolist(), f"{path}: storage bytes differ"
        if sa.nbytes():
            pa, pb = sa.data_ptr(), sb.data_ptr()
            assert self.ptrs.setdefault(pa, pb) == pb, f"{path}: a view came back as a copy"
            assert self.ptrs_back.setdefault(pb, pa) == pa, f"{path}: copies came back as views"


def assert_same(a, b, numpy_native=False):
    Same(numpy_native)(a, b)


def roundtrip(state, **kw):
    data = encode_extra_state(state, **kw)
    return data, decode_extra_state(data, "test", kw.get("safe_globals", ()))


def test_the_judge_can_fail():
    nan1 = struct.unpack(">d", bytes.fromhex("7ff8000000000001"))[0]
    nan2 = struct.unpack(">d", bytes.fromhex("7ff8000000000002"))[0]
    base = torch.arange(4.0)
    for a, b in [(0.0, -0.0), (nan1, nan2), (1, True), ((1,), [1]), ({"a": 1, "b": 2}, {"b": 2, "a": 1}),
                 ({"a": 1}, collections.OrderedDict(a=1)), (np.float32(1), np.float64(1)),
                 (np.arange(3, dtype="<i4"), np.arange(3, dtype=">i4")), (torch.ones(2), torch.ones(2, dtype=torch.float64)),
                 (torch.zeros(()), torch.zeros(1)), ([base, base[1:]], [base.clone(), base.clone()[1:]]),
                 ([base.clone(), base.clone()], [base, base]), (np.longlong(1), np.int64(1)),
                 (torch.ones(1, requires_grad=True), torch.ones(1)), (base.view(2, 2).t(), base.view(2, 2).t().contiguous())]:
        with pytest.raises(AssertionError):
            assert_same(a, b)


# -- the property -----------------------------------------------------------------------------------

_NAN_PAYLOAD = st.integers(1, 2**51 - 1).flatmap(lambda m: st.sampled_from([0, 1]).map(
    lambda sign: struct.unpack(">d", struct.pack(">Q", (sign << 63) | (0x7FF << 52) | m))[0]))
KEYS = st.one_of(st.integers(-3, 2**70), st.text(max_size=4), st.booleans(), st.none(),
                 st.floats(allow_nan=True), st.tuples(st.integers(0, 3), st.text(max_size=2)))
TORCH_DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.complex64, torch.complex128,
                torch.bool, torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64]
NP_DTYPES = ["?", "i1", "u1", "<i2", ">i2", "<i4", ">i4", "<i8", ">u8", "<f2", ">f4", "<f8", ">f8", "<c8", ">c16"]


@st.composite
def tensors(draw):
    dtype = draw(st.sampled_from(TORCH_DTYPES))
    shape = draw(st.lists(st.integers(0, 3), max_size=3))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    if dtype.is_complex:
        t = torch.randn(shape, dtype=dtype, generator=g)
    else:
        t = (torch.randn(shape, generator=g) * 50).to(dtype)
    if dtype.is_floating_point and draw(st.booleans()):
        t.requires_grad_(True)
    return t


@st.composite
def views(draw):
    """A base tensor and views of it (slices, strides, reshapes, transposes, conj), in one list."""
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16, torch.complex64, torch.int8]))
    base = (torch.arange(24) * 3).to(dtype) if not dtype.is_complex else torch.arange(24).to(dtype) * (1 + 2j)
    makers = [lambda b: b[3:9], lambda b: b[::5], lambda b: b.view(4, 6).t(), lambda b: b.view(2, 3, 4)[1],
              lambda b: b[5], lambda b: b[7:7], lambda b: b.view(6, 4)[:, 1:3]]
    chosen = draw(st.lists(st.sampled_from(range(len(makers))), min_size=1, max_size=4))
    out = [base] + [makers[i](base) for i in chosen]
    if dtype.is_complex and draw(st.booleans()):
        out.append(base.conj())
    return draw(st.permutations(out))


def rng_states():
    return st.sampled_from([
        lambda s: np.random.get_state(), lambda s: np.random.default_rng(s).bit_generator.state,
        lambda s: np.random.MT19937(s).state, lambda s: torch.Generator().manual_seed(s).get_state(),
        lambda s: torch.get_rng_state(), lambda s: random.Random(s).getstate(),
    ]).flatmap(lambda f: st.integers(0, 2**32 - 1).map(f))


class Opaque:  # a class nobody trusted
    pass


BAD = st.sampled_from([
    lambda: (lambda: 1), lambda: collections.defaultdict(int), lambda: collections.namedtuple("P", "x")(1),
    lambda: np.array([1, None], dtype=object), lambda: np.matrix([[1.0]]), lambda: np.ma.masked_array([1, 2]),
    lambda: torch.empty(2, device="meta"), lambda: Opaque(), lambda: frozenset({1}), lambda: collections.Counter(a=1),
    lambda: np.zeros(2, dtype=[("a", "f4")]), lambda: np.array(["s"]), lambda: torch.ones(2).as_subclass(_MyTensor),
]).map(lambda make: _Bad(make()))


class _MyTensor(torch.Tensor):
    pass


class _Bad:
    """Marks a leaf encode must refuse (unwrapped by ``unwrap``)."""

    def __init__(self, value):
        self.value = value


LEAVES = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**80), 2**80), st.floats(allow_nan=True, allow_infinity=True), _NAN_PAYLOAD,
    st.complex_numbers(allow_nan=True), st.text(max_size=6), st.binary(max_size=6), st.binary(max_size=3).map(bytearray),
    st.frozensets(st.integers(0, 5) | st.text(max_size=2), max_size=3).map(set),
    tensors(), views(), rng_states(), st.sampled_from([torch.float16, torch.device("cpu"), torch.Size([2, 0])]),
    st.sampled_from(NP_DTYPES).flatmap(lambda d: hnp.arrays(np.dtype(d), hnp.array_shapes(min_dims=0, max_dims=3,
                                                                                           min_side=0, max_side=3))),
    st.sampled_from(NP_DTYPES).flatmap(lambda d: hnp.from_dtype(np.dtype(d).newbyteorder("="))).map(
        lambda v: v if isinstance(v, np.generic) else np.asarray(v)[()]),
    st.just(0).map(lambda _: []), st.just(0).map(lambda _: {}), st.just(()),
)


def containers(children):
    return st.one_of(st.lists(children, max_size=3), st.lists(children, max_size=3).map(tuple),
                     st.dictionaries(KEYS, children, max_size=3),
                     st.dictionaries(KEYS, children, max_size=3).map(collections.OrderedDict))


def unwrap(x):
    """(x without _Bad markers, whether it held one); containers are rebuilt, tensors and arrays kept."""
    if isinstance(x, _Bad):
        return x.value, True
    if type(x) in (list, tuple):
        parts = [unwrap(v) for v in x]
        return type(x)(v for v, _ in parts), any(b for _, b in parts)
    if type(x) in (dict, collections.OrderedDict):
        parts = {k: unwrap(v) for k, v in x.items()}
        return type(x)((k, v) for k, (v, _) in parts.items()), any(b for _, b in parts.values())
    return x, False


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(st.dictionaries(KEYS, st.recursive(st.one_of(LEAVES, BAD), containers, max_leaves=12), max_size=5))
def test_encode_decode_is_exact_or_refused(drawn):
    state, bad = unwrap(drawn)
    event("refused" if bad else "round trip")
    if bad:
        with pytest.raises(ExtraStateError) as e:
            encode_extra_state(state)
        assert e.value.path and e.value.path.startswith(SRC)
        return
    data, back = roundtrip(state)
    assert_same(state, back)
    # the blob stays a plain torch.save file: torch.load without the allow-list reads the same object
    assert_same(state, torch.load(io.BytesIO(data), weights_only=False), numpy_native=True)


# -- pinned: what round-trips ---------------------------------------------------------------------

def rich_state():
    base = torch.arange(12, dtype=torch.float32)
    od = collections.OrderedDict(w=torch.ones(2))
    od._metadata = {"": {"version": 1}}
    return {
        "global_step": 7, "numpy_rng": np.random.get_state(), "pcg": np.random.default_rng(3).bit_generator.state,
        "torch_rng": torch.get_rng_state(), "python_rng": random.getstate(),
        "views": (base, base[2:5], base.view(3, 4).t(), base[4]), 1: "int key", (2, "t"): None, None: -0.0, False: b"",
        2.5: float("nan"), "empty": ({}, [], (), set(), bytearray()), "bf16": torch.tensor([1.5, -0.0], dtype=torch.bfloat16),
        "c": torch.tensor([1 + 2j], dtype=torch.complex64).conj(), "b": torch.tensor(True), "n0": torch.empty(0, 3),
        "p": torch.nn.Parameter(torch.ones(2), requires_grad=False), "g": torch.ones(1, requires_grad=True),
        "be": np.arange(4, dtype=">f8"), "f": np.asfortranarray(np.arange(6, dtype="<i2").reshape(2, 3)),
        "np0": np.array(3.5), "npe": np.zeros((0, 2), dtype=np.uint8), "s": (np.float32(1.5), np.bool_(True), np.int8(-3)),
        np.int64(5): "numpy scalar key", "od": od, "size": torch.Size([2, 3]), "dt": (torch.bfloat16, torch.device("cpu")),
        "big": 2**2000, "set": {1, "a", 2.5},
    }


def test_rich_state_round_trips_exactly_and_reads_with_plain_torch_load():
    state = rich_state()
    data, back = roundtrip(state)
    assert_same(state, back)
    assert_same(state, torch.load(io.BytesIO(data), weights_only=False), numpy_native=True)
    # views stay views: writing through the base shows in the views
    v = back["views"]
    v[0][3] = 100.0
    assert v[1][1].item() == 100.0 and v[2][3, 0].item() == 100.0
    assert v[0].untyped_storage().data_ptr() == v[3].untyped_storage().data_ptr()
    assert back["be"].dtype.str == ">f8" and back["f"].flags.f_contiguous


def test_numpy_rng_state_was_the_reported_defect_and_now_restores():
    state = {"rng": np.random.get_state()}
    data = encode_extra_state(state)
    with pytest.raises(pickle.UnpicklingError):  # torch's reader alone refuses numpy's reconstruction
        torch.load(io.BytesIO(data), weights_only=True)
    back = decode_extra_state(data, "test")
    assert_same(state, back)
    np.random.set_state(back["rng"])


def test_shared_numpy_array_stays_one_object():
    a = np.arange(3)
    back = roundtrip({"x": [a, a], "y": (a,)})[1]
    assert back["x"][0] is back["x"][1] is back["y"][0]


def test_depth_limit_is_exact():
    def nest(levels):  # the extra-state dict is level 1
        d = inner = {}
        for _ in range(levels - 1):
            inner["k"] = {}
            inner = inner["k"]
        return d
    roundtrip(nest(MAX_DEPTH))
    with pytest.raises(ExtraStateError, match=f"deeper than {MAX_DEPTH}") as e:
        encode_extra_state(nest(MAX_DEPTH + 1))
    assert e.value.path == SRC + "['k']" * MAX_DEPTH


class Trusted:
    def __init__(self):
        self.a, self.b = 1, [np.float64(2.0), np.arange(2)]

    def __eq__(self, other):
        return type(other) is Trusted and self.a == other.a


class Lossy:
    def __init__(self):
        self.a, self.b = 1, 2

    def __getstate__(self):
        return {"a": self.a}


def test_trusted_classes_round_trip_and_lossy_ones_are_named():
    state = {"obj": Trusted()}
    with pytest.raises(ExtraStateError, match=r"safe_globals=\[TheClass\]") as e:
        encode_extra_state(state)
    assert e.value.path == SRC + "['obj']" and "Trusted" in str(e.value)
    back = roundtrip(state, safe_globals=[Trusted])[1]["obj"]
    assert type(back) is Trusted and type(back.b[1]) is np.ndarray and back.b[1].tolist() == [0, 1]
    with pytest.raises(ExtraStateError, match="does not come back exactly") as e:
        encode_extra_state({"deep": [{"o": Lossy()}]}, safe_globals=[Lossy])
    assert e.value.path == SRC + "['deep'][0]['o']"


# -- pinned: what is refused at save ----------------------------------------------------------------

def _cycle_list():
    x = [1]
    x.append(x)
    return x


def _cycle_dict():
    d = {}
    d["me"] = {"up": d}
    return d


def _def():
    return 1


def _numpy_view():
    a = np.arange(4.0)
    return [a, a[1:]]


def _tensor_numpy():
    t = torch.arange(4.0)
    return [t, t.numpy()]


def _dtype_views():
    t = torch.arange(4.0)
    return [t, t.view(torch.int32)]


REFUSED = {
    "lambda": (lambda: (lambda x: x), "", "function"),
    "function": (lambda: _def, "", "function"),
    "instance": (lambda: Opaque(), "", "safe_globals=[TheClass]"),
    "defaultdict": (lambda: collections.defaultdict(list), "", "dict(x)"),
    "namedtuple": (lambda: collections.namedtuple("Pt", "x y")(1, 2), "", "_asdict()"),
    "counter": (lambda: collections.Counter("ab"), "", "dict(x)"),
    "list subclass": (lambda: type("L", (list,), {})([1]), "", "list(x)"),
    "tuple subclass": (lambda: type("T", (tuple,), {})((1,)), "", "tuple(x)"),
    "frozenset": (lambda: frozenset({1}), "", "set(x)"),
    "int enum": (lambda: __import__("enum").IntEnum("E", "A").A, "", "int(x)"),
    "tensor subclass": (lambda: torch.ones(2).as_subclass(_MyTensor), "", "full_tensor()"),
    "meta tensor": (lambda: torch.empty(3, device="meta"), "", "materialize"),
    "sparse tensor": (lambda: torch.eye(2).to_sparse(), "", "to_dense()"),
    "non-leaf tensor": (lambda: torch.ones(2, requires_grad=True) * 2, "", "detach()"),
    "object array": (lambda: np.array([1, "a"], dtype=object), "", "tolist()"),
    "structured array": (lambda: np.zeros(2, dtype=[("a", "<f4"), ("b", "<i8")]), "", "tolist()"),
    "string array": (lambda: np.array(["a"]), "", "tolist()"),
    "datetime array": (lambda: np.array(["2020-01-01"], dtype="M8[D]"), "", "tolist()"),
    "longlong array": (lambda: np.array([1], dtype=np.longlong), "", "numpy.longlong as numpy.int64"),
    "np.matrix": (lambda: np.matrix([[1.0]]), "", "np.asarray(x)"),
    "masked array": (lambda: np.ma.masked_array([1.0], mask=[True]), "", "x.mask"),
    "numpy dtype": (lambda: np.dtype("f4"), "", "np.dtype(s)"),
    "numpy str scalar": (lambda: np.str_("a"), "", "tolist()"),
    "huge int": (lambda: 2**2040, "", "str(x)"),
    "tensor key": (lambda: {torch.ones(1): 1}, "", "keys and set elements"),
    "cycle list": (_cycle_list, "[1]", "cycle"),
    "cycle dict": (_cycle_dict, "['me']['up']", "cycle"),
    "numpy views": (_numpy_view, "[1]", "independent copies"),
    "tensor.numpy()": (_tensor_numpy, "[1]", "independent copies"),
    "dtype views": (_dtype_views, "[1]", "x.clone()"),
}


@pytest.mark.parametrize("name", list(REFUSED))
def test_refused_at_save_naming_key_type_and_fix(name):
    make, tail, fix = REFUSED[name]
    value = make()
    state = {"sched": {"bad": value}, "global_step": 1}
    with pytest.raises(ExtraStateError) as e:
        encode_extra_state(state)
    where = SRC + "['sched']['bad']" + tail
    msg = str(e.value)
    assert msg.startswith(where + ":") and e.value.path == where, msg
    assert fix in msg, msg
    assert isinstance(e.value, (ConfigError, CallerError, ValueError))
    if name not in ("cycle list", "cycle dict", "numpy views", "tensor.numpy()", "dtype views", "huge int", "tensor key"):
        inner = value if not isinstance(value, set) else next(iter(value))
        assert type(inner).__name__ in msg, msg  # the type is named


def test_dtensor_is_refused():
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor

    owned = not dist.is_initialized()
    if owned:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        dt = distribute_tensor(torch.ones(4), init_device_mesh("cpu", (1,)), [Replicate()])
        with pytest.raises(ExtraStateError, match=r"tensor subclass \(torch.distributed.tensor.*full_tensor\(\)") as e:
            encode_extra_state({"m": {"dt": dt}})
        assert e.value.path == SRC + "['m']['dt']"
    finally:
        if owned:
            dist.destroy_process_group()


def test_top_level_must_be_a_dict():
    with pytest.raises(ExtraStateError, match="must be a dict"):
        encode_extra_state([1])  # type: ignore[arg-type]


# -- crafted files: numpy requests beyond the allow-list are UnsafeCheckpointError --------------

class _RawPickler:
    def __init__(self, f, protocol=2):
        self.f = f

    def dump(self, obj):
        self.f.write(obj)


_RAW = types.ModuleType("rawpickle")
_RAW.Pickler = _RawPickler  # type: ignore[attr-defined]


def _wrap(pickle_bytes: bytes) -> bytes:
    """A torch.save zip whose data.pkl is exactly ``pickle_bytes``."""
    buf = io.BytesIO()
    torch.save(pickle_bytes, buf, pickle_module=_RAW)
    return buf.getvalue()


def _save(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


class Reduce:
    """Pickles as ``fn(*args)`` (then BUILD ``state`` when given): what a crafted file can ask for."""

    def __init__(self, fn, args, *state):
        self.r = (fn, args, *state)

    def __reduce__(self):
        return self.r


def _evil_dtype(state):
    return Reduce(np.dtype, ("f8", False, True), state)


OBJECT_FLAGS = (3, "|", None, None, None, -1, -1, 63)
CRAFTED = {
    "object array": lambda: np.array([1, None], dtype=object),
    "structured array": lambda: np.zeros(1, dtype=[("a", "<f4")]),
    "datetime array": lambda: np.zeros(1, dtype="M8[s]"),
    "subtype torch.Tensor": lambda: Reduce(MULTIARRAY._reconstruct, (torch.Tensor, (0,), b"b")),
    "subtype np.matrix": lambda: np.matrix([[1.0]]),
    "masked array": lambda: np.ma.masked_array([1.0]),
    "numpy.frombuffer": lambda: Reduce(np.frombuffer, (b"\0" * 8, "f8")),
    "numpy.load": lambda: Reduce(np.load, ("/etc/passwd",)),
    "ndarray called": lambda: Reduce(np.ndarray, ((2,), "O")),
    "dtype state sets object flags": lambda: Reduce(MULTIARRAY.scalar, (_evil_dtype(OBJECT_FLAGS), b"\0" * 8)),
    "dtype state adds fields": lambda: Reduce(
        MULTIARRAY.scalar, (_evil_dtype((3, "|", None, ("a",), {"a": (np.dtype("f8"), 0)}, 8, 8, 0)), b"\0" * 8)),
    "dtype state sets itemsize": lambda: Reduce(
        MULTIARRAY.scalar, (_evil_dtype((3, "<", None, None, None, 64, 64, 0)), b"\0" * 8)),
    "array of evil dtype": lambda: Reduce(MULTIARRAY._reconstruct, (np.ndarray, (0,), b"b"),
                                          (1, (1,), _evil_dtype(OBJECT_FLAGS), False, b"\0" * 8)),
    "array short of bytes": lambda: Reduce(MULTIARRAY._reconstruct, (np.ndarray, (0,), b"b"),
                                           (1, (4,), np.dtype("f8"), False, b"\0" * 8)),
    "array with a list for data": lambda: Reduce(MULTIARRAY._reconstruct, (np.ndarray, (0,), b"b"),
                                                 (1, (1,), np.dtype("f8"), False, [1.0])),
    "object scalar": lambda: Reduce(MULTIARRAY.scalar, (np.dtype("O"), 5)),
    "scalar short of bytes": lambda: Reduce(MULTIARRAY.scalar, (np.dtype("f8"), b"\0")),
    "dtype spec unicode": lambda: Reduce(np.dtype, ("U8", False, True)),
    "dtype object standalone": lambda: np.dtype("f4"),
    "bytes with a size": lambda: Reduce(bytes, (10,)),
}


@pytest.mark.parametrize("name", list(CRAFTED))
def test_crafted_numpy_requests_are_unsafe(name):
    data = _save({"x": [CRAFTED[name]()]})
    with pytest.raises(UnsafeCheckpointError) as e:
        decode_extra_state(data, "/ckpt/extra_state/extra_state_rank_0.pt")
    assert "/ckpt/extra_state/extra_state_rank_0.pt" in str(e.value)
    if name.startswith("dtype state"):
        assert "only a byte order may be set" in str(e.value)


def test_trusting_numpy_names_again_does_not_reopen_the_hole():
    """The old workaround (allow-listing numpy's own classes) is ignored: the checked stand-ins decide."""
    legacy = [np.ndarray, np.dtype, np.dtypes.Float64DType, np.dtypes.UInt32DType, MULTIARRAY._reconstruct, MULTIARRAY.scalar]
    data = _save({"x": CRAFTED["dtype state sets object flags"]()})
    with pytest.raises(UnsafeCheckpointError, match="only a byte order may be set"):
        decode_extra_state(data, "f", safe_globals=legacy)
    assert_same({"r": np.random.get_state()}, decode_extra_state(_save({"r": np.random.get_state()}), "f", legacy))


def _hand_pickle(*ops: bytes) -> bytes:
    return b"\x80\x02" + b"".join(ops) + b"."


def _array_ops(module: bytes, subtype: bytes = b"numpy\nndarray\n", byteorder: bytes = b"<") -> bytes:
    """Protocol-2 opcodes numpy would write for np.array([1.0, 2.0]) ('f8'), with the names given."""
    unicode = lambda s: b"X" + struct.pack("<I", len(s)) + s  # noqa: E731
    raw = struct.pack(byteorder.decode() + "2d", 1.0, 2.0).decode("latin1").encode("utf-8")
    return (b"c" + module + b"\n_reconstruct\n" + b"c" + subtype + b"K\x00\x85" + b"c_codecs\nencode\n" + unicode(b"b")
            + unicode(b"latin1") + b"\x86R\x87R" + b"(K\x01K\x02\x85" + b"cnumpy\ndtype\n" + unicode(b"f8") + b"\x89\x88\x87R"
            + b"(K\x03" + unicode(byteorder) + b"NNNJ\xff\xff\xff\xffJ\xff\xff\xff\xffK\x00tb" + b"\x89"
            + b"c_codecs\nencode\n" + unicode(raw) + unicode(b"latin1") + b"\x86R" + b"tb")


@pytest.mark.parametrize("module", [b"numpy.core.multiarray", b"numpy._core.multiarray"])
def test_numpy_1_and_2_spellings_load(module):
    for order in (b"<", b">"):
        back = decode_extra_state(_wrap(_hand_pickle(_array_ops(module, byteorder=order))), "f")
        assert back.tolist() == [1.0, 2.0] and back.dtype.str == order.decode() + "f8"


def test_hand_written_attacks_are_unsafe():
    # a subtype that is not numpy.ndarray (torch.Tensor is allowed globally, so the stand-in must refuse it)
    with pytest.raises(UnsafeCheckpointError, match="subtype"):
        decode_extra_state(_wrap(_hand_pickle(_array_ops(b"numpy.core.multiarray", b"torch\nTensor\n"))), "f")
    # BUILD twice: the dtype is rebuilt after its first state (memo 0 holds it)
    dtype = b"cnumpy\ndtype\nX\x02\x00\x00\x00f8\x89\x88\x87Rq\x00"
    state = b"(K\x03X\x01\x00\x00\x00<NNNJ\xff\xff\xff\xffJ\xff\xff\xff\xffK\x00t"
    with pytest.raises(UnsafeCheckpointError, match="only a byte order may be set"):
        decode_extra_state(_wrap(_hand_pickle(dtype + state + b"bh\x00" + state + b"b")), "f")
    # numpy reached through a name numpy does not pickle
    with pytest.raises(UnsafeCheckpointError):
        decode_extra_state(_wrap(_hand_pickle(b"cnumpy\nfromfile\nX\x01\x00\x00\x00x\x85R")), "f")


def test_garbage_is_corrupt_not_unsafe():
    with pytest.raises(CorruptCheckpointError):
        decode_extra_state(b"not a torch file", "f")
    with pytest.raises(CorruptCheckpointError):
        decode_extra_state(_save({"a": np.arange(3)})[:-30], "f")


def test_without_numpy_files_without_numpy_still_load(monkeypatch):
    data = _save({"step": 3, "t": torch.ones(2), "b": b""})
    numpy_data = _save({"a": np.arange(2)})
    monkeypatch.setitem(sys.modules, "numpy", None)  # import numpy now raises ImportError
    assert X.extra_safe_globals() == [(X._empty_bytes, "builtins.bytes")]
    back = decode_extra_state(data, "f")
    assert back["step"] == 3 and back["b"] == b"" and torch.equal(back["t"], torch.ones(2))
    assert decode_extra_state(encode_extra_state({"s": 1.0}), "f") == {"s": 1.0}
    with pytest.raises(UnsafeCheckpointError):
        decode_extra_state(numpy_data, "f")


def test_error_class():
    assert issubclass(ExtraStateError, ConfigError) and issubclass(ExtraStateError, CallerError)
    assert issubclass(ExtraStateError, ValueError)
    assert set(X.__all__) >= {"ExtraStateError", "encode_extra_state", "decode_extra_state", "extra_safe_globals"}
    assert MAX_DEPTH == 100  # the limit the docs state
