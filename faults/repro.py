"""``python -m faults repro NODEID --checkpointer SPEC``: a finding of :mod:`faults.suite` as a
standalone script -- torch and the checkpointer under test only, no ``faults`` -- that shows the
defect and exits 1 while it is present (0 once it is gone): what a user attaches to a bug report.

How a reproducer is made
------------------------
1. *Record.* The failing test runs once more (pytest, ``--hypothesis-seed`` pinned, shrinking
   kept, so the last example the test runs is the minimal failing one) with
   ``FAULTS_REPRO_RECORD=<dir>`` set. :func:`faults.training.load_factory`, which makes every
   checkpointer of the suite (the test's process, its forked children, its ranks), then wraps the
   factory (:func:`recording_factory`): each object it makes is a recording proxy. For each contract
   call (``save``, ``load``, ``find_latest_checkpoint``, ``load_latest``, ``maybe_wait_for_async_save``,
   ``raise_for_failed_async_save``) the proxy writes, before the call, the method, its arguments (the
   state serialised with ``torch.save``), and a snapshot of the checkpoint root's files (relative path
   -> bytes, links as links, FIFOs as FIFOs); after it, the outcome (the path returned, the state
   loaded, or the exception's type and message) and a second snapshot. This module is also loaded as
   a pytest plugin (``-p faults.repro``) for that run: it selects NODEID and writes how the test
   ended and which recorded call raised the exception that failed it, if one did.
2. *Choose the episode.* Records are grouped by checkpoint root. Each root's calls are judged
   (:class:`Judge`, below) by what the contract expects; the root whose last violation came last
   (Hypothesis replays the failing example last) is the episode. What the harness did to the files
   between two calls (damage, a crash's leftovers) is the difference between the snapshot after one
   call and the snapshot before the next.
3. *Write the script.* The recorded calls, the harness's file operations between them, the states
   and files (zlib-compressed, base64), the runtime part of this module (between the ``runtime``
   markers: stdlib and torch only), and the checkpointer: an adapter of :mod:`faults.adapters` is
   inlined (its source, with each name it imports from ``faults`` replaced by a copy of that name's
   definition); any other ``MODULE:FACTORY`` is imported as is.
4. *Verify.* The script is run once with the ``faults`` package hidden; it must exit 1.

What the script checks (the contract, :mod:`faults.contract`)
-------------------------------------------------------------
* a ``load`` of an acknowledged, intact step returns exactly the state saved there (every saved
  tensor bitwise, every saved value; extra state exactly, keys included); one of a step damaged
  after its save was acknowledged raises;
* ``find_latest_checkpoint`` names the newest acknowledged step not damaged in its structure (a
  file missing, truncated, added, or a commit record changed), or a newer step that is only
  damaged in content (a flipped payload bit, which only reading finds), or a step whose outcome is
  unknown (left by a killed save, made by the harness); never a step whose save failed;
* the call whose exception failed the suite's test must not raise; no call may hang (a timeout).

Replay modes: ``exact`` (the recorded checkpointer; the files the harness touched are put back
byte for byte) and ``mapped`` (another checkpointer, ``--checkpointer``: each file operation is
applied to the file of the same role -- commit record, shard, extra state, by the contract's names
-- in the same step, at the same relative offset), so that the episode can be replayed on a
correct checkpointer, which must exit 0.

Not reproducible (the command says so and writes nothing): episodes of more than one rank (state
with DTensors, collectives), calls whose arguments cannot be serialised (a lambda in extra state),
roots over the size cap, paths outside the root (links out of it), a fault injected *inside* a
call (a patched ``os`` call, a signal, a file-size limit, a kill at an operation: the snapshots see
only what happened between calls), and findings that no contract call shows (memory bounds, code
run by unpickling, disk leaks, timing of interrupts).
"""

from __future__ import annotations

import argparse
import base64
import collections
import datetime
import hashlib
import inspect
import io
import itertools
import json
import os
import pickle
import pprint
import re
import shutil
import stat
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import zlib
from collections.abc import Callable, Iterable
from typing import Any

from .contract import (
    COMMIT_RECORD,
    DEFAULT_CHECKPOINTER,
    EXTRA_STATE_DIR,
    POINTER_FILE,
    RANK_RECORD_RE,
    SHARD_SUFFIXES,
    STEP_PREFIX,
)

__all__ = ["ENV_RECORD", "ENV_SELECT", "recording_factory", "Judge", "Episode", "load_episode", "build_script",
           "hidden_faults_env", "main"]

PROG = "python -m faults repro"
#: Set by the command for the test run: the directory records go to (the switch of the hook in
#: :func:`faults.training.load_factory`).
ENV_RECORD = "FAULTS_REPRO_RECORD"
#: The test the recording run selects (NODEID as given).
ENV_SELECT = "FAULTS_REPRO_SELECT"
#: The contract calls a proxy records; any other attribute is passed through unrecorded.
METHODS = ("save", "load", "find_latest_checkpoint", "load_latest", "maybe_wait_for_async_save",
           "raise_for_failed_async_save")
#: Caps of what one snapshot, one state and one episode may hold (tests use small tensors).
SNAPSHOT_BYTES = 32 << 20
SNAPSHOT_ENTRIES = 4000
STATE_BYTES = 16 << 20
EPISODE_BYTES = 48 << 20


# =====================================================================================================
# --- runtime: begin (copied verbatim into every reproducer: the standard library and torch only) ---
# The script defines STEP_PREFIX, POINTER_FILE, COMMIT_RECORD, RANK_RECORD_RE, EXTRA_STATE_DIR and
# SHARD_SUFFIXES (faults.contract's values) before this part.

def _step_of(name: str) -> int | None:
    """``N`` of ``global_step_<N>`` (the first component of a root-relative path), else None."""
    head = name.split("/", 1)[0]
    rest = head[len(STEP_PREFIX):]
    return int(rest) if head.startswith(STEP_PREFIX) and rest.isdigit() and rest.isascii() else None


def _is_record(name: str) -> bool:
    return name == COMMIT_RECORD or RANK_RECORD_RE.fullmatch(name) is not None


def _role(rel: str) -> str:
    """What a file inside a step directory is, by the contract's names: record, extra, shard, other."""
    inner = rel.split("/", 1)[1] if "/" in rel else ""
    if "/" not in inner and _is_record(inner):
        return "record"
    if inner.startswith(EXTRA_STATE_DIR + "/"):
        return "extra"
    if inner.endswith(tuple(SHARD_SUFFIXES)):
        return "shard"
    return "other"


def _load_obj(data: bytes) -> Any:
    import torch

    return torch.load(io.BytesIO(data), weights_only=False, map_location="cpu")


def error_text(e: BaseException) -> str:
    """``str(e)``'s first line, and for DCP's ``CheckpointException`` (whose message is a traceback per
    rank) each rank's own error."""
    def first(x: BaseException) -> str:
        lines = str(x).strip().splitlines()
        return lines[0] if lines else ""

    text = first(e)
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict):
        for rank, failure in sorted(failures.items(), key=lambda kv: str(kv[0]))[:4]:
            inner = failure[0] if isinstance(failure, tuple) else failure
            if isinstance(inner, BaseException):
                text += f"; rank {rank}: {type(inner).__name__}: {first(inner)[:300]}"
    return text[:2000]


def _same_tensor(a: Any, b: Any, t: Any) -> str | None:
    """None when ``b`` is ``a`` bitwise; else how it differs (the first element that does, and whether
    ``b`` is still the load target's ``t``: never restored)."""
    import torch

    if not isinstance(b, torch.Tensor):
        return f"a tensor was saved, {type(b).__name__} came back"
    if a.dtype != b.dtype or tuple(a.shape) != tuple(b.shape):
        return f"saved {a.dtype} {tuple(a.shape)}, loaded {b.dtype} {tuple(b.shape)}"
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    x, y = (v.detach().cpu().contiguous().reshape(-1) for v in (a, b))
    size = x.element_size()
    if size not in ints or x.dtype.is_complex:
        same = torch.equal(x.view(torch.uint8), y.view(torch.uint8))
        return None if same else "bytes differ"
    diff = (x.view(ints[size]) != y.view(ints[size])).nonzero()
    if not len(diff):
        return None
    i = int(diff[0])
    where = f"element {i}" if x.numel() > 1 else "value"
    text = f"{len(diff)} of {x.numel()} elements differ; {where}: saved {x[i].item()!r}, loaded {y[i].item()!r}"
    if isinstance(t, torch.Tensor) and t.dtype == b.dtype and tuple(t.shape) == tuple(b.shape) \
            and _same_tensor(t, b, None) is None:
        text += " -- never restored: still the load target's own value"
    return text


def state_mismatch(saved: Any, loaded: Any, *, extra: bool, strict_model: bool = True, target: Any = None) -> list[str]:
    """Where ``loaded`` differs from ``saved``: each saved tensor bitwise, each saved value; the
    optimizer and model entries a load target holds beyond the saved ones (primed moments of
    parameters that never had a gradient) are not compared. ``extra``: ``saved["extra_state"]`` is
    compared exactly (keys, types); without it, extra state is not compared at all. ``target``: the
    state as it was before the load, to tell a value never restored."""
    import torch

    out: list[str] = []

    def sub(t: Any, k: Any) -> Any:
        try:
            return t[k]
        except Exception:  # noqa: BLE001 - no such entry in the target
            return None

    def cmp(a: Any, b: Any, t: Any, path: str, exact: bool) -> None:
        if len(out) >= 12:
            return
        if isinstance(a, torch.Tensor):
            why = _same_tensor(a, b, t)
            if why:
                out.append(f"{path}: {why}")
        elif isinstance(a, dict):
            if not isinstance(b, dict):
                out.append(f"{path}: a dict was saved, {type(b).__name__} came back")
                return
            if exact and list(a) != list(b):
                out.append(f"{path}: keys {list(a)!r} saved, {list(b)!r} loaded")
            for k, v in a.items():
                if k not in b:
                    if strict_model or not path.startswith("model"):
                        out.append(f"{path}.{k}: saved, missing from the loaded state".lstrip("."))
                    continue
                cmp(v, b[k], sub(t, k), f"{path}.{k}".lstrip("."), exact)
        elif isinstance(a, (list, tuple)):
            if not isinstance(b, (list, tuple)) or len(a) != len(b) or (exact and type(a) is not type(b)):
                out.append(f"{path}: {type(a).__name__} of {len(a)} saved, {b!r:.80} loaded")
                return
            for i, (x, y) in enumerate(zip(a, b)):
                cmp(x, y, sub(t, i), f"{path}.{i}", exact)
        else:
            try:
                same = bool(a == b) and (type(a) is type(b) or not exact)
            except Exception:  # noqa: BLE001 - an object without a plain ==
                same = False
            if not same:
                out.append(f"{path}: saved {a!r:.60}, loaded {b!r:.60}")

    if not isinstance(saved, dict) or not isinstance(loaded, dict):
        return [f"saved a {type(saved).__name__}, loaded a {type(loaded).__name__}"]
    for key, value in saved.items():
        if key == "extra_state" and not extra:
            continue
        if key not in loaded:
            out.append(f"{key}: saved, missing from the loaded state")
            continue
        cmp(value, loaded[key], sub(target, key), str(key), key == "extra_state")
    return out


def _diffs(diff: list[str]) -> str:
    shown = "".join(f"\n          {d}" for d in diff[:8])
    return shown + (f"\n          ... ({len(diff) - 8} more)" if len(diff) > 8 else "")


class Judge:
    """What the contract expects of each call of an episode, given what came before it: which steps
    were acknowledged (with the state saved), which are pending in an async save, which the harness
    damaged after their acknowledgement, which are of unknown outcome. :meth:`call` returns the
    violations of one call's outcome."""

    def __init__(self, initial_steps: Iterable[int] = ()) -> None:
        self.acked: dict[int, Any] = {}
        self.pending: dict[str, tuple[int, Any]] = {}
        self.failed: set[int] = set()
        self.uncertain: set[int] = set(initial_steps)
        self.damaged: dict[int, tuple[str, str]] = {}

    def disk(self, damage: dict[int, tuple[str, str]], created: Iterable[int] = ()) -> None:
        """The harness changed these steps (``structural`` or ``content``, and what it did), or made
        steps appear (a killed save's leftovers, a copy)."""
        for s, (kind, what) in damage.items():
            if s in self.acked:
                old = self.damaged.get(s)
                if old is None or old[0] == "content":
                    self.damaged[s] = (kind, what if old is None else f"{old[1]}; {what}")
        for s in created:
            if s not in self.acked:
                self.uncertain.add(s)
                self.failed.discard(s)

    def _ack(self, step: int, state: Any) -> None:
        self.acked[step] = state
        self.damaged.pop(step, None)
        self.failed.discard(step)
        self.uncertain.discard(step)

    def _expected(self, exists: Callable[[int], bool]) -> tuple[int | None, set[int]]:
        intact = [s for s in self.acked if exists(s) and s not in self.damaged]
        newest = max(intact) if intact else None
        floor = -1 if newest is None else newest
        also = {s for s in self.acked if s > floor and exists(s) and self.damaged.get(s, ("",))[0] == "content"}
        also |= {s for s in self.uncertain | {p[0] for p in self.pending.values()} if s > floor and exists(s)}
        return newest, also

    def call(self, c: dict, out: dict, exists: Callable[[int], bool], state: Callable[[str], Any]) -> list[str]:
        """``c``: the call (method, obj, args, step of its path); ``out``: its outcome (kind
        returned/raised/hung, path, state, type, message); ``state(key)``: a recorded state."""
        m, v = c["method"], []
        raised = out["kind"] == "raised"
        err = f"{out.get('type')}: {out.get('message', '')[:300]}" if raised else ""
        if out["kind"] == "hung":
            return [f"{m} did not return within {out.get('timeout', 0):.0f} s: a hang (the contract: a hang is a violation)"]
        if raised and c.get("escaped"):
            v.append(f"{m} raised {err} -- the exception that failed the suite's test")
        obj, step = c["obj"], c.get("step")
        if m == "save":
            if raised:
                self.pending.pop(obj, None)
                if step is not None and step not in self.acked:
                    self.failed.add(step)
                    self.uncertain.discard(step)
            else:
                earlier = self.pending.pop(obj, None)  # a save first waits for the object's earlier async save
                if earlier is not None:
                    self._ack(*earlier)
                if step is not None:
                    if c["args"].get("save_async"):
                        self.pending[obj] = (step, state(c["state"])["state"])
                    else:
                        self._ack(step, state(c["state"])["state"])
        elif m == "maybe_wait_for_async_save":
            done = self.pending.pop(obj, None)
            if done is not None and not raised:
                self._ack(*done)
            elif done is not None:
                self.failed.add(done[0])
        elif m == "raise_for_failed_async_save":
            if raised and obj in self.pending:
                self.failed.add(self.pending.pop(obj)[0])
        elif m in ("find_latest_checkpoint", "load_latest"):
            newest, also = self._expected(exists)
            want = "None (no acknowledged, intact step)" if newest is None else f"{STEP_PREFIX}{newest}"
            if raised:
                if not c.get("escaped"):
                    v.append(f"{m} raised {err}; the newest acknowledged, intact step is {want}")
            else:
                got = out.get("path")
                got_step = None if got is None else _step_of(got) if "/" not in got else None
                if got is not None and got_step is None:
                    v.append(f"{m} returned {got!r}, not a step directory of the root; expected {want}")
                elif got_step != newest and got_step not in also:
                    why = ""
                    if got_step is not None and got_step in self.damaged:
                        why = f" ({STEP_PREFIX}{got_step} was damaged after its save was acknowledged: " \
                              f"{self.damaged[got_step][1]})"
                    elif got_step is not None and got_step in self.failed:
                        why = f" (the save of {STEP_PREFIX}{got_step} failed: a failed save is never resumed from)"
                    elif got_step is not None and not exists(got_step):
                        why = f" ({STEP_PREFIX}{got_step} does not exist)"
                    v.append(f"{m} returned {got}{why}; the newest acknowledged, intact step is {want}"
                             + (f" (also acceptable: {', '.join(STEP_PREFIX + str(s) for s in sorted(also))})"
                                if also else ""))
                if m == "load_latest" and got_step is not None:
                    v += self._judge_load(c, out, got_step, False)
        elif m == "load":
            if step is not None:
                v += self._judge_load(c, out, step, raised, err)
        return v

    def _judge_load(self, c: dict, out: dict, step: int, raised: bool, err: str = "") -> list[str]:
        name = f"{STEP_PREFIX}{step}"
        if step in self.damaged:
            if raised:
                return []
            kind, what = self.damaged[step]
            diff = self._diff(c, out, step)
            return [f"load of {name} returned without an error although the step was damaged after its save was "
                    f"acknowledged ({what}): damaged bytes must raise, never load as state; it loaded "
                    + (f"a state that differs from the one saved:{_diffs(diff)}" if diff
                       else "a state equal to the saved one")]
        if step not in self.acked:
            return []
        if raised:
            return [f"load of {name}, acknowledged and intact, raised {err}"]
        diff = self._diff(c, out, step)
        if diff:
            return [f"load of {name} returned a state that differs from the one saved at step {step} "
                    f"({len(diff)}{'+' if len(diff) >= 12 else ''} difference(s)):{_diffs(diff)}"]
        return []

    def _diff(self, c: dict, out: dict, step: int) -> list[str]:
        if "state" not in out:
            return []
        return state_mismatch(self.acked[step], out["state"], extra=c["args"].get("extra_state_skeleton", False),
                              strict_model=c["args"].get("strict_model", True), target=out.get("target"))


def _rm(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    elif os.path.lexists(path):
        os.unlink(path)


def _materialize(root: str, entries: dict, blob: Callable[[str], bytes]) -> list[str]:
    """Create ``entries`` (root-relative path -> ``["d"]``, ``["f", key, size]``, ``["l", target]``,
    ``["p"]``) under ``root``, parents first; returns what could not be made."""
    problems = []
    for rel in sorted(entries, key=lambda r: (r.count("/"), r)):
        e, p = entries[rel], os.path.join(root, rel)
        os.makedirs(os.path.dirname(p), exist_ok=True)
        if e[0] == "d":
            os.makedirs(p, exist_ok=True)
        elif e[0] == "f":
            with open(p, "wb") as f:
                f.write(blob(e[1]))
        elif e[0] == "l":
            os.symlink(e[1].replace("<root>", root), p)
        elif e[0] == "p":
            os.mkfifo(p)
        else:
            problems.append(f"{rel}: {e[1]} (not recreated)")
    return problems


def _largest_of_role(root: str, rel: str) -> str | None:
    """The live file of ``rel``'s role in ``rel``'s step directory (``rel`` itself if it is there),
    the largest first."""
    if os.path.lexists(os.path.join(root, rel)):
        return rel
    step_dir, role, found = rel.split("/", 1)[0], _role(rel), []
    for dirpath, _dirs, files in os.walk(os.path.join(root, step_dir)):
        for f in files:
            r = os.path.relpath(os.path.join(dirpath, f), root)
            if _role(r) == role:
                found.append((-os.path.getsize(os.path.join(root, r)), r))
    return min(found)[1] if found else None


def apply_mapped(root: str, ops: list, blob: Callable[[str], bytes]) -> tuple[dict[int, tuple[str, str]], list[str],
                                                                          list[str]]:
    """The harness's file operations on another checkpointer's files: each operation on a file of a
    step applied to the file of the same role in the same step (the file itself if it exists), at
    the same relative offset; operations elsewhere (the pointer) as recorded. Returns the damage
    applied per step, what was done, and the operations that found nothing to apply to."""
    damage: dict[int, tuple[str, str]] = {}
    missed: list[str] = []
    done: list[str] = []
    mapped: dict[str, str] = {}  # a file replaced by another kind (deleted, then made): both at its mapped file
    for op in ops:
        kind, rel = op[0], op[1]
        step = _step_of(rel)
        target = mapped.get(rel, rel)
        if step is not None and "/" in rel and kind in ("rm", "flip", "trunc", "put") and op[-1] != "d":
            found = _largest_of_role(root, rel)
            if found is None:
                missed.append(f"{kind} {rel}: no {_role(rel)} file in {rel.split('/', 1)[0]}")
                continue
            target = mapped[rel] = found
        p = os.path.join(root, target)
        if kind == "rm":
            if not os.path.lexists(p):
                continue
            _rm(p)
            what = f"deleted {target}"
        elif kind == "mk":
            _materialize(root, {target: op[2]}, blob)
            what = f"created {target}" + (f": {dict(d='a directory', p='a FIFO', l='a link').get(op[2][0], 'a file')}")
        elif kind == "flip":
            size = os.path.getsize(p)
            with open(p, "r+b") as f:
                for off, x in op[2]:
                    at = min(size - 1, off * size // max(1, op[3]))
                    f.seek(at)
                    b = f.read(1)[0]
                    f.seek(at)
                    f.write(bytes([b ^ x]))
            what = f"flipped bits of {target} at the relative offset of the recorded flip"
        elif kind == "trunc":
            size = os.path.getsize(p)
            os.truncate(p, size * op[2] // max(1, op[3]))
            what = f"truncated {target} to {op[2]}/{op[3]} of its size"
        else:  # put
            with open(p, "wb") as f:
                f.write(blob(op[2]))
            what = f"rewrote {target} with the recorded bytes"
        done.append(what)
        if step is not None:
            structural = not (kind == "flip" and _role(rel) != "record")
            old = damage.get(step)
            damage[step] = ("structural" if structural or (old and old[0] == "structural") else "content",
                            what if old is None else f"{old[1]}; {what}")
    return damage, done, missed


def _call_text(c: dict) -> str:
    args = [repr("<root>" if c["path"] == "." else f"<root>/{c['path']}")] if c.get("path") is not None else []
    if c.get("state"):
        args.append("<state>")
    args += [f"{k}={'<skeleton>' if k == 'extra_state_skeleton' else repr(v)}" for k, v in c["args"].items()]
    return f"{c['obj']}.{c['method']}({', '.join(args)})"


def _outcome_text(out: dict) -> str:
    if out["kind"] == "raised":
        return f"raised {out['type']}: {out.get('message', '')[:200]}"
    if out["kind"] == "hung":
        return "hung"
    if out["kind"] == "skipped":
        return f"skipped: {out['why']}"
    if "path" in out:
        return f"returned {'None' if out['path'] is None else repr('<root>/' + out['path'])}"
    return "returned a state" if "state" in out else "returned"


def replay(episode: dict, factory: Callable[..., Any], *, mode: str, timeout: float, root: str,
           blob: Callable[[str], bytes], say: Callable[[str], None]) -> list[tuple[int, str]]:
    """Replay ``episode`` on checkpointers from ``factory`` in ``root`` and judge each call; returns
    the violations (call number, what)."""
    objects: dict[str, Any] = {}
    initial = episode["initial"]
    if initial is not None:
        os.makedirs(root, exist_ok=True)
        for problem in _materialize(root, initial, blob):
            say(f"      note: {problem}")
    judge = Judge(s for s in {_step_of(r) for r in initial or {}} if s is not None)
    states: dict[str, Any] = {}

    def state(key: str) -> Any:
        if key not in states:
            states[key] = _load_obj(blob(key))
        return states[key]

    found_paths: dict[str, str | None] = {}
    violations: list[tuple[int, str]] = []
    for item in episode["items"]:
        if item["op"] == "disk":
            if mode == "exact":
                for top, entries in item["changed"].items():
                    _rm(os.path.join(root, top))
                    if entries:
                        os.makedirs(root, exist_ok=True)
                        _materialize(root, entries, blob)
                damage = {int(k): tuple(v) for k, v in item["damage"].items()}
                done: list[str] = []
                missed: list[str] = []
            else:
                damage, done, missed = apply_mapped(root, item["ops"], blob)
            say(f"  [-] the harness, between calls: {item['text']}")
            if done:
                say(f"      applied to this checkpointer's files as: {'; '.join(done)}")
            for m in missed:
                say(f"      not applied: {m}")
            judge.disk(damage, [int(s) for s in item["created"]])
            continue
        c, n = item, item["n"]
        if c["interrupted"] and not c["hang"]:
            say(f"  [{n}] {_call_text(c)}: killed in the recorded run (its leftovers are the next file operations)")
            continue
        if c["obj"] not in objects:
            objects[c["obj"]] = factory(**c["options"])
            say(f"      {c['obj']} = {episode['factory_name']}({', '.join(f'{k}={v!r}' for k, v in c['options'].items())})")
        ck = objects[c["obj"]]
        path = c.get("path")
        if c.get("path_from") is not None:
            path = found_paths.get(c["obj"], "<none>")
            if path is None or path == "<none>":
                say(f"  [{n}] {_call_text(c)}: skipped -- find_latest_checkpoint found nothing, so the resuming "
                    "caller loads nothing")
                continue
        kwargs = dict(c["args"])
        args: list[Any] = []
        if path is not None:
            args.append(os.path.normpath(os.path.join(root, path)))
        if c.get("state"):
            recorded = _load_obj(blob(c["state"]))
            args.append(recorded["state"])
            if "skeleton" in recorded:
                kwargs["extra_state_skeleton"] = recorded["skeleton"]
        say(f"  [{n}] {_call_text(dict(c, path=path))}")
        timer = threading.Timer(timeout, _hung, (n, c["method"], timeout))
        timer.daemon = True
        timer.start()
        try:
            ret = getattr(ck, c["method"])(*args, **kwargs)
            out: dict[str, Any] = {"kind": "returned"}
            if c["method"] in ("find_latest_checkpoint", "load_latest"):
                out["path"] = None if ret is None else os.path.relpath(os.path.normpath(os.path.abspath(str(ret))), root)
                found_paths[c["obj"]] = out["path"]
            if c["method"] in ("load", "load_latest"):
                out["state"] = ret if isinstance(ret, dict) and c["method"] == "load" else args[1]
                out["target"] = _load_obj(blob(c["state"]))["state"]
        except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
            if isinstance(e, KeyboardInterrupt) and not c["recorded"].get("type", "").endswith("KeyboardInterrupt"):
                raise
            message = error_text(e).replace(root + os.sep, "<root>/").replace(root, "<root>")
            out = {"kind": "raised", "type": f"{type(e).__module__}.{type(e).__name__}", "message": message}
            if c["method"] == "find_latest_checkpoint":
                found_paths[c["obj"]] = None
        finally:
            timer.cancel()
        step = _step_of(path) if path is not None and "/" not in path else c.get("step")
        verdict = judge.call(dict(c, step=step), out, lambda s: os.path.isdir(os.path.join(root, f"{STEP_PREFIX}{s}")),
                             state)
        same = _outcome_text(out) == _outcome_text(c["recorded"])
        say(f"      -> {_outcome_text(out)}" + ("" if same else f"   (recorded: {_outcome_text(c['recorded'])})"))
        for what in verdict:
            say(f"      VIOLATION: {what}")
            violations.append((n, what))
    return violations


def _hung(n: int, method: str, timeout: float) -> None:
    import faulthandler

    print(f"      VIOLATION: call [{n}] {method} did not return within {timeout:.0f} s: a hang (the contract: a hang "
          "is a violation). Every thread's stack:", flush=True)
    faulthandler.dump_traceback(file=sys.stdout, all_threads=True)
    print(f"\nDEFECT PRESENT: call [{n}] hung. Exit 1.", flush=True)
    sys.stdout.flush()
    os._exit(1)


def run_script(argv: list[str] | None, episode: dict, finding: dict, default_factory: Callable[[], Any],
               blob: Callable[[str], bytes]) -> int:
    """The reproducer's ``main``."""
    import argparse as _argparse
    import importlib as _importlib
    import tempfile as _tempfile

    p = _argparse.ArgumentParser(description=f"Reproducer of {finding['nodeid']} against {finding['spec']}. Exit 1: "
                                 "the defect is present; 0: every replayed call behaved as the contract asks; "
                                 "2: the replay could not run.")
    p.add_argument("--checkpointer", metavar="MODULE:FACTORY",
                   help="replay on another checkpointer (default: the one recorded, inlined above)")
    p.add_argument("--mode", choices=("exact", "mapped"),
                   help="exact: the harness's files put back byte for byte (default for the recorded checkpointer); "
                        "mapped: its operations applied to the files of the same role (default with --checkpointer)")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds a call may take before it counts as a hang")
    p.add_argument("--keep", action="store_true", help="keep the replay's checkpoint root")
    a = p.parse_args(argv)
    import warnings

    # DCP warns that it runs in a single process on every call; the suite ignores it too
    warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
    factory, name = default_factory, finding["spec"]
    if a.checkpointer:
        mod, _, attr = a.checkpointer.partition(":")
        try:
            factory = getattr(_importlib.import_module(mod), attr)
        except Exception as e:  # noqa: BLE001
            print(f"cannot import {a.checkpointer}: {type(e).__name__}: {e}")
            return 2
        name = a.checkpointer
    mode = a.mode or ("mapped" if a.checkpointer and a.checkpointer != finding["spec"] else "exact")
    if mode == "mapped" and episode.get("unmappable"):
        print(f"cannot replay in mapped mode: {episode['unmappable']}")
        return 2
    tmp = _tempfile.mkdtemp(prefix="repro-")
    root = os.path.join(tmp, "root")
    say = lambda line: print(line, flush=True)  # noqa: E731
    say(f"Reproducer of a faults.suite finding: {finding['nodeid']}")
    say(f"  recorded against {finding['spec']} ({finding['versions']}); replayed on {name}, mode {mode}")
    say("  the suite's failure (what the contract asks):")
    for line in finding["message"].splitlines()[:8]:
        say(f"    {line[:400]}")
    for line in finding["recorded"]:
        say(f"  recorded: {line.splitlines()[0][:400]}")
    say(f"Replaying {sum(1 for i in episode['items'] if i['op'] == 'call')} call(s) in {root}:")
    try:
        episode = dict(episode, factory_name=name)
        found = replay(episode, factory, mode=mode, timeout=a.timeout, root=root, blob=blob, say=say)
    except Exception as e:  # noqa: BLE001 - the replay itself failed (a factory refused its options...)
        import traceback

        traceback.print_exc()
        print(f"REPLAY FAILED: {type(e).__name__}: {e}. Exit 2.")
        return 2
    finally:
        if not a.keep:
            shutil.rmtree(tmp, ignore_errors=True)
    if found:
        again = any(n in episode["violating"] for n, _ in found)
        say(f"DEFECT PRESENT: {len(found)} violation(s)" + (" -- the recorded defect, observed again" if again else
                                                             " -- not the recorded one, another") + ". Exit 1.")
        return 1
    say("NOT REPRODUCED: every replayed call behaved as the contract asks (the defect is gone). Exit 0.")
    return 0

# --- runtime: end ---
# =====================================================================================================


# -- recording (the suite's processes, under FAULTS_REPRO_RECORD) ---------------------------------------

_COUNTER = itertools.count(1)
#: Exceptions a proxy let through, newest last: (exception, call id). The plugin looks the one that
#: failed the test up by identity (kept alive here so that ids stay theirs).
_RAISED: collections.deque = collections.deque(maxlen=64)


class _TooBig(Exception):
    pass


class _Recorder:
    def __init__(self, directory: str) -> None:
        self.dir = directory
        os.makedirs(os.path.join(directory, "blobs"), exist_ok=True)
        os.makedirs(os.path.join(directory, "calls"), exist_ok=True)

    def put(self, data: bytes) -> str:
        key = hashlib.sha256(data).hexdigest()[:32]
        path = os.path.join(self.dir, "blobs", key)
        if not os.path.exists(path):
            tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
            with open(tmp, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        return key

    def write(self, name: str, record: dict) -> None:
        path = os.path.join(self.dir, "calls", name)
        with open(path + ".tmp", "wb") as f:
            pickle.dump(record, f)
        os.replace(path + ".tmp", path)

    def snapshot(self, root: str | None) -> dict | None:
        """Root-relative path -> entry, without following links and without opening anything but
        regular files; None when ``root`` is not a directory."""
        if root is None or not os.path.isdir(root) or os.path.islink(root):
            return None
        out: dict[str, tuple] = {}
        total, stack = 0, [""]
        prefix = os.path.abspath(root) + os.sep
        while stack:
            rel = stack.pop()
            try:
                names = sorted(os.listdir(os.path.join(root, rel) if rel else root))
            except OSError as e:
                out[rel] = ("x", f"unreadable directory: {e}")
                continue
            for n in names:
                r = f"{rel}/{n}" if rel else n
                p = os.path.join(root, r)
                try:
                    st = os.lstat(p)
                except OSError:
                    continue  # gone meanwhile (a background save or purge)
                if stat.S_ISLNK(st.st_mode):
                    target = os.readlink(p)
                    out[r] = ("l", "<root>/" + target[len(prefix):] if target.startswith(prefix) else target)
                elif stat.S_ISDIR(st.st_mode):
                    out[r] = ("d",)
                    stack.append(r)
                elif stat.S_ISREG(st.st_mode):
                    total += st.st_size
                    if total > SNAPSHOT_BYTES:
                        raise _TooBig(f"the root holds more than {SNAPSHOT_BYTES >> 20} MiB")
                    try:
                        with open(p, "rb") as f:
                            data = f.read()
                    except OSError as e:
                        out[r] = ("x", f"unreadable file: {e}")
                        continue
                    out[r] = ("f", self.put(data), len(data))
                elif stat.S_ISFIFO(st.st_mode):
                    out[r] = ("p",)
                else:
                    out[r] = ("x", f"a {stat.filemode(st.st_mode)} file")
            if len(out) > SNAPSHOT_ENTRIES:
                raise _TooBig(f"the root holds more than {SNAPSHOT_ENTRIES} entries")
        return out


def _serialise(obj: Any) -> bytes:
    import torch

    def check(o: Any, depth: int = 0) -> None:
        if depth > 60:
            return
        if type(o).__name__ == "DTensor" or hasattr(o, "device_mesh"):
            raise ValueError("the state holds a DTensor (a sharded, multi-rank state)")
        if isinstance(o, torch.Tensor) and o.device.type != "cpu":
            raise ValueError(f"the state holds a tensor on {o.device}")
        if isinstance(o, dict):
            for v in o.values():
                check(v, depth + 1)
        elif isinstance(o, (list, tuple)):
            for v in o:
                check(v, depth + 1)

    check(obj)
    buf = io.BytesIO()
    torch.save(obj, buf)
    if buf.tell() > STATE_BYTES:
        raise ValueError(f"the state is larger than {STATE_BYTES >> 20} MiB")
    return buf.getvalue()


def _world_size() -> int:
    try:
        import torch.distributed as dist

        return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    except Exception:  # noqa: BLE001
        return 1


def _literal(v: Any) -> bool:
    if v is None or isinstance(v, (bool, int, float, str)):
        return True
    if isinstance(v, (list, tuple)):
        return all(_literal(x) for x in v)
    if isinstance(v, dict):
        return all(isinstance(k, str) and _literal(x) for k, x in v.items())
    return False


class _Proxy:
    """A checkpointer that records its contract calls (:data:`METHODS`) and passes everything else through."""

    def __init__(self, inner: Any, rec: _Recorder, options: dict) -> None:
        object.__setattr__(self, "_r_inner", inner)
        object.__setattr__(self, "_r_rec", rec)
        object.__setattr__(self, "_r_key", f"{os.getpid()}-{next(_COUNTER)}")
        object.__setattr__(self, "_r_options", options)
        object.__setattr__(self, "_r_root", None)

    def __getattr__(self, name: str) -> Any:
        return getattr(object.__getattribute__(self, "_r_inner"), name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._r_inner, name, value)

    def save(self, path, state, *args, **kwargs):
        return self._r_call("save", path, state, args, kwargs)

    def load(self, path, state, *args, **kwargs):
        return self._r_call("load", path, state, args, kwargs)

    def load_latest(self, root, state, *args, **kwargs):
        return self._r_call("load_latest", root, state, args, kwargs)

    def find_latest_checkpoint(self, checkpoint_dir, *args, **kwargs):
        return self._r_call("find_latest_checkpoint", checkpoint_dir, None, args, kwargs)

    def maybe_wait_for_async_save(self, *args, **kwargs):
        return self._r_call("maybe_wait_for_async_save", None, None, args, kwargs)

    def raise_for_failed_async_save(self, *args, **kwargs):
        return self._r_call("raise_for_failed_async_save", None, None, args, kwargs)

    def _r_call(self, method: str, path: Any, state: Any, args: tuple, kwargs: dict) -> Any:
        inner, rec = self._r_inner, self._r_rec
        fn = getattr(inner, method)
        try:
            record = self._r_before(method, path, state, args, kwargs)
        except Exception as e:  # noqa: BLE001 - recording never changes what the test sees
            record = {"problem": f"recording failed: {type(e).__name__}: {e}", "method": method, "root": self._r_root,
                      "obj": self._r_key, "t": time.time_ns(), "id": f"{time.time_ns()}-{os.getpid()}"}
            rec.write(record["id"] + ".call", record)
        try:
            ret = fn(path, state, *args, **kwargs) if state is not None else (
                fn(path, *args, **kwargs) if path is not None else fn(*args, **kwargs))
        except BaseException as e:
            _RAISED.append((e, record["id"]))
            self._r_after(record, {"kind": "raised", "type": f"{type(e).__module__}.{type(e).__name__}",
                                   "message": error_text(e), "exception": isinstance(e, Exception)})
            raise
        out: dict[str, Any] = {"kind": "returned"}
        try:
            if method in ("find_latest_checkpoint", "load_latest"):
                out["path"] = None if ret is None else os.path.normpath(os.path.abspath(str(ret)))
            if method in ("load", "load_latest"):
                out["state"] = rec.put(_serialise(ret if isinstance(ret, dict) else state))
        except Exception as e:  # noqa: BLE001
            out["problem"] = f"the outcome could not be recorded: {type(e).__name__}: {e}"
        self._r_after(record, out)
        return ret

    def _r_before(self, method: str, path: Any, state: Any, args: tuple, kwargs: dict) -> dict:
        rec = self._r_rec
        t = time.time_ns()
        record: dict[str, Any] = {"id": f"{t}-{os.getpid()}-{next(_COUNTER)}", "t": t, "pid": os.getpid(),
                                  "obj": self._r_key, "options": self._r_options, "method": method,
                                  "world": _world_size(), "problem": None}
        root = self._r_root
        if path is not None:
            path = os.path.normpath(os.path.abspath(str(path)))
            record["path"] = path
            is_step = STEP_PREFIX in os.path.basename(path) and method in ("save", "load")
            root = os.path.dirname(path) if is_step else path
            object.__setattr__(self, "_r_root", root)
        record["root"] = root
        if args:
            record["problem"] = f"{method} was called with positional arguments beyond the contract's: {args!r:.80}"
        plain = {k: v for k, v in kwargs.items() if k != "extra_state_skeleton"}
        if not _literal(plain):
            record["problem"] = f"{method} was called with arguments that are not literals: {plain!r:.120}"
        record["args"] = {k: (v if k != "extra_state_skeleton" else v is not None) for k, v in kwargs.items()
                          if _literal(v) or k == "extra_state_skeleton"}
        if state is not None:
            payload = {"state": state}
            if kwargs.get("extra_state_skeleton") is not None:
                payload["skeleton"] = kwargs["extra_state_skeleton"]
            try:
                record["state"] = rec.put(_serialise(payload))
            except Exception as e:  # noqa: BLE001
                record["problem"] = f"the {method} state cannot be replayed: {type(e).__name__}: {e}"
        try:
            record["before"] = rec.snapshot(root)
        except _TooBig as e:
            record["problem"] = f"root too large to snapshot: {e}"
        rec.write(record["id"] + ".call", record)
        return record

    def _r_after(self, record: dict, out: dict) -> None:
        try:
            out["t"] = time.time_ns()
            try:
                out["after"] = self._r_rec.snapshot(record.get("root"))
            except _TooBig as e:
                out["problem"] = f"root too large to snapshot: {e}"
            self._r_rec.write(record["id"] + ".out", out)
        except Exception:  # noqa: BLE001 - recording never changes what the test sees
            pass


class _RecordingFactory:
    """``factory(**options)`` whose objects are recording proxies; every other attribute (the
    declared ``capabilities``) is the factory's own."""

    def __init__(self, factory: Callable[..., Any], spec: str, rec: _Recorder) -> None:
        self._r_factory, self._r_spec, self._r_rec = factory, spec, rec

    def __getattr__(self, name: str) -> Any:
        return getattr(self._r_factory, name)

    def __call__(self, **options: Any) -> Any:
        return _Proxy(self._r_factory(**options), self._r_rec, dict(options))

    def __repr__(self) -> str:
        return repr(self._r_factory)


def recording_factory(factory: Callable[..., Any], spec: str) -> Any:
    """``factory`` wrapped so that each checkpointer it makes records its contract calls under
    ``$FAULTS_REPRO_RECORD`` (the hook of :func:`faults.training.load_factory`)."""
    return _RecordingFactory(factory, spec, _Recorder(os.environ[ENV_RECORD]))


# -- the pytest plugin of the recording run (-p faults.repro) --------------------------------------

def _short_name(name: str) -> str:
    """A collected test's name without the checkpointer's parameter (the first one, ``module:factory``),
    as docs/audit.md lists findings: ``test_x[faults.adapters.dcp:PlainDCP-a]`` -> ``test_x[a]``."""
    base, sep, params = name.partition("[")
    if not sep or ":" not in params:
        return name
    dash = params.find("-", params.index(":"))
    rest = "" if dash < 0 else params[dash + 1:-1]
    return base + (f"[{rest}]" if rest else "")


def _matches(name: str, path_stem: str, want: str) -> bool:
    """Whether a collected test is NODEID: ``test_x[params]`` with or without the checkpointer's
    parameter, optionally after ``file.py::`` or ``package.module::``."""
    file_part, _, wanted = want.rpartition("::")
    if file_part and re.split(r"[/.]", file_part[:-3] if file_part.endswith(".py") else file_part)[-1] != path_stem:
        return False
    return wanted in (name, _short_name(name))


def pytest_collection_modifyitems(session: Any, config: Any, items: list) -> None:
    want = os.environ.get(ENV_SELECT)
    if not want or not os.environ.get(ENV_RECORD):
        return
    keep = [it for it in items if _matches(it.name, it.path.stem, want)]
    base = want.rpartition("::")[2].split("[")[0]
    with open(os.path.join(os.environ[ENV_RECORD], "selected.json"), "w") as f:
        json.dump({"selected": [it.nodeid for it in keep],
                   "candidates": [_short_name(it.name) for it in items if base in it.name][:20]}, f)
    if len(keep) != 1:
        keep = []
    config.hook.pytest_deselected(items=[it for it in items if it not in keep])
    items[:] = keep


def _exception_chain(e: BaseException | None, seen: set[int] | None = None) -> list[BaseException]:
    seen = set() if seen is None else seen
    out: list[BaseException] = []
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        out.append(e)
        for inner in getattr(e, "exceptions", ()) or ():
            out += _exception_chain(inner, seen)
        cause = getattr(e, "cause", None)
        if isinstance(cause, BaseException):
            out += _exception_chain(cause, seen)
        e = e.__cause__ or e.__context__
    return out


def _result() -> dict:
    try:
        with open(os.path.join(os.environ[ENV_RECORD], "result.json")) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def _write_result(data: dict) -> None:
    with open(os.path.join(os.environ[ENV_RECORD], "result.json"), "w") as f:
        json.dump(data, f)


def pytest_runtest_logreport(report: Any) -> None:
    """How the test ended: its call phase, or a setup that failed or skipped (a teardown never hides
    a failed call)."""
    if not os.environ.get(ENV_RECORD):
        return
    data = _result()
    if not (report.when == "call" or (report.when == "setup" and not report.passed)
            or (report.failed and data.get("outcome") != "failed")):
        return
    message = ""
    if report.failed:
        message = getattr(getattr(report.longrepr, "reprcrash", None), "message", "") or str(report.longrepr)[-2000:]
    data.update(nodeid=report.nodeid, outcome=report.outcome, when=report.when, message=message,
                longrepr=str(report.longrepr or "")[-12000:])
    _write_result(data)


def pytest_exception_interact(node: Any, call: Any, report: Any) -> None:
    """Which recorded call raised the exception that failed the test, if one did (by identity)."""
    if not os.environ.get(ENV_RECORD) or call.excinfo is None or call.when == "teardown":
        return
    raised = {id(e): cid for e, cid in _RAISED}
    escaped = next((raised[id(e)] for e in _exception_chain(call.excinfo.value) if id(e) in raised), None)
    data = _result()
    if data.get("escaped") is None:
        data["escaped"] = escaped
        _write_result(data)


# -- the episode ---------------------------------------------------------------------------------------

class NotReproducible(Exception):
    """The finding's last example cannot be replayed by a script; the message says why."""


class Episode:
    """One root's recorded calls, ready to judge and to write as a script."""

    def __init__(self, root: str, calls: list[dict], blobs_dir: str, escaped: str | None) -> None:
        self.root, self.calls, self.blobs_dir, self.escaped = root, calls, blobs_dir, escaped
        self._states: dict[str, Any] = {}
        #: the calls whose violation is the one the suite's test failed on
        self.confirmed: list[int] = []

    def blob(self, key: str) -> bytes:
        with open(os.path.join(self.blobs_dir, key), "rb") as f:
            return f.read()

    def state(self, key: str) -> Any:
        if key not in self._states:
            self._states[key] = _load_obj(self.blob(key))
        return self._states[key]

    def problems(self) -> list[str]:
        out = []
        for c in self.calls:
            if c.get("problem"):
                out.append(f"{c['method']}: {c['problem']}")
            if c.get("world", 1) > 1:
                out.append(f"{c['method']} ran in a world of {c['world']} ranks: a single-process script cannot "
                           "replay collectives")
            if (c.get("out") or {}).get("problem"):
                out.append(f"{c['method']}: {c['out']['problem']}")
            p = c.get("path")
            if p is not None and p != self.root and os.path.dirname(p) != self.root:
                out.append(f"{c['method']}({p}): a path outside the root")
        end = 0
        for c in self.calls:
            if c["t"] < end:
                out.append("calls overlapped in time on the root (two writers or readers at once): a sequential "
                           "replay cannot reproduce a race")
                break
            end = max(end, (c.get("out") or {}).get("t", c["t"]))
        return sorted(set(out))

    def judge(self) -> list[tuple[int, str]]:
        """The recorded outcomes judged by :class:`Judge`: (call index, violation)."""
        items, _ = self.items()
        judge = Judge(s for s in {_step_of(r) for r in self.calls[0].get("before") or {}} if s is not None)
        out: list[tuple[int, str]] = []
        found: dict[str, str | None] = {}
        for item in items:
            if item["op"] == "disk":
                judge.disk({int(k): tuple(v) for k, v in item["damage"].items()}, [int(s) for s in item["created"]])
                continue
            c = item
            if c["interrupted"] and not c["hang"]:
                continue
            snap = self.calls[c["n"] - 1].get("before") or {}
            rec = dict(c["recorded"])
            if "state" in rec:
                rec["state"] = self.state(rec["state"])
                rec["target"] = self.state(c["state"])["state"]
            if c.get("path_from") is not None and found.get(c["obj"]) is None:
                continue
            if c["method"] == "find_latest_checkpoint":
                found[c["obj"]] = rec.get("path") if rec["kind"] == "returned" else None
            for what in judge.call(c, rec, _exists_in(snap), self.state):
                out.append((c["n"], what))
        return out

    def items(self) -> tuple[list[dict], set[str]]:
        """The script's episode: calls (numbered from 1) and, between them, what the harness did to
        the files; and the blobs they need."""
        items: list[dict] = []
        need: set[str] = set()
        names: dict[str, str] = {}
        pending: set[str] = set()
        found: dict[str, str | None] = {}
        prev_snap: dict | None = None
        first = True
        for n, c in enumerate(self.calls, 1):
            out = c.get("out")
            before = c.get("before")
            if not first and (prev_snap is not None or before is not None) and not pending:
                disk = _disk_item(prev_snap or {}, before or {}, self.blob, need)
                if disk is not None:
                    items.append(disk)
            first = False
            obj = names.setdefault(c["obj"], f"ck{len(names) + 1}")
            rel = None if c.get("path") is None else os.path.relpath(c["path"], self.root)
            item: dict[str, Any] = {"op": "call", "n": n, "obj": obj, "options": c.get("options", {}),
                                    "method": c["method"], "path": rel, "args": c.get("args", {}),
                                    "state": c.get("state"), "interrupted": out is None, "hang": False,
                                    "escaped": c["id"] == self.escaped, "path_from": None,
                                    "step": _step_of(rel) if rel is not None and "/" not in rel else None}
            if c.get("state"):
                need.add(c["state"])
            if c["method"] == "load" and rel is not None and obj in found and found[obj] == rel:
                item["path_from"] = "find_latest_checkpoint"
            if out is None:
                item["recorded"] = {"kind": "hung"}
            elif out["kind"] == "raised":
                item["recorded"] = {"kind": "raised", "type": out["type"], "message": out["message"]}
            else:
                item["recorded"] = {"kind": "returned"}
                if "path" in out:
                    item["recorded"]["path"] = None if out["path"] is None else os.path.relpath(out["path"], self.root)
                if "state" in out:
                    item["recorded"]["state"] = out["state"]
            if c["method"] == "find_latest_checkpoint":
                found[obj] = item["recorded"].get("path") if item["recorded"]["kind"] == "returned" else None
            raised = out is not None and out["kind"] == "raised"
            if c["method"] == "save":
                pending.discard(obj)  # a save first waits for the object's earlier async save
                if c.get("args", {}).get("save_async") and out is not None and not raised:
                    pending.add(obj)
            elif c["method"] == "maybe_wait_for_async_save" or (c["method"] == "raise_for_failed_async_save" and raised):
                pending.discard(obj)
            items.append(item)
            prev_snap = before if out is None else out.get("after")
        return items, need


def _exists_in(snap: dict) -> Callable[[int], bool]:
    names = set(snap)
    return lambda s: f"{STEP_PREFIX}{s}" in names


def _entry_blobs(entries: dict, need: set[str]) -> None:
    for e in entries.values():
        if e[0] == "f":
            need.add(e[1])


def _disk_item(a: dict, b: dict, blob: Callable[[str], bytes], need: set[str]) -> dict | None:
    """What changed between two snapshots of a root: as file operations (for a mapped replay), as the
    recorded state of each top-level entry touched (for an exact one), and the damage per step."""
    def same(x: tuple, y: tuple) -> bool:
        return tuple(x[:2]) == tuple(y[:2])

    gone = sorted((r for r in a if r not in b or a[r][0] != b[r][0]), key=lambda r: (-r.count("/"), r))
    new = sorted((r for r in b if r not in a or a[r][0] != b[r][0]), key=lambda r: (r.count("/"), r))
    changed = sorted(r for r in a if r in b and a[r][0] == b[r][0] and not same(a[r], b[r]))
    if not gone and not new and not changed:
        return None
    ops: list[list] = []
    texts: list[str] = []
    damage: dict[int, list[str]] = {}

    def hurt(rel: str, structural: bool, text: str) -> None:
        texts.append(text)
        s = _step_of(rel)
        if s is not None:
            kind, old = ("structural" if structural else "content"), damage.get(s)
            if old is not None:
                kind = "structural" if "structural" in (kind, old[0]) else "content"
                text = f"{old[1]}; {text}"
            damage[s] = [kind, text]

    for r in gone:
        ops.append(["rm", r, a[r][0]])
        hurt(r, True, f"deleted {r}" + (f" ({a[r][2]} bytes)" if a[r][0] == "f" else " (a directory)" if a[r][0] == "d"
                                          else ""))
    for r in new:
        e = list(b[r])
        ops.append(["mk", r, e])
        if e[0] == "f":
            need.add(e[1])
        kinds = {"d": "a directory", "p": "a FIFO"}
        kind = (f"a file of {e[2]} bytes" if e[0] == "f" else f"a link to {e[1]}" if e[0] == "l"
                else kinds.get(e[0], str(e[-1])))
        hurt(r, True, f"created {r}: {kind}")
    for r in changed:
        if a[r][0] == "l":
            ops += [["rm", r, "l"], ["mk", r, list(b[r])]]
            hurt(r, True, f"relinked {r} to {b[r][1]}")
            continue
        if a[r][0] != "f":
            continue
        old, now = blob(a[r][1]), blob(b[r][1])
        need.add(b[r][1])
        if len(old) == len(now):
            diffs = [(i, x ^ y) for i, (x, y) in enumerate(zip(old, now)) if x != y]
            if len(diffs) <= 64:
                ops.append(["flip", r, diffs, len(old), "f"])
                where = ", ".join(f"byte {i} (xor 0x{x:02x})" for i, x in diffs[:4])
                hurt(r, _role(r) == "record", f"flipped {sum(bin(x).count('1') for _, x in diffs)} bit(s) of {r} at {where}")
                continue
        if now == old[:len(now)]:
            ops.append(["trunc", r, len(now), len(old), "f"])
            hurt(r, True, f"truncated {r} from {len(old)} to {len(now)} bytes")
            continue
        ops.append(["put", r, b[r][1], "f"])
        shown = repr(now[:40]) + ("..." if len(now) > 40 else "")
        hurt(r, True, f"rewrote {r} ({len(old)} -> {len(now)} bytes: {shown})")
    tops = sorted({r.split("/", 1)[0] for r in (*gone, *new, *changed)})
    exact: dict[str, dict] = {}
    for t in tops:
        sub = {r: list(e) for r, e in b.items() if r == t or r.startswith(t + "/")}
        _entry_blobs(sub, need)
        exact[t] = sub
    created = sorted({s for r in new if (s := _step_of(r)) is not None and r.count("/") == 0})
    pointer_only = all(t == POINTER_FILE for t in tops)
    return {"op": "disk", "ops": ops, "changed": exact, "damage": {str(k): v for k, v in damage.items()},
            "created": created, "text": "; ".join(texts[:12]) + (f"; ... ({len(texts)} changes)" if len(texts) > 12
                                                                  else ""), "pointer_only": pointer_only}


def load_episode(record_dir: str) -> tuple[Episode, list[tuple[int, str]], dict]:
    """The episode of the finding recorded under ``record_dir`` (see the module docstring), its
    recorded violations, and how the test ended. Raises :class:`NotReproducible`."""
    try:
        with open(os.path.join(record_dir, "result.json")) as f:
            result = json.load(f)
    except (OSError, ValueError):
        raise NotReproducible("the test run left no result (did it run at all?)") from None
    calls: dict[str, dict] = {}
    cdir = os.path.join(record_dir, "calls")
    for name in sorted(os.listdir(cdir)) if os.path.isdir(cdir) else []:
        if name.endswith(".call"):
            with open(os.path.join(cdir, name), "rb") as f:
                c = pickle.load(f)
            out_path = os.path.join(cdir, name[:-5] + ".out")
            if os.path.exists(out_path):
                with open(out_path, "rb") as f:
                    c["out"] = pickle.load(f)
            calls[c["id"]] = c
    if not calls:
        raise NotReproducible("the test made no contract call of a checkpointer made by faults.training.load_factory")
    ordered = sorted(calls.values(), key=lambda c: c["t"])
    escaped = result.get("escaped")
    if escaped is None and result.get("outcome") == "failed":
        text = result.get("longrepr", "") + result.get("message", "")
        for c in reversed(ordered):
            o = c.get("out") or {}
            if o.get("kind") == "raised" and f"{o['type'].rsplit('.', 1)[-1]}: {o['message'][:80]}" in text:
                escaped = c["id"]
                break
    # a call the process never finished, last before the test's end: a hang when the suite says so
    by_root: dict[str, list[dict]] = {}
    for c in ordered:
        if c.get("root") is not None:
            by_root.setdefault(c["root"], []).append(c)
    best: tuple[int, Episode, list, list] | None = None
    refusals: list[str] = []
    unconfirmed: list[str] = []
    blobs = os.path.join(record_dir, "blobs")
    for root, cs in by_root.items():
        ep = Episode(root, cs, blobs, escaped)
        problems = ep.problems()
        if problems:
            refusals.append(f"{root}: " + "; ".join(problems[:4]))
            continue
        try:
            found = ep.judge()
        except Exception as e:  # noqa: BLE001 - an episode this module cannot judge
            refusals.append(f"{root}: cannot judge: {type(e).__name__}: {e}")
            continue
        hang = _hang_call(ep, result)
        if hang is not None:
            found.append((hang, "the call did not return (hung)"))
        confirmed = [v for v in found if _confirmed(v[1], result.get("message", ""))]
        if found and not confirmed:
            unconfirmed.append(f"{root}: {found[-1][1].splitlines()[0][:200]}")
        if confirmed:
            last_t = max(cs[n - 1]["t"] for n, _ in confirmed)
            if best is None or last_t > best[0]:
                best = (last_t, ep, found, confirmed)
    if best is None:
        first = result.get("message", "").strip().splitlines()[:1]
        if unconfirmed:
            why = (f"the recorded calls break the contract ({unconfirmed[-1]}), but that is not what the suite's "
                   f"test failed on ({first[0][:200] if first else '?'}): a replay does not check that property")
        elif refusals:
            why = "; ".join(refusals[-3:])
        else:
            why = ("no recorded contract call broke a rule a replay checks (load returns the saved state, find-latest "
                   "names the newest intact step, the call that failed the test raises, nothing hangs): the finding "
                   "is of a kind a replay of calls cannot show (a memory bound, code run by unpickling, a disk leak, "
                   "an interrupt's type, a fault injected inside a call...)")
        raise NotReproducible(why)
    _, ep, found, confirmed = best
    last = max(n for n, _ in confirmed)
    ep.calls = ep.calls[:last]
    ep.confirmed = sorted({n for n, _ in confirmed})
    return ep, [v for v in found if v[0] <= last], result


#: Words of the suite's failure message that say it is about what find-latest chose, or what a load
#: returned (a violation of the replay counts as the finding's only when the message speaks of it).
_CHOICE_WORDS = ("resumed", "resume failed", "find_latest", "newest", "fall back", "fell back", "landed", "chose")
_LOAD_WORDS = ("loaded", "load raised", "restored", "differs", "round trip", "round-trip", "resumed")


def _confirmed(violation: str, message: str) -> bool:
    """Whether ``violation`` is what the suite's test failed on, by the test's failure ``message``."""
    text = message.lower()
    if "-- the exception that failed the suite's test" in violation or "did not return" in violation:
        return True
    if violation.startswith(("find_latest_checkpoint", "load_latest")):
        return any(w in text for w in _CHOICE_WORDS)
    if violation.startswith("load"):
        return any(w in text for w in _LOAD_WORDS)
    return False


def _hang_call(ep: Episode, result: dict) -> int | None:
    text = (result.get("message", "") + result.get("longrepr", "")).lower()
    if "hung" not in text and "no answer within" not in text:
        return None
    if ep.calls and ep.calls[-1].get("out") is None:
        return len(ep.calls)
    return None


# -- the script ------------------------------------------------------------------------------------------

def _runtime_source() -> str:
    src = inspect.getsource(sys.modules[__name__])
    begin = src.index("# --- runtime: begin")
    end = src.index("# --- runtime: end ---")
    return src[src.index("\n", begin) + 1:end]


def _global_names(src: str) -> set[str]:
    import ast

    return {n.id for n in ast.walk(ast.parse(src)) if isinstance(n, ast.Name)}


def _standins(module: Any, names: list[tuple[str, str]], adapter: dict[str, Any]) -> list[str]:
    """Source for the names ``module`` imports from ``faults`` (``(name, alias)``): each name's own
    definition (a function's or class's source, a constant's repr, a module's import), and what
    those definitions use from their modules, dependencies first."""
    import builtins

    out: list[str] = []
    done: dict[str, Any] = {}

    def need(mod: Any, name: str) -> None:
        obj = getattr(mod, name)
        if name in done:
            if done[name] is not obj:
                raise NotReproducible(f"cannot inline: two different definitions named {name}")
            return
        done[name] = obj
        if name in adapter and adapter[name] is not obj:
            raise NotReproducible(f"cannot inline: {name} is defined by the adapter and by what it imports")
        if inspect.ismodule(obj):
            out.append(f"import {obj.__name__}" if obj.__name__ == name else f"import {obj.__name__} as {name}")
        elif inspect.isfunction(obj) or inspect.isclass(obj):
            home = sys.modules[obj.__module__]
            if not obj.__module__.split(".")[0] == "faults":
                out.append(f"from {obj.__module__} import {obj.__qualname__} as {name}")
                return
            src = textwrap.dedent(inspect.getsource(obj))
            for dep in sorted(_global_names(src)):
                if dep != obj.__name__ and dep in vars(home) and not hasattr(builtins, dep) and dep not in (
                        "annotations",):
                    need(home, dep)
            out.append(src.rstrip() + ("" if obj.__name__ == name else f"\n{name} = {obj.__name__}"))
        elif isinstance(obj, (dict, list, set)) and name.startswith("_"):
            out.append(f"{name} = {type(obj).__name__}()  # a private registry: empty in a fresh process")
        else:
            text = repr(obj)
            try:
                ok = eval(text, {"re": re}) == obj  # noqa: S307 - our own constants' reprs
            except Exception:  # noqa: BLE001
                ok = False
            if not ok:
                raise NotReproducible(f"cannot inline {name} = {text:.60}: its repr does not rebuild it")
            if text.startswith("re.compile("):
                out.insert(0, "import re")
            out.append(f"{name} = {text}")

    for name, alias in names:
        need(module, name)
        if alias != name:
            out.append(f"{alias} = {name}")
    return out


def _inline_adapter(spec: str) -> tuple[str, str]:
    """An adapter module's source with its ``faults`` imports replaced by stand-ins, and the factory
    expression; any other spec is imported as is."""
    import ast
    import importlib
    import importlib.util

    mod_name, _, attr = spec.partition(":")
    if mod_name.split(".")[0] != "faults":
        return (f"import importlib as _importlib\n\nFACTORY = getattr(_importlib.import_module({mod_name!r}), {attr!r})\n",
                attr)
    if not mod_name.startswith("faults.adapters."):
        raise NotReproducible(f"{spec}: only an adapter of faults.adapters can be inlined into a script without faults")
    module = importlib.import_module(mod_name)
    src = inspect.getsource(module)
    tree = ast.parse(src)
    lines = src.splitlines()
    drop: set[int] = set()
    imported: dict[str, list[tuple[str, str]]] = {}
    for node in tree.body:
        if isinstance(node, ast.Expr) and isinstance(getattr(node, "value", None), ast.Constant) and node is tree.body[0]:
            drop.update(range(node.lineno, (node.end_lineno or node.lineno) + 1))
        if isinstance(node, ast.ImportFrom) and (node.module == "__future__"):
            drop.update(range(node.lineno, (node.end_lineno or node.lineno) + 1))
        if isinstance(node, ast.ImportFrom) and (node.level > 0 or (node.module or "").split(".")[0] == "faults"):
            base = importlib.util.resolve_name("." * node.level + (node.module or ""), module.__package__) \
                if node.level else node.module
            imported.setdefault(base or "", []).extend((a.name, a.asname or a.name) for a in node.names)
            drop.update(range(node.lineno, (node.end_lineno or node.lineno) + 1))
    for sub in ast.walk(tree):
        if isinstance(sub, ast.Import) and any(a.name.split(".")[0] == "faults" for a in sub.names):
            raise NotReproducible(f"{spec}: imports faults inside its code (line {sub.lineno}); cannot inline")
        if isinstance(sub, ast.ImportFrom) and sub not in tree.body and (sub.level > 0 or (sub.module or "").startswith(
                "faults")):
            raise NotReproducible(f"{spec}: imports from faults inside its code (line {sub.lineno}); cannot inline")
    stand: list[str] = []
    for base, names in imported.items():
        stand += _standins(importlib.import_module(base), names, vars(module))
    body = "\n".join(line for i, line in enumerate(lines, 1) if i not in drop).strip("\n")
    head = (f"# ---- {spec}: the adapter the suite judged, inlined from {mod_name};\n"
            "# ---- its imports from the faults package are replaced by these copies of what it uses:\n")
    return head + "\n\n".join(stand) + f"\n\n# ---- {mod_name} itself:\n" + body + f"\n\nFACTORY = {attr}\n", attr


def _versions(spec: str) -> str:
    from importlib import metadata

    import torch

    out = [f"torch {torch.__version__}", f"python {sys.version.split()[0]}"]
    top = spec.partition(":")[0].split(".")[0]
    pkg = top
    if spec.startswith("faults.adapters."):
        import importlib

        pkg = getattr(importlib.import_module(spec.partition(":")[0]), "PACKAGE", "torch")
    if pkg not in ("torch", "faults"):
        try:
            out.insert(1, f"{pkg} {metadata.version(pkg)}")
        except metadata.PackageNotFoundError:
            pass
    return ", ".join(out)


def build_script(episode: dict, finding: dict, blobs: dict[str, bytes], spec: str) -> str:
    """The reproducer's text: ``episode`` (``initial``, ``items``, ``violating``), ``finding``
    (``nodeid``, ``spec``, ``message``, ``recorded``, ``versions``), the ``blobs`` it refers to, and
    the checkpointer ``spec`` (inlined when it is an adapter of :mod:`faults.adapters`)."""
    ck_src, fname = _inline_adapter(spec)
    packed = base64.b64encode(zlib.compress(pickle.dumps(blobs, protocol=4), 9)).decode()
    wrapped = "\n".join(textwrap.wrap(packed, 120, break_on_hyphens=False))
    constants = "\n".join(f"{n} = {v!r}" for n, v in (("STEP_PREFIX", STEP_PREFIX), ("POINTER_FILE", POINTER_FILE),
                                                        ("COMMIT_RECORD", COMMIT_RECORD),
                                                        ("RANK_RECORD_RE", RANK_RECORD_RE),
                                                        ("EXTRA_STATE_DIR", EXTRA_STATE_DIR),
                                                        ("SHARD_SUFFIXES", tuple(SHARD_SUFFIXES))))
    recorded = "\n".join(f"#   {'  ' if i else ''}{part}" for v in finding["recorded"]
                         for i, line in enumerate(v.splitlines()) for part in textwrap.wrap(line.strip(), 110))
    message = "\n".join(f"#   {line[:200]}" for line in finding["message"].splitlines()[:10])
    doc = (f'"""Reproducer of a faults.suite finding: {finding["nodeid"]}\n'
           f"against {spec} ({finding['versions']}).\n\n"
           "Run it with torch and the checkpointer's package installed (nothing else: it does not import faults):\n\n"
           "    python THIS_FILE                       # exit 1: the defect is present; 0: it is gone; 2: could not run\n"
           "    python THIS_FILE --checkpointer M:F    # the same episode on another checkpointer (mapped mode)\n\n"
           "It recreates the checkpoint root the suite's test saw, calls the checkpointer as the test did (the\n"
           "states are the test's own, embedded below), makes between the calls the file changes the test made\n"
           "(damage, a crash's leftovers), and judges each outcome by the checkpointer contract.\n"
           f"Generated {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC by `{PROG}`.\n"
           '"""\n')
    return (f"#!/usr/bin/env python3\n{doc}\nfrom __future__ import annotations\n\n"
            "import base64\nimport io\nimport os\nimport pickle\nimport re\nimport shutil\nimport sys\n"
            "import threading\nimport zlib\nfrom collections.abc import Callable, Iterable\nfrom typing import Any\n\n"
            f"# The suite's failure (what the contract asks):\n{message}\n# What the recorded calls did wrong:\n{recorded}\n\n"
            f"{ck_src}\n\n"
            f"# ---- the contract's names on disk (faults.contract)\n{constants}\n\n"
            f"FINDING = {pprint.pformat(finding, width=120)}\n\n"
            f"EPISODE = {pprint.pformat(episode, width=120, compact=True)}\n\n"
            f"# ---- the recorded states and files: zlib-compressed pickle of {{key: bytes}}, base64\n"
            f"_BLOBS_B64 = \"\"\"\n{wrapped}\n\"\"\"\n"
            "_BLOBS: dict[str, bytes] = {}\n\n\n"
            "def _blob(key: str) -> bytes:\n"
            "    if not _BLOBS:\n"
            "        _BLOBS.update(pickle.loads(zlib.decompress(base64.b64decode(''.join(_BLOBS_B64.split())))))\n"
            "    return _BLOBS[key]\n\n\n"
            "# ---- the replay and the contract's checks (faults/repro.py's runtime part)\n"
            f"{_runtime_source()}\n\n"
            "def main(argv: list[str] | None = None) -> int:\n"
            f"    return run_script(argv, EPISODE, FINDING, FACTORY, _blob)  # FACTORY: {fname}\n\n\n"
            "if __name__ == \"__main__\":\n    sys.exit(main())\n")


def script_for(ep: Episode, found: list[tuple[int, str]], result: dict, spec: str) -> str:
    items, need = ep.items()
    hang = _hang_call(ep, result)
    if hang is not None:
        for it in items:
            if it["op"] == "call" and it["n"] == hang:
                it["hang"] = True
    initial = ep.calls[0].get("before")
    if initial:
        _entry_blobs(initial, need)
    unmappable = None
    if any(it["op"] == "call" and it["interrupted"] and not it["hang"] for it in items):
        unmappable = "a call was killed in the recorded run: its leftovers are the recorded checkpointer's files"
    episode = {"initial": None if initial is None else {r: list(e) for r, e in initial.items()}, "items": items,
               "violating": ep.confirmed or sorted({n for n, _ in found}), "unmappable": unmappable}
    total = 0
    blobs = {}
    for k in sorted(need):
        blobs[k] = ep.blob(k)
        total += len(blobs[k])
    if total > EPISODE_BYTES:
        raise NotReproducible(f"the episode's states and files hold {total >> 20} MiB, more than {EPISODE_BYTES >> 20}")
    def scrub(text: str) -> str:  # the test's temporary root is <root> in the script, as in its replay
        return text.replace(ep.root + os.sep, "<root>/").replace(ep.root, "<root>")

    message = result.get("message", "").split("\nTraceback (most recent call last)")[0]
    message = message.split("\nassert ")[0]  # pytest's rewritten-assert detail: digests, not the expectation
    finding = {"nodeid": result.get("nodeid", "?"), "spec": spec, "message": scrub(message),
               "recorded": [scrub(f"[{n}] {what}") for n, what in found], "versions": _versions(spec)}
    for it in items:
        if it["op"] == "call" and it["recorded"].get("message"):
            it["recorded"]["message"] = scrub(it["recorded"]["message"])
    return build_script(episode, finding, blobs, spec)


def hidden_faults_env(tmp: str, env: dict | None = None) -> dict:
    """An environment in which ``import faults`` fails (a ``faults`` package first on PYTHONPATH that
    raises), to prove a reproducer needs no faults."""
    shadow = os.path.join(tmp, "no-faults")
    os.makedirs(os.path.join(shadow, "faults"), exist_ok=True)
    with open(os.path.join(shadow, "faults", "__init__.py"), "w") as f:
        f.write("raise ImportError('a reproducer must not import faults')\n")
    env = dict(os.environ if env is None else env)
    env["PYTHONPATH"] = os.pathsep.join([shadow, *([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])])
    env.pop(ENV_RECORD, None)
    return env


# -- the command -----------------------------------------------------------------------------------------

def _pytest_command(nodeid: str, spec: str, a: argparse.Namespace) -> list[str]:
    import importlib.util

    file_part = nodeid.rpartition("::")[0]
    target = "faults.suite"
    if file_part:
        stem = re.split(r"[/.]", file_part[:-3] if file_part.endswith(".py") else file_part)[-1]
        if importlib.util.find_spec(f"faults.suite.{stem}") is not None:
            target = f"faults.suite.{stem}"
    cmd = [sys.executable, "-m", "pytest", "--pyargs", target, "-p", "faults.repro", "-p", "no:cacheprovider",
           "-p", "no:randomly", "-q", f"--checkpointer={spec}", f"--fault-budget={a.fault_budget}",
           f"--world-sizes={a.world_sizes}", f"--hypothesis-seed={a.hypothesis_seed}"]
    if importlib.util.find_spec("xdist") is not None:
        cmd += ["-n", "0"]
    return cmd + list(a.pytest_args or [])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog=PROG, formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Write a standalone script that reproduces a finding of the resilience suite: torch and the "
                    "checkpointer under test only, no faults import; it exits 1 while the defect is present and 0 "
                    "once it is gone -- what to attach to an upstream bug report.",
        epilog=textwrap.dedent("""\
            How: the test runs once more (hypothesis seed pinned, shrinking kept) with every checkpointer it makes
            recording its contract calls, their arguments, outcomes and the root's files before and after; the
            last failing example's calls on one root become the script, which replays them and judges each
            outcome by the contract. The script is then run once with faults hidden: it must exit 1.

            Reproducible: world-size-1 episodes whose defect a contract call shows (a load that returns another
            state, or loads a damaged step without an error; find-latest naming a damaged or failed step; a call
            raising the error that failed the test; a hang). Not: several ranks, faults injected inside a call,
            memory bounds, code execution, disk leaks (see docs/faults.md).

            Exit codes: 0 the script is written and reproduces the defect (it exits 1); 1 no reproducer (the test
            passed or was skipped, the finding is of a kind a replay cannot show, or the script did not
            reproduce it); 2 bad arguments.

            Example:
              python -m faults repro test_corrupt_payload_never_loads_silently --checkpointer dcp -o repro_dcp.py
              python repro_dcp.py; echo $?       # 1 while DCP loads a flipped bit silently
              python repro_dcp.py --checkpointer refckpt:DistributedCheckpointer; echo $?   # 0
            """))
    p.add_argument("nodeid", metavar="NODEID",
                   help="the finding's test, as docs/audit.md lists it (test_x[params]) or a pytest node id "
                        "(faults/suite/test_contract.py::test_x[...]); the checkpointer's own parameter may be left out")
    p.add_argument("--checkpointer", default=DEFAULT_CHECKPOINTER, metavar="SPEC",
                   help="MODULE:FACTORY or an audit shorthand (dcp, torchtitan, veomni, refckpt, ...) "
                        f"(default: {DEFAULT_CHECKPOINTER})")
    p.add_argument("-o", "--output", help="where to write the script (default: ./repro_<test>.py)")
    p.add_argument("--hypothesis-seed", type=int, default=0, help="the seed of the run (default 0, as the audit's)")
    p.add_argument("--fault-budget", type=int, default=4, help="examples per property (default 4, as the audit's)")
    p.add_argument("--world-sizes", default="1,2", help="as the audit's (default 1,2)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds for the recording run (default 900)")
    p.add_argument("--no-verify", action="store_true", help="write the script without running it")
    p.add_argument("--keep-records", metavar="DIR", help="keep the recording under DIR (a new directory)")
    p.add_argument("--from-records", metavar="DIR", help="write the script from a recording kept by --keep-records "
                   "instead of running the test again")
    p.add_argument("pytest_args", nargs="*", help="after --: more pytest arguments")
    a = p.parse_args(argv)
    from .audit import resolve_spec

    try:
        spec = resolve_spec(a.checkpointer)
    except ValueError as e:
        p.error(str(e))
    if a.from_records and not os.path.isfile(os.path.join(a.from_records, "result.json")):
        p.error(f"--from-records {a.from_records}: no recording there (result.json)")
    if a.keep_records and os.path.exists(a.keep_records):
        p.error(f"--keep-records {a.keep_records}: exists; name a new directory")
    out_path = a.output or "repro_" + re.sub(r"[^A-Za-z0-9_]+", "_", a.nodeid.rpartition("::")[2]).strip("_") + ".py"
    tmp = tempfile.mkdtemp(prefix="faults-repro-")
    rec_dir = a.from_records or a.keep_records or os.path.join(tmp, "record")
    os.makedirs(rec_dir, exist_ok=True)
    try:
        return _run(a, spec, rec_dir, out_path, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _run(a: argparse.Namespace, spec: str, rec_dir: str, out_path: str, tmp: str) -> int:
    say = lambda s: print(s, flush=True)  # noqa: E731
    if not a.from_records:
        code = _record(a, spec, rec_dir, say)
        if code is not None:
            return code
    return _write_and_verify(a, spec, rec_dir, out_path, tmp, say)


def _record(a: argparse.Namespace, spec: str, rec_dir: str, say: Callable[[str], None]) -> int | None:
    """Run the test with recording on; None when it failed (there is something to reproduce), else
    the command's exit code."""
    env = dict(os.environ, **{ENV_RECORD: rec_dir, ENV_SELECT: a.nodeid})
    cmd = _pytest_command(a.nodeid, spec, a)
    say(f"{PROG}: recording {a.nodeid} against {spec}: {' '.join(cmd[1:])}")
    t0 = time.monotonic()
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=a.timeout)
    except subprocess.TimeoutExpired:
        say(f"{PROG}: the test run took more than {a.timeout:.0f} s; no reproducer")
        return 1
    try:
        with open(os.path.join(rec_dir, "selected.json")) as f:
            selected = json.load(f)
    except (OSError, ValueError):
        selected = None
    if selected is None or len(selected["selected"]) != 1:
        found = "" if selected is None else ", ".join(selected["selected"] or selected["candidates"][:8]) or "none"
        say(f"{PROG}: NODEID {a.nodeid!r} names {'no' if not selected or not selected['selected'] else 'more than one'} "
            f"test of faults.suite for {spec} (candidates: {found})\n{(proc.stdout + proc.stderr)[-2000:]}")
        return 1
    try:
        with open(os.path.join(rec_dir, "result.json")) as f:
            outcome = json.load(f).get("outcome")
    except (OSError, ValueError):
        outcome = None
    say(f"  the test {outcome or 'did not report'} in {time.monotonic() - t0:.1f} s (pytest exit {proc.returncode})")
    if outcome != "failed":
        say(f"{PROG}: {selected['selected'][0]} did not fail against {spec}: nothing to reproduce\n"
            f"{(proc.stdout + proc.stderr)[-1500:]}")
        return 1
    return None


def _write_and_verify(a: argparse.Namespace, spec: str, rec_dir: str, out_path: str, tmp: str,
                      say: Callable[[str], None]) -> int:
    try:
        ep, violations, result = load_episode(rec_dir)
        script = script_for(ep, violations, result, spec)
    except NotReproducible as e:
        say(f"{PROG}: no reproducer for this finding: {e}")
        return 1
    with open(out_path, "w") as f:
        f.write(script)
    os.chmod(out_path, 0o755)
    say(f"  episode: {len(ep.calls)} calls on one root; recorded violations:")
    for n, what in violations:
        what = what.replace(ep.root + os.sep, "<root>/")
        for i, line in enumerate(what.splitlines()[:10]):
            say(f"    {f'[{n}]' if i == 0 else '   '} {line.strip()[:300]}")
    say(f"  wrote {out_path} ({len(script) // 1024} KiB)")
    if a.no_verify:
        return 0
    run = subprocess.run([sys.executable, out_path], env=hidden_faults_env(tmp), capture_output=True, text=True,
                         timeout=max(120.0, a.timeout))
    say(f"  verified with faults hidden: `python {out_path}` exited {run.returncode}:")
    for line in (run.stdout + run.stderr).strip().splitlines()[-30:]:
        say(f"    | {line}")
    if run.returncode != 1:
        say(f"{PROG}: the script did not reproduce the defect (exit {run.returncode}; 1 was expected)")
        return 1
    return 0
