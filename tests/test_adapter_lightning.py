"""``faults.adapters.lightning:LightningFabric``: Lightning 2.6.6's ``Fabric.save`` / ``Fabric.load``
behind the harness contract. The import path and capabilities, a one-process round trip, the one
file per step, extra state only with a skeleton, ``strict_model`` as Fabric's ``strict``; a 2-rank
round trip (Fabric's DDP strategy over the live group) in the extended profile.

``lightning`` is imported by the fixture below, not at collection: it imports torchmetrics
(about 2 CPU s), and every xdist worker collects every module."""

from __future__ import annotations

import importlib
import os
import sys
from typing import Any

import pytest
import torch

from faults.adapters import Unavailable
from faults.contract import Checkpointer, Limitation, capabilities_of, limitations_of
from faults.training import ModelSpec, OptimSpec, RunConfig, TrainRun, load_factory
from tests import _plain_adapter_fns as fns
from tests._adapter_checks import extra_state_only_with_a_skeleton

SPEC = "faults.adapters.lightning:LightningFabric"
INSTALL = "pip install --no-deps 'lightning==2.6.6' 'lightning-utilities==0.15.3' 'torchmetrics==1.9.0'"
adapter: Any = None


@pytest.fixture(scope="module", autouse=True)
def _lightning() -> None:
    global adapter
    adapter = pytest.importorskip("faults.adapters.lightning", exc_type=ImportError,
                                  reason=f"faults.adapters.lightning cannot be imported ({INSTALL})")


# One xdist worker for the module: Lightning's import costs about 2 CPU s in the worker and again in each rank, so
# spread over `pytest -n 8`'s workers it was paid once per worker and per world.
pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning",
                                        "ignore::DeprecationWarning"),
              pytest.mark.xdist_group("peer-lightning")]

CFG = RunConfig(ModelSpec(tied=True, frozen=True, unused=True), OptimSpec(("adamw", "sgd_momentum")),
                extra_per_rank=False)


def test_factory_declares_limitations_only_and_follows_the_protocol():
    factory = load_factory(SPEC)
    assert factory is adapter.LightningFabric
    assert capabilities_of(factory) == frozenset()
    assert limitations_of(factory) == {Limitation.SYNC_ONLY, Limitation.PLAIN_TENSORS_ONLY,
                                       Limitation.NO_COMMIT_RECORD, Limitation.NO_POINTER}
    assert isinstance(factory(), Checkpointer)
    assert adapter.PACKAGE == "lightning"


def test_one_process_round_trip_is_bitwise(tmp_path):
    r = fns.round_trip(SPEC, str(tmp_path), CFG)
    assert r["path"] == fns.step_dir(str(tmp_path), 3)
    assert r["listing"] == ["global_step_2", "global_step_3"]
    assert os.listdir(r["path"]) == ["checkpoint.ckpt"]
    assert r["same_dict"] and r["step"] == 3 and r["digest"] == r["reference"]
    saved = torch.load(os.path.join(r["path"], "checkpoint.ckpt"), weights_only=True)  # Fabric's own format
    assert sorted(saved) == ["extra_state", "global_step", "model", "optimizer"] and saved["global_step"] == 3
    # find-latest: the highest step whose file is there; nothing is read
    os.makedirs(fns.step_dir(str(tmp_path), 9))
    assert adapter.LightningFabric().find_latest_checkpoint(str(tmp_path)) == r["path"]


def test_extra_state_only_with_a_skeleton_and_strict_is_fabrics(tmp_path):
    run = TrainRun(CFG)
    run.train_to(2)
    path = fns.step_dir(str(tmp_path), 2)
    adapter.LightningFabric().save(path, run.state(), global_step=2)
    extra_state_only_with_a_skeleton(adapter.LightningFabric(), path, CFG, 2)
    state = TrainRun(CFG).state(target=True)
    state["model"]["not_in_checkpoint"] = torch.zeros(2)
    with pytest.raises(RuntimeError, match=r"Missing key\(s\) in state_dict: \"not_in_checkpoint\""):
        adapter.LightningFabric().load(path, state)  # module.load_state_dict(strict=True), Fabric's call
    before = state["model"]["out.bias"]
    adapter.LightningFabric().load(path, state, strict_model=False)
    assert state["model"]["out.bias"] is before  # filled in place


def test_missing_lightning_raises_unavailable(monkeypatch):
    monkeypatch.setitem(sys.modules, "lightning.fabric", None)
    monkeypatch.delitem(sys.modules, "faults.adapters.lightning")
    with pytest.raises(Unavailable, match=r"lightning==2\.6\.6.*pip install --no-deps 'lightning==2\.6\.6'"):
        importlib.import_module("faults.adapters.lightning")


@pytest.mark.extended
def test_two_rank_round_trip(world_factory, tmp_path):
    """Fabric's DDP strategy over the harness's live group: rank 0 writes, Fabric's barrier, both
    ranks read."""
    results = world_factory.get(2).run(fns.round_trip, SPEC, str(tmp_path), CFG)
    for rank, r in enumerate(results):
        assert r["path"] == fns.step_dir(str(tmp_path), 3), f"rank {rank} resumed {r['path']}"
        assert r["step"] == 3 and r["digest"] == r["reference"], f"rank {rank}"
