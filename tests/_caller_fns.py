"""Rank functions for tests/test_caller_errors.py (module level: worlds pickle them by reference).

The training job is :mod:`faults.training`'s (deterministic from its config, so a digest of a
resumed run is compared with a run trained from scratch). Each function catches the refckpt
errors its test expects and returns plain data, so the reused world survives for the next test.
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from typing import Any

import torch

from faults.training import RunConfig, TrainRun, reference_digest
from refckpt import DistributedCheckpointer
from refckpt.errors import CheckpointError, CorruptCheckpointError

#: The saved run: an untied model. FSDP2 variants shard it over the world.
SAVED = RunConfig()


def config(sharding: str = "replicated", **model: Any) -> RunConfig:
    return dataclasses.replace(SAVED, sharding=sharding, model=dataclasses.replace(SAVED.model, **model))


def save_steps(root: str, cfg: RunConfig, steps: tuple[int, ...] = (1, 2)) -> None:
    run = TrainRun(cfg)
    ck = DistributedCheckpointer()
    for s in steps:
        run.train_to(s)
        ck.save(root, run.state(), global_step=s)


def bad_state(case: str, sharding: str) -> dict:
    """A state to load into that is wrong in one way (``case``); ``"good"`` is the saved run's."""
    if case == "meta":
        state = TrainRun(config(sharding)).state(target=True)
        state["model"] = {k: torch.empty_like(v, device="meta") for k, v in state["model"].items()}
        return state
    cfg = {
        "good": config(sharding),
        "tied": config(sharding, tied=True),        # head.weight is embed.weight; the saver's were apart
        "dtype": config(sharding, dtype="bfloat16"),
        "shape": config(sharding, hidden=9),
    }[case]
    return TrainRun(cfg).state(target=True)


def _fallbacks(caught) -> list[str]:
    return [str(w.message) for w in caught if "fall back" in str(w.message)]


def attempt(root: str, case: str, bad_ranks: tuple[int, ...], sharding: str = "replicated") -> dict:
    """``load_latest`` with a wrong state on ``bad_ranks`` (the saved run's state elsewhere), then a
    resume into a correct state. Returns what each load raised and where the resume landed."""
    import torch.distributed as dist

    rank = dist.get_rank()
    state = bad_state(case if rank in bad_ranks else "good", sharding)
    out: dict[str, Any] = {"error": None, "message": "", "corrupt": False}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            out["path"] = DistributedCheckpointer(timeout=60).load_latest(root, state)
        except CheckpointError as e:
            out.update(error=type(e).__name__, message=str(e), corrupt=isinstance(e, CorruptCheckpointError),
                       mro=[c.__name__ for c in type(e).__mro__])
    out["fallbacks"] = _fallbacks(caught)
    cfg = config(sharding)
    run = TrainRun(cfg)
    good = run.state(target=True)
    out["resumed"] = DistributedCheckpointer(timeout=60).load_latest(root, good)
    run.apply(good)
    out["step"] = run.step
    out["exact"] = run.digest() == reference_digest(cfg, 2)
    return out


def tied_both(root: str, sharding: str) -> dict:
    """Saved tied and loaded tied (the checkpoint holds equal values for both keys): loads, bitwise."""
    cfg = config(sharding, tied=True)
    save_steps(root, cfg, (2,))
    run = TrainRun(cfg)
    state = run.state(target=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        path = DistributedCheckpointer().load_latest(root, state)
    run.apply(state)
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()  # no rank's load_latest (its reader's lease file in the root) overlaps another's listing
    return {"path": path, "exact": run.digest() == reference_digest(cfg, 2),
            "still_tied": run.model.head.weight is run.model.embed.weight,
            "entries": sorted(os.listdir(root))}
