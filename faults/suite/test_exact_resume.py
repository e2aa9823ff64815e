"""What resume restores is exactly what was saved, for any checkpointer.

* **A fallback never mixes two steps.** Steps 1 and 2 of a run whose late branch joins the forward
  at step 2 (so step 1 holds no optimizer state for it); each file of step 2 gets one flipped bit in
  turn; a restarted job resumes into a fresh, primed state whose optimizer entries hold a sentinel.
  Wherever it lands, the state must be that step's entries over the values it had before the call --
  the late branch's moments must keep the sentinel after a fallback to step 1, never step 2's values.
  With ``load_latest`` (declared) the checkpointer falls back itself: a mix is a **violation**.
  Without it, the contract's caller falls back (``load`` of step 2 raises, ``load`` of step 1 into the
  same state): a mix there means the failed ``load`` wrote into the state, an **advisory** (the
  contract does not promise that a failed load leaves the state as it was).
* **Extra state round-trips exactly, or is refused at save.** Extra state drawn by Hypothesis (int,
  tuple and str keys, empty containers, nesting, tensors that are views of one another, numpy
  arrays, scalars and RNG states, bf16/complex/bool/0-dim/numel-0 tensors) plus pinned cases: a save
  that returns must load back exactly (:func:`faults.exact.first_difference`); a save that raises must
  have published nothing. A save accepted and a load that cannot restore it is a **violation**
  ("save accepts what load cannot read": an acknowledged step that does not resume).
* **Hostile bytes stay within a memory bound.** A commit record made of object-creating opcodes
  (``faults.hostile.object_bomb_record``, 4 MiB) in place of step 2's record, and a step in the
  contract's layout written by plain DCP whose extra-state file has a DEFLATE-compressed member
  (``faults.hostile.deflated_torch_save``, a GiB inflated): a restarted job resumes in a forked child
  whose peak memory growth must stay within ``MEMORY_FACTOR x`` the hostile file's size plus
  ``MEMORY_SLACK``; more is a **violation** (refusing the file is fine, a MemoryError is not).

The oracle: runs of :mod:`faults.training` trained again from scratch (what each step saved), the
values the suite put into the state before the call, the extra state it drew."""

from __future__ import annotations

import dataclasses
import os
import random
import resource
import shutil
import warnings
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from faults.contract import EXTRA_STATE_DIR, Limitation, extra_state_file_name, step_dir_name
from faults.contract import Capability as C
from faults.exact import first_difference
from faults.hostile import MIB, deflated_torch_save, object_bomb_record
from faults.inject import FaultNotApplicable, record_path
from faults.strategies import extra_states, payload_files
from faults.training import ModelSpec, RunConfig, TrainRun, _errors, describe_error

from ._common import (
    Stats,
    accepts,
    advise,
    budget,
    config_for,
    has,
    in_child,
    lacks,
    make,
    need_not,
    resume,
    same_path,
    save_steps,
    step_path,
)

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

LATE = RunConfig(model=ModelSpec(late=True), extra_per_rank=False)
#: what no saved moment holds: a fallback that leaves it in place kept the state as it was
SENTINEL = 0.25


# -- a fallback never mixes two steps -------------------------------------------------------------
def _saved(cfg: RunConfig, step: int) -> dict[str, Any]:
    """What step ``step`` of ``cfg`` saved, trained again from scratch."""
    run = TrainRun(cfg)
    run.train_to(step)
    return _detached(run.state())


def _detached(obj: Any) -> Any:
    """A copy of a state tree whose tensors are independent clones (containers keep their types)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, dict):
        return type(obj)((k, _detached(v)) for k, v in obj.items())
    if isinstance(obj, list):
        return [_detached(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_detached(v) for v in obj)
    return obj


def _overlay(before: Any, saved: Any) -> Any:
    """``before`` with every entry ``saved`` holds replaced by the saved value (dicts merged, anything
    else replaced whole): the state a load of that step leaves."""
    if isinstance(before, dict) and isinstance(saved, dict):
        out = type(before)(before) if type(before) is not dict else dict(before)
        for k, v in saved.items():
            out[k] = _overlay(before[k], v) if k in before else _detached(v)
        return out
    return _detached(saved)


def _target(cfg: RunConfig) -> tuple[dict[str, Any], dict[str, Any]]:
    """A fresh run's state to load into (every parameter primed) with the sentinel in every floating
    optimizer entry, and the extra-state skeleton."""
    state = TrainRun(cfg).state(target=True)
    with torch.no_grad():
        for entry in state["optimizer"]["state"].values():
            for v in entry.values():
                if isinstance(v, torch.Tensor) and v.is_floating_point():
                    v.fill_(SENTINEL)
    return state, state.pop("extra_state")


def _landed(state: dict[str, Any], skeleton: dict[str, Any], before: dict[str, Any], saved: dict[str, Any]) -> str | None:
    """How ``state`` differs from a clean load of the step that saved ``saved`` into ``before``."""
    want = {k: _overlay(before[k], saved[k]) for k in ("model", "optimizer")}
    diff = first_difference(want, {k: state[k] for k in ("model", "optimizer")})
    if diff is not None:
        return diff
    extra = state.get("extra_state")
    return first_difference(saved["extra_state"], extra, "['extra_state']") if extra is not skeleton else None


def _flip_middle(path: str) -> str:
    size = os.path.getsize(path)
    pos = size // 2
    with open(path, "r+b") as f:
        f.seek(pos)
        b = f.read(1)
        f.seek(pos)
        f.write(bytes([b[0] ^ 0x10]))
    return f"flipped a bit at byte {pos} of {size}"


def test_a_fallback_never_mixes_two_steps(checkpointer_factory, tmp_path, request):
    """Each file of step 2 damaged in turn (one bit in its middle): resume lands on step 2 bitwise
    (the damage touched nothing it reads) or on step 1, whose entries over the state's own values
    must be exactly what the state holds -- never step 2's moments of the late branch."""
    stats = Stats(request)
    cfg = config_for(checkpointer_factory, LATE)
    root, pristine = str(tmp_path / "root"), str(tmp_path / "pristine")
    save_steps(checkpointer_factory(), root, cfg, [1, 2])
    shutil.copytree(root, pristine, symlinks=True)
    saved = {s: _saved(cfg, s) for s in (1, 2)}
    lazy = has(checkpointer_factory, C.LOAD_LATEST)
    files = sorted(os.path.relpath(p, step_path(pristine, 2)) for p in payload_files(step_path(pristine, 2)))
    assert files, "step 2 holds no payload file to damage"
    for rel in files:
        shutil.rmtree(root)
        shutil.copytree(pristine, root, symlinks=True)
        detail = f"{step_dir_name(2)}/{rel}: {_flip_middle(os.path.join(step_path(root, 2), rel))}"
        stats.add("files damaged")
        state, skeleton = _target(cfg)
        before = _detached({**state, "extra_state": skeleton})
        ck = checkpointer_factory()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if lazy:
                try:
                    path = ck.load_latest(root, state, extra_state_skeleton=skeleton)
                except _errors() as e:  # noqa: BLE001 - judged here
                    raise AssertionError(f"{detail}: load_latest raised although step 1 is intact: "
                                         f"{describe_error(e)}") from e
                outcome = _judge_landing(root, path, state, skeleton, before, saved, detail)
                if outcome is not None:
                    raise AssertionError(f"load_latest after {outcome}")
                continue
            path = ck.find_latest_checkpoint(root)
            try:
                ck.load(path, state, extra_state_skeleton=skeleton)
            except _errors() as e:  # noqa: BLE001 - the caller falls back, as a restarted job does
                if not same_path(path, step_path(root, 2)):
                    raise AssertionError(f"{detail}: load of {path} raised {describe_error(e)}") from e
                failed = _landed(state, skeleton, before, before)
                path = step_path(root, 1)
                ck.load(path, state, extra_state_skeleton=skeleton)
                outcome = _judge_landing(root, path, state, skeleton, before, saved, detail)
                if outcome is not None:
                    advise(f"a load that failed ({detail}) left the state changed ({failed}): a caller that "
                           f"falls back to step 1 into the same objects resumes a mix ({outcome})")
                continue
            outcome = _judge_landing(root, path, state, skeleton, before, saved, detail)
            if outcome is not None:
                raise AssertionError(f"resume after {outcome}")


def _judge_landing(root: str, path: str | None, state: dict[str, Any], skeleton: dict[str, Any],
                   before: dict[str, Any], saved: dict[int, dict[str, Any]], detail: str) -> str | None:
    for s in (2, 1):
        if same_path(path, step_path(root, s)):
            diff = _landed(state, skeleton, before, saved[s])
            if diff is None:
                return None
            what = "mixes step 2 into a fallback to step 1" if s == 1 else "differs from what step 2 saved"
            return f"{detail}: landed on {step_dir_name(s)}, and the state {what}: {diff}"
    return f"{detail}: landed on {path}, neither step 2 nor the intact step 1"


# -- extra state round-trips exactly, or is refused at save ----------------------------------------
def _blank(obj: Any) -> Any:
    """A skeleton of ``obj``: its dict keys and containers, tensors zeroed, every other leaf None."""
    if isinstance(obj, torch.Tensor):
        return torch.zeros_like(obj.detach())
    if isinstance(obj, dict):
        return {k: _blank(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_blank(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_blank(v) for v in obj)
    return None


def _extra_round_trip(factory, root: str, cfg: RunConfig, extra: dict[Any, Any], options: dict[str, Any]) -> str | None:
    """Save step 1 (plain extra state), then step 2 with ``extra``; load step 2 back. None when it
    round-trips exactly or was refused at save with nothing published; otherwise the violation."""
    ck = make(factory, **options)
    run = save_steps(ck, root, cfg, [1])
    run.train_to(2)
    state = run.state()
    state["extra_state"] = dict(extra)
    what = f"extra state with keys {_short(list(extra))}"
    try:
        ck.save(step_path(root, 2), state, global_step=2)
        ck.maybe_wait_for_async_save()
    except _errors() as e:  # noqa: BLE001 - refusing at save is allowed; then nothing may be published
        path, _run = resume(factory(), root, cfg)
        if not same_path(path, step_path(root, 1)):
            return f"{what}: save raised {describe_error(e)[:300]}, yet resume found {path}"
        return None
    target = TrainRun(cfg).state(target=True)
    target.pop("extra_state")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out = factory().load(step_path(root, 2), target, extra_state_skeleton=_blank(extra))
    except _errors() as e:  # noqa: BLE001 - the violation: an acknowledged step that does not resume
        return f"save accepted it, load cannot restore it: {describe_error(e)[:400]} ({what}: {_short(extra)})"
    got = (out if isinstance(out, dict) else target).get("extra_state")
    diff = first_difference(extra, got, "['extra_state']")
    return None if diff is None else f"save accepted it and load restored something else: {diff} ({what}: {_short(extra)})"


def _short(obj: Any) -> str:
    text = repr(obj)
    return text if len(text) < 200 else text[:200] + "..."


def _layouts(factory) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = [{}]
    if has(factory, C.EMBEDDED_EXTRA_STATE) and accepts(factory, extra_state_per_rank=False):
        out.append({"extra_state_per_rank": False})
    return out


def _pinned() -> dict[str, dict[Any, Any]]:
    """Extra states users keep, each once (the property draws the rest)."""
    import numpy as np

    base = torch.arange(6, dtype=torch.float32)
    return {
        "int_keys": {0: 1200, 1: {2: 3}},
        "empty_containers": {"metrics": {}, "history": [], "nothing": ()},
        "tuple_keys": {(1, "a"): 5, (): "empty"},
        "numpy_rng": {"np_rng": np.random.RandomState(3).get_state()},
        "numpy_values": {"arr": np.arange(5, dtype=np.uint32), "be": np.array([1.5, -2.0], dtype=">f8"),
                         "zero_d": np.array(7, dtype=np.int16), "s": np.float32(0.1), "b": np.bool_(True)},
        "views": {"base": base, "tail": base[2:], "grid": base.view(2, 3)},
        "tensor_kinds": {"bf16": torch.tensor([1.5, -0.0], dtype=torch.bfloat16),
                         "c64": torch.tensor([1 + 2j], dtype=torch.complex64), "mask": torch.tensor([True, False]),
                         "zero_d": torch.tensor(3.5), "empty": torch.empty(0, 3)},
        "python_values": {"nan": float("nan"), "negzero": -0.0, "big": 2**80, "c": 1 + 2j, "bytes": b"\x00x",
                          "none": None, "flag": True, "rng": random.Random(5).getstate()},
    }


#: pinned cases that are no registered object's state_dict (numpy values and RNG objects)
NOT_REGISTERED = ("numpy_rng", "numpy_values")
PINNED = ["int_keys", "empty_containers", "tuple_keys", "numpy_rng", "numpy_values", "views", "tensor_kinds",
          "python_values"]


@pytest.mark.parametrize("case", PINNED)
def test_extra_state_users_keep_round_trips_exactly_or_is_refused_at_save(checkpointer_factory, tmp_path, case):
    """Pinned extra states (int and tuple keys, empty containers, numpy RNG state and arrays, views,
    bf16/complex/bool/0-dim/empty tensors, NaN and -0.0): exact, or refused at save."""
    if case in NOT_REGISTERED:
        need_not(checkpointer_factory, Limitation.REGISTERED_EXTRA_STATE, what=f"{case} extra state")
    cfg = config_for(checkpointer_factory, RunConfig(extra_per_rank=False))
    for i, options in enumerate(_layouts(checkpointer_factory)):
        extra = {"global_step": 2, **_pinned()[case]}
        problem = _extra_round_trip(checkpointer_factory, str(tmp_path / f"root{i}"), cfg, extra, options)
        assert problem is None, f"{options or 'default layout'}: {problem}"


def test_drawn_extra_state_round_trips_exactly_or_is_refused_at_save(checkpointer_factory, tmp_path_factory, request):
    stats = Stats(request)
    cfg = config_for(checkpointer_factory, RunConfig(extra_per_rank=False))
    layouts = _layouts(checkpointer_factory)

    @budget(request, scale=2)
    @given(extra=extra_states(registered=lacks(checkpointer_factory, Limitation.REGISTERED_EXTRA_STATE)),
           layout=st.sampled_from(range(len(layouts))))
    def prop(extra, layout):
        stats.add("examples")
        problem = _extra_round_trip(checkpointer_factory, str(tmp_path_factory.mktemp("extra")), cfg,
                                    {"global_step": 2, **extra}, layouts[layout])
        assert problem is None, f"{layouts[layout] or 'default layout'}: {problem}"

    prop()


# -- hostile bytes stay within a memory bound ------------------------------------------------------
#: peak memory growth a resume may show reading a hostile file of ``n`` bytes: this times ``n``...
MEMORY_FACTOR = 32
#: ... plus this (the process's own working memory for a small checkpoint: tensors, buffers, threads)
MEMORY_SLACK = 256 * MIB
#: an address-space limit the child runs under (above the bound: it only keeps a runaway from the machine)
_AS_HEADROOM = 3 << 30


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def _resume_measured(factory, root: str, cfg: RunConfig) -> dict[str, Any]:
    """In a forked child: resume, with the peak resident memory growth it caused."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset the peak (VmHWM) to the current resident size
    except OSError:
        pass
    base = _status("VmRSS")
    limit = _status("VmSize") + _AS_HEADROOM
    resource.setrlimit(resource.RLIMIT_AS, (limit, resource.getrlimit(resource.RLIMIT_AS)[1]))
    out: dict[str, Any] = {"error": None, "path": None}
    try:
        path, run = resume(factory(), root, cfg)
        out["path"], out["step"] = path, run.step
    except MemoryError as e:
        out["error"] = f"MemoryError: {e}"
    except BaseException as e:  # noqa: BLE001 - a refusal is fine; how much memory it took is judged
        out["error"] = describe_error(getattr(e, "cause", e))[:300]
    out["growth"] = _status("VmHWM") - base
    return out


def _plain_dcp_step(step_dir: str, cfg: RunConfig, extra_bytes: bytes) -> None:
    """A step in the contract's layout written by plain DCP (``.metadata`` + ``__0_0.distcp``) with a
    per-rank extra-state file of the given bytes: what another tool of the family leaves in a root."""
    import torch.distributed.checkpoint as dcp

    run = TrainRun(cfg)
    run.train_to(3)
    state = run.state()
    state.pop("extra_state")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, storage_writer=dcp.FileSystemWriter(step_dir), no_dist=True)
    os.makedirs(os.path.join(step_dir, EXTRA_STATE_DIR), exist_ok=True)
    with open(os.path.join(step_dir, EXTRA_STATE_DIR, extra_state_file_name(0)), "wb") as f:
        f.write(extra_bytes)


@pytest.mark.parametrize("kind", ["record_of_objects", "deflated_extra_state"])
def test_hostile_bytes_stay_within_a_memory_bound(checkpointer_factory, tmp_path, kind):
    """A hostile commit record (4 MiB of object-creating opcodes, no footer) in place of step 2's, or
    a plain-DCP step 3 whose extra-state file inflates to a GiB: resume may refuse either, but its
    peak memory growth must stay within the bound (run in a forked child under an address-space
    limit)."""
    cfg = config_for(checkpointer_factory, RunConfig(extra_per_rank=False))
    root = str(tmp_path / "root")
    save_steps(checkpointer_factory(), root, cfg, [1, 2])
    if kind == "record_of_objects":
        data = object_bomb_record(4 * MIB)
        try:
            target = record_path(step_path(root, 2))
        except FaultNotApplicable as e:
            pytest.skip(str(e))
        with open(target, "wb") as f:
            f.write(data)
    else:
        data = deflated_torch_save(1024 * MIB)
        target = os.path.join(step_path(root, 3), EXTRA_STATE_DIR, extra_state_file_name(0))
        _plain_dcp_step(step_path(root, 3), dataclasses.replace(cfg), data)
    bound = MEMORY_FACTOR * len(data) + MEMORY_SLACK
    out = in_child(lambda: _resume_measured(checkpointer_factory, root, cfg), timeout=180,
                   what=f"resume with {kind} at {target}")
    where = f"{target} ({len(data)} bytes, {kind})"
    assert out["error"] is None or not out["error"].startswith("MemoryError"), (
        f"reading {where} ran out of memory: {out['error']}")
    assert out["growth"] <= bound, (
        f"reading {where} grew peak memory by {out['growth'] / MIB:.0f} MiB, more than {MEMORY_FACTOR} x its size "
        f"+ {MEMORY_SLACK // MIB} MiB = {bound / MIB:.0f} MiB (outcome: {out['error'] or out['path']})")
