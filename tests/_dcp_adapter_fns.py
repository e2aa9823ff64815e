"""Rank functions for ``tests/test_adapter_dcp.py``: module level, so that a
:class:`faults.world.World` pickles them by reference and its ranks import them from here."""

from __future__ import annotations

import os
import warnings
from typing import Any

from faults.training import RunConfig, TrainRun, reference_digest


def step_dir(root: str, step: int) -> str:
    return os.path.join(os.path.abspath(root), f"global_step_{step}")


def round_trip(root: str, cfg: RunConfig, save_async: bool, steps: tuple[int, ...] = (2, 3),
               train_after: int = 2, overlap: bool = True) -> dict[str, Any]:
    """Train and save at each of ``steps`` (``save_async`` for every save), train on
    ``train_after`` more steps, wait; then do what a restarted job does: a fresh run and
    checkpointer, ``find_latest_checkpoint``, ``load`` with a skeleton, ``apply``. Returns where
    it landed and the digests that judge it.

    ``overlap``: training goes on while an async save runs. With ``overlap=False`` each async
    save is waited for before training resumes: in a gloo-only world the training collectives
    and DCP's background-thread collectives share the default process group, and interleaved
    they deadlock (see the report of ``tests/test_adapter_dcp.py``)."""
    from faults.adapters.dcp import PlainDCP

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP's single-process notice, torch's pickle notice
        run, ck = TrainRun(cfg), PlainDCP()
        for s in steps:
            run.train_to(s)
            ck.save(step_dir(root, s), run.state(), global_step=s, save_async=save_async)
            ck.raise_for_failed_async_save()
            if not overlap:
                ck.maybe_wait_for_async_save()
        run.train_to(run.step + train_after)
        ck.maybe_wait_for_async_save()
        ck.maybe_wait_for_async_save()  # nothing pending: a no-op
        ck.raise_for_failed_async_save()

        fresh, ck2 = TrainRun(cfg), PlainDCP()
        path = ck2.find_latest_checkpoint(root)
        state = fresh.state(target=True)
        skeleton = state.pop("extra_state")
        out = ck2.load(path, state, extra_state_skeleton=skeleton)
        fresh.apply(out)
        return {"path": path, "same_dict": out is state, "step": fresh.step, "digest": fresh.digest(),
                "reference": reference_digest(cfg, fresh.step)}
