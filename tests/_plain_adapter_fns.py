"""Rank functions for the adapters' tests of rank-0-writes checkpointers (``tests/test_adapter_
torchsave.py``, ``test_adapter_lightning.py``, ``test_adapter_deepspeed.py``,
``test_adapter_megatron.py``): module level, so that a :class:`faults.world.World` pickles them by
reference and its ranks import them from here; in one process they are called directly."""

from __future__ import annotations

import os
import warnings
from typing import Any

from faults.training import RunConfig, TrainRun, load_factory, reference_digest


def step_dir(root: str, step: int) -> str:
    return os.path.join(os.path.abspath(root), f"global_step_{step}")


def round_trip(spec: str, root: str, cfg: RunConfig, steps: tuple[int, ...] = (2, 3),
               save_async: tuple[bool, ...] = (False, True), train_after: int = 1) -> dict[str, Any]:
    """Train and save at each of ``steps`` (the i-th save with ``save_async[i % len]``), train on,
    wait; then what a restarted job does: a fresh run and checkpointer, ``find_latest_checkpoint``,
    ``load`` with a skeleton, ``apply``. Returns where it landed, the root's listing and the
    digests that judge it."""
    factory = load_factory(spec)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        run, ck = TrainRun(cfg), factory()
        for i, s in enumerate(steps):
            run.train_to(s)
            ck.save(step_dir(root, s), run.state(), global_step=s, save_async=save_async[i % len(save_async)])
            ck.raise_for_failed_async_save()
        run.train_to(run.step + train_after)
        ck.maybe_wait_for_async_save()
        ck.raise_for_failed_async_save()

        fresh, ck2 = TrainRun(cfg), factory()
        path = ck2.find_latest_checkpoint(root)
        state = fresh.state(target=True)
        skeleton = state.pop("extra_state")
        out = ck2.load(path, state, extra_state_skeleton=skeleton)
        fresh.apply(out)
        return {"path": path, "same_dict": out is state, "listing": sorted(os.listdir(root)), "step": fresh.step,
                "digest": fresh.digest(), "reference": reference_digest(cfg, fresh.step)}
