"""A shared root, for any checkpointer: readers beside a writer with retention, a reader in another
pid namespace (another host's view of pids), interrupted saves of many steps, two writers of
different steps. Real processes, real SIGKILLs, real files; time on the file system moved with
``os.utime`` (:mod:`faults.sharedroot`), never waited for.

Properties (docs/design.md, "Readers and leftovers on a shared root"):

* a reader never gets None, or a step older than the newest acknowledged before it asked, while
  a writer with ``keep_last`` runs beside it (``find_latest_checkpoint``, and ``load_latest`` where
  declared: it must land on a complete step and load it exactly) -- :mod:`test_pointer_and_readers`
  runs the racing reader; here, the paused one;
* a reader in another pid namespace, paused inside its load while the writer saves with
  ``keep_last=1``: its load returns the step's exact state or raises (a different state is a
  violation; a load that raised because retention deleted the step under it is an advisory, and a
  violation for ``load_latest``, which must land on a complete step); once it is SIGKILLed, it pins
  nothing after :data:`faults.sharedroot.MAX_PIN_S` of file-system time;
* interrupted saves (SIGKILLed after writing payload) of two steps, each followed by a good save,
  leave no more beside the kept steps than one interrupted save left;
* two writers saving different steps into one root at once never fail each other, and resume
  lands on the newest step bitwise.
"""

from __future__ import annotations

import json
import os
import threading
import time

import pytest

from faults import sharedroot as S
from faults.contract import POINTER_FILE
from faults.contract import Capability as C
from faults.findings import advise
from faults.training import RunConfig, TrainRun, _errors, describe_error, reference_digest

from ._common import accepts, assert_resumed, config_for, has, make, resume, save_step, step_path

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
CFG = RunConfig()
#: How long retention that deletes in the background (torchtitan's purge thread) may take to delete a
#: step after the save that dooms it returned (seconds).
PURGE_S = 30.0
#: Saves per writer in the two-writers property.
SAVES_PER_WRITER = 6


def _keep_last(factory) -> dict:
    """``keep_last=1``, else 2 (some checkpointers refuse 1); skip when neither is declared."""
    for k in (1, 2):
        if has(factory, C.KEEP_LAST) and accepts(factory, keep_last=k):
            return {"keep_last": k}
    pytest.skip("the checkpointer does not declare keep_last (1 or 2): retention cannot race a reader")


def _finish(proc, what: str, timeout: float = 120) -> str:
    try:
        out, err = proc.communicate(timeout=timeout)
    except Exception:
        proc.kill()
        out, err = proc.communicate()
        raise AssertionError(f"{what} did not finish within {timeout:.0f} s:\n{(out + err)[-2000:]}") from None
    if proc.returncode != 0:
        raise AssertionError(f"{what} failed in the harness (status {proc.returncode}):\n{(out + err)[-3000:]}")
    return out


def _gone_within(path: str, seconds: float) -> bool:
    """Whether ``path`` is gone now or within ``seconds`` (retention in a background thread): the
    condition itself is polled, with a deadline."""
    deadline = time.monotonic() + seconds
    while os.path.isdir(path):
        if time.monotonic() > deadline:
            return False
        threading.Event().wait(0.05)
    return True


def _first_step(factory, tmp_path):
    """(options: ``keep_last=2`` where declared, root, config, checkpointer, a third of a step's bytes)
    after step 1 was saved into a new root."""
    options = {"keep_last": 2} if has(factory, C.KEEP_LAST) and accepts(factory, keep_last=2) else {}
    root, cfg = str(tmp_path / "root"), config_for(factory, CFG)
    os.makedirs(root)
    ck = make(factory, **options)
    _saves(ck, root, cfg, [1])
    return options, root, cfg, ck, S.tree_bytes(step_path(root, 1)) // 3


def _files(step_dir: str) -> set[str]:
    return {os.path.relpath(os.path.join(d, f), step_dir) for d, _, fs in os.walk(step_dir) for f in fs}


def _saves(ck, root: str, cfg, steps) -> None:
    run = TrainRun(cfg)
    for s in steps:
        run.train_to(s)
        save_step(ck, root, run)


@pytest.mark.parametrize("mode,scope", [("load", "step"), ("load_latest", "step"), ("load_latest", "root")])
def test_a_reader_in_another_pid_namespace_is_never_deleted_under_and_never_pins_forever(
        checkpointer_spec, checkpointer_factory, tmp_path, mode, scope):
    """``scope="step"``: paused at its first open of a file of step 1; ``"root"``: at its first open of
    anything under the root, before it read the step it will choose (``load_latest`` must then look
    again when that step vanished, and land on step 3)."""
    if mode == "load_latest" and not has(checkpointer_factory, C.LOAD_LATEST):
        pytest.skip("the checkpointer does not declare load_latest")
    options = _keep_last(checkpointer_factory)
    k = options["keep_last"]
    prefix = S.unshare_argv()
    if prefix is None:
        pytest.skip("this machine refuses a pid namespace of its own (unshare --pid needs root or user "
                    "namespaces): a reader on another host cannot be played here")
    root, cfg = str(tmp_path / "root"), config_for(checkpointer_factory, CFG)
    os.makedirs(root)
    writer = make(checkpointer_factory, **options)
    _saves(writer, root, cfg, [1])
    before = set(os.listdir(root))
    reader = S.start(S.READER_SCRIPT, checkpointer_spec, root, cfg, {}, "1", mode, scope, prefix=prefix)
    first = reader.stdout.readline().strip()
    if not first.startswith("paused"):
        out = first + "\n" + _finish(reader, "the reader")
        if "never-paused" in out:
            pytest.skip("the reader's load opened no file of the step through Python (native reads): it cannot "
                        "be paused inside its load here")
        raise AssertionError(f"the reader in another pid namespace did not start its load:\n{out[-2000:]}")
    held = set(os.listdir(root)) - before  # what the reader made in the root: its lease, if it takes one
    files = _files(step_path(root, 1))
    _saves(writer, root, cfg, [2, 3])  # retention (keep_last=1, or 2) deletes step 1 unless the reader holds it
    reader.stdin.write("go\n")
    reader.stdin.flush()
    out = _finish(reader, "the reader")
    # judged once the reader is done: retention may delete in the background, file by file
    deleted_under = not files <= _files(step_path(root, 1))
    result = json.loads(next(ln for ln in out.splitlines() if ln.startswith("result "))[len("result "):])
    if "raised" in result:
        what = (f"{mode} of step 1 by a reader in another pid namespace raised {result['raised']}"
                f"{' after retention deleted step 1 under it' if deleted_under else ''}")
        why = ("load_latest must land on a complete step (step 3 was there)" if mode == "load_latest"
               else "step 1 was complete throughout")
        assert mode == "load" and deleted_under, f"{what}: {why}"
        advise(f"{what}: a reader on another host (or in a container) is invisible to retention; take a lease that "
               f"any host can judge")
    else:
        got = result["step"]
        assert result["digest"] == reference_digest(cfg, got), (
            f"{mode} by a reader in another pid namespace returned a state that is not step {got}'s"
            f"{' (retention deleted step 1 under it)' if deleted_under else ''}")
        if mode == "load_latest":
            complete = "step 3 was" if deleted_under else "steps 1 and 3 were"
            assert result["path"] is not None, (
                f"load_latest by a reader in another pid namespace answered None (paused at its first open under "
                f"the {scope}) while {complete} complete")
            want = (3,) if deleted_under else (1, 3)
            assert got in want and os.path.basename(result["path"]) == f"global_step_{got}", (
                f"load_latest by a reader in another pid namespace (paused under the {scope}) resumed {result['path']}; "
                f"complete then: {['step 1'] if not deleted_under else []} + ['step 3']")
    # The reader is gone (it exited; a SIGKILLed one leaves the same files). Whatever it left must not
    # pin step 1 once the file system's clock moved past any expiry.
    before = set(os.listdir(root))
    reader2 = S.start(S.READER_SCRIPT, checkpointer_spec, root, cfg, {}, "3", "load", "step", prefix=prefix)
    if reader2.stdout.readline().startswith("paused"):
        held |= set(os.listdir(root)) - before
        reader2.kill()  # SIGKILL inside its load: whatever it holds stays on disk, unrenewed
    reader2.wait()
    S.age_files(root, held)
    _saves(writer, root, cfg, list(range(4, 4 + k)))  # step 3 is older than the newest k after these
    assert _gone_within(step_path(root, 3), PURGE_S), (
        f"step 3, read by a reader in another pid namespace that was SIGKILLed, is still kept after {S.MAX_PIN_S} s "
        f"of file-system time and saves with keep_last={k}: a dead reader on another host pins it forever "
        f"(its files: {sorted(held)})")
    assert_resumed(*resume(checkpointer_factory(), root, cfg), root, 3 + k, cfg, "after the readers: ")


def test_interrupted_saves_leave_bounded_disk(checkpointer_spec, checkpointer_factory, tmp_path):
    """Two saves of new steps, each SIGKILLed once a third of a step's bytes are written (at an fsync
    of such a file, or a rename after them) and followed by a good save: what the root holds
    beside the acknowledged steps (retention, where declared, keeps two) must not grow with the number
    of interrupted saves -- at most what one interrupted save left."""
    options, root, cfg, ck, min_bytes = _first_step(checkpointer_factory, tmp_path)
    acked, one_interrupted = [1], None
    for good in (2, 3):
        keep = {f"global_step_{s}" for s in (acked[-2:] if options else acked)} | {POINTER_FILE}
        child = S.start(S.STOPPED_SAVE_SCRIPT, checkpointer_spec, root, cfg, options, str(100 + good), str(min_bytes),
                        "kill")
        out, err = child.communicate(timeout=120)
        if child.returncode != -9:
            pytest.skip(f"the save made no fsync of a file of {min_bytes} bytes or more, nor a rename once that many "
                        f"bytes were written (status {child.returncode}): it could not be killed after writing its "
                        f"payload")
        if one_interrupted is None:
            one_interrupted = sum(S.leftover_bytes(root, keep).values())
        _saves(ck, root, cfg, [good])
        acked.append(good)
    keep = {f"global_step_{s}" for s in (acked[-2:] if options else acked)} | {POINTER_FILE}
    left = {n: b for n, b in S.leftover_bytes(root, keep).items() if b}
    assert sum(left.values()) <= (one_interrupted or 0), (
        f"2 interrupted saves (SIGKILLed after writing payload), each followed by a good save, left "
        f"{sum(left.values())} bytes beside the steps, more than one interrupted save leaves ({one_interrupted}): "
        f"{sorted(left)[:6]}; saves never reclaim what an interrupted save of another step left")
    assert_resumed(*resume(checkpointer_factory(), root, cfg), root, 3, cfg, "after interrupted saves: ")


def test_two_writers_of_different_steps_never_fail_each_other(checkpointer_spec, checkpointer_factory, tmp_path):
    """Two jobs in one root by mistake (``keep_last=2`` where declared). Forced first: the other job's
    save of step 2 pauses once the bulk of its payload is written, while this one saves steps 3, 5
    and 7; then it goes on -- every save, its own included, must succeed; its save of step 10 pauses
    at its pointer's rename while this one saves step 9. Then both save odd and even steps at once.
    No save may fail because of the other; resume lands on the newest step, bitwise."""
    options, root, cfg, ck, min_bytes = _first_step(checkpointer_factory, tmp_path)
    def beside_paused(other_step: int, min_bytes: int, action: str, own: list[int], where: str) -> list[str]:
        """The other job's save of ``other_step`` pauses (``action``) while this one saves ``own``."""
        other = S.start(S.STOPPED_SAVE_SCRIPT, checkpointer_spec, root, cfg, options, str(other_step),
                        str(min_bytes), action)
        assert other.stdout is not None and other.stdin is not None  # pipes, as S.start opens them
        first = other.stdout.readline().strip()
        problems = []
        if first == "paused":
            for step in own:
                try:
                    _saves(ck, root, cfg, [step])
                except _errors() as e:  # noqa: BLE001 - judged below
                    problems.append(f"failed {step} (while the other job's save of step {other_step} was paused "
                                    f"{where}): {describe_error(e)[:300]}")
            other.stdin.write("go\n")
            other.stdin.flush()
        out = first + "\n" + _finish(other, "the other writer")
        return problems + [f"{ln} (paused {where} while this job saved {own})" for ln in S.saves_problems([out])]

    failed = beside_paused(2, min_bytes, "pause", [3, 5, 7], "after its payload")
    # Forced again, at the other job's pointer: its save of step 10 (the newest: it names it) pauses at
    # its first rename of a file directly in the root (a pointer through a tmp file).
    failed += beside_paused(10, 0, "pause-root-rename", [9], "at its pointer")
    n = SAVES_PER_WRITER
    jobs = [S.start(S.SAVES_SCRIPT, checkpointer_spec, root, cfg, options,
                    json.dumps(list(range(first_step, first_step + 2 * n, 2)))) for first_step in (11, 12)]
    outs = [_finish(j, f"writer {i + 1}", timeout=240) for i, j in enumerate(jobs)]
    failed += S.saves_problems(outs)
    assert not failed, (f"{len(failed)} saves by two writers of different steps in one root failed: "
                        + " | ".join(failed[:2])[:1500])
    newest = 10 + 2 * n
    assert_resumed(*resume(checkpointer_factory(), root, cfg), root, newest, cfg, "after two writers: ")
