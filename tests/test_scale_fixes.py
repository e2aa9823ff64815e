"""What the scale model (``benchmarks/scale.py``, docs/scale.md) found growing too fast, fixed:

1. the coordinator's global save plan is checked by refckpt's linear tiling check
   (:class:`refckpt.planner.RefSavePlanner`), not DCP's ``_validate_global_plan`` (quadratic in ranks
   for a tensor cut along a dimension smaller than another) -- and a bad global plan (overlap, gap,
   out of bounds) is still refused, wherever DCP's check refuses it;
2. ``SafetensorsWriter.finish`` empties the ``Metadata`` that ``dcp.save`` broadcasts to every rank
   once the record is written (unless the planner caches plans and reuses that object);
3. the garbage collector is paused while the record is built and while it is unpickled;
4. ``Agreement.failures`` (the shared-root check of every save, the outcome of every load candidate) is one
   one-integer all-reduce when all is well; messages are gathered only on a failure.

Real gloo worlds (``world_factory``) for what crosses ranks; DCP's own planner beside refckpt's for
what the coordinator refuses.
"""

from __future__ import annotations

import gc
import os
import pickle
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import default_planner
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, TensorWriteData, WriteItem, WriteItemType

from refckpt import record
from refckpt.errors import ConfigError, CorruptCheckpointError
from refckpt.planner import RefSavePlanner, check_global_save_plan
from refckpt.safeload import MetadataUnpickler, load_record
from refckpt.storage import SafetensorsWriter
from tests import _scale_fix_fns as fns

pytestmark = pytest.mark.usefixtures("quiet_single_process_warnings")


# -- 1. the global save plan ---------------------------------------------------------------------------
def _plans(shape: tuple[int, ...], chunks: list[tuple[tuple[int, ...], tuple[int, ...]]]) -> list[SavePlan]:
    """One local plan per chunk (one rank each) of the tensor ``"w"`` of ``shape``, as DCP's local
    planner writes a DTensor's chunk, with the key paths DCP's flattening records."""
    plans = []
    for off, sz in chunks:
        offsets, sizes = torch.Size(off), torch.Size(sz)
        item = WriteItem(index=MetadataIndex("w", offsets), type=WriteItemType.SHARD,
                         tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(offsets=offsets, sizes=sizes),
                                                     properties=TensorProperties(dtype=torch.float32),
                                                     size=torch.Size(shape)))
        plans.append(SavePlan([item], planner_data={"w": ("w",)}))
    return plans


BAD_PLANS = {
    "overlap": ((4, 2), [((0, 0), (3, 2)), ((2, 0), (2, 2))], "overlaps another chunk"),
    "gap": ((4, 2), [((0, 0), (1, 2)), ((2, 0), (2, 2))], "cover 6 of its 8 elements"),
    "out of bounds": ((4, 2), [((0, 0), (2, 2)), ((2, 0), (3, 2))], "reaches outside shape"),
    "negative offset": ((4, 2), [((-1, 0), (1, 2)), ((0, 0), (4, 2))], "negative offset or size"),
    "2-d overlap": ((4, 4), [((0, 0), (2, 4)), ((2, 0), (2, 2)), ((1, 2), (3, 2))], "overlaps another chunk"),
}


@pytest.mark.parametrize("case", sorted(BAD_PLANS))
def test_a_bad_global_plan_is_refused_as_dcp_refuses_it(case):
    shape, chunks, message = BAD_PLANS[case]
    with pytest.raises(ValueError, match="Failed to validate global plan"):  # DCP's own check, for reference
        DefaultSavePlanner().create_global_plan(_plans(shape, chunks))
    with pytest.raises(ConfigError, match=message) as ei:
        RefSavePlanner().create_global_plan(_plans(shape, chunks))
    text = str(ei.value)
    assert text.startswith("the global save plan: w: ") and "Nothing was written" in text, text
    assert not isinstance(ei.value, CorruptCheckpointError)  # a save-side error, not a damaged record


@pytest.mark.parametrize("chunks", [
    [((0, 0), (2, 3)), ((2, 0), (2, 3))],                             # Shard(0)
    [((0, 0), (4, 1)), ((0, 1), (4, 2))],                             # Shard(1), uneven
    [((0, 0), (2, 2)), ((0, 2), (2, 1)), ((2, 0), (2, 2)), ((2, 2), (2, 1))],  # a 2-d mesh
    [((0, 0), (4, 3)), ((4, 0), (0, 3)), ((4, 0), (0, 3))],           # empty chunks past the end
], ids=["shard0", "shard1", "2d", "empty"])
def test_a_good_global_plan_is_dcps_own(chunks):
    """The same global plan and metadata as DCP's planner, key paths included."""
    ours = RefSavePlanner().create_global_plan(_plans((4, 3), chunks))
    theirs = DefaultSavePlanner().create_global_plan(_plans((4, 3), chunks))
    assert ours == theirs
    assert ours[1].planner_data == {"w": ("w",)}


def test_one_plan_need_not_cover_its_tensor_as_in_dcp():
    """DCP checks coverage only when more than one rank planned (``len(global_plan) > 1``)."""
    plans = _plans((4, 2), [((0, 0), (2, 2))])
    DefaultSavePlanner().create_global_plan(plans)
    RefSavePlanner().create_global_plan(plans)
    with pytest.raises(ConfigError, match="cover 4 of its 8"):
        check_global_save_plan(RefSavePlanner().create_global_plan(plans)[1], whole=True)


def test_the_check_is_linear_where_dcps_is_quadratic(monkeypatch):
    """A w2-like tensor (cut along dim 0, its smaller one) over 256 ranks: DCP's sweep compares
    every chunk with every other, 256 * 255 / 2 times; refckpt's planner makes no such comparison
    (its check marks each chunk's cells once)."""
    n = 256
    plans = _plans((2 * n, 4 * n), [((2 * r, 0), (2, 4 * n)) for r in range(n)])
    calls = 0
    real = default_planner._check_box_overlap

    def counting(a, b):
        nonlocal calls
        calls += 1
        return real(a, b)

    monkeypatch.setattr(default_planner, "_check_box_overlap", counting)
    RefSavePlanner().create_global_plan(plans)
    assert calls == 0
    DefaultSavePlanner().create_global_plan(plans)
    assert calls == n * (n - 1) // 2


@pytest.mark.parametrize("world_size", [2, 4])
def test_a_sharded_save_skips_dcps_check_and_broadcasts_a_few_hundred_bytes(world_factory, tmp_path, world_size):
    """A real save of a w2-like DTensor: DCP's ``_validate_global_plan`` (made to raise in every
    rank) is never called; what ``dcp.save`` returns on every rank -- the object DCP broadcast from
    the coordinator -- is empty and small, while the record on disk is whole and loads back exactly."""
    results = world_factory.get(world_size).run(fns.save_skips_dcps_validation_and_broadcasts_little, str(tmp_path))
    for rank, r in enumerate(results):
        assert r["error"] is None, (rank, r["error"])
        assert r["returned_tensors"] == 0, rank
        assert r["returned_bytes"] < 1024, (rank, r["returned_bytes"])
        assert r["record_tensors"] == ["model.bias", "model.w2"]
        assert r["record_w2_chunks"] == world_size
        assert r["round_trip"], rank


# -- 2. what finish leaves to DCP's broadcast ------------------------------------------------------------
def _record_tables(path: str) -> tuple[dict, dict, dict]:
    md, _ = load_record(path)
    return md.state_dict_metadata, md.storage_data, getattr(md, record.MANIFEST_ATTR)


def test_finish_empties_what_dcp_returns_after_writing_the_whole_record(tmp_path):
    state = {"model": {"w": torch.arange(12.0).reshape(3, 4), "step": torch.tensor(7)}}
    md = dcp.save(state, storage_writer=SafetensorsWriter(str(tmp_path)), planner=RefSavePlanner(), no_dist=True)
    assert md.state_dict_metadata == {} and md.storage_data is None and md.planner_data is None
    assert not hasattr(md, record.MANIFEST_ATTR)
    assert len(pickle.dumps(md)) < 1024
    sdm, storage, manifest = _record_tables(str(tmp_path / ".metadata"))
    assert sorted(sdm) == ["model.step", "model.w"] and len(storage) == 2 and manifest["files"]


def test_a_caching_planner_keeps_its_metadata_for_the_next_save(tmp_path):
    """DCP's plan caching reuses the global ``Metadata`` object when no rank's plan changed: emptied,
    the second save's record would list no tensor. ``finish`` leaves it whole for such a planner."""
    keys = ("_cached_save_plan", "_cached_all_plans", "_cached_global_plan", "_cached_metadata",
            "_cached_final_save_plan")

    def clear() -> None:
        for k in keys:
            getattr(SavePlanner, k, {}).pop("DefaultSavePlanner", None)

    state = {"model": {"w": torch.arange(6.0)}}
    clear()
    try:
        for step in ("a", "b"):
            os.makedirs(tmp_path / step)
            dcp.save(state, storage_writer=SafetensorsWriter(str(tmp_path / step)),
                     planner=DefaultSavePlanner(enable_plan_caching=True), no_dist=True)
    finally:
        clear()
    a, b = _record_tables(str(tmp_path / "a" / ".metadata")), _record_tables(str(tmp_path / "b" / ".metadata"))
    assert list(b[0]) == ["model.w"] and b[0] == a[0]
    assert list(b[1].values()) == list(a[1].values())


# -- 3. the garbage collector -------------------------------------------------------------------------------
@pytest.fixture
def collector_on():
    was = gc.isenabled()
    gc.enable()
    yield
    if not was:
        gc.disable()


def test_unpickling_a_record_pauses_the_collector(tmp_path, collector_on):
    state = {"model": {"w": torch.arange(4.0)}}
    dcp.save(state, storage_writer=SafetensorsWriter(str(tmp_path)), planner=RefSavePlanner(), no_dist=True)
    body, _ = record.split_record((tmp_path / ".metadata").read_bytes(), "t")
    seen = []

    class Watching(MetadataUnpickler):
        def load(self):
            seen.append(gc.isenabled())
            return super().load()

    assert record.unpickle_record(body, "t", Watching).state_dict_metadata
    assert seen == [False] and gc.isenabled()
    gc.disable()  # a caller that had it off keeps it off
    record.unpickle_record(body, "t", Watching)
    assert seen == [False, False] and not gc.isenabled()
    gc.enable()

    class Failing(MetadataUnpickler):
        def load(self):
            seen.append(gc.isenabled())
            raise RuntimeError("a damaged record")

    with pytest.raises(CorruptCheckpointError, match="a damaged record"):  # an error restores it too
        record.unpickle_record(body, "t", Failing)
    assert seen == [False, False, False] and gc.isenabled()


def test_building_the_record_pauses_the_collector(tmp_path, monkeypatch, collector_on):
    from refckpt.storage import writer as W

    seen = []
    real_summary, real_encode = W.tensor_summary, W.encode_record

    def summary(md):
        seen.append(("manifest", gc.isenabled()))
        return real_summary(md)

    def encode(data):
        seen.append(("pickle", gc.isenabled()))
        return real_encode(data)

    monkeypatch.setattr(W, "tensor_summary", summary)
    monkeypatch.setattr(W, "encode_record", encode)
    dcp.save({"model": {"w": torch.arange(4.0)}}, storage_writer=SafetensorsWriter(str(tmp_path)),
             planner=RefSavePlanner(), no_dist=True)
    assert seen == [("manifest", False), ("pickle", False)] and gc.isenabled()
    assert load_record(str(tmp_path / ".metadata"))[0].state_dict_metadata


# -- 4. agreeing on an outcome ---------------------------------------------------------------------------
@pytest.mark.parametrize("world_size", [2, 4])
def test_all_ok_gathers_messages_only_when_a_rank_failed(world_factory, world_size):
    world = world_factory.get(world_size)
    for r in world.run(fns.all_ok, []):
        assert r == {"failures": [], "all_gather_object_calls": 0}
    bad = [0, world_size - 1]
    for r in world.run(fns.all_ok, bad):
        assert r["all_gather_object_calls"] == 1
        assert [tuple(f) for f in r["failures"]] == [(b, f"OSError: boom on rank {b}") for b in bad]


@pytest.mark.parametrize("world_size", [2])
def test_a_root_that_is_not_shared_is_refused_on_every_rank(world_factory, tmp_path, world_size):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        results = world_factory.get(world_size).run(fns.save_to_per_rank_roots, str(tmp_path))
    for r in results:
        assert r is not None and r.startswith("SaveFailedError") and "not one shared directory" in r, r
        assert "rank(s) [1]" in r and "does not exist on host" in r, r
    for node in ("node_0", "node_1"):
        d = tmp_path / node
        assert not d.exists() or os.listdir(d) == [], (node, os.listdir(d))
