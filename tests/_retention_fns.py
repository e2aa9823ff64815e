"""Rank function for tests/test_retention_readers.py (module level: worlds pickle it by reference):
a saver with retention that readers in the test process race against."""

from __future__ import annotations

import warnings

import torch

from refckpt import DistributedCheckpointer, get_training_state


def save_rounds(root: str, steps: list[int], keep_last: int) -> list[str]:
    """Save a small model at each of ``steps`` (every save acknowledged before the next) with
    ``keep_last``; returns the errors (none expected)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ck = DistributedCheckpointer(keep_last=keep_last)
    errors = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for step in steps:
            model(torch.ones(2, 4)).sum().backward()
            opt.step()
            try:
                ck.save(root, get_training_state(model, opt, {"global_step": step}), global_step=step)
            except Exception as e:  # noqa: BLE001 - reported to the test
                errors.append(f"step {step}: {type(e).__name__}: {e}")
    ck.close()
    return errors
