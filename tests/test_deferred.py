"""Zero-stall async saves: ``save(..., save_async=True, snapshot="deferred")``.

``save`` returns before copying; the copy into the reused staging buffers runs in the
background. Every test that needs an order between the background copy and the training loop
makes it certain: the copy is held at its ``STAGING`` mark by a gate (``GateIO``) until the test
has done what must land first, and a guard is seen waiting through an event set by
``DeferredCopy.wait`` -- never by sleeping. Without the guards (hooks) the training thread would
never be seen waiting; without the version check a change made before the copy would be saved.
"""

from __future__ import annotations

import concurrent.futures
import os
import sys
import threading

import pytest
import torch

from refckpt import DistributedCheckpointer, get_training_state, set_training_state
from refckpt import errors as E
from refckpt.layout import LATEST_CHECKPOINT_FILE
from refckpt.staging import DeferredCopy, Stager
from tests import _deferred_fns as fns
from tests._deferred_fns import GateIO, build, digest, hooks, resumed_digest, train

pytestmark = pytest.mark.usefixtures("quiet_single_process_warnings")

TIMEOUT = 60  # a bound on a wait that must end (a failure when hit), never a synchronisation


def _state(model, opt, step: int) -> dict:
    return get_training_state(model, opt, {"global_step": step})


@pytest.fixture
def seen_waiting(monkeypatch):
    """Which guard hook waited for the copy first (``_before_forward`` or ``_before_step``), and an
    event set the moment one starts waiting."""
    first = threading.Event()
    callers: list[str] = []
    original = DeferredCopy.wait

    def wait(self):
        callers.append(sys._getframe(1).f_code.co_name)
        first.set()
        original(self)

    monkeypatch.setattr(DeferredCopy, "wait", wait)
    return first, callers


def _trainer(model, opt, steps: range) -> tuple[threading.Thread, list[BaseException]]:
    errors: list[BaseException] = []

    def run() -> None:
        try:
            train(model, opt, steps)
        except BaseException as e:  # noqa: BLE001 - reported by the test
            errors.append(e)

    t = threading.Thread(target=run, name="test-trainer")
    t.start()
    return t, errors


def _error_chain(e: BaseException | None) -> list[BaseException]:
    out = []
    while e is not None:
        out.append(e)
        e = e.__cause__
    return out


@pytest.mark.parametrize("bn", [True, False], ids=["batchnorm", "no_buffers"])
def test_training_continues_at_once_and_the_save_holds_the_values_at_the_call(tmp_path, seen_waiting, bn):
    """save() returns with the copy still pending (held at the gate); training goes on at once in
    another thread. Forward and backward run; with BatchNorm the model's forward first claims and
    copies its subtree's buffers (the running statistics change without a version bump) on the
    training thread, without waiting for the gate; the optimizer step waits for the whole copy.
    Nothing else changed while the copy was pending; the step resumes bitwise to the values at the
    call, and training continued from it equals training continued in place."""
    first_wait, callers = seen_waiting
    root = str(tmp_path)
    model, opt = build(0, bn)
    train(model, opt, range(1, 4))
    at_call = digest(model, opt)
    before = hooks()
    gate = threading.Event()
    io = GateIO(gate)
    ck = DistributedCheckpointer(io=io)
    ck.save(root, _state(model, opt, 3), global_step=3, save_async=True, snapshot="deferred")
    assert hooks() == (before[0] + 1, before[1] + 1), "the guards are installed while the copy is pending"
    assert not os.path.exists(tmp_path / "global_step_3")
    trainer, errors = _trainer(model, opt, range(4, 7))
    try:
        assert first_wait.wait(TIMEOUT), "no guard waited for the pending copy"
        assert callers[0] == "_before_step", callers
        # forward and backward ran during the pending copy: every gradient is there
        assert all(p.grad is not None for p in model.parameters())
        buffers = ["1.running_mean", "1.running_var", "1.num_batches_tracked"] if bn else []
        assert sorted(ck._deferred.claimed) == sorted(f"model.{b}" for b in buffers), "the forward claimed no buffer"
        now = digest(model, opt)
        assert {k for k in at_call if now[k] != at_call[k]} == {f"model/{b}" for b in buffers}, (
            "the training loop changed saved state other than the claimed buffers while the copy was pending")
        assert trainer.is_alive()
    finally:
        gate.set()
        trainer.join(TIMEOUT)
    assert not trainer.is_alive() and not errors, errors
    ck.maybe_wait_for_async_save()
    assert hooks() == before, "the guards outlived the save"
    continued = digest(model, opt)
    assert continued != at_call
    path, loaded, model2, opt2 = resumed_digest(root, ck, bn=bn)
    assert path == str(tmp_path / "global_step_3")
    assert loaded == at_call
    train(model2, opt2, range(4, 7))
    assert digest(model2, opt2) == continued
    ck.close()


def test_back_to_back_deferred_saves_reuse_the_buffers_and_each_holds_its_values(tmp_path):
    """Several deferred saves in a row, training right after each (not gated: the guards decide
    the order): every step resumes bitwise to its values at the call; the host buffers are reused."""
    root = str(tmp_path)
    model, opt = build()
    ck = DistributedCheckpointer()
    at: dict[int, dict] = {}
    bufs = None
    for s in (2, 4, 6):
        train(model, opt, range(s - 1, s + 1))
        at[s] = digest(model, opt)
        ck.save(root, _state(model, opt, s), global_step=s, save_async=True, snapshot="deferred")
        train(model, opt, range(100 + s, 102 + s))  # steps and forwards right after save returns
        ck.maybe_wait_for_async_save()
        if bufs is None:
            bufs = {k: v.data_ptr() for k, v in ck._stager._bufs.items()}
        else:
            assert {k: v.data_ptr() for k, v in ck._stager._bufs.items()} == bufs, "staging buffers not reused"
    for s in (2, 4, 6):
        m, o = build(9)
        state = get_training_state(m, o, {})
        ck.load(str(tmp_path / f"global_step_{s}"), state)
        set_training_state(m, o, state)
        assert digest(m, o) == at[s], s
    ck.close()


@pytest.mark.parametrize("how", ["no_grad_mul", "view_of_detach", "optimizer_state", "buffer_in_place"])
def test_an_in_place_change_before_the_copy_fails_the_save_and_publishes_nothing(tmp_path, how):
    """A change outside optimizer.step/forward, made while the copy is held at the gate (so
    surely before it), fails the save loudly, naming the tensor and the fix; nothing of the step
    appears, the previous step stays the newest complete one and resumes bitwise."""
    root = str(tmp_path)
    model, opt = build()
    train(model, opt, range(1, 3))
    gate = threading.Event()
    ck = DistributedCheckpointer(io=GateIO(gate))
    ck.save(root, _state(model, opt, 2), global_step=2)
    saved2 = digest(model, opt)
    train(model, opt, range(3, 5))
    before = hooks()
    ck.save(root, _state(model, opt, 4), global_step=4, save_async=True, snapshot="deferred")
    w, bn = model[0].weight, model[1]
    if how == "no_grad_mul":
        with torch.no_grad():
            w.mul_(2.0)
        key = "model.0.weight"
    elif how == "view_of_detach":
        w.detach().view(-1)[0] = 5.0
        key = "model.0.weight"
    elif how == "optimizer_state":
        opt.state[w]["exp_avg"].add_(1.0)
        key = "optimizer.state.0.weight.exp_avg"
    else:
        bn.running_mean.add_(1.0)  # a user's in-place op on a buffer: not a forward, so not waited for
        key = "model.1.running_mean"
    gate.set()
    with pytest.raises(E.AsyncSaveFailedError) as info:
        ck.maybe_wait_for_async_save()
    msg = str(info.value)
    assert repr(key) in msg and "maybe_wait_for_async_save()" in msg and "snapshot='copy'" in msg, msg
    assert "Nothing was published" in msg, msg
    assert any(isinstance(e, E.SnapshotChangedError) for e in _error_chain(info.value))
    assert hooks() == before
    assert sorted(os.listdir(root)) == ["global_step_2", LATEST_CHECKPOINT_FILE]
    assert (tmp_path / LATEST_CHECKPOINT_FILE).read_text() == "2\n"
    path, loaded, _m, _o = resumed_digest(root, ck)
    assert path == str(tmp_path / "global_step_2") and loaded == saved2
    ck.close()


def test_the_failure_is_reported_by_raise_for_failed_async_save_once(tmp_path):
    root = str(tmp_path)
    model, opt = build()
    train(model, opt, range(1, 3))
    gate = threading.Event()
    ck = DistributedCheckpointer(io=GateIO(gate))
    before = hooks()
    ck.save(root, _state(model, opt, 2), global_step=2, save_async=True, snapshot="deferred")
    ck.raise_for_failed_async_save()  # held at the gate: neither blocks nor raises
    assert hooks() == (before[0] + 1, before[1] + 1), "removed while the copy is pending"
    with torch.no_grad():
        model[3].bias.zero_()
    gate.set()
    concurrent.futures.wait([ck._pending], timeout=TIMEOUT)
    with pytest.raises(E.AsyncSaveFailedError, match=r"'model\.3\.bias'"):
        ck.raise_for_failed_async_save()
    assert hooks() == before
    ck.maybe_wait_for_async_save()  # reported once
    ck.raise_for_failed_async_save()
    assert os.listdir(root) == []
    ck.close()


def test_a_change_while_the_copy_runs_is_caught(tmp_path, monkeypatch):
    """The versions are read after the copy has ended: a change that lands after a tensor's bytes
    were read, before the check (a racing in-place op, made certain here by doing it inside the
    copy), fails the save."""
    root = str(tmp_path)
    model, opt = build()
    train(model, opt, range(1, 3))
    original = Stager._copy

    def copy_then_change(self, plan):
        out = original(self, plan)
        with torch.no_grad():
            model[0].bias.add_(1.0)
        return out

    monkeypatch.setattr(Stager, "_copy", copy_then_change)
    ck = DistributedCheckpointer()
    ck.save(root, _state(model, opt, 2), global_step=2, save_async=True, snapshot="deferred")
    with pytest.raises(E.AsyncSaveFailedError, match=r"'model\.0\.bias'"):
        ck.maybe_wait_for_async_save()
    assert os.listdir(root) == []
    ck.close()


def test_guards_are_removed_after_the_copy_and_by_close(tmp_path):
    """The global hooks exist only while a deferred copy is pending (and until the caller's thread
    next calls into the checkpointer): never after maybe_wait_for_async_save, raise_for_failed_async_save
    of a finished save, or close."""
    root = str(tmp_path)
    model, opt = build()
    train(model, opt, range(1, 3))
    before = hooks()
    ck = DistributedCheckpointer()
    ck.save(root, _state(model, opt, 1), global_step=1, save_async=True, snapshot="deferred")
    concurrent.futures.wait([ck._pending], timeout=TIMEOUT)
    ck.raise_for_failed_async_save()
    assert hooks() == before
    ck.save(root, _state(model, opt, 2), global_step=2, save_async=True, snapshot="deferred")
    ck.close()
    assert hooks() == before
    gate = threading.Event()
    ck = DistributedCheckpointer(io=GateIO(gate), async_snapshot="deferred")
    ck.save(root, _state(model, opt, 3), global_step=3, save_async=True)  # the constructor's default
    assert hooks() == (before[0] + 1, before[1] + 1)
    gate.set()
    ck.maybe_wait_for_async_save()
    assert hooks() == before
    ck.save(root, _state(model, opt, 4), global_step=4)  # a sync save ignores the async default
    assert hooks() == before
    assert sorted(os.listdir(root))[:4] == ["global_step_1", "global_step_2", "global_step_3", "global_step_4"]
    ck.close()


def test_default_async_save_is_unchanged_copy_mode(tmp_path):
    """The default snapshot is the copy: no hooks, and anything may change once save returns."""
    root = str(tmp_path)
    model, opt = build()
    train(model, opt, range(1, 3))
    at_call = digest(model, opt)
    before = hooks()
    ck = DistributedCheckpointer()
    assert ck.async_snapshot == "copy"
    ck.save(root, _state(model, opt, 2), global_step=2, save_async=True)
    assert hooks() == before
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(0).add_(3.0)
    ck.maybe_wait_for_async_save()
    assert resumed_digest(root, ck)[1] == at_call
    ck.close()


@pytest.mark.parametrize("kwargs,match", [
    ({"save_async": True, "snapshot": "lazy"}, r"snapshot='lazy'"),
    ({"snapshot": "deferred"}, r"async saves only"),
    ({"snapshot": "copy"}, r"async saves only"),
])
def test_snapshot_option_is_checked_before_anything_is_written(tmp_path, kwargs, match):
    model, opt = build()
    ck = DistributedCheckpointer()
    with pytest.raises(E.ConfigError, match=match):
        ck.save(str(tmp_path / "root"), _state(model, opt, 1), global_step=1, **kwargs)
    assert not (tmp_path / "root").exists()


def test_constructor_refuses_an_unknown_snapshot_mode():
    with pytest.raises(E.ConfigError, match=r"async_snapshot='eager'"):
        DistributedCheckpointer(async_snapshot="eager")


def test_capability_is_declared():
    from faults.contract import Capability, capabilities_of

    assert Capability.DEFERRED_SNAPSHOT in capabilities_of(DistributedCheckpointer)


# -- in a world ------------------------------------------------------------------------------------
@pytest.mark.parametrize("world_size", [2])
def test_deferred_round_trip_in_a_world(world_factory, tmp_path, world_size):
    results = world_factory.get(world_size).run(fns.round_trip, str(tmp_path))
    for rank, r in enumerate(results):
        assert r["path"] == str(tmp_path / "global_step_3"), rank
        assert r["loaded"] == r["at_call"], rank
        assert r["continued"] != r["at_call"]
        assert r["resumed_continued"] == r["continued"], rank
        assert r["hooks_after_wait"] == (0, 0), rank


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("embedded", [False, True], ids=["per_rank_extra", "embedded_extra"])
def test_save_makes_no_collective_call_on_the_callers_path(world_factory, tmp_path, world_size, embedded):
    """Zero stall at any world size: rank 0's deferred save returns before the other ranks call
    theirs (a collective on its path would hang it until the 20 s timeout), and the step then
    commits and resumes bitwise on every rank."""
    results = world_factory.get(world_size).run(fns.returns_before_the_other_ranks_call, str(tmp_path), embedded, False)
    assert results[0]["returned_first"]
    for rank, r in enumerate(results):
        assert r["raised"] is None, (rank, r["raised"])
        assert r["path"] == str(tmp_path / "global_step_3") and r["loaded_ok"], (rank, r)


@pytest.mark.parametrize("world_size", [2])
def test_an_error_of_the_staging_moved_off_the_callers_path_comes_from_the_wait(world_factory, tmp_path, world_size):
    """Step 3 is complete and overwrite is off: the deferred save's staging (in the background)
    refuses, and every rank's wait raises it; the complete step stays as it was."""
    results = world_factory.get(world_size).run(fns.returns_before_the_other_ranks_call, str(tmp_path), False, True)
    for rank, r in enumerate(results):
        assert r["raised"] and r["raised"].startswith("AsyncSaveFailedError") and "global_step_3" in r["raised"], (
            rank, r["raised"])
        assert r["path"] == str(tmp_path / "global_step_3") and r["loaded_ok"], (rank, r)


@pytest.mark.parametrize("world_size", [2])
@pytest.mark.parametrize("bad_rank", [0, 1])
def test_a_change_on_one_rank_fails_the_save_on_every_rank(world_factory, tmp_path, world_size, bad_rank):
    results = world_factory.get(world_size).run(fns.one_rank_changes_a_tensor, str(tmp_path), bad_rank)
    for rank, r in enumerate(results):
        assert r["raised"] and r["raised"].startswith("AsyncSaveFailedError"), (rank, r)
        assert f"found on rank {bad_rank}" in r["raised"] and "'model.0.weight'" in r["raised"], (rank, r["raised"])
        assert r["hooks"] == (0, 0), rank
        assert r["entries"] == ["global_step_2", LATEST_CHECKPOINT_FILE], (rank, r["entries"])
        assert r["path"] == str(tmp_path / "global_step_2") and r["loaded_ok"], rank


@pytest.mark.parametrize("world_size", [2])
@pytest.mark.parametrize("bad_rank", [None, 1], ids=["training_goes_on", "rank1_changes_its_shard"])
def test_fsdp2_shards(world_factory, tmp_path, world_size, bad_rank):
    """DTensor/FSDP2: the local shard is what is copied and version-checked."""
    results = world_factory.get(world_size).run(fns.fsdp2, str(tmp_path), bad_rank)
    for rank, r in enumerate(results):
        assert r["hooks"] == (0, 0), rank
        if bad_rank is None:
            assert r["raised"] is None, (rank, r["raised"])
            assert r["path"] == str(tmp_path / "global_step_3"), rank
        else:
            assert r["raised"] and f"found on rank {bad_rank}" in r["raised"] and "'model.0.weight'" in r["raised"], (
                rank, r["raised"])
            assert r["entries"] == [], (rank, r["entries"])
    if bad_rank is None:
        assert results[0]["same"] is True
