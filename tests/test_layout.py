"""The on-disk contract: names, the pointer, completeness, and which step resume picks.

Every scenario starts from real checkpoints written by refckpt (steps 4 and 42, copied from
one module-level template) and damages them on disk the way a crash or a bad disk would.
"""

from __future__ import annotations

import errno
import os
import pickle
import shutil
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors import safe_open
from torch.distributed.checkpoint import FileSystemWriter

import refckpt
from refckpt import DistributedCheckpointer, check_step_dir, find_latest_checkpoint
from refckpt import errors as E
from refckpt.durable import FileIO, durable_write
from refckpt.errors import CorruptCheckpointError
from refckpt.layout import MANIFEST_ATTR, parse_step_dir_name, read_pointer
from refckpt.safeload import load_metadata
from refckpt.storage import BYTES_KEY_PREFIX, verify_step_files

from . import _builders as B

pytestmark = pytest.mark.usefixtures("quiet_single_process_warnings")

POINTER = "latest_checkpoint_iteration.txt"


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


@pytest.fixture(scope="module")
def template(tmp_path_factory):
    """root with complete steps 4 and 42 (pointer "42\\n"), plus the parameters each one holds."""
    root = tmp_path_factory.mktemp("template") / "ckpt"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _, p4, _ = B.save_trained(root, 4, seed=1)
        _, p42, o42 = B.save_trained(root, 42, seed=2)
    return root, {4: p4, 42: p42}, o42


@pytest.fixture
def ckpt(template, tmp_path):
    """A private copy of the template root: (root, step-4 dir, step-42 dir)."""
    src, _, _ = template
    root = tmp_path / "ckpt"
    shutil.copytree(src, root, symlinks=True)
    return str(root), str(root / "global_step_4"), str(root / "global_step_42")


# -- what a save leaves on disk ------------------------------------------------------------
def test_save_layout(tmp_path):
    root = tmp_path / "root"
    model, opt = B.make(0, "adamw")
    B.train(model, opt, range(2))
    weights = B.params(model)
    B.save(root, model, opt, 7, extra={"global_step": 7, "note": "hello"})

    assert sorted(os.listdir(root)) == sorted([POINTER, "global_step_7"])  # no staging / tmp / lease left
    assert (root / POINTER).read_bytes() == b"7\n"
    step = root / "global_step_7"
    assert sorted(os.listdir(step)) == [".metadata", "__0_0.safetensors", "extra_state"]
    assert os.listdir(step / "extra_state") == ["extra_state_rank_0.pt"]
    assert not [n for n in os.listdir(step) if n.endswith(".tmp")]

    with safe_open(str(step / B.SHARD), framework="pt") as f:
        keys = set(f.keys())
        for name, t in weights.items():
            B.assert_bitwise(f.get_tensor(f"model.{name}"), t, name)
        byte_keys = [k for k in keys if k.startswith(BYTES_KEY_PREFIX)]
        assert byte_keys, "non-tensor items (param groups) are stored under __bytes__/"
        for k in byte_keys:
            u8 = f.get_tensor(k)
            assert u8.dtype == torch.uint8 and u8.dim() == 1
    assert {f"model.{n}" for n in weights} <= keys
    assert {"optimizer.state.0.weight.exp_avg", "optimizer.state.2.bias.exp_avg_sq"} <= keys
    assert f"{BYTES_KEY_PREFIX}optimizer.param_groups.0.lr" in keys

    extra = torch.load(step / "extra_state" / "extra_state_rank_0.pt", weights_only=True)
    assert extra == {"global_step": 7, "note": "hello"}
    st = check_step_dir(str(step), str(root))
    assert st.complete and st.step == 7 and st.commit_records == (".metadata",)


# -- strict names ------------------------------------------------------------------------
@pytest.mark.parametrize("name,expected", [
    ("global_step_7", 7),
    ("global_step_0", 0),
    ("global_step_42", 42),
    ("global_step_-1", None),
    ("global_step_+1", None),
    ("global_step_07x", None),
    ("global_step_", None),
    ("global_step_\uff11\uff12", None),  # fullwidth digits: int() would accept them
    ("global_step_\u0661", None),  # Arabic-Indic digit
    ("global_step_99999999999999999999", None),
    ("global_step_9223372036854775808", None),  # 2**63
    ("global_step_ 7", None),
    ("global_step_7 ", None),
    ("global_step_7\n", None),
    (".global_step_7.partial", None),
    ("Global_Step_7", None),
    ("global_step_1_5", None),
])
def test_parse_step_dir_name(name, expected):
    assert parse_step_dir_name(name) == expected


@pytest.mark.parametrize("content,expected", [
    (None, None),
    (b"", None),
    (b"\n", None),
    (b"42\n", 42),
    (b"42", 42),
    (b"garbage\n", None),
    (b"\x00\x00\x00\x00", None),
    (b"42\x00", None),
    (b"4", 4),  # a torn "42": a valid but stale number; find_latest_checkpoint must not trust it
    (b"-3\n", None),
    (b"0x10\n", None),
    (b"\xef\xbc\x91\n", None),  # fullwidth "1" in UTF-8
    (b"99999999999999999999\n", None),
])
def test_read_pointer(tmp_path, content, expected):
    if content is not None:
        B.write_pointer(tmp_path, content)
    assert read_pointer(str(tmp_path)) == expected


def test_read_pointer_missing_root(tmp_path):
    assert read_pointer(str(tmp_path / "nope")) is None


# -- resume picks the newest complete step whatever the pointer says -----------------------
@pytest.mark.parametrize("pointer", [
    None,  # absent
    b"",  # empty
    b"garbage",
    b"\x00" * 8,  # a zero-filled block after power loss
    b"4",  # torn write of "42"
    b"99\n",  # dangling: names a step that does not exist
    b"4\n",  # stale: names an older complete step
    b"42\n",  # correct
])
def test_find_latest_ignores_bad_pointer(ckpt, pointer):
    root, _s4, s42 = ckpt
    os.unlink(os.path.join(root, POINTER))
    if pointer is not None:
        B.write_pointer(root, pointer)
    assert find_latest_checkpoint(root) == s42
    assert DistributedCheckpointer().find_latest_checkpoint(root) == s42


def test_pointer_naming_incomplete_step(ckpt):
    root, _s4, s42 = ckpt
    s50 = os.path.join(root, "global_step_50")
    shutil.copytree(s42, s50)
    os.unlink(os.path.join(s50, ".metadata"))  # crash before the commit record
    B.write_pointer(root, b"50\n")
    assert find_latest_checkpoint(root) == s42


def _damage_newest(s42: str, how: str) -> None:
    shard = os.path.join(s42, B.SHARD)
    if how == "no_metadata":
        os.unlink(os.path.join(s42, ".metadata"))
    elif how == "shard_deleted":
        os.unlink(shard)
    elif how == "shard_truncated":
        os.truncate(shard, os.path.getsize(shard) - 1)
    elif how == "shard_extended":
        with open(shard, "ab") as f:
            f.write(b"\0")
    elif how == "shard_empty":
        os.truncate(shard, 0)
    elif how == "extra_deleted":
        os.unlink(os.path.join(s42, B.EXTRA_REL))
    elif how == "metadata_truncated":
        md = os.path.join(s42, ".metadata")
        os.truncate(md, os.path.getsize(md) // 2)
    elif how == "metadata_garbage":
        with open(os.path.join(s42, ".metadata"), "wb") as f:
            f.write(b"\x00" * 64)
    else:  # pragma: no cover
        raise ValueError(how)


@pytest.mark.parametrize("how", [
    "no_metadata", "shard_deleted", "shard_truncated", "shard_extended", "shard_empty",
    "extra_deleted", "metadata_truncated", "metadata_garbage",
])
def test_damaged_newest_falls_back(ckpt, template, how):
    root, s4, s42 = ckpt
    _damage_newest(s42, how)
    st = check_step_dir(s42, root)
    assert not st.complete and st.reason
    assert find_latest_checkpoint(root) == s4
    # and resume really restores step 4's weights
    model, opt = B.make(99, "adamw")
    state = refckpt.get_training_state(model, opt, {})
    assert DistributedCheckpointer().load_latest(root, state) == s4
    refckpt.set_training_state(model, opt, state)
    B.assert_bitwise(B.params(model), template[1][4])
    assert state["extra_state"]["global_step"] == 4


def test_empty_or_missing_root(tmp_path):
    assert find_latest_checkpoint(str(tmp_path)) is None
    assert find_latest_checkpoint(str(tmp_path / "missing")) is None
    B.write_pointer(tmp_path, b"3\n")  # a pointer alone is not a checkpoint
    (tmp_path / "global_step_3").mkdir()  # nor is an empty step directory
    (tmp_path / ".global_step_9.partial").mkdir()  # nor a staging directory
    assert find_latest_checkpoint(str(tmp_path)) is None
    assert DistributedCheckpointer().load_latest(str(tmp_path), {"model": {}}) is None


def test_staging_dir_is_never_a_checkpoint(ckpt):
    root, _s4, s42 = ckpt
    shutil.copytree(s42, os.path.join(root, ".global_step_43.partial"))  # complete but unpublished
    assert find_latest_checkpoint(root) == s42


# -- the __R.metadata spelling --------------------------------------------------------------
def _plain_dcp_per_rank(step_dir: str) -> dict:
    state = {"model": {"w": torch.arange(6.0).reshape(2, 3), "b": torch.tensor([1.5, -2.0])}}
    os.makedirs(step_dir)
    dcp.save(state, storage_writer=FileSystemWriter(step_dir), no_dist=True, use_collectives=False)
    return state


def test_rank_metadata_spelling_is_a_commit_record(ckpt):
    root, _s4, _s42 = ckpt
    s60 = os.path.join(root, "global_step_60")
    saved = _plain_dcp_per_rank(s60)
    names = os.listdir(s60)
    assert "__0.metadata" in names and ".metadata" not in names, names
    st = check_step_dir(s60, root)
    assert st.complete, st.reason
    assert st.commit_records == ("__0.metadata",)
    assert find_latest_checkpoint(root) == s60
    out = {"model": {"w": torch.zeros(2, 3), "b": torch.zeros(2)}}
    DistributedCheckpointer().load(s60, out)
    B.assert_bitwise(out, saved)


def test_renamed_refckpt_commit_record_still_loads(ckpt, template):
    root, _s4, s42 = ckpt
    os.rename(os.path.join(s42, ".metadata"), os.path.join(s42, "__0.metadata"))
    assert check_step_dir(s42, root).complete
    assert find_latest_checkpoint(root) == s42
    model, opt, extra = B.load_fresh(s42)
    B.assert_bitwise(B.params(model), template[1][42])
    assert extra["global_step"] == 42


@pytest.mark.parametrize("names", [("__1.metadata",), ("__0.metadata", "__2.metadata"), ("__00.metadata",)])
def test_rank_metadata_gap_is_not_a_commit_record(ckpt, names):
    root, s4, s42 = ckpt
    src = os.path.join(s42, ".metadata")
    for n in names:
        shutil.copyfile(src, os.path.join(s42, n))
    os.unlink(src)
    # __1 alone: rank 0 never committed; __0 + __2: rank 1 never did; "__00" is no strict rank name.
    assert not check_step_dir(s42, root).complete
    assert find_latest_checkpoint(root) == s4


# -- bit rot: complete by sizes, refused by checksums --------------------------------------
def test_bit_flip_detected_on_load_and_fallback(ckpt, template):
    root, s4, s42 = ckpt
    shard = os.path.join(s42, B.SHARD)
    start, end = B.item_range(shard, "model.0.weight")
    B.flip_bit(shard, start + (end - start) // 2, bit=3)

    st = check_step_dir(s42, root)
    assert st.complete  # sizes still match: only reading the bytes can tell
    assert find_latest_checkpoint(root) == s42

    problems = verify_step_files(s42, st.manifest)
    assert len(problems) == 1 and shard in problems[0], problems

    model, opt = B.make(99, "adamw")
    state = refckpt.get_training_state(model, opt, {})
    with pytest.raises(CorruptCheckpointError, match=B.SHARD) as ei:
        DistributedCheckpointer().load(s42, state)
    assert isinstance(ei.value, ValueError) and shard in str(ei.value)

    model, opt = B.make(99, "adamw")
    state = refckpt.get_training_state(model, opt, {})
    with pytest.warns(UserWarning, match="fall back") as rec:
        assert DistributedCheckpointer().load_latest(root, state) == s4
    assert any("global_step_42" in str(w.message) for w in rec)
    refckpt.set_training_state(model, opt, state)
    B.assert_bitwise(B.params(model), template[1][4])
    assert state["extra_state"]["global_step"] == 4


def test_bit_flip_in_non_tensor_item_detected(ckpt):
    root, _s4, s42 = ckpt
    shard = os.path.join(s42, B.SHARD)
    start, _end = B.item_range(shard, f"{BYTES_KEY_PREFIX}optimizer.param_groups.0.lr")
    B.flip_bit(shard, start + 40)
    assert check_step_dir(s42, root).complete
    model, opt = B.make(99, "adamw")
    with pytest.raises(CorruptCheckpointError, match=B.SHARD):
        DistributedCheckpointer().load(s42, refckpt.get_training_state(model, opt, {}))


def test_bit_flip_in_extra_state_detected(ckpt):
    root, _s4, s42 = ckpt
    path = os.path.join(s42, B.EXTRA_REL)
    B.flip_bit(path, os.path.getsize(path) // 2)
    st = check_step_dir(s42, root)
    assert st.complete
    assert any("extra_state_rank_0.pt" in p for p in verify_step_files(s42, st.manifest))
    model, opt = B.make(99, "adamw")
    with pytest.raises(CorruptCheckpointError, match="extra_state_rank_0.pt"):
        DistributedCheckpointer().load(s42, refckpt.get_training_state(model, opt, {}))


def test_verify_clean_checkpoint_has_no_problems(ckpt):
    root, s4, s42 = ckpt
    for s in (s4, s42):
        assert verify_step_files(s, check_step_dir(s, root).manifest) == []


def test_every_complete_step_fails_raises(ckpt):
    root, s4, s42 = ckpt
    for s in (s4, s42):
        shard = os.path.join(s, B.SHARD)
        start, _ = B.item_range(shard, "model.2.bias")
        B.flip_bit(shard, start)
    model, opt = B.make(99, "adamw")
    state = refckpt.get_training_state(model, opt, {})
    with pytest.warns(UserWarning, match="fall back"):
        with pytest.raises(CorruptCheckpointError, match="every complete checkpoint"):
            DistributedCheckpointer().load_latest(root, state)


# -- durable_write / FileIO ------------------------------------------------------------------------
class _FsyncFails(FileIO):
    def fsync(self, f) -> None:
        raise B.oserror(errno.EIO, f.name)


class _ReplaceThenFails(FileIO):
    """The rename happens, then the call reports an error (a network file system losing the reply)."""

    def replace(self, src: str, dst: str) -> None:
        os.replace(src, dst)
        raise B.oserror(errno.EIO, dst)


@pytest.mark.parametrize("io_cls,final", [(_FsyncFails, b"old\n"), (_ReplaceThenFails, b"new\n")])
def test_atomic_write_failure_raises_its_own_error_and_leaves_no_tmp(tmp_path, io_cls, final):
    target = tmp_path / "pointer.txt"
    target.write_bytes(b"old\n")
    with pytest.raises(OSError) as ei:
        durable_write(str(target), b"new\n", io_cls())
    assert ei.value.errno == errno.EIO  # not the FileNotFoundError of a clean-up
    assert os.listdir(tmp_path) == ["pointer.txt"]  # the tmp file is gone either way
    assert target.read_bytes() == final  # old or new, never a mix


def test_exchange_swaps_and_reports_a_missing_path(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.write_bytes(b"A")
    b.write_bytes(b"B")
    assert FileIO().exchange(str(a), str(b)) is True
    assert (a.read_bytes(), b.read_bytes()) == (b"B", b"A")
    with pytest.raises(FileNotFoundError) as ei:
        FileIO().exchange(str(a), str(tmp_path / "missing"))
    assert ei.value.errno == errno.ENOENT and ei.value.filename == str(a)
    assert a.read_bytes() == b"B"


# -- commit records that cannot be trusted ---------------------------------------------------------
def test_commit_record_naming_a_torch_function_is_refused(ckpt):
    root, s4, s42 = ckpt
    payload = b"\x80\x02ctorch\nsave\nq\x00."  # GLOBAL torch.save: a callable, not a dtype or layout
    assert pickle.loads(payload) is torch.save  # control: plain pickle would hand out the function
    with open(os.path.join(s42, ".metadata"), "wb") as f:
        f.write(payload)
    with pytest.raises(E.UnsafeCheckpointError, match=r"refusing to load global torch\.'save'"):
        load_metadata(os.path.join(s42, ".metadata"))
    st = check_step_dir(s42, root)
    assert not st.complete and "torch.'save'" in st.reason
    assert find_latest_checkpoint(root) == s4


@pytest.mark.parametrize("payload,kind", [
    (pickle.dumps({"files": {}}, protocol=2), "dict"),
    (b"\x80\x02ctorch\nfloat32\nq\x00.", "dtype"),  # an allowed global, but not a Metadata
])
def test_commit_record_of_the_wrong_type_is_not_a_checkpoint(ckpt, payload, kind):
    root, s4, s42 = ckpt
    with open(os.path.join(s42, ".metadata"), "wb") as f:
        f.write(payload)
    with pytest.raises(E.CorruptCheckpointError, match=f"holds {kind}, not DCP Metadata"):
        load_metadata(os.path.join(s42, ".metadata"))
    st = check_step_dir(s42, root)
    assert not st.complete and "not DCP Metadata" in st.reason
    assert find_latest_checkpoint(root) == s4
    with pytest.raises(E.CorruptCheckpointError, match="not DCP Metadata"):
        DistributedCheckpointer().load(s42, B.fresh_state()[2])


@pytest.mark.parametrize("manifest", [["files"], {"format": "refckpt/1"}, {"files": ["__0_0.safetensors"]}])
def test_malformed_manifest_makes_the_step_incomplete(ckpt, manifest):
    root, s4, s42 = ckpt
    B.rewrite_commit_record(s42, lambda md: setattr(md, MANIFEST_ATTR, manifest))
    st = check_step_dir(s42, root)
    assert not st.complete and st.reason == ".metadata: malformed refckpt manifest"
    assert find_latest_checkpoint(root) == s4


@pytest.mark.parametrize("record", [{"chunks": []}, {"size": "many", "chunks": []}, None])
def test_malformed_size_record_makes_the_step_incomplete(ckpt, record):
    root, s4, s42 = ckpt
    B.rewrite_commit_record(s42, lambda md: getattr(md, MANIFEST_ATTR)["files"].__setitem__(B.SHARD, record))
    st = check_step_dir(s42, root)
    assert not st.complete and st.reason.startswith(".metadata: malformed size record")
    assert find_latest_checkpoint(root) == s4


def test_step_committed_per_rank_needs_every_ranks_files(tmp_path):
    """``__0.metadata`` + ``__1.metadata`` (DCP's use_collectives=False spelling): each record's files count."""
    root = str(tmp_path)
    step = os.path.join(root, "global_step_6")
    saved = {"model": {"w": torch.arange(6.0).reshape(2, 3)}}
    os.makedirs(step)
    dcp.save(saved, checkpoint_id=step, no_dist=True)
    os.rename(os.path.join(step, ".metadata"), os.path.join(step, "__0.metadata"))
    md = load_metadata(os.path.join(step, "__0.metadata"))
    for info in md.storage_data.values():  # a second rank's record naming that rank's shard
        info.relative_path = "__1_0.distcp"
    with open(os.path.join(step, "__1.metadata"), "wb") as f:
        pickle.dump(md, f)
    shutil.copyfile(os.path.join(step, "__0_0.distcp"), os.path.join(step, "__1_0.distcp"))
    st = check_step_dir(step, root)
    assert st.complete, st.reason
    assert st.commit_records == ("__0.metadata", "__1.metadata")
    out = {"model": {"w": torch.zeros(2, 3)}}
    DistributedCheckpointer().load(step, out)
    B.assert_bitwise(out, saved)

    os.unlink(os.path.join(step, "__1_0.distcp"))
    st = check_step_dir(step, root)
    assert not st.complete and st.reason == "missing file __1_0.distcp"
    assert find_latest_checkpoint(root) is None
