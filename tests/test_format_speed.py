"""Issue 30's fast paths give what the general path gives, bit for bit, and step aside when they must.

* Pass 2 of a load reads an item straight into the caller's tensor, consecutive items with one
  ``preadv``, where the destination has the saved layout (the same sharding: a contiguous CPU
  tensor of the saved dtype and shape); everything else goes through the general path (DCP's
  narrowing, a buffer, ``copy_``). Pass 1 checksums a mapping of the shard instead of reading it
  into buffers. Loading with both fast paths switched off (``_direct_target`` answering None,
  ``MAP_WINDOW = False``) must give the same bytes, for every dtype the suite draws and more,
  non-contiguous destinations and 0-size tensors.
* A load whose sharding differs from the save's (a state saved by two ranks loaded by one) is
  planned by DCP's planner, chunk by chunk, and is still exact.
* The writer hands many small tensors to one ``writev``; a ``FileIO`` that overrides ``write`` (a
  fault injector, a tracer) still sees every byte as a ``write`` call.

Everything here is small (a few KiB per tensor); the speed itself is the benchmark's
(``python -m benchmarks``), never a timed test.
"""

from __future__ import annotations

import os

import pytest
import torch

from refckpt import DistributedCheckpointer
from refckpt.durable import FileIO
from refckpt.errors import CorruptCheckpointError
from refckpt.storage import reader as reader_mod

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

#: faults' DTYPES (float32, bfloat16, float16) and every other dtype the shard format encodes
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32, torch.int16,
          torch.int8, torch.uint8, torch.bool]
for _name in ("float8_e4m3fn", "float8_e5m2"):
    if hasattr(torch, _name):
        DTYPES.append(getattr(torch, _name))


def _values(shape, dtype, g: torch.Generator) -> torch.Tensor:
    raw = torch.randint(0, 256, (int(torch.Size(shape).numel()) * torch.empty((), dtype=dtype).element_size(),),
                        dtype=torch.uint8, generator=g)
    if dtype == torch.bool:
        return (raw[: torch.Size(shape).numel()] & 1).bool().reshape(shape)
    return raw.view(dtype).reshape(shape)  # every bit pattern, NaNs and all: compared as bytes


def _state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    model: dict[str, torch.Tensor] = {}
    for i, dtype in enumerate(DTYPES):
        model[f"t{i}.w"] = _values((33, 5), dtype, g)
        model[f"t{i}.empty"] = _values((0, 3), dtype, g)
        model[f"t{i}.scalar"] = _values((), dtype, g)
    model["many"] = _values((600,), torch.float32, g)
    model["transposed"] = _values((6, 9), torch.float32, g).t()  # non-contiguous, saved and loaded
    return {"model": model, "optimizer": {"state": {"0": {"exp_avg": _values((40,), torch.float32, g)}},
                                          "param_groups": [{"lr": 0.5, "params": ["0"]}]}}


def _like(state: dict) -> dict:
    """A state of the same shapes to load into; non-contiguous where the saved one was."""
    model = {}
    for k, v in state["model"].items():
        if not v.is_contiguous():
            model[k] = torch.zeros(v.shape[::-1], dtype=v.dtype).t()
        else:
            model[k] = torch.zeros_like(v)
    return {"model": model, "optimizer": {"state": {"0": {"exp_avg": torch.zeros(40)}},
                                          "param_groups": [{"lr": 0.0, "params": ["0"]}]}}


def _bits(t: torch.Tensor) -> bytes:
    t = t.detach().contiguous()
    return bytes(t.reshape(-1).view(torch.uint8).tolist()) if t.numel() else b""


def _assert_same(a: dict, b: dict) -> None:
    for k in b["model"]:
        assert a["model"][k].dtype == b["model"][k].dtype and a["model"][k].shape == b["model"][k].shape, k
        assert _bits(a["model"][k]) == _bits(b["model"][k]), k
    assert _bits(a["optimizer"]["state"]["0"]["exp_avg"]) == _bits(b["optimizer"]["state"]["0"]["exp_avg"])
    assert a["optimizer"]["param_groups"][0]["lr"] == b["optimizer"]["param_groups"][0]["lr"]


def _saved(tmp_path, seed: int, **ckpt_kwargs) -> tuple[DistributedCheckpointer, dict, str]:
    """(a checkpointer, the state ``_state(seed)`` it saved as step 1 under ``tmp_path``, that step's directory)."""
    saved = _state(seed)
    ck = DistributedCheckpointer(**ckpt_kwargs)
    ck.save(str(tmp_path), saved, global_step=1)
    return ck, saved, os.path.join(str(tmp_path), "global_step_1")


def _flip_last_byte(step: str, mask: int) -> None:
    """XOR the last byte of the step's shard (the end of its last item's bytes) with ``mask``."""
    shard = next(os.path.join(step, n) for n in os.listdir(step) if n.endswith(".safetensors"))
    with open(shard, "r+b") as f:
        f.seek(-1, os.SEEK_END)
        b = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([b[0] ^ mask]))


@pytest.fixture
def counted(monkeypatch):
    """How many items pass 2 read straight into the caller's tensors, and how many through the general path."""
    seen = {"direct": 0, "general": 0}
    orig = reader_mod.SafetensorsReader.commit

    def commit(self):
        orig(self)
        seen["direct"] += self.direct_items
        seen["general"] += self.general_items

    monkeypatch.setattr(reader_mod.SafetensorsReader, "commit", commit)
    return seen


@pytest.fixture
def mapped(monkeypatch):
    """Pass 1 maps every run, however short (these states are a few KiB: below ``MAP_MIN`` they are read)."""
    monkeypatch.setattr(reader_mod.SafetensorsReader, "MAP_MIN", 0)


@pytest.mark.parametrize("small_blocks", [False, True])
def test_fast_paths_load_the_general_paths_bytes(tmp_path, monkeypatch, counted, mapped, small_blocks):
    from refckpt.storage import crc as crc_mod

    if small_blocks:  # multi-block items, every block handed to the checksum thread, one-page map windows
        monkeypatch.setattr(crc_mod, "_IO_BLOCK", 4096)
        monkeypatch.setattr(crc_mod, "_INLINE_CRC", 0)
        monkeypatch.setattr(crc_mod, "_BATCH", 1)
        monkeypatch.setattr(reader_mod.SafetensorsReader, "MAP_WINDOW", 4096)
    ck, saved, step = _saved(tmp_path, 1)

    fast = _like(saved)
    ck.load(step, fast)
    # every item read straight in but the transposed one; DCP plans no read of an empty tensor
    assert counted == {"direct": 2 * len(DTYPES) + 2, "general": 1}, counted
    _assert_same(fast, saved)

    with monkeypatch.context() as m:  # the general path only
        m.setattr(reader_mod.SafetensorsReader, "_direct_target", lambda self, req, planner, full: None)
        m.setattr(reader_mod.SafetensorsReader, "MAP_WINDOW", False)
        before = dict(counted)
        general = _like(saved)
        ck.load(step, general)
        assert counted["direct"] == before["direct"] and counted["general"] == before["general"] + 2 * len(DTYPES) + 3
    _assert_same(general, fast)
    ck.close()


def test_a_flipped_byte_fails_the_mapped_pass_and_changes_nothing(tmp_path, mapped):
    ck, saved, step = _saved(tmp_path, 2)
    _flip_last_byte(step, 0x10)
    target = _like(saved)
    before = {k: _bits(v) for k, v in target["model"].items()}
    with pytest.raises(CorruptCheckpointError, match="checksum mismatch"):
        ck.load(step, target)
    assert {k: _bits(v) for k, v in target["model"].items()} == before
    ck.close()


def test_a_truncated_shard_is_named_not_mapped_past_its_end(tmp_path, mapped):
    """Pass 1 maps what the file holds and checks every range against its size first: a shard cut in
    the middle of its tensors is a CorruptCheckpointError naming it (never a read past the mapping)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from refckpt.planner import RefLoadPlanner

    saved = _state(3)
    ck = DistributedCheckpointer()
    ck.save(str(tmp_path), saved, global_step=1)
    ck.close()
    step = os.path.join(str(tmp_path), "global_step_1")
    shard = next(os.path.join(step, n) for n in os.listdir(step) if n.endswith(".safetensors"))
    os.truncate(shard, os.path.getsize(shard) // 2)
    reader = reader_mod.SafetensorsReader(step, transactional=True)
    planner = RefLoadPlanner(checkpoint_path=step, caller_tensors=set())
    target = _like(saved)
    target.pop("optimizer")
    with pytest.raises(CheckpointException) as err:
        dcp.load(target, storage_reader=reader, planner=planner, no_dist=True)
    (exc, _tb), = err.value.failures.values()
    assert isinstance(exc, CorruptCheckpointError) and os.path.basename(shard) in str(exc) and "truncated" in str(exc)


def _mapped_rss_kib(addr: int) -> int:
    """The resident KiB of the mapping that starts at ``addr`` (``/proc/self/smaps``)."""
    with open("/proc/self/smaps") as f:
        lines = f.read().splitlines()
    for i, line in enumerate(lines):
        if line.split("-", 1)[0] == format(addr, "x"):
            for field in lines[i + 1:]:
                if field.startswith("Rss:"):
                    return int(field.split()[1])
    raise AssertionError(f"no mapping at {addr:#x}")


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="needs /proc/self/smaps (Linux)")
def test_pass_one_gives_back_every_mapped_page_after_each_run(tmp_path, monkeypatch, mapped):
    """Pass 1 maps a shard window by window and unmaps each once checksummed; what a window's pages
    drag in around it (a large page-cache folio mapped whole: 2 MiB on ext4 here) must go too. With
    every item a run of its own (most far shorter than a page), the mapping holds no resident page
    after any run: a load that unmapped only each window's whole pages kept one per run (67 MiB of
    RSS at world size 2 on the benchmark's 512 MiB state, where each rank verifies the other's share
    of the step counters, scattered through its shard)."""
    monkeypatch.setattr(reader_mod.SafetensorsReader, "COALESCE_GAP", -1)  # every item a run of its own
    ck, saved, step = _saved(tmp_path, 5)
    resident: list[int] = []
    orig = reader_mod.SafetensorsReader._verify_run

    def verify_run(self, f, rel, full, run, crc, pending):
        orig(self, f, rel, full, run, crc, pending)
        resident.append(_mapped_rss_kib(self._maps[rel].addr))

    monkeypatch.setattr(reader_mod.SafetensorsReader, "_verify_run", verify_run)
    target = _like(saved)
    ck.load(step, target)
    _assert_same(target, saved)
    assert len(resident) > 10 and resident == [0] * len(resident), resident
    ck.close()


def test_short_runs_are_read_through_buffers_grown_for_the_longest(tmp_path, monkeypatch):
    """A run shorter than ``MAP_MIN`` is read with ``pread`` into the ring buffers instead of mapped
    (a few bytes must not map a folio). The buffers are sized by the first such run and grown for a
    longer one: a first run of a scalar's few bytes must not leave a later run of KiBs read a few
    bytes at a time. Both ways give the saved bytes, and a flipped byte in a later run is found."""
    monkeypatch.setattr(reader_mod.SafetensorsReader, "COALESCE_GAP", -1)
    opened: list[str] = []
    monkeypatch.setattr(reader_mod.MappedFile, "open",
                        classmethod(lambda cls, fd, size, source: opened.append(source)))
    spans: list[tuple[int, int]] = []
    orig = reader_mod.SafetensorsReader._verify_run

    def verify_run(self, f, rel, full, run, crc, pending):
        orig(self, f, rel, full, run, crc, pending)
        span = max(off + n for _r, off, n in run) - min(off for _r, off, n in run)
        spans.append((span, len(self._ring[0]) if self._ring else 0))

    monkeypatch.setattr(reader_mod.SafetensorsReader, "_verify_run", verify_run)
    ck, saved, step = _saved(tmp_path, 6)
    target = _like(saved)
    ck.load(step, target)
    _assert_same(target, saved)
    assert opened == []  # nothing mapped: every run is short
    assert min(s for s, _ in spans) < 16 < 2400 <= max(s for s, _ in spans), spans  # scalars and the 600 floats
    assert all(ring >= span for span, ring in spans if span), spans  # one read per run, whatever came first
    _flip_last_byte(step, 0x01)  # in the last item's run
    with pytest.raises(CorruptCheckpointError, match="checksum mismatch"):
        ck.load(step, _like(saved))
    ck.close()


def test_a_resharded_load_takes_the_general_path(tmp_path, counted):
    """Saved by two FSDP2 ranks (each tensor in two chunks), loaded whole by one plain process: DCP's
    planner reshards (a read item per saved chunk, narrowed to its rows of the destination), so pass 2
    sees more items than the state has tensors; a chunk whose destination rows are one contiguous
    region is still read straight into it. The result is the saved state, exactly."""
    from faults.world import World
    from refckpt import get_training_state
    from tests import _fsdp_fns as F

    with World(2, "gloo", 120, start_method="forkserver") as world:
        saved = world.run(F.save_fsdp, str(tmp_path), False, timeout=120)[0]["full"]
    from refckpt import initialize_optimizer_state

    model, opt = F.build(1, shard=False)
    initialize_optimizer_state(opt)  # optimizer state to load into
    state = get_training_state(model, opt, {"global_step": 0})
    DistributedCheckpointer().load(os.path.join(str(tmp_path), f"global_step_{F.SAVE_STEP}"), state)
    tensors = sum(1 for _ in model.parameters()) * 5  # each parameter with AMSGrad's four entries
    assert counted["direct"] + counted["general"] > tensors, counted  # chunks, not tensors
    got = model.state_dict()
    assert set(got) == set(saved["model"])
    for k, v in saved["model"].items():
        assert torch.equal(got[k], v), k


def test_fault_injectors_still_see_every_write(tmp_path):
    class Counting(FileIO):
        def __init__(self) -> None:
            self.bytes = 0

        def write(self, f, data) -> int:
            n = super().write(f, data)
            self.bytes += n
            return n

    io = Counting()
    ck, saved, step = _saved(tmp_path, 4, io=io)
    on_disk = sum(os.path.getsize(os.path.join(step, n)) for n in os.listdir(step) if n.endswith(".safetensors"))
    assert io.bytes >= on_disk
    out = _like(saved)
    ck.load(step, out)
    _assert_same(out, saved)
    ck.close()


def _plans(flat: dict, md) -> tuple[list, list]:
    from torch.distributed.checkpoint.default_planner import create_default_local_load_plan

    from refckpt.planner import local_load_plan

    return local_load_plan(flat, md).items, create_default_local_load_plan(flat, md, True).items


def _same_items(ours: list, dcps: list) -> bool:
    return len(ours) == len(dcps) and all(
        a == b and a.dest_index.index == b.dest_index.index and a.storage_index.index == b.storage_index.index
        for a, b in zip(ours, dcps))


def test_the_load_plan_is_dcps_item_for_item(tmp_path):
    """refckpt plans a same-sharding load without DCP's resharding sweep; the items must be exactly
    DCP's (every dtype, 0-size and 0-d tensors, a non-contiguous destination, non-tensor items), and
    a record that cut a tensor into chunks (a save by another world) must fall back to DCP's path."""
    import dataclasses

    from torch.distributed.checkpoint._nested_dict import flatten_state_dict
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

    from refckpt.planner import _same_sharding_item
    from refckpt.safeload import load_metadata

    saved = _state(5)
    ck = DistributedCheckpointer()
    ck.save(str(tmp_path), saved, global_step=1)
    ck.close()
    md = load_metadata(os.path.join(str(tmp_path), "global_step_1", ".metadata"))
    flat, _ = flatten_state_dict(_like(saved))
    ours, dcps = _plans(flat, md)
    assert _same_items(ours, dcps) and len(ours) >= 2 * len(DTYPES) + 3  # 0-size tensors: no item
    direct = [k for k, v in flat.items() if isinstance(v, torch.Tensor)
              and _same_sharding_item(k, md.state_dict_metadata[k], v, {}) is not None]
    assert "model.t0.w" in direct and "model.t0.scalar" in direct and "model.transposed" in direct
    assert "model.t0.empty" not in direct  # DCP reads nothing for it: its own path decides

    # The record of a world that cut "many" into two chunks: the sweep's items (two reads), not ours.
    tmd = md.state_dict_metadata["model.many"]
    halves = [ChunkStorageMetadata(offsets=torch.Size([0]), sizes=torch.Size([300])),
              ChunkStorageMetadata(offsets=torch.Size([300]), sizes=torch.Size([300]))]
    cut = dataclasses.replace(md, state_dict_metadata={**md.state_dict_metadata,
                                                       "model.many": dataclasses.replace(tmd, chunks=halves)})
    ours, dcps = _plans(flat, cut)
    assert _same_items(ours, dcps)
    assert sum(1 for i in ours if i.dest_index.fqn == "model.many") == 2
    assert _same_sharding_item("model.many", cut.state_dict_metadata["model.many"], flat["model.many"], {}) is None


@pytest.mark.parametrize("saved_by", [2, 1])
def test_the_load_plan_of_fsdp2_shards_is_dcps(tmp_path, saved_by):
    """Two FSDP2 ranks plan their load of a step saved by two ranks (each local shard is one saved
    chunk: planned without the sweep) and of one saved by one process (resharding: DCP's sweep for
    every DTensor shard):
    on both ranks the items equal DCP's own, field for field and in order."""
    from faults.world import World
    from tests import _fsdp_fns as F

    if saved_by == 1:
        from refckpt import get_training_state, initialize_optimizer_state

        model, opt = F.build(1, shard=False)
        initialize_optimizer_state(opt)
        DistributedCheckpointer().save(str(tmp_path), get_training_state(model, opt), global_step=F.SAVE_STEP)
    with World(2, "gloo", 120, start_method="forkserver") as world:
        if saved_by == 2:
            world.run(F.save_fsdp, str(tmp_path), False, timeout=120)
        got = world.run(F.plans_agree, str(tmp_path), timeout=120)
    for r in got:
        assert r["all_equal"] and r["items"] == r["dcp_items"] > 0, r
        if saved_by == 2:
            assert r["direct"] > 0, r
        else:
            assert r["direct"] == 0, r


def test_a_kept_save_plan_is_reused_only_for_the_same_state(tmp_path):
    """One process, one checkpointer: a second save of the same state reuses the kept plans; the same
    shapes in another dtype, or a key more, are planned again; every step's record describes its own
    state (its dtypes), and loads back bitwise."""
    from refckpt import planner as P
    from refckpt.safeload import load_metadata

    seen: list[bool] = []
    orig = P.RefSavePlanner.finish_plan

    def finish_plan(self, new_plan):
        out = orig(self, new_plan)
        seen.append(self.reused_global and self.reused_final)
        return out

    a = _state(6)
    b = {"model": {k: (v.to(torch.float16) if v.dtype == torch.float32 else v) for k, v in a["model"].items()},
         "optimizer": a["optimizer"]}
    c = {"model": {**a["model"], "new": torch.arange(5.0)}, "optimizer": a["optimizer"]}
    ck = DistributedCheckpointer()
    P.RefSavePlanner.finish_plan = finish_plan
    try:
        for step, state in enumerate((a, a, b, b, c, a), start=1):
            ck.save(str(tmp_path), state, global_step=step)
    finally:
        P.RefSavePlanner.finish_plan = orig
    assert seen == [False, True, False, True, False, False]
    for step, state in enumerate((a, a, b, b, c, a), start=1):
        path = os.path.join(str(tmp_path), f"global_step_{step}")
        md = load_metadata(os.path.join(path, ".metadata"))
        assert md.state_dict_metadata["model.many"].properties.dtype == state["model"]["many"].dtype
        assert ("model.new" in md.state_dict_metadata) == ("new" in state["model"])
        out = _like(state)
        if "new" in state["model"]:
            out["model"]["new"] = torch.zeros(5)
        ck.load(path, out)
        _assert_same(out, state)
    ck.close()


def test_kept_save_plans_across_fsdp2_ranks(tmp_path):
    """Two FSDP2 ranks: the second save of the same DTensors reuses the kept plans on both ranks
    (nothing planned, nothing exchanged but two empty plans), the same shapes in bfloat16 are planned
    again; a coordinator that lost its plans fails that one save, on every rank, with a
    CheckpointError, and the next save plans from scratch; each step loads back bitwise."""
    from faults.world import World
    from tests import _fsdp_fns as F

    with World(2, "gloo", 120, start_method="forkserver") as world:
        got = world.run(F.plan_reuse, str(tmp_path), timeout=120)
    for rank, r in enumerate(got):
        reused = (rank == 0, True)  # the global plan is the coordinator's; every rank reuses its final plan
        assert r["seen"][:4] == [(False, False), reused, (False, False), reused], r
        assert r["error"] and "SaveFailedError" in r["error"] and "save plan the coordinator does not hold" in r["error"], r
        assert len(r["seen"]) == 5 and r["seen"][-1] == (False, False), r  # the failed save finished no plan
        assert r["same"] == {2: True, 6: True}, r


@pytest.mark.parametrize("transactional", [False, True])
def test_a_planner_that_commits_by_copying_is_verified_inline(tmp_path, transactional):
    """DCP's load with refckpt's reader and a planner that overrides ``commit_tensor`` (it copies out of
    the tensors the reader fills, so no view may be checksummed later on another thread): every item is
    verified on the calling thread before its commit, the bytes come back exactly, and a flipped byte
    still fails the load, naming the item."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    class Copying(DefaultLoadPlanner):
        def __init__(self) -> None:
            super().__init__()
            self.committed: dict[str, torch.Tensor] = {}

        def commit_tensor(self, read_item, tensor):
            self.committed[read_item.dest_index.fqn] = tensor.detach().clone()

    saved = _state(7)
    ck = DistributedCheckpointer()
    ck.save(str(tmp_path), saved, global_step=1)
    ck.close()
    step = os.path.join(str(tmp_path), "global_step_1")
    target = {"model": _like(saved)["model"]}
    planner = Copying()
    reader = reader_mod.SafetensorsReader(step, transactional=transactional)
    dcp.load(target, storage_reader=reader, planner=planner, no_dist=True)
    reader.commit()  # a transactional reader copies the caller's tensors in only now (a no-op otherwise)
    _assert_same({**target, "optimizer": saved["optimizer"]}, saved)
    assert _bits(planner.committed["model.many"]) == _bits(saved["model"]["many"])

    from refckpt.safeload import load_metadata

    md = load_metadata(os.path.join(step, ".metadata"))
    info = next(v for k, v in md.storage_data.items() if k.fqn == "model.many")
    with open(os.path.join(step, info.relative_path), "r+b") as f:  # the last byte of model.many
        f.seek(info.offset + info.length - 1)
        b = f.read(1)
        f.seek(info.offset + info.length - 1)
        f.write(bytes([b[0] ^ 0x01]))
    with pytest.raises(CheckpointException) as err:  # pass 1 verifies inline too: found before any commit
        dcp.load({"model": _like(saved)["model"]}, storage_reader=reader_mod.SafetensorsReader(
            step, transactional=transactional), planner=Copying(), no_dist=True)
    (exc, _tb), = err.value.failures.values()
    assert isinstance(exc, CorruptCheckpointError) and "checksum mismatch for model.many " in str(exc), exc


def test_the_reader_counts_the_bytes_it_read(tmp_path):
    """``SafetensorsReader.bytes_read`` (a public statistic) counts what the load read from the shard:
    every item's bytes at least once, never more than the shard per pass; a transactional load reads
    the caller's items twice (pass 1 and pass 2)."""
    import torch.distributed.checkpoint as dcp

    from refckpt.planner import RefLoadPlanner

    saved = _state(8)
    ck = DistributedCheckpointer()
    ck.save(str(tmp_path), saved, global_step=1)
    ck.close()
    step = os.path.join(str(tmp_path), "global_step_1")
    shard = sum(os.path.getsize(os.path.join(step, n)) for n in os.listdir(step) if n.endswith(".safetensors"))
    items = sum(t.numel() * t.element_size() for t in saved["model"].values())
    got = {}
    for transactional in (False, True):
        target = {"model": _like(saved)["model"]}
        reader = reader_mod.SafetensorsReader(step, transactional=transactional)
        mine = {id(t) for t in target["model"].values()}  # the caller's tensors: copied in by commit()
        planner = RefLoadPlanner(checkpoint_path=step, caller_tensors=mine if transactional else None)
        dcp.load(target, storage_reader=reader, planner=planner, no_dist=True)
        reader.commit()
        got[transactional] = reader.bytes_read
    assert items <= got[False] <= shard, (items, got, shard)
    assert 2 * items <= got[True] <= 2 * shard, (items, got, shard)


def test_a_2_rank_load_exchanges_no_plan_and_fails_alike_on_every_rank(tmp_path):
    """Two FSDP2 ranks: a load exchanges no pickled plan (no gather, scatter or all-gather of objects:
    refckpt drives DCP's load steps with one all-reduce per step), resolves no DTensor through
    autograd (pass 2 runs under no_grad: ~40 us per item otherwise) and loads the state bitwise; a
    byte flipped in rank 1's shard fails the load on both ranks with the same error, naming the
    shard, and leaves both ranks' states as they were (the exchange then gathers the failures)."""
    from faults.world import World
    from tests import _fsdp_fns as F

    with World(2, "gloo", 120, start_method="forkserver") as world:
        got = world.run(F.load_exchange, str(tmp_path), timeout=120)
    for r in got:
        assert r["calls"] == {"gather_object": 0, "scatter_object_list": 0, "all_gather_object": 0, "to_local": 0,
                              "to_local_in_place": 0}, r
        assert r["same"] and r["untouched"], r
        assert r["error"] and "CorruptCheckpointError" in r["error"] and "__1_" in r["error"], r
    assert got[0]["error"] == got[1]["error"]


def test_save_plans_equal_dcps_on_fsdp2_ranks(tmp_path):
    """Two FSDP2 ranks: refckpt's local save plan, which computes a DTensor's chunk once per mesh,
    placements and shape, has DCP's write items field for field and in order -- the training
    state, the parameters (which require grad: the properties differ with grad mode, and both
    modes are compared), replicated, unevenly sharded (an empty shard on rank 1) and bfloat16
    DTensors."""
    from faults.world import World
    from tests import _fsdp_fns as F

    with World(2, "gloo", 120, start_method="forkserver") as world:
        got = world.run(F.save_plans_agree, str(tmp_path), timeout=120)
    for r in got:
        for case, (n, n_dcp, equal, _grads) in r.items():
            assert n == n_dcp and n > 0 and equal, (case, r)
        assert r["params/True"][3] > 0 and r["params/False"][3] == 0, r  # both sides of requires_grad seen


def test_two_chunks_of_one_key_in_one_shard_get_distinct_header_keys(tmp_path):
    """One rank holding two chunks of one tensor (a legacy ShardedTensor's two row blocks) writes
    both into its shard file under distinct safetensors keys -- the first by its name, the second
    ``name@offsets`` -- each with its own offsets in ``DCP_SHARDING_INFO``, and the byte range the
    commit record gives each holds that block's bytes (issue 29: a mutant that broke the second key's
    name passed every test, none of which put two chunks of one key on one rank)."""
    from faults.world import World
    from tests import _fsdp_fns as F

    with World(1, "gloo", 120, start_method="forkserver") as world:
        (r,) = world.run(F.two_chunks_in_one_shard, str(tmp_path), timeout=120)
    assert r["same"], r
    assert set(r["keys"]) == {"model.w", "model.w@2,0"}, r
    assert r["sharding"] == {"model.w": {"saved_offsets": [0, 0]}, "model.w@2,0": {"saved_offsets": [2, 0]}}, r
    assert {(o, n) for _rel, o, n in r["record"].values()} == set(r["keys"].values()), r
