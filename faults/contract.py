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

A step is *complete* when its commit record is there and every file it needs is intact.

Declaring capabilities
----------------------
A ``capabilities`` attribute (an iterable of :class:`Capability` values or their string
names) on the factory that ``--checkpointer`` names, or else on the object the factory
returns. Without one, a checkpointer is judged as contract-only. Strings keep a library that
declares them free of any import of this harness::

    class MyCheckpointer:
        capabilities = ("overwrite", "keep_last")

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

import enum
from collections.abc import Callable, Iterable
from typing import Any, Protocol, runtime_checkable

__all__ = ["Checkpointer", "CheckpointerFactory", "Capability", "capabilities_of", "VIOLATION", "ADVISORY",
           "STEP_PREFIX", "POINTER_FILE", "COMMIT_RECORD", "step_dir_name"]

STEP_PREFIX = "global_step_"
POINTER_FILE = "latest_checkpoint_iteration.txt"
COMMIT_RECORD = ".metadata"
VIOLATION = "violation"
ADVISORY = "advisory"


def step_dir_name(step: int) -> str:
    return f"{STEP_PREFIX}{step}"


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


class Capability(str, enum.Enum):
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

    def __str__(self) -> str:
        return self.value


def capabilities_of(factory: Callable[..., Any], instance: Any | None = None) -> frozenset[Capability]:
    """The capabilities ``factory`` declares (its ``capabilities`` attribute, else that of
    ``instance`` or of an object it makes with no options). An unknown name is an error, so a
    typo never silently turns a test off."""
    declared: Iterable[Any] | None = getattr(factory, "capabilities", None)
    if declared is None:
        declared = getattr(instance if instance is not None else factory(), "capabilities", None)
    out = set()
    for c in declared or ():
        try:
            out.add(Capability(str(c)))
        except ValueError:
            known = ", ".join(v.value for v in Capability)
            raise ValueError(f"{factory!r} declares capability {c!r}; known: {known}") from None
    return frozenset(out)
