"""The checkpointer contract that :mod:`faults.suite` judges, written down once.

This is the interface of the seed family (hyper_parallel / VeOmni ``CheckpointerBase`` and its
DCP ``DistributedCheckpointer``): :class:`Checkpointer` is what every checkpointer must offer,
:class:`Capability` is everything beyond it, which a checkpointer may *declare*. The suite uses
the contract only; a test of a capability that is not declared is skipped, saying which one.

On disk (what a judge may look at)::

    <root>/
    |-- latest_checkpoint_iteration.txt      "N": the newest step; a hint, never trusted
    `-- global_step_<N>/                     one step directory per save
        |-- .metadata                         the commit record (DCP metadata), written last
        `-- ...                               payload files (shards, extra state)

The suite never judges by these names. A step is *complete* when the checkpointer itself says so
and loads it: ``find_latest_checkpoint`` of a root holding only a copy of the step returns it
(``faults.suite._common.Completeness``), and resume then restores it bitwise. The record-damage
faults apply where a commit record is found (``.metadata``, or ``__<R>.metadata`` for a step
committed per rank by DCP with ``use_collectives=False``); a checkpointer without one skips them,
and ``faults.suite.test_file_roles`` damages each file its load reads, whatever it is called.

Every name the harness assumes on disk is defined here, once: the contract's (above) and those
of the reference protocol (refckpt's staging directory ``.global_step_<N>[.<writer>].partial``,
temporary files, steps renamed aside for deletion, readers' leases), which only the fault points
(:func:`faults.points.classify`) and refckpt's own fault matrix look for.

Declaring capabilities
----------------------
A ``capabilities`` attribute (an iterable of :class:`Capability` values or their string
names) on the factory that ``--checkpointer`` names, or else on the object the factory
returns. Without one, a checkpointer is judged as contract-only. Strings keep a library that
declares them free of any import of this harness::

    class MyCheckpointer:
        capabilities = ("overwrite", "keep_last")

The same attribute declares what a checkpointer *lacks* that the contract's state and calls would
otherwise draw (:class:`Limitation`: ``sync_only``, ``plain_tensors_only``, ``no_commit_record``,
``no_pointer``, ``registered_extra_state``). A limitation narrows what the suite draws (its
strategies and its state machine) and skips the properties that need what is lacking, each with
the reason -- so that a checkpointer that honestly cannot save asynchronously is judged on
everything else instead of failing every async draw::

    class HandWrittenCheckpointer:
        capabilities = ("sync_only", "plain_tensors_only", "no_commit_record", "no_pointer")

A limitation changes what is *asked*, never how an answer is judged: completeness, lost saves and
the resumed state are judged by what ``find_latest_checkpoint`` and ``load`` return (the suite's
completeness oracle asks the checkpointer itself about a copy of the step), never by a file name.

Severity of a finding
---------------------
* :data:`VIOLATION` -- the contract is broken: an acknowledged save lost, a wrong state loaded
  (silently different from what was saved), code executed from checkpoint bytes, a hang, or a
  write or delete outside the checkpoint root. A test that finds one fails.
* :data:`ADVISORY` -- a hardening gap that loses nothing by itself: an error that is not an
  ``Exception`` (``except Exception`` in a trainer misses it), saving over a complete step in
  place (a crash then loses it), following a symbolic link out of the root when reading. The
  test passes and reports it; ``--strict`` fails it.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterable
from typing import Any, Protocol, runtime_checkable

from refckpt._enum import StrEnum

__all__ = ["Checkpointer", "CheckpointerFactory", "Capability", "capabilities_of", "Limitation", "limitations_of",
           "VIOLATION", "ADVISORY",
           "DEFAULT_CHECKPOINTER", "STEP_PREFIX", "POINTER_FILE", "COMMIT_RECORD", "STEP_RE", "RANK_RECORD_RE",
           "EXTRA_STATE_DIR", "SHARD_SUFFIXES", "STAGING_SUFFIX", "TMP_SUFFIX", "DELETING_SUFFIX", "LEASE_PREFIX",
           "step_dir_name", "step_of", "rank_record_name", "extra_state_file_name", "is_commit_record", "step_numbers"]

#: The checkpointer judged when none is named (``--checkpointer``, ``killmatrix --correct``, the
#: fault matrix's rank functions): refckpt's, as a ``MODULE:FACTORY`` spec (no import of refckpt here).
DEFAULT_CHECKPOINTER = "refckpt:DistributedCheckpointer"

VIOLATION = "violation"
ADVISORY = "advisory"

# -- the contract's names on disk ------------------------------------------------------------
STEP_PREFIX = "global_step_"
POINTER_FILE = "latest_checkpoint_iteration.txt"
COMMIT_RECORD = ".metadata"
#: A step directory's name (``fullmatch``; group 1: the step).
STEP_RE = re.compile(re.escape(STEP_PREFIX) + r"([0-9]+)")
#: A per-rank commit record, ``__<R>.metadata`` (``fullmatch``; group 1: the rank).
RANK_RECORD_RE = re.compile(r"__([0-9]+)" + re.escape(COMMIT_RECORD))

# -- the seed family's payload names ----------------------------------------------------------
#: Per-rank extra state: ``<step>/extra_state/extra_state_rank_<R>.pt``.
EXTRA_STATE_DIR = "extra_state"
#: Shard files (``__<R>_<i>.safetensors`` from refckpt, ``__<R>_<i>.distcp`` from plain DCP).
SHARD_SUFFIXES = (".safetensors", ".distcp")

# -- the reference protocol's (refckpt's) other names ---------------------------------------
#: Staging directory of a save in flight: ``.global_step_<N>[.<writer>].partial``.
STAGING_SUFFIX = ".partial"
#: A file written aside before it is renamed into place (``.metadata.tmp``).
TMP_SUFFIX = ".tmp"
#: An old step renamed aside by retention before it is removed.
DELETING_SUFFIX = ".deleting"
#: A reader's lease on a step, ``.lease.global_step_<N>.<pid>``.
LEASE_PREFIX = ".lease"


def step_dir_name(step: int) -> str:
    return f"{STEP_PREFIX}{step}"


def rank_record_name(rank: int) -> str:
    return f"__{rank}{COMMIT_RECORD}"


def extra_state_file_name(rank: int) -> str:
    """The name, under :data:`EXTRA_STATE_DIR`, of rank ``rank``'s extra state."""
    return f"extra_state_rank_{rank}.pt"


def step_of(name: str) -> int | None:
    """``N`` of a step directory's name ``global_step_<N>``, else None."""
    m = STEP_RE.fullmatch(name)
    return int(m.group(1)) if m else None


def is_commit_record(name: str) -> bool:
    """``.metadata`` or a per-rank ``__<R>.metadata``."""
    return name == COMMIT_RECORD or RANK_RECORD_RE.fullmatch(name) is not None


def step_numbers(root: str) -> list[int]:
    """The steps of the step directories' names under ``root``, ascending (complete or not);
    an unreadable root has none."""
    try:
        names = os.listdir(root)
    except OSError:
        return []
    return sorted(s for s in map(step_of, names) if s is not None)


@runtime_checkable
class Checkpointer(Protocol):
    """What every checkpointer offers. Every rank of a world calls every method.

    ``state`` holds ``"model"`` and ``"optimizer"`` (DCP ``get_state_dict`` output, possibly
    DTensor-sharded; the optimizer may be a list of state dicts), optionally
    ``"fp32_main_params"`` (a mixed-precision branch) and ``"extra_state"`` (a dict of
    training state with ``"global_step"``).
    """

    def save(self, path: str, state: dict[str, Any], *, global_step: int, save_async: bool = False) -> None:
        """Save ``state`` as step ``global_step`` into the step directory ``path``
        (``<root>/global_step_<N>``; the pointer lives in its parent).

        First waits for any earlier async save. Sync: returns when the step is durable and
        the pointer names it (the save is then *acknowledged*). Async: returns once the state
        is staged, so the caller may change its tensors at once; the rest runs in the
        background and is acknowledged when :meth:`maybe_wait_for_async_save` returns. A
        failure raises (from here or from the wait); a failed save is never resumed from."""

    def load(self, path: str, state: dict[str, Any], *, strict_model: bool = True,
             extra_state_skeleton: dict[str, Any] | None = None) -> dict[str, Any]:
        """Fill ``state`` in place from the step directory ``path`` and return it.

        The model must be complete unless ``strict_model=False``; optimizer state may be partial
        (frozen parameters, parameters that never had a gradient). Extra state is restored only
        when ``extra_state_skeleton`` is given, into ``state["extra_state"]``. The optimizer
        entries are filled where they exist: the caller primes a fresh optimizer first (unless
        the checkpointer declares :attr:`Capability.PRIMING`). Damaged bytes raise; they are
        never returned as state."""

    def find_latest_checkpoint(self, checkpoint_dir: str) -> str | None:
        """The newest *complete* step directory under the root ``checkpoint_dir``, or None.
        The pointer is a hint: a missing, torn, stale or dangling pointer changes nothing."""

    def maybe_wait_for_async_save(self) -> None:
        """Block until an in-flight async save ends and raise its failure; a no-op with nothing
        pending."""

    def raise_for_failed_async_save(self) -> None:
        """Non-blocking: raise a finished async save's failure (once); leave a running one alone."""


#: ``factory(**options)`` -> a :class:`Checkpointer`. Options are only ever passed for a
#: declared capability: ``keep_last=k`` (:attr:`Capability.KEEP_LAST`), ``overwrite=True``
#: (:attr:`Capability.OVERWRITE`), ``extra_state_per_rank=False``
#: (:attr:`Capability.EMBEDDED_EXTRA_STATE`). A contract-only factory takes none.
CheckpointerFactory = Callable[..., Checkpointer]


class Capability(StrEnum):
    """What a checkpointer may offer beyond :class:`Checkpointer`; each value is the string a
    checkpointer declares."""

    #: ``save(root, ...)`` with the checkpoint root instead of a step directory.
    ROOT_SAVE = "root_save"
    #: ``factory(overwrite=True)`` saves over a complete step (the old one stays resumable until
    #: the new one is committed); without the option, such a save is refused with an error.
    OVERWRITE = "overwrite"
    #: ``factory(keep_last=k)`` keeps the newest ``k`` complete steps and deletes older ones.
    KEEP_LAST = "keep_last"
    #: ``ck.load_latest(root, state, **load_kwargs) -> path | None``: find and load, falling back
    #: past a damaged step on every rank together.
    LOAD_LATEST = "load_latest"
    #: extra state that differs across ranks (RNG states, data positions) comes back to each rank.
    #: Without it, the suite saves rank-invariant extra state only.
    PER_RANK_EXTRA_STATE = "per_rank_extra_state"
    #: ``factory(extra_state_per_rank=False)`` embeds (rank-invariant) extra state in the payload.
    EMBEDDED_EXTRA_STATE = "embedded_extra_state"
    #: ``load`` fills a fresh, never-stepped optimizer (every moment), so the caller need not prime.
    #: Without it, the suite primes fresh optimizers itself, as the contract asks callers to.
    PRIMING = "priming"
    #: ``save(path, state, global_step=N, save_async=True, snapshot="deferred")``: a zero-stall
    #: async save that returns before copying the state. Between ``save()`` and the end of the
    #: background copy the caller may run forward and backward; the next ``optimizer.step()`` (and
    #: the forward of a module whose buffers are being copied) waits for the copy; any other
    #: in-place change to a saved tensor fails that save (raised by ``raise_for_failed_async_save``
    #: or ``maybe_wait_for_async_save``; nothing published). An acknowledged deferred save holds
    #: the values at the call.
    DEFERRED_SNAPSHOT = "deferred_snapshot"



class Limitation(StrEnum):
    """What a checkpointer may declare it *lacks* (in the same ``capabilities`` attribute): each
    narrows what the suite draws and skips, with the reason, the properties that need it."""

    #: ``save_async=True`` is not supported (the save raises, or saves synchronously): the suite
    #: draws sync saves only and skips the async properties (deferred, exit with a save in flight,
    #: fork during an async save).
    SYNC_ONLY = "sync_only"
    #: plain ``torch.Tensor`` state only, no DTensor: no FSDP2 sharding is drawn.
    PLAIN_TENSORS_ONLY = "plain_tensors_only"
    #: no commit record: the record-damage kinds (bit flips, truncation, rewritten or forged fields
    #: of a record) and ``missing_commit`` are not drawn; completeness is judged by behaviour anyway.
    NO_COMMIT_RECORD = "no_commit_record"
    #: no ``latest`` pointer file: pointer damage is not drawn and the pointer properties skip.
    NO_POINTER = "no_pointer"
    #: extra state comes back only as what registered objects' ``state_dict`` hold -- tensors,
    #: numbers, strings, bytes, None and lists/tuples/dicts of them: no numpy arrays, numpy or
    #: Python RNG objects or other picklable objects are drawn as extra state.
    REGISTERED_EXTRA_STATE = "registered_extra_state"


def _declared(factory: Callable[..., Any], instance: Any | None) -> tuple[Any, ...]:
    declared: Iterable[Any] | None = getattr(factory, "capabilities", None)
    if declared is None:
        declared = getattr(instance if instance is not None else factory(), "capabilities", None)
    out = tuple(declared or ())
    known = {v.value for v in Capability} | {v.value for v in Limitation}
    for c in out:
        if str(c) not in known:
            raise ValueError(f"{factory!r} declares capability {c!r}; known: {', '.join(sorted(known))}")
    return out


def capabilities_of(factory: Callable[..., Any], instance: Any | None = None) -> frozenset[Capability]:
    """The capabilities ``factory`` declares (its ``capabilities`` attribute, else that of
    ``instance`` or of an object it makes with no options). An unknown name is an error, so a
    typo never silently turns a test off; :class:`Limitation` names are allowed and left out."""
    caps = {v.value for v in Capability}
    return frozenset(Capability(str(c)) for c in _declared(factory, instance) if str(c) in caps)


def limitations_of(factory: Callable[..., Any], instance: Any | None = None) -> frozenset[Limitation]:
    """The :class:`Limitation` values ``factory`` declares (in its ``capabilities`` attribute)."""
    lims = {v.value for v in Limitation}
    return frozenset(Limitation(str(c)) for c in _declared(factory, instance) if str(c) in lims)
