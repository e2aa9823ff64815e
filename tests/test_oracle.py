"""The harness's oracle (:func:`faults.training.reference_digest`): an uninterrupted run,
recomputed by training, memoized per rank. A memo that continued a kept run where a run from
scratch differs, or that trained on a run built in a process group since destroyed, would make
every check that compares with it wrong; these tests compare it with runs trained from scratch."""

from __future__ import annotations

import pytest

from faults.world import World

from . import _oracle_fns as fns


@pytest.mark.world_size(2)
@pytest.mark.parametrize("sharding", ["replicated", "fsdp2"])
def test_the_memo_continues_a_kept_run_and_agrees_with_training_from_scratch(world, sharding):
    for rank, got in enumerate(world.run(fns.memo_continues_the_kept_run, sharding)):
        assert got == {"continued": True, "exact3": True, "exact6": True}, (rank, got)


@pytest.mark.parametrize("sharding", ["replicated", "fsdp2"])
def test_a_run_kept_under_a_destroyed_group_is_not_trained_on(tmp_path, sharding):
    init = f"file://{tmp_path / 'second-rendezvous'}"
    with World(2, "gloo", timeout=60, start_method="forkserver").start() as world:
        for rank, got in enumerate(world.run(fns.a_new_default_group_drops_the_kept_run, sharding, init)):
            assert got == {"new_run": True, "exact5": True}, (rank, got)
