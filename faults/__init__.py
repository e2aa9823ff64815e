"""faults: a fault-injection and test harness that proves a checkpointer resumable.

Modules (each one concept; see ``DESIGN.md``):

* :mod:`faults.world`: real multi-process ``torch.distributed`` worlds (gloo/NCCL/HCCL) that
  report rank errors with tracebacks, kill every rank on a timeout and name a dead rank's
  signal.
* :mod:`faults.plugin`: the pytest plugin (``--backend``, ``--world-timeout``, markers and
  the ``world_factory`` / ``fresh_world`` fixtures).

This package imports nothing heavy on purpose: the pytest plugin is loaded in every pytest
run of an environment where refckpt is installed, and must not import torch there.
"""

__all__: list[str] = []
