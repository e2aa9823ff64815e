"""A load fills the caller's state completely from one step, or leaves it exactly as it was
(docs/design.md, "Load": the transaction).

The defects these pin (issue 25): the read path filled the caller's tensors as it read them and
compared the checksums at the end, so a damaged newest step had already written into the state when
``load_latest`` fell back, and every entry the older step does not hold (here: Adam's moments of a
branch that had no gradient yet at step 1) resumed with the *newer* step's values; a caller's
mistake (``None`` or an ``expand()``ed tensor where a tensor was saved) ended as "corrupt"; a
checkpoint saved with ``checksums=False`` ignored the checksums it does record.

Every test compares with values kept before the call (``clone_tree``) or saved by the run itself,
never with what the checkpointer reports."""

from __future__ import annotations

import os
import warnings

import pytest
import torch

from refckpt import DistributedCheckpointer, get_training_state
from refckpt import errors as E
from refckpt.interop import RankRecordReader
from refckpt.tools.cli import main as cli_main
from tests import _builders as B
from tests import _txn_fns as T

pytestmark = pytest.mark.usefixtures("quiet_single_process_warnings")

SHARD = B.SHARD


def _load_latest(root, state, **kwargs):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        path = DistributedCheckpointer().load_latest(root, state, **kwargs)
    return path, [str(w.message) for w in caught if "fall back" in str(w.message)]


@pytest.mark.parametrize("where", ["late_moment", "first_tensor", "extra_state"])
def test_fallback_starts_from_the_callers_original_state(tmp_path, where):
    """Step 2 damaged (a bit in the late branch's moment, in the shard's first tensor, or in the extra
    state): load_latest falls back to step 1, and the state is step 1's entries over the values it
    had before the call, bitwise -- the late branch's moments keep their pre-load 0.25, not step 2's."""
    root = str(tmp_path)
    saved = T.save_two_steps(root)
    step2 = os.path.join(root, "global_step_2")
    shard = os.path.join(step2, SHARD)
    if where == "late_moment":
        B.flip_bit(shard, B.item_range(shard, "optimizer.state.late.weight.exp_avg")[0] + 1)
    elif where == "first_tensor":
        start, _header = B.safetensors_header(shard)
        B.flip_bit(shard, start)
    else:
        B.flip_bit(os.path.join(step2, B.EXTRA_REL), 40)
    _model, _opt, state = T.target_state()
    before = B.clone_tree(state)
    path, fallbacks = _load_latest(root, state)
    assert path == os.path.join(root, "global_step_1") and fallbacks
    B.assert_bitwise(state, T.expected_after_fallback(before, saved[1]), "state after the fallback")
    assert (state["optimizer"]["state"]["late.weight"]["exp_avg"] == 0.25).all()


def test_a_failed_load_leaves_every_tensor_and_container_as_it_was(tmp_path):
    """load() of a damaged step raises and changes nothing: tensors, the optimizer's (empty) state
    dict of an unprimed optimizer, non-tensor items and the extra state are as before the call."""
    root = str(tmp_path)
    T.save_two_steps(root)
    shard = os.path.join(root, "global_step_2", SHARD)
    _start, end = B.item_range(shard, "optimizer.state.late.bias.exp_avg_sq")
    B.flip_bit(shard, end - 1)
    model, opt = T.build(5)
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, opt)
    osd = {"state": {}, "param_groups": osd["param_groups"]}  # unprimed: the load would create every moment
    osd["param_groups"][0]["lr"] = 0.5  # saved 1e-2: a non-tensor item the load would set
    state = {"model": msd, "optimizer": osd, "extra_state": {"global_step": -1, "mine": [1, 2]}}
    before = B.clone_tree(state)
    ids = {k: id(v) for k, v in msd.items()}
    with pytest.raises(E.CorruptCheckpointError):
        DistributedCheckpointer().load(os.path.join(root, "global_step_2"), state)
    B.assert_bitwise(state, before, "state after a failed load")
    assert state["optimizer"]["state"] == {}, "the failed load created optimizer entries"
    assert {k: id(v) for k, v in state["model"].items()} == ids


def test_the_load_that_succeeds_fills_an_unprimed_optimizer_and_the_non_tensor_items(tmp_path):
    """The other half of the transaction: a good load commits everything (an unprimed optimizer gets
    every moment, a param-group hyperparameter and the extra state their saved values)."""
    root = str(tmp_path)
    saved = T.save_two_steps(root)
    model, opt = T.build(5)
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, opt)
    osd = {"state": {}, "param_groups": osd["param_groups"]}
    osd["param_groups"][0]["lr"] = 0.5
    state = {"model": msd, "optimizer": osd, "extra_state": {"global_step": -1}}
    DistributedCheckpointer().load(os.path.join(root, "global_step_2"), state)
    B.assert_bitwise(state["model"], saved[2]["model"], "model")
    B.assert_bitwise(state["optimizer"]["state"], saved[2]["optimizer"]["state"], "moments")
    assert state["optimizer"]["param_groups"][0]["lr"] == saved[2]["optimizer"]["param_groups"][0]["lr"]
    assert state["extra_state"] == saved[2]["extra_state"]


def test_no_caller_tensor_is_written_before_every_byte_is_verified(tmp_path, monkeypatch):
    """The mechanism itself: during DCP's read phase (pass 1) none of the caller's tensors changes;
    the bytes go in at the commit only."""
    root = str(tmp_path)
    saved = T.save_two_steps(root)
    _model, _opt, state = T.target_state()
    before = B.clone_tree(state)
    seen = {}
    original = RankRecordReader.commit

    def commit(self):
        seen["at_commit"] = B.clone_tree({"model": state["model"], "optimizer": state["optimizer"]})
        return original(self)

    monkeypatch.setattr(RankRecordReader, "commit", commit)
    DistributedCheckpointer().load(os.path.join(root, "global_step_2"), state)
    B.assert_bitwise(seen["at_commit"]["model"], before["model"], "model before the commit")
    B.assert_bitwise(seen["at_commit"]["optimizer"], before["optimizer"], "optimizer before the commit")
    B.assert_bitwise(state["model"], saved[2]["model"], "model after the commit")


def test_a_file_changed_between_verification_and_commit_is_a_partial_load_and_no_fallback(tmp_path, monkeypatch):
    """The one case the transaction cannot cover: the shard changes in place after pass 1 verified it
    (refckpt never writes a published step; this writes it at exactly that moment). The second check
    catches it: PartialLoadError, which load_latest does not fall back from (the state is a mix)."""
    root = str(tmp_path)
    T.save_two_steps(root)
    shard = os.path.join(root, "global_step_2", SHARD)
    original = RankRecordReader.commit

    def commit(self):
        B.flip_bit(shard, B.item_range(shard, "model.late.weight")[0])
        return original(self)

    monkeypatch.setattr(RankRecordReader, "commit", commit)
    _model, _opt, state = T.target_state()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(E.PartialLoadError) as ei:
            DistributedCheckpointer().load_latest(root, state)
    assert shard in str(ei.value) and "fresh state" in str(ei.value)
    assert not [w for w in caught if "fall back" in str(w.message)]


@pytest.mark.parametrize("how", ["none", "float", "expanded", "string"])
def test_a_destination_that_cannot_hold_the_saved_tensor_is_a_caller_error(tmp_path, how):
    """None, a float or a string where a tensor was saved, or a tensor that overlaps itself
    (expand): a StateMismatchError (a CallerError) naming the key, from load_latest too, with no
    fallback, no "corrupt" in it, and the state as it was."""
    root = str(tmp_path)
    T.save_two_steps(root)
    _model, _opt, state = T.target_state()
    key = "a.bias"
    if how == "none":
        state["model"][key] = None
    elif how == "float":
        state["model"][key] = 1.5
    elif how == "string":
        state["model"][key] = "bias"
    else:
        state["model"][key] = torch.zeros(1).expand(4)
    before = B.clone_tree(state)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(E.StateMismatchError) as ei:
            DistributedCheckpointer().load_latest(root, state)
    assert isinstance(ei.value, E.CallerError) and f"'model.{key}'" in str(ei.value)
    assert "corrupt" not in str(ei.value).lower()
    assert not [w for w in caught if "fall back" in str(w.message)]
    B.assert_bitwise(state, before, "state after a caller error")


def test_tied_destinations_the_checkpoint_holds_apart_change_nothing(tmp_path):
    """Tied in the state to load into, different in the checkpoint: refused (a caller error) after the
    bytes were compared, and before anything of the caller's was written."""
    root = str(tmp_path)
    T.save_two_steps(root)
    _model, _opt, state = T.target_state()
    state["model"]["late.weight"] = state["model"]["a.weight"]  # tied in the state, not in the saver
    before = B.clone_tree(state)
    with pytest.raises(E.StateMismatchError) as ei:
        DistributedCheckpointer().load_latest(root, state)
    assert "'model.a.weight'" in str(ei.value) and "'model.late.weight'" in str(ei.value)
    B.assert_bitwise(state, before, "state after a refused tie")


def test_recorded_checksums_are_verified_when_the_save_said_checksums_false(tmp_path, capsys):
    """checksums=False still records the extra-state file's CRC-32C: a zero-filled 4 KiB range in it
    fails the load (load_latest falls back) and `refckpt verify` names the file."""
    root = str(tmp_path)
    model, opt = T.build()
    ck = DistributedCheckpointer(checksums=False)
    for s in (1, 2):
        T.train_to(model, opt, s - 1, s)
        extra = {"global_step": s, "blob": torch.arange(4096, dtype=torch.int32)}
        ck.save(root, get_training_state(model, opt, extra), global_step=s)
    extra_file = os.path.join(root, "global_step_2", B.EXTRA_REL)
    size = os.path.getsize(extra_file)
    B.patch_bytes(extra_file, size - 6000, bytes(4096))
    _model, _opt, state = T.target_state()
    path, fallbacks = _load_latest(root, state)
    assert path == os.path.join(root, "global_step_1") and fallbacks
    assert state["extra_state"]["global_step"] == 1
    code, out, _err = B.run_main(cli_main, capsys, "verify", os.path.join(root, "global_step_2"))
    assert code == 1 and extra_file in out


@pytest.mark.parametrize("world_size", [2])
@pytest.mark.parametrize("bad_rank", [0, 1])
def test_one_ranks_damage_leaves_every_ranks_state_as_it_was(world_factory, tmp_path, world_size, bad_rank):
    """At 2 gloo ranks, step 2 damaged in one rank's shard only: the other rank verified its own bytes
    but must not commit them; both fall back to step 1 from their original state, bitwise."""
    results = world_factory.get(world_size).run(T.r_fallback_from_one_damaged_rank, str(tmp_path), bad_rank)
    for rank, r in enumerate(results):
        assert "error" not in r, (rank, r)
        assert r["path"] == str(tmp_path / "global_step_1"), (rank, r)
        assert r["fell_back"], (rank, r)
        assert r["mixed"] is None, f"rank {rank}: {r['mixed']}"


class _ModelStateful:
    """DCP's ``Stateful`` protocol (what torchtitan-style trainers put in a state): the load takes its
    ``state_dict()`` and hands the filled one to ``load_state_dict`` at the commit only."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model, self.calls = model, 0

    def state_dict(self):
        return self.model.state_dict()

    def load_state_dict(self, sd) -> None:
        self.calls += 1
        self.model.load_state_dict(sd)


@pytest.mark.filterwarnings("ignore:.*optimizer entries are absent")
def test_a_stateful_value_is_loaded_at_the_commit_and_untouched_by_a_failed_load(tmp_path):
    root = str(tmp_path)
    saved = T.save_two_steps(root)
    model, opt, state = T.target_state()
    wrapper = _ModelStateful(model)
    state["model"] = wrapper
    before = B.clone_tree(model.state_dict())
    shard = os.path.join(root, "global_step_2", SHARD)
    B.flip_bit(shard, B.item_range(shard, "model.a.weight")[0])
    with pytest.raises(E.CorruptCheckpointError):
        DistributedCheckpointer().load(os.path.join(root, "global_step_2"), state)
    assert wrapper.calls == 0
    B.assert_bitwise(model.state_dict(), before, "model after a failed load")
    DistributedCheckpointer().load(os.path.join(root, "global_step_1"), state)
    assert wrapper.calls == 1
    B.assert_bitwise(dict(model.state_dict()), dict(saved[1]["model"]), "model after the load")


def test_pass_one_never_reuses_a_buffer_the_checksum_thread_still_reads(tmp_path, monkeypatch):
    """The read buffers of pass 1 outlive one run of items (another file, or items after a non-tensor
    one): the next run must wait for the checksum thread to be done with a buffer before it reads
    into it. Found by the benchmark at 2 FSDP ranks (a wrong CRC-32C of a good shard); forced here
    by holding every fold until somebody waits for one, with blocks and inline folds made tiny."""
    import threading

    from refckpt.storage import crc as crc_mod
    from refckpt.storage import reader as reader_mod

    root = str(tmp_path)
    saved = T.save_two_steps(root)
    monkeypatch.setattr(reader_mod, "_IO_BLOCK", 64)
    monkeypatch.setattr(reader_mod.SafetensorsReader, "COALESCE_GAP", -1)  # every item a run of its own
    monkeypatch.setattr(crc_mod, "_INLINE_CRC", 1)
    # every fold waits until somebody asks for a future at or after it: the thread lags the reads
    # as far as the reader lets it, so a buffer reused without waiting is still being read
    cond = threading.Condition()
    seen = {"submitted": 0, "released": 0}

    class HeldExecutor(crc_mod.ThreadPoolExecutor):
        def submit(self, fn, /, *args, **kwargs):
            seen["submitted"] += 1
            n = seen["submitted"]

            def job():
                with cond:
                    cond.wait_for(lambda: seen["released"] >= n, timeout=60)
                return fn(*args, **kwargs)

            fut = super().submit(job)
            fut.number = n  # type: ignore[attr-defined]
            return fut

    class Releasing:
        def __init__(self, fut):
            self.fut = fut

        def result(self):
            with cond:
                seen["released"] = max(seen["released"], self.fut.number)
                cond.notify_all()
            return self.fut.result()

    def releasing_fence(self, _orig=crc_mod.CrcPipe.fence):
        fut = _orig(self)
        return None if fut is None else Releasing(fut)

    def results(self, _orig=crc_mod.CrcPipe.results):
        with cond:
            seen["released"] = 1 << 30
            cond.notify_all()
        return _orig(self)

    monkeypatch.setattr(crc_mod, "ThreadPoolExecutor", HeldExecutor)
    monkeypatch.setattr(crc_mod.CrcPipe, "fence", releasing_fence)
    monkeypatch.setattr(crc_mod.CrcPipe, "results", results)
    _model, _opt, state = T.target_state()
    DistributedCheckpointer().load(os.path.join(root, "global_step_2"), state)
    B.assert_bitwise(state["model"], saved[2]["model"], "model")
