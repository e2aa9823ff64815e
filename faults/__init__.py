"""faults: a fault-injection and test harness that proves a checkpointer resumable.

Modules (each one concept; ``docs/faults.md`` is the guide):

* :mod:`faults.contract`: the checkpointer contract the suite judges (:class:`Checkpointer`,
  :class:`Capability`), the default checkpointer, and every name the harness assumes on disk.
* :mod:`faults.world`: real multi-process ``torch.distributed`` worlds that report rank errors
  with tracebacks, kill every rank on a timeout and name a dead rank's signal;
  :mod:`faults.backends` picks their backend (gloo/NCCL/HCCL) and devices, :mod:`faults.errors`
  holds what they raise.
* :mod:`faults.points` (the crash points and fault kinds), :mod:`faults.inject` (injecting them:
  a faulty I/O layer, patched ``os`` calls, kills from outside, damage on disk),
  :mod:`faults.strategies` (Hypothesis strategies), :mod:`faults.training` (the training job whose
  state is recomputed from scratch as the oracle).
* :mod:`faults.suite` (the resilience suite), :mod:`faults.plugin` (the pytest plugin:
  ``--backend``, ``--checkpointer``, markers and the world fixtures), :mod:`faults.killfirst`
  (mutation testing's ``--kill-first``), :mod:`faults.findings` (hardening advisories).
* :mod:`faults.crashsim` and :mod:`faults.powerloss`: what a save leaves after a power cut.
* Commands (``python -m faults ...``): :mod:`faults.demo`, :mod:`faults.matrix`,
  :mod:`faults.campaign`, :mod:`faults.killmatrix`, :mod:`faults.powerloss`, :mod:`faults.audit`;
  :mod:`faults.adapters` maps other checkpointers onto the contract.

This package imports nothing on purpose: the pytest plugin is loaded in every pytest run of an
environment where refckpt is installed, and must not import torch there. The names in
``__all__`` are imported from their modules on first use (PEP 562), so ``faults.World`` works and
``import faults`` stays cheap.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

#: module of this package -> the public names this package imports from it on first use
_EXPORTS: dict[str, tuple[str, ...]] = {
    "contract": ("Checkpointer", "CheckpointerFactory", "Capability", "capabilities_of", "VIOLATION", "ADVISORY",
                 "DEFAULT_CHECKPOINTER", "STEP_PREFIX", "POINTER_FILE", "COMMIT_RECORD", "step_dir_name"),
    "world": ("World", "run_world", "emit"),
    "backends": ("BACKENDS", "BackendChoice", "select_backend", "device_for_rank"),
    "errors": ("WorldError", "BackendUnavailable", "RankError", "RankDied", "WorldTimeout", "WorldCloseError"),
    "points": ("Role", "Target", "CrashPoint", "CRASH_POINTS", "POINTS_BY_NAME", "FaultKind", "classify",
               "target_ranks"),
    "inject": ("Action", "FaultSpec", "FaultyIO", "patch_os", "kill_on_event", "crash_spec", "io_error_spec",
               "DiskFault", "DISK_FAULTS", "FaultNotApplicable"),
    "findings": ("advise",),
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}

# The same names, spelled out for linters and type checkers (tests/test_architecture.py checks
# that the two lists agree and that every name resolves).
__all__ = [
    # contract
    "Checkpointer", "CheckpointerFactory", "Capability", "capabilities_of", "VIOLATION", "ADVISORY",
    "DEFAULT_CHECKPOINTER", "STEP_PREFIX", "POINTER_FILE", "COMMIT_RECORD", "step_dir_name",
    # world
    "World", "run_world", "emit",
    # backends
    "BACKENDS", "BackendChoice", "select_backend", "device_for_rank",
    # errors
    "WorldError", "BackendUnavailable", "RankError", "RankDied", "WorldTimeout", "WorldCloseError",
    # points
    "Role", "Target", "CrashPoint", "CRASH_POINTS", "POINTS_BY_NAME", "FaultKind", "classify",
    "target_ranks",
    # inject
    "Action", "FaultSpec", "FaultyIO", "patch_os", "kill_on_event", "crash_spec", "io_error_spec",
    "DiskFault", "DISK_FAULTS", "FaultNotApplicable",
    # findings
    "advise",
]

if TYPE_CHECKING:  # pragma: no cover - what type checkers see; at run time, __getattr__ below
    from .backends import BACKENDS, BackendChoice, device_for_rank, select_backend
    from .contract import (
        ADVISORY,
        COMMIT_RECORD,
        DEFAULT_CHECKPOINTER,
        POINTER_FILE,
        STEP_PREFIX,
        VIOLATION,
        Capability,
        Checkpointer,
        CheckpointerFactory,
        capabilities_of,
        step_dir_name,
    )
    from .errors import BackendUnavailable, RankDied, RankError, WorldCloseError, WorldError, WorldTimeout
    from .findings import advise
    from .inject import (
        DISK_FAULTS,
        Action,
        DiskFault,
        FaultNotApplicable,
        FaultSpec,
        FaultyIO,
        crash_spec,
        io_error_spec,
        kill_on_event,
        patch_os,
    )
    from .points import CRASH_POINTS, POINTS_BY_NAME, CrashPoint, FaultKind, Role, Target, classify, target_ranks
    from .world import World, emit, run_world


def __getattr__(name: str) -> Any:
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value  # once imported, a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
