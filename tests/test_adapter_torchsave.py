"""``faults.adapters.torchsave:TorchSave``: a hand-written trainer's ``torch.save`` of one state dict
per step behind the harness contract. The import path and capabilities, a one-process round trip
(sync and "async" saves, both sync), the one file per step, the thin ``find_latest_checkpoint``,
extra state only with a skeleton, ``strict_model`` as ``load_state_dict``'s ``strict``, the two
``weights_only`` choices; a 2-rank round trip in the extended profile."""

from __future__ import annotations

import os
import pickle

import pytest
import torch

from faults.contract import Checkpointer, Limitation, capabilities_of, limitations_of
from faults.training import ModelSpec, OptimSpec, RunConfig, TrainRun, load_factory
from tests import _plain_adapter_fns as fns
from tests._adapter_checks import extra_state_only_with_a_skeleton

torchsave = pytest.importorskip("faults.adapters.torchsave", reason="faults.adapters.torchsave cannot be imported",
                                exc_type=ImportError)
TorchSave = torchsave.TorchSave
SPEC = "faults.adapters.torchsave:TorchSave"

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")

CFG = RunConfig(ModelSpec(tied=True, frozen=True, unused=True), OptimSpec(("adamw", "sgd_momentum")),
                extra_per_rank=False)


def test_factories_declare_limitations_only_and_follow_the_protocol():
    for spec, weights_only in ((SPEC, False), ("faults.adapters.torchsave:TorchSaveWeightsOnly", None)):
        factory = load_factory(spec)
        assert capabilities_of(factory) == frozenset()
        assert isinstance(factory(), Checkpointer)
        assert factory.weights_only is weights_only
        assert limitations_of(factory) == {Limitation.SYNC_ONLY, Limitation.PLAIN_TENSORS_ONLY,
                                           Limitation.NO_COMMIT_RECORD, Limitation.NO_POINTER}
    assert torchsave.PACKAGE == "torch"


def test_one_process_round_trip_is_bitwise(tmp_path):
    """Two steps (the second asked for async: saved synchronously all the same), the newest found
    and loaded into a fresh run: bitwise the uninterrupted run's state at that step."""
    r = fns.round_trip(SPEC, str(tmp_path), CFG)
    assert r["path"] == fns.step_dir(str(tmp_path), 3)
    assert r["listing"] == ["global_step_2", "global_step_3"]  # no pointer, nothing else
    assert os.listdir(r["path"]) == ["checkpoint.pt"]
    assert r["same_dict"] and r["step"] == 3 and r["digest"] == r["reference"]


def test_one_file_holds_the_state_dicts_as_given_and_the_step(tmp_path):
    run = TrainRun(CFG)
    run.train_to(2)
    state = run.state()
    TorchSave().save(fns.step_dir(str(tmp_path), 2), state, global_step=2, save_async=True)
    saved = torch.load(os.path.join(fns.step_dir(str(tmp_path), 2), "checkpoint.pt"), weights_only=True)
    assert sorted(saved) == ["extra_state", "global_step", "model", "optimizer"] and saved["global_step"] == 2
    assert saved["model"].keys() == state["model"].keys()
    assert all(torch.equal(saved["model"][k], v) for k, v in state["model"].items())


def test_find_latest_is_the_highest_step_with_the_file(tmp_path):
    ck = TorchSave()
    assert ck.find_latest_checkpoint(str(tmp_path / "missing")) is None
    assert ck.find_latest_checkpoint(str(tmp_path)) is None
    for name in ("global_step_2", "global_step_10", "global_step_30", "global_step_7x", "step_99"):
        (tmp_path / name).mkdir()
    for name in ("global_step_2", "global_step_10", "global_step_7x", "step_99"):
        (tmp_path / name / "checkpoint.pt").write_bytes(b"")  # nothing is read: an empty file counts
    (tmp_path / "global_step_30" / "checkpoint.pt").mkdir()  # not a file
    assert ck.find_latest_checkpoint(str(tmp_path)) == str(tmp_path / "global_step_10")


def _saved(tmp_path, step=2):
    run = TrainRun(CFG)
    run.train_to(step)
    path = fns.step_dir(str(tmp_path), step)
    TorchSave().save(path, run.state(), global_step=step)
    return path


def test_extra_state_only_with_a_skeleton(tmp_path):
    extra_state_only_with_a_skeleton(TorchSave(), _saved(tmp_path), CFG, 2)


def test_strict_model_is_load_state_dicts_strict(tmp_path):
    path = _saved(tmp_path)
    state = TrainRun(CFG).state(target=True)
    state["model"]["not_in_checkpoint"] = torch.zeros(2)
    with pytest.raises(RuntimeError, match=r"Missing key\(s\) in state_dict: \"not_in_checkpoint\""):
        TorchSave().load(path, state)
    before = state["model"]["out.bias"]
    TorchSave().load(path, state, strict_model=False)
    assert state["model"]["out.bias"] is before  # filled in place, not replaced


class Opaque:
    """An object a trainer keeps in its extra state (a pickled class instance)."""

    def __eq__(self, other):
        return isinstance(other, Opaque)


def test_weights_only_false_unpickles_what_the_safe_loader_refuses(tmp_path):
    run = TrainRun(CFG)
    run.train_to(1)
    state = run.state()
    state["extra_state"]["opaque"] = Opaque()
    path = fns.step_dir(str(tmp_path), 1)
    TorchSave().save(path, state, global_step=1)
    target = TrainRun(CFG).state(target=True)
    TorchSave().load(path, target, extra_state_skeleton={})
    assert target["extra_state"]["opaque"] == Opaque()
    with pytest.raises(pickle.UnpicklingError, match="Weights only load failed"):
        torchsave.TorchSaveWeightsOnly().load(path, TrainRun(CFG).state(target=True), extra_state_skeleton={})


@pytest.mark.extended
def test_two_rank_round_trip(world_factory, tmp_path):
    """Rank 0 writes, both ranks wait at the barrier and both read the one file."""
    results = world_factory.get(2).run(fns.round_trip, SPEC, str(tmp_path), CFG)
    for rank, r in enumerate(results):
        assert r["path"] == fns.step_dir(str(tmp_path), 3), f"rank {rank} resumed {r['path']}"
        assert r["step"] == 3 and r["digest"] == r["reference"], f"rank {rank}"
