"""Rank functions for ``tests/test_adapter_torchtitan.py``: module level, so that a
:class:`faults.world.World` pickles them by reference and its ranks import them from here."""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Iterator
from typing import Any

from faults.training import RunConfig, TrainRun, reference_digest


def step_dir(root: str, step: int) -> str:
    return os.path.join(os.path.abspath(root), f"global_step_{step}")


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP's single-process and overwrite notices, torch's pickle notice
        yield


def resume(root: str, cfg: RunConfig, **options: Any) -> tuple[str | None, TrainRun]:
    """What a restarted job does: fresh run and checkpointer, ``find_latest_checkpoint``, ``load``
    with a skeleton, apply."""
    from faults.adapters.torchtitan import TorchTitan

    fresh, ck = TrainRun(cfg), TorchTitan(**options)
    try:
        path = ck.find_latest_checkpoint(root)
        if path is not None:
            state = fresh.state(target=True)
            skeleton = state.pop("extra_state")
            out = ck.load(path, state, extra_state_skeleton=skeleton)
            assert out is state
            fresh.apply(out)
    finally:
        ck.close()
    return path, fresh


def round_trip(root: str, cfg: RunConfig, save_async: bool, steps: tuple[int, ...] = (2, 3),
               train_after: int = 2, keep_last: int | None = None) -> dict[str, Any]:
    """Train and save at each of ``steps`` (``save_async`` for every save, polled after each),
    train ``train_after`` more steps while the last async save may still run, wait, close (which
    joins torchtitan's purge thread, so its deletions are done); then resume in fresh objects.
    Returns where it landed, the digests that judge it and the steps left on disk."""
    import torch.distributed as dist

    from faults.adapters.torchtitan import TorchTitan

    options = {} if keep_last is None else {"keep_last": keep_last}
    with quiet():
        run, ck = TrainRun(cfg), TorchTitan(**options)
        for s in steps:
            run.train_to(s)
            ck.save(step_dir(root, s), run.state(), global_step=s, save_async=save_async)
            ck.raise_for_failed_async_save()
        run.train_to(run.step + train_after)
        ck.maybe_wait_for_async_save()
        ck.maybe_wait_for_async_save()  # nothing pending: a no-op
        ck.raise_for_failed_async_save()
        ck.close()
        if dist.is_initialized():
            dist.barrier()  # rank 0's purge is done before any rank lists the root
        on_disk = sorted(os.listdir(root))
        path, fresh = resume(root, cfg)
        return {"path": path, "step": fresh.step, "digest": fresh.digest(),
                "reference": reference_digest(cfg, fresh.step), "on_disk": on_disk}
