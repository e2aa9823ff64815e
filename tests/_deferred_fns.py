"""Helpers and rank functions for tests/test_deferred.py (module level: worlds pickle the rank
functions by reference). Each rank function returns plain data and catches the errors its test
expects, so the world survives for the next test."""

from __future__ import annotations

import hashlib
import os
import threading
import warnings

import torch
import torch.nn as nn
from torch.nn.modules import module as _module
from torch.optim import optimizer as _optimizer

from refckpt import DistributedCheckpointer, SavePoint, get_training_state, set_training_state
from refckpt.durable import FileIO
from refckpt.errors import CheckpointError
from refckpt.storage import tensor_to_bytes


def build(seed: int = 0, bn: bool = True) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A tiny model (with BatchNorm buffers unless ``bn=False``) and AdamW."""
    torch.manual_seed(seed)
    layers: list[nn.Module] = [nn.Linear(4, 6)]
    if bn:
        layers.append(nn.BatchNorm1d(6))
    layers += [nn.Tanh(), nn.Linear(6, 3)]
    model = nn.Sequential(*layers)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def train(model: nn.Module, opt: torch.optim.Optimizer, steps: range, *, all_reduce: bool = False) -> None:
    """Deterministic training: forward (updates BatchNorm's running statistics), backward, step.
    The batch depends on the step only, so replicated ranks stay replicated."""
    for step in steps:
        x = torch.randn(5, 4, generator=torch.Generator().manual_seed(1000 + step))
        opt.zero_grad(set_to_none=True)
        model(x).pow(2).mean().backward()
        if all_reduce:
            import torch.distributed as dist

            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= dist.get_world_size()
        opt.step()


def digest(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, str]:
    """Bitwise fingerprint of every parameter, buffer (running statistics, batch count) and
    optimizer state entry, and the param-group hyperparameters."""
    out = {f"model/{k}": hashlib.sha256(tensor_to_bytes(v)).hexdigest() for k, v in model.state_dict().items()}
    names = {p: n for n, p in model.named_parameters()}
    for p, st in opt.state.items():
        for k, v in sorted(st.items()):
            out[f"optim/{names[p]}/{k}"] = hashlib.sha256(tensor_to_bytes(v)).hexdigest()
    for i, g in enumerate(opt.param_groups):
        out[f"group/{i}"] = repr(sorted((k, v) for k, v in g.items() if k != "params"))
    return out


def hooks() -> tuple[int, int]:
    """How many global module forward pre-hooks and optimizer step pre-hooks torch holds."""
    return len(_module._global_forward_pre_hooks), len(_optimizer._global_optimizer_pre_hooks)


class GateIO(FileIO):
    """Holds the background copy of a deferred save (at its ``STAGING`` mark, on the background
    thread) until ``gate`` is set: whatever the test does meanwhile surely lands before the copy."""

    def __init__(self, gate: threading.Event | None = None) -> None:
        self.gate = gate
        self.entered = threading.Event()

    def mark(self, point, **info):
        if str(point) == str(SavePoint.STAGING) and self.gate is not None:
            self.entered.set()
            if not self.gate.wait(120):
                raise TimeoutError("GateIO: the test never opened the gate")



def _waited(ck, root: str) -> dict:
    """Wait for the save on every rank: what it raised, the hooks left installed, the root's
    entries once every rank waited (listed before any rank's load_latest leaves a lease file)."""
    import torch.distributed as dist

    out: dict = {"raised": None}
    try:
        ck.maybe_wait_for_async_save()
    except CheckpointError as e:
        out["raised"] = f"{type(e).__name__}: {e}"
    out["hooks"] = hooks()
    dist.barrier()
    out["entries"] = sorted(os.listdir(root))
    dist.barrier()  # no rank's load_latest (its reader's lease file in the root) overlaps another's listing
    return out

def resumed_digest(root: str, ck: DistributedCheckpointer, seed: int = 5, bn: bool = True):
    """Fresh objects (another seed: nothing leaks through), load_latest, apply: (path, digest, model, opt)."""
    model, opt = build(seed, bn)
    state = get_training_state(model, opt, {})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        path = ck.load_latest(root, state)
    set_training_state(model, opt, state)
    return path, digest(model, opt), model, opt


# -- rank functions ------------------------------------------------------------------------------
def round_trip(root: str) -> dict:
    """Train 3, deferred save, train 3 more at once (the step hook and the BatchNorm forward wait
    for the copy), wait; fresh objects resume bitwise to the values at the call and continue alike."""
    model, opt = build()
    train(model, opt, range(1, 4), all_reduce=True)
    at_call = digest(model, opt)
    ck = DistributedCheckpointer()
    ck.save(root, get_training_state(model, opt, {"global_step": 3}), global_step=3, save_async=True,
            snapshot="deferred")
    train(model, opt, range(4, 7), all_reduce=True)
    ck.maybe_wait_for_async_save()
    after_wait = hooks()
    path, loaded, model2, opt2 = resumed_digest(root, ck)
    train(model2, opt2, range(4, 7), all_reduce=True)
    ck.close()
    return {"path": path, "at_call": at_call, "loaded": loaded, "continued": digest(model, opt),
            "resumed_continued": digest(model2, opt2), "hooks_after_wait": after_wait}


def returns_before_the_other_ranks_call(root: str, embedded: bool, overwrite_step: bool) -> dict:
    """Rank 0's deferred save returns while every other rank has not called ``save`` yet: they are
    held in a barrier of the default group that rank 0 enters only after its ``save`` returned,
    so a collective call on ``save``'s path (the staging directory's broadcast, the shared-root
    check, the embedded extra state's all-gather) would hang rank 0 until the checkpointer's
    timeout. (A first save, sync, made the checkpointer's own process group: a collective, once
    per checkpointer.) Then every rank waits for the save; ``overwrite_step``: step 3 is already complete,
    and the refusal to overwrite it (made in the background) comes from the wait, on every rank."""
    import torch.distributed as dist

    rank = dist.get_rank()
    model, opt = build()
    train(model, opt, range(1, 4), all_reduce=True)
    at_call = digest(model, opt)
    ck = DistributedCheckpointer(timeout=20, extra_state_per_rank=not embedded)
    state = get_training_state(model, opt, {"global_step": 3, "data": [1, 2]})
    # the checkpointer's first save creates its process group (collective, once per checkpointer);
    # the steady state is what is zero-stall
    ck.save(root, state, global_step=3 if overwrite_step else 1)
    dist.barrier()
    out: dict = {"raised": None, "returned_first": None}
    if rank == 0:
        ck.save(root, state, global_step=3, save_async=True, snapshot="deferred")
        out["returned_first"] = True  # the others are still in the barrier below
        dist.barrier()
    else:
        dist.barrier()
        ck.save(root, state, global_step=3, save_async=True, snapshot="deferred")
    train(model, opt, range(4, 6), all_reduce=True)  # the step hook waits for the copy
    try:
        ck.maybe_wait_for_async_save()
    except CheckpointError as e:
        out["raised"] = f"{type(e).__name__}: {e}"
    dist.barrier()
    path, loaded, _m, _o = resumed_digest(root, ck)
    out["path"], out["loaded_ok"] = path, loaded == at_call
    ck.close()
    return out


def one_rank_changes_a_tensor(root: str, bad_rank: int) -> dict:
    """Step 2 saved; then a deferred save of step 4 during which rank ``bad_rank`` changes a
    parameter in place before its copy (held by a gate until the change is made). Every rank must
    raise, nothing of step 4 may appear, step 2 stays the newest and resumes bitwise."""
    import torch.distributed as dist

    rank = dist.get_rank()
    model, opt = build()
    train(model, opt, range(1, 3), all_reduce=True)
    gate = threading.Event()
    ck = DistributedCheckpointer(io=GateIO(gate if rank == bad_rank else None))
    ck.save(root, get_training_state(model, opt, {"global_step": 2}), global_step=2)
    saved2 = digest(model, opt)
    train(model, opt, range(3, 5), all_reduce=True)
    ck.save(root, get_training_state(model, opt, {"global_step": 4}), global_step=4, save_async=True,
            snapshot="deferred")
    if rank == bad_rank:
        with torch.no_grad():
            model[0].weight.mul_(2.0)  # before the copy: the copy is held at the gate
        gate.set()
    out = _waited(ck, root)
    path, loaded, _m, _o = resumed_digest(root, ck)
    out["path"], out["loaded_ok"] = path, loaded == saved2
    ck.close()
    return out


def fsdp2(root: str, bad_rank: int | None) -> dict:
    """FSDP2 (DTensor shards): a deferred save with training right after it holds the values at the
    call; with ``bad_rank``, that rank changes its local shard of a parameter in place before the
    copy (held at the gate) and every rank's save fails, naming the parameter."""
    import torch.distributed as dist

    from tests import _fsdp_fns as F

    rank = dist.get_rank()
    model, opt = F.build(0)
    F.train(model, opt, range(3))
    at_call = F.full_state(model, opt)
    gate = threading.Event()
    ck = DistributedCheckpointer(io=GateIO(gate))
    ck.save(root, get_training_state(model, opt, {"global_step": 3}), global_step=3, save_async=True,
            snapshot="deferred")
    out: dict = {"raised": None, "hooks": None, "same": None}
    if bad_rank is not None:
        if rank == bad_rank:
            with torch.no_grad():
                model[0].weight.mul_(2.0)  # a DTensor op: changes this rank's local shard
        gate.set()
    else:
        # forward (all-gathers) and backward (reduce-scatters) while the copy is surely pending:
        # neither may count as a change of a saved shard; then the step, which waits for the copy
        x = torch.randn(F.BATCH, F.IN, generator=torch.Generator().manual_seed(7919 * 3 + rank))
        opt.zero_grad(set_to_none=True)
        model(x).pow(2).mean().backward()
        gate.set()
        opt.step()
        F.train(model, opt, range(4, 6))
    out.update(_waited(ck, root))
    if bad_rank is None:
        model2, opt2 = F.build(99)
        state = get_training_state(model2, opt2, {})
        out["path"] = ck.load_latest(root, state)
        set_training_state(model2, opt2, state)
        loaded = F.full_state(model2, opt2)
        if rank == 0:
            flat_a, flat_b = _flatten(at_call), _flatten(loaded)
            out["same"] = flat_a.keys() == flat_b.keys() and all(
                torch.equal(flat_a[k], flat_b[k]) if isinstance(flat_a[k], torch.Tensor) else flat_a[k] == flat_b[k]
                for k in flat_a)
    ck.close()
    return out


def _flatten(obj, prefix: str = "") -> dict:
    if isinstance(obj, dict):
        out: dict = {}
        for k, v in obj.items():
            out.update(_flatten(v, f"{prefix}{k}/"))
        return out
    if isinstance(obj, (list, tuple)):
        out = {}
        for i, v in enumerate(obj):
            out.update(_flatten(v, f"{prefix}{i}/"))
        return out
    return {prefix: obj}
