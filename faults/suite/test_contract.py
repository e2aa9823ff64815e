"""Contract properties, in one process: newest complete step under any damage, bitwise round
trips over generated models/optimizers/dtypes, async snapshots and failures, overwrite refusal,
retention, corruption never loads silently, no code runs from checkpoint bytes."""

from __future__ import annotations

import os
import pickle

import pytest
from hypothesis import given
from hypothesis import strategies as st

from faults.inject import Action, FaultSpec, patch_os
from faults.strategies import damage_pointer, damage_step, payload_files, run_configs
from faults.training import _errors, RunConfig, TrainRun, reference_digest

from ._common import Stats, assert_resumed, budget, make, resume, step_path

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
CFG = RunConfig()


def _save_steps(ck, root: str, cfg: RunConfig, steps, save_async: bool = False) -> TrainRun:
    run = TrainRun(cfg)
    for s in steps:
        run.train_to(s)
        ck.save(root, run.state(), global_step=s, save_async=save_async)
        ck.maybe_wait_for_async_save()
    return run


def test_resume_lands_on_newest_complete_step(checkpointer_factory, tmp_path_factory, request):
    """Save several steps, damage some (missing commit record, missing or truncated payload),
    damage the pointer: resume must pick the newest undamaged step and restore it bitwise."""

    stats = Stats(request)

    @budget(request)
    @given(steps=st.lists(st.integers(0, 40), min_size=1, max_size=4, unique=True).map(sorted), data=st.data())
    def prop(steps, data):
        stats.add("examples")
        root = str(tmp_path_factory.mktemp("root"))
        ck = checkpointer_factory()
        _save_steps(ck, root, CFG, steps)
        damaged = data.draw(st.sets(st.sampled_from(steps)), label="damaged")
        for s in sorted(damaged):
            damage_step(step_path(root, s), data.draw(st.sampled_from(
                ["missing_commit", "missing_payload", "truncated_payload", "missing_extra_state"]), label=f"damage {s}"))
        how = data.draw(st.sampled_from(["keep", "absent", "empty", "torn", "garbage", "nul", "dangling", "stale"]), label="pointer")
        if how != "keep":
            damage_pointer(root, how, steps)
        good = [s for s in steps if s not in damaged]
        path, run = resume(checkpointer_factory(), root, CFG)
        assert_resumed(path, run, root, good[-1] if good else None, CFG, f"steps {steps}, damaged {sorted(damaged)}, pointer {how}: ")

    prop()


@pytest.mark.parametrize("how", ["missing_commit", "missing_payload", "truncated_payload", "missing_extra_state"])
def test_each_kind_of_damage_falls_back_to_the_previous_step(checkpointer_factory, tmp_path, how):
    """Every damage kind on its own, deterministically (the property above mixes them at random)."""
    root = str(tmp_path)
    _save_steps(checkpointer_factory(), root, CFG, [1, 2])
    damage_step(step_path(root, 2), how)
    assert_resumed(*resume(checkpointer_factory(), root, CFG), root, 1, CFG, f"step 2 {how}: ")


@pytest.mark.parametrize("how", ["absent", "empty", "torn", "garbage", "nul", "dangling", "stale"])
def test_each_kind_of_pointer_damage_still_finds_the_newest_step(checkpointer_factory, tmp_path, how):
    root = str(tmp_path)
    _save_steps(checkpointer_factory(), root, CFG, [1, 12])
    damage_pointer(root, how, [1, 12])
    assert_resumed(*resume(checkpointer_factory(), root, CFG), root, 12, CFG, f"pointer {how}: ")


def test_round_trip_is_bitwise(checkpointer_factory, tmp_path_factory, request):
    """Generated models (shapes, frozen, tied, never-a-gradient parameters), one to three
    optimizers, fp32/bf16/fp16 with or without fp32 main parameters, sync or async, into a
    primed or an unprimed fresh optimizer: the resumed state equals an uninterrupted run, and
    so does training continued from it."""

    stats = Stats(request)

    @budget(request, scale=2)
    @given(cfg=run_configs(1), k=st.integers(0, 3), save_async=st.booleans(), unprimed=st.booleans())
    def prop(cfg, k, save_async, unprimed):
        stats.add("examples")
        root = str(tmp_path_factory.mktemp("rt"))
        ck = checkpointer_factory()
        _save_steps(ck, root, cfg, [k], save_async)
        path, run = resume(checkpointer_factory(), root, cfg, unprimed=unprimed)
        assert_resumed(path, run, root, k, cfg)
        run.train_to(k + 2)
        assert run.digest() == reference_digest(cfg, k + 2), "training continued after the resume diverged"

    prop()


@pytest.mark.parametrize("save_async", [False, True], ids=["sync", "async"])
def test_fresh_unprimed_optimizer_gets_every_moment(checkpointer_factory, tmp_path, save_async):
    """A restarted job loads into an optimizer that has never stepped (its state dict has no
    per-parameter entries): exp_avg, exp_avg_sq and step must come back, not stay zero. The
    round-trip property draws this case at random; here it is pinned, so a checkpointer that
    skips an empty optimizer is failed on every run, whatever examples the seed produces."""
    root = str(tmp_path)
    _save_steps(checkpointer_factory(), root, CFG, [3], save_async)
    path, run = resume(checkpointer_factory(), root, CFG, unprimed=True)
    assert_resumed(path, run, root, 3, CFG, "unprimed optimizer: ")
    run.train_to(5)
    assert run.digest() == reference_digest(CFG, 5), "training continued after an unprimed resume diverged"


def test_async_save_holds_values_at_the_call(checkpointer_factory, tmp_path):
    """Training right after an async ``save`` returns (parameters and moments change in place)
    must not leak into the checkpoint."""
    root = str(tmp_path)
    ck = checkpointer_factory()
    run = TrainRun(CFG)
    run.train_to(2)
    ck.save(root, run.state(), global_step=2, save_async=True)
    run.train_to(5)
    ck.maybe_wait_for_async_save()
    assert_resumed(*resume(checkpointer_factory(), root, CFG), root, 2, CFG)


def test_failed_async_save_is_raised_and_never_published(checkpointer_factory, tmp_path):
    """ENOSPC on the first fsync of an async save: the failure must surface (from ``save``,
    ``raise_for_failed_async_save`` or ``maybe_wait_for_async_save``) and resume must still
    land on the previous step."""
    root = str(tmp_path)
    ck = checkpointer_factory()
    run = _save_steps(ck, root, CFG, [1])
    run.train_to(2)
    errors = []
    with patch_os(FaultSpec("fsync", "*", "before", Action.ENOSPC, (0,), 1, "enospc"), 0) as trig:
        try:
            ck.save(root, run.state(), global_step=2, save_async=True)
            if hasattr(ck, "raise_for_failed_async_save"):
                try:
                    ck.raise_for_failed_async_save()
                except _errors() as e:  # noqa: BLE001 - either place may report it
                    errors.append(e)
            ck.maybe_wait_for_async_save()
        except _errors() as e:  # noqa: BLE001
            errors.append(e)
    assert trig.fired, "the save never fsynced a file: nothing to fail"
    assert errors, "an async save that hit ENOSPC was acknowledged (no error from save or maybe_wait_for_async_save)"
    assert_resumed(*resume(checkpointer_factory(), root, CFG), root, 1, CFG, "after a failed async save: ")


def test_saving_over_a_complete_step_is_refused(checkpointer_factory, tmp_path):
    root = str(tmp_path)
    ck = checkpointer_factory()
    run = _save_steps(ck, root, CFG, [2])
    run.train_to(3)
    with pytest.raises(Exception):  # noqa: B017 - any clear error; the point is that it refuses
        ck.save(root, run.state(), global_step=2)
        ck.maybe_wait_for_async_save()
    assert_resumed(*resume(checkpointer_factory(), root, CFG), root, 2, CFG, "after a refused overwrite: ")


def test_overwrite_replaces_the_step_when_asked(checkpointer_factory, tmp_path):
    root = str(tmp_path)
    ck = make(checkpointer_factory, overwrite=True)
    run = _save_steps(ck, root, CFG, [1, 2])
    ck.save(root, run.state(), global_step=2)
    assert_resumed(*resume(checkpointer_factory(), root, CFG), root, 2, CFG)


@pytest.mark.parametrize("keep", [1, 2])
def test_retention_keeps_the_newest_complete_steps(checkpointer_factory, tmp_path, keep):
    root = str(tmp_path)
    ck = make(checkpointer_factory, keep_last=keep)
    _save_steps(ck, root, CFG, [1, 2, 3, 4])
    for s in range(5 - keep, 5):
        assert os.path.isdir(step_path(root, s)), f"keep_last={keep} deleted step {s}, one of the newest {keep}"
    assert_resumed(*resume(checkpointer_factory(), root, CFG), root, 4, CFG)


def test_corrupt_payload_never_loads_silently(checkpointer_factory, tmp_path):
    """A flipped bit in the payload (size intact) must make the load raise, not return wrong data."""
    root = str(tmp_path)
    _save_steps(checkpointer_factory(), root, CFG, [2])
    damage_step(step_path(root, 2), "bitflip_payload")
    run = TrainRun(CFG)
    state = run.state()
    with pytest.raises(Exception):  # noqa: B017 - the checkpointer's own error type
        checkpointer_factory().load(step_path(root, 2), state)


class _Marker:
    """Unpickling this creates a file: proof that checkpoint bytes ran code."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


@pytest.mark.parametrize("target", ["commit_record", "payload"])
def test_no_code_runs_from_checkpoint_bytes(checkpointer_factory, tmp_path, target):
    """The commit record, or every payload file, of the newest step replaced by a pickle
    that would create a file when unpickled: finding and loading must not run it."""
    root = str(tmp_path / "root")
    os.makedirs(root)
    _save_steps(checkpointer_factory(), root, CFG, [1, 2])
    marker = str(tmp_path / "PWNED")
    evil = pickle.dumps(_Marker(marker))
    step = step_path(root, 2)
    victims = [os.path.join(step, n) for n in os.listdir(step) if n.endswith(".metadata")] \
        if target == "commit_record" else payload_files(step)
    for v in victims:
        with open(v, "wb") as f:
            f.write(evil)
    ck = checkpointer_factory()
    try:
        path = ck.find_latest_checkpoint(root)
        if path is not None:
            ck.load(path, TrainRun(CFG).state())
    except _errors():  # noqa: BLE001 - refusing is fine; running the pickle is not
        pass
    assert not os.path.exists(marker), f"loading a crafted {target} executed code from the checkpoint"
