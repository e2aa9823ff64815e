"""Hypothesis strategies and generic helpers for the resilience suite.

Everything here works on *any* checkpointer that follows the on-disk contract: damage is
done to files by role (commit record, payload), never through a checkpointer's internals.
"""

from __future__ import annotations

import os

import torch
from hypothesis import strategies as st

__all__ = ["OPTIMIZERS", "DTYPES", "optimizers", "dtypes", "build_model", "make_optimizer",
           "payload_files", "damage_step", "DAMAGE"]

#: Optimizer kinds the suite generates (the moments each keeps differ: exp_avg/exp_avg_sq,
#: max_exp_avg_sq, momentum_buffer, square_avg, sum).
OPTIMIZERS = ("adamw", "adam_amsgrad", "sgd_momentum", "rmsprop", "adagrad")
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def optimizers() -> st.SearchStrategy[str]:
    return st.sampled_from(OPTIMIZERS)


def dtypes() -> st.SearchStrategy[torch.dtype]:
    return st.sampled_from(DTYPES)


def build_model(seed: int, dtype: torch.dtype = torch.float32) -> torch.nn.Sequential:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3)).to(dtype)


def make_optimizer(kind: str, model: torch.nn.Module) -> torch.optim.Optimizer:
    params = model.parameters()
    if kind == "adamw":
        return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
    if kind == "adam_amsgrad":
        return torch.optim.Adam(params, lr=1e-2, amsgrad=True)
    if kind == "sgd_momentum":
        return torch.optim.SGD(params, lr=1e-2, momentum=0.9)
    if kind == "rmsprop":
        return torch.optim.RMSprop(params, lr=1e-2)
    if kind == "adagrad":
        return torch.optim.Adagrad(params, lr=1e-2)
    raise ValueError(f"unknown optimizer kind {kind!r}; choose from {OPTIMIZERS}")


def payload_files(step_dir: str) -> list[str]:
    """Every file of a step except commit records, largest first."""
    out = []
    for dirpath, _dirs, files in os.walk(step_dir):
        for f in files:
            if f == ".metadata" or (f.startswith("__") and f.endswith(".metadata")):
                continue
            out.append(os.path.join(dirpath, f))
    return sorted(out, key=lambda p: (-os.path.getsize(p), p))


DAMAGE = ("missing_commit", "missing_payload", "truncated_payload", "bitflip_payload")


def damage_step(step_dir: str, how: str) -> None:
    """Damage a step the way real failures do, by file role only."""
    if how == "missing_commit":
        for f in os.listdir(step_dir):
            if f == ".metadata" or (f.startswith("__") and f.endswith(".metadata")):
                os.unlink(os.path.join(step_dir, f))
        return
    target = payload_files(step_dir)[0]
    size = os.path.getsize(target)
    if how == "missing_payload":
        os.unlink(target)
    elif how == "truncated_payload":
        os.truncate(target, size // 2)
    elif how == "bitflip_payload":
        with open(target, "r+b") as f:
            f.seek(size - max(1, size // 4))  # inside the data, past any header
            b = f.read(1)[0]
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([b ^ 0x04]))
    else:
        raise ValueError(f"unknown damage {how!r}; choose from {DAMAGE}")
