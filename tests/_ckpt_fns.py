"""Rank functions for tests/test_checkpointer_world.py (module level: worlds pickle them by reference).

Each function returns plain data (digests, flags, error names) and catches the errors a
test expects, so the world survives and is reused by the next test.
"""

from __future__ import annotations

import concurrent.futures
import copy
import errno
import hashlib
import os
import threading
import warnings

import torch
import torch.distributed as dist

import refckpt
from faults.training import average_gradients
from refckpt import DistributedCheckpointer, get_training_state, set_training_state
from refckpt.durable import FileIO
from refckpt.errors import CheckpointError
from refckpt.storage import tensor_to_bytes as _b


def build(seed: int = 0, kind: str = "adamw"):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    if kind == "adamw":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, amsgrad=True)
    elif kind == "sgd":
        opt = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9, nesterov=True)
    else:
        raise ValueError(kind)
    return model, opt


def train(model, opt, steps: range) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    for step in steps:
        g = torch.Generator().manual_seed(7919 * step + rank)
        loss = model(torch.randn(4, 6, generator=g)).pow(2).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        average_gradients(dist, model.parameters(), world)
        opt.step()


def digest(model, opt) -> dict[str, str]:
    """Independent bitwise fingerprint: params, every moment and step, param-group hyperparameters."""
    out = {}
    for name, p in model.named_parameters():
        out[f"param/{name}"] = hashlib.sha256(_b(p)).hexdigest()
        for k, v in sorted(opt.state.get(p, {}).items()):
            out[f"state/{name}/{k}"] = hashlib.sha256(_b(v)).hexdigest()
    for i, g in enumerate(opt.param_groups):
        out[f"group/{i}"] = repr(sorted((k, v) for k, v in g.items() if k != "params"))
    return out


def extra_for(step: int, rank: int, per_rank: bool) -> dict:
    torch.manual_seed(100 + step + (rank if per_rank else 0))
    extra = {"global_step": step, "rng": torch.get_rng_state(), "data": {"epoch": 1, "pos": [step, 3]}, "tag": "x"}
    if per_rank:
        extra["rank"] = rank
    return extra


def extra_digest(extra: dict) -> str:
    canonical = {k: (_b(v) if isinstance(v, torch.Tensor) else v) for k, v in sorted(extra.items())}
    return hashlib.sha256(repr(canonical).encode()).hexdigest()


def save_resume_continue(root: str, save_async: bool, per_rank: bool, kind: str = "adamw") -> dict:
    """Train 3, save, (async: mutate right after save returns), train 2 more; fresh objects
    resume and train the same 2 steps. Returns what the parent compares."""
    rank = dist.get_rank()
    model, opt = build(0, kind)
    train(model, opt, range(1, 4))
    saved = digest(model, opt)
    extra = extra_for(3, rank, per_rank)
    ckpt = DistributedCheckpointer(extra_state_per_rank=per_rank)
    ckpt.save(root, get_training_state(model, opt, dict(extra)), global_step=3, save_async=save_async)
    if save_async:
        snapshot = (copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict()))
        with torch.no_grad():  # training mutates parameters and moments right away
            for p in model.parameters():
                p.mul_(0).add_(123.0)
                for v in opt.state[p].values():
                    v.add_(7.0)
        ckpt.maybe_wait_for_async_save()
        model.load_state_dict(snapshot[0])
        opt.load_state_dict(snapshot[1])
    train(model, opt, range(4, 6))
    uninterrupted = digest(model, opt)

    model2, opt2 = build(seed=1, kind=kind)  # different init: nothing may leak through
    state = get_training_state(model2, opt2, {})
    path = ckpt.load_latest(root, state)
    set_training_state(model2, opt2, state)
    loaded = digest(model2, opt2)
    got_extra = state["extra_state"]
    train(model2, opt2, range(4, 6))
    resumed = digest(model2, opt2)
    ckpt.close()
    return {
        "path": path, "saved": saved, "loaded": loaded, "uninterrupted": uninterrupted, "resumed": resumed,
        "extra_ok": extra_digest(got_extra) == extra_digest(extra), "extra_keys": sorted(got_extra),
        "pointer": open(os.path.join(root, refckpt.LATEST_CHECKPOINT_FILE)).read(),
    }


def embedded_rank_variant(root: str) -> str:
    rank = dist.get_rank()
    model, opt = build()
    ckpt = DistributedCheckpointer(extra_state_per_rank=False)
    try:
        ckpt.save(root, get_training_state(model, opt, {"global_step": 1, "rank": rank}), global_step=1)
    except CheckpointError as e:
        return f"{type(e).__name__}: {e}"
    return "saved"


class FailingIO(FileIO):
    """ENOSPC on the fsync of rank ``bad_rank``'s shard (a full disk discovered at writeback)."""

    def __init__(self, bad_rank: int, gate: threading.Event | None = None) -> None:
        self.bad_rank = bad_rank
        self.gate = gate
        self.armed = False

    def mark(self, point, **info):
        if str(point) == str(refckpt.SavePoint.SHARDS):
            if self.gate is not None:
                self.gate.wait(60)
            self.armed = info.get("rank") == self.bad_rank

    def fsync(self, f):
        if self.armed and str(getattr(f, "name", "")).endswith(".safetensors"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), f.name)
        super().fsync(f)


def failed_save(root: str, save_async: bool, bad_rank: int) -> dict:
    """Step 2 saved fine; step 4 fails with ENOSPC on one rank. Nothing of step 4 may appear."""
    model, opt = build()
    train(model, opt, range(1, 3))
    good = DistributedCheckpointer()
    good.save(root, get_training_state(model, opt, {"global_step": 2}), global_step=2)
    saved2 = digest(model, opt)
    train(model, opt, range(3, 5))
    gate = threading.Event()
    ckpt = DistributedCheckpointer(io=FailingIO(bad_rank, gate if save_async else None))
    out = {"raised_sync": None, "early_check": None, "raised_async": None, "wait_raised": None}
    try:
        ckpt.save(root, get_training_state(model, opt, {"global_step": 4}), global_step=4, save_async=save_async)
    except refckpt.errors.SaveFailedError as e:
        out["raised_sync"] = f"{type(e).__name__}: {e}"
    if save_async:
        try:  # background is held at the gate: the check must neither block nor raise
            ckpt.raise_for_failed_async_save()
            out["early_check"] = "no error yet"
        except CheckpointError as e:  # pragma: no cover - would be a bug
            out["early_check"] = repr(e)
        gate.set()
        concurrent.futures.wait([ckpt._pending])
        try:
            ckpt.raise_for_failed_async_save()
        except refckpt.errors.AsyncSaveFailedError as e:
            out["raised_async"] = f"{type(e).__name__}: {e}"
        try:
            ckpt.maybe_wait_for_async_save()  # already reported: does not raise twice
            out["wait_raised"] = False
        except CheckpointError:
            out["wait_raised"] = True
    dist.barrier()
    out["latest"] = refckpt.find_latest_checkpoint(root)
    out["pointer"] = open(os.path.join(root, refckpt.LATEST_CHECKPOINT_FILE)).read()
    out["entries"] = sorted(os.listdir(root))
    dist.barrier()  # every rank has listed the root before any load_latest leaves its reader's lease file there
    model2, opt2 = build(1)
    state = get_training_state(model2, opt2, {})
    out["loaded_path"] = DistributedCheckpointer().load_latest(root, state)
    set_training_state(model2, opt2, state)
    out["loaded_ok"] = digest(model2, opt2) == saved2
    return out


def save_steps(root: str, steps: list[int], per_rank: bool = True) -> dict[int, dict]:
    """Save the given steps (training in between); return each step's digest for this rank."""
    rank = dist.get_rank()
    model, opt = build()
    ckpt = DistributedCheckpointer(extra_state_per_rank=per_rank)
    out, done = {}, 0
    for s in steps:
        train(model, opt, range(done + 1, s + 1))
        done = s
        ckpt.save(root, get_training_state(model, opt, extra_for(s, rank, per_rank)), global_step=s)
        out[s] = digest(model, opt)
    return out


def resume(root: str, **load_kwargs) -> dict:
    model, opt = build(1)
    state = get_training_state(model, opt, {})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            path = DistributedCheckpointer().load_latest(root, state, **load_kwargs)
        except CheckpointError as e:
            return {"error": f"{type(e).__name__}: {e}"}
    set_training_state(model, opt, state)
    return {
        "path": path, "digest": digest(model, opt), "step": state["extra_state"].get("global_step"),
        "warnings": [str(w.message) for w in caught if "fall back" in str(w.message)],
    }


def overwrite(root: str) -> dict:
    model, opt = build()
    train(model, opt, range(1, 2))
    DistributedCheckpointer().save(root, get_training_state(model, opt, {"global_step": 1}), global_step=1)
    first = digest(model, opt)
    train(model, opt, range(2, 3))
    out = {"first": first}
    try:
        DistributedCheckpointer().save(root, get_training_state(model, opt, {"global_step": 1}), global_step=1)
        out["refused"] = None
    except refckpt.errors.CheckpointExistsError as e:
        out["refused"] = str(e)
    out["after_refusal"] = resume(root)["digest"] == first
    DistributedCheckpointer(overwrite=True).save(root, get_training_state(model, opt, {"global_step": 1}), global_step=1)
    out["after_overwrite"] = resume(root)["digest"] == digest(model, opt)
    dist.barrier()  # no rank's load_latest (its reader's lease file in the root) overlaps another's listing
    out["entries"] = sorted(os.listdir(root))
    return out


def save_with_os_kill(root: str) -> str:
    """Step 2 saved; step 4 dies on rank 0 at os.replace of the commit record (patched os)."""
    from faults.inject import Action, FaultSpec, patch_os
    from faults.points import Role

    rank = dist.get_rank()
    model, opt = build()
    train(model, opt, range(1, 3))
    DistributedCheckpointer(timeout=30).save(root, get_training_state(model, opt, extra_for(2, rank, True)), global_step=2)
    train(model, opt, range(3, 5))
    spec = FaultSpec("replace", str(Role.COMMIT), "before", Action.KILL, (0,), name="commit.rename")
    with patch_os(spec, rank):
        DistributedCheckpointer(timeout=30).save(root, get_training_state(model, opt, extra_for(4, rank, True)), global_step=4)
    return "survived"


class GateIO(FileIO):
    """Holds a background save at its shards until ``release`` is set by another instance's
    first protocol step -- so the two saves would overlap unless refckpt serialises them."""

    def __init__(self, hold: threading.Event | None = None, release: threading.Event | None = None) -> None:
        self.hold, self.release = hold, release

    def mark(self, point, **info):
        if self.release is not None and str(point) == str(refckpt.SavePoint.WAIT_PREVIOUS):
            self.release.set()
        if self.hold is not None and str(point) == str(refckpt.SavePoint.SHARDS):
            self.hold.wait(60)


def two_instances(root: str) -> dict:
    """Instance A saves async; instance B saves while A's background is still in its collectives."""
    rank = dist.get_rank()
    gate = threading.Event()
    a = DistributedCheckpointer(io=GateIO(hold=gate), timeout=20)
    b = DistributedCheckpointer(io=GateIO(release=gate), timeout=20)
    model, opt = build()
    train(model, opt, range(1, 3))
    a.save(root, get_training_state(model, opt, extra_for(2, rank, True)), global_step=2, save_async=True)
    train(model, opt, range(3, 5))
    b.save(root, get_training_state(model, opt, extra_for(4, rank, True)), global_step=4)
    a.maybe_wait_for_async_save()
    return {"latest": refckpt.find_latest_checkpoint(root),
            "steps": sorted(n for n in os.listdir(root) if n.startswith("global"))}
