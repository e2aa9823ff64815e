"""What the forward guard of a deferred save (``snapshot="deferred"``) covers, and what it does not.

The guard (``refckpt/staging.py``): before the forward of any module, the pending copies of the
buffers registered in the module's subtree are claimed and made on the caller's thread; the
forward waits only for those the background copier is copying right now; ``optimizer.step``
waits for the whole copy. Covered here: a parent that updates a child's running statistics with
``F.batch_norm`` (the issue: BatchNorm's in-kernel update bumps no version counter), a great-
grandchild's statistics, the optimizer step, a module whose subtree owns no pending buffer, and
``DistributedDataParallel``'s buffer broadcast (a 1-rank gloo group in this process), a forward
waiting for a buffer the background is copying right now, and buffers the background copied that
a forward changes, version bumped, once past the guard (BatchNorm's ``num_batches_tracked``, DDP's
broadcast): they are checked when the forward passes them, so the save stands. Outside
the guard, and shown to be so: writes that bypass the version counter, and version-less updates
of a buffer outside the updating module's subtree (an unregistered reference, a closure, the
training loop itself).

Order is made certain, never slept for: the background copy is held at its ``STAGING`` mark by
a gate (``GateIO``) until the test has done what must land first, or held inside the copy of one
buffer by an event; a guard is seen waiting through an event set when it starts to wait. A
training call that must not wait runs on a thread joined with a bound (``TIMEOUT``): a guard
that waited for the gate would still be waiting then.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from refckpt import DistributedCheckpointer, get_training_state, set_training_state
from refckpt.staging import DeferredCopy
from tests._deferred_fns import GateIO, digest, hooks, resumed_digest
from tests._deferred_fns import build as build_sequential

pytestmark = pytest.mark.usefixtures("quiet_single_process_warnings")

TIMEOUT = 60  # a bound on a wait that must end (a failure when hit), never a synchronisation
STATS = ("running_mean", "running_var", "num_batches_tracked")


class Box(nn.Module):
    """A container whose forward is never called."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner


class Net(nn.Module):
    """The issue's model: the forward normalizes with a CHILD's running statistics through
    ``F.batch_norm(..., training=True)`` (which updates them in place, without a version bump);
    the BatchNorm module's own forward never runs. ``deep``: the BatchNorm is a great-grandchild
    (``stats.inner.inner.inner``) instead of a child (``bn``)."""

    def __init__(self, deep: bool = False) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 6)
        if deep:
            self.stats = Box(Box(Box(nn.BatchNorm1d(6))))
        else:
            self.bn = nn.BatchNorm1d(6)
        self.out = nn.Linear(6, 3)

    def norm(self) -> nn.BatchNorm1d:
        m = self.stats.inner.inner.inner if hasattr(self, "stats") else self.bn
        assert isinstance(m, nn.BatchNorm1d)
        return m

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bn = self.norm()
        h = F.batch_norm(self.lin(x), bn.running_mean, bn.running_var, bn.weight, bn.bias, training=True)
        return self.out(torch.tanh(h))


def build(seed: int = 0, deep: bool = False) -> tuple[Net, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = Net(deep)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def batch(i: int) -> torch.Tensor:
    return torch.randn(5, 4, generator=torch.Generator().manual_seed(1000 + i))


def forward_backward(model: nn.Module, opt: torch.optim.Optimizer, i: int) -> None:
    opt.zero_grad(set_to_none=True)
    model(batch(i)).pow(2).mean().backward()


def train(model: nn.Module, opt: torch.optim.Optimizer, steps: range) -> None:
    for i in steps:
        forward_backward(model, opt, i)
        opt.step()


def bn_keys(model: Net, prefix: str = "model/") -> set[str]:
    name = next(n for n, m in model.named_modules() if m is model.norm())
    return {f"{prefix}{name}.{s}" for s in STATS}


def bounded(fn: Callable[[], object]) -> tuple[bool, list[BaseException]]:
    """Run ``fn`` on a thread joined with a bound: (whether it ended, what it raised)."""
    errors: list[BaseException] = []

    def run() -> None:
        try:
            fn()
        except BaseException as e:  # noqa: BLE001 - reported by the test
            errors.append(e)

    t = threading.Thread(target=run, name="test-training")
    t.start()
    t.join(TIMEOUT)
    return not t.is_alive(), errors


def loaded(ck: DistributedCheckpointer, root: str, deep: bool = False) -> tuple[dict[str, str], Net,
                                                                               torch.optim.Optimizer]:
    """Fresh objects (another seed: nothing leaks through), the newest step loaded and applied."""
    model, opt = build(5, deep)
    state = get_training_state(model, opt, {})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ck.load_latest(root, state)
    set_training_state(model, opt, state)
    return digest(model, opt), model, opt


@pytest.fixture
def waits(monkeypatch):
    """Every wait of a guard, by kind (``"step"``: the whole copy, ``"forward"``: some buffers'
    copies), and an event set the moment one starts."""
    started = threading.Event()
    seen: list[str] = []
    whole, some = DeferredCopy.wait, DeferredCopy._wait_for_jobs

    def wait(self):
        seen.append("step")
        started.set()
        whole(self)

    def wait_for_jobs(self, jobs):
        seen.append("forward")
        started.set()
        some(self, jobs)

    monkeypatch.setattr(DeferredCopy, "wait", wait)
    monkeypatch.setattr(DeferredCopy, "_wait_for_jobs", wait_for_jobs)
    return started, seen


class Saved:
    """A model trained 3 steps, then a deferred save of step 3 whose copy is held at the gate."""

    def __init__(self, root: str, deep: bool = False) -> None:
        self.root, self.deep = root, deep
        self.model, self.opt = build(0, deep)
        train(self.model, self.opt, range(1, 4))
        self.at_call = digest(self.model, self.opt)
        self.hooks = hooks()
        self.gate = threading.Event()
        self.ck = DistributedCheckpointer(io=GateIO(self.gate))
        self.ck.save(root, get_training_state(self.model, self.opt, {"global_step": 3}), global_step=3,
                     save_async=True, snapshot="deferred")
        assert self.ck._deferred is not None
        self.copy: DeferredCopy = self.ck._deferred

    def finish(self) -> dict[str, str]:
        """Open the gate, wait for the save (acknowledged), the loaded step's digest."""
        self.gate.set()
        self.ck.maybe_wait_for_async_save()
        assert hooks() == self.hooks
        return loaded(self.ck, self.root, self.deep)[0]

    def close(self) -> None:
        self.gate.set()
        self.ck.close()


@pytest.fixture
def saved(tmp_path, request):
    s = Saved(str(tmp_path), deep=getattr(request, "param", False))
    yield s
    s.close()


# -- what the guard covers -----------------------------------------------------------------------------
@pytest.mark.parametrize("saved", [False, True], ids=["child", "great_grandchild"], indirect=True)
def test_a_forward_updating_a_descendants_statistics_claims_them_without_waiting(saved, waits):
    """The issue (and its deep variant): right after the save, with the copy held at the gate, the
    forward that updates a (great-grand)child's running statistics through ``F.batch_norm`` ends
    without waiting -- it copied the statistics itself, first. The acknowledged step holds the
    statistics of the call (cloned before the forward), bitwise the values at the call, and training
    continued from it equals training continued in place."""
    _started, seen = waits
    model, opt = saved.model, saved.opt
    bn = model.norm()
    before = {s: getattr(bn, s).clone() for s in STATS}
    ended, errors = bounded(lambda: forward_backward(model, opt, 4))
    assert ended, "the forward waited for the gated copy"
    assert not errors, errors
    assert not torch.equal(bn.running_mean, before["running_mean"]), "the forward did not update the statistics"
    assert not saved.copy.done
    loaded_digest = saved.finish()
    model2, opt2 = loaded(saved.ck, saved.root, saved.deep)[1:]
    for s in STATS:
        assert torch.equal(getattr(model2.norm(), s), before[s]), f"the step holds {s} from after the call"
    assert loaded_digest == saved.at_call
    assert seen == [], "the forward waited"
    assert sorted(saved.copy.claimed) == sorted(k.replace("model/", "model.") for k in bn_keys(model))
    opt.step()
    train(model, opt, range(5, 7))
    train(model2, opt2, range(4, 7))
    assert digest(model2, opt2) == digest(model, opt)


def test_the_optimizer_step_still_waits_for_the_whole_copy(saved, waits):
    """Forward and backward run at once (the statistics claimed); ``optimizer.step`` waits until
    the whole copy has ended -- it sees it ended when it starts -- and changes nothing before."""
    started, seen = waits
    model, opt = saved.model, saved.opt
    forward_backward(model, opt, 4)
    at_step: list[bool] = []
    opt.register_step_pre_hook(lambda *_: at_step.append(saved.copy.done))  # runs after the global guard
    trainer = threading.Thread(target=opt.step, name="test-step")
    trainer.start()
    try:
        assert started.wait(TIMEOUT), "optimizer.step did not wait"
        assert seen == ["step"] and trainer.is_alive() and at_step == []
        now = digest(model, opt)
        running = {k for k in bn_keys(model) if "num_batches_tracked" not in k}  # F.batch_norm leaves the count
        assert {k for k in now if now[k] != saved.at_call[k]} == running, "the step ran before the copy"
    finally:
        saved.gate.set()
        trainer.join(TIMEOUT)
    assert not trainer.is_alive()
    assert at_step == [True], "the step ran before the whole copy had ended"
    assert saved.finish() == saved.at_call


def test_a_forward_whose_subtree_owns_no_pending_buffer_neither_claims_nor_waits(saved, waits):
    """A module without buffers (a Linear), a module whose buffers are not saved, and -- once the
    statistics are copied -- the model itself: no claim, no wait, the gated copy still pending."""
    _started, seen = waits
    model = saved.model
    unsaved = nn.BatchNorm1d(6)
    ended, errors = bounded(lambda: (model.lin(batch(4)), unsaved(torch.randn(5, 6))))
    assert ended and not errors, errors
    assert saved.copy.claimed == [] and seen == []
    ended, errors = bounded(lambda: model(batch(5)))
    assert ended and not errors, errors
    claimed = list(saved.copy.claimed)
    assert len(claimed) == len(STATS)
    ended, errors = bounded(lambda: (model(batch(6)), model.norm()(torch.randn(5, 6))))
    assert ended and not errors, errors
    assert saved.copy.claimed == claimed and seen == [], "claimed or waited for buffers already copied"
    assert not saved.copy.done
    saved.finish()


def test_a_forward_waits_for_a_buffer_the_background_is_copying_right_now(tmp_path, waits, monkeypatch):
    """The background copier holds the copy of the running mean (an event keeps it inside that
    copy); the model's forward claims the statistics still pending, waits for the running mean
    only, and runs once that copy has ended. The step holds the values at the call."""
    started, seen = waits
    model, opt = build(0)
    train(model, opt, range(1, 4))
    at_call = digest(model, opt)
    held, release = _hold_the_copy_of(monkeypatch, model.norm().running_mean)
    ck = DistributedCheckpointer()
    try:
        ck.save(str(tmp_path), get_training_state(model, opt, {"global_step": 3}), global_step=3, save_async=True,
                snapshot="deferred")
        assert held.wait(TIMEOUT), "the background copier never copied the running mean"
        trainer = threading.Thread(target=forward_backward, args=(model, opt, 4), name="test-forward")
        trainer.start()
        try:
            assert started.wait(TIMEOUT), "the forward did not wait for the copy in progress"
            assert seen == ["forward"] and trainer.is_alive()
            assert ck._deferred is not None
            assert sorted(ck._deferred.claimed) == ["model.bn.num_batches_tracked", "model.bn.running_var"]
            assert digest(model, opt) == at_call, "the forward ran before the copy it waits for"
        finally:
            release.set()
            trainer.join(TIMEOUT)
        assert not trainer.is_alive()
        ck.maybe_wait_for_async_save()
        assert loaded(ck, str(tmp_path))[0] == at_call
    finally:
        release.set()
        ck.close()


def _hold_the_copy_of(monkeypatch, tensor: torch.Tensor) -> tuple[threading.Event, threading.Event]:
    """Keep the background copier inside its copy of ``tensor`` (copied, not yet marked done)
    until the second event is set; the first is set once it is there."""
    held, release = threading.Event(), threading.Event()
    finish = DeferredCopy._finish
    ptr = tensor.untyped_storage().data_ptr()

    def hold(self, jobs):
        if any(j.src.untyped_storage().data_ptr() == ptr for j in jobs):
            held.set()
            if not release.wait(TIMEOUT):
                raise TimeoutError("the test never released the copy")
        finish(self, jobs)

    monkeypatch.setattr(DeferredCopy, "_finish", hold)
    return held, release


@pytest.fixture
def one_rank_group():
    """A 1-rank gloo default process group in this process (a HashStore: no port, no file)."""
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a default process group is already initialized in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _ddp(monkeypatch) -> tuple[nn.parallel.DistributedDataParallel, torch.optim.Optimizer, list[int]]:
    """A DDP-wrapped model with BatchNorm trained 2 steps, its optimizer, and the sizes of the
    buffer broadcasts its forwards made since. With one rank a broadcast changes nothing, so rank
    0's values are played by a stand-in that writes new ones (+100), as a broadcast does on another
    rank, inside DDP's ``_unsafe_preserve_version_counter`` (no version bump once it ends)."""
    torch.manual_seed(0)
    inner = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Tanh(), nn.Linear(6, 3))
    ddp = nn.parallel.DistributedDataParallel(inner)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    train(ddp, opt, range(1, 3))
    broadcasts: list[int] = []

    def broadcast(bufs, bucket_size, authoritative_rank):
        broadcasts.append(len(bufs))
        for b in bufs:
            b.add_(100)

    monkeypatch.setattr(ddp, "_distributed_broadcast_coalesced", broadcast)
    return ddp, opt, broadcasts


def _ddp_loaded_stats(ck: DistributedCheckpointer, root: str) -> dict[str, torch.Tensor]:
    model = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Tanh(), nn.Linear(6, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    state = get_training_state(model, opt, {})
    ck.load_latest(root, state)
    set_training_state(model, opt, state)
    return {s: getattr(model[1], s) for s in STATS}


@pytest.mark.parametrize("held", [False, True], ids=["claims", "waits"])
def test_ddp_broadcast_of_buffers_lands_after_their_copy(tmp_path, waits, monkeypatch, one_rank_group, held):
    """DistributedDataParallel broadcasts rank 0's buffers into the wrapped module's before its
    forward, without a version bump. The DDP module's own subtree owns the buffers: its forward
    claims them (the copy held at the gate) or waits for the one being copied right now (the
    background held inside that copy) before the broadcast; the step holds the values at the call."""
    started, seen = waits
    ddp, opt, broadcasts = _ddp(monkeypatch)
    bn = ddp.module[1]
    at_call = {s: getattr(bn, s).clone() for s in STATS}
    if held:
        hold, release = _hold_the_copy_of(monkeypatch, bn.running_mean)
    gate = threading.Event()
    ck = DistributedCheckpointer(io=GateIO(None if held else gate))
    try:
        ck.save(str(tmp_path), get_training_state(ddp, opt, {"global_step": 2}), global_step=2, save_async=True,
                snapshot="deferred")
        assert ck._deferred is not None
        copy = ck._deferred
        if held:
            assert hold.wait(TIMEOUT), "the background copier never copied the running mean"
            trainer = threading.Thread(target=forward_backward, args=(ddp, opt, 3), name="test-ddp")
            trainer.start()
            try:
                assert started.wait(TIMEOUT), "the DDP forward did not wait for the copy in progress"
                assert seen == ["forward"] and trainer.is_alive() and broadcasts == []
            finally:
                release.set()
                trainer.join(TIMEOUT)
            assert not trainer.is_alive()
        else:
            ended, errors = bounded(lambda: forward_backward(ddp, opt, 3))
            assert ended and not errors, errors
            assert seen == []
            assert sorted(copy.claimed) == sorted(f"model.1.{s}" for s in STATS)
        assert broadcasts and float(bn.running_var.min()) > 50, "the stand-in broadcast did not run"
        gate.set()
        ck.maybe_wait_for_async_save()
        got = _ddp_loaded_stats(ck, str(tmp_path))
        for s in STATS:
            assert torch.equal(got[s], at_call[s]), s
    finally:
        gate.set()
        if held:
            release.set()
        ck.close()


def test_buffers_the_background_copied_may_change_once_a_forward_let_them_through(tmp_path, waits, monkeypatch):
    """The background copier has copied the BatchNorm buffers and is held inside the copy of a
    later tensor (before the version check). The model's forward neither claims nor waits; the
    BatchNorm forward then bumps ``num_batches_tracked``'s version (``add_(1)``) before the check.
    That change came after the copy, through the guard: the save is acknowledged, holding the
    values at the call (the buffers are checked when the forward passes them, not at the end)."""
    _started, seen = waits
    model, opt = build_sequential(0)
    train(model, opt, range(1, 4))
    at_call = digest(model, opt)
    hold, release = _hold_the_copy_of(monkeypatch, model[3].weight)  # after every buffer, in the state's order
    ck = DistributedCheckpointer()
    try:
        ck.save(str(tmp_path), get_training_state(model, opt, {"global_step": 3}), global_step=3, save_async=True,
                snapshot="deferred")
        assert hold.wait(TIMEOUT), "the background copier never reached the last layer"
        version = model[1].num_batches_tracked._version
        ended, errors = bounded(lambda: forward_backward(model, opt, 4))
        assert ended and not errors, errors
        assert model[1].num_batches_tracked._version != version, "the BatchNorm forward bumped no version"
        assert ck._deferred is not None and ck._deferred.claimed == [] and seen == []
        release.set()
        ck.maybe_wait_for_async_save()
        assert resumed_digest(str(tmp_path), ck)[1] == at_call
    finally:
        release.set()
        ck.close()


def test_ddp_broadcast_may_bump_a_copied_buffers_version_while_the_copy_is_checked(tmp_path, monkeypatch,
                                                                                   one_rank_group):
    """DDP's broadcast writes the buffers inside ``_unsafe_preserve_version_counter``: their versions
    are bumped until it ends. The background copier has copied the buffers and is held inside the
    copy of a later tensor; the stand-in broadcast, with the versions bumped, lets the copy go on
    and waits until it has ended -- version check included. The save is acknowledged, holding the
    values at the call: the buffers were checked when the DDP forward passed them."""
    ddp, opt, _broadcasts = _ddp(monkeypatch)
    inner = ddp.module
    at_call = {s: getattr(inner[1], s).clone() for s in STATS}
    hold, release = _hold_the_copy_of(monkeypatch, inner[3].weight)  # after every buffer, in the state's order
    ck = DistributedCheckpointer()
    ended_inside: list[bool] = []

    def broadcast_then_let_the_copy_end(bufs, bucket_size, authoritative_rank):
        for b in bufs:
            b.add_(100)  # bumps the version, restored when DDP's context ends
        release.set()
        assert ck._deferred is not None
        ck._deferred._done.wait(TIMEOUT)
        ended_inside.append(ck._deferred.done)

    try:
        ck.save(str(tmp_path), get_training_state(ddp, opt, {"global_step": 2}), global_step=2, save_async=True,
                snapshot="deferred")
        assert hold.wait(TIMEOUT), "the background copier never reached the last layer"
        monkeypatch.setattr(ddp, "_distributed_broadcast_coalesced", broadcast_then_let_the_copy_end)
        ended, errors = bounded(lambda: forward_backward(ddp, opt, 3))
        assert ended and not errors, errors
        assert ended_inside == [True], "the copy did not end during the broadcast"
        ck.maybe_wait_for_async_save()
        got = _ddp_loaded_stats(ck, str(tmp_path))
        for s in STATS:
            assert torch.equal(got[s], at_call[s]), s
    finally:
        release.set()
        ck.close()


# -- what the guard does not cover (documented in refckpt/staging.py) ------------------------------
@pytest.mark.parametrize("how", ["data", "numpy"])
def test_a_write_that_bypasses_the_version_counter_is_neither_waited_for_nor_detected(saved, waits, how):
    """Outside the guard: a write through ``tensor.data`` or a ``.numpy()`` view, made while the copy
    is held at the gate (so before it): no wait, no claim, no error -- the acknowledged step holds
    the changed value. Make such writes after ``maybe_wait_for_async_save()``."""
    _started, seen = waits
    model = saved.model
    if how == "data":
        model.norm().running_mean.data.add_(1.0)
        key = "model/bn.running_mean"
    else:
        model.lin.weight.detach().numpy()[0, 0] += 1.0
        key = "model/lin.weight"
    changed = digest(model, saved.opt)
    assert changed[key] != saved.at_call[key]
    got = saved.finish()
    assert seen == [] and saved.copy.claimed == []
    assert got[key] == changed[key] and got == changed, "the write was not in the acknowledged step"


class Peer(nn.Module):
    """Normalizes with another module's running statistics, reached through a reference that is
    not registered (a plain attribute set past ``nn.Module.__setattr__``, or a closure): they are
    not in this module's subtree."""

    peer_mean: torch.Tensor
    peer_var: torch.Tensor

    def __init__(self, owner: nn.BatchNorm1d, how: str) -> None:
        super().__init__()
        self.how = how
        if how == "attribute":
            object.__setattr__(self, "peer_mean", owner.running_mean)
            object.__setattr__(self, "peer_var", owner.running_var)
        else:
            mean, var = owner.running_mean, owner.running_var
            self.fn = lambda x: F.batch_norm(x, mean, var, training=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.how == "attribute":
            return F.batch_norm(x, self.peer_mean, self.peer_var, training=True)
        return self.fn(x)


@pytest.mark.parametrize("how", ["attribute", "closure", "no_module"])
def test_an_update_of_a_buffer_outside_the_updating_modules_subtree_is_neither_waited_for_nor_detected(
        saved, waits, how):
    """Outside the guard: the running statistics of the model's BatchNorm updated (without a version
    bump) by a module that reaches them through an unregistered reference, or by the training loop
    itself, while the owner's forward (and its ancestors') is not called and the copy is held at the
    gate: no wait, no claim, no error -- the acknowledged step holds the changed statistics."""
    _started, seen = waits
    bn = saved.model.norm()
    x = torch.randn(5, 6, generator=torch.Generator().manual_seed(3))
    if how == "no_module":
        F.batch_norm(x, bn.running_mean, bn.running_var, training=True)
    else:
        peer = Peer(bn, how)
        assert not any(b is bn.running_mean for b in peer.buffers())
        peer(x)
    changed = digest(saved.model, saved.opt)
    assert changed["model/bn.running_mean"] != saved.at_call["model/bn.running_mean"]
    got = saved.finish()
    assert seen == [] and saved.copy.claimed == []
    assert got == changed, "the update was not in the acknowledged step"
