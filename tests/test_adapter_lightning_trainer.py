"""``faults.adapters.lightning_trainer:LightningTrainer``: Lightning 2.6.6's Trainer checkpointing
(``ModelCheckpoint(save_top_k)`` through ``Trainer.save_checkpoint``, restore through
``ckpt_path=``) behind the harness contract. The capabilities, a one-process round trip in
Lightning's own file format, ``save_top_k`` as ``keep_last`` (the files and directories that fell out
of the top k are gone), extra state only with a skeleton, ``strict_model`` as the module's
``strict_loading``; a 2-rank round trip (the DDP strategy over the live group) in the extended profile.

``lightning`` is imported by the fixture below, not at collection (it imports torchmetrics)."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

from faults.contract import Capability, Checkpointer, Limitation, capabilities_of, limitations_of
from faults.training import ModelSpec, OptimSpec, RunConfig, TrainRun, load_factory
from tests import _plain_adapter_fns as fns
from tests._adapter_checks import extra_state_only_with_a_skeleton

SPEC = "faults.adapters.lightning_trainer:LightningTrainer"
INSTALL = "pip install --no-deps 'lightning==2.6.6' 'lightning-utilities==0.15.3' 'torchmetrics==1.9.0'"
adapter: Any = None


@pytest.fixture(scope="module", autouse=True)
def _lightning() -> None:
    global adapter
    adapter = pytest.importorskip("faults.adapters.lightning_trainer", exc_type=ImportError,
                                  reason=f"faults.adapters.lightning_trainer cannot be imported ({INSTALL})")


# One xdist worker for the module: Lightning's import costs about 2 CPU s in the worker and again in each rank, so
# spread over `pytest -n 8`'s workers it was paid once per worker and per world.
pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning",
                                        "ignore::DeprecationWarning"),
              pytest.mark.xdist_group("peer-lightning")]

CFG = RunConfig(ModelSpec(tied=True, frozen=True, unused=True), OptimSpec(("adamw", "sgd_momentum")),
                extra_per_rank=False)


def test_factory_declares_keep_last_and_its_limitations():
    factory = load_factory(SPEC)
    assert factory is adapter.LightningTrainer
    assert capabilities_of(factory) == frozenset({Capability.KEEP_LAST})
    assert limitations_of(factory) == {Limitation.SYNC_ONLY, Limitation.PLAIN_TENSORS_ONLY,
                                       Limitation.NO_COMMIT_RECORD, Limitation.NO_POINTER}
    assert isinstance(factory(), Checkpointer)
    with pytest.raises(ValueError, match="keep_last must be >= 1"):
        factory(keep_last=0)


def test_one_process_round_trip_is_lightnings_own_checkpoint(tmp_path):
    r = fns.round_trip(SPEC, str(tmp_path), CFG)
    assert r["path"] == fns.step_dir(str(tmp_path), 3)
    assert r["listing"] == ["global_step_2", "global_step_3"]
    assert os.listdir(r["path"]) == ["checkpoint.ckpt"]
    assert r["same_dict"] and r["step"] == 3 and r["digest"] == r["reference"]
    saved = torch.load(os.path.join(r["path"], "checkpoint.ckpt"), weights_only=False)  # the Trainer's dict
    assert {"state_dict", "callbacks", "pytorch-lightning_version", "optimizer", "extra_state"} <= set(saved)
    assert sorted(saved["state_dict"]) == sorted(f"model.{k}" for k in TrainRun(CFG).state()["model"])
    (cb_state,) = [v for k, v in saved["callbacks"].items() if k.startswith("ModelCheckpoint")]
    assert cb_state["best_model_path"].endswith("global_step_3/checkpoint.ckpt")  # ModelCheckpoint's bookkeeping


def test_save_top_k_is_keep_last_and_removes_what_fell_out(tmp_path):
    run, ck = TrainRun(CFG), adapter.LightningTrainer(keep_last=2)
    for s in (1, 2, 3, 4):
        run.train_to(s)
        ck.save(fns.step_dir(str(tmp_path), s), run.state(), global_step=s)
    assert sorted(os.listdir(tmp_path)) == ["global_step_3", "global_step_4"]
    # without keep_last: save_top_k=-1 keeps every step
    root = tmp_path / "all"
    ck = adapter.LightningTrainer()
    for s in (1, 2, 3):
        run.train_to(s)
        ck.save(fns.step_dir(str(root), s), run.state(), global_step=s)
    assert sorted(os.listdir(root)) == ["global_step_1", "global_step_2", "global_step_3"]
    with pytest.raises(ValueError, match="ModelCheckpoint names the file"):
        ck.save(str(root / "elsewhere"), run.state(), global_step=4)
    assert sorted(os.listdir(root)) == ["global_step_1", "global_step_2", "global_step_3"]


def test_extra_state_only_with_a_skeleton_and_strict_is_strict_loading(tmp_path):
    run = TrainRun(CFG)
    run.train_to(2)
    path = fns.step_dir(str(tmp_path), 2)
    adapter.LightningTrainer().save(path, run.state(), global_step=2)
    extra_state_only_with_a_skeleton(adapter.LightningTrainer(), path, CFG, 2)
    state = TrainRun(CFG).state(target=True)
    state["model"]["not_in_checkpoint"] = torch.zeros(2)
    with pytest.raises(RuntimeError, match=r"Missing key\(s\) in state_dict: \"model\.not_in_checkpoint\""):
        adapter.LightningTrainer().load(path, state)
    before = state["model"]["out.bias"]
    adapter.LightningTrainer().load(path, state, strict_model=False)
    assert state["model"]["out.bias"] is before  # filled in place
    assert torch.equal(before, run.state()["model"]["out.bias"])


@pytest.mark.extended
def test_two_rank_round_trip(world_factory, tmp_path):
    """The DDP strategy over the harness's live group: rank 0 writes, the strategy's barrier, both
    ranks restore through ckpt_path."""
    results = world_factory.get(2).run(fns.round_trip, SPEC, str(tmp_path), CFG)
    for rank, r in enumerate(results):
        assert r["path"] == fns.step_dir(str(tmp_path), 3), f"rank {rank} resumed {r['path']}"
        assert r["step"] == 3 and r["digest"] == r["reference"], f"rank {rank}"
