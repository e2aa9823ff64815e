"""The injection mechanisms themselves: path roles, the trace of a real save in protocol
order, os-level patching of a checkpointer that does not cooperate (plain DCP), and a
SIGKILL from os-level patching in a real world."""

from __future__ import annotations

import errno
import os
import warnings

import pytest
import torch

from faults.inject import Action, FaultSpec, FaultyIO, patch_os
from faults.points import CRASH_POINTS, Role, classify


@pytest.mark.parametrize(
    "path, dst, role",
    [
        ("/r/.global_step_4.partial/__0_0.safetensors", None, Role.SHARD),
        ("/r/.global_step_4.partial/__1_0.distcp", None, Role.SHARD),
        ("/r/.global_step_4.partial/extra_state/extra_state_rank_3.pt", None, Role.EXTRA_STATE),
        ("/r/.global_step_4.partial/.metadata.tmp", None, Role.COMMIT_TMP),
        ("/r/.global_step_4.partial/.metadata.tmp", "/r/.global_step_4.partial/.metadata", Role.COMMIT),
        ("/r/.global_step_4.partial", "/r/global_step_4", Role.PUBLISH),
        ("/r/.latest_checkpoint_iteration.txt.tmp.77", None, Role.POINTER_TMP),
        ("/r/.latest_checkpoint_iteration.txt.tmp.77", "/r/latest_checkpoint_iteration.txt", Role.POINTER),
        ("/r/global_step_2", "/r/.global_step_2.deleting", Role.RETENTION),
        ("/r/.global_step_4.partial", None, Role.STAGING),
        ("/r/notes.txt", None, Role.OTHER),
    ],
)
def test_classify(path, dst, role):
    assert classify(path, dst) == role


def _tiny_state(step: int):
    from refckpt import get_training_state

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return get_training_state(model, opt, {"global_step": step})


def test_trace_of_a_real_save_follows_the_protocol(tmp_path):
    """The order refckpt's durability rests on, read off the operations it really performed."""
    from refckpt import DistributedCheckpointer

    trace: list = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        DistributedCheckpointer(io=FaultyIO(None, 0, trace), keep_last=1).save(tmp_path, _tiny_state(1), global_step=1)
        DistributedCheckpointer(io=FaultyIO(None, 0, trace), keep_last=1).save(tmp_path, _tiny_state(2), global_step=2)
    ops = [(op, role) for op, role, _ in trace]
    second = ops[len(ops) // 2:]
    pos = {k: second.index(k) for k in [("fsync", "shard"), ("fsync", "extra_state"), ("replace", "commit"),
                                         ("replace", "publish"), ("replace", "pointer"), ("replace", "retention")]}
    assert pos[("fsync", "extra_state")] < pos[("fsync", "shard")] < pos[("replace", "commit")]
    assert pos[("replace", "commit")] < pos[("replace", "publish")] < pos[("replace", "pointer")] < pos[("replace", "retention")]
    # every rename is followed by an fsync of its directory before the next step depends on it
    for i, (op, role) in enumerate(second):
        if op == "replace" and role in ("commit", "publish", "pointer"):
            assert second[i + 1] == ("fsync_dir", role), (i, second[i:i + 3])
    # and every crash point of the vocabulary is reachable in a save like this one
    reachable = set(ops)
    for p in CRASH_POINTS:
        if p.op != "mark" and not p.needs_retention:
            assert (p.op, str(p.role)) in reachable, p.name


def test_patch_os_injects_into_plain_dcp(tmp_path):
    """A checkpointer that does not cooperate: ENOSPC from os.fsync of a .distcp shard."""
    import torch.distributed.checkpoint as dcp

    spec = FaultSpec("fsync", str(Role.SHARD), "before", Action.ENOSPC, (0,), name="enospc@shard")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with patch_os(spec, 0) as trigger, pytest.raises(BaseException) as info:
            dcp.save({"w": torch.ones(3)}, checkpoint_id=str(tmp_path / "c"), no_dist=True)
    assert trigger.fired
    assert "No space left" in str(info.value) or str(errno.ENOSPC) in str(info.value)
    assert os.fsync.__module__ in ("os", "posix", "nt")  # restored


def test_patch_os_unpatched_after_error(tmp_path):
    spec = FaultSpec("replace", str(Role.POINTER), "before", Action.EIO, (0,))
    orig = (os.fsync, os.replace, os.rename)
    (tmp_path / "x").write_text("1\n")
    with pytest.raises(OSError) as info, patch_os(spec, 0):
        os.replace(tmp_path / "x", tmp_path / "latest_checkpoint_iteration.txt")
    assert info.value.errno == errno.EIO
    assert (os.fsync, os.replace, os.rename) == orig
    assert (tmp_path / "x").exists(), "the fault fired before the rename, so nothing moved"


def test_patch_os_sigkill_in_a_real_world(tmp_path, world_factory):
    """SIGKILL through os-level patching (no cooperation from the checkpointer) just before the
    coordinator renames the commit record into place: resume lands on the previous step."""
    from faults.world import RankDied, run_world
    from tests import _ckpt_fns as fns

    with pytest.raises(RankDied) as info:
        run_world(fns.save_with_os_kill, 2, str(tmp_path), start_method="forkserver", timeout=60)
    assert info.value.rank == 0 and info.value.signal == "SIGKILL"
    out = world_factory.get(2).run(fns.resume, str(tmp_path))
    assert [r["path"] for r in out] == [str(tmp_path / "global_step_2")] * 2
    assert all(r["step"] == 2 for r in out)
