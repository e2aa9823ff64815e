"""refckpt in real gloo worlds of 1, 2 and 4 ranks: exactness, async semantics, failures, fallback.

Worlds come from ``faults.plugin``'s ``world_factory`` and are reused: every rank
function catches the errors its test expects, so no fault here kills a world.
"""

from __future__ import annotations

import os

import pytest

from tests import _ckpt_fns as fns

WORLD_SIZES = [1, 2, 4]


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("save_async", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("per_rank", [True, False], ids=["per_rank", "embedded"])
def test_save_resume_is_bitwise_exact(world_factory, tmp_path, world_size, save_async, per_rank):
    results = world_factory.get(world_size).run(fns.save_resume_continue, str(tmp_path), save_async, per_rank)
    for rank, r in enumerate(results):
        assert r["path"] == str(tmp_path / "global_step_3"), rank
        assert r["pointer"] == "3\n"
        assert r["loaded"] == r["saved"], f"rank {rank}: restored state differs from the saved one"
        assert r["resumed"] == r["uninterrupted"], f"rank {rank}: training after resume diverged"
        assert r["extra_ok"], f"rank {rank}: extra_state differs: {r['extra_keys']}"
        assert ("rank" in r["extra_keys"]) == per_rank
    # every rank restored the same model (data parallel), and per-rank extra state is its own
    assert len({tuple(sorted(r["loaded"].items())) for r in results}) == 1
    names = sorted(os.listdir(tmp_path / "global_step_3"))
    assert [n for n in names if n.endswith(".safetensors")] == [f"__{r}_0.safetensors" for r in range(world_size)]
    if per_rank:
        assert sorted(os.listdir(tmp_path / "global_step_3" / "extra_state")) == sorted(
            f"extra_state_rank_{r}.pt" for r in range(world_size))
    else:
        assert "extra_state" not in names
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".")], "staging or tmp files left behind"


@pytest.mark.parametrize("world_size", [2, 4])
def test_sgd_momentum_round_trip(world_factory, tmp_path, world_size):
    results = world_factory.get(world_size).run(fns.save_resume_continue, str(tmp_path), False, True, "sgd")
    for r in results:
        assert r["loaded"] == r["saved"] and r["resumed"] == r["uninterrupted"]
        assert any("momentum_buffer" in k for k in r["saved"])


@pytest.mark.parametrize("world_size", [2, 4])
def test_embedded_extra_state_must_be_rank_invariant(world_factory, tmp_path, world_size):
    results = world_factory.get(world_size).run(fns.embedded_rank_variant, str(tmp_path))
    for r in results:
        assert r.startswith("ConfigError") and "extra_state_per_rank=True" in r, r
    assert not (tmp_path / "global_step_1").exists()


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("save_async", [False, True], ids=["sync", "async"])
def test_failed_save_publishes_nothing_on_any_rank(world_factory, tmp_path, world_size, save_async):
    bad_rank = world_size - 1
    results = world_factory.get(world_size).run(fns.failed_save, str(tmp_path), save_async, bad_rank)
    for rank, r in enumerate(results):
        if save_async:
            assert r["raised_sync"] is None
            assert r["early_check"] == "no error yet"
            assert r["raised_async"] and "AsyncSaveFailedError" in r["raised_async"], (rank, r)
            assert "No space left" in r["raised_async"] or "ENOSPC" in r["raised_async"] or "28" in r["raised_async"]
            assert r["wait_raised"] is False
        else:
            assert r["raised_sync"] and "SaveFailedError" in r["raised_sync"], (rank, r)
            assert f"rank(s) [{bad_rank}]" in r["raised_sync"]
        assert r["latest"] == str(tmp_path / "global_step_2")
        assert r["pointer"] == "2\n"
        assert r["entries"] == ["global_step_2", "latest_checkpoint_iteration.txt"], r["entries"]
        assert r["loaded_path"] == str(tmp_path / "global_step_2") and r["loaded_ok"]


def _flip_tensor_byte(shard: str) -> None:
    """Flip one bit inside the tensor data of a safetensors shard (past the header)."""
    import json
    import struct

    with open(shard, "r+b") as f:
        (hlen,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(hlen))
        key = next(k for k, v in header.items() if k != "__metadata__" and not k.startswith("__bytes__")
                   and v["data_offsets"][1] > v["data_offsets"][0])
        pos = 8 + hlen + header[key]["data_offsets"][0]
        f.seek(pos)
        b = f.read(1)[0]
        f.seek(pos)
        f.write(bytes([b ^ 0x10]))


@pytest.mark.parametrize("world_size", [2, 4])
def test_corrupt_shard_on_one_rank_falls_back_on_all_ranks(world_factory, tmp_path, world_size):
    world = world_factory.get(world_size)
    saved = world.run(fns.save_steps, str(tmp_path), [2, 4])
    _flip_tensor_byte(str(tmp_path / "global_step_4" / f"__{world_size - 1}_0.safetensors"))
    results = world.run(fns.resume, str(tmp_path))
    for rank, r in enumerate(results):
        assert "error" not in r, r
        assert r["path"] == str(tmp_path / "global_step_2"), (rank, r)
        assert r["step"] == 2
        assert r["digest"] == saved[rank][2], f"rank {rank}: fallback state differs from step 2"
        assert r["warnings"] and "ALL ranks fall back" in r["warnings"][0]


@pytest.mark.parametrize("world_size", [2])
def test_overwrite_refused_then_allowed(world_factory, tmp_path, world_size):
    for r in world_factory.get(world_size).run(fns.overwrite, str(tmp_path)):
        assert r["refused"] and "overwrite=True" in r["refused"] and "global_step_1" in r["refused"]
        assert r["after_refusal"], "refused save damaged the old checkpoint"
        assert r["after_overwrite"], "overwrite did not take effect"
        assert r["entries"] == ["global_step_1", "latest_checkpoint_iteration.txt"]


@pytest.mark.parametrize("world_size", [2])
def test_two_checkpointer_instances_never_overlap_their_collectives(world_factory, tmp_path, world_size):
    """Both instances share one checkpoint process group; B's save must wait for A's async save."""
    for r in world_factory.get(world_size).run(fns.two_instances, str(tmp_path)):
        assert r["latest"] == str(tmp_path / "global_step_4")
        assert r["steps"] == ["global_step_2", "global_step_4"]
