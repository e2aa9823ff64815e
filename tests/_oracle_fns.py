"""Rank functions for ``tests/test_oracle.py`` (module level: worlds pickle them by reference)."""

from __future__ import annotations

import torch.distributed as dist

from faults import training
from faults.training import ModelSpec, RunConfig, TrainRun

CONFIGS = {
    "replicated": RunConfig(ModelSpec(depth=2), sharding="replicated", seed=3),
    "fsdp2": RunConfig(ModelSpec(depth=2), sharding="fsdp2", seed=3),
}


def _kept(cfg: RunConfig):
    where = (dist.get_rank(), dist.get_world_size(), dist.get_backend())
    return training._REF_RUNS[(cfg, *where)][0]


def _from_scratch(cfg: RunConfig, step: int) -> str:
    run = TrainRun(cfg)
    run.train_to(step)
    return run.digest()


def memo_continues_the_kept_run(sharding: str) -> dict:
    """The oracle at step 3 then step 6: the second continues the run kept at step 3; both equal
    a run trained from scratch to that step."""
    cfg = CONFIGS[sharding]
    at3 = training.reference_digest(cfg, 3)
    kept = _kept(cfg)
    at6 = training.reference_digest(cfg, 6)
    return {"continued": _kept(cfg) is kept and kept.step == 6,
            "exact3": at3 == _from_scratch(cfg, 3), "exact6": at6 == _from_scratch(cfg, 6)}


def a_new_default_group_drops_the_kept_run(sharding: str, init_method: str) -> dict:
    """The default group is destroyed and made again (same ranks, a new rendezvous): the run kept
    under the old group (an FSDP2 run holds its device mesh) is not trained on; the oracle starts
    a new run in the new group and still agrees with training from scratch."""
    cfg = CONFIGS[sharding]
    training.reference_digest(cfg, 2)
    old = _kept(cfg)
    rank, world = dist.get_rank(), dist.get_world_size()
    dist.destroy_process_group()
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world)
    at5 = training.reference_digest(cfg, 5)
    return {"new_run": _kept(cfg) is not old, "exact5": at5 == _from_scratch(cfg, 5)}
