"""Rank functions and a model for ``tests/test_transactional_load.py`` (worlds pickle functions by
reference, so they live in a module of their own).

:class:`LateNet` has a branch that joins the forward only from step 2 on: a checkpoint of step 1
holds no optimizer state for its parameters, a checkpoint of step 2 does. That is the case where a
fallback from a damaged step 2 to step 1 can leave step 2's Adam moments in the state."""

from __future__ import annotations

import os
import warnings
from typing import Any

import torch
import torch.distributed as dist

from refckpt import DistributedCheckpointer, get_training_state
from refckpt.errors import CheckpointError
from tests import _builders as B


class LateNet(torch.nn.Module):
    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.a = torch.nn.Linear(4, 4)
        self.late = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, step: int) -> torch.Tensor:
        y = torch.tanh(self.a(x))
        return y + self.late(y) if step >= 2 else y


def build(seed: int = 0) -> tuple[LateNet, torch.optim.Optimizer]:
    model = LateNet(seed)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def train_to(model: LateNet, opt: torch.optim.Optimizer, start: int, stop: int) -> None:
    """The same batches on every rank (data parallel: every rank holds the same model and moments)."""
    for s in range(start + 1, stop + 1):
        opt.zero_grad(set_to_none=True)
        model(B.batch(s * 10), s).pow(2).mean().backward()
        opt.step()


def save_two_steps(root: str, rank: int = 0, **ck_kwargs: Any) -> dict[int, dict]:
    """Steps 1 and 2 of a LateNet run saved under ``root``; the state of each step as saved."""
    model, opt = build()
    ck = DistributedCheckpointer(**ck_kwargs)
    saved = {}
    for s in (1, 2):
        train_to(model, opt, s - 1, s)
        state = get_training_state(model, opt, {"global_step": s, "rank": rank, "seen": [s, rank]})
        saved[s] = B.clone_tree(state)
        ck.save(root, state, global_step=s)
    return saved


def target_state(seed: int = 7) -> tuple[LateNet, torch.optim.Optimizer, dict]:
    """A fresh run's state to load into (primed: every parameter has zeroed moments), its extra
    state holding values of its own, so that "left as it was" is visible."""
    model, opt = build(seed)
    state = get_training_state(model, opt, {"global_step": -1, "mine": "before"})
    with torch.no_grad():  # pre-load values that differ from any saved ones
        for group in state["optimizer"]["state"].values():
            for v in group.values():
                if isinstance(v, torch.Tensor) and v.is_floating_point():
                    v.fill_(0.25)
    return model, opt, state


def expected_after_fallback(before: dict, saved_old: dict) -> dict:
    """What a fallback to the older step must leave: the older step's value for every entry it holds,
    the pre-load value for every other one (the older step lacks the late branch's moments)."""
    out = B.clone_tree(before)
    for top in ("model", "optimizer"):
        _overlay(out[top], saved_old[top])
    out["extra_state"] = B.clone_tree(saved_old["extra_state"])
    return out


def _overlay(dst: Any, src: Any) -> None:
    for k, v in src.items():
        if isinstance(v, dict) and isinstance(dst.get(k), dict):
            _overlay(dst[k], v)
        else:
            dst[k] = B.clone_tree(v)


def r_fallback_from_one_damaged_rank(root: str, bad_rank: int) -> dict:
    """Save steps 1 and 2 at this world size, flip a bit in ``bad_rank``'s extra-state file of step 2
    (which only that rank reads: the shards of a replicated model are read by every rank), then
    load_latest into a primed fresh state on every rank."""
    rank = dist.get_rank()
    saved = save_two_steps(root, rank)
    dist.barrier()
    if rank == bad_rank:
        extra = os.path.join(root, "global_step_2", "extra_state", f"extra_state_rank_{rank}.pt")
        B.flip_bit(extra, os.path.getsize(extra) // 2)
    dist.barrier()
    _model, _opt, state = target_state()
    before = B.clone_tree(state)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            path = DistributedCheckpointer().load_latest(root, state)
        except CheckpointError as e:
            return {"error": f"{type(e).__name__}: {e}"}
    want = expected_after_fallback(before, saved[1])
    try:
        B.assert_bitwise(state, want, "state")
        mixed = None
    except AssertionError as e:
        mixed = str(e)
    return {"path": path, "mixed": mixed, "fell_back": any("fall back" in str(w.message) for w in caught)}
