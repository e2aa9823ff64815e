"""Integrity of a step beyond its files' presence and sizes, for any checkpointer: a damaged
commit record, files that are not regular files, a tree too deep to walk recursively, and a
second job saving into the same root.

Each test saves steps through the harness interface, damages the newest step with
:data:`faults.inject.DISK_FAULTS` (reproducible from a seed, named in every failure), and
resumes as a restarted job does (``find_latest_checkpoint`` + ``load``) in a forked child
with a timeout, so a resume that hangs on a FIFO or crashes on a deep recursion is a failure
naming the fault, never a stuck or dead test run. The oracle is the suite's own: which steps
it saved and damaged, and digests recomputed by training from scratch.

* A commit record with a flipped bit, cut short, with one field changed (checksum stale), or
  with one field changed so that the record is structurally wrong and its checksum is
  recomputed (``forged``): the step is skipped, resume lands bitwise on the previous one.
  A control re-pickles the record unchanged (checksum recomputed): that step still resumes,
  so what the faults change is what is caught, not the rewriting.
* A recorded payload file replaced by a FIFO or a character device: skipped, and nothing
  blocks (a FIFO opened for reading without ``O_NONBLOCK`` would block forever).
* A directory tree 1,200 levels deep inside the newest step (not listed by its record):
  resume still lands on the step; a save with ``keep_last=1`` (whose retention deletes that
  step) and the save after it succeed.
* Two processes save into one root at once, the same step or two steps: every save that
  returned resumes bitwise as its writer's state, no step mixes the writers' files, and
  resume finds a step no older than the newest acknowledged one. A save that raised is fine.
"""

from __future__ import annotations

import gc
import os
import random
import select
import shutil
import signal
import time
import traceback

import pytest

from faults.contract import step_dir_name, step_numbers
from faults.inject import DISK_FAULTS, FaultNotApplicable, make_deep_tree, remove_tree, rewrite_record
from faults.points import FaultKind
from faults.training import NOT_AN_EXCEPTION, RunConfig, TrainRun, _errors, reference_digest

from ._common import (
    accepts,
    advise,
    config_for,
    in_child,
    load_into,
    refused_in_rank,
    resume,
    same_path,
    save_steps,
    step_path,
)

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
CFG = RunConfig()
#: Seconds one resume in a child may take before it counts as hung (a tiny model resumes in
#: well under a second; the margin is for a loaded machine).
RESUME_TIMEOUT = 60.0

FALLBACK_FAULTS = (FaultKind.BITFLIP_RECORD, FaultKind.TRUNCATED_RECORD, FaultKind.CORRUPT_RECORD_FIELD,
                   FaultKind.FORGED_RECORD_FIELD, FaultKind.FIFO_IN_STEP, FaultKind.DEVICE_IN_STEP)
#: Faults whose draw matters (which bit, where to cut) get more seeds per run than those whose
#: draw only picks among a few fields or files.
_MANY_SEEDS = (FaultKind.BITFLIP_RECORD, FaultKind.TRUNCATED_RECORD)


def _resume_in_child(factory, root: str, what: str) -> tuple[str | None, int, str]:
    """(path, step, digest) of a restarted job's resume, run in a forked child."""

    def go():
        path, run = resume(factory(), root, config_for(factory, CFG))
        return path, run.step, run.digest()

    return in_child(go, timeout=RESUME_TIMEOUT, what=what)


def _assert_landed(got: tuple[str | None, int, str], root: str, want: int, cfg: RunConfig, what: str) -> None:
    path, step, digest = got
    assert same_path(path, step_path(root, want)), (
        f"{what}: resumed {path}, the newest undamaged step is {step_path(root, want)}")
    assert step == want, f"{what}: extra_state global_step {step}, saved at {want}"
    assert digest == reference_digest(cfg, want), (
        f"{what}: state restored from step {want} differs from an uninterrupted run at step {want}")


def _restore(pristine: str, root: str) -> None:
    remove_tree(root)  # a FIFO or device node in it is unlinked, never opened
    shutil.copytree(pristine, root, symlinks=True)


@pytest.mark.parametrize("kind", [str(k) for k in FALLBACK_FAULTS])
def test_damaged_record_or_file_falls_back_without_hanging(checkpointer_factory, tmp_path, fault_budget, kind):
    """The newest step's commit record flipped / truncated / rewritten / forged, or a payload
    file replaced by a FIFO or a device node: resume skips the step and lands bitwise on the
    previous one, within the timeout, for every seed drawn."""
    kind = FaultKind(kind)
    root, pristine = str(tmp_path / "root"), str(tmp_path / "pristine")
    cfg = config_for(checkpointer_factory, CFG)
    save_steps(checkpointer_factory(), root, cfg, [1, 2])
    shutil.copytree(root, pristine, symlinks=True)
    seeds = max(2, fault_budget // 2) if kind in _MANY_SEEDS else max(1, fault_budget // 4)
    for seed in range(seeds):
        if seed:
            _restore(pristine, root)
        try:
            detail = DISK_FAULTS[kind](root, step_path(root, 2), 0, random.Random(seed))
        except FaultNotApplicable as e:
            pytest.skip(f"{kind}: {e}")
        what = f"{kind} (seed {seed}: {detail})"
        _assert_landed(_resume_in_child(checkpointer_factory, root, what), root, 1, cfg, what)


def test_record_rewritten_unchanged_still_resumes(checkpointer_factory, tmp_path):
    """Control for the record faults: the record re-pickled with nothing changed (a checksum
    footer, if it has one, recomputed) is still the newest step. So a record rewritten with one
    field changed is caught for the change, not for being rewritten."""
    root, cfg = str(tmp_path), config_for(checkpointer_factory, CFG)
    save_steps(checkpointer_factory(), root, cfg, [1, 2])
    try:
        detail = rewrite_record(step_path(root, 2), 0, random.Random(0), None, forge=True)
    except FaultNotApplicable as e:
        pytest.skip(str(e))
    what = f"control ({detail})"
    _assert_landed(_resume_in_child(checkpointer_factory, root, what), root, 2, cfg, what)


def test_deep_tree_in_a_step_breaks_neither_resume_nor_retention_nor_later_saves(checkpointer_factory, tmp_path):
    """A 1,200-level directory tree inside the newest step, which its record does not list:
    resume lands on that step bitwise, and the next saves (steps 3 and 4) succeed. With
    ``keep_last`` (declared), they save with ``keep_last=2``, whose retention deletes the step
    holding the tree; a step it leaves behind is an advisory (nothing is lost, but the disk
    fills), and resume lands on the last save."""
    retains = accepts(checkpointer_factory, keep_last=2)
    root, cfg = str(tmp_path / "root"), config_for(checkpointer_factory, CFG)
    try:
        save_steps(checkpointer_factory(), root, cfg, [1, 2])
        make_deep_tree(step_path(root, 2))

        def go():
            out = {"resume": None, "errors": [], "final": None}
            path, run = resume(checkpointer_factory(), root, cfg)
            out["resume"] = (path, run.step, run.digest())
            ck = checkpointer_factory(keep_last=2) if retains else checkpointer_factory()
            for s in (3, 4):
                run.train_to(s)
                try:
                    ck.save(step_path(root, s), run.state(), global_step=s)
                    ck.maybe_wait_for_async_save()
                except _errors() as e:  # noqa: BLE001 - judged by the parent
                    out["errors"].append(f"save of step {s}: {type(e).__name__}: {e}\n{traceback.format_exc()[-1500:]}")
            if callable(getattr(ck, "close", None)):
                ck.close()  # retention may run in the background (torchtitan's purge thread)
            path, run = resume(checkpointer_factory(), root, cfg)
            out["final"] = (path, run.step, run.digest())
            out["entries"] = sorted(os.listdir(root))
            return out

        out = in_child(go, timeout=RESUME_TIMEOUT * 2, what="deep_tree")
        _assert_landed(out["resume"], root, 2, cfg, "deep_tree: resume")
        assert not out["errors"], "deep_tree: a save after it failed: " + "\n".join(out["errors"])
        _assert_landed(out["final"], root, 4, cfg, "deep_tree: resume after two more saves")
        left = [n for n in out["entries"] if step_dir_name(2) in n]
        if retains and left:  # nothing lost, nothing wrong loaded: disk space, until someone looks
            advise(f"deep_tree: retention (keep_last=2) left {left} behind (the step holding a 1,200-level tree): "
                   "a recursive delete gave up on it, silently")
    finally:
        if os.path.lexists(root):
            remove_tree(root)  # pytest's own clean-up recurses: it must never meet the tree


# -- two writers ------------------------------------------------------------------------------

_WRITERS = {1: RunConfig(seed=1), 2: RunConfig(seed=2)}


def _start_writer(factory, root: str, cfg: RunConfig, step: int) -> tuple[int, int, int]:
    """Fork a writer: it trains ``cfg`` to ``step``, writes ``R`` when ready, waits for ``G``,
    saves, and writes ``ok`` or its error. Returns (pid, read fd, write fd) of the parent's ends."""
    to_child_r, to_child_w = os.pipe()
    from_child_r, from_child_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child's coverage is not collected
        code = 0
        try:
            gc.freeze()  # see _common.in_child
            os.close(to_child_w)
            os.close(from_child_r)
            run = TrainRun(cfg)
            run.train_to(step)
            ck = factory()
            os.write(from_child_w, b"R")
            if os.read(to_child_r, 1) != b"G":
                os._exit(3)
            try:
                ck.save(step_path(root, step), run.state(), global_step=step)
                ck.maybe_wait_for_async_save()
                report = "ok"
            except _errors() as e:  # noqa: BLE001 - a save that raised is fine; reported
                report = ("" if isinstance(e, Exception) else NOT_AN_EXCEPTION) + f"{type(e).__name__}: {e}"
            data = report.encode()[:60000]
            while data:
                data = data[os.write(from_child_w, data):]
        except BaseException:  # noqa: BLE001
            traceback.print_exc()
            code = 1
        finally:
            os._exit(code)
    os.close(to_child_r)
    os.close(from_child_w)
    return pid, from_child_r, to_child_w


def _read_all(fd: int, deadline: float, what: str, first: int | None = None) -> bytes:
    """``first`` bytes from ``fd``, or everything up to EOF; a writer that stays silent past
    ``deadline`` fails the test (the caller's ``finally`` kills it)."""
    out = b""
    while first is None or len(out) < first:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            raise AssertionError(f"{what}: no answer within the timeout (hung)")
        chunk = os.read(fd, 1 if first is not None else 1 << 16)
        if not chunk:
            break
        out += chunk
    return out


@pytest.mark.parametrize("variant", ["same_step", "different_steps"])
def test_two_writers_in_one_root(checkpointer_factory, tmp_path, variant):
    """Two processes save into one root: the same step at the same moment (they meet at a gate
    first), or two different steps, the older one's save ending after the newer one's (a lagging
    job beside its restart), on top of a step a third run saved before. Every save
    that returned must resume bitwise as its own writer's state; no step on disk may mix the
    writers' files (it must load as exactly one writer's state, or not at all); resume lands
    on a step no older than the newest acknowledged one. A save that raised is fine."""
    root = str(tmp_path / "root")
    base = config_for(checkpointer_factory, CFG)
    writers = {w: config_for(checkpointer_factory, cfg) for w, cfg in _WRITERS.items()}
    save_steps(checkpointer_factory(), root, base, [1])
    steps = {1: 3, 2: 3} if variant == "same_step" else {1: 3, 2: 4}
    procs = {}
    deadline = time.monotonic() + RESUME_TIMEOUT * 2
    try:
        for w, cfg in writers.items():
            procs[w] = _start_writer(checkpointer_factory, root, cfg, steps[w])
        for w, (_pid, rfd, _wfd) in procs.items():
            assert _read_all(rfd, deadline, f"writer {w} getting ready", first=1) == b"R", f"writer {w} died"
        if variant == "same_step":
            for _pid, _rfd, wfd in procs.values():
                os.write(wfd, b"G")  # both are waiting: the saves start together
            reports = {w: _read_all(rfd, deadline, f"writer {w} saving step {steps[w]}").decode()
                       for w, (_pid, rfd, _wfd) in procs.items()}
        else:
            # A lagging job's save of an older step ends after the newer step's save: the order that
            # loses the newest step where a save repoints "latest" unconditionally. Forced, not raced,
            # so the verdict is the same in every run (two concurrent writers of different steps are
            # test_shared_root's).
            reports = {}
            for w in (2, 1):
                _pid, rfd, wfd = procs[w]
                os.write(wfd, b"G")
                reports[w] = _read_all(rfd, deadline, f"writer {w} saving step {steps[w]}").decode()
    finally:
        for pid, rfd, wfd in procs.values():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            os.waitpid(pid, 0)
            os.close(rfd)
            os.close(wfd)
    for w, rep in reports.items():
        assert rep, f"writer {w} died during its save of step {steps[w]} (no report)"
    refused_in_rank(reports.values(), "a save that lost to a second writer")
    acked = {w: steps[w] for w, rep in reports.items() if rep == "ok"}
    summary = ", ".join(f"writer {w} step {steps[w]}: {reports[w][:200]}" for w in sorted(reports))
    if variant == "same_step":
        assert len(acked) < 2, f"both writers were told step 3 is saved; one was overwritten ({summary})"

    candidates = {1: [base], **{s: [writers[w] for w in writers if steps[w] == s] for s in set(steps.values())}}

    def go():
        out = {}
        for s in step_numbers(root):
            run = TrainRun(base)
            try:
                load_into(checkpointer_factory(), step_path(root, s), run)
                out[s] = (None, run.step, run.digest())
            except _errors() as e:  # noqa: BLE001 - a step that refuses to load is not a mix
                out[s] = (f"{type(e).__name__}: {str(e)[:300]}", None, None)
        path, run = resume(checkpointer_factory(), root, base)
        return out, (path, run.step, run.digest())

    loads, latest = in_child(go, timeout=RESUME_TIMEOUT, what=f"loading after two writers ({summary})")
    refs = {(s, cfg.seed): reference_digest(cfg, s) for s, cfgs in candidates.items() for cfg in cfgs}
    for w, s in acked.items():
        err, step, digest = loads.get(s, ("not on disk", None, None))
        assert err is None and step == s and digest == refs[(s, writers[w].seed)], (
            f"writer {w}'s acknowledged step {s} does not load as its state: {err or 'another state'} ({summary})")
    for s, (err, step, digest) in loads.items():
        if err is None:
            assert step == s and digest in {refs[(s, c.seed)] for c in candidates.get(s, [])}, (
                f"step {s} loads as a state no writer saved: the writers' files are mixed ({summary})")
    newest = max([1, *acked.values()])
    path, step, digest = latest
    assert path is not None and step >= newest, f"resume found {path}; the newest acknowledged step is {newest} ({summary})"
    assert digest in {refs[(step, c.seed)] for c in candidates.get(step, [])}, (
        f"resume landed on {path} with a state no writer saved ({summary})")
