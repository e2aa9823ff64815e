"""A caller's mistake is never reported as checkpoint corruption (issue 17, point 3).

Loading into a state that cannot receive the checkpoint -- tensors on the ``meta`` device, two
entries sharing memory that the checkpoint holds apart, a dtype or a shape that differs -- raises
a :class:`~refckpt.errors.StateMismatchError` (a :class:`~refckpt.errors.CallerError`) that names
the keys and the fix, once, on every rank: no "ALL ranks fall back" warning, no walk to older
steps, no "restore one from a copy", and the root is left as it was and loads afterwards, bitwise.
Entries tied in the loader *and* the saver load fine, and so do disjoint views of one buffer.

In one process (small ``nn.Module`` s, real files), and in reused 2-rank gloo worlds with
:mod:`faults.training`'s run: a bad state on one rank only makes every rank raise the same error
(including a tie found only after reading, which needs its own agreement), and FSDP2 (DTensor)
states tied in both saver and loader load bitwise.
"""

from __future__ import annotations

import logging
import os
import warnings

import pytest
import torch

from refckpt import DistributedCheckpointer
from refckpt import errors as E
from tests import _builders as B
from tests import _caller_fns as fns

pytestmark = pytest.mark.usefixtures("quiet_single_process_warnings")


class Pair(torch.nn.Module):
    """Two same-shaped weights; ``tied`` makes ``b.weight`` the Parameter of ``a.weight``."""

    def __init__(self, tied: bool = False, dtype: torch.dtype = torch.float32, width: int = 3) -> None:
        super().__init__()
        self.a = torch.nn.Linear(width, 3, bias=False, dtype=dtype)
        self.b = torch.nn.Linear(width, 3, bias=False, dtype=dtype)
        if tied:
            self.b.weight = self.a.weight


def _save_two_steps(root, tied: bool = False) -> dict[int, dict[str, torch.Tensor]]:
    """Steps 1 and 2 of a ``Pair`` (values differ per step and, untied, between a and b)."""
    saved = {}
    for step in (1, 2):
        torch.manual_seed(step)
        model = Pair(tied)
        DistributedCheckpointer().save(root, {"model": model.state_dict(), "extra_state": {"global_step": step}},
                                       global_step=step)
        saved[step] = B.params(model)
    return saved


def _tree(root) -> dict[str, tuple[int, int]]:
    """Every file under ``root``: (size, mtime_ns). A lease taken and dropped leaves no file."""
    out = {}
    for d, _, files in os.walk(root):
        for f in files:
            st = os.stat(os.path.join(d, f))
            out[os.path.relpath(os.path.join(d, f), root)] = (st.st_size, st.st_mtime_ns)
    return out


def _refused(root, state: dict, caplog) -> E.CheckpointError:
    """``load_latest(root, state)`` must raise a caller error, not corruption, with no fallback
    (no warning, no error log), leave every file of the root as it was, and step 2 must still
    load bitwise afterwards."""
    before = _tree(root)
    with warnings.catch_warnings(record=True) as caught, caplog.at_level(logging.WARNING, logger="refckpt"):
        warnings.simplefilter("always")
        with pytest.raises(E.CheckpointError) as ei:
            DistributedCheckpointer().load_latest(root, state)
    err = ei.value
    assert isinstance(err, E.StateMismatchError) and isinstance(err, E.CallerError), repr(err)
    assert not isinstance(err, E.CorruptCheckpointError), repr(err)
    assert "restore one from a copy" not in str(err)
    assert os.path.join(str(root), "global_step_2") in str(err), "the error names the step it refused"
    assert not [w for w in caught if "fall back" in str(w.message)], [str(w.message) for w in caught]
    assert not [r for r in caplog.records if "fall back" in r.getMessage() or "skipping" in r.getMessage()]
    assert _tree(root) == before, "a refused load changed the root"
    return err


def _loads_step_2(root, saved) -> None:
    torch.manual_seed(99)
    model = Pair()
    state = {"model": model.state_dict(), "extra_state": {}}
    assert DistributedCheckpointer().load_latest(root, state) == os.path.join(str(root), "global_step_2")
    B.assert_bitwise(B.params(model), saved[2], "step 2 after the refusal")
    assert state["extra_state"] == {"global_step": 2}


def test_meta_tensors_are_refused_as_the_callers_not_as_corruption(tmp_path, caplog):
    saved = _save_two_steps(tmp_path)
    with torch.device("meta"):
        model = Pair()
    err = _refused(tmp_path, {"model": model.state_dict()}, caplog)
    msg = str(err)
    assert "meta device" in msg and "'model.a.weight'" in msg and "'model.b.weight'" in msg, msg
    assert "Materialise the model first" in msg and "to_empty" in msg, msg
    _loads_step_2(tmp_path, saved)


def test_meta_tensors_refused_by_load_too(tmp_path):
    """``load`` of one step directory: the same caller error (was a CorruptCheckpointError wrapping
    DCP's 'Default process group has not been initialized')."""
    _save_two_steps(tmp_path)
    with torch.device("meta"):
        model = Pair()
    with pytest.raises(E.StateMismatchError, match="meta device"):
        DistributedCheckpointer().load(tmp_path / "global_step_1", {"model": model.state_dict()})


def test_tied_in_the_loader_but_not_the_saver_is_refused_naming_both_keys(tmp_path, caplog):
    saved = _save_two_steps(tmp_path)
    model = Pair(tied=True)
    err = _refused(tmp_path, {"model": model.state_dict()}, caplog)
    msg = str(err)
    assert "'model.a.weight' and 'model.b.weight'" in msg and "share storage" in msg, msg
    assert "untied" in msg, msg
    _loads_step_2(tmp_path, saved)


def test_tied_in_saver_and_loader_loads(tmp_path):
    saved = _save_two_steps(tmp_path, tied=True)
    torch.manual_seed(99)
    model = Pair(tied=True)
    assert DistributedCheckpointer().load_latest(tmp_path, {"model": model.state_dict()}) is not None
    assert model.a.weight is model.b.weight
    B.assert_bitwise(B.params(model), saved[2])


def test_overlapping_views_that_are_not_one_tensor_are_refused(tmp_path, caplog):
    saved = _save_two_steps(tmp_path)
    buf = torch.zeros(12)
    state = {"model": {"a.weight": buf[:9].view(3, 3), "b.weight": buf[3:].view(3, 3)}}
    msg = str(_refused(tmp_path, state, caplog))
    assert "'model.a.weight' and 'model.b.weight' overlap in memory" in msg, msg
    assert not buf.any(), "nothing was read into a refused state"
    _loads_step_2(tmp_path, saved)


def test_disjoint_views_of_one_buffer_load(tmp_path):
    """Column blocks of one fused buffer share a storage and their byte spans interleave, but no
    element: not aliasing (the exact overlap check, not the span one)."""
    saved = _save_two_steps(tmp_path)
    fused = torch.zeros(3, 6)
    state = {"model": {"a.weight": fused[:, :3], "b.weight": fused[:, 3:]}}
    DistributedCheckpointer().load_latest(tmp_path, state)
    B.assert_bitwise(fused[:, :3].contiguous(), saved[2]["a.weight"])
    B.assert_bitwise(fused[:, 3:].contiguous(), saved[2]["b.weight"])


def test_wrong_dtype_is_refused_not_cast(tmp_path, caplog):
    saved = _save_two_steps(tmp_path)
    model = Pair(dtype=torch.float64)
    msg = str(_refused(tmp_path, {"model": model.state_dict()}, caplog))
    assert isinstance(_refused(tmp_path, {"model": model.state_dict()}, caplog), E.ShapeMismatchError)
    assert "'model.a.weight': checkpoint float32 (3, 3), state float64 (3, 3)" in msg, msg
    assert not model.a.weight.detach().eq(saved[2]["a.weight"].double()).all(), "the values were cast in"
    _loads_step_2(tmp_path, saved)


def test_wrong_shape_is_refused(tmp_path, caplog):
    saved = _save_two_steps(tmp_path)
    err = _refused(tmp_path, {"model": Pair(width=4).state_dict()}, caplog)
    assert isinstance(err, E.ShapeMismatchError)
    assert "'model.a.weight': checkpoint float32 (3, 3), state float32 (3, 4)" in str(err), str(err)
    _loads_step_2(tmp_path, saved)


def test_partial_optimizer_state_and_non_tensor_entries_still_load(tmp_path):
    """The checks skip what the load does not fill: optimizer state of a parameter that never had a
    gradient (absent from the checkpoint, kept at zero with a warning) and non-tensor entries
    (param groups, extra state)."""
    cfg = fns.config(unused=True)
    fns.save_steps(str(tmp_path), cfg, (2,))
    run = fns.TrainRun(cfg)
    state = run.state(target=True)
    with pytest.warns(UserWarning, match="absent from the checkpoint"):
        DistributedCheckpointer().load_latest(tmp_path, state)
    run.apply(state)
    assert run.step == 2 and run.digest() == fns.reference_digest(cfg, 2)


def test_error_hierarchy():
    for cls in (E.StateMismatchError, E.ShapeMismatchError, E.MissingKeysError, E.MissingTrainingStateError,
                E.ConfigError):
        assert issubclass(cls, E.CallerError) and issubclass(cls, E.CheckpointError), cls
    assert issubclass(E.StateMismatchError, ValueError) and not issubclass(E.CorruptCheckpointError, E.CallerError)


# -- 2-rank worlds ----------------------------------------------------------------------------
@pytest.mark.parametrize("case,bad_ranks", [
    ("meta", (1,)),
    ("tied", (1,)),     # found after the read: every rank must still raise it
    ("tied", (0, 1)),
    ("dtype", (0,)),
    ("shape", (0, 1)),
])
def test_a_bad_state_on_some_ranks_raises_on_every_rank_without_fallback(world_factory, tmp_path, case, bad_ranks):
    world = world_factory.get(2)
    world.run(fns.save_steps, str(tmp_path), fns.SAVED)
    before = _tree(tmp_path)
    results = world.run(fns.attempt, str(tmp_path), case, bad_ranks)
    want = {"meta": "StateMismatchError", "tied": "StateMismatchError",
            "dtype": "ShapeMismatchError", "shape": "ShapeMismatchError"}[case]
    messages = {r["message"] for r in results}
    assert len(messages) == 1, f"ranks raised different errors: {results}"
    for rank, r in enumerate(results):
        assert r["error"] == want and not r["corrupt"] and "CallerError" in r["mro"], (rank, r)
        assert str(tmp_path / "global_step_2") in r["message"] and "restore one from a copy" not in r["message"]
        assert not r["fallbacks"], (rank, r["fallbacks"])
        assert r["resumed"] == str(tmp_path / "global_step_2") and r["step"] == 2 and r["exact"], (rank, r)
    msg = results[0]["message"]
    if case == "tied":
        assert "'model.embed.weight' and 'model.head.weight'" in msg and f"found on rank {bad_ranks[0]}" in msg, msg
    if case == "meta":
        assert "meta device" in msg and "'model.embed.weight'" in msg, msg
    if case in ("dtype", "shape"):
        assert "'model.out.weight'" in msg, msg
    assert _tree(tmp_path) == before, "a refused load changed the root"


def test_fsdp2_tied_in_the_loader_only_is_refused_on_every_rank(world_factory, tmp_path):
    world = world_factory.get(2)
    world.run(fns.save_steps, str(tmp_path), fns.config("fsdp2"))
    results = world.run(fns.attempt, str(tmp_path), "tied", (0, 1), "fsdp2")
    for rank, r in enumerate(results):
        assert r["error"] == "StateMismatchError" and "'model.embed.weight' and 'model.head.weight'" in r["message"]
        assert not r["fallbacks"] and r["resumed"] == str(tmp_path / "global_step_2") and r["exact"], (rank, r)


@pytest.mark.parametrize("sharding", ["replicated", "fsdp2"])
def test_tied_in_saver_and_loader_loads_at_two_ranks(world_factory, tmp_path, sharding):
    for rank, r in enumerate(world_factory.get(2).run(fns.tied_both, str(tmp_path), sharding)):
        assert r["path"] == str(tmp_path / "global_step_2") and r["exact"] and r["still_tied"], (rank, r)
