"""Nothing resume reads is trusted unchecked: the commit record's own checksum, its structure,
bounded parsing, regular files only, trees of any depth, one writer per root.

Each test damages or forges a real checkpoint on disk (steps 4 and 42 from ``conftest.ckpt``)
the way a failing disk, a bad copy or an attacker would, and checks that resume lands bitwise
on what was saved -- the newest step when the damage touches nothing it needs, the previous
step otherwise -- with a :class:`refckpt.errors.CheckpointError` wherever something is refused.
Parameters are compared with snapshots taken before the save, never with what the code under
test read back.
"""

from __future__ import annotations

import errno
import hashlib
import io
import logging
import multiprocessing
import os
import pickle
import random
import re
import resource
import shutil
import signal
import stat
import struct
import sys
import traceback
import zlib

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystemReader, _StorageInfo
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

import refckpt
from refckpt import DistributedCheckpointer, check_step_dir, find_latest_checkpoint, get_training_state
from refckpt import errors as E
from refckpt.durable import FileIO, remove_tree, tree_size
from refckpt.layout import MANIFEST_ATTR, METADATA_FILE
from refckpt.planner import RefLoadPlanner
from refckpt.protocol import SavePoint
from refckpt.record import RECORD_FOOTER_LEN, RECORD_MAGIC, Manifest, read_record_bytes, scan_pickle
from refckpt.safeload import load_record
from refckpt.storage import SafetensorsReader, SafetensorsWriter, tensor_bytes, tensor_to_bytes, verify_step_files
from refckpt.tools.cli import main as cli_main

from . import _builders as B

pytestmark = pytest.mark.usefixtures("quiet_single_process_warnings")


def _fresh_state():
    model, opt = B.make(99, "adamw")
    return model, opt, refckpt.get_training_state(model, opt, {})


def _resumes(root: str, want_dir: str, params: dict, step: int) -> None:
    """``load_latest`` lands on ``want_dir`` and restores ``params`` (kept from before the save) bitwise."""
    model, opt, state = _fresh_state()
    with _deadline(60):
        assert DistributedCheckpointer().load_latest(root, state) == want_dir
    refckpt.set_training_state(model, opt, state)
    B.assert_bitwise(B.params(model), params)
    assert state["extra_state"]["global_step"] == step


_deadline = B.no_hang


def _record(step_dir: str) -> str:
    return os.path.join(step_dir, METADATA_FILE)


def _flip(path: str, pos: int, bit: int) -> None:
    with open(path, "r+b") as f:
        f.seek(pos)
        b = f.read(1)[0]
        f.seek(pos)
        f.write(bytes([b ^ (1 << bit)]))


def _cli(args: list[str], capsys) -> tuple[int, str]:
    rc = cli_main(args)
    return rc, capsys.readouterr().out


# -- 1. a self-verifying commit record ------------------------------------------------------------
def test_new_records_carry_their_own_checksum_and_dcp_still_reads_them(ckpt):
    _root, _s4, s42 = ckpt
    data = open(_record(s42), "rb").read()
    body, footer = data[:-RECORD_FOOTER_LEN], data[-RECORD_FOOTER_LEN:]
    assert footer[:16] == RECORD_MAGIC
    assert struct.unpack("<Q", footer[16:24])[0] == len(body)
    assert footer[24:] == hashlib.sha256(body).digest()  # recomputed here, not read from refckpt
    md, checksum = load_record(_record(s42))
    assert checksum == "sha256"
    assert getattr(md, MANIFEST_ATTR)["format"] == "refckpt/2"
    # DCP's own reader (pickle.load stops at STOP) reads the same record, footer and all.
    theirs = FileSystemReader(s42).read_metadata()
    assert theirs.state_dict_metadata == md.state_dict_metadata
    assert theirs.storage_data == md.storage_data


@pytest.mark.parametrize("seed", range(4))
def test_every_flipped_bit_of_the_record_falls_back(ckpt, template, seed):
    """Single-bit flips anywhere in the record (pickle, manifest, footer), 16 per seed."""
    root, s4, s42 = ckpt
    path = _record(s42)
    original = open(path, "rb").read()
    rng = random.Random(seed)
    positions = [rng.randrange(len(original)) for _ in range(15)] + [len(original) - rng.randrange(1, RECORD_FOOTER_LEN)]
    for pos in positions:
        bit = rng.randrange(8)
        _flip(path, pos, bit)
        st = check_step_dir(s42, root)
        assert not st.complete and st.damaged, f"flip of bit {bit} at byte {pos}/{len(original)}: {st.reason}"
        assert find_latest_checkpoint(root) == s4
        with pytest.raises(E.CheckpointError):
            DistributedCheckpointer().load(s42, _fresh_state()[2])
        with open(path, "wb") as f:
            f.write(original)
    _flip(path, positions[0], 0)
    _resumes(root, s4, template[1][4], 4)


def test_a_refckpt2_record_that_lost_its_footer_is_corrupt(ckpt, template):
    root, s4, s42 = ckpt
    data = open(_record(s42), "rb").read()
    with open(_record(s42), "wb") as f:
        f.write(data[:-RECORD_FOOTER_LEN])  # a valid pickle of a refckpt/2 record, footer cut off
    st = check_step_dir(s42, root)
    assert not st.complete and "checksum footer, which is gone or damaged" in st.reason
    _resumes(root, s4, template[1][4], 4)


def _as_refckpt1(step_dir: str) -> None:
    """Rewrite a record as refckpt before the record checksum wrote it: no footer, format refckpt/1."""
    md = load_record(_record(step_dir))[0]
    man = getattr(md, MANIFEST_ATTR)
    man["format"] = "refckpt/1"
    del man["record_checksum"], man["tensors"], man["writer"]
    with open(_record(step_dir), "wb") as f:
        pickle.dump(md, f)


def test_records_written_before_the_checksum_still_load_and_say_so(ckpt, template, capsys):
    root, _s4, s42 = ckpt
    _as_refckpt1(s42)
    st = check_step_dir(s42, root)
    assert st.complete and st.record_checksum is None
    _resumes(root, s42, template[1][42], 42)
    rc, out = _cli(["ls", root], capsys)
    assert rc == 0
    row42 = next(line for line in out.splitlines() if line.startswith("42 "))
    row4 = next(line for line in out.splitlines() if line.startswith("4 "))
    assert "refckpt/1" in row42 and "unchecked" in row42
    assert "refckpt/2" in row4 and "sha256" in row4
    rc, out = _cli(["verify", s42], capsys)
    assert rc == 0 and "commit record carries no checksum" in out
    rc, out = _cli(["verify", os.path.join(root, "global_step_4")], capsys)
    assert rc == 0 and "commit record matches its sha256" in out


def test_verify_reports_a_damaged_record(ckpt, capsys):
    root, _s4, s42 = ckpt
    _flip(_record(s42), 100, 3)
    rc, out = _cli(["verify", root], capsys)
    assert rc == 1
    assert "global_step_42: FAIL" in out and "fails its own checksum" in out
    assert "global_step_4: OK" in out and "resume would load global_step_4" in out


# -- 2. structure, for records whose checksum holds (a forgery by someone who knows the format) ---
def _chunk_edit(fqn: str, **change):
    def edit(md):
        smd = md.state_dict_metadata[fqn]
        c = smd.chunks[0]
        smd.chunks[0] = ChunkStorageMetadata(offsets=torch.Size(change.get("offsets", c.offsets)),
                                             sizes=torch.Size(change.get("sizes", c.sizes)))
    return edit


def _storage_edit(fqn: str, **change):
    def edit(md):
        for k, info in md.storage_data.items():
            if k.fqn == fqn:
                md.storage_data[k] = _StorageInfo(change.get("relative_path", info.relative_path),
                                                  change.get("offset", info.offset), change.get("length", info.length))
    return edit


def _two_chunks(md):
    """model.0.weight (5x4) recorded as two overlapping row blocks."""
    smd = md.state_dict_metadata["model.0.weight"]
    smd.chunks = [ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([3, 4])),
                  ChunkStorageMetadata(torch.Size([2, 0]), torch.Size([3, 4]))]


def _dtype_edit(md):
    smd = md.state_dict_metadata["model.0.bias"]
    smd.properties.dtype = torch.int32  # same element size: only the manifest's table can tell


def _shape_edit(md):
    smd = md.state_dict_metadata["model.0.weight"]
    smd.size = torch.Size([4, 5])
    smd.chunks = [ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([4, 5]))]


def _rename_optimizer_key(md):
    """An optimizer moment's key changed: the planner would keep zeros for the real one."""
    key = "optimizer.state.0.weight.exp_avg" if "optimizer.state.0.weight.exp_avg" in md.state_dict_metadata else \
        next(k for k in md.state_dict_metadata if k.endswith("exp_avg"))
    md.state_dict_metadata[key.replace("exp_avg", "exp_avh")] = md.state_dict_metadata.pop(key)


def _planner_data_edit(md):
    """The record's key paths (how a flattened key such as ``optimizer.state.0.exp_avg`` maps back
    to nested containers, which a skeleton-less load and refckpt's tools rebuild from) malformed."""
    md.planner_data = {"model.0.weight": "model.0.weight"}  # a string where a tuple of path parts belongs


def _storage_key_edit(md):
    """One storage key a plain string instead of DCP's MetadataIndex."""
    md.storage_data = {("model.0.weight" if k.fqn == "model.0.weight" else k): v for k, v in md.storage_data.items()}


def _manifest_blocks_edit(md):
    """A file entry of refckpt's manifest whose checksummed blocks are not a list."""
    files = getattr(md, MANIFEST_ATTR)["files"]
    files[sorted(files)[0]]["chunks"] = "0:64:123"


FORGERIES = {
    "planner_data_malformed": (_planner_data_edit, r"key paths \(planner_data\) are malformed"),
    "storage_key_malformed": (_storage_key_edit, r"storage key 'model.0.weight' is malformed"),
    # the entry's error names the file it is in (the record), inside the step's reason
    "manifest_blocks_malformed": (_manifest_blocks_edit, r"\(\.metadata: manifest entry '__0_0\.safetensors' has "
                                                         r"malformed checksum blocks"),
    "chunk_offsets_moved": (_chunk_edit("model.0.weight", offsets=[1, 0]), "reaches outside shape"),
    "chunk_shrunk_leaves_a_gap": (_chunk_edit("model.0.weight", sizes=[4, 4]), "cover 16 of its 20 elements"),
    "chunks_overlap": (_two_chunks, "overlap"),
    "chunk_rank_mismatch": (_chunk_edit("model.0.weight", offsets=[0]), "1-d offsets"),
    "length_beyond_file": (_storage_edit("model.0.weight", length=1 << 30), "which has"),
    "offset_beyond_file": (_storage_edit("model.0.weight", offset=1 << 40), "which has"),
    "negative_offset": (_storage_edit("model.0.weight", offset=-8), "malformed"),
    "file_not_in_the_step": (_storage_edit("model.0.weight", relative_path="__9_0.safetensors"), "not a file of this step"),
    "dtype_differs_from_manifest": (_dtype_edit, "the manifest says"),
    "shape_differs_from_manifest": (_shape_edit, "the manifest says"),
    "optimizer_key_renamed": (_rename_optimizer_key, "different tensors|no storage entry"),
}


@pytest.mark.parametrize("name", sorted(FORGERIES))
def test_forged_records_are_corrupt_and_resume_falls_back(ckpt, template, name):
    root, s4, s42 = ckpt
    edit, why = FORGERIES[name]
    B.rewrite_commit_record(s42, edit)  # with a valid record checksum
    assert load_record(_record(s42))[1] == "sha256"
    st = check_step_dir(s42, root)
    assert not st.complete and st.damaged and re.search(why, st.reason), st.reason
    with pytest.raises(E.CorruptCheckpointError, match=why) as ei:
        DistributedCheckpointer().load(s42, _fresh_state()[2])
    assert str(ei.value).startswith(s42), ei.value  # the error names the step it refuses
    _resumes(root, s4, template[1][4], 4)


def test_a_record_in_pickle_protocol_2_still_resumes(ckpt, template):
    """The same record re-encoded with pickle protocol 2 (no FRAME, BINPUT memo): the bounded reader
    follows it and the step resumes bitwise. (Protocols 0 and 1 pickle the record's dataclasses
    through copy_reg, which the record's allow-list refuses, as it should.)"""
    root, _s4, s42 = ckpt
    B.rewrite_commit_record(s42, lambda md: None, protocol=2)
    st = check_step_dir(s42, root)
    assert st.complete, st.reason
    _resumes(root, s42, template[1][42], 42)


def test_a_real_model_mismatch_is_the_callers_not_a_fallback(ckpt):
    """The record's checksum and structure hold, so a shape difference is the caller's model."""
    root, _s4, s42 = ckpt
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.ReLU(), torch.nn.Linear(6, 2))
    opt = torch.optim.AdamW(model.parameters())
    state = refckpt.get_training_state(model, opt, {})
    with pytest.raises(E.ShapeMismatchError):
        DistributedCheckpointer().load_latest(root, state)


# -- 3. bounded parsing ---------------------------------------------------------------------------
def _forge_record_bytes(step_dir: str, body: bytes) -> None:
    with open(_record(step_dir), "wb") as f:
        f.write(body)


_BOMBS = {
    # LONG_BINPUT to memo slot 2**31: CPython's unpickler would size its memo array to it (16 GiB).
    "memo_index": b"\x80\x04]r\xff\xff\xff\x7f.",
    # BINBYTES declaring 2 GiB in a 10-byte file: CPython allocates the buffer before reading.
    "binbytes_length": b"\x80\x04B\xff\xff\xff\x7f" + b"x" * 4 + b".",
    # BINUNICODE8 declaring 2**40 bytes.
    "unicode8_length": b"\x80\x04\x8d" + struct.pack("<Q", 1 << 40) + b"abc.",
    # FRAME past the end.
    "frame_length": b"\x80\x04\x95" + struct.pack("<Q", 1 << 40) + b"N.",
    "trailing_bytes": pickle.dumps({"a": 1}) + b"garbage",
    "no_stop": pickle.dumps([1, 2, 3])[:-1],
}


def _run_limited(fn, limit_bytes: int):
    """Run ``fn`` in a forked child under RLIMIT_AS = current size + ``limit_bytes``; (ok, text)."""
    ctx = multiprocessing.get_context("fork")
    parent, child = ctx.Pipe(duplex=False)

    def body():
        with open("/proc/self/statm") as f:
            vm = int(f.read().split()[0]) * resource.getpagesize()
        resource.setrlimit(resource.RLIMIT_AS, (vm + limit_bytes, vm + limit_bytes))
        try:
            child.send((True, repr(fn())))
        except BaseException as e:  # noqa: BLE001 - reported to the parent
            child.send((False, f"{type(e).__module__}.{type(e).__name__}: {e}\n{traceback.format_exc()}"))

    p = ctx.Process(target=body)
    p.start()
    child.close()
    if not parent.poll(60):
        p.kill()
        raise AssertionError("the child took more than 60 s")
    out = parent.recv()
    p.join(10)
    return out


@pytest.mark.parametrize("bomb", sorted(_BOMBS))
def test_crafted_record_pickles_are_refused_within_bounded_memory(ckpt, template, bomb):
    root, s4, s42 = ckpt
    _forge_record_bytes(s42, _BOMBS[bomb])

    def load():
        try:
            load_record(_record(s42))
        except E.CorruptCheckpointError as e:
            return "corrupt: " + str(e)
        return "loaded"

    ok, text = _run_limited(load, 256 << 20)
    assert ok and text.startswith("'corrupt: "), text
    assert not check_step_dir(s42, root).complete
    _resumes(root, s4, template[1][4], 4)


def test_the_same_bombs_with_a_valid_record_checksum_are_refused(ckpt):
    """A forger who appends a correct footer gets no further: the scan runs on every record."""
    from refckpt.record import encode_record

    _root, _s4, s42 = ckpt
    for body in _BOMBS.values():
        _forge_record_bytes(s42, encode_record(body))
        with pytest.raises(E.CorruptCheckpointError):
            load_record(_record(s42))


def test_scan_accepts_real_records_and_plain_pickles():
    scan_pickle(pickle.dumps({"a": [1, 2, (3, 4)], "b": b"x" * 1000}, protocol=2), "t")
    scan_pickle(pickle.dumps(list(range(5000)), protocol=pickle.HIGHEST_PROTOCOL), "t")
    scan_pickle(pickle.dumps([1 << 3000, -(1 << 3000)], protocol=2), "t")  # LONG4: a signed 4-byte length


@pytest.mark.parametrize(("data", "reason"), [
    (pickle.dumps([1, 2], protocol=2) + b"xyz", "(3 bytes after the end at byte "),
    (b"\x80\x04\x95" + (1000).to_bytes(8, "little") + b"N.", "(a frame longer than the data at byte 2)"),
], ids=["after_stop", "frame_past_the_end"])
def test_scan_names_what_is_malformed_in_a_pickle(data, reason):
    """The scan's refusal says what it found and where: the bytes left after STOP, counted; a
    FRAME that declares more bytes than follow it."""
    with pytest.raises(E.CorruptCheckpointError) as err:
        scan_pickle(data, "t")
    assert str(err.value).startswith("t: cannot parse") and reason in str(err.value), err.value


def test_records_larger_than_the_limit_are_not_read(ckpt):
    _root, _s4, s42 = ckpt
    size = os.path.getsize(_record(s42))
    with pytest.raises(E.CorruptCheckpointError, match="more than the 100 refckpt reads"):
        read_record_bytes(_record(s42), limit=100)
    assert len(read_record_bytes(_record(s42), limit=size)) == size


def test_an_oversized_length_allocates_nothing_before_it_is_refused(ckpt, template):
    """A storage entry declaring 1 GiB for a 20 KB shard, record checksum valid: refused by
    structure before the reader allocates, in a child limited to 256 MiB above its size."""
    root, s4, s42 = ckpt
    B.rewrite_commit_record(s42, _storage_edit("model.0.weight", length=1 << 30))

    def load():
        state = _fresh_state()[2]
        try:
            DistributedCheckpointer().load(s42, state)
        except E.CorruptCheckpointError as e:
            return "corrupt: " + str(e)
        return "loaded"

    ok, text = _run_limited(load, 256 << 20)
    assert ok and "corrupt: " in text and "which has" in text, text
    _resumes(root, s4, template[1][4], 4)


# -- 4. non-regular files ------------------------------------------------------------------------
def _plant(path: str, kind: str) -> None:
    os.unlink(path)
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "device":
        try:
            os.mknod(path, stat.S_IFCHR | 0o600, os.makedev(1, 3))
        except PermissionError as e:
            pytest.skip(f"mknod of a character device is not permitted here ({e})")
    else:
        raise AssertionError(kind)


@pytest.mark.parametrize("kind", ["fifo", "device"])
@pytest.mark.parametrize("where", ["shard", "extra_state", "record"])
def test_non_regular_files_never_block_and_resume_falls_back(ckpt, template, capsys, kind, where):
    root, s4, s42 = ckpt
    target = {"shard": os.path.join(s42, B.SHARD), "extra_state": os.path.join(s42, B.EXTRA_REL),
              "record": _record(s42)}[where]
    _plant(target, kind)
    if where != "record":  # listed in the record with the size a FIFO or device reports: 0
        def edit(md):
            rel = os.path.relpath(target, s42)
            getattr(md, MANIFEST_ATTR)["files"][rel]["size"] = 0
            getattr(md, MANIFEST_ATTR)["files"][rel]["chunks"] = []
        B.rewrite_commit_record(s42, edit)
    with _deadline(30):
        st = check_step_dir(s42, root)
        assert not st.complete
        assert find_latest_checkpoint(root) == s4
        with pytest.raises(E.CheckpointError):
            DistributedCheckpointer().load(s42, _fresh_state()[2])
        rc, out = _cli(["verify", root], capsys)
        assert rc == 1 and "global_step_42: FAIL" in out
        rc, out = _cli(["ls", root], capsys)
        assert rc == 0 and re.search(r"^42 +(corrupt|incomplete)", out, re.M), out
        rc, out = _cli(["inspect", s42], capsys)
        assert rc != 0
    _resumes(root, s4, template[1][4], 4)


# -- 5. trees of any depth -----------------------------------------------------------------------
def _deep_tree(parent: str, depth: int) -> None:
    """``parent/d/d/.../d/f`` ``depth`` levels deep, made relative to descriptors (no long paths)."""
    fd = os.open(parent, os.O_RDONLY)
    try:
        for _ in range(depth):
            os.mkdir("d", dir_fd=fd)
            sub = os.open("d", os.O_RDONLY, dir_fd=fd)
            os.close(fd)
            fd = sub
        os.close(os.open("f", os.O_WRONLY | os.O_CREAT, 0o600, dir_fd=fd))
    finally:
        os.close(fd)


def test_a_deep_tree_in_an_old_step_is_retained_listed_and_removed(ckpt, template, capsys):
    root, s4, s42 = ckpt
    _deep_tree(s4, 1500)
    rc, out = _cli(["ls", root], capsys)
    assert rc == 0 and re.search(r"^4 +complete", out, re.M), out
    rc, _out = _cli(["verify", root], capsys)
    assert rc == 0  # the tree is not listed by the record: both steps are intact
    model, opt = B.make(7, "adamw")
    B.train(model, opt, range(3))
    weights = B.params(model)
    B.save(root, model, opt, 50, keep_last=1)  # retention deletes step 4 (and 42) with their trees
    assert sorted(n for n in os.listdir(root) if not n.startswith(".") and n.startswith("global")) == ["global_step_50"]
    assert [n for n in os.listdir(root) if n.endswith(".deleting")] == []
    B.save(root, model, opt, 51, keep_last=1)
    _resumes(root, os.path.join(root, "global_step_51"), weights, 51)


class _CannotRemoveLeftovers(FileIO):
    """A file system on which directories renamed aside for deletion cannot be removed (EBUSY)."""

    def rmtree(self, path: str) -> None:
        if path.endswith(".deleting"):
            raise OSError(errno.EBUSY, os.strerror(errno.EBUSY), path)
        super().rmtree(path)


class _RetentionBlowsUp(FileIO):
    def rmtree(self, path: str) -> None:
        raise RecursionError("maximum recursion depth exceeded")


def test_a_leftover_that_cannot_be_removed_never_blocks_a_later_save(ckpt, caplog):
    root, _s4, _s42 = ckpt
    model, opt = B.make(7, "adamw")
    with caplog.at_level(logging.WARNING, logger="refckpt"):
        B.save(root, model, opt, 50, keep_last=1, io=_CannotRemoveLeftovers())
        B.save(root, model, opt, 51, keep_last=1, io=_CannotRemoveLeftovers())
        B.save(root, model, opt, 52, keep_last=1, io=_CannotRemoveLeftovers())
    assert "could not remove" in caplog.text or "could not delete" in caplog.text
    assert find_latest_checkpoint(root) == os.path.join(root, "global_step_52")
    weights = B.params(model)
    B.save(root, model, opt, 53, keep_last=1)  # a healthy file system removes every leftover
    assert [n for n in os.listdir(root) if n.endswith(".deleting")] == []
    _resumes(root, os.path.join(root, "global_step_53"), weights, 53)


def test_an_error_after_publishing_never_claims_the_previous_step_is_newest(ckpt, caplog):
    root, _s4, _s42 = ckpt
    model, opt = B.make(7, "adamw")
    weights = B.params(model)
    with caplog.at_level(logging.WARNING, logger="refckpt"):
        B.save(root, model, opt, 50, keep_last=1, io=_RetentionBlowsUp())  # committed: no error
    assert "step 50 is committed" in caplog.text or "retention could not delete" in caplog.text
    assert "stays the newest" not in caplog.text
    _resumes(root, os.path.join(root, "global_step_50"), weights, 50)
    B.save(root, model, opt, 51, keep_last=1)
    assert sorted(n for n in os.listdir(root) if n.startswith("global_step_")) == ["global_step_51"]


class _FailsAtPointer(FileIO):
    def mark(self, point, **info) -> None:
        if point == SavePoint.POINTER:
            raise RuntimeError("the pointer's file server went away")


def test_a_failure_after_the_rename_says_the_step_is_committed(ckpt):
    root, _s4, _s42 = ckpt
    model, opt = B.make(7, "adamw")
    weights = B.params(model)
    with pytest.raises(E.SaveFailedError) as ei:
        B.save(root, model, opt, 50, io=_FailsAtPointer())
    assert "step 50 is committed at" in str(ei.value) and "stays the newest" not in str(ei.value)
    _resumes(root, os.path.join(root, "global_step_50"), weights, 50)


def test_tree_walkers_are_iterative_and_never_follow_links(tmp_path):
    top = tmp_path / "t"
    top.mkdir()
    _deep_tree(str(top), 3000)
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep").write_bytes(b"12345")
    os.symlink(outside, top / "link")
    assert tree_size(str(top)) == len(os.fsencode(str(outside)))  # the link itself; the deep file is empty
    remove_tree(str(top))
    assert not top.exists() and (outside / "keep").read_bytes() == b"12345"
    assert tree_size(str(top)) == 0  # gone (retention's deletion under `refckpt ls`): nothing to count


_TREE_SIZE_CHILD = """
import sys
from refckpt.durable import tree_size
print("ready", flush=True)
sys.stdin.readline()
print(tree_size(sys.argv[1]), flush=True)
"""


def _tree_size_traced(top: str, call: str, inject_at: int | None) -> tuple[int, list[str]]:
    """``tree_size(top)`` in a child that strace attaches to once it is ready (so Python's start-up
    is not counted): the ``call`` system calls it made, and its answer when the ``inject_at``-th
    of them (1-based) failed with ENOENT in the kernel -- an entry vanished at exactly that call."""
    import subprocess

    child = subprocess.Popen([sys.executable, "-c", _TREE_SIZE_CHILD, top], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip() == "ready"
    cmd = ["strace", "-p", str(child.pid), "-e", f"trace={call}"]
    if inject_at is not None:
        cmd += ["-e", f"inject={call}:error=ENOENT:when={inject_at}"]
    tracer = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    assert "attached" in tracer.stderr.readline()  # "Process N attached": now it may go on
    child.stdin.write("go\n")
    child.stdin.flush()
    answer = child.stdout.readline().strip()
    child.wait(timeout=60)
    calls = tracer.stderr.read().splitlines()
    tracer.wait(timeout=60)
    return int(answer), [c for c in calls if c.startswith(f"{call}(")]


@pytest.mark.skipif(shutil.which("strace") is None, reason="strace is not installed")
@pytest.mark.parametrize("call", ["newfstatat", "openat"])
def test_tree_size_skips_an_entry_that_vanishes_while_it_walks_and_counts_the_rest(tmp_path, call):
    """Retention of another job deletes an entry between ``tree_size``'s listing and its stat
    (``newfstatat``: the first entry listed) or its descent (``openat``: the first subdirectory
    entered): the kernel's ENOENT at exactly that system call, injected by strace. The entry is
    skipped and every other one still counted -- the walk goes on after it."""
    top = tmp_path / "t"
    sizes = {}
    for d in ("sub", "sub2"):
        (top / d / "deeper").mkdir(parents=True)
        sizes[d] = len(d) * 100 + 1000
        (top / d / "s").write_bytes(b"y" * (len(d) * 100))
        (top / d / "deeper" / "d").write_bytes(b"z" * 1000)
    for name, n in (("a", 4), ("b", 10), ("c", 7)):
        (top / name).write_bytes(b"x" * n)
        sizes[name] = n
    whole = sum(sizes.values())
    listed = os.listdir(top)  # the order tree_size's scandir sees
    # stat: the first entry listed; descent: subdirectories are entered last listed first
    name = listed[0] if call == "newfstatat" else [n for n in listed if n.startswith("sub")][-1]
    lost = sizes[name]
    assert tree_size(str(top)) == whole
    answer, calls = _tree_size_traced(str(top), call, None)
    assert answer == whole
    hits = [i for i, c in enumerate(calls, 1) if f', "{name}",' in c]
    assert len(hits) == 1, calls  # one call names the entry: the stat of it, or the open of it
    answer, _ = _tree_size_traced(str(top), call, hits[0])
    assert answer == whole - lost, (listed, name)


# -- 6. one writer per root ----------------------------------------------------------------------
class _PauseAt(FileIO):
    """Stops a save at ``point`` until the parent says go (events, never sleeps)."""

    def __init__(self, point: str, reached, go) -> None:
        self.point, self.reached, self.go = point, reached, go

    def mark(self, point, **info) -> None:
        if str(point) == self.point:
            self.reached.set()
            assert self.go.wait(60), "the test never released the paused save"


class _SlowRemoval(FileIO):
    """Removes its first directory as :func:`refckpt.durable.remove_tree` does, through a descriptor
    of it, but stops after its first file (not the commit record) until the parent says go: a
    removal still in progress when another writer publishes that directory."""

    def __init__(self, reached, go) -> None:
        self.reached, self.go, self.paused = reached, go, False

    def rmtree(self, path: str) -> None:
        if self.paused:
            return remove_tree(path)
        self.paused = True

        def is_dir(name: str, fd: int) -> bool:
            return stat.S_ISDIR(os.stat(name, dir_fd=fd, follow_symlinks=False).st_mode)

        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            first = next(n for n in sorted(os.listdir(fd)) if n != METADATA_FILE and not is_dir(n, fd))
            os.unlink(first, dir_fd=fd)
            self.reached.set()
            assert self.go.wait(60), "the test never released the paused removal"
            for name in os.listdir(fd):
                if is_dir(name, fd):
                    remove_tree(f"/proc/self/fd/{fd}/{name}")
                else:
                    os.unlink(name, dir_fd=fd)
        finally:
            os.close(fd)
        os.rmdir(path)


def _writer(root: str, step: int, seed: int, point: str | None, reached, go, out) -> None:
    """One job: train ``seed``'s model ``step`` steps and save it as ``step`` into ``root``."""
    import faulthandler
    import sys
    import warnings

    faulthandler.dump_traceback_later(55, file=sys.__stderr__)  # a writer that hangs says where

    warnings.simplefilter("ignore")
    model, opt = B.make(seed, "adamw")
    B.train(model, opt, range(3))
    fio = (_SlowRemoval(reached, go) if point == "slow-removal" else _PauseAt(point, reached, go) if point
           else FileIO())
    try:
        B.save(root, model, opt, step, io=fio)
        buf = io.BytesIO()  # plain bytes: a tensor would travel as a shared-memory fd that dies with this process
        torch.save(B.params(model), buf)
        out.send(("ok", buf.getvalue()))
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        out.send(("err", f"{type(e).__name__}: {e}"))


def _start(ctx, root, step, seed, point=None):
    reached, go = ctx.Event(), ctx.Event()
    recv, send = ctx.Pipe(duplex=False)
    p = ctx.Process(target=_writer, args=(root, step, seed, point, reached, go, send))
    p.start()
    send.close()
    return p, reached, go, recv


def _result(p, recv):
    assert recv.poll(120), "a writer never finished"
    kind, value = recv.recv()
    p.join(30)
    return (kind, torch.load(io.BytesIO(value), weights_only=True)) if kind == "ok" else (kind, value)


@pytest.mark.parametrize("point", [str(SavePoint.SHARDS), str(SavePoint.COMMIT), str(SavePoint.PUBLISH)])
def test_two_writers_of_one_step_never_publish_a_mix(ckpt, point):
    """Writer A stops at ``point`` of step 43; writer B saves step 43 whole; then A goes on.
    Whatever each is told, every acknowledged save resumes bitwise and nothing mixed is published."""
    root, _s4, _s42 = ckpt
    ctx = multiprocessing.get_context("fork")
    a, a_reached, a_go, a_out = _start(ctx, root, 43, seed=11, point=point)
    assert a_reached.wait(60)
    b, _r, _g, b_out = _start(ctx, root, 43, seed=12)
    rb = _result(b, b_out)
    a_go.set()
    ra = _result(a, a_out)
    acked = [r for r in (ra, rb) if r[0] == "ok"]
    assert len(acked) == 1, f"exactly one save of step 43 is acknowledged: A {ra}, B {rb[0]}"
    if ra[0] == "err":
        assert "another" in ra[1] or "No such file" in ra[1], ra[1]
    s43 = os.path.join(root, "global_step_43")
    st = check_step_dir(s43, root)
    assert st.complete, st.reason
    _resumes(root, s43, acked[0][1], 43)


def test_a_publish_during_another_writers_removal_of_its_staging_is_never_lost(ckpt):
    """Writer A stops at PUBLISH of step 43 (its record written). Writer B, saving step 43 too,
    starts removing A's staging directory and stops after one file; then A publishes, then B goes
    on. A removal that follows the directory to its published name would empty A's acknowledged
    step (and B then publish over it: both acknowledged, A's save lost). Exactly one save is
    acknowledged, and it resumes bitwise."""
    root, _s4, _s42 = ckpt
    ctx = multiprocessing.get_context("fork")
    a, a_reached, a_go, a_out = _start(ctx, root, 43, seed=11, point=str(SavePoint.PUBLISH))
    assert a_reached.wait(60)
    b, b_reached, b_go, b_out = _start(ctx, root, 43, seed=12, point="slow-removal")
    assert b_reached.wait(60), "B never started removing A's staging directory"
    a_go.set()
    ra = _result(a, a_out)
    b_go.set()
    rb = _result(b, b_out)
    acked = [r for r in (ra, rb) if r[0] == "ok"]
    assert len(acked) == 1, f"exactly one save of step 43 is acknowledged: A {ra[0]} {ra[1] if ra[0] == 'err' else ''}, B {rb[0]}"
    s43 = os.path.join(root, "global_step_43")
    st = check_step_dir(s43, root)
    assert st.complete, st.reason
    _resumes(root, s43, acked[0][1], 43)


def test_a_rank_never_makes_a_vanished_staging_directory_again(tmp_path):
    """Another writer's sweep renamed this save's staging directory aside after some ranks wrote
    into it: a later rank's extra-state write must fail (and with it the save, on every rank),
    never make the staging directory again under its old name, which would publish a step whose
    earlier files went with the renamed one (seen in the fault matrix: an acknowledged step
    missing a rank's extra state)."""
    staging = tmp_path / ".global_step_6.0123456789abcdef.partial"
    staging.mkdir()
    writer = SafetensorsWriter(str(staging))
    writer._write_extra("extra_state/extra_state_rank_0.pt", b"rank 0")  # before the rename: fine
    staging.rename(tmp_path / ".aside.deleting")
    with pytest.raises(FileNotFoundError):
        writer._write_extra("extra_state/extra_state_rank_1.pt", b"rank 1")
    assert not staging.exists()


def test_two_writers_of_different_steps_both_resume(ckpt):
    root, _s4, _s42 = ckpt
    ctx = multiprocessing.get_context("fork")
    a, a_reached, a_go, a_out = _start(ctx, root, 43, seed=11, point=str(SavePoint.PUBLISH))
    assert a_reached.wait(60)
    b, _r, _g, b_out = _start(ctx, root, 44, seed=12)
    rb = _result(b, b_out)
    a_go.set()
    ra = _result(a, a_out)
    assert ra[0] == rb[0] == "ok", (ra, rb)
    _resumes(root, os.path.join(root, "global_step_44"), rb[1], 44)
    model, opt, state = _fresh_state()
    DistributedCheckpointer().load(os.path.join(root, "global_step_43"), state)
    refckpt.set_training_state(model, opt, state)
    B.assert_bitwise(B.params(model), ra[1])


def test_a_writer_killed_while_another_publishes_loses_nothing_acknowledged(ckpt):
    root, _s4, _s42 = ckpt
    ctx = multiprocessing.get_context("fork")
    a, a_reached, _a_go, _a_out = _start(ctx, root, 43, seed=11, point=str(SavePoint.PUBLISH))
    assert a_reached.wait(60)
    b, b_reached, b_go, b_out = _start(ctx, root, 43, seed=12, point=str(SavePoint.PUBLISH))
    assert b_reached.wait(60)
    os.kill(a.pid, signal.SIGKILL)  # A dies with its commit record written, about to publish
    a.join(30)
    b_go.set()
    rb = _result(b, b_out)
    assert rb[0] == "ok", rb
    _resumes(root, os.path.join(root, "global_step_43"), rb[1], 43)
    # A's staging is a leftover: never a checkpoint, and the next save of any step goes through.
    model, opt = B.make(5, "adamw")
    B.save(root, model, opt, 44)
    _resumes(root, os.path.join(root, "global_step_44"), B.params(model), 44)


def test_tiling_check_is_exact_and_linear_in_the_chunks():
    """Grid layouts of any mesh pass; gaps, overlaps and crafted chunk sets that no sharding makes
    (they would cost a pairwise check quadratic time) are refused; bounded by a deadline."""
    from refckpt.record import _check_tiling

    with _deadline(30):
        _check_tiling("w", (128, 128), [((i * 4, j * 4), (4, 4)) for i in range(32) for j in range(32)], True, "r")
        _check_tiling("w", (10, 10000), [((0, j * 2), (10, 2)) for j in range(5000)], True, "r")  # column-parallel
        _check_tiling("w", (7, 5), [((0, 0), (4, 5)), ((4, 0), (3, 5))], True, "r")  # uneven rows
        _check_tiling("s", (), [((), ())], True, "r")
        _check_tiling("e", (0, 3), [((0, 0), (0, 3))], True, "r")
        cases = {
            "overlaps another chunk": [((0, 0), (3, 4)), ((2, 0), (2, 4))],
            "cover 8 of its 16": [((0, 0), (2, 4))],
            "reaches outside": [((0, 0), (5, 4))],
            "cells; no sharding does that": ([((i, 0), (1, 1000)) for i in range(1000)]
                                             + [((0, j), (1000, 1)) for j in range(1000)]),
        }
        for why, boxes in cases.items():
            size = (1000, 1000) if len(boxes) > 100 else (4, 4)
            with pytest.raises(E.CorruptCheckpointError, match=why):
                _check_tiling("w", size, boxes, True, "r")
        _check_tiling("w", (4, 4), [((0, 0), (2, 4))], False, "r")  # a per-rank record covers its own rows only


def test_a_step_directory_renamed_by_hand_is_not_resumed_as_another_step(ckpt, template):
    """global_step_4 copied to global_step_99: its record says step 4; resuming it as 99 would
    continue training from step 4's state under step 99's name."""
    root, s4, s42 = ckpt
    shutil.copytree(s4, os.path.join(root, "global_step_99"))
    st = check_step_dir(os.path.join(root, "global_step_99"), root)
    assert not st.complete and st.damaged and "written for step 4, not 99" in st.reason
    _resumes(root, s42, template[1][42], 42)


def test_deeply_nested_record_fields_are_refused_without_recursion(ckpt):
    """A forged record may nest a field 100,000 levels deep (the unpickler builds it without
    recursion); naming it in an error must not recurse either."""
    from refckpt.record import Manifest, validate_record

    _root, _s4, s42 = ckpt
    md, _c = load_record(_record(s42))
    deep: list = []
    for _ in range(100_000):
        deep = [deep]
    key = next(iter(md.storage_data))
    info = md.storage_data[key]
    md.storage_data[key] = _StorageInfo(deep, info.offset, info.length)
    manifest = Manifest.from_dict(getattr(md, MANIFEST_ATTR), "r")
    sizes = manifest.sizes("r")
    with pytest.raises(E.CorruptCheckpointError, match="malformed"):
        validate_record(md, manifest, sizes, "r", whole=True)
    md.storage_data[key] = info
    md.storage_meta = deep
    with pytest.raises(E.CorruptCheckpointError, match="storage_meta is list"):
        validate_record(md, manifest, sizes, "r", whole=True)


class _SwapsRecordBeforePublish(FileIO):
    """Another process replaces the staged commit record with its own (an intact, checksummed
    record of another step) just before this save publishes."""

    def __init__(self, other_record: bytes) -> None:
        self.other = other_record

    def mark(self, point, **info) -> None:
        if point == SavePoint.PUBLISH:
            (staging,) = [n for n in os.listdir(os.path.dirname(info["path"])) if n.endswith(".partial")]
            with open(os.path.join(os.path.dirname(info["path"]), staging, METADATA_FILE), "wb") as f:
                f.write(self.other)


def test_publish_refuses_a_staging_directory_that_holds_another_record(ckpt, template):
    root, _s4, s42 = ckpt
    model, opt = B.make(7, "adamw")
    with pytest.raises(E.SaveFailedError, match="does not hold this save's commit record"):
        B.save(root, model, opt, 43, io=_SwapsRecordBeforePublish(open(_record(s42), "rb").read()))
    assert not os.path.exists(os.path.join(root, "global_step_43"))
    _resumes(root, s42, template[1][42], 42)


# -- shards that disagree with their commit record -------------------------------------------------
def _storage_key(md, fqn: str):
    (key,) = [k for k in md.storage_data if k.fqn == fqn]
    return key


def test_shard_item_without_a_recorded_checksum_is_refused(ckpt, template):
    root, s4, s42 = ckpt
    start, end = B.item_range(os.path.join(s42, B.SHARD), "model.0.weight")

    def edit(md):
        rec = getattr(md, MANIFEST_ATTR)["files"][B.SHARD]
        rec["chunks"] = [c for c in rec["chunks"] if c[0] != start]

    B.rewrite_commit_record(s42, edit)
    st = check_step_dir(s42, root)  # sizes agree, the record's own checksum too; its blocks leave a gap
    assert not st.complete and st.damaged
    assert f"{B.SHARD}: checksum blocks do not tile the file (at byte {start}" in st.reason
    _m, _o, state = _fresh_state()
    with pytest.raises(E.CorruptCheckpointError, match="checksum blocks do not tile"):
        DistributedCheckpointer().load(s42, state)
    model, opt, state = _fresh_state()
    assert DistributedCheckpointer().load_latest(root, state) == s4
    # Not even without verification: a record that leaves bytes unchecked is not trusted.
    with pytest.raises(E.CorruptCheckpointError):
        DistributedCheckpointer(verify_checksums=False).load(s42, _fresh_state()[2])


def test_recorded_length_that_disagrees_with_the_shape_is_refused(ckpt):
    root, s4, s42 = ckpt

    def edit(md):
        key = _storage_key(md, "model.0.weight")
        info = md.storage_data[key]
        md.storage_data[key] = _StorageInfo(info.relative_path, info.offset, info.length - 4)

    B.rewrite_commit_record(s42, edit)
    _m, _o, state = _fresh_state()
    with pytest.raises(E.CorruptCheckpointError) as ei:
        DistributedCheckpointer().load(s42, state)
    # model.0.weight is 5x4 float32: 80 bytes; the record claims 76. Refused before any read.
    assert ("model.0.weight: chunk at [0, 0] of shape [5, 4] (torch.float32) needs 80 bytes, its storage entry records 76"
            in str(ei.value))
    assert DistributedCheckpointer().load_latest(root, _fresh_state()[2]) == s4


def test_item_using_dcp_stream_extensions_is_refused(ckpt):
    _root, _s4, s42 = ckpt

    def edit(md):
        md.storage_data[_storage_key(md, "model.2.bias")].transform_descriptors = ["zstd"]

    B.rewrite_commit_record(s42, edit)
    _m, _o, state = _fresh_state()
    with pytest.raises(E.CheckpointError) as ei:
        DistributedCheckpointer().load(s42, state)
    msg = str(ei.value)
    assert os.path.join(s42, B.SHARD) in msg and "model.2.bias" in msg and "zstd" in msg
    assert "refckpt reads plain items only" in msg


def test_plain_dcp_item_recorded_as_tensor_that_is_not_one(tmp_path):
    step = str(tmp_path / "global_step_1")
    dcp.save({"model": {"w": torch.ones(3), "b": torch.zeros(2)}}, checkpoint_id=step, no_dist=True)
    (shard,) = [n for n in os.listdir(step) if n.endswith(".distcp")]
    blob = B.torch_saved({"not": "a tensor"})
    offset = os.path.getsize(os.path.join(step, shard))
    with open(os.path.join(step, shard), "ab") as f:
        f.write(blob)

    def edit(md):
        info = md.storage_data[_storage_key(md, "model.w")]
        info.offset, info.length = offset, len(blob)

    B.rewrite_commit_record(step, edit)
    assert check_step_dir(step).complete
    with pytest.raises(E.CorruptCheckpointError, match=r"item model\.w is not a tensor") as ei:
        DistributedCheckpointer().load(step, {"model": {"w": torch.empty(3), "b": torch.empty(2)}})
    assert os.path.join(step, shard) in str(ei.value)


def test_commit_record_without_storage_meta_still_loads(ckpt, template):
    """Commit records written before DCP recorded ``storage_meta`` carry None there."""
    _root, _s4, s42 = ckpt
    B.rewrite_commit_record(s42, lambda md: setattr(md, "storage_meta", None))
    assert B.read_commit_record(s42).storage_meta is None
    model, opt, extra = B.load_fresh(s42)
    B.assert_bitwise(B.params(model), template[1][42])
    assert extra == {"global_step": 42}


# -- the storage layer used directly with DCP ------------------------------------------------------
def test_writer_and_reader_follow_dcp_checkpoint_id(tmp_path):
    placeholder, target = str(tmp_path / "placeholder"), str(tmp_path / "target")
    os.makedirs(target)
    saved = {"model": {"w": torch.arange(12.0).reshape(3, 4), "step": torch.tensor(7)}}
    dcp.save(saved, checkpoint_id=target, storage_writer=SafetensorsWriter(placeholder), no_dist=True)
    assert not os.path.exists(placeholder)
    assert sorted(os.listdir(target)) == [".metadata", B.SHARD]
    out = {"model": {"w": torch.zeros(3, 4), "step": torch.tensor(0)}}
    dcp.load(out, checkpoint_id=target, storage_reader=SafetensorsReader(placeholder),
             planner=RefLoadPlanner(checkpoint_path=target), no_dist=True)
    B.assert_bitwise(out, saved)


def test_reader_reports_a_truncated_shard(ckpt):
    """A shard cut short after the completeness check (or read without one) fails naming the bytes."""
    _root, _s4, s42 = ckpt
    shard = os.path.join(s42, B.SHARD)
    start, end = B.item_range(shard, "model.0.weight")
    os.truncate(shard, start + 8)
    model = B.make_model(99)
    with pytest.raises(CheckpointException) as ei:
        dcp.load({"model": model.state_dict()}, storage_reader=SafetensorsReader(s42), no_dist=True,
                 planner=RefLoadPlanner(checkpoint_path=s42))
    (exc, _tb) = ei.value.failures[0]
    assert isinstance(exc, E.CorruptCheckpointError)
    assert shard in str(exc) and f"wanted {end - start} bytes at offset {start}" in str(exc)
    assert "file ends after 8" in str(exc)


def test_ref_load_planner_refuses_optimizer_state_the_checkpoint_lacks(tmp_path):
    """Used with plain dcp.load, the planner itself refuses (DistributedCheckpointer checks earlier)."""
    model, opt = B.make(0, "adamw")
    DistributedCheckpointer().save(tmp_path, {"model": model.state_dict()}, global_step=1)
    step = str(tmp_path / "global_step_1")
    fresh, fopt = B.make(9, "adamw")
    state = get_training_state(fresh, fopt, None)
    before = B.params(fresh)
    with pytest.raises(CheckpointException) as ei:
        dcp.load(state, storage_reader=SafetensorsReader(step), planner=RefLoadPlanner(checkpoint_path=step), no_dist=True)
    (exc, _tb) = ei.value.failures[0]
    assert isinstance(exc, E.MissingTrainingStateError)
    assert step in str(exc) and "no optimizer state" in str(exc)
    B.assert_bitwise(B.params(fresh), before)  # refused before anything was read


def test_tensor_bytes_needs_a_contiguous_tensor():
    t = torch.arange(6, dtype=torch.int16).reshape(2, 3)
    assert bytes(tensor_bytes(t)) == b"".join(v.to_bytes(2, sys.byteorder) for v in range(6))
    assert not t.t().is_contiguous()
    with pytest.raises(ValueError, match="contiguous CPU tensor"):
        tensor_bytes(t.t())


def test_tensor_to_bytes_of_a_non_contiguous_tensor():
    t = torch.arange(32, dtype=torch.int16).reshape(4, 8).t()  # small: freed memory stays mapped
    assert not t.is_contiguous()
    want = b"".join(int(v).to_bytes(2, sys.byteorder) for v in t.reshape(-1).tolist())  # row-major values
    assert tensor_to_bytes(t) == want


def test_verify_step_files_reports_each_kind_of_problem(tmp_path):
    step = tmp_path / "global_step_1"
    step.mkdir()
    files = {"good.bin": b"abcd", "short.bin": b"abc", "rot.bin": b"abcX", "past_end.bin": b"abcd"}
    for name, data in files.items():
        (step / name).write_bytes(data)
    (tmp_path / "escape.bin").write_bytes(b"abcd")
    crc = zlib.crc32(b"abcd")
    manifest = {
        "checksum": "crc32",
        "files": {
            "good.bin": {"size": 4, "chunks": [[0, 4, crc]]},
            "short.bin": {"size": 4, "chunks": [[0, 4, crc]]},
            "rot.bin": {"size": 4, "chunks": [[0, 4, crc]]},
            "past_end.bin": {"size": 4, "chunks": [[0, 4, crc], [4, 4, crc]]},  # a chunk beyond the end
            "missing.bin": {"size": 4, "chunks": [[0, 4, crc]]},
            "../escape.bin": {"size": 4, "chunks": [[0, 4, crc]]},
        },
    }
    problems = verify_step_files(str(step), Manifest.from_dict(manifest, "m"))
    expected = {
        "../escape.bin": "resolves outside the step directory",
        "missing.bin": "missing (No such file or directory)",
        "past_end.bin": "bytes 4..8 fail their crc32",
        "rot.bin": "bytes 0..4 fail their crc32",
        "short.bin": "3 bytes, commit record says 4",
    }
    assert len(problems) == len(expected), problems
    for rel, what in expected.items():
        assert [p for p in problems if rel.lstrip("./") in p and what in p], (rel, problems)
    assert not [p for p in problems if "good.bin" in p]

    # A manifest that names no algorithm (saved with checksums=False) still has its recorded blocks
    # verified (issue 25: they used to be ignored): CRC-32C, or zlib's CRC-32 of older checkpoints.
    manifest["checksum"] = None
    problems = verify_step_files(str(step), Manifest.from_dict(manifest, "m"))
    assert len(problems) == 5 and [p for p in problems if "rot.bin" in p], problems
    # Files without recorded blocks: only presence and sizes can be checked.
    for rec in manifest["files"].values():
        rec["chunks"] = []
    problems = verify_step_files(str(step), Manifest.from_dict(manifest, "m"))
    assert len(problems) == 3 and not [p for p in problems if "rot.bin" in p or "past_end.bin" in p], problems
