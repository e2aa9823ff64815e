"""The pointer and readers beside saves: a save of an older step than the newest, retention with
it, and ``find_latest_checkpoint`` run in a loop while a saver in another process saves (with
retention where it is declared).

The seed contract says the pointer is a hint and resume lands on the newest complete step: a
resume that lands elsewhere is a violation. It is silent on the rest, so these are advisories: a
pointer moved back to an older step, retention deleting a save right after acknowledging it (or
the step the pointer names), ``find_latest_checkpoint`` raising while a save with retention runs
beside it. A reader that answers a directory that was never a saved step is a violation (resume
would load it), and so is one that answers None or an older step than the newest acknowledged
before it asked (a restarted job would train from scratch, or redo work).
"""

from __future__ import annotations

import os
import threading
import uuid

import pytest

from faults import training as T
from faults.contract import Capability as C
from faults.training import TrainRun, _errors, describe_error, reference_digest

from ._common import (
    Stats,
    accepts,
    advise,
    assert_resumed,
    config_for,
    has,
    make,
    read_pointer,
    refused,
    resume,
    same_path,
    save_step,
    save_steps,
    step_path,
)

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
CFG = T.RunConfig()
#: Saves the saver makes beside the reader loop (a fixed number of rounds).
ROUNDS = 10


def _save_older(ck, root: str, cfg) -> bool:
    """Save step 6 after step 7; True when the save was acknowledged, False when it was refused."""
    older = TrainRun(cfg)
    older.train_to(6)
    try:
        save_step(ck, root, older)
    except _errors() as e:  # noqa: BLE001 - refusing it, with an Exception, is a fine answer
        refused(e, "a save of step 6 after step 7")
        return False
    return True


def _pointer_step(root: str) -> int | None:
    raw = read_pointer(root)
    try:
        return None if raw is None else int(raw.strip())
    except ValueError:
        return None


def test_a_save_of_an_older_step_never_moves_the_pointer_back(checkpointer_factory, tmp_path):
    """Step 7, then step 6: the save of 6 is refused or acknowledged; either way resume lands on 7
    (violation otherwise), and a pointer moved back to 6 is an advisory."""
    root, cfg = str(tmp_path), config_for(checkpointer_factory, CFG)
    ck = checkpointer_factory()
    save_steps(ck, root, cfg, [7])
    if _save_older(ck, root, cfg) and _pointer_step(root) == 6:
        advise("a save of step 6 after step 7 moved the pointer back to step 6: the pointer is a hint, but a reader "
               "that trusts it (the family's own loaders) resumes an older step than the newest complete one")
    assert_resumed(*resume(checkpointer_factory(), root, cfg), root, 7, cfg, "after saving step 6 after step 7: ")


def test_retention_keeps_the_older_save_it_just_acknowledged(checkpointer_factory, tmp_path):
    """``keep_last=1`` (declared): step 7, then step 6. Deleting step 6 right after acknowledging its
    save, or leaving the pointer naming a deleted step, is an advisory; resume lands on 7."""
    root, cfg = str(tmp_path), config_for(checkpointer_factory, CFG)
    ck = make(checkpointer_factory, keep_last=1)
    save_steps(ck, root, cfg, [7])
    if _save_older(ck, root, cfg):
        if not os.path.isdir(step_path(root, 6)):
            advise("keep_last=1 deleted step 6 right after acknowledging its save (step 7 is newer): an acknowledged "
                   "save was lost silently; keep the step just saved until a newer save's retention")
        pointed = _pointer_step(root)
        if pointed is not None and not os.path.isdir(step_path(root, pointed)):
            advise(f"after a save of step 6 after step 7 with keep_last=1 the pointer names step {pointed}, which "
                   f"retention deleted: rewrite the pointer before deleting the step it names")
    assert_resumed(*resume(checkpointer_factory(), root, cfg), root, 7, cfg, "after saving step 6 after step 7: ")


def _load_latest_once(ck, root: str, cfg, newest: int | None) -> list[str]:
    """One ``load_latest`` into a fresh run: what it did wrong, if anything."""
    run = TrainRun(cfg)
    state = run.state(target=True)
    skeleton = state.pop("extra_state")
    try:
        path = ck.load_latest(root, state, extra_state_skeleton=skeleton)
    except _errors() as e:  # noqa: BLE001 - a resume that raises while complete steps exist
        return [f"load_latest raised {describe_error(e)}"]
    if path is None:
        return [] if newest is None else [f"load_latest answered None after step {newest} was acknowledged"]
    got = next((s for s in range(1, ROUNDS + 1) if same_path(path, step_path(root, s))), None)
    if got is None:
        return [f"load_latest answered {path}, never a saved step"]
    run.apply(state)
    if run.digest() != reference_digest(cfg, got):
        return [f"load_latest answered step {got} and loaded a different state"]
    if newest is not None and got < newest:
        return [f"load_latest answered step {got} after step {newest} was acknowledged"]
    return []


def test_find_latest_beside_a_saver_with_retention(checkpointer_spec, checkpointer_factory, world_factory,
                                                   tmp_path, request):
    """A saver in another process (a 1-rank world) saves steps 1..ROUNDS, with ``keep_last=1`` (or 2)
    where declared, while this process reads in a loop: ``find_latest_checkpoint`` and, where declared,
    every third read ``load_latest`` (a restarted job's resume). Violations: an answer that is not a
    step the saver saved; None, or a step older than the newest acknowledged before the read began
    (retention deleting the step a reader looked at must make it look again, never miss the newest);
    ``load_latest`` raising, or loading a state other than its step's. ``find_latest_checkpoint``
    raising is an advisory. Afterwards resume lands on the last step, bitwise."""
    stats = Stats(request)
    cfg = config_for(checkpointer_factory, CFG)
    options = next(({"keep_last": k} for k in (1, 2)
                    if has(checkpointer_factory, C.KEEP_LAST) and accepts(checkpointer_factory, keep_last=k)), {})
    latest = has(checkpointer_factory, C.LOAD_LATEST)
    root, run_id = str(tmp_path / "root"), uuid.uuid4().hex
    os.makedirs(root)
    world = world_factory.get(1)
    world.run(T.r_start, run_id, cfg, checkpointer_spec, options)
    acked: list[int] = []
    out: dict = {}

    def saver() -> None:
        try:
            for step in range(1, ROUNDS + 1):
                world.run(T.r_train, run_id, 1)
                error = world.run(T.r_save, run_id, root, False)[0]
                if error is not None:
                    out["error"] = f"save of step {step} failed: {error}"
                    return
                acked.append(step)
        except BaseException as e:  # noqa: BLE001 - re-raised below
            out["raised"] = e

    reader = checkpointer_factory()
    thread = threading.Thread(target=saver)
    thread.start()
    strange: list[str] = []
    missed: list[str] = []
    n = 0
    try:
        while thread.is_alive():
            before = len(acked)
            newest = acked[before - 1] if before else None
            n += 1
            if latest and n % 3 == 0:
                stats.add("load_latest")
                missed += _load_latest_once(reader, root, cfg, newest)
                continue
            stats.add("reads")
            try:
                path = reader.find_latest_checkpoint(root)
            except _errors() as e:  # noqa: BLE001 - judged below
                advise(f"find_latest_checkpoint raised while a save{' with retention' if options else ''} ran beside "
                       f"it: {describe_error(e)}")
                continue
            if path is None:
                if newest is not None:
                    missed.append(f"find_latest_checkpoint answered None after step {newest} was acknowledged")
                continue
            got = next((s for s in range(1, ROUNDS + 1) if same_path(path, step_path(root, s))), None)
            if got is None:
                strange.append(str(path))
            elif newest is not None and got < newest:
                missed.append(f"find_latest_checkpoint answered step {got} after step {newest} was acknowledged")
    finally:
        thread.join()
        world.run(T.r_drop, run_id)
    if "raised" in out:
        raise out["raised"]
    assert "error" not in out, out["error"]
    assert not strange, f"find_latest_checkpoint answered directories that were never a saved step: {strange[:3]}"
    assert not missed, (f"a reader beside a save{' with retention' if options else ''} missed the newest complete "
                        f"step ({len(missed)} of {n} reads): " + "; ".join(missed[:3]))
    assert_resumed(*resume(checkpointer_factory(), root, cfg), root, ROUNDS, cfg, f"after {ROUNDS} saves: ")
