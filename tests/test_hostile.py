"""Hostile and odd on-disk input: the load path never executes code from checkpoint bytes,
nothing recorded in a checkpoint reaches outside the root, and odd names/files are skipped.

Every malicious payload is first shown to be live (a plain ``pickle``/``torch.load(weights_only=False)``
of it *does* create its marker file) so that "no marker after refckpt read it" means something.
"""

from __future__ import annotations

import io
import os
import pickle
import shutil
import warnings
import zlib

import pytest
import torch

import refckpt
from refckpt import DistributedCheckpointer, check_step_dir, find_latest_checkpoint
from refckpt import errors as E
from refckpt.layout import MANIFEST_ATTR
from refckpt.storage import BYTES_KEY_PREFIX

from . import _builders as B


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        warnings.filterwarnings("ignore", message="Detected pickle protocol")
        yield



def _fresh_state():
    model, opt = B.make(99, "adamw")
    return model, opt, refckpt.get_training_state(model, opt, {})


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

    rel = B.EXTRA_REL
    with open(os.path.join(s42, rel), "wb") as f:
        f.write(payload)

    def edit(md):  # a consistent commit record, so only the unpickler stands in the way
        getattr(md, MANIFEST_ATTR)["files"][rel] = {"size": len(payload), "chunks": [[0, len(payload), zlib.crc32(payload)]]}

    B.rewrite_commit_record(s42, edit)
    assert check_step_dir(s42, root).complete
    _m, _o, state = _fresh_state()
    with pytest.raises(E.UnsafeCheckpointError, match="extra_state_rank_0.pt"):
        DistributedCheckpointer(verify_checksums=verify).load(s42, state)
    assert not marker.exists()


# -- a non-tensor item inside the shard ----------------------------------------------------
@pytest.fixture
def embedded(tmp_path):
    """A checkpoint with extra state embedded in the shard (``__bytes__/extra_state.*`` items)."""
    model, opt = B.make(3, "adamw")
    B.train(model, opt, range(2))
    extra = {"global_step": 9, "note": "n" * 400}
    root = tmp_path / "emb"
    return str(root), B.save(root, model, opt, 9, extra=extra, extra_state_per_rank=False)


@pytest.mark.parametrize("kind,item", [
    ("raw", "optimizer.param_groups.0.lr"),
    ("raw", "extra_state.note"),
    ("zip", "extra_state.note"),
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
    outside = tmp_path / "outside" / "global_step_100"
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
        for k, info in list(md.storage_data.items()):
            if info.relative_path == B.SHARD:
                info.relative_path = bad

    B.rewrite_commit_record(s42, edit)
    st = check_step_dir(s42, root)
    assert not st.complete and repr(bad) in st.reason
    assert find_latest_checkpoint(root) == s4
    _m, _o, state = _fresh_state()
    with pytest.raises(E.IncompleteCheckpointError, match="outside|not a relative"):
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


# -- odd files --------------------------------------------------------------------------------
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
    (E.ConfigError, ValueError),
])
def test_errors_subclass_root_and_builtin(cls, builtin):
    assert issubclass(cls, E.CheckpointError) and issubclass(cls, builtin)
    err = cls("/some/path: message")
    assert "/some/path: message" in str(err)  # KeyError subclasses do not quote-mangle the message
    with pytest.raises(builtin):
        raise err
