"""Interoperability: refckpt reads checkpoints it did not write, and DCP reads refckpt's.

What the family writes (read from their sources): VeOmni's and hyper_models' (hyper_parallel)
DCP checkpointers save ``<root>/global_step_N/`` with ``torch.distributed.checkpoint``
(``.metadata`` + ``__R_0.distcp``; torch DCP spells a per-rank commit record ``__R.metadata``
when saving with ``use_collectives=False``), ``extra_state/extra_state_rank_R.pt`` by
``torch.save`` before the shards, and (hyper_models) the pointer
``latest_checkpoint_iteration.txt`` = ``"N\n"`` with a plain ``open(..., "w")``.
hyper_parallel's *own* DCP implementation is a different format (its own pickled metadata
classes, ``_rankR_.safetensors``, per-rank ``R.metadata``): refckpt does not read it and says so.

* Plain-DCP / family checkpoints, built here with ``dcp.save`` and ``torch.save`` only (one
  process, and a real 2-rank gloo world with one ``.metadata`` or per-rank ``__R.metadata``),
  are found and restored by refckpt bitwise; each rank reads its own ``__R.metadata``; a rank
  that left a shard without its record makes the step incomplete.
* A refckpt checkpoint loads with plain DCP: the recipe of docs/design.md is tested verbatim
  (``storage_reader=refckpt.storage.SafetensorsReader(step_dir)``, optionally
  ``planner=refckpt.planner.RefLoadPlanner()`` so non-tensor items go through
  ``torch.load(weights_only=True)``; extra state by ``torch.load(weights_only=True)``).
* Every shard is a plain safetensors file: it opens with ``safetensors.safe_open`` and its
  names, dtypes, shapes and bytes are what the commit record says; tensor-only state also
  loads with DCP's ``HuggingFaceStorageReader(step_dir)`` (no checksum verification there).
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner, HuggingFaceStorageReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import refckpt
from refckpt import DistributedCheckpointer, find_latest_checkpoint, get_training_state, set_training_state
from refckpt import errors as E
from refckpt.planner import RefLoadPlanner
from refckpt.storage import BYTES_KEY_PREFIX, SafetensorsReader
from refckpt.tools.cli import main as cli_main
from refckpt.tools.readers import inspect_step

from . import _builders as B
from . import _interop_fns as fns


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def test_plain_dcp_family_checkpoint_is_found_and_restored(tmp_path):
    root = str(tmp_path)
    step_dir, model, opt, params, opt_sd, extra = B.save_family(root, 5, lr=0.0042)
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
    step_dir, *_ = B.save_family(root, 5)
    assert find_latest_checkpoint(root) == step_dir


def test_plain_dcp_checkpoint_missing_shard_is_incomplete(tmp_path):
    root = str(tmp_path)
    older, _p, _o = B.save_trained(root, 3, seed=1)
    step_dir, *_ = B.save_family(root, 5)
    shard = os.path.join(step_dir, "__0_0.distcp")
    os.truncate(shard, os.path.getsize(shard) - 8)  # shorter than the records it must hold
    assert not refckpt.check_step_dir(step_dir, root).complete
    assert find_latest_checkpoint(root) == older


def test_plain_dcp_checkpoint_without_extra_state(tmp_path):
    root = str(tmp_path)
    step_dir, _m, _o, params, _osd, _x = B.save_family(root, 5)
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


@pytest.mark.parametrize("planner", [None, RefLoadPlanner], ids=["default_planner", "ref_planner"])
def test_plain_dcp_load_of_refckpt_checkpoint(tmp_path, planner):
    """The recipe of docs/design.md, verbatim: torch's own state-dict API, ``dcp.load`` with refckpt's
    reader, and ``torch.load(weights_only=True)`` for the per-rank extra state."""
    model, opt = B.make(0, "adamw_amsgrad")
    B.train(model, opt, range(3))
    saved_params, saved_opt = B.params(model), B.opt_snapshot(opt)
    step_dir = B.save(tmp_path, model, opt, 3, extra={"global_step": 3, "epoch": 1})
    model, optimizer, rank = *B.make(99, "adamw_amsgrad"), 0  # fresh objects, another init

    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.load({"model": model_sd, "optimizer": optim_sd},
             storage_reader=SafetensorsReader(step_dir),
             planner=planner and planner(), no_dist=True)
    set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)
    extra = torch.load(f"{step_dir}/extra_state/extra_state_rank_{rank}.pt", weights_only=True)

    B.assert_bitwise(B.params(model), saved_params)
    B.assert_bitwise(optimizer.state_dict(), saved_opt)
    assert extra == {"global_step": 3, "epoch": 1}
    # DCP's default reader cannot: the items are raw safetensors bytes, not torch.save blobs.
    with pytest.raises(CheckpointException):
        dcp.load({"model": B.make_model(9).state_dict()}, checkpoint_id=step_dir, no_dist=True)


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


# -- the family in a real 2-rank world ---------------------------------------------------------
def test_family_two_rank_checkpoints_resume_bitwise(world_factory, tmp_path, capsys, caplog):
    """Step 2 with one ``.metadata``, step 4 committed per rank (``__0.metadata``, ``__1.metadata``)
    with per-rank weights: each rank restores its own record's state and its own extra state."""
    root, world = str(tmp_path), world_factory.get(2)
    world.run(fns.family_save, root, 2, False)
    saved = world.run(fns.family_save, root, 4, True)
    assert sorted(os.listdir(tmp_path / "global_step_2")) == [".metadata", "__0_0.distcp", "__1_0.distcp", "extra_state"]
    assert sorted(os.listdir(tmp_path / "global_step_4")) == [
        "__0.metadata", "__0_0.distcp", "__1.metadata", "__1_0.distcp", "extra_state"]
    assert (tmp_path / refckpt.LATEST_CHECKPOINT_FILE).read_bytes() == b"4\n"
    assert saved[0]["digest"] != saved[1]["digest"]  # so a rank reading the other's record shows

    for rank, r in enumerate(world.run(fns.resume, root)):
        assert r["path"] == r["latest"] == str(tmp_path / "global_step_4"), (rank, r)
        assert r["digest"] == saved[rank]["digest"], f"rank {rank} restored another rank's state"
        assert r["extra"] == saved[rank]["extra"], rank

    # `refckpt inspect` lists every rank's record, not only __0.metadata's items.
    s4 = str(tmp_path / "global_step_4")
    info = inspect_step(s4)
    assert info["records"] == ["__0.metadata", "__1.metadata"] and not info["errors"], info["errors"]
    where = {(e["record"], c["file"]) for e in info["entries"] if e["kind"] == "tensor" for c in e["chunks"]}
    assert where == {("__0.metadata", "__0_0.distcp"), ("__1.metadata", "__1_0.distcp")}, where
    keys = {r: sorted(e["key"] for e in info["entries"] if e["record"] == r) for r in info["records"]}
    assert keys["__0.metadata"] == keys["__1.metadata"] and keys["__0.metadata"], keys
    capsys.readouterr()
    caplog.clear()
    assert cli_main(["inspect", s4]) == 0
    text = capsys.readouterr().out
    assert not [r.getMessage() for r in caplog.records if r.levelno >= 30], "inspect warned"
    assert "committed per rank: __0.metadata, __1.metadata" in text and "RECORD" in text, text
    assert text.count("__1.metadata") > len(keys["__1.metadata"]) // 2, text
    assert inspect_step(str(tmp_path / "global_step_2"))["records"] == []  # one .metadata


def test_family_rank_without_commit_record(world_factory, tmp_path):
    """Rank 1 never wrote ``__1.metadata`` (crashed after its shard): the step is incomplete, and
    resume lands on the older step bitwise although the family's pointer names the newer one.
    Without rank 1's shard as well, nothing tells the step from a 1-rank save: a 2-rank world
    refuses it (every rank, naming the fix) instead of loading rank 0's state on rank 1."""
    root, world = str(tmp_path), world_factory.get(2)
    older = world.run(fns.family_save, root, 2, False)
    world.run(fns.family_save, root, 4, True)
    s4 = tmp_path / "global_step_4"
    (s4 / "__1.metadata").unlink()
    st = refckpt.check_step_dir(str(s4), root)
    assert not st.complete and "__1.metadata" in st.reason and "rank 1 never committed" in st.reason
    for rank, r in enumerate(world.run(fns.resume, root)):
        assert r["path"] == r["latest"] == str(tmp_path / "global_step_2"), (rank, r)
        assert r["digest"] == older[rank]["digest"] and r["extra"] == older[rank]["extra"], rank

    (s4 / "__1_0.distcp").unlink()
    (s4 / "extra_state" / "extra_state_rank_1.pt").unlink()
    assert refckpt.check_step_dir(str(s4), root).commit_records == ("__0.metadata",)
    for r in world.run(fns.resume, root):
        assert r["error"].startswith("MissingTrainingStateError"), r
        assert str(s4) in r["error"] and "committed per rank by 1 rank" in r["error"] and "Load at 1 rank" in r["error"]


def test_refckpt_shards_open_with_safe_open(world_factory, tmp_path):
    """Every shard of a 2-rank save (a row-sharded DTensor, a replicated tensor, a non-tensor
    item) opens with ``safetensors.safe_open``; each entry is where the commit record says, with
    the recorded dtype and chunk shape, and holds the values saved (known independently)."""
    from safetensors import safe_open
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    world_factory.get(2).run(fns.refckpt_save_sharded, str(tmp_path))
    step = str(tmp_path / "global_step_5")
    md = B.read_commit_record(step)
    shards = sorted(n for n in os.listdir(step) if n.endswith(".safetensors"))
    assert shards == ["__0_0.safetensors", "__1_0.safetensors"]
    expected = {"model.table": torch.arange(48, dtype=torch.float32).reshape(12, 4), "model.bias": torch.arange(3)}
    seen = set()
    for name in shards:
        path = os.path.join(step, name)
        start, header = B.safetensors_header(path)
        by_range = {(start + h["data_offsets"][0], start + h["data_offsets"][1]): k
                    for k, h in header.items() if k != "__metadata__"}
        records = {idx: info for idx, info in md.storage_data.items() if info.relative_path == name}
        assert records, f"{name}: no item of the commit record lives here"
        with safe_open(path, framework="pt") as f:
            assert set(f.keys()) == set(by_range.values())
            for idx, info in records.items():
                key = by_range.pop((info.offset, info.offset + info.length))
                t = f.get_tensor(key)
                smd = md.state_dict_metadata[idx.fqn]
                if isinstance(smd, TensorStorageMetadata):
                    (chunk,) = [c for c in smd.chunks if tuple(c.offsets) == tuple(idx.offset)]
                    assert t.dtype == smd.properties.dtype and tuple(t.shape) == tuple(chunk.sizes), key
                    rows = slice(chunk.offsets[0], chunk.offsets[0] + chunk.sizes[0])
                    B.assert_bitwise(t, expected[idx.fqn][rows], key)
                else:
                    assert key == BYTES_KEY_PREFIX + idx.fqn and t.dtype == torch.uint8 and t.numel() == info.length
                seen.add((idx.fqn, tuple(idx.offset or ())))
        assert not by_range, f"{name}: entries the commit record does not name: {sorted(by_range.values())}"
    table_chunks = {off for fqn, off in seen if fqn == "model.table"}
    assert table_chunks == {(0, 0), (6, 0)}, table_chunks  # both ranks' rows, each in its own shard
    assert {fqn for fqn, _ in seen} == set(md.state_dict_metadata)


# -- hyper_parallel's own DCP format: not read, and said so ------------------------------------
def test_hyper_parallel_rank_record_spelling_is_named(tmp_path):
    root = str(tmp_path)
    older, params, _o = B.save_trained(root, 3, seed=1)
    step_dir, *_ = B.save_family(root, 5)
    os.rename(os.path.join(step_dir, ".metadata"), os.path.join(step_dir, "0.metadata"))
    st = refckpt.check_step_dir(step_dir, root)
    assert not st.complete and "0.metadata" in st.reason and "hyper_parallel" in st.reason
    assert find_latest_checkpoint(root) == older
    with pytest.raises(E.IncompleteCheckpointError, match="hyper_parallel") as ei:
        DistributedCheckpointer().load(step_dir, {"model": B.make_model(9).state_dict()})
    assert step_dir in str(ei.value)


def test_hyper_parallel_metadata_classes_are_refused_by_name(tmp_path):
    """A ``.metadata`` pickling hyper_parallel's metadata classes is never unpickled (the module
    is not even imported), and the reason says which format it is."""
    root = str(tmp_path)
    older, params, _o = B.save_trained(root, 3, seed=1)
    step_dir, *_ = B.save_family(root, 5)
    with open(os.path.join(step_dir, ".metadata"), "wb") as f:  # GLOBAL opcode, then build it
        f.write(b"\x80\x02chyper_parallel.core.distributed_checkpoint.metadata\nMetadata\n)\x81.")
    st = refckpt.check_step_dir(step_dir, root)
    assert not st.complete and "hyper_parallel's own DCP" in st.reason and step_dir in st.reason
    fresh, fopt = B.make(99, "adamw")
    state = get_training_state(fresh, fopt, {})
    assert DistributedCheckpointer().load_latest(root, state) == older
    set_training_state(fresh, fopt, state)
    B.assert_bitwise(B.params(fresh), params)
