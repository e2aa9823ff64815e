"""``faults.adapters.dcp:PlainDCP``: plain ``torch.distributed.checkpoint`` behind the harness
contract. Round trips in one process (sync and async saves) and in a 2-rank gloo world from
``faults.plugin``'s ``world_factory``, the thin ``find_latest_checkpoint``, extra state only
with a skeleton, async failures raised once, and the import path."""

from __future__ import annotations

import importlib
import os
import sys

import pytest

pytest.importorskip("torch.distributed.checkpoint", reason="plain DCP ships with torch; torch is not importable here")

from torch.distributed.checkpoint.api import CheckpointException  # noqa: E402  (a BaseException)

from faults.adapters import Unavailable  # noqa: E402
from faults.contract import Checkpointer, capabilities_of  # noqa: E402
from faults.training import ModelSpec, OptimSpec, RunConfig, TrainRun, load_factory  # noqa: E402
from tests import _dcp_adapter_fns as fns  # noqa: E402
from tests._adapter_checks import extra_state_only_with_a_skeleton  # noqa: E402

dcp_adapter = pytest.importorskip("faults.adapters.dcp", reason="faults.adapters.dcp cannot be imported",
                                  exc_type=ImportError)
PlainDCP = dcp_adapter.PlainDCP

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")

EMBEDDED = RunConfig(ModelSpec(), OptimSpec(("adamw", "sgd_momentum")), extra_per_rank=False)


def test_factory_declares_nothing_and_follows_the_protocol():
    factory = load_factory("faults.adapters.dcp:PlainDCP")
    assert factory is PlainDCP
    assert capabilities_of(factory) == frozenset()
    assert isinstance(factory(), Checkpointer)
    assert dcp_adapter.PACKAGE == "torch"


@pytest.mark.parametrize("save_async", [False, True], ids=["sync", "async"])
def test_one_process_round_trip(tmp_path, save_async):
    r = fns.round_trip(str(tmp_path), EMBEDDED, save_async)
    assert r["path"] == fns.step_dir(str(tmp_path), 3)
    assert r["same_dict"]
    assert r["step"] == 3 and r["digest"] == r["reference"]


def test_mixed_sync_and_async_saves_and_bf16_main_params(tmp_path):
    """A sync save, then async saves, over a bf16 model with fp32 main parameters (the
    ``fp32_main_params`` branch) and tied weights: the newest step comes back bitwise."""
    cfg = RunConfig(ModelSpec(dtype="bfloat16", tied=True), OptimSpec(("adamw",), main_fp32=True),
                    extra_per_rank=False)
    root = str(tmp_path)
    run, ck = TrainRun(cfg), PlainDCP()
    for s, asynchronous in ((1, False), (2, True), (4, True)):
        run.train_to(s)
        ck.save(fns.step_dir(root, s), run.state(), global_step=s, save_async=asynchronous)
    run.train_to(6)  # training goes on while the last async save persists
    ck.maybe_wait_for_async_save()
    assert sorted(os.listdir(root)) == ["global_step_1", "global_step_2", "global_step_4"]
    fresh = TrainRun(cfg)
    path = PlainDCP().find_latest_checkpoint(root)
    assert path == fns.step_dir(root, 4)
    state = fresh.state(target=True)
    skeleton = state.pop("extra_state")
    fresh.apply(PlainDCP().load(path, state, extra_state_skeleton=skeleton))
    assert fresh.step == 4 and fresh.digest() == fns.reference_digest(cfg, 4)


def test_two_rank_round_trip(world_factory, tmp_path):
    """Sync and async saves in a 2-rank gloo world. Each async save is waited for before
    training goes on (``overlap=False``): DCP's ``async_save`` runs its collectives from a
    background thread on the default process group, and with training collectives on that
    same gloo group at the same time both ranks deadlock -- a finding about plain DCP that the
    suite reports, not something this round trip is about."""
    for save_async in (False, True):
        root = str(tmp_path / ("async" if save_async else "sync"))
        results = world_factory.get(2).run(fns.round_trip, root, EMBEDDED, save_async, (2, 3), 2, False)
        for rank, r in enumerate(results):
            assert r["path"] == fns.step_dir(root, 3), f"rank {rank} ({save_async=}) resumed {r['path']}"
            assert r["step"] == 3 and r["digest"] == r["reference"], (
                f"rank {rank} ({save_async=}): restored state differs from the uninterrupted run")


def test_two_rank_fsdp2_round_trip(world_factory, tmp_path):
    cfg = RunConfig(ModelSpec(depth=2), OptimSpec(("adam_amsgrad",)), sharding="fsdp2", extra_per_rank=False)
    results = world_factory.get(2).run(fns.round_trip, str(tmp_path), cfg, True, (3,), 1, False)
    for rank, r in enumerate(results):
        assert r["path"] == fns.step_dir(str(tmp_path), 3)
        assert r["step"] == 3 and r["digest"] == r["reference"], f"rank {rank}"


# -- find_latest_checkpoint: the one piece of logic the adapter supplies ----------------------


def test_find_latest_is_the_highest_step_with_dcp_metadata(tmp_path):
    ck = PlainDCP()
    assert ck.find_latest_checkpoint(str(tmp_path / "missing")) is None
    assert ck.find_latest_checkpoint(str(tmp_path)) is None
    for name in ("global_step_2", "global_step_10", "global_step_30", "global_step_7x", "step_99", "global_step_50"):
        (tmp_path / name).mkdir()
    for name in ("global_step_2", "global_step_10", "global_step_7x", "step_99"):
        (tmp_path / name / ".metadata").write_bytes(b"")
    (tmp_path / "global_step_50" / ".metadata").mkdir()  # not a file
    (tmp_path / "global_step_99").write_bytes(b"")  # not a directory
    # numeric order (10 > 2), no metadata in 30/50: skipped; nothing is read or validated
    assert ck.find_latest_checkpoint(str(tmp_path)) == str(tmp_path / "global_step_10")


# -- extra state, load options ----------------------------------------------------------------


def _saved(tmp_path, steps=(2,)):
    root = str(tmp_path)
    run, ck = TrainRun(EMBEDDED), PlainDCP()
    for s in steps:
        run.train_to(s)
        ck.save(fns.step_dir(root, s), run.state(), global_step=s)
    return root, run


def test_extra_state_only_with_a_skeleton(tmp_path):
    root, _ = _saved(tmp_path)
    extra_state_only_with_a_skeleton(PlainDCP(), fns.step_dir(root, 2), EMBEDDED, 2)


def test_strict_model_maps_to_dcp_partial_load(tmp_path):
    root, _ = _saved(tmp_path)
    path = fns.step_dir(root, 2)
    state = TrainRun(EMBEDDED).state(target=True)
    state.pop("extra_state")
    state["model"]["not_in_checkpoint"] = state["model"]["out.bias"].clone()
    # DCP raises its CheckpointException (a BaseException, not an Exception) wrapping the error
    with pytest.raises(BaseException, match="Missing key in checkpoint state_dict: model.not_in_checkpoint"):
        PlainDCP().load(path, state)
    PlainDCP().load(path, state, strict_model=False)  # DefaultLoadPlanner(allow_partial_load=True)


# -- async failures ---------------------------------------------------------------------------


def _failing_async_save(tmp_path):
    """An async save whose step directory cannot be created (its parent is a file)."""
    blocker = tmp_path / "blocker"
    blocker.write_bytes(b"")
    run, ck = TrainRun(EMBEDDED), PlainDCP()
    run.train_to(1)
    ck.save(str(blocker / "global_step_1"), run.state(), global_step=1, save_async=True)
    return ck, run


def test_async_failure_raises_from_the_wait_once(tmp_path):
    ck, _ = _failing_async_save(tmp_path)
    with pytest.raises(BaseException) as e:  # DCP's CheckpointException is not an Exception
        ck.maybe_wait_for_async_save()
    assert not isinstance(e.value, (KeyboardInterrupt, SystemExit))
    ck.maybe_wait_for_async_save()  # raised once; nothing pending now
    ck.raise_for_failed_async_save()


def test_async_failure_raises_from_the_poll_once_done(tmp_path):
    ck, _ = _failing_async_save(tmp_path)
    future = ck._future
    assert future is not None
    future.exception()  # block until the background save has ended (without consuming anything)
    with pytest.raises(CheckpointException):
        ck.raise_for_failed_async_save()
    ck.raise_for_failed_async_save()
    ck.maybe_wait_for_async_save()


def test_async_failure_raises_from_the_next_save(tmp_path):
    ck, run = _failing_async_save(tmp_path)
    with pytest.raises(CheckpointException):
        ck.save(fns.step_dir(str(tmp_path), 2), run.state(), global_step=2)
    assert PlainDCP().find_latest_checkpoint(str(tmp_path)) is None  # the failed save wrote nothing


def test_raise_for_failed_leaves_a_running_save_alone(tmp_path):
    import threading

    gate = threading.Event()

    class Pending:  # a future that has not finished
        def done(self):
            return gate.is_set()

        def result(self):
            raise AssertionError("result() of a running save")

    ck = PlainDCP()
    ck._future = Pending()
    ck.raise_for_failed_async_save()
    assert ck._future is not None


# -- import ----------------------------------------------------------------------------------


def test_missing_dcp_raises_unavailable(monkeypatch):
    """DCP ships with torch, so the only availability check is the import itself; if it failed,
    the adapter would say so with an :class:`Unavailable` naming torch."""
    monkeypatch.setitem(sys.modules, "torch.distributed.checkpoint", None)
    monkeypatch.delitem(sys.modules, "faults.adapters.dcp")
    with pytest.raises(Unavailable, match=r"torch\.distributed\.checkpoint.*torch==2\.13"):
        importlib.import_module("faults.adapters.dcp")
