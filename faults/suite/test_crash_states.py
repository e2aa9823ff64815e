"""Every process-crash state of a save, and power loss right after one is acknowledged.

One real save runs under :func:`faults.crashsim.record`; after each file-system operation the
root is copied (what a SIGKILL at that moment leaves on disk), and a fresh checkpointer
resumes from every copy. That is exhaustive over the save's operations and costs one save,
where killing a process per point would cost a world each (the multi-rank state machine
does those real SIGKILLs at drawn points). Judged by behaviour only: the new step counts as
complete in a state iff the checkpointer's own ``find_latest_checkpoint`` takes a copy of it as
complete (:class:`~faults.suite._common.Completeness`), and then it must load bitwise.
"""

from __future__ import annotations

import os

import pytest

from faults.crashsim import acknowledged_not_durable, record, snapshot_states, snapshot_tree
from faults.training import RunConfig, TrainRun, _errors, reference_digest

from ._common import (
    Completeness,
    Stats,
    advise,
    config_for,
    make,
    need_async,
    read_pointer,
    resume,
    same_path,
    save_step,
    step_path,
)

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
CFG = RunConfig()
#: fewer crash states than this is reported as thin coverage (an advisory): before the save, after the
#: mkdir and little else means the save's writes were not observed
MIN_CRASH_STATES = 3

#: (name, checkpointer options, steps saved before, step of the recorded save, async)
SCENARIOS = [
    ("new-step", {}, [1, 2], 3, False),
    ("new-step-async", {}, [1, 2], 3, True),
    ("first-save", {}, [], 1, False),
    ("retention", {"keep_last": 2}, [1, 2, 3], 4, False),
    ("overwrite", {"overwrite": True}, [1, 2], 2, False),
]


@pytest.mark.parametrize("name,options,before,step,save_async", SCENARIOS, ids=[s[0] for s in SCENARIOS])
def test_every_crash_state_of_a_save_resumes(checkpointer_factory, tmp_path, name, options, before, step, save_async,
                                             request):
    """In every state a crash inside the save can leave: resume lands on the newest complete
    step (the new one iff its commit record is on disk, else the newest acknowledged one),
    bitwise equal to an uninterrupted run; no acknowledged step is lost; and the pointer is
    either untouched or names a complete step (never torn, never ahead of the commit)."""
    need_async(checkpointer_factory, save_async)
    root = str(tmp_path / "root")
    os.makedirs(root)
    ck = make(checkpointer_factory, **options)
    committed = Completeness(checkpointer_factory, **options)
    cfg = config_for(checkpointer_factory, CFG)
    run = TrainRun(cfg)
    for s in before:
        run.train_to(s)
        save_step(ck, root, run)
    run.train_to(step)
    pointer_before = read_pointer(root)
    snaps = snapshot_states(root, str(tmp_path / "states"))
    with record(on_op=snaps):
        save_step(ck, root, run, save_async=save_async)
    assert len(snaps.states) > 1, "the save did no file-system operation that could be observed"
    Stats(request).add("crash states", len(snaps.states))
    if len(snaps.states) < MIN_CRASH_STATES:
        advise(f"thin coverage: a {name} save showed only {len(snaps.states)} crash states (fewer than "
               f"{MIN_CRASH_STATES}: {[op.kind if op else 'before' for _s, op in snaps.states]}); its file-system "
               "operations are not seen by faults.crashsim (a writer outside Python's os calls?)")
    acked = max(before) if before else None
    problems = []
    for i, (state_dir, op) in enumerate(snaps.states):
        at = f"state {i} (after {op.kind} {op.path})" if op is not None else f"state {i} (before the save)"
        want = step if committed(state_dir, step) else acked
        # with keep_last=1, retention may drop the acknowledged step once the new one commits
        retired = options.get("keep_last") == 1 and want == step
        if acked is not None and not retired and not committed(state_dir, acked):
            problems.append(f"{at}: acknowledged step {acked} lost ({committed.why(state_dir, acked)})")
        pointer = read_pointer(state_dir)
        if pointer != pointer_before and pointer is not None:
            text = pointer.decode("ascii", "replace").strip()
            if not text.isdigit() or not committed(state_dir, int(text)):
                problems.append(f"{at}: pointer {pointer!r} names no complete step (torn, or published before the commit)")
        try:
            path, resumed = resume(checkpointer_factory(), state_dir, cfg)
        except _errors() as e:  # noqa: BLE001 - reported with the state it happened in
            problems.append(f"{at}: resume raised {type(e).__name__}: {e}")
            continue
        want_path = None if want is None else step_path(state_dir, want)
        if not same_path(path, want_path):
            problems.append(f"{at}: resumed {path}, the newest complete step is {want_path}")
        elif want is not None and resumed.digest() != reference_digest(cfg, want):
            problems.append(f"{at}: state restored from step {want} is not the one saved")
    assert not problems, (f"{len(problems)} problems in the {len(snaps.states)} crash states of a {name} save:\n"
                          + "\n".join(problems[:8]))


@pytest.mark.parametrize("save_async", [False, True], ids=["sync", "async"])
def test_acknowledged_save_survives_power_loss(checkpointer_factory, tmp_path, save_async):
    """Once ``save`` (or ``maybe_wait_for_async_save``) returned, a power cut must not take the
    step away: every file of it fsynced, every directory entry on its path fsynced in its
    directory (:mod:`faults.crashsim`'s persistence model)."""
    need_async(checkpointer_factory, save_async)
    root = str(tmp_path)
    ck = checkpointer_factory()
    run = TrainRun(config_for(checkpointer_factory, CFG))
    run.train_to(1)
    save_step(ck, root, run)
    run.train_to(2)
    before = snapshot_tree(root)
    with record() as trace:
        save_step(ck, root, run, save_async=save_async)
    lost = acknowledged_not_durable(before, trace, root, step_path(root, 2))
    assert not lost, "a power cut right after the save was acknowledged could lose:\n" + "\n".join(lost[:8])
