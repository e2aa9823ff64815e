"""The commit: how a save of step N becomes the checkpoint ``global_step_N``. The save protocol.

The protocol's steps, in order, with who runs each and where it lives. Fault points
(``faults/points.py``) are named after these steps (:class:`refckpt.protocol.SavePoint`), never
after line numbers, and :meth:`FileIO.mark <refckpt.durable.FileIO.mark>` reports the marked ones
in this order.

1. (all ranks)   ``WAIT_PREVIOUS``   wait for any in-flight async save; saves never overlap
                                     (:meth:`DistributedCheckpointer.save <refckpt.checkpointer.DistributedCheckpointer.save>`).
2. (coordinator) ``PREPARE``         :meth:`StagedStep.create`: make ``.global_step_N.<writer>.partial/``
                                     (after its claim ``.claim.<writer>``, :mod:`refckpt.holders`);
                                     refuse to overwrite a complete step N unless asked; remove an
                                     incomplete step N, stale staging of step N, staging of any step
                                     whose writer is provably gone, and what crashed saves and
                                     retention left (:func:`_sweep`). The coordinator's writer makes the
                                     staging directory's entry durable (fsync of the root) before any shard.
   (all ranks)   ``STAGING``         async save only: copy the state into host memory on the caller's
                                     thread (:class:`refckpt.staging.Stager`); ``save`` returns after it.
                                     Deferred snapshot (``snapshot="deferred"``): ``save`` returns after
                                     recording what to copy, with no collective call on the caller's
                                     thread; in the background the copy runs first, then 2 (and the
                                     embedded extra state's rank-invariance check), then the copy's
                                     check: a saved tensor changed since the call fails the save in
                                     DCP's planning, on every rank, before anything of 3 is written.
3. (all ranks)   ``EXTRA_STATE``     :meth:`SafetensorsWriter.write_data <refckpt.storage.SafetensorsWriter.write_data>`:
                                     write per-rank extra state; fsync it, its directory and the staging directory;
                 ``SHARDS``          stream the rank's safetensors shard (header, then every tensor's bytes
                                     from its memory, a CRC-32C per item); fsync the file and the directory.
4. (all ranks)   ``AGREE``           DCP gathers every rank's write results on the coordinator
                                     (``dcp.save`` in :meth:`DistributedCheckpointer._persist
                                     <refckpt.checkpointer.DistributedCheckpointer._persist>`); a rank
                                     that failed makes every rank raise, and :meth:`StagedStep.abort`
                                     removes the staging directory.
5. (coordinator) ``COMMIT``          :meth:`SafetensorsWriter.finish <refckpt.storage.SafetensorsWriter.finish>`:
                                     write ``.metadata``, DCP's ``Metadata`` with the
                                     :class:`~refckpt.record.Manifest` (every file, its size and
                                     checksums) and a self-checking footer: tmp -> fsync -> rename -> fsync dir.
6. (coordinator) ``PUBLISH``         :meth:`StagedStep.publish`: check that the staging directory holds this
                                     save's own intact record; rename it to ``global_step_N`` (atomic
                                     exchange when overwriting, then remove the old step); fsync the root.
                                     From here the step is complete.
7. (coordinator) ``POINTER``         :meth:`StagedStep.publish`: ``latest_checkpoint_iteration.txt``:
                                     tmp -> fsync -> replace -> fsync the root. Monotonic: it names
                                     this step, or the newest complete step on disk when that is newer
                                     (a save of an older step is acknowledged; the pointer stays).
8. (coordinator) ``RETENTION``       :func:`retain`: keep-last-k: delete older steps (each renamed aside,
                                     then removed), never the newest complete one, never the step just
                                     saved or the one the pointer names, never one a live reader (of
                                     any host) holds a lease on (:mod:`refckpt.holders`); failures are
                                     logged. One listing of the root, and one more for leases taken
                                     while it renamed steps aside; completeness checked only where the
                                     decision needs it.
9. (all ranks)   ``DONE``            every rank learns the outcome; ``save`` returns or raises everywhere.

Async save runs 1-2 and stages tensors to host memory on the caller's thread, 3-9 in the
background; deferred, only 1 and the record of what to copy run on the caller's thread, and the
copy, then 2, then 3-9 in the background (``STAGING`` is then marked before ``PREPARE``).
Every durable write of 3, 5 and 7 is :func:`refckpt.durable.durable_write`. A directory another
writer may publish or readers may see (another save's staging of step N, an incomplete step N)
is renamed aside before it is removed, as retention's are.
"""

from __future__ import annotations

import dataclasses
import errno
import logging
import os
import secrets

from . import holders
from .durable import DEFAULT_IO, FileIO, durable_write, tmp_prefix
from .errors import (
    CheckpointError,
    CheckpointExistsError,
    InvalidCheckpointPathError,
    SaveFailedError,
    os_error_hint,
)
from .layout import (
    LATEST_CHECKPOINT_FILE,
    METADATA_FILE,
    STEP_PREFIX,
    check_step_dir,
    list_step_dirs,
    read_pointer,
    staging_dir_name,
    staging_step,
    staging_writer,
    step_dirs_of,
)
from .protocol import SavePoint
from .record import Manifest, read_record_bytes, split_record
from .safeload import load_record

__all__ = ["StagedStep", "retain", "newest_complete_step", "take_lease", "drop_lease", "staging_verdict"]

log = logging.getLogger(__name__)

#: Reader leases and writer claims (:mod:`refckpt.holders`), re-exported where callers took them.
take_lease = holders.take_lease
drop_lease = holders.drop_lease


@dataclasses.dataclass(frozen=True)
class StagedStep:
    """One save's staging directory of step ``step`` under ``root``, and its way into ``step_dir``.

    The coordinator creates, aborts and publishes it; every rank writes into the ``path`` the
    coordinator created (its ``path`` and ``writer`` are all that travel between ranks: the I/O
    layer need not be picklable)."""

    root: str
    step_dir: str
    step: int
    #: this save's own token: it names the staging directory and goes into the manifest, so that
    #: publish can tell this save's commit record from another writer's.
    writer: str
    #: the staging directory, ``.global_step_N.<writer>.partial`` in ``root``.
    path: str
    io: FileIO = dataclasses.field(default=DEFAULT_IO, repr=False, compare=False)
    #: fsync what publish renames (False forfeits power-loss safety; the pointer is synced anyway).
    sync_files: bool = True

    # -- step 2 ----------------------------------------------------------------------------------
    @classmethod
    def create(cls, root: str, step_dir: str, step: int, *, io: FileIO = DEFAULT_IO, sync_files: bool = True,
               overwrite: bool = False) -> StagedStep:
        """Make a new staging directory for step ``step`` (protocol step 2, on the coordinator)."""
        writer = secrets.token_hex(8)
        staged = cls(root, step_dir, step, writer, os.path.join(root, staging_dir_name(step, writer)), io, sync_files)
        io.mark(SavePoint.PREPARE, path=staged.path)
        if os.path.exists(root) and not os.path.isdir(root):
            raise InvalidCheckpointPathError(f"{root}: exists and is not a directory; pass a directory as checkpoint root.")
        io.mkdir(root)
        pointer = os.path.join(root, LATEST_CHECKPOINT_FILE)
        if os.path.isdir(pointer) and not os.path.islink(pointer):  # os.replace could never publish over it
            raise InvalidCheckpointPathError(f"{pointer}: is a directory where refckpt keeps its pointer file; "
                                             f"remove or rename it, then save again. Nothing was written.")
        if os.path.lexists(step_dir):
            st = check_step_dir(step_dir, root)
            if st.complete and not overwrite:
                raise CheckpointExistsError(
                    f"{step_dir}: a complete checkpoint of step {step} exists; refusing to overwrite it. "
                    f"Pass DistributedCheckpointer(overwrite=True) to replace it (the old one stays "
                    f"resumable until the new one is committed), or save under another step."
                )
            if not st.complete:
                log.warning("removing incomplete %s (%s) before saving step %d", step_dir, st.reason, step)
                _remove_aside(io, root, step_dir)
        _sweep(io, root, step)
        # The claim names this writer so that any host can tell a live save from an abandoned one
        # (refckpt.holders); it exists before the staging directory does, and is renewed until
        # publish or abort remove it.
        holders.write_holder(staged.claim)
        try:
            io.mkdir(staged.path)
        except BaseException:
            holders.release(staged.claim)
            raise
        # The coordinator's writer fsyncs the root (the staging entry) before any shard, in the
        # background for an async save: its caller does not wait for a directory fsync.
        return staged

    @property
    def claim(self) -> str:
        """This save's claim on its staging directory (:mod:`refckpt.holders`), ``.claim.<writer>``."""
        return os.path.join(self.root, f"{holders.CLAIM_PREFIX}{self.writer}")

    # -- step 4, when a rank failed ---------------------------------------------------------------
    def abort(self) -> None:
        """Remove the staging directory after a failed save, best effort: a later save removes it
        anyway (readers ignore hidden staging directories)."""
        try:
            if os.path.lexists(self.path):
                _remove(self.io, self.path)
        except OSError as e:
            log.warning("could not remove %s after a failed save: %s", self.path, e)
        # The save is over either way: without its claim, a staging directory left here is judged by
        # its age (removed by the first save once it is older than the ttl; at once by one of its step).
        holders.release(self.claim)

    # -- steps 6 and 7 ----------------------------------------------------------------------------
    def publish(self, footer: bytes | None, *, overwrite: bool = False) -> None:
        """Rename the staging directory into place and write the pointer (protocol steps 6-7).

        ``footer``: the footer of the commit record this save wrote (None: parse the staged record
        and compare its writer token instead). ``overwrite``: publish over a complete step N by
        atomic exchange (the old step stays resumable until then)."""
        try:
            self._publish(footer, overwrite)
        finally:
            if not os.path.lexists(self.path):  # published (or removed): nothing left to claim
                holders.release(self.claim)

    def _publish(self, footer: bytes | None, overwrite: bool) -> None:
        root, step_dir, step = self.root, self.step_dir, self.step
        self.io.mark(SavePoint.PUBLISH, path=step_dir)
        self._check_own_record(footer)
        if os.path.lexists(step_dir) and overwrite:
            if self.io.exchange(self.path, step_dir):
                self._fsync_published()
                self._remove_after_publish(self.path)  # now holds the old step
            else:  # file systems without RENAME_EXCHANGE (tests/test_protocol_edges.py)
                old = os.path.join(root, f".{os.path.basename(step_dir)}.{self.writer}.old")
                log.warning("no atomic exchange on this file system; replacing %s with two renames", step_dir)
                self.io.replace(step_dir, old)
                self.io.replace(self.path, step_dir)
                if self.sync_files:
                    self.io.fsync_dir(root)
                self._remove_after_publish(old)
        else:
            # rename(2) of a directory never replaces a non-empty one: if another writer published
            # this step since prepare, this fails (ENOTEMPTY/EEXIST) and this save is not acknowledged.
            try:
                self.io.replace(self.path, step_dir)
            except OSError as e:
                if e.errno not in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR, errno.EISDIR):
                    raise
                self.abort()
                raise SaveFailedError(
                    f"save of step {step}: {step_dir} appeared while this save was written (another job or "
                    f"an older incarnation of this one saves into the same root {root}); this save was not "
                    f"published and the step on disk is the other writer's. Give each job its own checkpoint "
                    f"root, and make sure no earlier incarnation of the job is still running.") from e
            self._fsync_published()
        pointer = os.path.join(root, LATEST_CHECKPOINT_FILE)
        self.io.mark(SavePoint.POINTER, path=pointer)
        try:
            self._write_pointer(pointer)
        except OSError as e:  # the step is already published: say so, not "nothing was published"
            raise SaveFailedError(f"step {step} is committed at {step_dir} (resume finds it), but writing the "
                                  f"pointer {pointer} failed ({type(e).__name__}: {e}); the pointer is only a "
                                  f"hint, so nothing is lost.{os_error_hint(e, root)}") from e

    #: Rewrites of the pointer after another writer published a newer step between this save's
    #: look and its write (two jobs saving into one root); each follows a newer step.
    POINTER_RECHECKS = 4

    def _write_pointer(self, pointer: str) -> None:
        """Protocol step 7: the pointer is monotonic. It names this step, or the newest complete step
        on disk when that is newer (a save of an older step is acknowledged and leaves the pointer at
        the newest). Written (tmp, fsync, replace, fsync the root: synced even without sync_files, it
        is tiny) for this step always, for a newer one only when the pointer does not name it yet; then
        the root is listed once more: a newer step that another writer published while this one
        looked would otherwise be named by an older pointer."""
        target = newest_complete_step(self.root, self.step)
        if target != self.step:
            log.info("saved step %d is older than the complete step %d on disk; the pointer stays at %d",
                     self.step, target, target)
        for _ in range(self.POINTER_RECHECKS + 1):
            if target == self.step or read_pointer(self.root) != target:
                durable_write(pointer, f"{target}\n".encode(), self.io, tmp=pointer_tmp(pointer))
            newer = newest_complete_step(self.root, target)
            if newer == target:
                return
            target = newer

    def _check_own_record(self, footer: bytes | None) -> None:
        """The staging directory about to be published must hold this save's own commit record,
        intact: never publish a directory another writer wrote into or replaced. ``footer``: the
        record footer (length and SHA-256) this save's writer wrote; the file must end with it and
        its bytes must match it -- a read and a hash, no parse. Without one (the writer ran in
        another process), the record is parsed and its writer token compared."""
        path = os.path.join(self.path, METADATA_FILE)
        theirs: str | None
        try:
            if footer is not None:
                data = read_record_bytes(path)
                ok = data.endswith(footer) and split_record(data, path)[1] is not None
                theirs = self.writer if ok else "another writer's record"
            else:
                md, checksum = load_record(path)
                manifest = Manifest.of(md, path)
                theirs = manifest.writer if manifest is not None and checksum else None
        except (CheckpointError, OSError) as e:
            theirs = f"unreadable ({e})"
        if theirs != self.writer:
            raise SaveFailedError(
                f"save of step {self.step}: the staging directory {self.path} does not hold this save's commit "
                f"record (found: {theirs}; this save is {self.writer!r}); another process writes into the same "
                f"root. Nothing was published. Give each job its own checkpoint root.")

    def _remove_after_publish(self, path: str) -> None:
        try:
            _remove(self.io, path)
        except (OSError, RecursionError) as e:
            log.warning("step %d is committed at %s; the replaced copy %s could not be removed (%s: %s); the next "
                        "save removes it", self.step, self.step_dir, path, type(e).__name__, e)

    def _fsync_published(self) -> None:
        """Make the rename that published the step durable. It is visible already, so a failure
        must not claim the previous checkpoint is still the newest."""
        if not self.sync_files:
            return
        try:
            self.io.fsync_dir(self.root)
        except OSError as e:
            raise SaveFailedError(
                f"step {self.step} is committed and visible at {self.step_dir}, but making its directory entry "
                f"durable (fsync of {self.root}) failed ({type(e).__name__}: {e}): resume on this machine finds "
                f"it; after a power loss it may be gone and resume takes the previous step. Save again to be "
                f"sure.{os_error_hint(e, self.root)}"
            ) from e


# -- step 8 ---------------------------------------------------------------------------------------
def retain(root: str, keep_last: int, just_saved: int, io: FileIO = DEFAULT_IO) -> None:
    """Keep the newest ``keep_last`` complete steps under ``root`` (protocol step 8, after the
    pointer): older steps, and incomplete ones older than ``just_saved``, are renamed aside (readers
    see a step vanish whole, never half-deleted) and removed. Never deleted: the newest complete step,
    ``just_saved`` (the save just acknowledged, even when it is older than the newest ``keep_last``:
    it goes with the next save's retention, once a newer complete step than it exists), the step the
    pointer names, a step a live reader holds a lease on (:mod:`refckpt.holders`, from any host).
    A deletion that fails is logged and left for the next save.

    Leases and deletion race: a reader takes its lease, then checks that the step is still there;
    retention renames the step aside, then looks for a live lease on it once more and renames it back
    when one appeared. Either the reader's check sees the step gone (and it looks again), or the
    lease was there before the rename and retention's second look finds it. Dead and expired leases
    (:func:`refckpt.holders.judge`) are removed on the way.

    O(steps): one listing of the root (step names and leases together), completeness checked only
    where the decision needs it -- until ``keep_last`` complete steps are found, and for an
    unfinished-looking step newer than ``just_saved`` (not this save's to judge) -- and every other
    step deleted by its name, unread."""
    try:
        names = os.listdir(root)
    except OSError as e:
        log.warning("retention could not list %s: %s", root, e)
        return
    clock = holders.Clock(root)
    leased = holders.live_leases(root, names, clock, remove_dead=True)
    pointed = read_pointer(root)
    kept = 0
    doomed: list[tuple[str, str]] = []
    for step, path in step_dirs_of(root, names):
        if kept < keep_last or step > just_saved:
            st = check_step_dir(path, root)
            if st.vanished:
                continue  # deleted meanwhile (another writer's retention)
            if st.complete and kept < keep_last:
                kept += 1
                continue
            if not st.complete and step >= just_saved:
                continue  # not ours to judge: newer than what we committed
        if step in (just_saved, pointed):
            continue  # the save just acknowledged, the step the pointer names
        name = os.path.basename(path)
        if name in leased:
            log.info("retention: keeping %s, %s holds a lease on it", path, leased[name])
            continue
        try:
            aside = _rename_aside(io, root, path)  # readers see the step vanish whole, never half-deleted
        except OSError as e:
            log.warning("retention could not delete %s: %s", path, e)
            continue
        if aside is not None:
            doomed.append((path, aside))
    if not doomed:
        return
    # The second look, once for every step renamed aside: a lease taken meanwhile puts its step back.
    try:
        late = holders.live_leases(root, [n for n in os.listdir(root) if holders.lease_step(n) is not None],
                                   holders.Clock(root))
    except OSError as e:
        log.warning("retention could not list %s again (%s); keeping the steps it renamed aside for the next save",
                    root, e)
        return
    for path, aside in doomed:
        reader = late.get(os.path.basename(path))
        try:
            if reader is not None:
                try:
                    io.replace(aside, path)
                    log.info("retention: keeping %s, %s took a lease on it meanwhile", path, reader)
                    continue
                except OSError as e:
                    log.warning("retention: %s took a lease on %s meanwhile, but it could not be put back (%s)",
                                reader, path, e)
            _remove(io, aside)
        except (OSError, RecursionError) as e:
            # One failed deletion must not fail the save that was already committed.
            log.warning("retention could not delete %s: %s", path, e)


def newest_complete_step(root: str, step: int) -> int:
    """The newest complete step under ``root`` newer than ``step``, else ``step``: one listing, and a
    completeness check of the newer names only (none when ``step`` is the newest, the usual case)."""
    for newer, path in list_step_dirs(root):
        if newer <= step:
            break
        if check_step_dir(path, root).complete:
            return newer
    return step


def pointer_tmp(pointer: str) -> str:
    """The pointer's tmp file for this process: ``.latest_checkpoint_iteration.txt.tmp.<machine>.<pid>``,
    so that a sweep can tell a live writer's (of any job in the root) from a dead one's."""
    return os.path.join(os.path.dirname(pointer), f"{tmp_prefix(pointer)}{holders.machine_key()}.{os.getpid()}")


# -- helpers --------------------------------------------------------------------------------------
def _age_verdict(path: str, clock: holders.Clock) -> holders.Verdict | None:
    """A leftover with no holder file, judged by its own age (None: gone)."""
    try:
        mtime = os.lstat(path).st_mtime
    except FileNotFoundError:
        return None
    return holders.judge(None, mtime, clock)


def staging_verdict(root: str, name: str, clock: holders.Clock | None = None) -> holders.Verdict | None:
    """Is the save writing staging directory ``name`` alive? Judged by its claim (``.claim.<writer>``),
    else (a save from before claims, or one whose claim was removed) by the directory's age. None: gone."""
    clock = clock or holders.Clock(root)
    writer = staging_writer(name)
    if writer is not None:
        got = holders.read_holder(os.path.join(root, f"{holders.CLAIM_PREFIX}{writer}"))
        if got is not None:
            return holders.judge(got[0], got[1], clock)
    return _age_verdict(os.path.join(root, name), clock)


def _pointer_tmp_verdict(root: str, name: str, suffix: str, clock: holders.Clock) -> holders.Verdict | None:
    """A pointer tmp file's writer: ``<machine>.<pid>`` of this machine by its pid, else by age."""
    key, _, pid = suffix.rpartition(".")
    if key == holders.machine_key() and pid.isdigit():
        alive = holders.pid_alive(int(pid))
        return holders.Verdict(alive, f"pid {pid} on this host {'is writing it' if alive else 'exited'}")
    return _age_verdict(os.path.join(root, name), clock)


def _sweep(io: FileIO, root: str, step: int) -> None:
    """Remove what crashed saves and retention left in the root, of *any* step, and never what a live
    writer (of this job or another, on any host) still uses:

    * staging directories of this step (an earlier attempt's, or a writer that is still running and
      must not publish a mix: its publish then fails, naming this);
    * staging directories of other steps whose writer is provably gone: its claim's holder is dead
      (this machine: pid and start time) or expired (another host: not renewed within its ttl, by the
      file system's clock), or, without a claim, untouched for the default ttl; their claims, and
      claims left without a staging directory;
    * pointer tmp files of a dead writer (this machine: its pid; elsewhere: older than the ttl);
    * steps already renamed aside for deletion, and the file system clock's probe files.

    None is a checkpoint or can become one. A leftover that cannot be removed is named and left: it
    never blocks this save."""
    ptmp = tmp_prefix(os.path.join(root, LATEST_CHECKPOINT_FILE))
    clock = holders.Clock(root)
    names = os.listdir(root)
    stagings = {w for n in names if (w := staging_writer(n)) is not None}
    for name in names:
        path = os.path.join(root, name)
        aside = False
        sstep = staging_step(name)
        if sstep is not None:
            if sstep != step:
                v = staging_verdict(root, name, clock)
                if v is None or v.alive:
                    continue
                log.warning("removing %s: an interrupted save's staging directory (%s)", path, v.reason)
            else:
                log.warning("removing %s left by an interrupted save of this step", path)
            aside = True
        elif name.startswith(ptmp):
            v = _pointer_tmp_verdict(root, name, name[len(ptmp):], clock)
            if v is None or v.alive:
                continue
            log.warning("removing %s left by an interrupted pointer write (%s)", path, v.reason)
        elif name.startswith(holders.CLAIM_PREFIX):
            if name[len(holders.CLAIM_PREFIX):] in stagings:
                continue  # judged with its staging directory (removed after it)
            got = holders.read_holder(path)
            if got is None or holders.judge(got[0], got[1], clock).alive:
                continue
            log.info("removing %s, the claim of a save that ended", path)
        elif name.startswith(holders._CLOCK_PREFIX):
            v = _age_verdict(path, clock)
            if v is None or v.alive:
                continue
        elif not (name.startswith(f".{STEP_PREFIX}") and name.endswith((".deleting", ".old"))):
            continue
        else:
            log.warning("removing %s left by an interrupted save or retention", path)
        try:
            if aside:
                _remove_aside(io, root, path)
                writer = staging_writer(name)
                if writer is not None:
                    holders.release(os.path.join(root, f"{holders.CLAIM_PREFIX}{writer}"))
            else:
                _remove(io, path)
        except (OSError, RecursionError) as e:
            log.warning("could not remove %s (%s: %s); it is not a checkpoint and is left as it is: "
                        "remove it by hand", path, type(e).__name__, e)


def _rename_aside(io: FileIO, root: str, path: str) -> str | None:
    """Rename ``path`` to a hidden ``.deleting`` name beside it; None when it is gone already."""
    name = os.path.basename(path)  # hidden, as retention's: readers skip it, the next save's sweep removes it
    aside = os.path.join(root, f"{'' if name.startswith('.') else '.'}{name}.{secrets.token_hex(4)}.deleting")
    try:
        io.replace(path, aside)
    except FileNotFoundError:
        log.info("%s was published or removed by its writer meanwhile; left to it", path)
        return None
    return aside


def _remove_aside(io: FileIO, root: str, path: str) -> None:
    """Remove a directory that another writer may be about to publish (its staging directory), or
    that readers may be looking at: rename it aside atomically first, then remove it there.

    Removing it in place raced that writer's publish: the removal works through a descriptor of
    the directory (:func:`refckpt.durable.remove_tree`), which follows it to its new name, so a
    publish in the middle of the removal acknowledged a step whose files the removal then took
    (seen once in the fault matrix: two writers of one step, both acknowledged, one step left).
    Renamed aside, one of two renames wins: the publish (then this rename fails, ENOENT, and the
    published step is left whole) or this one (then the publish fails, and that save is not
    acknowledged)."""
    if os.path.isdir(path) and not os.path.islink(path):
        aside = _rename_aside(io, root, path)
        if aside is None:
            return
        path = aside
    _remove(io, path)


def _remove(io: FileIO, path: str) -> None:
    if os.path.islink(path) or not os.path.isdir(path):
        io.unlink(path)
    else:
        io.rmtree(path)
