"""The paths that make refckpt fast (issue: performance) keep it correct.

* Async staging reuses its host buffers across saves: a save still captures exactly the
  values at the moment ``save`` returned, even when training mutates the tensors right after
  and the next save writes into the same buffers; shapes that change get new buffers.
* Checksums are computed block by block on a helper thread while writing and reading: the
  recorded crc32 is the crc32 of the bytes in the file (recomputed here from the file, not
  from refckpt's code), and a flipped byte in any block of a multi-block item is caught.

Block sizes are shrunk with ``monkeypatch`` (configuration, not a mock) so tiny tensors span
many blocks and every hand-off to the checksum thread is exercised.
"""

from __future__ import annotations

import os
import zlib

import crc32c
import pytest
import torch

import refckpt.storage.crc as S
from refckpt import DistributedCheckpointer
from refckpt.errors import CorruptCheckpointError
from refckpt.layout import MANIFEST_ATTR, METADATA_FILE
from refckpt.safeload import load_metadata

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _state(seed: int, n: int = 3000) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"model": {"w": torch.randn(n, generator=g), "b": torch.randn(7, generator=g),
                      "big": torch.randn(4, n, generator=g)}}


def _clone(state: dict) -> dict:
    return {"model": {k: v.clone() for k, v in state["model"].items()}}


def _load(step_dir: str, like: dict) -> dict:
    out = {"model": {k: torch.zeros_like(v) for k, v in like["model"].items()}}
    DistributedCheckpointer().load(step_dir, out)
    return out


def _equal(a: dict, b: dict) -> bool:
    return all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])


@pytest.fixture
def small_blocks(monkeypatch):
    monkeypatch.setattr(S, "_IO_BLOCK", 4096)
    monkeypatch.setattr(S, "_INLINE_CRC", 0)
    import refckpt.staging as St

    monkeypatch.setattr(St, "_PIECE", 4096)
    monkeypatch.setattr(St, "_SMALL", 1024)


def test_async_saves_reuse_staging_and_capture_the_moment_of_return(tmp_path, small_blocks):
    root = str(tmp_path / "ckpt")
    ck = DistributedCheckpointer()
    live = _state(1)
    expected = {}
    ptrs = []
    for step in (1, 2, 3):
        expected[step] = _clone(live)
        ck.save(root, live, global_step=step, save_async=True)
        ptrs.append({k: v.data_ptr() for k, v in ck._stager._bufs.items()})
        for t in live["model"].values():  # training mutates in place while the save persists
            t.mul_(-3.0).add_(step)
    ck.maybe_wait_for_async_save()
    assert ptrs[0] == ptrs[1] == ptrs[2], "later saves must write into the first save's buffers"
    assert ck._stager.held_bytes == sum(t.numel() * 4 for t in live["model"].values())
    for step in (1, 2, 3):
        got = _load(os.path.join(root, f"global_step_{step}"), live)
        assert _equal(got, expected[step]), f"step {step} does not hold the values at save time"
    ck.close()
    assert ck._stager.held_bytes == 0


def test_changed_shape_gets_a_new_buffer_and_reuse_can_be_turned_off(tmp_path):
    root = str(tmp_path / "ckpt")
    ck = DistributedCheckpointer()
    a = _state(2)
    ck.save(root, a, global_step=1, save_async=True)
    before = {k: v.data_ptr() for k, v in ck._stager._bufs.items()}
    b = _state(3)
    b["model"]["w"] = torch.randn(10)  # resized between saves
    ck.save(root, b, global_step=2, save_async=True)
    ck.maybe_wait_for_async_save()
    after = {k: v.data_ptr() for k, v in ck._stager._bufs.items()}
    assert after[("model", "w")] != before[("model", "w")]
    assert after[("model", "big")] == before[("model", "big")]
    assert _equal(_load(os.path.join(root, "global_step_2"), b), b)
    ck.close()

    once = DistributedCheckpointer(reuse_staging=False)
    once.save(root, a, global_step=3, save_async=True)
    assert once._stager.held_bytes == 0  # the in-flight save owns its copy; nothing kept after
    once.maybe_wait_for_async_save()
    assert _equal(_load(os.path.join(root, "global_step_3"), a), a)


def _manifest(step_dir: str) -> dict:
    return getattr(load_metadata(os.path.join(step_dir, METADATA_FILE)), MANIFEST_ATTR)


@pytest.mark.parametrize("save_async", [False, True])
def test_blockwise_checksums_are_the_crc32_of_the_file_bytes(tmp_path, small_blocks, save_async):
    root = str(tmp_path / "ckpt")
    state = _state(4)
    ck = DistributedCheckpointer()
    ck.save(root, state, global_step=1, save_async=save_async)
    ck.maybe_wait_for_async_save()
    step = os.path.join(root, "global_step_1")
    files = _manifest(step)["files"]
    shards = [rel for rel in files if rel.endswith(".safetensors")]
    assert shards
    multi_block = 0
    for rel in shards:
        with open(os.path.join(step, rel), "rb") as f:
            data = f.read()
        chunks = files[rel]["chunks"]
        assert sum(n for _o, n, _c in chunks) == len(data) == files[rel]["size"]
        for off, n, crc in chunks:
            assert crc32c.crc32c(data[off:off + n]) == crc, (rel, off)
            multi_block += n > 4096
    assert multi_block >= 2  # "w" and "big" span several 4 KiB blocks


@pytest.mark.parametrize("where", ["first block", "middle block", "last byte"])
def test_flipped_byte_in_any_block_fails_the_load(tmp_path, small_blocks, where):
    root = str(tmp_path / "ckpt")
    state = _state(5)
    DistributedCheckpointer().save(root, state, global_step=1)
    step = os.path.join(root, "global_step_1")
    md = load_metadata(os.path.join(step, METADATA_FILE))
    big = next(v for k, v in md.storage_data.items() if k.fqn == "model.big")
    pos = {"first block": 10, "middle block": big.length // 2, "last byte": big.length - 1}[where]
    path = os.path.join(step, big.relative_path)
    with open(path, "r+b") as f:
        f.seek(big.offset + pos)
        byte = f.read(1)
        f.seek(big.offset + pos)
        f.write(bytes([byte[0] ^ 0x10]))
    with pytest.raises(CorruptCheckpointError) as ei:
        _load(step, state)
    msg = str(ei.value)
    assert "model.big" in msg and path in msg and "checksum mismatch" in msg
    # the other items were fine: the same file without the flip loads
    with open(path, "r+b") as f:
        f.seek(big.offset + pos)
        f.write(byte)
    assert _equal(_load(step, state), state)


def _rewrite_checksums(step: str, algo: str, fn) -> None:
    """Make the commit record name ``algo`` and hold ``fn``'s checksums of the bytes on disk, as a
    refckpt/1 record did (no record checksum footer, no tensor table)."""
    import pickle

    path = os.path.join(step, METADATA_FILE)
    md = load_metadata(path)
    man = getattr(md, MANIFEST_ATTR)
    man["checksum"] = algo
    man["format"] = "refckpt/1"
    del man["record_checksum"], man["tensors"]
    for rel, rec in man["files"].items():
        with open(os.path.join(step, rel), "rb") as f:
            data = f.read()
        rec["chunks"] = [[off, n, fn(data[off:off + n]) if fn else 0] for off, n, _c in rec["chunks"]]
    with open(path, "wb") as f:
        pickle.dump(md, f)


def test_checkpoints_with_zlib_crc32_still_load_and_catch_damage(tmp_path):
    """Checkpoints written before the switch to CRC-32C record "crc32" (zlib): still verified."""
    root = str(tmp_path / "ckpt")
    state = _state(6)
    DistributedCheckpointer().save(root, state, global_step=1)
    step = os.path.join(root, "global_step_1")
    _rewrite_checksums(step, "crc32", zlib.crc32)
    assert _equal(_load(step, state), state)
    md = load_metadata(os.path.join(step, METADATA_FILE))
    w = next(v for k, v in md.storage_data.items() if k.fqn == "model.w")
    with open(os.path.join(step, w.relative_path), "r+b") as f:
        f.seek(w.offset + 5)
        b = f.read(1)
        f.seek(w.offset + 5)
        f.write(bytes([b[0] ^ 1]))
    with pytest.raises(CorruptCheckpointError, match="model.w .*crc32 "):
        _load(step, state)


def test_unknown_checksum_algorithm_is_refused_as_corrupt(tmp_path):
    root = str(tmp_path / "ckpt")
    state = _state(7)
    DistributedCheckpointer().save(root, state, global_step=1)
    step = os.path.join(root, "global_step_1")
    _rewrite_checksums(step, "md4-lol", None)
    with pytest.raises(CorruptCheckpointError, match="unknown checksum algorithm 'md4-lol'"):
        _load(step, state)
