"""Symbolic links that lead out of the checkpoint root, for any checkpointer: a step directory,
a shard, the extra state and the pointer replaced by links to another run's files.

* Writing or deleting *through* such a link (retention or ``overwrite=True`` that deletes the
  files behind a step link, a save refused by an ``overwrite`` checkpointer that writes there
  anyway, a pointer update that truncates the file the pointer links to) destroys data outside
  the root: a contract violation. A checkpointer with no overwrite concept that saves over an
  existing (linked) step in place gets the overwrite-in-place advisory, with where it wrote.
* Reading through one is judged by what was loaded: another run's state (or a refusal to start)
  is a hardening advisory; this run's exact state passes, and so does skipping the link, or
  detecting that its bytes are not the step's (checksums) and landing on the root's own newest step.

The other run's files are real checkpoints of the same model with another seed, saved by the
same checkpointer, so what a loader would take from them is a valid but different state: the
oracle tells them apart by digest.
"""

from __future__ import annotations

import hashlib
import os

import pytest

from faults.contract import POINTER_FILE
from faults.contract import Capability as C
from faults.strategies import payload_files
from faults.training import RunConfig, TrainRun, _errors, reference_digest

from ._common import ResumeFailed, accepts, advise, config_for, has, refused, resume, same_path, save_step, save_steps, step_path

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
CFG, OTHER = RunConfig(seed=0), RunConfig(seed=1)


def _tree(top: str) -> dict[str, str]:
    """Every file under ``top`` (links not followed) -> its SHA-256."""
    out = {}
    for dirpath, _dirs, files in os.walk(top):
        for name in files:
            p = os.path.join(dirpath, name)
            with open(p, "rb") as f:
                out[os.path.relpath(p, top)] = hashlib.sha256(f.read()).hexdigest()
    return out


def _roots(factory, tmp_path) -> tuple[str, str, RunConfig, RunConfig]:
    """(root with steps 1 and 2 of this run, another run's root with steps 2 and 3 outside it)."""
    root, other = str(tmp_path / "root"), str(tmp_path / "elsewhere")
    cfg, ocfg = config_for(factory, CFG), config_for(factory, OTHER)
    save_steps(factory(), root, cfg, [1, 2])
    save_steps(factory(), other, ocfg, [2, 3])
    return root, other, cfg, ocfg


def _judge_read(factory, root: str, cfg: RunConfig, ocfg: RunConfig, want: int, linked: int, what: str) -> None:
    """Resume lands bitwise on ``want`` (the link skipped or caught), or on the linked step
    (``linked``) with exactly this run's state at that step (the linked bytes held nothing else):
    pass. Loading the linked step as another state, or refusing to resume: an advisory. Anything
    else (another step, a state that is neither) fails."""
    try:
        path, run = resume(factory(), root, cfg)
    except ResumeFailed as e:
        refused(e.cause, f"resuming past {what}")
        advise(f"{what}: resume raised {type(e.cause).__name__} ({str(e.cause)[:160]}) instead of skipping the link")
        return
    if same_path(path, step_path(root, want)) and run.step == want and run.digest() == reference_digest(cfg, want):
        return
    if same_path(path, step_path(root, linked)) and run.step == linked:
        # Judged by what was loaded: the linked bytes may hold exactly this run's state (an extra-state
        # file the two runs share, a step the other run saved alike): then nothing wrong was loaded.
        if run.digest() != reference_digest(cfg, linked):
            advise(f"{what}: resume followed the link out of the root and loaded another run's state as step {linked}")
        return
    raise AssertionError(f"{what}: resumed {path} (extra_state global_step {run.step}); the newest step of this "
                         f"root's own is {step_path(root, want)}")


def test_step_directory_linked_out_of_the_root(checkpointer_factory, tmp_path):
    """``global_step_3`` is a link to another run's complete step 3. Resume: see the module
    docstring. Then saves into the root -- step 3 again (refused or written beside, never into
    the link's target), with ``overwrite=True`` (declared), and steps 4 and 5 with ``keep_last=2``
    (declared; its retention removes step 3) -- must leave every file behind the link as it was."""
    root, other, cfg, ocfg = _roots(checkpointer_factory, tmp_path)
    os.symlink(step_path(other, 3), step_path(root, 3))
    before = _tree(other)
    _judge_read(checkpointer_factory, root, cfg, ocfg, 2, 3, "global_step_3 linked to another run's step")
    run = TrainRun(cfg)
    run.train_to(3)
    saves = [({}, 3)]
    if has(checkpointer_factory, C.OVERWRITE):
        saves.append(({"overwrite": True}, 3))
    if accepts(checkpointer_factory, keep_last=2):
        saves += [({"keep_last": 2}, 4), ({"keep_last": 2}, 5)]
    for options, step in saves:
        run.train_to(step)
        try:
            save_step(checkpointer_factory(**options), root, run)
        except _errors() as e:  # noqa: BLE001 - refusing is fine; writing through the link is not
            refused(e, f"a save of step {step} ({options or 'no options'}) over a linked step")
        after = _tree(other)
        changed = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
        what = (f"a save of step {step} with {options or 'no options'} changed or deleted files outside the root, "
                f"behind the link global_step_3 -> {step_path(other, 3)}: {changed[:6]}")
        if changed and not options and not has(checkpointer_factory, C.OVERWRITE):
            # no overwrite concept: saving over an existing step writes in place, here through the link
            advise(what + " (saving over an existing step in place, through the link)")
            before = after
            continue
        assert not changed, what


@pytest.mark.parametrize("kind", ["shard", "extra_state"])
def test_file_linked_out_of_the_root(checkpointer_factory, tmp_path, kind):
    """In the newest step, the largest shard (or every extra-state file) is a link to the same
    file of another run's step 2: resume skips the step or catches the foreign bytes (lands
    on step 1), or else an advisory is reported (see the module docstring)."""
    root, other, cfg, ocfg = _roots(checkpointer_factory, tmp_path)
    step = step_path(root, 2)
    files = [p for p in payload_files(step) if ("extra_state" in os.path.relpath(p, step)) == (kind == "extra_state")]
    if kind == "shard":
        files = files[:1]
    files = [p for p in files if os.path.isfile(os.path.join(step_path(other, 2), os.path.relpath(p, step)))]
    if not files:
        pytest.skip(f"the step has no {kind.replace('_', ' ')} file of its own (extra state embedded in the payload)")
    for p in files:
        os.unlink(p)
        os.symlink(os.path.join(step_path(other, 2), os.path.relpath(p, step)), p)
    _judge_read(checkpointer_factory, root, cfg, ocfg, 1, 2, f"{kind} {[os.path.relpath(p, root) for p in files]} linked "
                "to another run's")


def test_pointer_linked_out_of_the_root(checkpointer_factory, tmp_path):
    """The pointer is a link to a file outside the root: a save must replace the link (or leave
    it), never write into the file it points to; resume lands on the new step."""
    root, cfg = str(tmp_path / "root"), config_for(checkpointer_factory, CFG)
    ck = checkpointer_factory()
    run = save_steps(ck, root, cfg, [1])
    notes = str(tmp_path / "notes.txt")
    with open(notes, "w") as f:
        f.write("not a checkpoint pointer: a user's file\n")
    pointer = os.path.join(root, POINTER_FILE)
    if os.path.lexists(pointer):
        os.unlink(pointer)
    os.symlink(notes, pointer)
    run.train_to(2)
    save_step(ck, root, run)
    with open(notes) as f:
        assert f.read() == "not a checkpoint pointer: a user's file\n", (
            f"the save wrote the pointer through the link {POINTER_FILE} -> {notes}, into a file outside the root")
    path, resumed = resume(checkpointer_factory(), root, cfg)
    assert same_path(path, step_path(root, 2)) and resumed.digest() == reference_digest(cfg, 2), (
        f"with the pointer linked out of the root, resume found {path}, not {step_path(root, 2)}")
