"""The on-disk contract: names, parsing, completeness, and which step resume picks.

::

    <root>/
    ├── latest_checkpoint_iteration.txt      # newest committed step, "42\\n" -- a hint, not the truth
    ├── .global_step_43.partial/             # staging of a save in flight (ignored by readers)
    └── global_step_42/
        ├── .metadata                        # DCP metadata = the commit record, written last
        ├── __0_0.safetensors, ...           # shard payloads, each a valid safetensors file
        └── extra_state/extra_state_rank_0.pt

Reader rules (what counts as a checkpoint):

* A step directory is **complete** iff its commit record exists (``.metadata``,
  or the ``__R.metadata`` spelling DCP writes with ``use_collectives=False``)
  and every file the record covers exists with the recorded size. Content
  checksums are verified when bytes are read (load, ``verify``).
* The pointer is a cache: resume lands on the newest complete step whatever the
  pointer says (torn, garbage, stale, dangling).
* Names are parsed strictly: ``global_step_`` + the canonical decimal of the step
  (ASCII digits, no sign, no leading zeros, at most int64), the only spelling a
  writer produces -- so ``global_step_007`` cannot pose as step 7 beside the real
  one. Nothing a checkpoint records may point outside the step directory, a
  commit record or step directory may not resolve outside it or the root, and
  the pointer is read only as a regular file (not through a symlink, never a
  FIFO that would block resume).

:func:`check_step_dir` answers with a :class:`StepStatus` whose :class:`StepState` (complete,
incomplete, corrupt; staging directories from :func:`list_staging_dirs`) is what callers act on;
its ``reason`` is for people and never matched by code.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import stat
from typing import Any

from ._enum import StrEnum
from .errors import CorruptCheckpointError, InvalidCheckpointPathError, UnsafeCheckpointError
from .record import MANIFEST_ATTR, VALIDATED, Manifest, validate_record
from .safeload import open_regular, read_record

__all__ = [
    "STEP_PREFIX",
    "LATEST_CHECKPOINT_FILE",
    "METADATA_FILE",
    "EXTRA_STATE_DIR",
    "MANIFEST_ATTR",
    "MAX_STEP",
    "StepState",
    "StepStatus",
    "list_staging_dirs",
    "parse_step_dir_name",
    "step_dir_name",
    "staging_dir_name",
    "staging_writer",
    "staging_step",
    "read_pointer",
    "list_step_dirs",
    "step_dirs_of",
    "step_identity",
    "check_step_dir",
    "find_latest_checkpoint",
    "extra_state_file_name",
]

log = logging.getLogger(__name__)

STEP_PREFIX = "global_step_"
LATEST_CHECKPOINT_FILE = "latest_checkpoint_iteration.txt"
METADATA_FILE = ".metadata"
EXTRA_STATE_DIR = "extra_state"
#: Largest step number accepted (int64), so a crafted name cannot make a huge int.
MAX_STEP = 2**63 - 1

_STEP_RE = re.compile(r"global_step_(0|[1-9][0-9]{0,18})")
_POINTER_RE = re.compile(rb"[0-9]{1,19}")
_STAGING_RE = re.compile(r"\.global_step_(0|[1-9][0-9]{0,18})(?:\.([0-9a-f]{1,32}))?\.partial")
_RANK_MD_RE = re.compile(r"__(0|[1-9][0-9]{0,8})\.metadata")
#: A shard DCP's writers name after the rank that wrote it (``__R_0.distcp``, ``__R_0.safetensors``).
_RANK_SHARD_RE = re.compile(r"__(0|[1-9][0-9]{0,8})_[0-9]+\.(?:distcp|safetensors)")
#: hyper_parallel's own DCP spells a per-rank commit record ``0.metadata`` (no ``__``) and
#: pickles its own metadata classes: recognised only to say so when the step is skipped.
_FOREIGN_RANK_MD_RE = re.compile(r"[0-9]{1,9}\.metadata")


def step_dir_name(step: int) -> str:
    if not isinstance(step, int) or isinstance(step, bool) or not 0 <= step <= MAX_STEP:
        raise InvalidCheckpointPathError(
            f"global_step={step!r}: steps are integers in [0, {MAX_STEP}]; pass the training step count."
        )
    return f"{STEP_PREFIX}{step}"


def staging_dir_name(step: int, writer: str | None = None) -> str:
    """Where step ``step`` is written before it is published (hidden, never parsed as a step).

    ``writer``: the save's own token, so that two writers in one root (two jobs by mistake, a
    zombie incarnation beside its restart) never write into the same staging directory. Without
    one: the name refckpt used before tokens (removed as a stale leftover by the next save)."""
    return f".{step_dir_name(step)}.{writer}.partial" if writer else f".{step_dir_name(step)}.partial"


def staging_step(name: str) -> int | None:
    """The step of a staging directory name (with or without a writer token), else None."""
    m = _STAGING_RE.fullmatch(name)
    return int(m.group(1)) if m else None


def staging_writer(name: str) -> str | None:
    """The writer token of a staging directory name, else None (no token, or not a staging name)."""
    m = _STAGING_RE.fullmatch(name)
    return m.group(2) if m else None


def extra_state_file_name(rank: int) -> str:
    return f"extra_state_rank_{rank}.pt"


def parse_step_dir_name(name: str) -> int | None:
    """``global_step_42`` -> 42; anything else (signs, suffixes, leading zeros, non-ASCII digits) -> None."""
    m = _STEP_RE.fullmatch(name)
    if m is None:
        return None
    step = int(m.group(1))
    return step if step <= MAX_STEP else None


def read_pointer(root: str) -> int | None:
    """The step the pointer names, or None when it is absent, empty, torn or garbage (one read).

    Also None when the pointer is not a regular file of the root: a symlink (it could
    name anything outside the root), a directory, or a FIFO (whose ``open()`` would block
    resume forever). The pointer is only a hint; the scan decides.
    """
    try:
        with open_regular(os.path.join(root, LATEST_CHECKPOINT_FILE), follow_symlinks=False) as f:
            raw = f.read(64)
    except (OSError, CorruptCheckpointError):
        return None
    m = _POINTER_RE.fullmatch(raw.strip())
    if m is None:
        return None
    step = int(m.group(0))
    return step if step <= MAX_STEP else None


def list_step_dirs(root: str) -> list[tuple[int, str]]:
    """(step, path) of every name that parses as a step directory, newest first (one listing of
    ``root``, names only, no stat)."""
    try:
        names = os.listdir(root)
    except (FileNotFoundError, NotADirectoryError):
        return []
    return step_dirs_of(root, names)


def step_dirs_of(root: str, names: list[str]) -> list[tuple[int, str]]:
    """(step, path) of the names (one listing of ``root``) that parse as step directories, newest
    first: callers that need other names of the same listing (leases) list the root once."""
    out = []
    for name in names:
        step = parse_step_dir_name(name)
        if step is not None:
            out.append((step, os.path.join(root, name)))
    out.sort(reverse=True)
    return out


def step_identity(path: str) -> tuple[int, int] | None:
    """(device, inode) of ``path`` itself (a symlink as itself), or None when nothing is there: a
    reader compares it before and after reading a step, to tell a step that retention deleted or an
    overwrite replaced while it was read (gone) from damage that is still there."""
    try:
        info = os.lstat(path)
    except OSError:
        return None
    return info.st_dev, info.st_ino


class StepState(StrEnum):
    """What a directory under a checkpoint root is, as readers judge it."""

    #: a checkpoint: its commit record is intact and every file it lists is there at its size.
    COMPLETE = "complete"
    #: a save that never finished (no commit record), or a file the record lists is gone since.
    INCOMPLETE = "incomplete"
    #: something disagrees with the commit record or the layout (a record that fails its checksum
    #: or its structure, a file of the wrong size or kind, a path that escapes the step).
    CORRUPT = "corrupt"
    #: a staging directory (``.global_step_N.<writer>.partial``): a save in flight or interrupted.
    STAGING = "staging"



@dataclasses.dataclass
class StepStatus:
    """What a reader knows about one step directory (or, from :func:`list_staging_dirs`, a staging one)."""

    path: str
    step: int | None
    state: StepState = StepState.INCOMPLETE
    #: why it is not complete, for people (never matched by code: ``state``, ``damaged`` and
    #: ``unsafe`` say what it is); empty when complete.
    reason: str = ""
    #: Commit records found (``.metadata`` or ``__R.metadata`` names); empty when none was found.
    commit_records: tuple[str, ...] = ()
    #: refckpt's manifest from the commit record, or None for plain-DCP / family checkpoints.
    manifest: Manifest | None = None
    metadata: Any = None
    #: "sha256" when every commit record carries its own valid checksum; None for records
    #: written without one (plain DCP, refckpt/1).
    record_checksum: str | None = None
    #: every commit record's parsed ``Metadata`` by file name (per-rank records: one per rank).
    record_metadata: dict = dataclasses.field(default_factory=dict)
    #: corrupt in a way a load reports as :class:`~refckpt.errors.CorruptCheckpointError` (a record
    #: that fails its checksum or its structure, a file of the wrong kind); a corrupt step without
    #: it (a file of the wrong size, a path outside the root) is reported as incomplete.
    damaged: bool = False
    #: ``check_step_dir`` found the commit record crafted to run code or to reach outside the step,
    #: or a FIFO, device or directory planted where the record lists a file.
    unsafe: bool = False
    #: the step directory was deleted or replaced while it was checked (retention or an overwrite
    #: by a running save; refckpt renames a step aside before removing it): not damage, the step is
    #: gone. Its state is then incomplete, never corrupt.
    vanished: bool = False

    @property
    def complete(self) -> bool:
        return self.state is StepState.COMPLETE

    def _fail(self, state: StepState, reason: str, *, damaged: bool = False, unsafe: bool = False) -> StepStatus:
        self.state, self.reason, self.damaged, self.unsafe = state, reason, damaged, unsafe
        return self


def list_staging_dirs(root: str) -> list[StepStatus]:
    """Every staging directory under ``root`` (state :attr:`StepState.STAGING`), by name: a save in
    flight or interrupted. Readers ignore them; the next save of the same step removes them."""
    try:
        names = sorted(os.listdir(root))
    except (FileNotFoundError, NotADirectoryError):
        return []
    return [StepStatus(os.path.join(root, n), step, StepState.STAGING, "a save in flight or interrupted")
            for n in names if (step := staging_step(n)) is not None]


def _inside(path: str, parent: str) -> bool:
    path, parent = os.path.realpath(path), os.path.realpath(parent)
    return path == parent or path.startswith(parent + os.sep)


def _commit_records(step_dir: str) -> tuple[list[str], str, StepState]:
    """(commit records, "", COMPLETE so far) of a step directory, or ([], why there is none usable, state).

    Per-rank records (DCP ``use_collectives=False``) carry no world size, so the ranks
    are known only from the names: ``__0.metadata`` .. ``__{N-1}.metadata`` without a
    gap, and no rank that left a shard (``__R_0.distcp``) without its record -- that rank
    crashed before committing, and the records present would pass for a smaller world.
    """
    if os.path.isfile(os.path.join(step_dir, METADATA_FILE)):
        return [METADATA_FILE], "", StepState.COMPLETE
    try:
        names = os.listdir(step_dir)
    except OSError as e:
        return [], f"cannot list the step directory ({e})", StepState.CORRUPT
    ranks = sorted(int(m.group(1)) for n in names if (m := _RANK_MD_RE.fullmatch(n)))
    if not ranks:
        foreign = sorted(n for n in names if _FOREIGN_RANK_MD_RE.fullmatch(n))
        if foreign:
            return [], (f"no commit record refckpt reads: {foreign[0]} is the per-rank spelling of hyper_parallel's "
                        f"own DCP format (torch DCP writes .metadata or __R.metadata); save with torch."
                        f"distributed.checkpoint, or convert the checkpoint with hyper_parallel"), StepState.INCOMPLETE
        return [], "no commit record (.metadata): the save never finished", StepState.INCOMPLETE
    shard_ranks = {int(m.group(1)) for n in names if (m := _RANK_SHARD_RE.fullmatch(n))}
    missing = sorted((set(range(ranks[-1] + 1)) | shard_ranks) - set(ranks))
    if missing:
        return [], (f"per-rank commit records {[f'__{r}.metadata' for r in ranks]} lack __{missing[0]}.metadata: "
                    f"rank {missing[0]} never committed its part of the save"), StepState.CORRUPT
    return [f"__{r}.metadata" for r in ranks], "", StepState.COMPLETE


def safe_relpath(step_dir: str, rel: str) -> str:
    """Join a path recorded in a checkpoint to its step dir, refusing anything that escapes it."""
    if not isinstance(rel, str) or not rel or os.path.isabs(rel) or "\x00" in rel:
        raise UnsafeCheckpointError(f"{step_dir}: recorded file name {rel!r} is not a relative name.")
    full = os.path.normpath(os.path.join(step_dir, rel))
    if not _inside(full, step_dir):
        raise UnsafeCheckpointError(
            f"{step_dir}: recorded file {rel!r} resolves outside the step directory; refusing it."
        )
    return full


def _storage_sizes(metadata: Any) -> dict[str, int]:
    """File -> minimal size a commit record without a manifest (plain DCP) implies."""
    sizes: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        rel = getattr(info, "relative_path", None)
        if rel is None:
            continue
        end = int(getattr(info, "offset", 0)) + int(getattr(info, "length", 0))
        sizes[rel] = max(sizes.get(rel, 0), end)
    return sizes


def _file_sizes(st: StepStatus, wanted: dict[str, int], exact: bool) -> dict[str, int] | None:
    """Real sizes of the files a record covers, or None with ``st`` failed: a missing file is an
    incomplete step (a partial copy); a wrong size is corrupt; a path that escapes the step or a
    file of the wrong kind is damage.

    Every one must be a regular file inside the step directory (``stat`` follows a symlink
    that stays inside; a FIFO, device, socket or directory in a file's place is damage)."""
    sizes: dict[str, int] = {}
    for rel, size in wanted.items():
        try:
            full = safe_relpath(st.path, rel)
        except UnsafeCheckpointError as e:
            st._fail(StepState.CORRUPT, str(e), damaged=True, unsafe=True)
            return None
        try:
            info = os.stat(full)
        except OSError:
            st._fail(StepState.INCOMPLETE, f"missing file {rel}")
            return None
        if not stat.S_ISREG(info.st_mode):
            kind = "directory" if stat.S_ISDIR(info.st_mode) else "FIFO" if stat.S_ISFIFO(info.st_mode) else "device or socket"
            st._fail(StepState.CORRUPT, f"corrupt: {rel} is a {kind}, not a regular file", damaged=True, unsafe=True)
            return None
        if exact and info.st_size != size:
            st._fail(StepState.CORRUPT, f"{rel} has {info.st_size} bytes, commit record says {size}")
            return None
        if not exact and info.st_size < size:
            st._fail(StepState.CORRUPT, f"{rel} has {info.st_size} bytes, commit record needs at least {size}")
            return None
        sizes[rel] = info.st_size
    return sizes


def check_step_dir(path: str, root: str | None = None) -> StepStatus:
    """Decide whether ``path`` is a complete checkpoint, reading only the commit record and sizes.

    Each commit record is read by :func:`refckpt.safeload.load_record` (its own checksum, bounded
    parsing, an allow-list unpickler) and its structure checked by
    :func:`refckpt.record.validate_record` against the files' sizes, before anything uses it.

    A step that is not complete is looked at once more: when the directory is no longer there, or
    another one stands under its name (:func:`step_identity`), it was deleted or replaced while it
    was read -- retention or an overwrite of a running save -- and the answer says so
    (``vanished``, incomplete, never corrupt): readers report it as gone, not as damage."""
    before = step_identity(path)
    st = _check_step_dir(path, root)
    if not st.complete:
        after = step_identity(path)
        if after is None or after != before:
            st._fail(StepState.INCOMPLETE, f"gone: deleted or replaced while it was read ({st.reason}); "
                                           f"retention or an overwrite by a running save")
            st.vanished = True
    return st


def _check_step_dir(path: str, root: str | None) -> StepStatus:
    step = parse_step_dir_name(os.path.basename(os.path.normpath(path)))
    st = StepStatus(path=path, step=step)
    if root is not None and not _inside(path, root):
        return st._fail(StepState.CORRUPT, f"resolves outside {root} (symlink?)")
    if not os.path.isdir(path):
        return st._fail(StepState.CORRUPT, "not a directory")
    records, why, state = _commit_records(path)
    if not records:
        return st._fail(state, why)
    st.commit_records = tuple(records)
    parsed: list[tuple[str, Any]] = []
    checksums: set[str | None] = set()
    identities: list = []
    for rec in records:
        try:
            md, checksum, identity = read_record(safe_relpath(path, rec))
        except (CorruptCheckpointError, UnsafeCheckpointError, OSError) as e:
            return st._fail(StepState.CORRUPT, str(e), damaged=True, unsafe=isinstance(e, UnsafeCheckpointError))
        raw = getattr(md, MANIFEST_ATTR, None)
        if raw is not None and not Manifest.is_manifest(raw):
            return st._fail(StepState.CORRUPT, f"{rec}: malformed refckpt manifest", damaged=True)
        parsed.append((rec, md))
        checksums.add(checksum)
        identities.append(identity)
    st.metadata = parsed[0][1]
    st.record_checksum = checksums.pop() if len(checksums) == 1 else None
    st.record_metadata = {rec: md for rec, md in parsed}
    manifests: list[Manifest | None] = []
    wanted: dict[str, int] = {}
    for rec, md in parsed:
        try:
            manifest = Manifest.of(md, METADATA_FILE)
            wanted.update(manifest.sizes(METADATA_FILE) if manifest is not None else _storage_sizes(md))
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            return st._fail(StepState.CORRUPT, f"{rec}: malformed size record ({e})", damaged=True)
        manifests.append(manifest)
    st.manifest = manifests[0]
    sizes = _file_sizes(st, wanted, exact=st.manifest is not None)
    if sizes is None:
        return st
    whole = records[0] == METADATA_FILE
    key = (tuple(identities), tuple(sorted(sizes.items())), whole) if None not in identities else None
    if key is None or key not in VALIDATED:
        for (rec, md), manifest in zip(parsed, manifests):
            try:
                validate_record(md, manifest, sizes, os.path.join(path, rec), whole=whole)
            except CorruptCheckpointError as e:
                return st._fail(StepState.CORRUPT, f"corrupt: {e}", damaged=True)
        if key is not None:
            VALIDATED.add(key)
    saved_step = st.manifest.global_step if st.manifest is not None else None
    if saved_step is not None and st.step is not None and saved_step != st.step:
        return st._fail(StepState.CORRUPT, f"corrupt: the commit record was written for step {saved_step}, not "
                                           f"{st.step}: a step directory copied or renamed by hand; it would "
                                           f"resume the wrong step", damaged=True)
    st.state = StepState.COMPLETE
    return st


#: How many times :func:`find_latest_checkpoint` lists the root again after a step it was checking
#: vanished (retention of a running save deleted it): every new listing follows a deletion, so only
#: a root whose steps keep being deleted faster than one check uses them all.
RESCANS_AFTER_VANISHED = 8


def find_latest_checkpoint(root: str) -> str | None:
    """Path of the newest complete checkpoint under ``root``, or None.

    The pointer is tried first: when it names the newest step name present and
    that step is complete, the answer costs one pointer read, one listing of
    names and one completeness check. A listing is needed because only seeing a
    newer name can tell that the pointer is stale (a crash between publish and
    pointer, or a pointer rewritten by hand). Otherwise the steps are checked
    newest first until a complete one is found.

    A step that vanishes while it is checked (retention of a running save deletes old steps) is
    gone, not damaged: the root is listed again (at most :data:`RESCANS_AFTER_VANISHED` times), so a
    listing that retention made stale never ends in an older step, or in None, while a newer
    complete step is there.
    """
    for _ in range(RESCANS_AFTER_VANISHED + 1):
        found, stale = _find_latest_once(root)
        if not stale:
            return found
        log.debug("a step under %s vanished while it was checked (retention?); listing the root again", root)
    return found


def _find_latest_once(root: str) -> tuple[str | None, bool]:
    """(newest complete step or None, whether a step vanished while it was checked)."""
    hinted = read_pointer(root)
    steps = list_step_dirs(root)
    stale = False
    if hinted is not None and steps and steps[0][0] == hinted:
        st = check_step_dir(steps[0][1], root)
        if st.complete:
            return st.path, False
        stale = st.vanished
    for step, path in steps:
        st = check_step_dir(path, root)
        if st.vanished:
            stale = True
            continue
        if not st.complete:
            if st.damaged:
                log.warning("skipping damaged %s: %s", path, st.reason)
            else:
                log.debug("skipping %s: %s", path, st.reason)
            continue
        if hinted is not None and step != hinted:
            log.info("pointer %s names step %s; newest complete step is %s", LATEST_CHECKPOINT_FILE, hinted, step)
        return st.path, stale
    return None, stale
