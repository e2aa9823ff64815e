"""Interoperability: refckpt reads checkpoints it did not write, and DCP reads refckpt's.

* A plain DCP checkpoint (``dcp.save(..., checkpoint_id=dir)``: ``.metadata`` + ``__0_0.distcp``)
  placed at ``root/global_step_N/`` with a family-style ``extra_state/extra_state_rank_0.pt``
  (``torch.save``) is found and restored by refckpt, bitwise.
* A refckpt checkpoint loads with plain DCP. The supported way is
  ``dcp.load(state, storage_reader=refckpt.storage.SafetensorsReader(step_dir), no_dist=True)``:
  refckpt's reader reads the commit record without unpickling arbitrary globals and verifies
  crc32s. (DCP's default load planner unpickles non-tensor items with
  ``torch.load(weights_only=False)``; pass ``planner=refckpt.planner.RefLoadPlanner()`` as well,
  or use ``DistributedCheckpointer.load``, when the checkpoint is not trusted.) Per-rank extra
  state lives in its own ``torch.save`` file and is not part of the DCP payload.
* Each shard is a plain safetensors file, so tensor-only state also loads with DCP's
  ``HuggingFaceStorageReader(step_dir)`` and ``DefaultLoadPlanner(allow_partial_load=True)``
  (no checksum verification on that path).
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner, HuggingFaceStorageReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict

import refckpt
from refckpt import DistributedCheckpointer, find_latest_checkpoint, get_training_state, set_training_state
from refckpt import errors as E
from refckpt.planner import RefLoadPlanner
from refckpt.storage import SafetensorsReader

from . import _builders as B


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _extra(step: int) -> dict:
    torch.manual_seed(77)
    return {"global_step": step, "rng": torch.get_rng_state(), "sampler": {"epoch": 1, "index": [4, 2]}}


def _write_family_checkpoint(root, step: int):
    """Train, then save with plain DCP + a torch.save'd extra-state file; returns snapshots."""
    model, opt = B.make(0, "adamw_amsgrad")
    B.train(model, opt, range(step))
    opt.param_groups[0]["lr"] = 0.0042
    msd, osd = get_state_dict(model, opt)  # trained: DCP does not prime, FQN-keyed
    step_dir = os.path.join(root, f"global_step_{step}")
    dcp.save({"model": msd, "optimizer": osd}, checkpoint_id=step_dir, no_dist=True)
    extra = _extra(step)
    os.makedirs(os.path.join(step_dir, "extra_state"))
    torch.save(extra, os.path.join(step_dir, "extra_state", "extra_state_rank_0.pt"))
    return step_dir, model, opt, B.params(model), B.opt_snapshot(opt), B.clone_tree(extra)


def test_plain_dcp_family_checkpoint_is_found_and_restored(tmp_path):
    root = str(tmp_path)
    step_dir, model, opt, params, opt_sd, extra = _write_family_checkpoint(root, 5)
    names = sorted(os.listdir(step_dir))
    assert names == sorted([".metadata", "__0_0.distcp", "extra_state"]), names
    assert find_latest_checkpoint(root) == step_dir
    assert refckpt.check_step_dir(step_dir, root).manifest is None  # not written by refckpt

    fresh, fopt = B.make(99, "adamw_amsgrad")
    state = get_training_state(fresh, fopt, {})
    assert DistributedCheckpointer().load_latest(root, state) == step_dir
    got_extra = set_training_state(fresh, fopt, state)
    B.assert_bitwise(B.params(fresh), params)
    B.assert_bitwise(fopt.state_dict(), opt_sd)
    assert fopt.param_groups[0]["lr"] == 0.0042
    B.assert_bitwise(got_extra, extra)

    B.train(model, opt, range(5, 7))
    B.train(fresh, fopt, range(5, 7))
    B.assert_bitwise(B.params(fresh), B.params(model))
    B.assert_bitwise(fopt.state_dict(), opt.state_dict())


def test_plain_dcp_checkpoint_newer_than_refckpt_one_wins(tmp_path):
    root = str(tmp_path)
    B.save_trained(root, 3, seed=1)
    step_dir, *_ = _write_family_checkpoint(root, 5)
    assert find_latest_checkpoint(root) == step_dir


def test_plain_dcp_checkpoint_missing_shard_is_incomplete(tmp_path):
    root = str(tmp_path)
    older, _p, _o = B.save_trained(root, 3, seed=1)
    step_dir, *_ = _write_family_checkpoint(root, 5)
    shard = os.path.join(step_dir, "__0_0.distcp")
    os.truncate(shard, os.path.getsize(shard) - 8)  # shorter than the records it must hold
    assert not refckpt.check_step_dir(step_dir, root).complete
    assert find_latest_checkpoint(root) == older


def test_plain_dcp_checkpoint_without_extra_state(tmp_path):
    root = str(tmp_path)
    step_dir, _m, _o, params, _osd, _x = _write_family_checkpoint(root, 5)
    os.remove(os.path.join(step_dir, "extra_state", "extra_state_rank_0.pt"))
    os.rmdir(os.path.join(step_dir, "extra_state"))
    fresh, fopt = B.make(99, "adamw_amsgrad")
    with pytest.raises(E.MissingTrainingStateError, match="weights only"):
        DistributedCheckpointer().load(step_dir, get_training_state(fresh, fopt, {}))
    sd = fresh.state_dict()
    DistributedCheckpointer().load(step_dir, {"model": sd})
    B.assert_bitwise(dict(sd), params)


def test_plain_dcp_non_tensor_item_is_never_unpickled_unsafely(tmp_path):
    """DCP stores non-tensor items with torch.save; refckpt reads them with weights_only=True."""
    marker = tmp_path / "marker"
    step_dir = str(tmp_path / "root" / "global_step_1")
    dcp.save({"model": {"w": torch.ones(2)}, "evil": B.Marker(str(marker))}, checkpoint_id=step_dir, no_dist=True)
    assert not marker.exists()
    with pytest.raises(E.UnsafeCheckpointError, match="evil"):
        DistributedCheckpointer().load(step_dir, {"model": {"w": torch.zeros(2)}, "evil": None})
    assert not marker.exists()


def test_plain_dcp_load_of_refckpt_checkpoint(tmp_path):
    model, opt = B.make(0, "adamw_amsgrad")
    B.train(model, opt, range(3))
    saved_params, saved_opt = B.params(model), B.opt_snapshot(opt)
    step_dir = B.save(tmp_path, model, opt, 3)

    fresh, fopt = B.make(99, "adamw_amsgrad")
    state = get_training_state(fresh, fopt)
    dcp.load(state, storage_reader=SafetensorsReader(step_dir), no_dist=True)
    set_training_state(fresh, fopt, state)
    B.assert_bitwise(B.params(fresh), saved_params)
    B.assert_bitwise(fopt.state_dict(), saved_opt)

    # the same with refckpt's planner (non-tensor items through the restricted unpickler)
    fresh, fopt = B.make(98, "adamw_amsgrad")
    state = get_training_state(fresh, fopt)
    dcp.load(state, storage_reader=SafetensorsReader(step_dir), planner=RefLoadPlanner(), no_dist=True)
    set_training_state(fresh, fopt, state)
    B.assert_bitwise(fopt.state_dict(), saved_opt)


def test_plain_dcp_load_verifies_checksums(tmp_path):
    model, opt = B.make(0, "adamw")
    step_dir = B.save(tmp_path, model, opt, 1)
    shard = os.path.join(step_dir, B.SHARD)
    start, _ = B.item_range(shard, "model.2.weight")
    B.flip_bit(shard, start + 1)
    with pytest.raises(CheckpointException) as ei:
        dcp.load({"model": B.make_model(9).state_dict()}, storage_reader=SafetensorsReader(step_dir), no_dist=True)
    exc = ei.value.failures[0][0]  # DCP wraps per-rank errors: (exception, traceback)
    assert isinstance(exc, E.CorruptCheckpointError) and "checksum mismatch" in str(exc) and shard in str(exc)


def test_huggingface_reader_loads_refckpt_tensors(tmp_path):
    model, opt = B.make(0, "adamw")
    B.train(model, opt, range(2))
    saved_params = B.params(model)
    saved_moments = {n: opt.state[p]["exp_avg"].clone() for n, p in model.named_parameters()}
    step_dir = B.save(tmp_path, model, opt, 2)

    fresh = B.make_model(9)
    moments = {n: torch.zeros_like(p) for n, p in fresh.named_parameters()}
    state = {"model": fresh.state_dict(), "optimizer": {"state": {n: {"exp_avg": t} for n, t in moments.items()}}}
    dcp.load(state, storage_reader=HuggingFaceStorageReader(step_dir),
             planner=DefaultLoadPlanner(allow_partial_load=True), no_dist=True)
    B.assert_bitwise(B.params(fresh), saved_params)
    B.assert_bitwise(moments, saved_moments)
