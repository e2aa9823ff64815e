"""Damage to each file the load reads, judged by what resume returns; each file's role learned.

The suite does not guess which file is "the payload" or "the extra state" from names or sizes. It
learns (:mod:`faults.fileroles`): one resume of the newest step runs under an ``inotify`` trace
(every file any process opens: Python, C and Rust readers alike), and each file of the step is
searched for the raw bytes of the saved tensors (model parameters, optimizer state, extra state
such as RNG states). Then each file the load read is damaged on its own, in a fresh copy of the
root, and a restarted job resumes:

* it falls back to the previous step, bitwise -- fine;
* it raises an ``Exception`` naming the problem -- fine (the contract: damaged bytes raise);
* it resumes the damaged step *bitwise as saved* -- "damage to F changed nothing": fine for a file
  that holds no saved state; an advisory naming F when F holds state the load promised;
* anything else -- a different state loaded silently, a mixed fallback, nothing found although the
  previous step is intact, a hang -- is a violation naming F and its learned role.

A second property puts a pickle that would create a file when unpickled (raw, and in
``torch.save``'s zip format) in place of each file the load reads: finding and loading must never
run it, whatever the file is called and wherever it lives.
"""

from __future__ import annotations

import os
import pickle
import shutil

import pytest

from faults.fileroles import FileRole, InotifyUnavailable, learn, state_regions
from faults.findings import advise
from faults.training import RunConfig, TrainRun, describe_error, reference_digest

from ._common import IncompleteState, Stats, config_for, in_child, resume, same_path, save_steps, step_path

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
CFG = RunConfig(extra_per_rank=False)
#: a trial that has not answered in this long hung (a tiny state resumes in well under a second)
TRIAL_TIMEOUT_S = 60.0
#: fewer files read than this is stated as thin coverage (a load that reads nothing we can see)
MIN_FILES = 1


def _roles(factory, root: str, cfg: RunConfig, step: int, request) -> list[FileRole]:
    run = TrainRun(cfg)
    run.train_to(step)
    try:
        roles = learn(step_path(root, step), run.state(), lambda: resume(factory(), root, cfg))
    except InotifyUnavailable as e:
        pytest.skip(f"no inotify here to learn which files a load reads: {e}")
    read = [r for r in roles if r.read_order is not None]
    if len(read) < MIN_FILES:
        advise(f"thin coverage: the load of {os.path.basename(step_path(root, step))} opened no file the trace saw "
               f"(files: {[r.rel for r in roles]}); damage to each file was not judged")
    request.node.user_properties.append(("faults-file-roles", [r.describe() for r in roles]))
    return read


def _damage(path: str, role: FileRole, kind: str, state: dict) -> str:
    size = os.path.getsize(path)
    if kind == "deleted":
        os.unlink(path)
        return "deleted"
    if kind == "truncated":
        os.truncate(path, size // 2)
        return f"truncated {size} -> {size // 2} bytes"
    with open(path, "rb") as f:
        data = f.read()
    regions = state_regions(data, state)
    if kind == "bitflip_outside_tensors":  # headers, indexes, non-tensor items (an lr, a step count), records
        at = _outside(sorted((a, b) for _w, a, b in regions), size)
        where = " (outside every saved tensor's bytes)"
    else:
        at = (regions[0][1] + regions[0][2]) // 2 if regions else size // 2
        where = f" (inside {regions[0][0]})" if regions else ""
    with open(path, "r+b") as f:
        f.seek(at)
        f.write(bytes([data[at] ^ 0x10]))
    return f"flipped a bit at byte {at} of {size}{where}"


def _outside(spans: list[tuple[int, int]], size: int) -> int:
    """The middle of the largest stretch of the file that holds no saved tensor's bytes."""
    gaps, pos = [], 0
    for a, b in spans:
        if a > pos:
            gaps.append((pos, a))
        pos = max(pos, b)
    if pos < size:
        gaps.append((pos, size))
    a, b = max(gaps, key=lambda g: (g[1] - g[0], -g[0])) if gaps else (0, size)
    return (a + b) // 2


def _copy_root(src: str, dst: str) -> None:
    shutil.copytree(src, dst, symlinks=True)


def _resume_outcome(factory, root: str, cfg: RunConfig) -> dict:
    try:
        path, run = resume(factory(), root, cfg)
    except IncompleteState as e:
        return {"error": None, "path": "?", "silent": str(e)}
    except BaseException as e:  # noqa: BLE001 - judged by the parent
        cause = getattr(e, "cause", e)
        return {"error": describe_error(cause)[:300], "exception": isinstance(cause, Exception)}
    return {"error": None, "path": path, "step": run.step if path is not None else None,
            "digest": run.digest() if path is not None else None}


@pytest.mark.parametrize("kind", ["bitflip", "bitflip_outside_tensors", "truncated", "deleted"])
def test_damage_to_each_file_the_load_reads(checkpointer_factory, tmp_path, kind, request):
    stats = Stats(request)
    cfg = config_for(checkpointer_factory, CFG)
    pristine = str(tmp_path / "pristine")
    os.makedirs(pristine)
    save_steps(checkpointer_factory(), pristine, cfg, [1, 2])
    roles = _roles(checkpointer_factory, pristine, cfg, 2, request)
    run2 = TrainRun(cfg)
    run2.train_to(2)
    state2 = run2.state()
    want = {1: reference_digest(cfg, 1), 2: reference_digest(cfg, 2)}
    problems = []
    for i, role in enumerate(roles):
        root = str(tmp_path / f"r{i}")
        _copy_root(pristine, root)
        did = _damage(os.path.join(step_path(root, 2), role.rel), role, kind, state2)
        stats.add("files damaged")
        what = f"global_step_2/{role.describe()}: {did}"
        out = in_child(lambda root=root: _resume_outcome(checkpointer_factory, root, cfg), timeout=TRIAL_TIMEOUT_S,
                       what=f"resume after damage to {what}")
        if out["error"] is not None:
            if not out["exception"]:
                advise(f"after damage to {what}: resume raised {out['error']}, which is not an Exception subclass")
            stats.add("damage refused with an error")
            continue
        path = out["path"]
        if out.get("silent"):
            problems.append(f"damage to {what}: {out['silent']}")
            continue
        if same_path(path, step_path(root, 1)) and out["digest"] == want[1]:
            stats.add("fell back to the previous step")
            continue
        if same_path(path, step_path(root, 2)) and out["digest"] == want[2]:
            stats.add("damage changed nothing")
            if role.holds_state and kind != "bitflip_outside_tensors":  # padding may rightly be ignored
                advise(f"damage to {what} changed nothing: the resumed state is bitwise step 2's, although the file "
                       "holds saved state (is it read at all, or restored from elsewhere?)")
            continue
        if same_path(path, step_path(root, 2)):
            problems.append(f"damage to {what}: resume loaded step 2 without an error, and the state differs "
                            "from the one saved (a silently different state)")
        elif same_path(path, step_path(root, 1)):
            problems.append(f"damage to {what}: resume fell back to step 1, and the state differs from the one "
                            "step 1 saved (a fallback that mixes two steps)")
        else:
            problems.append(f"damage to {what}: resume returned {path!r} although step 1 is intact")
    assert not problems, f"{len(problems)} of {len(roles)} files the load reads:\n" + "\n".join(problems)


class _Marker:
    """Unpickling this creates a file: proof that checkpoint bytes ran code."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def _evil(marker: str, fmt: str) -> bytes:
    if fmt == "pickle":
        return pickle.dumps(_Marker(marker), protocol=2)
    import io

    import torch

    buf = io.BytesIO()
    torch.save(_Marker(marker), buf)
    return buf.getvalue()


def test_no_code_runs_from_any_file_the_load_reads(checkpointer_factory, tmp_path, request):
    """Each file the load reads (learned, whatever its name), replaced on its own by a pickle -- raw,
    and as ``torch.save`` writes one -- that would create a file when unpickled: finding and loading
    must not run it (refusing is fine)."""
    stats = Stats(request)
    cfg = config_for(checkpointer_factory, CFG)
    pristine = str(tmp_path / "pristine")
    os.makedirs(pristine)
    save_steps(checkpointer_factory(), pristine, cfg, [1, 2])
    roles = _roles(checkpointer_factory, pristine, cfg, 2, request)
    ran = []
    for i, role in enumerate(roles):
        for fmt in ("pickle", "torch.save"):
            root = str(tmp_path / f"r{i}-{fmt.replace('.', '_')}")
            _copy_root(pristine, root)
            marker = str(tmp_path / f"PWNED-{i}-{fmt}")
            with open(os.path.join(step_path(root, 2), role.rel), "wb") as f:
                f.write(_evil(marker, fmt))
            stats.add("files replaced by a pickle")
            in_child(lambda root=root: _resume_outcome(checkpointer_factory, root, cfg), timeout=TRIAL_TIMEOUT_S,
                     what=f"resume with a {fmt} pickle in place of global_step_2/{role.rel}")
            if os.path.exists(marker):
                ran.append(f"global_step_2/{role.describe()} replaced by a {fmt} pickle")
    # and an object in the caller's extra state, saved through save() itself: a checkpointer refuses it at save
    # (the safe reader cannot restore it) or stores it so that loading never unpickles it
    marker = str(tmp_path / "PWNED-saved")
    root = str(tmp_path / "saved")
    os.makedirs(root)
    run = TrainRun(cfg)
    run.train_to(1)
    state = run.state()
    state["extra_state"] = {**state["extra_state"], "user_object": _Marker(marker)}
    try:
        checkpointer_factory().save(step_path(root, 1), state, global_step=1)
    except Exception:  # noqa: BLE001 - refused at save: nothing on disk to run
        stats.add("object in extra state refused at save")
    else:
        in_child(lambda: _resume_outcome(checkpointer_factory, root, cfg), timeout=TRIAL_TIMEOUT_S,
                 what="resume of a step whose extra state holds a user object")
        stats.add("object in extra state saved, then loaded")
        if os.path.exists(marker):
            ran.append("global_step_1, saved through save() with a user object in its extra state: the load "
                       "unpickled it with a reader that runs code (torch.load(weights_only=False) or pickle.load), "
                       f"so any checkpoint's bytes can run code; files the load reads: {[r.rel for r in roles]}")
    assert not ran, "loading ran code from checkpoint bytes (a crafted pickle executed):\n" + "\n".join(ran)
