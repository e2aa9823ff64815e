"""Caller errors are the caller's: a load into a state that cannot receive the checkpoint is never
reported, or handled, as damage to the checkpoint.

The states (each built by the suite from :mod:`faults.training`, loaded into an intact step saved
by an untied fp32 run): tensors on the ``meta`` device (a model not materialised), the input and
output projections tied in the loader only (one memory for two keys the checkpoint holds apart),
bf16 instead of fp32, a wider hidden layer, and a destination of the wrong kind where a tensor was
saved: ``None``, a float, a tensor that overlaps itself (``expand()``).

* **Violation** (the contract's): the mistake costs the checkpoint -- afterwards a restarted job
  no longer resumes the step bitwise -- or a load hangs (a world's timeout), or ``load_latest``
  (declared) treats it as damage: it walks past the intact step (returns an older one, or reads
  the older step's payload before it gives up). A fallback cannot fix a call, and it hides the cause.
* **Advisory** (the contract is silent on what a load into an impossible state does): the load
  returns without an error (loading nothing into meta tensors, one tied entry silently holding the
  other's values, values cast to another dtype, a destination of the wrong kind left as it was);
  the error calls the checkpoint corrupt or damaged; the error does not name the cause (``meta``,
  both tied keys, the dtype, the key); in a world, ranks disagree (one raises, a peer returns).
"""

from __future__ import annotations

import dataclasses
import os
import re
import sys
import uuid
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch

from faults import training as T
from faults.contract import EXTRA_STATE_DIR, SHARD_SUFFIXES, step_dir_name
from faults.contract import Capability as C
from faults.fileroles import opened_during, state_files

from ._common import advise, assert_resumed, config_for, need, resume, save_step, save_steps, step_path

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

SAVED = T.RunConfig(extra_per_rank=False)
#: case -> (what the state is, how the model differs from the saved run's; None: meta tensors)
CASES: dict[str, tuple[str, dict[str, Any] | None]] = {
    "meta": ("tensors on the meta device", None),
    "tied": ("embed.weight and head.weight tied (one memory) where the saver's were apart", {"tied": True}),
    "dtype": ("bfloat16 tensors where the checkpoint holds float32", {"dtype": "bfloat16"}),
    "shape": ("a hidden width of 9 where the checkpoint has 8", {"hidden": 9}),
    "none": ("None where the checkpoint holds embed.weight", {}),
    "number": ("a float where the checkpoint holds embed.weight", {}),
    "expanded": ("an expand()ed tensor (stride 0: one memory location for all its elements) as embed.weight", {}),
}
#: the cases that put something other than a tensor of memory of its own at this key
WRONG_KIND = {"none": lambda t: None, "number": lambda t: 1.5,
              "expanded": lambda t: torch.zeros((), dtype=t.dtype).expand(t.shape)}
WRONG_KEY = "embed.weight"
#: what a good error message names, per case (any one of the alternatives, case-insensitive)
CAUSE = {
    "meta": [r"\bmeta\b"],
    "tied": [r"embed\.weight", r"head\.weight"],
    "dtype": [r"bfloat16|bf16|dtype"],
    "shape": [r"body\.0\.(weight|bias)|out\.weight"],
    "none": [r"embed\.weight"],
    "number": [r"embed\.weight"],
    "expanded": [r"embed\.weight"],
}
CORRUPTION = re.compile(r"corrupt|damaged|restore .* from a copy|checksum mismatch", re.I)


def bad_state(cfg: T.RunConfig, case: str) -> dict[str, Any]:
    """The state a caller would pass: the saved run's own state, made wrong in one way."""
    change = CASES[case][1]
    if case in WRONG_KIND:
        state = T.TrainRun(cfg).state(target=True)
        state["model"][WRONG_KEY] = WRONG_KIND[case](state["model"][WRONG_KEY])
        return state
    if change is None:
        state = T.TrainRun(cfg).state(target=True)
        state["model"] = {k: torch.empty_like(v, device="meta") if isinstance(v, torch.Tensor) else v
                          for k, v in state["model"].items()}
        return state
    return T.TrainRun(dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, **change))).state(target=True)


def silently(case: str, state: dict[str, Any]) -> str | None:
    """What a load that returned did to ``state`` (the mistake it let through)."""
    model = state["model"]
    if case == "meta":
        still = sum(1 for v in model.values() if isinstance(v, torch.Tensor) and v.is_meta)
        if still:
            return f"returned without an error; {still} tensors are still on the meta device (nothing loaded into them)"
        return ("returned without an error, replacing the meta tensors of the state with new ones: the model "
                "they came from is not filled in place and stays on the meta device")
    if case == "tied":
        return ("returned without an error; embed.weight and head.weight share one memory, so one holds the "
                "other's saved values")
    if case == "dtype":
        return "returned without an error, casting float32 values into bfloat16 tensors"
    if case in WRONG_KIND:
        got = model.get(WRONG_KEY)
        if case != "expanded" and isinstance(got, torch.Tensor):
            return None  # replaced by a tensor: judged by the resume that follows, not here
        return f"returned without an error, leaving {WRONG_KEY} as {type(got).__name__} {_short(got)}"
    return "returned without an error into tensors of another shape"


def _short(v: Any) -> str:
    text = repr(v)
    return text if len(text) < 80 else text[:80] + "..."


def load_once(ck, path: str, state: dict[str, Any], case: str) -> dict[str, Any]:
    """``load`` of ``path`` into ``state`` as the contract's caller does; what came of it."""
    skeleton = state.pop("extra_state")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ck.load(path, state, extra_state_skeleton=skeleton)
    except T._errors() as e:  # noqa: BLE001 - judged by the test
        return {"error": T._error(e), "silently": None}
    return {"error": None, "silently": silently(case, state)}


def judge(case: str, how: str, outcome: dict[str, Any], where: str = "") -> None:
    """Advisories for one load's outcome (see the module docstring)."""
    what = f"{how} into a state with {CASES[case][0]}{where}"
    error = outcome["error"]
    if error is None:
        if outcome["silently"] is not None:
            advise(f"{what} {outcome['silently']}")
        return
    shown = error.splitlines()[0][:300]
    if CORRUPTION.search(error):
        advise(f"{what} raised an error that reports damage to the checkpoint, which is intact (a caller's "
               f"mistake reported as corruption): {shown}")
    missing = [p for p in CAUSE[case] if not re.search(p, error, re.I)]
    if missing:
        advise(f"{what} raised an error that does not name the cause ({' and '.join(missing)}): {shown}")


@pytest.mark.parametrize("case", list(CASES))
def test_a_callers_mistake_is_not_corruption_and_costs_nothing(checkpointer_factory, tmp_path, case):
    root, cfg = str(tmp_path), config_for(checkpointer_factory, SAVED)
    save_steps(checkpointer_factory(), root, cfg, [1, 2])
    outcome = load_once(checkpointer_factory(), step_path(root, 2), bad_state(cfg, case), case)
    judge(case, "load", outcome)
    assert_resumed(*resume(checkpointer_factory(), root, cfg), root, 2, cfg, f"after a load into {CASES[case][0]}: ")


# -- load_latest (declared): no walk past an intact step --------------------------------------
_OPENED: list[str] | None = None


def _audit(event: str, args: tuple) -> None:
    if _OPENED is not None and event == "open" and args and isinstance(args[0], (str, bytes, os.PathLike)):
        _OPENED.append(os.fsdecode(args[0]))


_HOOKED = False


@contextmanager
def opened_files() -> Iterator[list[str]]:
    """The files this process opens meanwhile (Python's ``open`` audit event: ``open``, ``os.open``).
    The hook is added once per process and records only inside this block."""
    global _OPENED, _HOOKED
    if not _HOOKED:
        sys.addaudithook(_audit)
        _HOOKED = True
    _OPENED = []
    try:
        yield _OPENED
    finally:
        _OPENED = None


def _payload_of(step_dir: str, paths: list[str]) -> list[str]:
    """The payload files (shards, extra state) of ``step_dir`` among ``paths``."""
    base = os.path.realpath(step_dir) + os.sep
    out = []
    for p in paths:
        full = os.path.realpath(p)
        if full.startswith(base):
            rel = full[len(base):]
            if rel.endswith(SHARD_SUFFIXES) or rel.startswith(EXTRA_STATE_DIR + os.sep):
                out.append(rel)
    return sorted(set(out))


def bad_config(cfg: T.RunConfig, case: str) -> T.RunConfig:
    change = CASES[case][1] or {}
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, **change))


@pytest.mark.parametrize("case", list(CASES))
def test_load_latest_does_not_fall_back_on_a_callers_mistake(checkpointer_factory, tmp_path, case):
    """Step 1 is saved by the caller's (wrong) model, step 2 by the right one: a ``load_latest``
    that treats the mistake as damage walks back and resumes step 1, silently older than the
    intact step 2 (meta tensors fit no step: there the walk shows as step 1's payload being read)."""
    need(checkpointer_factory, C.LOAD_LATEST)
    root, cfg = str(tmp_path), config_for(checkpointer_factory, SAVED)
    older = T.TrainRun(bad_config(cfg, case))
    older.train_to(1)
    save_step(checkpointer_factory(), root, older)
    newer = T.TrainRun(cfg)
    newer.train_to(2)
    save_step(checkpointer_factory(), root, newer)
    state = bad_state(cfg, case)
    ck = checkpointer_factory()
    path = None
    held = state_files(step_path(root, 1), older.state())  # step 1's files that hold its saved state (learned)
    with opened_during(step_path(root, 1)) as opened1, opened_files() as opened, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            path = ck.load_latest(root, state)
            outcome = {"error": None, "silently": silently(case, state)}
        except T._errors() as e:  # noqa: BLE001 - judged below
            outcome = {"error": T._error(e), "silently": None}
    walked = sorted(set(_payload_of(step_path(root, 1), opened)) | (set(opened1) & held))
    assert path is None or os.path.normpath(path) != step_path(root, 1), (
        f"load_latest into a state with {CASES[case][0]} fell back past the intact {step_dir_name(2)} and "
        f"loaded {step_dir_name(1)}: a caller's mistake handled as damage resumes an older step silently")
    judge(case, "load_latest", outcome)
    assert not walked, (
        f"load_latest into a state with {CASES[case][0]} fell back to {step_dir_name(1)} (read "
        f"{', '.join(walked[:3])}) although {step_dir_name(2)} is intact: a caller's mistake handled as damage "
        f"(every step fails alike, and the walk hides the cause: {(outcome['error'] or '')[:300]})")
    assert_resumed(*resume(checkpointer_factory(), root, cfg), root, 2, cfg, f"after a load into {CASES[case][0]}: ")


# -- in a world: one rank's mistake ------------------------------------------------------------
def r_load_bad(spec: str, root: str, cfg: T.RunConfig, case: str, bad_ranks: tuple[int, ...]) -> dict[str, Any]:
    """Rank function: ``load`` of step 2 with ``case``'s state on ``bad_ranks``, the saved run's
    elsewhere."""
    import torch.distributed as dist

    good = dist.get_rank() not in bad_ranks
    state = T.TrainRun(cfg).state(target=True) if good else bad_state(cfg, case)
    return load_once(T.load_factory(spec)(), step_path(root, 2), state, case)


@pytest.mark.parametrize("case", ["meta", "tied"])
def test_one_ranks_mistake_in_a_world(checkpointer_spec, checkpointer_factory, world_factory, suite_world_size,
                                      tmp_path, case):
    """The last rank alone passes a wrong state. Every rank must come back (a hang fails the test),
    the mistake must cost nothing, and the ranks should agree (advisory: one raises, a peer returns)."""
    if suite_world_size < 2:
        pytest.skip("one rank's mistake needs at least 2 ranks")
    cfg = config_for(checkpointer_factory, SAVED)
    world = world_factory.get(suite_world_size)
    run_id, root = uuid.uuid4().hex, str(tmp_path)
    world.run(T.r_start, run_id, cfg, checkpointer_spec, {})
    world.run(T.r_train, run_id, 2)
    errors = world.run(T.r_save, run_id, root, False)
    assert errors == [None] * suite_world_size, f"save of step 2 failed: {errors}"
    bad = suite_world_size - 1
    outcomes = world.run(r_load_bad, checkpointer_spec, root, cfg, case, (bad,))
    judge(case, "load", outcomes[bad], f" on rank {bad} only")
    raised = [r for r, o in enumerate(outcomes) if o["error"] is not None]
    if raised and len(raised) < suite_world_size:
        advise(f"load with a state with {CASES[case][0]} on rank {bad} only: rank(s) {raised} raised and the "
               f"others returned, so the job goes on with ranks that disagree")
    results = world.run(T.r_resume, run_id, cfg, checkpointer_spec, {}, root, False)
    world.run(T.r_drop, run_id)
    for rank, r in enumerate(results):
        assert r["error"] is None, f"rank {rank}: resume after a load into {CASES[case][0]} failed: {r['error']}"
        assert r["step"] == 2 and r["digest"] == r["reference"], (
            f"rank {rank}: after a load into {CASES[case][0]} on rank {bad}, step 2 no longer resumes bitwise")
