"""Adapters that map third-party checkpointers onto :class:`faults.contract.Checkpointer`, so that
``faults.suite`` and ``python -m faults audit`` can judge them.

Each adapter lives in its own module, imports its package at module import, and raises
:class:`Unavailable` (an ``ImportError``) when the package cannot be imported; the suite then
skips with that reason. No adapter reimplements checkpointing: each says in its docstring
exactly what it maps (paths, state keys, async) and what it adds only because the contract
needs a method the package lacks.

* ``faults.adapters.dcp:PlainDCP`` -- ``torch.distributed.checkpoint`` as PyTorch documents it.
* ``faults.adapters.torchtitan:TorchTitan`` -- torchtitan's ``CheckpointManager``.
* ``faults.adapters.veomni:VeOmni`` -- VeOmni's (hyper_parallel family) DCP checkpointer.
"""

from __future__ import annotations

__all__ = ["Unavailable"]


class Unavailable(ImportError):
    """The adapted package is not installed or cannot be imported here; the reason says which."""

