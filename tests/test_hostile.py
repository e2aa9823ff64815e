"""Hostile and odd on-disk input: the load path never executes code from checkpoint bytes,
nothing recorded in a checkpoint reaches outside the root, and odd names/files are skipped.

Every malicious payload is first shown to be live (a plain ``pickle``/``torch.load(weights_only=False)``
of it *does* create its marker file) so that "no marker after refckpt read it" means something.

Each case ends the same way: a clear error (naming the path and what to do) or the step skipped
as incomplete, and the previous committed step still restored bitwise by ``load_latest``. Hostile
environments are real, not simulated: a FIFO planted under a checkpoint name, a read-only root
(``chattr +i``, which binds root too, and permission bits for a child that drops to ``nobody``), a disk
that fills up (a size-limited tmpfs mounted in a private mount namespace where ``unshare`` allows it,
and ``RLIMIT_FSIZE``: the kernel's ``EFBIG``), each in a process of its own where it must be.
"""

from __future__ import annotations

import contextlib
import errno
import gc
import io
import os
import pickle
import shlex
import shutil
import subprocess
import sys
import tempfile
import traceback

import pytest
import torch

import refckpt
from refckpt import DistributedCheckpointer, check_step_dir, find_latest_checkpoint
from refckpt import errors as E
from refckpt.durable import FileIO
from refckpt.layout import LATEST_CHECKPOINT_FILE, MANIFEST_ATTR, read_pointer
from refckpt.storage import BYTES_KEY_PREFIX

from . import _builders as B
from . import _diskfull as _diskfull_child

pytestmark = pytest.mark.usefixtures("quiet_single_process_warnings")



REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _fresh_state(kind: str = "adamw"):
    model, opt = B.make(99, kind)
    return model, opt, refckpt.get_training_state(model, opt, {})


def _assert_resumes(root: str, step_dir: str, params: dict, step: int, *, fallback: bool = False) -> None:
    """``load_latest`` lands on ``step_dir`` (after a loud fall-back, if ``fallback``) and restores
    ``params`` bitwise (kept from before the save) and that step's extra state."""
    model, opt, state = _fresh_state()
    with (pytest.warns(UserWarning, match="fall back") if fallback else contextlib.nullcontext()):
        assert DistributedCheckpointer().load_latest(root, state) == step_dir
    refckpt.set_training_state(model, opt, state)
    B.assert_bitwise(B.params(model), params)
    assert state["extra_state"]["global_step"] == step


_no_hang = B.no_hang


def _assert_live(payload: bytes, tmp_path, loader) -> None:
    """Control: the payload really runs code (creates its marker) when loaded unsafely."""
    marker = tmp_path / "control_marker"
    assert not marker.exists()
    try:
        if loader == "pickle":
            pickle.loads(payload)
        else:
            torch.load(io.BytesIO(payload), weights_only=False)
    except Exception:  # noqa: BLE001 - os.system's int return is not a valid object everywhere
        pass
    assert marker.exists(), "control failed: the payload is not actually malicious"
    marker.unlink()


def _zip_payload(marker: str, length: int | None = None) -> bytes:
    """A torch.save file whose unpickling runs ``touch marker``; padded to ``length`` bytes exactly."""
    for k in range(0, 4096):
        buf = io.BytesIO()
        torch.save(B.Marker(marker + " " * k), buf)
        data = buf.getvalue()
        if length is None or len(data) == length:
            return data
    raise AssertionError(f"cannot build a torch.save payload of exactly {length} bytes")


def _raw_payload(marker: str, length: int | None = None) -> bytes:
    """A plain pickle (legacy torch format) that runs ``touch marker``; trailing bytes pad it."""
    data = B.malicious_pickle(marker)
    return data if length is None else data + b"\0" * (length - len(data))


PAYLOADS = {"zip": (_zip_payload, "torch"), "raw": (_raw_payload, "torch")}


# -- the commit record ---------------------------------------------------------------------
@pytest.mark.parametrize("variant", ["bare", "inside_metadata"])
def test_malicious_metadata_is_never_executed(ckpt, tmp_path, variant):
    root, s4, s42 = ckpt
    marker = tmp_path / "control_marker"
    if variant == "bare":
        payload = B.malicious_pickle(str(marker))
    else:  # a genuine Metadata object carrying the gadget in an attribute
        md = B.read_commit_record(s42)
        md.storage_meta = B.Marker(str(marker))
        payload = pickle.dumps(md, protocol=2)
    _assert_live(payload, tmp_path, "pickle")

    with open(os.path.join(s42, ".metadata"), "wb") as f:
        f.write(payload)
    st = check_step_dir(s42, root)
    assert not st.complete
    assert "refusing" in st.reason and "system" in st.reason
    assert find_latest_checkpoint(root) == s4
    _m, _o, state = _fresh_state()
    with pytest.raises((E.UnsafeCheckpointError, E.IncompleteCheckpointError), match="refusing") as ei:
        DistributedCheckpointer().load(s42, state)
    assert s42 in str(ei.value)
    assert DistributedCheckpointer().load_latest(root, state) == s4
    assert not marker.exists()


# -- the per-rank extra-state file ---------------------------------------------------------
@pytest.mark.parametrize("kind", sorted(PAYLOADS))
@pytest.mark.parametrize("verify", [True, False])
def test_malicious_extra_state_is_never_executed(ckpt, tmp_path, kind, verify):
    root, _s4, s42 = ckpt
    marker = tmp_path / "control_marker"
    build, loader = PAYLOADS[kind]
    payload = build(str(marker))
    _assert_live(payload, tmp_path, loader)

    B.replace_extra_file(s42, payload)  # a consistent commit record: only the unpickler stands in the way
    assert check_step_dir(s42, root).complete
    _m, _o, state = _fresh_state()
    with pytest.raises(E.UnsafeCheckpointError, match="extra_state_rank_0.pt"):
        DistributedCheckpointer(verify_checksums=verify).load(s42, state)
    assert not marker.exists()


# -- checkpoints the family wrote: a .distcp tensor item and the extra-state file --------------
@pytest.mark.parametrize("kind", sorted(PAYLOADS))
def test_malicious_distcp_tensor_item_is_never_executed(tmp_path, kind):
    """A plain-DCP ``.distcp`` tensor item is a ``torch.save`` blob: one that would run code is
    refused (``weights_only=True``), and resume falls back to the older step."""
    root = str(tmp_path / "root")
    older, params, _o = B.save_trained(root, 3, seed=1)
    step_dir, *_ = B.save_family(root, 5)
    marker = tmp_path / "control_marker"
    build, loader = PAYLOADS[kind]
    payload = build(str(marker))
    _assert_live(payload, tmp_path, loader)

    shard = os.path.join(step_dir, "__0_0.distcp")
    offset = os.path.getsize(shard)
    with open(shard, "ab") as f:
        f.write(payload)

    def edit(md):  # model.0.weight now reads the payload; every recorded size still holds
        (info,) = [info for idx, info in md.storage_data.items() if idx.fqn == "model.0.weight"]
        info.offset, info.length = offset, len(payload)

    B.rewrite_commit_record(step_dir, edit)
    assert check_step_dir(step_dir, root).complete
    with pytest.raises(E.UnsafeCheckpointError, match=r"model\.0\.weight") as ei:
        DistributedCheckpointer().load(step_dir, _fresh_state("adamw_amsgrad")[2])
    assert step_dir in str(ei.value) and "refusing" in str(ei.value)
    _assert_resumes(root, older, params, 3, fallback=True)
    assert not marker.exists()


@pytest.mark.parametrize("content", ["zip", "raw", "empty", "fifo"])
def test_family_extra_state_file_that_is_hostile(tmp_path, content):
    """The family's ``extra_state_rank_0.pt`` is outside its commit record, so only the read can
    judge it: code is never run, an empty file or a FIFO is a clear error (the FIFO never blocks),
    and resume falls back to the older step."""
    root = str(tmp_path / "root")
    older, params, _o = B.save_trained(root, 3, seed=1)
    step_dir, *_ = B.save_family(root, 5)
    path = os.path.join(step_dir, B.EXTRA_REL)
    os.unlink(path)
    marker = tmp_path / "control_marker"
    if content == "fifo":
        os.mkfifo(path)
        expected, match = E.CorruptCheckpointError, "is a FIFO, not a regular file"
    elif content == "empty":
        open(path, "wb").close()
        expected, match = E.CorruptCheckpointError, "cannot read"
    else:
        build, loader = PAYLOADS[content]
        payload = build(str(marker))
        _assert_live(payload, tmp_path, loader)
        with open(path, "wb") as f:
            f.write(payload)
        expected, match = E.UnsafeCheckpointError, "refusing to unpickle"
    with _no_hang():
        assert check_step_dir(step_dir, root).complete
        with pytest.raises(expected, match=match) as ei:
            DistributedCheckpointer().load(step_dir, _fresh_state("adamw_amsgrad")[2])
        assert path in str(ei.value)
        _assert_resumes(root, older, params, 3, fallback=True)
    assert not marker.exists()


# -- a non-tensor item inside the shard ----------------------------------------------------
@pytest.fixture
def embedded(tmp_path):
    """A checkpoint with extra state embedded in the shard (one ``__bytes__/extra_state`` item: the
    encoded blob of refckpt.extra)."""
    model, opt = B.make(3, "adamw")
    B.train(model, opt, range(2))
    extra = {"global_step": 9, "note": "n" * 400}
    root = tmp_path / "emb"
    return str(root), B.save(root, model, opt, 9, extra=extra, extra_state_per_rank=False)


@pytest.mark.parametrize("kind,item", [
    ("raw", "optimizer.param_groups.0.lr"),
    ("raw", "extra_state"),
    ("zip", "extra_state"),
])
@pytest.mark.parametrize("how", ["fix_crc", "no_verify"])
def test_malicious_bytes_item_is_never_executed(embedded, tmp_path, kind, item, how):
    root, step = embedded
    marker = tmp_path / "control_marker"
    shard = os.path.join(step, B.SHARD)
    start, end = B.item_range(shard, BYTES_KEY_PREFIX + item)
    build, loader = PAYLOADS[kind]
    payload = build(str(marker), end - start)
    assert len(payload) == end - start
    _assert_live(payload, tmp_path, loader)

    B.patch_bytes(shard, start, payload)
    if how == "fix_crc":
        B.fix_crc(step, B.SHARD, start, end - start)
    assert check_step_dir(step, root).complete  # same size: the file still looks whole
    _m, _o, state = _fresh_state()
    ckpt_ = DistributedCheckpointer(extra_state_per_rank=False, verify_checksums=how == "fix_crc")
    with pytest.raises(E.UnsafeCheckpointError, match=item.replace(".", r"\.")) as ei:
        ckpt_.load(step, state)
    assert step in str(ei.value)
    assert not marker.exists()


def test_embedded_extra_state_round_trips(embedded):
    """The fixture above is a sound checkpoint before it is tampered with."""
    _root, step = embedded
    _m, _o, state = _fresh_state()
    DistributedCheckpointer(extra_state_per_rank=False).load(step, state)
    assert state["extra_state"] == {"global_step": 9, "note": "n" * 400}


# -- paths that escape -----------------------------------------------------------------------
def test_symlinked_step_dir_outside_root_is_ignored(ckpt, tmp_path):
    root, _s4, s42 = ckpt
    outside = tmp_path / "outside" / "global_step_42"  # its own step: complete where it is
    shutil.copytree(s42, outside)
    assert check_step_dir(str(outside)).complete  # a real checkpoint, just not under root
    link = os.path.join(root, "global_step_100")
    os.symlink(outside, link)
    st = check_step_dir(link, root)
    assert not st.complete and "outside" in st.reason
    assert find_latest_checkpoint(root) == s42


def test_symlinked_shard_outside_step_is_refused(ckpt, tmp_path):
    root, s4, s42 = ckpt
    real = tmp_path / "elsewhere.safetensors"
    shutil.move(os.path.join(s42, B.SHARD), real)
    os.symlink(real, os.path.join(s42, B.SHARD))
    st = check_step_dir(s42, root)
    assert not st.complete and "outside" in st.reason
    assert find_latest_checkpoint(root) == s4


@pytest.mark.parametrize("bad", ["../x", "../../x", "/etc/hostname", "sub/../../x"])
def test_recorded_path_escaping_step_dir_is_refused(ckpt, bad):
    root, s4, s42 = ckpt
    shutil.copyfile(os.path.join(s42, B.SHARD), os.path.join(root, "x"))  # the target exists

    def edit(md):
        files = getattr(md, MANIFEST_ATTR)["files"]
        files[bad] = files.pop(B.SHARD)
        for info in list(md.storage_data.values()):
            if info.relative_path == B.SHARD:
                info.relative_path = bad

    B.rewrite_commit_record(s42, edit)
    st = check_step_dir(s42, root)
    assert not st.complete and repr(bad) in st.reason
    assert find_latest_checkpoint(root) == s4
    _m, _o, state = _fresh_state()
    with pytest.raises(E.UnsafeCheckpointError, match="outside|not a relative"):
        DistributedCheckpointer().load(s42, state)


def test_plain_dcp_record_escaping_step_dir_is_refused(ckpt):
    """Without a refckpt manifest, DCP's own storage records are checked the same way."""
    root, s4, s42 = ckpt
    shutil.copyfile(os.path.join(s42, B.SHARD), os.path.join(root, "x"))

    def edit(md):
        delattr(md, MANIFEST_ATTR)
        for info in md.storage_data.values():
            info.relative_path = "../x"

    B.rewrite_commit_record(s42, edit)
    assert not check_step_dir(s42, root).complete
    assert find_latest_checkpoint(root) == s4


@pytest.mark.parametrize("what", ["file", "dir"])
@pytest.mark.parametrize("layout", ["refckpt", "family"])
def test_extra_state_symlinked_outside_is_refused(tmp_path, layout, what):
    """``extra_state_rank_0.pt`` (or the ``extra_state`` directory) moved out and symlinked back:
    refckpt's commit record makes the step incomplete; the family's does not cover extra state,
    so the load refuses the file, and resume falls back."""
    root = str(tmp_path / "root")
    older, params, _o = B.save_trained(root, 3, seed=1)
    step_dir = (B.save_trained(root, 5, seed=2) if layout == "refckpt" else B.save_family(root, 5))[0]
    src = os.path.join(step_dir, B.EXTRA_REL if what == "file" else "extra_state")
    outside = str(tmp_path / f"outside_{what}")
    shutil.move(src, outside)
    os.symlink(outside, src)
    if layout == "refckpt":
        st = check_step_dir(step_dir, root)
        assert not st.complete and "outside" in st.reason
        assert find_latest_checkpoint(root) == older
    else:
        with pytest.raises(E.UnsafeCheckpointError, match="outside the step directory") as ei:
            DistributedCheckpointer().load(step_dir, _fresh_state("adamw_amsgrad")[2])
        assert step_dir in str(ei.value)
    _assert_resumes(root, older, params, 3, fallback=layout == "family")


def test_commit_record_symlinked_outside_is_not_a_record(ckpt, template, tmp_path):
    root, s4, s42 = ckpt
    outside = tmp_path / "outside.metadata"
    shutil.move(os.path.join(s42, ".metadata"), outside)
    os.symlink(outside, os.path.join(s42, ".metadata"))
    st = check_step_dir(s42, root)
    assert not st.complete and "'.metadata'" in st.reason and "outside" in st.reason
    _assert_resumes(root, s4, template[1][4], 4)


# -- the pointer -------------------------------------------------------------------------------
@pytest.mark.parametrize("content", [
    b"../global_step_4\n", b"../../etc\n", b"/etc/passwd\n", b"global_step_4\n", b"4/../../x\n",
    b"-1\n", b"99999999999999999999999\n", b"1e3\n", b"\xff\xfe\n",
])
def test_pointer_naming_a_path_is_ignored(ckpt, template, content):
    root, _s4, s42 = ckpt
    B.write_pointer(root, content)
    assert read_pointer(root) is None
    assert find_latest_checkpoint(root) == s42
    _assert_resumes(root, s42, template[1][42], 42)


@pytest.mark.parametrize("kind", ["symlink_outside", "fifo", "directory"])
def test_pointer_that_is_not_a_regular_file(ckpt, template, tmp_path, kind):
    """A pointer symlinked out of the root is not followed, a FIFO is not opened for a blocking
    read (resume would hang), and a save replaces either with a regular file -- not writing
    through the link. A directory cannot be replaced: the save refuses before writing anything."""
    root, _s4, s42 = ckpt
    pointer = os.path.join(root, LATEST_CHECKPOINT_FILE)
    os.unlink(pointer)
    outside = tmp_path / "outside_pointer"
    if kind == "symlink_outside":
        outside.write_bytes(b"4\n")
        os.symlink(outside, pointer)
    elif kind == "fifo":
        os.mkfifo(pointer)
    else:
        os.mkdir(pointer)
    before = sorted(os.listdir(root))
    model, opt = B.make(7, "adamw")
    weights = B.params(model)
    with _no_hang():
        assert read_pointer(root) is None
        assert find_latest_checkpoint(root) == s42
        _assert_resumes(root, s42, template[1][42], 42)
        if kind == "directory":
            with pytest.raises(E.InvalidCheckpointPathError, match="remove or rename it") as ei:
                B.save(root, model, opt, 43)
            assert pointer in str(ei.value)
            assert sorted(os.listdir(root)) == before
            _assert_resumes(root, s42, template[1][42], 42)
        else:
            s43 = B.save(root, model, opt, 43)
            assert os.path.isfile(pointer) and not os.path.islink(pointer)
            assert read_pointer(root) == 43
            _assert_resumes(root, s43, weights, 43)
    if kind == "symlink_outside":
        assert outside.read_bytes() == b"4\n"


class _PointerReplaceFails(FileIO):
    """The pointer's rename fails (EIO), after the step directory was published."""

    def replace(self, src: str, dst: str) -> None:
        if os.path.basename(dst) == LATEST_CHECKPOINT_FILE:
            raise OSError(errno.EIO, os.strerror(errno.EIO), dst)
        super().replace(src, dst)


class _RootFsyncFailsAfterPublish(FileIO):
    """The directory fsync that makes the published step durable fails (EIO)."""

    def __init__(self) -> None:
        self.published = False

    def replace(self, src: str, dst: str) -> None:
        super().replace(src, dst)
        self.published = self.published or os.path.basename(dst).startswith("global_step_")

    def fsync_dir(self, path: str) -> None:
        if self.published:
            raise OSError(errno.EIO, os.strerror(errno.EIO), path)
        super().fsync_dir(path)


@pytest.mark.parametrize("io_cls, says, pointer", [
    (_PointerReplaceFails, ["step 43 is committed at {s43}", "nothing is lost"], 42),  # the old pointer: a stale hint
    (_RootFsyncFailsAfterPublish, ["step 43 is committed and visible at {s43}", "Save again"], None),
], ids=["pointer-replace-fails", "root-fsync-fails"])
def test_failure_after_publish_says_the_step_is_committed(ckpt, io_cls, says, pointer):
    """An error after the step directory is published must say the step is committed (never
    "the previous checkpoint stays the newest"), and resume must land on it."""
    root, _s4, _s42 = ckpt
    model, opt = B.make(7, "adamw")
    weights = B.params(model)
    with pytest.raises(E.SaveFailedError) as ei:
        B.save(root, model, opt, 43, io=io_cls())
    s43 = os.path.join(root, "global_step_43")
    msg = str(ei.value)
    for fragment in says:
        assert fragment.format(s43=s43) in msg, msg
    assert "previous checkpoint stays" not in msg
    if pointer is not None:
        assert read_pointer(root) == pointer
    assert find_latest_checkpoint(root) == s43
    _assert_resumes(root, s43, weights, 43)


# -- names -------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", [
    "global_step_-1", "global_step_+100", "global_step_99999999999999999999999", "global_step_007",
    "global_step_0100", "global_step_1e3", "global_step_100 ", "global_step_0x64",
])
def test_non_canonical_step_names_are_not_steps(ckpt, template, name):
    """A complete checkpoint under a name no writer produces is never resumed from (``0100``
    would otherwise be step 100, newest of all), and a save into it is refused."""
    root, s4, s42 = ckpt
    shutil.copytree(s4, os.path.join(root, name))
    assert refckpt.layout.parse_step_dir_name(name) is None
    assert find_latest_checkpoint(root) == s42
    _assert_resumes(root, s42, template[1][42], 42)
    model, opt = B.make(7, "adamw")
    with pytest.raises(E.InvalidCheckpointPathError, match="pass the checkpoint root") as ei:
        B.save(os.path.join(root, name), model, opt, 100)
    assert name in str(ei.value)


def test_non_utf8_names_in_the_root(ckpt, template):
    """Names that are not UTF-8 (``os.fsencode``) are listed, skipped, and left alone by the
    sweep and by retention."""
    root, s4, s42 = ckpt
    broot = os.fsencode(root)
    for name in (b"global_step_\xff", b"global_step_9\xff9"):
        shutil.copytree(s4, os.fsdecode(os.path.join(broot, name)))  # complete, under a non-step name
    with open(os.path.join(broot, b"\xff\xfe"), "wb") as f:
        f.write(b"x")
    with open(os.path.join(os.fsencode(s42), b"__\xff.metadata"), "wb") as f:
        f.write(b"x")
    assert find_latest_checkpoint(root) == s42
    _assert_resumes(root, s42, template[1][42], 42)
    model, opt = B.make(7, "adamw")
    weights = B.params(model)
    s43 = B.save(root, model, opt, 43, keep_last=1)
    assert sorted(os.listdir(broot)) == sorted(
        [b"\xff\xfe", b"global_step_\xff", b"global_step_9\xff9", b"global_step_43", os.fsencode(LATEST_CHECKPOINT_FILE)])
    _assert_resumes(root, s43, weights, 43)


def test_non_utf8_root_path(tmp_path):
    root = os.fsdecode(os.path.join(os.fsencode(str(tmp_path)), b"r\xffoot"))
    step_dir, params, _o = B.save_trained(root, 3, seed=1)
    assert find_latest_checkpoint(root) == step_dir
    _assert_resumes(root, step_dir, params, 3)


# -- odd files --------------------------------------------------------------------------------
def _replace_with(path: str, kind: str) -> None:
    if os.path.isdir(path):
        shutil.rmtree(path)
    else:
        os.unlink(path)
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "dir":
        os.mkdir(path)
    else:
        with open(path, "wb") as f:
            f.write(b"a file where a directory belongs")


@pytest.mark.parametrize("rel,kind", [
    (".metadata", "fifo"), (".metadata", "dir"), ("__0.metadata", "fifo"), (B.SHARD, "fifo"),
    (B.SHARD, "dir"), (B.EXTRA_REL, "fifo"), ("extra_state", "file"),
])
def test_fifo_directory_or_file_in_the_wrong_place_makes_the_step_incomplete(ckpt, template, rel, kind):
    root, s4, s42 = ckpt
    if rel == "__0.metadata":  # the per-rank spelling of the commit record
        os.rename(os.path.join(s42, ".metadata"), os.path.join(s42, rel))
    _replace_with(os.path.join(s42, rel), kind)
    with _no_hang():
        st = check_step_dir(s42, root)
        assert not st.complete and st.reason
        assert find_latest_checkpoint(root) == s4
        _assert_resumes(root, s4, template[1][4], 4)



def test_zero_byte_shard_is_incomplete(ckpt):
    root, s4, s42 = ckpt
    os.truncate(os.path.join(s42, B.SHARD), 0)
    st = check_step_dir(s42, root)
    assert not st.complete and B.SHARD in st.reason
    assert find_latest_checkpoint(root) == s4
    with pytest.raises(E.IncompleteCheckpointError, match=B.SHARD):
        DistributedCheckpointer().load(s42, _fresh_state()[2])


def test_zero_byte_metadata_is_incomplete(ckpt):
    root, s4, s42 = ckpt
    os.truncate(os.path.join(s42, ".metadata"), 0)
    assert not check_step_dir(s42, root).complete
    assert find_latest_checkpoint(root) == s4


def test_file_where_step_dir_should_be_is_skipped(ckpt):
    root, _s4, s42 = ckpt
    with open(os.path.join(root, "global_step_100"), "wb") as f:
        f.write(b"not a directory")
    os.mkdir(os.path.join(root, "global_step_200x"))  # not a step name at all
    B.write_pointer(root, b"100\n")
    st = check_step_dir(os.path.join(root, "global_step_100"), root)
    assert not st.complete
    assert find_latest_checkpoint(root) == s42


def test_root_is_a_file(tmp_path):
    root = tmp_path / "iam_a_file"
    root.write_bytes(b"x")
    model, opt = B.make(0, "adamw")
    with pytest.raises(E.InvalidCheckpointPathError, match="not a directory") as ei:
        B.save(root, model, opt, 1)
    assert isinstance(ei.value, ValueError) and str(root) in str(ei.value)
    assert root.read_bytes() == b"x"
    assert find_latest_checkpoint(str(root)) is None


def test_load_missing_path_names_it(tmp_path):
    missing = tmp_path / "global_step_3"
    with pytest.raises(E.CheckpointNotFoundError) as ei:
        DistributedCheckpointer().load(missing, {"model": {}})
    assert isinstance(ei.value, FileNotFoundError) and str(missing) in str(ei.value)


def test_load_root_instead_of_step_dir_says_so(ckpt):
    root, _s4, _s42 = ckpt
    with pytest.raises(E.CheckpointNotFoundError, match="load_latest") as ei:
        DistributedCheckpointer().load(root, _fresh_state()[2])
    assert root in str(ei.value)


# -- a root that refuses writes, a disk that fills up ---------------------------------------------
@contextlib.contextmanager
def _read_only(path: str):
    """Make directory ``path`` refuse new entries, for real: permission bits for a normal user;
    root bypasses those, so ``chattr +i`` (immutable, binds root too) when running as root."""
    if os.geteuid() != 0:
        os.chmod(path, 0o555)
        try:
            yield
        finally:
            os.chmod(path, 0o755)
        return
    r = subprocess.run(["chattr", "+i", path], capture_output=True, text=True) if shutil.which("chattr") else None
    if r is None or r.returncode != 0:
        pytest.skip("running as root, whom permission bits do not bind, and chattr +i is not available "
                    f"on this file system ({r.stderr.strip() if r else 'no chattr'})")
    try:
        yield
    finally:
        subprocess.run(["chattr", "-i", path], check=True)


def test_read_only_root_fails_the_save_clearly(ckpt, template):
    root, _s4, s42 = ckpt
    before = sorted(os.listdir(root))
    model, opt = B.make(7, "adamw")
    with _read_only(root):
        with pytest.raises(E.SaveFailedError) as ei:
            B.save(root, model, opt, 43)
        msg = str(ei.value)
        assert root in msg and "writable" in msg and "nothing was written" in msg, msg
        assert isinstance(ei.value, OSError) and ei.value.__cause__.errno in (errno.EACCES, errno.EPERM)
        assert sorted(os.listdir(root)) == before
        assert find_latest_checkpoint(root) == s42
        _assert_resumes(root, s42, template[1][42], 42)  # a read-only root still loads


NOBODY = 65534


@pytest.mark.skipif(os.geteuid() != 0, reason="an unprivileged run already takes the permission-bit "
                    "path in test_read_only_root_fails_the_save_clearly; this one needs root to drop to 'nobody'")
def test_permission_bits_refuse_an_unprivileged_saver(template):
    """The read-only root a normal user meets: mode 0555, owned by the saving user, enforced by
    permission bits rather than ``chattr +i``. Run for real from root by forking a child that
    drops to uid/gid 65534 before it saves: the save must fail naming the root and the fix, add
    nothing, and the committed step must still resume."""
    base = tempfile.mkdtemp(prefix="refckpt-ro-", dir="/tmp")  # pytest's tmp is 0700 root: nobody can't reach it
    try:
        os.chmod(base, 0o755)
        root = os.path.join(base, "ckpt")
        shutil.copytree(template[0], root, symlinks=True)
        try:
            for d, dirs, files in os.walk(root):
                for name in [d] + [os.path.join(d, f) for f in files + dirs]:
                    os.chown(name, NOBODY, NOBODY)
        except OSError as e:  # a user namespace that maps only uid 0
            pytest.skip(f"cannot give the root to uid {NOBODY} here: {e}")
        s42 = os.path.join(root, "global_step_42")
        os.chmod(root, 0o555)
        before = sorted(os.listdir(root))
        model, opt = B.make(7, "adamw")
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child's coverage is not collected
            gc.freeze()  # see faults.suite._common.in_child
            os.close(r)
            report = "no error: the save into a 0555 root succeeded"
            try:
                try:
                    os.setgroups([])
                    os.setgid(NOBODY)
                    os.setuid(NOBODY)
                except OSError as e:
                    report = f"cannot drop to uid {NOBODY} here: {e}"
                    raise SystemExit from e
                B.save(root, model, opt, 43)
            except E.SaveFailedError as e:
                cause = getattr(e.__cause__, "errno", None)
                report = f"{type(e).__name__}|{cause}|{e}"
            except SystemExit:
                pass
            except BaseException:
                report = "wrong error: " + traceback.format_exc()
            os.write(w, report.encode())
            os._exit(0)
        os.close(w)
        with os.fdopen(r, "rb") as f:
            report = f.read().decode()
        assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0
        if report.startswith("cannot drop"):
            pytest.skip(report)
        kind, cause, msg = (report.split("|", 2) + ["", ""])[:3]
        assert kind == "SaveFailedError", report
        assert int(cause) == errno.EACCES, report
        assert root in msg and "writable" in msg and "nothing was written" in msg, msg
        assert sorted(os.listdir(root)) == before
        assert find_latest_checkpoint(root) == s42
        _assert_resumes(root, s42, template[1][42], 42)
    finally:
        if os.path.isdir(os.path.join(base, "ckpt")):
            os.chmod(os.path.join(base, "ckpt"), 0o755)
        shutil.rmtree(base)


def _diskfull(tmp_path, prefix: list[str] | None, mode: str, root: str, arg: str) -> dict:
    """:func:`tests._diskfull.run` in a child process: forked (no re-import of torch) when
    ``prefix`` is None, else ``prefix + python -m tests._diskfull ...``."""
    out = str(tmp_path / "diskfull_result.pt")
    if prefix is None:
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child's coverage is not collected
            gc.freeze()  # see faults.suite._common.in_child
            code = 1
            try:
                _diskfull_child.run(mode, root, out, arg)
                code = 0
            except BaseException:
                traceback.print_exc()
            finally:
                os._exit(code)
        assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0
    else:
        cmd = prefix + [sys.executable, "-m", "tests._diskfull", mode, root, out, arg]
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-4000:]
    return torch.load(out, weights_only=True)


def _assert_full_disk_outcome(r: dict, root: str, params: dict, err_no: int, hint: str) -> None:
    """The save failed with a clear error; no half step, no staging, the old pointer; resume
    restores step 42 bitwise."""
    err = r["error"]
    assert err and err["type"] == "SaveFailedError" and err["is_oserror"] and err["errno"] == err_no, r
    assert os.path.join(root, "global_step_43") in err["message"] and hint in err["message"], err["message"]
    assert r["entries"] == ["global_step_4", "global_step_42", LATEST_CHECKPOINT_FILE]
    assert r["pointer"] == b"42\n"
    assert r["latest"] == r["loaded"] == os.path.join(root, "global_step_42")
    B.assert_bitwise(r["params"], params)
    assert r["extra"] == {"global_step": 42}


@pytest.mark.parametrize("limit", [1024, 8192], ids=["at_extra_state", "at_shard"])
def test_file_size_limit_fails_the_save_clearly(ckpt, template, tmp_path, limit):
    """``RLIMIT_FSIZE``: the kernel fails the first write past ``limit`` bytes with EFBIG (the
    extra-state file is ~1.3 KB, the shard ~20 KB)."""
    root, _s4, _s42 = ckpt
    r = _diskfull(tmp_path, None, "rlimit", root, str(limit))
    _assert_full_disk_outcome(r, root, template[1][42], errno.EFBIG, "file-size limit")


def test_full_file_system_fails_the_save_clearly(template, tmp_path):
    """A 256 KiB tmpfs, mounted in a private mount namespace (gone with the process), holds a copy
    of the template; the next save does not fit: ENOSPC from the kernel."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    mount = f"mount -t tmpfs -o size=256k tmpfs {shlex.quote(str(mnt))}"
    prefix, why = None, "no unshare"
    for ns in (["unshare", "-rm"], ["unshare", "-m"]):
        if shutil.which(ns[0]) is None:
            break
        probe = subprocess.run(ns + ["sh", "-c", mount], capture_output=True, text=True)
        if probe.returncode == 0:
            prefix = ns + ["sh", "-c", f'{mount} && exec "$@"', "sh"]  # mount, then run the child in there
            break
        why = f"{' '.join(ns)}: {probe.stderr.strip()}"
    if prefix is None:
        pytest.skip(f"cannot mount a size-limited tmpfs in a private mount namespace here ({why})")
    r = _diskfull(tmp_path, prefix, "tmpfs", str(mnt), str(template[0]))
    _assert_full_disk_outcome(r, str(mnt), template[1][42], errno.ENOSPC, "is full")


# -- overwrite ------------------------------------------------------------------------------
def test_save_over_complete_step_refused_then_overwritten(ckpt, template):
    root, _s4, s42 = ckpt
    model, opt = B.make(7, "adamw")
    B.train(model, opt, range(3))
    new_weights = B.params(model)
    with pytest.raises(E.CheckpointExistsError) as ei:
        B.save(root, model, opt, 42)
    assert isinstance(ei.value, FileExistsError) and isinstance(ei.value, E.CheckpointError)
    assert s42 in str(ei.value) and "overwrite=True" in str(ei.value)
    assert not [n for n in os.listdir(root) if n.startswith(".")]  # no staging left behind
    loaded, _o, _x = B.load_fresh(s42)
    B.assert_bitwise(B.params(loaded), template[1][42])  # the old step is intact

    B.save(root, model, opt, 42, extra={"global_step": 42, "tag": "new"}, overwrite=True)
    assert not [n for n in os.listdir(root) if n.startswith(".")]
    loaded, _o, extra = B.load_fresh(s42)
    B.assert_bitwise(B.params(loaded), new_weights)
    assert extra == {"global_step": 42, "tag": "new"}
    assert find_latest_checkpoint(root) == s42


def test_stale_staging_dir_is_removed_not_mixed_in(ckpt):
    root, _s4, s42 = ckpt
    staging = os.path.join(root, ".global_step_43.partial")
    os.makedirs(os.path.join(staging, "extra_state"))
    for name in ("__0_0.safetensors", "__7_0.safetensors", "junk.bin", ".metadata.tmp", "extra_state/extra_state_rank_5.pt"):
        with open(os.path.join(staging, name), "wb") as f:
            f.write(b"junk from a crashed save")
    assert find_latest_checkpoint(root) == s42  # staging is never a checkpoint

    model, opt = B.make(5, "adamw")
    B.train(model, opt, range(2))
    weights = B.params(model)
    s43 = B.save(root, model, opt, 43)
    assert not os.path.exists(staging)
    assert sorted(os.listdir(s43)) == sorted([".metadata", B.SHARD, "extra_state"])
    assert os.listdir(os.path.join(s43, "extra_state")) == ["extra_state_rank_0.pt"]
    assert find_latest_checkpoint(root) == s43
    loaded, _o, extra = B.load_fresh(s43)
    B.assert_bitwise(B.params(loaded), weights)
    assert extra["global_step"] == 43


def test_incomplete_step_dir_is_replaced_by_save(ckpt):
    root, _s4, s42 = ckpt
    s50 = os.path.join(root, "global_step_50")
    shutil.copytree(s42, s50)
    os.unlink(os.path.join(s50, ".metadata"))
    with open(os.path.join(s50, "stray.bin"), "wb") as f:
        f.write(b"x")
    model, opt = B.make(5, "adamw")
    weights = B.params(model)
    B.save(root, model, opt, 50)  # no overwrite needed: the old one was never committed
    assert "stray.bin" not in os.listdir(s50)
    B.assert_bitwise(B.params(B.load_fresh(s50)[0]), weights)


# -- error hierarchy --------------------------------------------------------------------------
@pytest.mark.parametrize("cls,builtin", [
    (E.CheckpointNotFoundError, FileNotFoundError),
    (E.IncompleteCheckpointError, FileNotFoundError),
    (E.CorruptCheckpointError, ValueError),
    (E.CheckpointExistsError, FileExistsError),
    (E.MissingKeysError, KeyError),
    (E.MissingTrainingStateError, KeyError),
    (E.UnsafeCheckpointError, ValueError),
    (E.InvalidCheckpointPathError, ValueError),
    (E.SaveFailedError, OSError),
    (E.AsyncSaveFailedError, OSError),
    (E.SnapshotChangedError, OSError),
    (E.ConfigError, ValueError),
])
def test_errors_subclass_root_and_builtin(cls, builtin):
    assert issubclass(cls, E.CheckpointError) and issubclass(cls, builtin)
    err = cls("/some/path: message")
    assert "/some/path: message" in str(err)  # KeyError subclasses do not quote-mangle the message
    with pytest.raises(builtin):
        raise err
