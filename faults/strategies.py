"""Hypothesis strategies and generic helpers for the resilience suite.

Everything here works on *any* checkpointer that follows the on-disk contract: damage is
done to files by role (commit record, payload), never through a checkpointer's internals.
"""

from __future__ import annotations

import os
import random

from hypothesis import strategies as st

from .contract import EXTRA_STATE_DIR, POINTER_FILE, is_commit_record
from .training import DTYPES as _DTYPES
from .training import OPTIMIZERS as _OPTIMIZERS
from .training import ModelSpec, OptimSpec, RunConfig

__all__ = ["model_specs", "optim_specs", "run_configs", "world_sizes", "crash_points", "disk_damage", "extra_states",
           "pointer_damage", "payload_files", "damage_step", "damage_pointer", "DAMAGE", "RECORD_DAMAGE", "POINTER_DAMAGE",
           "OPTIMIZERS", "DTYPES"]

#: Optimizer kinds (the moments each keeps differ: exp_avg/exp_avg_sq, max_exp_avg_sq,
#: momentum_buffer, square_avg, sum) and dtypes the suite generates.
OPTIMIZERS = _OPTIMIZERS
DTYPES = _DTYPES


def model_specs(*, dtypes: tuple[str, ...] = DTYPES, shardable: bool = False) -> st.SearchStrategy[ModelSpec]:
    """Shapes, depth, a frozen parameter, tied weights, a module that never gets a gradient.
    ``shardable``: only what FSDP2 on gloo handles (fp32, no tied weights)."""
    return st.builds(
        ModelSpec,
        dim=st.integers(2, 9), hidden=st.integers(1, 12), depth=st.integers(1, 3),
        frozen=st.booleans(), tied=st.just(False) if shardable else st.booleans(), unused=st.booleans(),
        dtype=st.just("float32") if shardable else st.sampled_from(dtypes),
    )


def optim_specs(*, main_fp32: bool = True) -> st.SearchStrategy[OptimSpec]:
    """One to three optimizers at once, optionally stepping fp32 main copies of the parameters."""
    return st.builds(OptimSpec, kinds=st.lists(st.sampled_from(OPTIMIZERS), min_size=1, max_size=3).map(tuple),
                     main_fp32=st.booleans() if main_fp32 else st.just(False))


def run_configs(world_size: int = 1, *, extra_per_rank: st.SearchStrategy[bool] | None = None,
                sharding: tuple[str, ...] = ("replicated", "fsdp2")) -> st.SearchStrategy[RunConfig]:
    """A whole training job: model, optimizers, sharding (FSDP2 needs >= 2 ranks), extra-state
    layout, seed. Mixed precision with fp32 main parameters is drawn for replicated runs."""
    shardings = [s for s in sharding if s == "replicated" or world_size >= 2]

    @st.composite
    def build(draw):
        how = draw(st.sampled_from(shardings))
        fsdp = how == "fsdp2"
        model = draw(model_specs(shardable=fsdp))
        optim = draw(optim_specs(main_fp32=not fsdp and model.dtype != "float32"))
        per_rank = draw(extra_per_rank if extra_per_rank is not None else st.booleans())
        return RunConfig(model, optim, how, per_rank, draw(st.integers(0, 2**16)))

    return build()


def world_sizes(sizes: tuple[int, ...] = (1, 2, 4)) -> st.SearchStrategy[int]:
    return st.sampled_from(sizes)


def crash_points(max_ops: int = 12) -> st.SearchStrategy[tuple[int, str]]:
    """A crash at the nth file-system operation of a save (before or after it): the suite's
    protocol-agnostic fault point. Shrinks toward the first operation."""
    return st.tuples(st.integers(1, max_ops), st.sampled_from(["before", "after"]))


#: tensor dtypes :func:`extra_states` draws (the kinds a trainer's extra state holds: masks,
#: counters, RNG states, statistics in low precision, complex spectra)
EXTRA_TENSOR_DTYPES = ("float32", "float64", "bfloat16", "float16", "complex64", "bool", "int8", "uint8", "int32",
                       "int64")
EXTRA_ARRAY_DTYPES = ("uint32", "int64", "float64", "float32", "bool", "complex128", ">u4", ">f8", "int8", "uint16")
_SHAPES = ((), (0,), (3,), (2, 3), (3, 0, 2))


def _tensor(dtype: str, shape: tuple, seed: int):
    import torch

    g = torch.Generator().manual_seed(seed)
    kind = getattr(torch, dtype)
    if kind == torch.bool:
        return torch.rand(shape, generator=g) < 0.5
    if kind.is_complex:
        return torch.randn(shape, generator=g, dtype=kind)
    if kind.is_floating_point:
        return torch.randn(shape, generator=g).to(kind)
    return torch.randint(-100 if kind not in (torch.uint8,) else 0, 100, shape, generator=g, dtype=kind)


def _array(dtype: str, shape: tuple, seed: int):
    import numpy as np

    rng = np.random.RandomState(seed)
    dt = np.dtype(dtype)
    if dt.kind == "b":
        return np.asarray(rng.random_sample(shape) < 0.5)
    if dt.kind == "c":
        return np.asarray(rng.standard_normal(shape) + 1j * rng.standard_normal(shape)).astype(dt)
    if dt.kind == "f":
        return np.asarray(rng.standard_normal(shape)).astype(dt)
    return np.asarray(rng.randint(0, 100, size=shape)).astype(dt)


def extra_states(*, registered: bool = False) -> st.SearchStrategy[dict]:
    """Extra state as trainers keep it, and its edges: int, tuple, str, bool and None keys; empty
    dicts, lists and tuples; nesting; tensors of many dtypes (0-dim and numel-0 included) and views
    of one tensor; numpy arrays (big-endian too), numpy scalars and RNG states (numpy's legacy and
    new generators, torch's, Python's); floats with NaN, infinities and -0.0, big ints, complex,
    bytes. Keys at the top are strings (the names a trainer gives), never ``global_step``.
    ``registered=True`` (a checkpointer that declares
    :attr:`~faults.contract.Limitation.REGISTERED_EXTRA_STATE`): tensors, numbers, strings, bytes,
    None and containers of them only -- no numpy values or RNG objects."""
    import numpy as np
    import torch

    tensors = st.builds(_tensor, st.sampled_from(EXTRA_TENSOR_DTYPES), st.sampled_from(_SHAPES), st.integers(0, 999))
    arrays = st.builds(_array, st.sampled_from(EXTRA_ARRAY_DTYPES), st.sampled_from(_SHAPES), st.integers(0, 999))
    scalars = st.one_of(st.builds(np.int64, st.integers(-2**62, 2**62)), st.builds(np.float32, st.floats(width=32)),
                        st.builds(np.bool_, st.booleans()), st.builds(np.uint8, st.integers(0, 255)))
    rng_states = st.sampled_from(["numpy_legacy", "numpy_generator", "torch", "python"]).flatmap(
        lambda kind: st.integers(0, 99).map(lambda seed: _rng_state(kind, seed)))
    leaves = st.one_of(st.none(), st.booleans(), st.integers(-2**80, 2**80),
                       st.floats(allow_nan=True, allow_infinity=True), st.complex_numbers(allow_nan=False),
                       st.text(max_size=6), st.binary(max_size=6), tensors,
                       *(() if registered else (arrays, scalars, rng_states)))
    keys = st.one_of(st.text(max_size=5), st.integers(-3, 3), st.tuples(st.integers(0, 3), st.text(max_size=2)),
                     st.none())
    values = st.recursive(leaves, lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.lists(inner, max_size=3).map(tuple),
        st.dictionaries(keys, inner, max_size=3)), max_leaves=8)

    @st.composite
    def build(draw):
        out = draw(st.dictionaries(st.text(min_size=1, max_size=6).filter(lambda k: k != "global_step"), values,
                                   max_size=4))
        if draw(st.booleans(), label="views"):
            base = torch.arange(12, dtype=draw(st.sampled_from([torch.float32, torch.int64, torch.bfloat16])))
            out["base"], out["tail"], out["grid"] = base, base[5:], base.view(3, 4)
        return out

    return build()


def _rng_state(kind: str, seed: int):
    import numpy as np
    import torch

    if kind == "numpy_legacy":
        return np.random.RandomState(seed).get_state()
    if kind == "numpy_generator":
        return np.random.default_rng(seed).bit_generator.state
    if kind == "torch":
        return torch.Generator().manual_seed(seed).get_state()
    return random.Random(seed).getstate()


def payload_files(step_dir: str) -> list[str]:
    """Every file of a step except commit records, largest first."""
    out = []
    for dirpath, _dirs, files in os.walk(step_dir):
        for f in files:
            if is_commit_record(f):
                continue
            out.append(os.path.join(dirpath, f))
    return sorted(out, key=lambda p: (-os.path.getsize(p), p))


#: How :func:`damage_step` damages a step. Every kind makes the step unusable, so resume must
#: fall back past it. All but ``bitflip_payload`` are visible without reading payload bytes
#: (the commit record and the files' kinds and sizes), so ``find_latest_checkpoint`` must skip
#: such a step; a flipped payload bit is only found when the bytes are read (``load`` raises).
DAMAGE = ("missing_commit", "missing_payload", "truncated_payload", "missing_extra_state", "bitflip_payload",
          "bitflip_record", "truncated_record", "corrupt_record_field", "forged_record_field", "fifo_payload")
#: The commit-record kinds (see :data:`faults.inject.DISK_FAULTS` for what each models).
RECORD_DAMAGE = ("bitflip_record", "truncated_record", "corrupt_record_field", "forged_record_field")
POINTER_DAMAGE = ("absent", "empty", "torn", "garbage", "nul", "dangling", "stale")


def disk_damage(*, bitflip: bool = True, record: bool = True, commit_record: bool = True) -> st.SearchStrategy[str]:
    """A kind of step damage. ``bitflip=False`` leaves out ``bitflip_payload`` (found only by a
    load, not by ``find_latest_checkpoint``); ``record=False`` the commit-record kinds and the
    FIFO, for callers that judge the older contract only; ``commit_record=False`` (a checkpointer
    that declares :attr:`~faults.contract.Limitation.NO_COMMIT_RECORD`) the kinds that damage or
    remove a commit record."""
    kinds = [d for d in DAMAGE if (bitflip or d != "bitflip_payload")
             and (record or (d not in RECORD_DAMAGE and d != "fifo_payload"))
             and (commit_record or (d not in RECORD_DAMAGE and d != "missing_commit"))]
    return st.sampled_from(kinds)


def pointer_damage() -> st.SearchStrategy[str]:
    return st.sampled_from(POINTER_DAMAGE)


def damage_pointer(root: str, how: str, steps: list[int]) -> None:
    """Replace the pointer the way crashes and bad tools do; ``steps``: the steps saved so far. An
    error inside is a :class:`~faults.errors.HarnessError`."""
    from .errors import harness

    with harness(f"faults.strategies.damage_pointer({how!r})"):
        _damage_pointer(root, how, steps)


def _damage_pointer(root: str, how: str, steps: list[int]) -> None:
    p = os.path.join(root, POINTER_FILE)
    newest = max(steps) if steps else 1
    data = {"empty": b"", "torn": f"{newest}"[:-1].encode() or b"", "garbage": b"x\x07!",
            "nul": b"\x00" * 4, "dangling": f"{newest + 1000}\n".encode(),
            "stale": f"{min(steps) if steps else 0}\n".encode()}
    if how == "absent":
        if os.path.lexists(p):
            os.unlink(p)
    elif how in data:
        with open(p, "wb") as f:
            f.write(data[how])
    else:
        raise ValueError(f"unknown pointer damage {how!r}; choose from {POINTER_DAMAGE}")


def _tensor_byte(step_dir: str) -> tuple[str, int] | None:
    """(file, offset) of a byte in the middle of the largest model tensor's data, from the
    step's commit record: flipping it changes a value every loader returns, so a load that
    does not raise has loaded a wrong state (a byte in a header or padding might not). A
    tensor item DCP wrote with ``torch.save`` is a small zip: its ``data/0`` entry is found."""
    import io
    import struct
    import zipfile

    from .inject import read_record, record_path

    try:
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        md, _ = read_record(record_path(step_dir))
        items = [(info.length, info) for idx, info in md.storage_data.items()
                 if idx.fqn.startswith("model.") and isinstance(md.state_dict_metadata.get(idx.fqn), TensorStorageMetadata)]
        if not items:
            return None
        _, info = max(items, key=lambda t: t[0])
        path = os.path.join(step_dir, info.relative_path)
        with open(path, "rb") as f:
            f.seek(info.offset)
            region = f.read(info.length)
        start, length = 0, len(region)
        if region[:4] == b"PK\x03\x04":
            with zipfile.ZipFile(io.BytesIO(region)) as z:
                entry = next(i for i in z.infolist() if i.filename.endswith("/data/0"))
            name_len, extra_len = struct.unpack_from("<HH", region, entry.header_offset + 26)
            start, length = entry.header_offset + 30 + name_len + extra_len, entry.file_size
        if length < 1:
            return None
        return path, info.offset + start + length // 2
    except Exception:  # noqa: BLE001 - a record format of the checkpointer's own: no target
        return None


def damage_step(step_dir: str, how: str, rng: random.Random | int | None = None) -> str | None:
    """Damage a step the way real failures do (:func:`_damage_step`); an error inside the injector
    is a :class:`~faults.errors.HarnessError` naming it, never the checkpointer's violation."""
    from .errors import harness

    with harness(f"faults.strategies.damage_step({how!r})"):
        return _damage_step(step_dir, how, rng)


def _damage_step(step_dir: str, how: str, rng: random.Random | int | None = None) -> str | None:
    """Damage a step the way real failures do, by file role only (``how`` from :data:`DAMAGE`).

    The commit-record kinds and ``fifo_payload`` are :data:`faults.inject.DISK_FAULTS`'s and draw
    the bit, length, field or file from ``rng`` (a ``random.Random`` or a seed; default seed 0);
    they return what they did. The record is ``.metadata``, or ``__0.metadata`` for a step
    committed per rank."""
    if how in RECORD_DAMAGE or how == "fifo_payload":
        from .inject import DISK_FAULTS
        from .points import FaultKind

        kind = FaultKind.FIFO_IN_STEP if how == "fifo_payload" else FaultKind(how)
        r = rng if isinstance(rng, random.Random) else random.Random(0 if rng is None else rng)
        return DISK_FAULTS[kind](os.path.dirname(os.path.abspath(step_dir)), step_dir, 0, r)
    if how == "missing_commit":
        names = [n for n in os.listdir(step_dir) if is_commit_record(n)]
        if not names:  # deleting nothing and then demanding a fallback would judge an intact step
            from .inject import NoCommitRecord

            raise NoCommitRecord(f"{step_dir}: no commit record to delete: the checkpointer writes none")
        for name in names:
            os.unlink(os.path.join(step_dir, name))
        return None
    if how == "missing_extra_state":  # the contract's per-rank extra state; never a file guessed by its size
        extra = os.path.join(step_dir, EXTRA_STATE_DIR)
        names = sorted(os.listdir(extra)) if os.path.isdir(extra) else []
        if not names:
            from .inject import FaultNotApplicable

            raise FaultNotApplicable(f"{step_dir}: no {EXTRA_STATE_DIR}/ directory (extra state is elsewhere; "
                                     "test_file_roles damages each file the load reads, by its learned role)")
        os.unlink(os.path.join(extra, names[-1]))
        return f"deleted {EXTRA_STATE_DIR}/{names[-1]}"
    target = payload_files(step_dir)[0]
    size = os.path.getsize(target)
    if how == "missing_payload":
        os.unlink(target)
    elif how == "truncated_payload":
        os.truncate(target, size // 2)
    elif how == "bitflip_payload":
        where = _tensor_byte(step_dir)
        if where is None:  # no record the harness can read: a byte well inside the largest file
            where = (target, size - max(1, size // 4))
        path, offset = where
        with open(path, "r+b") as f:
            f.seek(offset)
            b = f.read(1)[0]
            f.seek(offset)
            f.write(bytes([b ^ 0x04]))
        return f"{os.path.basename(path)}@{offset}"
    else:
        raise ValueError(f"unknown damage {how!r}; choose from {DAMAGE}")
    return None
