"""Read-only tools over checkpoints: list a root, verify every byte, inspect a step.

Each function returns plain data (dataclasses, or dicts ready for ``json.dumps``);
:mod:`refckpt.tools.cli` prints them. Nothing here writes to a checkpoint (``verify`` holds a
reader's lease file in the root while it reads a step, :func:`refckpt.commit.take_lease`, so that
retention of a running save leaves that step until it is read). Checkpoint bytes
are read only through refckpt's own readers: the commit record through the restricted
unpickler of :mod:`refckpt.safeload`, items and extra state through
:meth:`DistributedCheckpointer.load` and ``torch.load(weights_only=True)`` -- never
``pickle.load`` or ``weights_only=False``.

What counts as complete is :func:`refckpt.layout.check_step_dir`'s answer and which step
resume picks is :func:`refckpt.layout.find_latest_checkpoint`'s: the tools report the same
decisions training would make, they do not re-implement them. :func:`verify` re-reads
every byte with :func:`refckpt.storage.verify_step_files` (the checksums the commit record
holds); checkpoints written without refckpt carry no checksums, so for them every item is
read and parsed through the load path instead.

Retention of a running save may delete a step while a tool reads it (refckpt renames the step
aside, then removes it). Before a problem is reported, the step is looked at again
(:func:`refckpt.layout.step_identity`): a step that is no longer there, or another directory now
stands under its name, is reported as *gone*, never as damage; only damage that is still there
makes ``verify`` fail. ``ls`` examines the newest :data:`LS_LIMIT` step directories of a root and
summarises the rest by name (``refckpt ls --all`` examines every one).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import re
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch

from ..checkpointer import EXTRA_STATE_EMBEDDED, EXTRA_STATE_PER_RANK, DistributedCheckpointer, _skeleton_from_metadata
from ..commit import drop_lease, take_lease
from ..durable import tree_size
from ..errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    InvalidCheckpointPathError,
    UnsafeCheckpointError,
)
from ..layout import (
    EXTRA_STATE_DIR,
    LATEST_CHECKPOINT_FILE,
    METADATA_FILE,
    STEP_PREFIX,
    StepState,
    StepStatus,
    check_step_dir,
    find_latest_checkpoint,
    list_staging_dirs,
    list_step_dirs,
    parse_step_dir_name,
    read_pointer,
    safe_relpath,
    step_identity,
)
from ..planner import EXTRA_STATE_KEY, OPTIMIZER_KEY
from ..safeload import load_metadata, open_regular, safe_torch_load
from ..storage import verify_step_files

__all__ = [
    "STATE_COMPLETE",
    "STATE_INCOMPLETE",
    "STATE_CORRUPT",
    "EXTRA_NONE",
    "KIND_ROOT",
    "KIND_STEP",
    "LS_LIMIT",
    "StepInfo",
    "PointerInfo",
    "RootListing",
    "StepVerification",
    "VerifyReport",
    "Progress",
    "resolve",
    "describe_step",
    "list_root",
    "verify",
    "inspect_step",
    "read_state",
    "optimizer_kind",
    "saved_tops",
    "extra_state_layout",
    "jsonable",
    "quiet_single_process",
]

log = logging.getLogger(__name__)

STATE_COMPLETE = StepState.COMPLETE.value
STATE_INCOMPLETE = StepState.INCOMPLETE.value  # a save that never finished, or a file gone since
STATE_CORRUPT = StepState.CORRUPT.value        # the commit record or a recorded size disagrees with the disk
#: extra-state layout of a checkpoint that holds no extra state.
EXTRA_NONE = "none"
KIND_ROOT = "root"
KIND_STEP = "step"
#: Step directories ``ls`` examines by default, newest first (each costs a commit-record read and a
#: walk of its files); a root holding more is summarised: the older ones are counted by name only.
#: ``list_root(root, limit=None)`` (``refckpt ls --all``) examines every one, in time linear in
#: their number.
LS_LIMIT = 100
#: How many times ``inspect`` of a root takes the newest complete step again after the one it was
#: reading was deleted (retention of a running save).
INSPECT_RETRIES = 8

_RANK_FILE_RE = re.compile(r"__([0-9]{1,9})_[0-9]+\.(?:distcp|safetensors)|__([0-9]{1,9})\.metadata")

#: on_progress(bytes_done, bytes_total, what): called as :func:`verify` advances.
Progress = Callable[[int, int, str], None]


@contextlib.contextmanager
def quiet_single_process() -> Iterator[None]:
    """DCP warns on every single-process (``no_dist``) load and save; the tools do that on purpose."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def resolve(path: str | os.PathLike) -> tuple[str, str]:
    """(kind, absolute path) of ``path``: :data:`KIND_STEP` for a step directory (named
    ``global_step_N`` or holding a commit record), :data:`KIND_ROOT` for a directory holding step
    directories. Anything else raises, naming the path and what to pass instead."""
    path = os.path.abspath(os.fspath(path))
    if not os.path.exists(path):
        raise CheckpointNotFoundError(
            f"{path}: no such file or directory; pass a checkpoint root (the directory that holds "
            f"{STEP_PREFIX}N/) or one step directory."
        )
    if not os.path.isdir(path):
        raise InvalidCheckpointPathError(
            f"{path}: is a file; pass a checkpoint root (the directory that holds {STEP_PREFIX}N/) "
            f"or one step directory."
        )
    if (parse_step_dir_name(os.path.basename(path)) is not None
            or os.path.isfile(os.path.join(path, METADATA_FILE))
            or os.path.isfile(os.path.join(path, "__0.metadata"))):
        return KIND_STEP, path
    if list_step_dirs(path):
        return KIND_ROOT, path
    raise InvalidCheckpointPathError(
        f"{path}: neither a checkpoint root (no {STEP_PREFIX}N/ inside) nor a step directory "
        f"(no {METADATA_FILE} commit record); pass the directory your training saved into."
    )


# -- ls -----------------------------------------------------------------------------------------
@dataclasses.dataclass
class StepInfo:
    """One step directory as ``ls`` reports it."""

    step: int | None
    name: str
    path: str
    state: str
    #: why it is not complete (``check_step_dir``'s reason); empty when complete.
    reason: str
    #: bytes of every file under the step directory (symlinks not followed).
    size_bytes: int
    world_size: int | None
    #: "manifest" (recorded by refckpt at save) or "file names" (inferred: ``__R_*`` files).
    world_size_source: str | None
    #: "per_rank", "embedded", "none", or None where unknown (no readable commit record).
    extra_state: str | None
    #: "refckpt/1" (refckpt's manifest), "dcp" (a commit record without one), or None.
    format: str | None
    checksums: str | None  # the algorithm the commit record names, None: no checksums
    #: "sha256": the commit record carries its own checksum and it holds; None: a record written
    #: without one (plain DCP, refckpt/1), or no readable record.
    record_checksum: str | None = None
    #: deleted or replaced while it was read (retention of a running save): gone, not damaged.
    vanished: bool = False


@dataclasses.dataclass
class PointerInfo:
    """What ``latest_checkpoint_iteration.txt`` says, and what resume makes of it."""

    file: str
    raw: str | None
    step: int | None
    note: str


@dataclasses.dataclass
class RootListing:
    root: str
    pointer: PointerInfo
    #: the step directory :func:`find_latest_checkpoint` picks (what resume loads), or None.
    resume: str | None
    steps: list[StepInfo]
    #: hidden ``.global_step_N.partial`` staging directories: a save in flight or interrupted.
    staging: list[str]
    #: step directories older than the newest ``limit`` examined: counted by name, not examined.
    not_examined: int = 0
    #: the oldest and newest step of those (None when there are none).
    not_examined_steps: tuple[int, int] | None = None
    #: step directories listed, then deleted or replaced before they were read (retention of a
    #: running save): gone, left out of ``steps``.
    gone: list[str] = dataclasses.field(default_factory=list)
    #: for each of ``staging``, what it is: a live save, or abandoned and when a save removes it.
    staging_status: list[str] = dataclasses.field(default_factory=list)

    @property
    def resume_step(self) -> int | None:
        return None if self.resume is None else parse_step_dir_name(os.path.basename(self.resume))

    def to_json(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["resume_step"] = self.resume_step
        return out


def _tree_size(path: str) -> int:
    return tree_size(path)  # iterative: a tree nested thousands of levels deep is just counted


def _ranks_from_names(path: str) -> int | None:
    try:
        names = os.listdir(path)
    except OSError:
        return None
    ranks = set()
    for name in names:
        m = _RANK_FILE_RE.fullmatch(name)
        if m:
            ranks.add(int(m.group(1) or m.group(2)))
    return max(ranks) + 1 if ranks else None


def saved_tops(md: Any) -> list[str]:
    """Top-level keys of the saved state, in save order."""
    paths = md.planner_data if isinstance(md.planner_data, dict) else {}
    tops: dict[str, None] = {}
    for key in md.state_dict_metadata:
        path = paths.get(key)
        tops[str(path[0]) if path else key.split(".", 1)[0]] = None
    return list(tops)


def extra_state_layout(st: StepStatus) -> str | None:
    """Where the step keeps its extra state: the manifest says; otherwise detected as load does."""
    if st.manifest is not None:
        return st.manifest.extra_state or EXTRA_NONE
    if os.path.isdir(os.path.join(st.path, EXTRA_STATE_DIR)):
        return EXTRA_STATE_PER_RANK
    if st.metadata is None:
        return None
    return EXTRA_STATE_EMBEDDED if EXTRA_STATE_KEY in saved_tops(st.metadata) else EXTRA_NONE


def describe_step(path: str, root: str | None = None) -> StepInfo:
    """What ``ls`` knows about one step directory: completeness, size, world size, extra-state layout."""
    st = check_step_dir(path, root)
    world = st.manifest.world_size if st.manifest is not None else None
    source = "manifest" if world is not None else None
    if source is None:
        world = _ranks_from_names(path)
        source = "file names" if world is not None else None
    fmt = None
    if st.metadata is not None:
        fmt = st.manifest.format if st.manifest is not None else "dcp"
    return StepInfo(
        step=st.step, name=os.path.basename(os.path.normpath(path)), path=path, state=st.state.value,
        reason=st.reason, size_bytes=_tree_size(path), world_size=world, world_size_source=source,
        extra_state=extra_state_layout(st), format=fmt, checksums=st.manifest.checksum if st.manifest is not None else None,
        record_checksum=st.record_checksum, vanished=st.vanished,
    )


def _pointer(root: str, steps: list[StepInfo], resume: str | None) -> PointerInfo:
    file = os.path.join(root, LATEST_CHECKPOINT_FILE)
    try:
        with open_regular(file, follow_symlinks=False) as f:  # never block on a FIFO pointer
            raw: str | None = f.read(64).decode("utf-8", "backslashreplace")
    except (OSError, CheckpointError):
        return PointerInfo(file, None, None, "absent")
    step = read_pointer(root)
    by_step: dict[int | None, Any] = {s.step: s for s in steps}
    if step is not None and step not in by_step:  # not examined (ls --limit), or published since the listing
        named = check_step_dir(os.path.join(root, f"{STEP_PREFIX}{step}"), root)
        if not named.vanished:
            by_step[step] = StepInfo(step, os.path.basename(named.path), named.path, named.state.value, named.reason,
                                     0, None, None, None, None, None)
    resume_name = None if resume is None else os.path.basename(resume)
    if step is None:
        note = "unreadable (torn, empty or garbage): ignored"
    elif step not in by_step:
        note = f"names {STEP_PREFIX}{step}, which does not exist (dangling): ignored"
    elif by_step[step].state != STATE_COMPLETE:
        note = f"names {STEP_PREFIX}{step}, which is {by_step[step].state}: ignored"
    elif by_step[step].name != resume_name:
        note = f"stale: names {STEP_PREFIX}{step}; the newest complete step is {resume_name}"
    else:
        note = "agrees with resume"
    return PointerInfo(file, raw, step, note)


def list_root(root: str | os.PathLike, limit: int | None = LS_LIMIT) -> RootListing:
    """Every step directory under ``root`` (newest first), the pointer, and what resume picks.

    ``limit``: examine the newest ``limit`` step directories only (default :data:`LS_LIMIT`); the
    older ones are counted by name (``not_examined``). None examines every one. A step deleted
    while it is examined (retention of a running save) is left out and named in ``gone``."""
    root = os.path.abspath(os.fspath(root))
    if not os.path.exists(root):
        raise CheckpointNotFoundError(
            f"{root}: no such directory; pass the checkpoint root (the directory that holds {STEP_PREFIX}N/).")
    if not os.path.isdir(root):
        raise InvalidCheckpointPathError(
            f"{root}: is not a directory; pass the checkpoint root (the directory that holds {STEP_PREFIX}N/).")
    if parse_step_dir_name(os.path.basename(root)) is not None:
        raise InvalidCheckpointPathError(
            f"{root}: is a step directory, not a root; list its parent ({os.path.dirname(root)}), "
            f"or inspect this step with `refckpt inspect {root}`."
        )
    listed = list_step_dirs(root)
    shown, rest = (listed, []) if limit is None else (listed[:limit], listed[limit:])
    steps: list[StepInfo] = []
    gone: list[str] = []
    for _step, path in shown:
        info = describe_step(path, root)
        if info.vanished:
            gone.append(info.name)
        else:
            steps.append(info)
    resume = find_latest_checkpoint(root)
    staging = [os.path.basename(s.path) for s in list_staging_dirs(root)]
    staging_status = [staging_status_of(root, name) for name in staging]
    span = (rest[-1][0], rest[0][0]) if rest else None
    return RootListing(root, _pointer(root, steps, resume), resume, steps, staging, len(rest), span, gone,
                       staging_status)


# -- verify -------------------------------------------------------------------------------------
@dataclasses.dataclass
class StepVerification:
    path: str
    step: int | None
    ok: bool
    problems: list[str]
    files: int = 0
    bytes_read: int = 0
    #: "crc32c" / "crc32" (every byte against the commit record's checksums of that algorithm), "sizes" (saved without checksums),
    #: "parsed" (no checksums recorded: every item read through the load path), or "" (not reached).
    checked: str = ""
    #: the commit record's own integrity: "sha256" (its checksum holds), "none" (written without
    #: one: plain DCP or refckpt/1, parsed and checked for structure only), "" (not reached).
    record: str = ""
    #: deleted or replaced while verify read it (retention of a running save): gone, not damaged;
    #: ``ok`` is then True (nothing damaged is left) and nothing was checked.
    gone: bool = False


@dataclasses.dataclass
class VerifyReport:
    target: str
    kind: str
    steps: list[StepVerification]
    resume: str | None

    @property
    def ok(self) -> bool:
        """No damage that is still there (a step gone while it was read is not damage)."""
        return all(s.ok for s in self.steps)

    @property
    def problems(self) -> list[str]:
        return [p for s in self.steps for p in s.problems]

    def to_json(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "ok": self.ok}


def _verify_plain(st: StepStatus, out: StepVerification) -> None:
    """A commit record without refckpt's manifest: no checksums to check; read every item through
    the load path (each ``.distcp`` item is parsed with ``weights_only=True``) and every per-rank
    extra-state file with the safe loader, so unreadable bytes still surface."""
    out.checked = "parsed"
    log.info("%s: no checksums recorded (not written by refckpt); reading and parsing every item instead", st.path)
    try:
        read_state(st.path, with_extra=False)
    except (CheckpointError, OSError) as e:
        out.problems.append(f"{st.path}: {e}")
    extra_dir = os.path.join(st.path, EXTRA_STATE_DIR)
    names = sorted(os.listdir(extra_dir)) if os.path.isdir(extra_dir) else []
    for name in names:
        full = os.path.join(extra_dir, name)
        try:
            with open_regular(full) as f:  # a FIFO planted here must not hang verify
                safe_torch_load(f.read(), full)
        except (CheckpointError, OSError) as e:
            out.problems.append(str(e))
    out.files = len(names) + len({getattr(i, "relative_path", None) for i in (st.metadata.storage_data or {}).values()})


def staging_status_of(root: str, name: str) -> str:
    """What staging directory ``name`` is, for people: a live save, or abandoned and when a save removes it
    (the rules of :func:`refckpt.commit._sweep`)."""
    from ..commit import staging_verdict
    from ..layout import staging_writer

    try:
        v = staging_verdict(root, name)
    except OSError as e:
        return f"could not be judged ({type(e).__name__}: {e}); a save leaves it until its writer is known to be gone"
    if v is None:
        return "gone (published or removed while ls read the root)"
    claimed = staging_writer(name) is not None and os.path.lexists(os.path.join(root, f".claim.{staging_writer(name)}"))
    if not v.alive:
        return f"abandoned ({v.reason}): the next save removes it; readers ignore it"
    if v.expires_in is None:
        return f"a save in flight ({v.reason}); readers ignore it, no save removes it while its writer lives"
    what = "a save in flight" if claimed else "a save in flight or one abandoned before claims"
    return (f"{what} ({v.reason}); if it is not renewed, the first save after {v.expires_in:.0f} s removes it; "
            f"readers ignore it")


def _verify_step(path: str, root: str | None, done: int, total: int, on_progress: Progress | None) -> StepVerification:
    """Verify one step under a reader's lease (retention of a running save skips a leased step);
    a problem is reported only when the step is still there, the same directory, after the read:
    one deleted or replaced meanwhile (retention took it before the lease, or an overwrite) is gone."""
    name = os.path.basename(path)
    parent = root if root is not None else os.path.dirname(path)
    lease = take_lease(parent, name) if parse_step_dir_name(name) is not None else None
    before = step_identity(path)  # after the lease: retention either honours it or took the step before
    try:
        try:
            out = _verify_step_files(path, root, done, total, on_progress)
        except OSError as e:  # a file that vanished under the read: judged below, never a bare traceback
            out = StepVerification(path=path, step=parse_step_dir_name(name), ok=False,
                                   problems=[f"{path}: {type(e).__name__}: {e}"])
    finally:
        drop_lease(lease)
    if not out.ok:
        after = step_identity(path)
        if after is None or after != before:
            log.info("%s was deleted or replaced while verify read it (retention of a running save?): gone, "
                     "not checked (%s)", path, "; ".join(out.problems))
            return StepVerification(path=path, step=out.step, ok=True, problems=[], gone=True)
    return out


def _verify_step_files(path: str, root: str | None, done: int, total: int,
                       on_progress: Progress | None) -> StepVerification:
    st = check_step_dir(path, root)
    out = StepVerification(path=path, step=st.step, ok=False, problems=[])
    if st.vanished:
        out.ok, out.gone = True, True
        return out
    if st.metadata is not None:
        out.record = st.record_checksum or "none"
    if not st.complete:
        out.problems.append(f"{path}: {st.state.value}: {st.reason}")
        return out
    if st.manifest is None:
        _verify_plain(st, out)
        out.bytes_read = _tree_size(path)
    else:
        out.checked = st.manifest.checksum or "sizes"

        def advance(n: int, rel: str) -> None:
            out.bytes_read += n
            if on_progress is not None:
                on_progress(done + out.bytes_read, total, f"{os.path.basename(path)}/{rel}")

        out.problems += verify_step_files(path, st.manifest, on_bytes=advance)  # progress moves per block
        out.files += len(st.manifest.files)
    out.ok = not out.problems
    return out


def verify(path: str | os.PathLike, on_progress: Progress | None = None) -> VerifyReport:
    """Re-read every byte of a step directory, or of every step directory under a root.

    A step is good when it is complete and every file matches the checksums of its commit record.
    Problems name the file and what is wrong with it. A step deleted or replaced while it is read
    (retention of a running save) is reported ``gone``, not as a problem.
    """
    kind, path = resolve(path)
    if kind == KIND_STEP:
        targets, root = [path], None
    else:
        targets, root = [p for _s, p in list_step_dirs(path)], path
    total = sum(_tree_size(p) for p in targets)
    steps: list[StepVerification] = []
    done = 0
    for target in targets:
        steps.append(_verify_step(target, root, done, total, on_progress))
        done += _tree_size(target)  # the commit record too, so the bar ends at 100%
        if on_progress is not None:
            on_progress(done, total, os.path.basename(target))
    resume = find_latest_checkpoint(root) if root is not None else None
    return VerifyReport(target=path, kind=kind, steps=steps, resume=resume)


# -- reading a whole state in one process ------------------------------------------------------
def read_state(step_dir: str, tops: list[str] | None = None, *, with_extra: bool = True) -> dict[str, Any]:
    """Read a complete checkpoint into fresh CPU tensors in this process, shards consolidated.

    ``tops``: the top-level keys to read (default: all). Goes through
    :meth:`DistributedCheckpointer.load` without a process group, so checksums are verified,
    non-tensor items are read with ``weights_only=True``, and DCP assembles every tensor from
    the chunks the ranks saved. ``with_extra`` adds ``"extra_state"`` (embedded, or the
    per-rank file of rank 0; a per-rank layout saved by several ranks raises).
    """
    st = check_step_dir(step_dir)
    if not st.complete:
        raise IncompleteCheckpointError(f"{step_dir}: not a complete checkpoint: {st.reason}.")
    present = saved_tops(st.metadata)
    wanted = [t for t in (present if tops is None else tops) if t in present and t != EXTRA_STATE_KEY]
    state: dict[str, Any] = {t: _skeleton_from_metadata(st.metadata, t) for t in wanted}
    if with_extra and extra_state_layout(st) not in (EXTRA_NONE, None):
        state[EXTRA_STATE_KEY] = {}
    with quiet_single_process():
        DistributedCheckpointer().load(step_dir, state, strict_model=True)
    return state


# -- inspect ------------------------------------------------------------------------------------
#: (state entries that must all be present, name), most specific first.
_OPTIMIZER_SIGNATURES: tuple[tuple[frozenset, str], ...] = (
    (frozenset({"exp_avg", "exp_avg_sq", "mu_product"}), "NAdam"),
    (frozenset({"exp_avg", "exp_avg_sq", "max_exp_avg_sq"}), "Adam/AdamW (amsgrad)"),
    (frozenset({"exp_avg", "exp_avg_sq"}), "Adam/AdamW"),
    (frozenset({"exp_avg", "exp_inf"}), "Adamax"),
    (frozenset({"square_avg", "acc_delta"}), "Adadelta"),
    (frozenset({"square_avg"}), "RMSprop"),
    (frozenset({"sum"}), "Adagrad"),
    (frozenset({"eta", "mu", "ax"}), "ASGD"),
    (frozenset({"prev", "step_size"}), "Rprop"),
    (frozenset({"momentum_buffer"}), "SGD (momentum)"),
)


def optimizer_kind(entries: set[str] | frozenset, hyper: dict[str, Any] | None = None) -> str:
    """Name the optimizer from the state entries of its parameters (and its hyperparameters)."""
    hyper = hyper or {}
    for needed, name in _OPTIMIZER_SIGNATURES:
        if needed <= set(entries):
            if name.startswith("Adam/AdamW") and "decoupled_weight_decay" in hyper:
                base = "AdamW" if hyper["decoupled_weight_decay"] else "Adam"
                name = base + name[len("Adam/AdamW"):]
            if name == "RMSprop":
                extras = [k for k, e in (("centered", "grad_avg"), ("momentum", "momentum_buffer")) if e in entries]
                name += f" ({', '.join(extras)})" if extras else ""
            return name
    if not entries or set(entries) <= {"step"}:
        if "momentum" in hyper and "nesterov" in hyper:
            return "SGD (no momentum state)"
        return "unknown (no per-parameter state saved)"
    return f"unknown ({', '.join(sorted(entries))})"


def jsonable(v: Any) -> Any:
    """A JSON-able rendering of a hyperparameter or extra-state value."""
    if isinstance(v, torch.Tensor):
        return v.item() if v.numel() == 1 else f"tensor {str(v.dtype).replace('torch.', '')} {list(v.shape)}"
    if isinstance(v, (bool, int, float, str)) or v is None:
        return v
    if isinstance(v, (list, tuple)):
        return [jsonable(x) for x in v]
    if isinstance(v, dict):
        return {str(k): jsonable(x) for k, x in v.items()}
    return repr(v)


def _describe_value(v: Any) -> str:
    if isinstance(v, torch.Tensor):
        return f"tensor {str(v.dtype).replace('torch.', '')} {list(v.shape)}"
    if isinstance(v, dict):
        return f"dict ({len(v)} keys)"
    if isinstance(v, (list, tuple)):
        return f"{type(v).__name__} of {len(v)}"
    text = repr(v)
    return text if len(text) <= 60 else text[:57] + "..."


def _entries(md: Any) -> list[dict[str, Any]]:
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    paths = md.planner_data if isinstance(md.planner_data, dict) else {}
    where = {(idx.fqn, tuple(idx.offset or ())): info for idx, info in (md.storage_data or {}).items()}
    out = []
    for key, smd in md.state_dict_metadata.items():
        path = paths.get(key) or tuple(key.split("."))
        item: dict[str, Any] = {"key": key, "top": str(path[0]), "path": [p if isinstance(p, int) else str(p) for p in path]}
        if isinstance(smd, TensorStorageMetadata):
            dtype = smd.properties.dtype
            chunks = []
            for c in smd.chunks:
                info = where.get((key, tuple(c.offsets)))
                chunks.append({"offsets": list(c.offsets), "sizes": list(c.sizes),
                               "file": getattr(info, "relative_path", None)})
            item.update(kind="tensor", shape=list(smd.size), dtype=str(dtype).replace("torch.", ""),
                        nbytes=smd.size.numel() * torch._utils._element_size(dtype), chunks=chunks)
        else:
            info = where.get((key, ()))
            item.update(kind="bytes", file=getattr(info, "relative_path", None), length=getattr(info, "length", None))
        out.append(item)
    return out


def _optimizer_section(step_dir: str, md: Any, entries: list[dict[str, Any]]) -> dict[str, Any]:
    by_param: dict[Any, set[str]] = {}
    for e in entries:
        p = e["path"]
        if e["top"] == OPTIMIZER_KEY and len(p) >= 4 and p[1] == "state":
            by_param.setdefault(str(p[2]), set()).add(str(p[3]))  # DCP keys state by str(param id)
    section: dict[str, Any] = {"params_with_state": len(by_param),
                               "state_entries": sorted({k for s in by_param.values() for k in s}),
                               "groups": [], "error": None}
    groups: list[dict[str, Any]] = []
    if any(e["top"] == OPTIMIZER_KEY and len(e["path"]) >= 2 and e["path"][1] == "param_groups" for e in entries):
        skeleton = _skeleton_from_metadata(md, OPTIMIZER_KEY)
        state = {OPTIMIZER_KEY: {"param_groups": skeleton.get("param_groups", [])}}
        # One process reads rank 0's record, so the groups shown are rank 0's (per-rank records
        # of data-parallel ranks hold the same ones); interop's "records left unread" warning
        # is about resuming with too few ranks and would only mislead here.
        interop_log = logging.getLogger("refckpt.interop")
        level = interop_log.level
        interop_log.setLevel(logging.ERROR)
        try:
            with quiet_single_process():
                DistributedCheckpointer().load(step_dir, state)
            groups = [g for g in state[OPTIMIZER_KEY]["param_groups"] if isinstance(g, dict)]
        except (CheckpointError, OSError) as e:
            section["error"] = f"param_groups unreadable: {e}"
        finally:
            interop_log.setLevel(level)
    for g in groups:
        params = [str(p) for p in g.get("params") or []]
        hyper = {k: jsonable(v) for k, v in g.items() if k != "params"}
        seen = set().union(*(by_param.get(p, set()) for p in params)) if params else set()
        section["groups"].append({"kind": optimizer_kind(seen, hyper), "params": len(params),
                                  "params_with_state": sum(p in by_param for p in params), "hyperparameters": hyper})
    section["kind"] = (", ".join(dict.fromkeys(g["kind"] for g in section["groups"])) if section["groups"]
                       else optimizer_kind(set(section["state_entries"])))
    return section


def _extra_section(st: StepStatus, layout: str | None) -> dict[str, Any]:
    section: dict[str, Any] = {"layout": layout, "files": 0, "keys": {}, "error": None}
    if layout in (EXTRA_NONE, None):
        return section
    ck = DistributedCheckpointer()
    try:
        if layout == EXTRA_STATE_PER_RANK:
            names = os.listdir(os.path.join(st.path, EXTRA_STATE_DIR))
            section["files"] = len(names)
            world = (st.manifest.world_size if st.manifest is not None else None) or len(names)
            # The reader load uses: checksums against the commit record, then weights_only=True.
            extra = ck._read_extra_per_rank(st.path, 0, world, st.manifest)
            section["read_from"] = "rank 0"
        else:
            with quiet_single_process():
                extra = ck.load(st.path, {EXTRA_STATE_KEY: {}})[EXTRA_STATE_KEY]
        section["keys"] = {str(k): _describe_value(v) for k, v in extra.items()}
    except (CheckpointError, OSError) as e:
        section["error"] = str(e)
    return section


def inspect_step(path: str | os.PathLike) -> dict[str, Any]:
    """Keys, shapes, dtypes and chunks of every saved item, optimizer kinds and hyperparameters,
    and the extra-state keys of one step (a root: the step resume picks). JSON-able.

    A step committed per rank (``__R.metadata`` only) has its items listed from every rank's
    record, each entry naming its ``record``; ``records`` lists them (empty for one ``.metadata``)."""
    kind, path = resolve(path)
    if kind == KIND_STEP:
        out = _inspect_once(path, None)
        if out is None:
            raise CheckpointNotFoundError(
                f"{path}: deleted or replaced while inspect read it (retention or an overwrite by a running save); "
                f"inspect the root ({os.path.dirname(path)}) for the step resume picks now.")
        return out
    for _ in range(INSPECT_RETRIES + 1):
        latest = find_latest_checkpoint(path)
        if latest is None:
            raise IncompleteCheckpointError(
                f"{path}: holds no complete checkpoint to inspect; `refckpt ls {path}` says why each step is not.")
        out = _inspect_once(latest, f"{path} is a root; showing {os.path.basename(latest)}, the step resume picks")
        if out is not None:
            return out
        log.info("%s was deleted while inspect read it (retention of a running save); taking the newest again", latest)
    raise CheckpointNotFoundError(
        f"{path}: every step inspect took was deleted while it was read ({INSPECT_RETRIES + 1} times): retention of a "
        f"running save deletes steps faster than they can be read; inspect one step retention keeps.")


def _inspect_once(path: str, note: str | None) -> dict[str, Any] | None:
    """:func:`inspect_step` of one step directory; None when it was deleted or replaced while read."""
    before = step_identity(path)
    try:
        out = _inspect_step(path, note)
    except (CheckpointError, OSError):
        if _changed(path, before):
            return None
        raise
    if out["errors"] and _changed(path, before):
        return None
    return out


def _changed(path: str, before: tuple[int, int] | None) -> bool:
    after = step_identity(path)
    return after is None or after != before


def _inspect_step(path: str, note: str | None) -> dict[str, Any]:
    st = check_step_dir(path)
    if st.vanished:
        raise CheckpointNotFoundError(f"{path}: {st.reason}")
    if st.metadata is None:
        raise IncompleteCheckpointError(f"{path}: nothing to inspect: {st.reason}.")
    if st.damaged:  # a record that fails its checksum or structure is not described field by field
        raise (UnsafeCheckpointError if st.unsafe else CorruptCheckpointError)(
            f"{path}: nothing to inspect: damaged: {st.reason}")
    info = describe_step(path)
    records = list(st.commit_records or ())
    errors: list[str] = []
    if records and records[0] != METADATA_FILE:
        # Committed per rank (DCP use_collectives=False): each __R.metadata lists rank R's items
        # only, so every record is read and each entry says which record it came from.
        entries = []
        for r, name in enumerate(records):
            try:
                md = st.metadata if r == 0 else load_metadata(safe_relpath(st.path, name))
            except (CheckpointError, OSError) as e:
                errors.append(f"{name} unreadable: {e}")
                continue
            entries += [{**e, "record": name} for e in _entries(md)]
    else:
        records, entries = [], _entries(st.metadata)
    out: dict[str, Any] = {
        "path": path, "note": note, "step": st.step, "state": info.state, "reason": info.reason,
        "format": info.format, "world_size": info.world_size, "checksums": info.checksums,
        "record_checksum": info.record_checksum,
        "saved_global_step": st.manifest.global_step if st.manifest is not None else None, "records": records,
        "entries": entries, "optimizer": None,
    }
    tops = saved_tops(st.metadata)
    out["tops"] = {t: {"tensors": sum(1 for e in entries if e["top"] == t and e["kind"] == "tensor"),
                       "items": sum(1 for e in entries if e["top"] == t and e["kind"] == "bytes"),
                       "nbytes": sum(e.get("nbytes", 0) for e in entries if e["top"] == t)} for t in tops}
    if OPTIMIZER_KEY in tops:
        out["optimizer"] = _optimizer_section(path, st.metadata, entries)
    out["extra_state"] = _extra_section(st, info.extra_state)
    errors += [s["error"] for s in (out["optimizer"] or {}, out["extra_state"]) if s.get("error")]
    if not st.complete:
        errors.insert(0, f"{path}: {info.state}: {st.reason}")
    out["errors"] = errors
    return out
