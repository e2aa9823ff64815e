"""Save and resume at every world size of ``--world-sizes``: per-rank extra state comes back to
its own rank (a rank-seeded RNG and data position), embedded extra state stays rank-invariant,
FSDP2-sharded state round-trips. Deterministic, so a checkpointer that breaks one of these is
failed on every run, not only when the state machine happens to draw the case."""

from __future__ import annotations

import uuid

import pytest

from faults import training as T
from faults.contract import Capability as C
from faults.contract import Limitation as L

from ._common import config_for, need, need_async, need_not, same_path, step_path

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

#: case -> (config, checkpointer options, the capabilities the case needs). Cases without a
#: capability save rank-invariant extra state when per-rank extra state is not declared.
CASES = {
    "per_rank": (T.RunConfig(T.ModelSpec(unused=True), T.OptimSpec(("adamw", "sgd_momentum"))), {},
                 (C.PER_RANK_EXTRA_STATE,)),
    "rank_invariant": (T.RunConfig(T.ModelSpec(unused=True), T.OptimSpec(("adamw", "sgd_momentum")),
                                   extra_per_rank=False), {}, ()),
    "embedded": (T.RunConfig(extra_per_rank=False), {"extra_state_per_rank": False}, (C.EMBEDDED_EXTRA_STATE,)),
    "fsdp2": (T.RunConfig(T.ModelSpec(depth=2), T.OptimSpec(("adam_amsgrad",)), sharding="fsdp2"), {}, ()),
    "bf16_main_fp32": (T.RunConfig(T.ModelSpec(dtype="bfloat16", tied=True), T.OptimSpec(("adamw",), main_fp32=True)),
                       {}, ()),
}


#: (mode, case): every case sync and async; a deferred snapshot (``save_async=True,
#: snapshot="deferred"``, for a checkpointer that declares it) on the FSDP2 case, where training's
#: own collectives (FSDP2's all-gathers and reduce-scatters) run while the save persists
#: in the background: a checkpointer that runs the background save's collectives on the default
#: group, which training is using, deadlocks or times out there, as DCP's async_save does.
MODES = [(mode, case) for case in CASES for mode in ("sync", "async")] + [("deferred", "fsdp2")]


@pytest.mark.parametrize(("mode", "case"), MODES, ids=[f"{m}-{c}" for m, c in MODES])
def test_multi_rank_round_trip(checkpointer_spec, checkpointer_factory, world_factory, suite_world_size,
                               tmp_path, case, mode):
    cfg, options, needs = CASES[case]
    save_async = mode != "sync"
    if mode == "deferred":
        need(checkpointer_factory, C.DEFERRED_SNAPSHOT)
    if cfg.sharding == "fsdp2" and suite_world_size < 2:
        pytest.skip("FSDP2 shards over at least 2 ranks")
    need(checkpointer_factory, *needs)
    need_async(checkpointer_factory, save_async)
    if cfg.sharding == "fsdp2":
        need_not(checkpointer_factory, L.PLAIN_TENSORS_ONLY, what="FSDP2 (DTensor) state")
    cfg = config_for(checkpointer_factory, cfg)
    world = world_factory.get(suite_world_size)
    run_id, root = uuid.uuid4().hex, str(tmp_path)
    world.run(T.r_start, run_id, cfg, checkpointer_spec, options)
    world.run(T.r_train, run_id, 3)
    errors = world.run(T.r_save, run_id, root, save_async, False, "deferred" if mode == "deferred" else None)
    assert errors == [None] * suite_world_size, f"save of step 3 failed: {errors}"
    world.run(T.r_train, run_id, 2)  # training goes on while an async save persists
    errors = world.run(T.r_wait, run_id)
    assert errors == [None] * suite_world_size, f"async save of step 3 failed: {errors}"
    results = world.run(T.r_resume, run_id, cfg, checkpointer_spec, options, root, False)
    world.run(T.r_drop, run_id)
    for rank, r in enumerate(results):
        assert r["error"] is None, f"rank {rank}: {r['error']}"
        assert same_path(r["path"], step_path(root, 3)), f"rank {rank} resumed {r['path']}"
        assert r["step"] == 3 and r["digest"] == r["reference"], (
            f"rank {rank}: state restored at {suite_world_size} ranks differs from the uninterrupted run at step 3 "
            "(parameters, moments, or this rank's own extra state)")
