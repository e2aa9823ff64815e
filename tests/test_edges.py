"""Edge behaviour a user meets once in a while, each asserted the way the user observes it:

* configuration and path validation (typed errors that name the setting or path and the fix,
  nothing created on disk);
* failed saves clean up after themselves, and a failed clean-up does not hide the real error;
* retention: leased steps, stale leases, deletions that fail, incomplete steps newer than the save;
* extra state: skeletons, missing ``global_step``, per-rank files missing / unlisted / not a dict,
  embedded extra state in plain DCP checkpoints, allow-listed classes;
* commit records and shards that disagree (malformed manifests, missing checksums, wrong lengths,
  DCP stream extensions, truncation), ``verify_step_files``;
* optimizer initialisation corners, weights-only round trips, the ``refckpt`` command line.

Single process, real files under ``tmp_path``; faults are injected through ``FileIO`` subclasses
(the seam ``DistributedCheckpointer(io=...)`` offers) or by patching one function to raise.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import errno
import importlib.util
import io
import logging
import os
import pickle
import re
import shutil
import subprocess
import sys
import tempfile
import warnings
import zlib

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.state_dict import get_state_dict

import refckpt.checkpointer as C
from refckpt import (
    DistributedCheckpointer,
    check_step_dir,
    find_latest_checkpoint,
    get_training_state,
    initialize_optimizer_state,
    set_training_state,
)
from refckpt import errors as E
from refckpt.durable import FileIO, atomic_write_bytes
from refckpt.layout import LATEST_CHECKPOINT_FILE, MANIFEST_ATTR
from refckpt.planner import RefLoadPlanner
from refckpt.safeload import load_metadata
from refckpt.storage import SafetensorsReader, SafetensorsWriter, tensor_bytes, tensor_to_bytes, verify_step_files
from refckpt.tools.cli import main as cli_main

from . import _builders as B

pytestmark = pytest.mark.usefixtures("quiet_single_process_warnings")



def _fresh_state(extra: dict | None = None):
    model, opt = B.make(99, "adamw")
    return model, opt, get_training_state(model, opt, {} if extra is None else extra)


def _pointer(root) -> bytes:
    with open(os.path.join(os.fspath(root), LATEST_CHECKPOINT_FILE), "rb") as f:
        return f.read()


def _hidden(root) -> list[str]:
    return sorted(n for n in os.listdir(root) if n.startswith("."))


def _steps(root) -> list[str]:
    return sorted(n for n in os.listdir(root) if n.startswith("global_step_"))


def _oserror(code: int, path: str = "") -> OSError:
    return OSError(code, os.strerror(code), path)


# ================================================================================================
# configuration
# ================================================================================================
@pytest.mark.parametrize("bad", [0, -1, 2.5, "3"])
def test_keep_last_must_be_a_positive_int(bad):
    with pytest.raises(E.ConfigError) as ei:
        DistributedCheckpointer(keep_last=bad)
    assert isinstance(ei.value, ValueError)
    assert f"keep_last={bad!r}" in str(ei.value) and ">= 1" in str(ei.value)


@pytest.mark.parametrize("bad", [0, -5, None])
def test_timeout_must_be_positive(bad):
    with pytest.raises(E.ConfigError, match=r"timeout=.*positive number of seconds") as ei:
        DistributedCheckpointer(timeout=bad)
    assert f"timeout={bad!r}" in str(ei.value)


class _SyncRecorder(FileIO):
    """Records every path fsync'd (files by name, directories by path)."""

    def __init__(self) -> None:
        self.synced: list[str] = []

    def fsync(self, f) -> None:
        self.synced.append(os.path.abspath(f.name))
        super().fsync(f)

    def fsync_dir(self, path: str) -> None:
        self.synced.append(os.path.abspath(path))
        super().fsync_dir(path)


def _save_twice_and_overwrite(root, ckpt_kwargs):
    """Save step 1, overwrite step 1 (atomic exchange), save step 2; returns params of step 2 / new step 1."""
    rec = _SyncRecorder()
    ck = DistributedCheckpointer(io=rec, overwrite=True, **ckpt_kwargs)
    model, opt = B.make(0, "adamw")
    ck.save(root, get_training_state(model, opt, {}), global_step=1)
    B.train(model, opt, range(2))
    p1 = B.params(model)
    ck.save(root, get_training_state(model, opt, {}), global_step=1)  # over a complete step: exchange
    B.train(model, opt, range(2, 3))
    p2 = B.params(model)
    ck.save(root, get_training_state(model, opt, {}), global_step=2)
    return rec, p1, p2


def test_sync_files_false_warns_and_syncs_no_checkpoint_file(tmp_path):
    root = str(tmp_path / "nosync")
    with pytest.warns(UserWarning, match=r"sync_files=False.*not power-loss safe"):
        rec, p1, p2 = _save_twice_and_overwrite(root, {"sync_files": False})
    # The step directories, their staging and their files are never fsync'd. (The pointer file
    # goes through atomic_write_bytes, which always syncs; that is the only durable write left.)
    step_syncs = [p for p in rec.synced if "global_step_" in p]
    assert step_syncs == []
    # ... and the checkpoints are still exactly what was saved.
    assert _steps(root) == ["global_step_1", "global_step_2"] and _hidden(root) == []
    assert _pointer(root) == b"2\n"
    B.assert_bitwise(B.params(B.load_fresh(os.path.join(root, "global_step_1"))[0]), p1)
    B.assert_bitwise(B.params(B.load_fresh(os.path.join(root, "global_step_2"))[0]), p2)


def test_sync_files_default_syncs_shards_and_commit_record(tmp_path):
    """Control for the test above: the recorder does see the syncs a durable save makes."""
    root = str(tmp_path / "sync")
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        rec, _p1, _p2 = _save_twice_and_overwrite(root, {})
    names = {os.path.basename(p) for p in rec.synced}
    assert {B.SHARD, ".metadata.tmp", "extra_state_rank_0.pt"} <= names
    assert any(re.fullmatch(r"\.global_step_2\.[0-9a-f]{16}\.partial", n) for n in names), names  # this save's own staging
    assert os.path.abspath(root) in rec.synced  # the publish rename is made durable


def test_checksums_off_saves_sizes_only_and_says_so(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="refckpt")
    root = tmp_path / "nocrc"
    model, opt = B.make(0, "adamw")
    B.train(model, opt, range(2))
    weights = B.params(model)
    ck = DistributedCheckpointer(checksums=False)
    assert "checksums=False" in caplog.text
    ck.save(root, get_training_state(model, opt, {}), global_step=2)
    step = str(root / "global_step_2")
    manifest = getattr(B.read_commit_record(step), MANIFEST_ATTR)
    assert manifest["checksum"] is None
    assert manifest["files"][B.SHARD]["chunks"] == []  # no crc32 computed over the tensors

    caplog.clear()
    B.assert_bitwise(B.params(B.load_fresh(step)[0]), weights)
    assert "no checksums recorded" in caplog.text and "sizes are checked only" in caplog.text
    caplog.clear()
    B.load_fresh(step, verify_checksums=False)  # nothing to say when nothing is verified anyway
    assert "no checksums recorded" not in caplog.text


# ================================================================================================
# paths and arguments
# ================================================================================================
def test_save_into_a_matching_step_directory(tmp_path):
    root = tmp_path / "root"
    model, opt = B.make(0, "adamw")
    weights = B.params(model)
    DistributedCheckpointer().save(root / "global_step_7", get_training_state(model, opt, {}), global_step=7)
    assert _steps(root) == ["global_step_7"] and _hidden(root) == []
    assert _pointer(root) == b"7\n"
    assert find_latest_checkpoint(str(root)) == str(root / "global_step_7")
    B.assert_bitwise(B.params(B.load_fresh(root / "global_step_7")[0]), weights)


@pytest.mark.parametrize("name,match", [
    ("global_step_7", r"names step 7 but global_step=8"),
    ("global_step_x", r"looks like a step directory"),
    ("global_step_-8", r"looks like a step directory"),
    ("global_step_8.bak", r"looks like a step directory"),
])
def test_save_into_mismatched_step_directory_is_refused(tmp_path, name, match):
    root = tmp_path / "root"
    model, opt = B.make(0, "adamw")
    with pytest.raises(E.InvalidCheckpointPathError, match=match) as ei:
        DistributedCheckpointer().save(root / name, get_training_state(model, opt, {}), global_step=8)
    assert isinstance(ei.value, ValueError)
    assert str(root / name) in str(ei.value) and "checkpoint root" in str(ei.value)
    assert not root.exists()


@pytest.mark.parametrize("bad", [-1, 2**63, 1.5, True, "5"])
def test_invalid_global_step_is_refused(tmp_path, bad):
    root = tmp_path / "root"
    model, opt = B.make(0, "adamw")
    with pytest.raises(E.InvalidCheckpointPathError) as ei:
        DistributedCheckpointer().save(root, get_training_state(model, opt, {}), global_step=bad)
    assert f"global_step={bad!r}" in str(ei.value) and str(2**63 - 1) in str(ei.value)
    assert not root.exists()


@pytest.mark.parametrize("op", ["save", "load"])
@pytest.mark.parametrize("bad", [[("model", {})], None, "model"])
def test_state_must_be_a_dict(ckpt, op, bad):
    root, _s4, s42 = ckpt
    ck = DistributedCheckpointer()
    with pytest.raises(E.ConfigError) as ei:
        if op == "save":
            ck.save(root, bad, global_step=43)
        else:
            ck.load(s42, bad)
    assert f"{op}: state must be a dict" in str(ei.value) and type(bad).__name__ in str(ei.value)
    assert _steps(root) == ["global_step_4", "global_step_42"] and _hidden(root) == []


def test_extra_state_must_be_a_dict(tmp_path):
    root = tmp_path / "root"
    model, opt = B.make(0, "adamw")
    state = get_training_state(model, opt, None)
    state["extra_state"] = [("global_step", 3)]
    with pytest.raises(E.ConfigError, match=r"state\['extra_state'\] must be a dict, got list"):
        DistributedCheckpointer().save(root, state, global_step=3)
    assert not root.exists()


# ================================================================================================
# failed saves
# ================================================================================================
class _BrokenScheduler:
    """A DCP ``Stateful`` entry whose ``state_dict()`` fails (DCP calls it inside ``dcp.save``)."""

    def state_dict(self):
        raise RuntimeError("scheduler state unavailable")

    def load_state_dict(self, sd) -> None:
        raise AssertionError("never loaded: the save fails")


def _assert_nothing_published(root, template, step: int) -> None:
    root = str(root)
    assert _steps(root) == ["global_step_4", "global_step_42"]
    assert _hidden(root) == []  # staging removed
    assert not os.path.exists(os.path.join(root, f"global_step_{step}"))
    assert _pointer(root) == b"42\n"
    assert find_latest_checkpoint(root) == os.path.join(root, "global_step_42")
    B.assert_bitwise(B.params(B.load_fresh(os.path.join(root, "global_step_42"))[0]), template[1][42])


def test_failing_stateful_entry_fails_the_save_cleanly(ckpt, template):
    root, _s4, _s42 = ckpt
    model, opt = B.make(5, "adamw")
    state = get_training_state(model, opt, {})
    state["scheduler"] = _BrokenScheduler()
    with pytest.raises(E.SaveFailedError) as ei:
        DistributedCheckpointer().save(root, state, global_step=43)
    msg = str(ei.value)
    assert isinstance(ei.value, OSError)
    assert "step 43" in msg and "rank 0" in msg and "RuntimeError: scheduler state unavailable" in msg
    assert "Nothing was published" in msg
    assert isinstance(ei.value.__cause__, RuntimeError)
    _assert_nothing_published(root, template, 43)


def test_complex_tensor_fails_the_save_naming_key_and_fix(ckpt, template):
    root, _s4, _s42 = ckpt
    state = {"model": {"spectrum": torch.ones(3, dtype=torch.complex64)}}
    with pytest.raises(E.SaveFailedError) as ei:
        DistributedCheckpointer().save(root, state, global_step=43)
    msg = str(ei.value)
    assert "model.spectrum" in msg and "complex64" in msg and "view a complex tensor as real" in msg
    assert isinstance(ei.value.__cause__, E.CheckpointError)
    _assert_nothing_published(root, template, 43)


class _FullDiskStuckDir(FileIO):
    """Every write fails with ENOSPC; removing a directory tree fails with EBUSY."""

    def write(self, f, data) -> int:
        raise _oserror(errno.ENOSPC, getattr(f, "name", ""))

    def rmtree(self, path: str) -> None:
        raise _oserror(errno.EBUSY, path)


def test_failed_cleanup_after_failed_save_keeps_the_real_error(ckpt, template, caplog):
    root, _s4, _s42 = ckpt
    model, opt = B.make(5, "adamw")
    with pytest.raises(E.SaveFailedError) as ei:
        DistributedCheckpointer(io=_FullDiskStuckDir()).save(root, get_training_state(model, opt, {}), global_step=43)
    (staging,) = [os.path.join(root, n) for n in _hidden(root)]  # this save's own staging directory
    assert re.fullmatch(r"\.global_step_43\.[0-9a-f]{16}\.partial", os.path.basename(staging))
    # The save's own failure is reported (not the clean-up's), the clean-up failure is logged.
    assert "No space left on device" in str(ei.value)
    assert isinstance(ei.value.__cause__, OSError) and ei.value.__cause__.errno == errno.ENOSPC
    assert "could not remove" in caplog.text and staging in caplog.text
    assert os.path.isdir(staging)
    assert find_latest_checkpoint(root) == os.path.join(root, "global_step_42")
    assert _pointer(root) == b"42\n"

    # The next healthy save removes the leftover staging and publishes.
    weights = B.params(model)
    DistributedCheckpointer().save(root, get_training_state(model, opt, {}), global_step=43)
    assert _hidden(root) == []
    assert find_latest_checkpoint(root) == os.path.join(root, "global_step_43")
    B.assert_bitwise(B.params(B.load_fresh(os.path.join(root, "global_step_43"))[0]), weights)


# -- atomic_write_bytes / FileIO ------------------------------------------------------------------
class _FsyncFails(FileIO):
    def fsync(self, f) -> None:
        raise _oserror(errno.EIO, f.name)


class _ReplaceThenFails(FileIO):
    """The rename happens, then the call reports an error (a network file system losing the reply)."""

    def replace(self, src: str, dst: str) -> None:
        os.replace(src, dst)
        raise _oserror(errno.EIO, dst)


@pytest.mark.parametrize("io_cls,final", [(_FsyncFails, b"old\n"), (_ReplaceThenFails, b"new\n")])
def test_atomic_write_failure_raises_its_own_error_and_leaves_no_tmp(tmp_path, io_cls, final):
    target = tmp_path / "pointer.txt"
    target.write_bytes(b"old\n")
    with pytest.raises(OSError) as ei:
        atomic_write_bytes(str(target), b"new\n", io_cls())
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


# ================================================================================================
# retention
# ================================================================================================
def _save_step(root, step: int, ck: DistributedCheckpointer | None = None, seed: int = 0) -> dict:
    model, opt = B.make(seed + step, "adamw")
    weights = B.params(model)
    (ck or DistributedCheckpointer(keep_last=1)).save(root, get_training_state(model, opt, {}), global_step=step)
    return weights


def test_retention_keeps_a_leased_step_until_the_lease_is_dropped(tmp_path):
    root = str(tmp_path / "root")
    w1 = _save_step(root, 1)
    lease = C._take_lease(root, "global_step_1")  # a reader (load_latest) of step 1 in this process
    assert lease is not None and os.path.exists(lease)
    _save_step(root, 2)
    _save_step(root, 3)
    assert _steps(root) == ["global_step_1", "global_step_3"]  # 2 deleted, leased 1 kept
    B.assert_bitwise(B.params(B.load_fresh(os.path.join(root, "global_step_1"))[0]), w1)
    C._drop_lease(lease)
    assert not os.path.exists(lease)
    _save_step(root, 4)
    assert _steps(root) == ["global_step_4"]


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", ""])
    child.wait()
    return child.pid


@pytest.mark.parametrize("holder,kept", [("self", True), ("dead", False), ("not_a_pid", False), ("other_user", True)])
def test_retention_honours_live_leases_only(tmp_path, monkeypatch, holder, kept):
    root = str(tmp_path / "root")
    _save_step(root, 1)
    pid = {"self": str(os.getpid()), "dead": str(_dead_pid()), "not_a_pid": "x1", "other_user": "1"}[holder]
    if holder == "other_user":  # signalling another user's process is refused: it is alive
        real_kill = os.kill

        def kill(p, sig):
            if p == 1 and sig == 0:
                raise PermissionError(errno.EPERM, os.strerror(errno.EPERM))
            return real_kill(p, sig)

        monkeypatch.setattr(os, "kill", kill)
    lease = os.path.join(root, f".lease.global_step_1.{pid}")
    open(lease, "w").close()
    _save_step(root, 2)
    assert _steps(root) == (["global_step_1", "global_step_2"] if kept else ["global_step_2"])
    assert os.path.exists(lease)  # retention never removes a reader's lease


class _CannotRenameForDeletion(FileIO):
    def replace(self, src: str, dst: str) -> None:
        if dst.endswith(".deleting"):
            raise _oserror(errno.EACCES, src)
        super().replace(src, dst)


def test_failed_retention_deletion_does_not_fail_the_committed_save(tmp_path, caplog):
    root = str(tmp_path / "root")
    ck = DistributedCheckpointer(keep_last=1, io=_CannotRenameForDeletion())
    w1 = _save_step(root, 1, ck)
    w2 = _save_step(root, 2, ck)  # must not raise: step 2 is committed and published
    assert "retention could not delete" in caplog.text and os.path.join(root, "global_step_1") in caplog.text
    assert _pointer(root) == b"2\n"
    assert find_latest_checkpoint(root) == os.path.join(root, "global_step_2")
    B.assert_bitwise(B.params(B.load_fresh(os.path.join(root, "global_step_2"))[0]), w2)
    # The step that could not be deleted is whole, not half-deleted.
    assert check_step_dir(os.path.join(root, "global_step_1"), root).complete
    B.assert_bitwise(B.params(B.load_fresh(os.path.join(root, "global_step_1"))[0]), w1)
    _save_step(root, 3)  # healthy retention catches up
    assert _steps(root) == ["global_step_3"]


def test_retention_leaves_incomplete_newer_steps_alone(tmp_path):
    root = str(tmp_path / "root")
    _save_step(root, 3)
    for step in (1, 9):  # 1: an abandoned older save; 9: someone else's save in flight
        os.makedirs(os.path.join(root, f"global_step_{step}"))
        with open(os.path.join(root, f"global_step_{step}", "__0_0.safetensors"), "wb") as f:
            f.write(b"partial")
    _save_step(root, 5)
    assert _steps(root) == ["global_step_5", "global_step_9"]
    assert os.listdir(os.path.join(root, "global_step_9")) == ["__0_0.safetensors"]
    assert find_latest_checkpoint(root) == os.path.join(root, "global_step_5")


# -- leases taken by load_latest -------------------------------------------------------------------
def test_load_latest_on_a_root_where_no_lease_can_be_written(ckpt, template, monkeypatch):
    root, _s4, s42 = ckpt
    real_open = open

    def read_only_root(path, mode="r", *args, **kwargs):
        if ".lease." in os.fspath(path) and "w" in mode:
            raise _oserror(errno.EROFS, os.fspath(path))
        return real_open(path, mode, *args, **kwargs)

    monkeypatch.setattr(C, "open", read_only_root, raising=False)
    model, opt, state = _fresh_state()
    assert DistributedCheckpointer().load_latest(root, state) == s42
    set_training_state(model, opt, state)
    B.assert_bitwise(B.params(model), template[1][42])
    assert state["extra_state"] == {"global_step": 42}
    assert not [n for n in os.listdir(root) if ".lease." in n]


class _LeaseSweptDuringLoad(DistributedCheckpointer):
    """A tmp cleaner removes the reader's lease while the load runs."""

    def load(self, path, state, **kwargs):
        root = os.path.dirname(os.fspath(path))
        leases = [n for n in os.listdir(root) if n.startswith(".lease.")]
        assert leases, "load_latest should hold a lease during the load"
        for n in leases:
            os.unlink(os.path.join(root, n))
        return super().load(path, state, **kwargs)


def test_lease_removed_during_load_does_not_fail_the_resume(ckpt, template):
    root, _s4, s42 = ckpt
    model, opt, state = _fresh_state()
    assert _LeaseSweptDuringLoad().load_latest(root, state) == s42
    set_training_state(model, opt, state)
    B.assert_bitwise(B.params(model), template[1][42])
    assert not [n for n in os.listdir(root) if ".lease." in n]


# ================================================================================================
# async
# ================================================================================================
def test_successful_async_save_reports_nothing(tmp_path):
    root = tmp_path / "root"
    model, opt = B.make(0, "adamw")
    weights = B.params(model)
    ck = DistributedCheckpointer()
    ck.save(root, get_training_state(model, opt, {}), global_step=1, save_async=True)
    concurrent.futures.wait([ck._pending])  # done, but nobody has looked at the outcome yet
    assert ck.raise_for_failed_async_save() is None
    assert ck._pending is None  # the outcome was consumed: a later check has nothing to report
    assert ck.raise_for_failed_async_save() is None
    ck.close()
    assert find_latest_checkpoint(str(root)) == str(root / "global_step_1")
    B.assert_bitwise(B.params(B.load_fresh(root / "global_step_1")[0]), weights)


# ================================================================================================
# extra state
# ================================================================================================
def test_extra_state_skeleton_names_a_key_the_checkpoint_lacks(ckpt):
    _root, _s4, s42 = ckpt
    _m, _o, state = _fresh_state()
    with pytest.raises(E.MissingKeysError) as ei:
        DistributedCheckpointer().load(s42, state, extra_state_skeleton={"global_step": 0, "lr_schedule": {}})
    assert isinstance(ei.value, KeyError)
    assert s42 in str(ei.value) and "'lr_schedule'" in str(ei.value) and "extra_state_skeleton" in str(ei.value)


@pytest.mark.parametrize("how", ["none_placeholder", "skeleton_only"])
def test_extra_state_is_filled_in_when_the_state_holds_no_dict(ckpt, template, how):
    _root, _s4, s42 = ckpt
    model, opt = B.make(99, "adamw")
    state = get_training_state(model, opt, None)
    if how == "none_placeholder":
        state["extra_state"] = None
        DistributedCheckpointer().load(s42, state)
    else:
        assert "extra_state" not in state
        DistributedCheckpointer().load(s42, state, extra_state_skeleton={"global_step": 0})
    assert state["extra_state"] == {"global_step": 42}
    set_training_state(model, opt, state)
    B.assert_bitwise(B.params(model), template[1][42])


def _plain_dcp_with_embedded_extra(root, step: int, extra: dict):
    """A checkpoint written by plain DCP (another tool): model + extra state in the DCP payload."""
    model, opt = B.make(0, "adamw")
    B.train(model, opt, range(2))
    msd, osd = get_state_dict(model, opt)
    step_dir = os.path.join(os.fspath(root), f"global_step_{step}")
    dcp.save({"model": msd, "optimizer": osd, "extra_state": extra}, checkpoint_id=step_dir, no_dist=True)
    return step_dir, B.params(model), B.opt_snapshot(opt)


def test_plain_dcp_embedded_extra_state_is_detected_and_restored(tmp_path):
    rng = torch.Generator().manual_seed(5).get_state()
    saved_extra = {"global_step": 7, "epoch": 3, "rng": rng.clone()}
    step_dir, weights, opt_sd = _plain_dcp_with_embedded_extra(tmp_path, 7, saved_extra)
    assert check_step_dir(step_dir).manifest is None  # not written by refckpt: no layout recorded
    model, opt, state = _fresh_state()
    DistributedCheckpointer().load(step_dir, state)
    extra = set_training_state(model, opt, state)
    B.assert_bitwise(extra, {"global_step": 7, "epoch": 3, "rng": rng})
    B.assert_bitwise(B.params(model), weights)
    B.assert_bitwise(opt.state_dict(), opt_sd)


def test_plain_dcp_extra_state_without_global_step_is_refused(tmp_path):
    step_dir, _w, _o = _plain_dcp_with_embedded_extra(tmp_path, 7, {"epoch": 3})
    _m, _o2, state = _fresh_state()
    with pytest.raises(E.MissingTrainingStateError) as ei:
        DistributedCheckpointer().load(step_dir, state)
    msg = str(ei.value)
    assert step_dir in msg and "no 'global_step'" in msg and "without 'extra_state'" in msg


def test_plain_dcp_per_rank_extra_state_of_rank_0_missing(tmp_path):
    """A family checkpoint with an extra_state/ directory, but no file for this rank."""
    root = str(tmp_path)
    older = B.save_trained(root, 3, seed=1)
    model, opt = B.make(0, "adamw")
    msd, osd = get_state_dict(model, opt)
    step_dir = os.path.join(root, "global_step_5")
    dcp.save({"model": msd, "optimizer": osd}, checkpoint_id=step_dir, no_dist=True)
    os.makedirs(os.path.join(step_dir, "extra_state"))
    torch.save({"global_step": 5}, os.path.join(step_dir, "extra_state", "extra_state_rank_1.pt"))
    assert find_latest_checkpoint(root) == step_dir  # complete as far as its commit record goes

    model, opt, state = _fresh_state()
    with pytest.raises(E.IncompleteCheckpointError) as ei:
        DistributedCheckpointer().load(step_dir, state)
    assert isinstance(ei.value, FileNotFoundError)
    assert os.path.join(step_dir, "extra_state", "extra_state_rank_0.pt") in str(ei.value)
    assert "per-rank extra state missing" in str(ei.value)

    # Damage, not a mismatch: load_latest falls back to the older complete step.
    model, opt, state = _fresh_state()
    with pytest.warns(UserWarning, match="fall back"):
        assert DistributedCheckpointer().load_latest(root, state) == older[0]
    set_training_state(model, opt, state)
    B.assert_bitwise(B.params(model), older[1])
    assert state["extra_state"] == {"global_step": 3}


def _falls_back_to_step_4(root: str, s4: str, template) -> dict:
    """``load_latest`` warns, falls back to step 4 and restores it bitwise; returns the state."""
    model, opt, state = _fresh_state()
    with pytest.warns(UserWarning, match="fall back"):
        assert DistributedCheckpointer().load_latest(root, state) == s4
    set_training_state(model, opt, state)
    B.assert_bitwise(B.params(model), template[1][4])
    return state


def test_extra_state_file_not_in_commit_record_is_refused(ckpt, template):
    root, s4, s42 = ckpt
    B.rewrite_commit_record(s42, lambda md: getattr(md, MANIFEST_ATTR)["files"].pop(B.EXTRA_REL))
    assert check_step_dir(s42, root).complete  # nothing the record lists is missing
    _m, _o, state = _fresh_state()
    with pytest.raises(E.CorruptCheckpointError, match="not listed in the commit record") as ei:
        DistributedCheckpointer().load(s42, state)
    assert os.path.join(s42, B.EXTRA_REL) in str(ei.value)

    assert _falls_back_to_step_4(root, s4, template)["extra_state"] == {"global_step": 4}


def _torch_saved(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


@pytest.mark.parametrize("data,match", [
    (_torch_saved([42, "global_step"]), r"extra state is a list, not a dict"),
    (_torch_saved(torch.zeros(2)), r"extra state is a Tensor, not a dict"),
    (_torch_saved({"global_step": 42, "rng": torch.ones(8)})[:200], r"cannot read \(RuntimeError"),  # cut short
    (b"", r"cannot read \(EOFError"),
])
def test_extra_state_file_that_is_not_a_dict_is_corrupt(ckpt, template, data, match):
    root, s4, s42 = ckpt
    B.replace_extra_file(s42, data)
    assert check_step_dir(s42, root).complete
    _m, _o, state = _fresh_state()
    with pytest.raises(E.CorruptCheckpointError, match=match) as ei:
        DistributedCheckpointer().load(s42, state)
    assert os.path.join(s42, B.EXTRA_REL) in str(ei.value)
    _falls_back_to_step_4(root, s4, template)


def test_extra_state_file_of_garbage_bytes_is_corrupt_not_unsafe(ckpt):
    _root, _s4, s42 = ckpt
    B.replace_extra_file(s42, b"\x00\x13\x37 bit rot, not a pickle \x00")
    _m, _o, state = _fresh_state()
    with pytest.raises(E.CorruptCheckpointError, match="cannot read") as ei:
        DistributedCheckpointer().load(s42, state)
    assert "safe_globals" not in str(ei.value)


@dataclasses.dataclass
class SamplerState:
    """A user's own class in extra state: not loadable unless allow-listed."""

    epoch: int
    index: int


@pytest.mark.parametrize("per_rank", [True, False])
def test_safe_globals_allow_a_users_class_in_extra_state(tmp_path, per_rank):
    root = tmp_path / "root"
    model, opt = B.make(0, "adamw")
    saved = {"global_step": 5, "sampler": SamplerState(epoch=2, index=17)}
    DistributedCheckpointer(extra_state_per_rank=per_rank).save(
        root, get_training_state(model, opt, dict(saved)), global_step=5)
    step = str(root / "global_step_5")

    _m, _o, state = _fresh_state()
    with pytest.raises(E.UnsafeCheckpointError, match=r"safe_globals=\[") as ei:
        DistributedCheckpointer(extra_state_per_rank=per_rank).load(step, state)
    assert step in str(ei.value)

    _m, _o, state = _fresh_state()
    DistributedCheckpointer(extra_state_per_rank=per_rank, safe_globals=[SamplerState]).load(step, state)
    assert state["extra_state"] == saved
    assert type(state["extra_state"]["sampler"]) is SamplerState


# ================================================================================================
# commit records that cannot be trusted
# ================================================================================================
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
        DistributedCheckpointer().load(s42, _fresh_state()[2])


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


# ================================================================================================
# shards that disagree with their commit record
# ================================================================================================
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
    assert "model.0.weight: chunk at [0, 0] of shape [5, 4] (torch.float32) needs 80 bytes, its storage entry records 76" in str(ei.value)
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
    blob = _torch_saved({"not": "a tensor"})
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
    problems = verify_step_files(str(step), manifest)
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

    # Without recorded checksums only presence and sizes can be checked.
    manifest["checksum"] = None
    problems = verify_step_files(str(step), manifest)
    assert len(problems) == 3 and not [p for p in problems if "rot.bin" in p or "past_end.bin" in p], problems


# ================================================================================================
# model / optimizer
# ================================================================================================
def test_model_shape_mismatch_is_not_reported_as_corruption(ckpt):
    root, _s4, s42 = ckpt
    torch.manual_seed(0)
    wider = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 2))
    state = {"model": wider.state_dict()}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(E.CheckpointError) as ei:
            DistributedCheckpointer().load_latest(root, state)
    msg = str(ei.value)
    # Not damage: the user's model does not match, so no fallback and no "restore from a copy".
    assert not isinstance(ei.value, E.CorruptCheckpointError), msg
    assert "model.0.weight" in msg and s42 in msg
    assert not [w for w in caught if "fall back" in str(w.message)]


def test_fused_adamw_direct_init_matches_lazy_init():
    model = B.make_model(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
    assert initialize_optimizer_state(opt) is True
    for p in model.parameters():
        step = opt.state[p]["step"]
        assert step.shape == () and step.dtype == torch.float32 and step.device == p.device and step.item() == 0
        assert p.grad is None
    lazy_model = B.make_model(0)
    lazy_opt = torch.optim.AdamW(lazy_model.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
    B.train(model, opt, range(3))
    B.train(lazy_model, lazy_opt, range(3))
    B.assert_bitwise(B.params(model), B.params(lazy_model))
    B.assert_bitwise(opt.state_dict(), lazy_opt.state_dict())


@pytest.mark.parametrize("kind,keys", [("adamw", {"step", "exp_avg", "exp_avg_sq"}), ("sgd_nesterov", {"momentum_buffer"})])
def test_init_fills_only_parameters_without_state(kind, keys):
    """Mid-training, a parameter added later (or never used so far) gets state; the others keep theirs."""
    model = B.make_model(0)
    late = torch.nn.Parameter(torch.ones(3))
    opt = B.OPTIMIZERS[kind](list(model.parameters()) + [late])
    B.train(model, opt, range(2))  # `late` is not in the graph: no grad, no state
    opt.zero_grad(set_to_none=True)
    assert late not in opt.state or not opt.state[late]
    existing = {n: B.clone_tree(opt.state[p]) for n, p in model.named_parameters()}
    assert initialize_optimizer_state(opt) is True
    for n, p in model.named_parameters():
        B.assert_bitwise(opt.state[p], existing[n], n)
    assert set(opt.state[late]) == keys
    assert all(not v.any() for v in opt.state[late].values())
    assert torch.equal(late, torch.ones(3)) and late.grad is None


def test_priming_an_optimizer_without_weight_decay_is_parameter_neutral():
    model = B.make_model(0)
    opt = torch.optim.Rprop(model.parameters(), lr=0.0375)
    assert "weight_decay" not in opt.param_groups[0]
    before = B.params(model)
    assert initialize_optimizer_state(opt) is True
    B.assert_bitwise(B.params(model), before)
    assert opt.param_groups[0]["lr"] == 0.0375 and "weight_decay" not in opt.param_groups[0]
    assert all(set(opt.state[p]) >= {"step", "prev", "step_size"} and p.grad is None for p in model.parameters())


PRIMED = {
    "rprop": lambda ps: torch.optim.Rprop(ps, lr=1e-2),
    "radam": lambda ps: torch.optim.RAdam(ps, lr=1e-2),
    "nadam": lambda ps: torch.optim.NAdam(ps, lr=1e-2),
    "adamax": lambda ps: torch.optim.Adamax(ps, lr=1e-2),
}


@pytest.mark.parametrize("kind", sorted(PRIMED))
def test_saving_before_the_first_step_does_not_perturb_primed_optimizers(tmp_path, kind):
    model = B.make_model(0)
    opt = PRIMED[kind](model.parameters())
    DistributedCheckpointer().save(tmp_path, get_training_state(model, opt, {}), global_step=0)
    lazy_model = B.make_model(0)
    lazy_opt = PRIMED[kind](lazy_model.parameters())
    B.train(model, opt, range(3))
    B.train(lazy_model, lazy_opt, range(3))
    B.assert_bitwise(B.params(model), B.params(lazy_model))


@pytest.mark.parametrize("with_opt", [False, True])
def test_weights_only_state_round_trips(tmp_path, with_opt):
    model, opt = B.make(0, "adamw")
    B.train(model, opt, range(2))
    weights = B.params(model)
    state = get_training_state(model)
    assert set(state) == {"model"}
    DistributedCheckpointer().save(tmp_path, state, global_step=2)

    fresh, fopt = B.make(99, "adamw")
    fopt_before = B.opt_snapshot(fopt)
    loaded = get_training_state(fresh)
    DistributedCheckpointer().load(str(tmp_path / "global_step_2"), loaded)
    assert set_training_state(fresh, fopt if with_opt else None, loaded) is None  # no extra state
    B.assert_bitwise(B.params(fresh), weights)
    B.assert_bitwise(B.opt_snapshot(fopt), fopt_before)  # an optimizer passed along is left alone


# ================================================================================================
# command line
# ================================================================================================
def test_cli_help_lists_the_example_command(capsys):
    with pytest.raises(SystemExit) as ei:
        cli_main(["--help"])
    assert ei.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: refckpt") and "example" in out


@pytest.mark.parametrize("argv,match", [
    ([], "the following arguments are required: cmd"),
    (["restore"], "invalid choice: 'restore'"),
    (["example", "--world-size", "two"], "expected a positive integer, got 'two'"),
])
def test_cli_rejects_bad_arguments(capsys, argv, match):
    with pytest.raises(SystemExit) as ei:
        cli_main(argv)
    assert ei.value.code == 2
    assert match in capsys.readouterr().err


@pytest.mark.parametrize("argv,code", [(["example", "--help"], 0), (["example", "--steps"], 2)])
def test_python_dash_m_refckpt_runs_the_cli(capsys, monkeypatch, argv, code):
    """``python -m refckpt`` executes refckpt/__main__.py, which exits with the CLI's status.
    (Executed in this process, as the module ``-m`` would run, to avoid starting another torch.)"""
    monkeypatch.setattr(sys, "argv", ["refckpt", *argv])
    spec = importlib.util.find_spec("refckpt.__main__")
    assert spec is not None and spec.origin.endswith(os.path.join("refckpt", "__main__.py"))
    with pytest.raises(SystemExit) as ei:
        spec.loader.exec_module(importlib.util.module_from_spec(spec))
    assert ei.value.code == code
    out, err = capsys.readouterr()
    if code == 0:
        assert "usage: refckpt example" in out and "--world-size" in out and "--every" in out
    else:
        assert "argument --steps: expected one argument" in err


def test_cli_example_rejects_an_empty_world(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # run_example's work dir lands here
    with pytest.raises(SystemExit) as ei:
        cli_main(["example", "--dir", str(tmp_path / "ckpt"), "--world-size", "0"])
    assert ei.value.code == 2 and "--world-size" in capsys.readouterr().err
