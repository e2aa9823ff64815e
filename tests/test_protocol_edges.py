"""Protocol edges that ``faults.suite`` cannot reach, because they depend on the file system's
capabilities or on refckpt's own I/O layer rather than on anything the checkpointer contract
says (issue 29: each test here kills a surviving mutant of the mutation run, named in its
docstring and classed *outside* in benchmarks/mutation_notes.toml).
"""

from __future__ import annotations

import os
import threading

import pytest

from refckpt import DistributedCheckpointer, find_latest_checkpoint, get_training_state
from refckpt.durable import FileIO
from refckpt.errors import CorruptCheckpointError
from refckpt.storage.reader import _read_exact_into

from . import _builders as B

pytestmark = pytest.mark.usefixtures("quiet_single_process_warnings")


class NoExchange(FileIO):
    """A file system without ``renameat2(RENAME_EXCHANGE)`` (vfat, some network and FUSE file
    systems): ``exchange`` says so by returning False, as :meth:`FileIO.exchange` does there."""

    def __init__(self) -> None:
        self.exchanges = 0

    def exchange(self, a: str, b: str) -> bool:
        self.exchanges += 1
        return False


def test_overwrite_without_an_atomic_exchange_replaces_the_step_with_two_renames(tmp_path, caplog):
    """overwrite=True where the file system cannot exchange two directories: the old step is
    moved aside, the new one renamed in, the old one removed; the step loads the new state.
    (Kills ``commit._publish``'s ``replace(old)``: the fallback was never run by any test.)"""
    root = tmp_path / "root"
    io = NoExchange()
    ck = DistributedCheckpointer(overwrite=True, io=io)
    m1, o1 = B.make(1)
    ck.save(root / "global_step_3", get_training_state(m1, o1, {}), global_step=3)
    m2, o2 = B.make(2)
    B.train(m2, o2, range(2))
    with caplog.at_level("WARNING", logger="refckpt"):
        ck.save(root / "global_step_3", get_training_state(m2, o2, {}), global_step=3)
    assert io.exchanges == 1
    assert "no atomic exchange" in caplog.text
    assert sorted(os.listdir(root)) == ["global_step_3", "latest_checkpoint_iteration.txt"]
    assert find_latest_checkpoint(str(root)) == str(root / "global_step_3")
    B.assert_bitwise(B.params(B.load_fresh(root / "global_step_3")[0]), B.params(m2))


def _pipe_in_pieces(data: bytes, piece: int):
    """A real pipe whose writer sends ``data`` in ``piece``-byte writes, each after the reader
    took the one before: every ``readinto`` returns one piece (a short read)."""
    r, w = os.pipe()
    took = threading.Semaphore(0)

    def writer():
        with os.fdopen(w, "wb", buffering=0) as f:
            for i in range(0, len(data), piece):
                f.write(data[i:i + piece])
                took.acquire()

    t = threading.Thread(target=writer, daemon=True)
    t.start()

    class Reader:
        def __init__(self) -> None:
            self.f = os.fdopen(r, "rb", buffering=0)
            self.calls = 0

        def readinto(self, view):
            n = self.f.readinto(view)
            self.calls += 1
            took.release()
            return n

    return Reader(), t


def test_short_reads_are_completed_not_mistaken_for_the_whole_item():
    """A read that returns fewer bytes than asked (a pipe, a signal, a read over 2 GiB on Linux)
    is continued where it stopped. (Kills ``_read_exact_into``'s ``got = n``.)"""
    data = bytes(range(256)) * 40  # 10,240 bytes in 10 pieces of 1,024
    reader, t = _pipe_in_pieces(data, 1024)
    buf = bytearray(len(data))
    _read_exact_into(reader, memoryview(buf), "pipe", 0)
    t.join(10)
    assert reader.calls == 10 and bytes(buf) == data


def test_a_truncated_item_names_the_file_and_the_offset():
    reader, t = _pipe_in_pieces(b"x" * 100, 100)
    with pytest.raises(CorruptCheckpointError, match=r"shard\.safetensors: truncated: wanted 200 bytes at offset 4096, "
                                                     r"file ends after 100"):
        _read_exact_into(reader, memoryview(bytearray(200)), "shard.safetensors", 4096)
    t.join(10)


class PointerFull(FileIO):
    """A disk that fills up exactly at the pointer's write (ENOSPC on its tmp file's write)."""

    def write(self, f, data) -> int:
        if "latest_checkpoint_iteration" in os.path.basename(f.name):  # its tmp file
            raise OSError(28, "No space left on device", f.name)
        return super().write(f, data)


def test_the_pointer_is_written_through_the_checkpointers_io_layer(tmp_path):
    """Every file the save writes goes through its ``io`` (what fault injectors, the power-loss
    recorder and a user's own I/O layer rely on), the pointer included: a disk full at the
    pointer is the save's error, reported as committed-but-no-pointer, and the step resumes.
    (Kills ``commit._write_pointer``'s ``durable_write`` without ``self.io``.)"""
    from refckpt.errors import SaveFailedError

    root = tmp_path / "root"
    m, o = B.make(1)
    with pytest.raises(SaveFailedError, match=r"step 5 is committed at .*global_step_5 .*pointer"):
        DistributedCheckpointer(io=PointerFull()).save(root / "global_step_5", get_training_state(m, o, {}),
                                                        global_step=5)
    assert not (root / "latest_checkpoint_iteration.txt").exists()
    assert find_latest_checkpoint(str(root)) == str(root / "global_step_5")


class DamageStagedRecord(FileIO):
    """Right before publishing, one byte of the staged commit record changes (a bad disk, or
    another process writing into the staging directory)."""

    def mark(self, point: str, **info) -> None:
        from refckpt.protocol import SavePoint

        if point == SavePoint.PUBLISH:
            root = os.path.dirname(info["path"])
            [staging] = [n for n in os.listdir(root) if n.startswith(".") and os.path.isdir(os.path.join(root, n))]
            record = os.path.join(root, staging, ".metadata")
            with open(record, "r+b") as f:
                f.seek(100)
                b = f.read(1)
                f.seek(100)
                f.write(bytes([b[0] ^ 0x01]))
        super().mark(point, **info)


def test_a_staged_record_changed_before_publish_is_not_published(tmp_path):
    """The staging directory about to be published must hold this save's own record, byte for
    byte (its footer: length and SHA-256): a changed one fails the save and publishes nothing.
    (Kills ``commit._check_own_record`` ignoring the footer comparison.)"""
    from refckpt.errors import SaveFailedError

    root = tmp_path / "root"
    m, o = B.make(1)
    DistributedCheckpointer().save(root / "global_step_1", get_training_state(m, o, {}), global_step=1)
    with pytest.raises(SaveFailedError, match=r"does not hold this save's commit record"):
        DistributedCheckpointer(io=DamageStagedRecord()).save(root / "global_step_2", get_training_state(m, o, {}),
                                                               global_step=2)
    assert find_latest_checkpoint(str(root)) == str(root / "global_step_1")
    assert not (root / "global_step_2").exists()


def test_the_shard_writer_under_dcps_plan_caching_saves_twice(tmp_path):
    """``refckpt.storage.SafetensorsWriter`` used on its own with DCP and a planner that caches
    its plan (``DefaultSavePlanner(enable_plan_caching=True)``): the writer must leave the global
    metadata the planner keeps for its next save whole, and both saves load back. (refckpt's own
    planner does not cache, so the checkpointer never takes this branch; kills ``write_data``
    always clearing the metadata.)"""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    from refckpt.storage import SafetensorsReader, SafetensorsWriter

    planner = DefaultSavePlanner(enable_plan_caching=True)
    for step in (1, 2):
        state = {"w": torch.arange(6, dtype=torch.float32) * step, "b": torch.full((3,), float(step))}
        path = tmp_path / f"global_step_{step}"
        path.mkdir()
        dcp.save(state, storage_writer=SafetensorsWriter(str(path)), planner=planner, no_dist=True)
        back = {"w": torch.zeros(6), "b": torch.zeros(3)}
        dcp.load(back, storage_reader=SafetensorsReader(str(path)), no_dist=True)
        assert torch.equal(back["w"], state["w"]) and torch.equal(back["b"], state["b"]), step
