"""refckpt's ``DistributedCheckpointer``, in real gloo worlds of 1, 2 and 4 ranks and in one process.

In worlds: exactness, async semantics, failures, fallback. Worlds come from ``faults.plugin``'s
``world_factory`` and are reused: every rank function catches the errors its test expects, so
no fault here kills a world.

In one process (real files under ``tmp_path``), the edges a user meets once in a while, each
asserted the way the user observes it: configuration and path validation (typed errors that
name the setting or path and the fix, nothing created on disk); failed saves clean up after
themselves, and a failed clean-up does not hide the real error; retention with leased steps,
stale leases, deletions that fail and incomplete steps newer than the save; the outcome of an
async save; extra state (skeletons, missing ``global_step``, per-rank files missing, unlisted or
not a dict, embedded extra state in plain DCP checkpoints, allow-listed classes). Faults are
injected through ``FileIO`` subclasses (the seam ``DistributedCheckpointer(io=...)`` offers) or
by patching one function to raise.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import errno
import logging
import os
import re
import subprocess
import sys
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict

import refckpt.commit as C
from refckpt import (
    DistributedCheckpointer,
    check_step_dir,
    find_latest_checkpoint,
    get_training_state,
    set_training_state,
)
from refckpt import errors as E
from refckpt.durable import FileIO
from refckpt.layout import LATEST_CHECKPOINT_FILE, MANIFEST_ATTR
from tests import _builders as B
from tests import _ckpt_fns as fns

pytestmark = pytest.mark.usefixtures("quiet_single_process_warnings")

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


# ================================================================================================
# In one process
# ================================================================================================
def _pointer(root) -> bytes:
    with open(os.path.join(os.fspath(root), LATEST_CHECKPOINT_FILE), "rb") as f:
        return f.read()


def _hidden(root) -> list[str]:
    return sorted(n for n in os.listdir(root) if n.startswith("."))


def _steps(root) -> list[str]:
    return sorted(n for n in os.listdir(root) if n.startswith("global_step_"))


# -- configuration ---------------------------------------------------------------------------------
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
    with pytest.warns(UserWarning, match=r"sync_files=False.*not power-loss safe") as caught:
        rec, p1, p2 = _save_twice_and_overwrite(root, {"sync_files": False})
    # attributed to the line that made the checkpointer (here), not to refckpt's own code
    where = {w.filename for w in caught if "sync_files=False" in str(w.message)}
    # mutmut's repository runner (docs/mutation.md) calls every refckpt function through its
    # trampoline: one frame more between this test and refckpt, which the warning then names
    tramp = sys.modules.get("mutmut.mutation.trampoline")
    assert where == {tramp.__file__ if tramp else __file__}, where
    # The step directories, their staging and their files are never fsync'd. (The pointer file
    # is synced whatever sync_files says; that is the only durable write left.)
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


# -- paths and arguments ---------------------------------------------------------------------------
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


# -- failed saves ----------------------------------------------------------------------------------
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
        raise B.oserror(errno.ENOSPC, getattr(f, "name", ""))

    def rmtree(self, path: str) -> None:
        raise B.oserror(errno.EBUSY, path)


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


# -- retention -------------------------------------------------------------------------------------
def _save_step(root, step: int, ck: DistributedCheckpointer | None = None, seed: int = 0) -> dict:
    model, opt = B.make(seed + step, "adamw")
    weights = B.params(model)
    (ck or DistributedCheckpointer(keep_last=1)).save(root, get_training_state(model, opt, {}), global_step=step)
    return weights


def test_retention_keeps_a_leased_step_until_the_lease_is_dropped(tmp_path):
    root = str(tmp_path / "root")
    w1 = _save_step(root, 1)
    lease = C.take_lease(root, "global_step_1")  # a reader (load_latest) of step 1 in this process
    assert lease is not None and os.path.exists(lease)
    _save_step(root, 2)
    _save_step(root, 3)
    assert _steps(root) == ["global_step_1", "global_step_3"]  # 2 deleted, leased 1 kept
    B.assert_bitwise(B.params(B.load_fresh(os.path.join(root, "global_step_1"))[0]), w1)
    C.drop_lease(lease)
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
    # a live reader's lease stays; a dead one's (or a file that names no holder) is removed
    assert os.path.exists(lease) == kept


class _CannotRenameForDeletion(FileIO):
    def replace(self, src: str, dst: str) -> None:
        if dst.endswith(".deleting"):
            raise B.oserror(errno.EACCES, src)
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
            raise B.oserror(errno.EROFS, os.fspath(path))
        return real_open(path, mode, *args, **kwargs)

    monkeypatch.setattr(C, "open", read_only_root, raising=False)
    model, opt, state = B.fresh_state()
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
    model, opt, state = B.fresh_state()
    assert _LeaseSweptDuringLoad().load_latest(root, state) == s42
    set_training_state(model, opt, state)
    B.assert_bitwise(B.params(model), template[1][42])
    assert not [n for n in os.listdir(root) if ".lease." in n]


# -- async -----------------------------------------------------------------------------------------
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


# -- extra state -----------------------------------------------------------------------------------
def test_extra_state_skeleton_names_a_key_the_checkpoint_lacks(ckpt):
    _root, _s4, s42 = ckpt
    _m, _o, state = B.fresh_state()
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
    model, opt, state = B.fresh_state()
    DistributedCheckpointer().load(step_dir, state)
    extra = set_training_state(model, opt, state)
    B.assert_bitwise(extra, {"global_step": 7, "epoch": 3, "rng": rng})
    B.assert_bitwise(B.params(model), weights)
    B.assert_bitwise(opt.state_dict(), opt_sd)


def test_plain_dcp_extra_state_without_global_step_is_refused(tmp_path):
    step_dir, _w, _o = _plain_dcp_with_embedded_extra(tmp_path, 7, {"epoch": 3})
    _m, _o2, state = B.fresh_state()
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

    model, opt, state = B.fresh_state()
    with pytest.raises(E.IncompleteCheckpointError) as ei:
        DistributedCheckpointer().load(step_dir, state)
    assert isinstance(ei.value, FileNotFoundError)
    assert os.path.join(step_dir, "extra_state", "extra_state_rank_0.pt") in str(ei.value)
    assert "per-rank extra state missing" in str(ei.value)

    # Damage, not a mismatch: load_latest falls back to the older complete step.
    model, opt, state = B.fresh_state()
    with pytest.warns(UserWarning, match="fall back"):
        assert DistributedCheckpointer().load_latest(root, state) == older[0]
    set_training_state(model, opt, state)
    B.assert_bitwise(B.params(model), older[1])
    assert state["extra_state"] == {"global_step": 3}


def _falls_back_to_step_4(root: str, s4: str, template) -> dict:
    """``load_latest`` warns, falls back to step 4 and restores it bitwise; returns the state."""
    model, opt, state = B.fresh_state()
    with pytest.warns(UserWarning, match="fall back"):
        assert DistributedCheckpointer().load_latest(root, state) == s4
    set_training_state(model, opt, state)
    B.assert_bitwise(B.params(model), template[1][4])
    return state


def test_extra_state_file_not_in_commit_record_is_refused(ckpt, template):
    root, s4, s42 = ckpt
    B.rewrite_commit_record(s42, lambda md: getattr(md, MANIFEST_ATTR)["files"].pop(B.EXTRA_REL))
    assert check_step_dir(s42, root).complete  # nothing the record lists is missing
    _m, _o, state = B.fresh_state()
    with pytest.raises(E.CorruptCheckpointError, match="not listed in the commit record") as ei:
        DistributedCheckpointer().load(s42, state)
    assert os.path.join(s42, B.EXTRA_REL) in str(ei.value)

    assert _falls_back_to_step_4(root, s4, template)["extra_state"] == {"global_step": 4}


@pytest.mark.parametrize("data,match", [
    (B.torch_saved([42, "global_step"]), r"extra state is a list, not a dict"),
    (B.torch_saved(torch.zeros(2)), r"extra state is a Tensor, not a dict"),
    (B.torch_saved({"global_step": 42, "rng": torch.ones(8)})[:200], r"cannot read \(a damaged torch.save zip"),  # cut
    (b"", r"cannot read \(not a torch.save zip archive"),
])
def test_extra_state_file_that_is_not_a_dict_is_corrupt(ckpt, template, data, match):
    root, s4, s42 = ckpt
    B.replace_extra_file(s42, data)
    assert check_step_dir(s42, root).complete
    _m, _o, state = B.fresh_state()
    with pytest.raises(E.CorruptCheckpointError, match=match) as ei:
        DistributedCheckpointer().load(s42, state)
    assert os.path.join(s42, B.EXTRA_REL) in str(ei.value)
    _falls_back_to_step_4(root, s4, template)


def test_extra_state_file_of_garbage_bytes_is_corrupt_not_unsafe(ckpt):
    _root, _s4, s42 = ckpt
    B.replace_extra_file(s42, b"\x00\x13\x37 bit rot, not a pickle \x00")
    _m, _o, state = B.fresh_state()
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
    """A class of the user's own in extra state: refused at save unless trusted there too (a load
    without it could not restore the step), then loaded only by a checkpointer that trusts it."""
    root = tmp_path / "root"
    model, opt = B.make(0, "adamw")
    saved = {"global_step": 5, "sampler": SamplerState(epoch=2, index=17)}
    with pytest.raises(E.ConfigError, match=r"safe_globals=\[") as refused:
        DistributedCheckpointer(extra_state_per_rank=per_rank).save(
            root, get_training_state(model, opt, dict(saved)), global_step=5)
    assert "['sampler']" in str(refused.value) and not os.path.exists(root / "global_step_5")
    DistributedCheckpointer(extra_state_per_rank=per_rank, safe_globals=[SamplerState]).save(
        root, get_training_state(model, opt, dict(saved)), global_step=5)
    step = str(root / "global_step_5")

    _m, _o, state = B.fresh_state()
    with pytest.raises(E.UnsafeCheckpointError, match=r"safe_globals=\[") as ei:
        DistributedCheckpointer(extra_state_per_rank=per_rank).load(step, state)
    assert step in str(ei.value)

    _m, _o, state = B.fresh_state()
    DistributedCheckpointer(extra_state_per_rank=per_rank, safe_globals=[SamplerState]).load(step, state)
    assert state["extra_state"] == saved
    assert type(state["extra_state"]["sampler"]) is SamplerState


def test_destroy_process_group_frees_the_checkpointers_group_and_a_new_world_gets_a_new_one(tmp_path):
    """The checkpointer's own gloo group lives as long as the job's process groups: a strong
    reference kept it to interpreter exit, where destroying a gloo group can abort a rank that
    finished cleanly (seen as ``terminate called without an active exception``, exit -6, in a
    torchrun job); and a job that calls ``init_process_group`` again must get a live group."""
    import gc
    import weakref

    import torch.distributed as dist

    from refckpt.checkpointer import _ckpt_group

    if dist.is_initialized():
        pytest.skip("a default process group is already initialized in this process")
    root, groups = tmp_path / "root", []
    try:
        for step in (2, 4):
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
            model, opt = B.make(step, "adamw")
            DistributedCheckpointer().save(root, get_training_state(model, opt, {"global_step": step}),
                                           global_step=step)
            group = _ckpt_group(DistributedCheckpointer().timeout)
            assert group in dist.distributed_c10d._world.pg_names, "the group in use is a registered, live one"
            groups.append(weakref.ref(group))
            del group
            dist.destroy_process_group()
            gc.collect()
            assert groups[-1]() is None, "refckpt still holds its group after destroy_process_group"
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    _m, _o, state = B.fresh_state()
    assert DistributedCheckpointer().load_latest(root, state) == str(root / "global_step_4")
    assert state["extra_state"]["global_step"] == 4
