"""Checks the adapters' tests share: what each contract call must do, asked the same way of
every adapter (``tests/test_adapter_*.py``)."""

from __future__ import annotations

import torch

from faults.training import RunConfig, TrainRun


def extra_state_only_with_a_skeleton(ck, path: str, cfg: RunConfig, step: int) -> None:
    """``ck.load`` of the step at ``path`` (saved by ``cfg`` at ``step``): without a skeleton it
    restores no extra state and leaves a caller's ``state["extra_state"]`` alone; with one it
    restores the saved extra state into ``state["extra_state"]``, filling a copy of the skeleton
    (never the skeleton itself)."""
    fresh = TrainRun(cfg)
    state = fresh.state(target=True)
    state.pop("extra_state")
    out = ck.load(path, state)
    assert out is state and "extra_state" not in state
    marker = {"global_step": -1}
    state["extra_state"] = marker
    ck.load(path, state)
    assert state["extra_state"] is marker and marker == {"global_step": -1}  # left alone
    skeleton = fresh.extra()
    ck.load(path, state, extra_state_skeleton=skeleton)
    assert state["extra_state"] is not skeleton and skeleton["global_step"] == 0  # a copy was filled
    assert state["extra_state"]["global_step"] == step
    ref = TrainRun(cfg)
    ref.train_to(step)
    assert torch.equal(state["extra_state"]["rng"], ref.extra()["rng"])
