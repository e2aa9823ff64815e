"""A checkpointer written to the seed's contract and nothing more (``faults.contract``).

It takes no options, saves only into the step directory it is given (a root, or a directory
whose name does not match ``global_step``, is refused), and declares no capability: no
root-accepting save, no overwrite option, no retention, no ``load_latest``, no priming it
promises, no per-rank extra state it promises. The resilience suite must pass it with 0
failures (``tests/test_contract_only.py``): a checkpointer that is correct to the contract is
never failed for lacking refckpt's extensions.

The commit mechanics are those of :mod:`tests.independent_ckpt` (staging directory, commit
record written last, fsync, rename into place, pointer written last): the point here is
the interface, not a third commit protocol.
"""

from __future__ import annotations

import os
import re
from typing import Any

from tests.independent_ckpt import IndependentCheckpointer

_STEP_DIR = re.compile(r"global_step_([0-9]+)")


class ContractOnlyCheckpointer(IndependentCheckpointer):
    capabilities = ()

    def __init__(self) -> None:
        super().__init__()

    def save(self, path, state: dict, *, global_step: int, save_async: bool = False) -> None:
        m = _STEP_DIR.fullmatch(os.path.basename(os.path.normpath(os.fspath(path))))
        if m is None or int(m.group(1)) != int(global_step):
            raise ValueError(f"save({path!r}, global_step={global_step}): pass the step directory "
                             f"<root>/global_step_{global_step}")
        super().save(path, state, global_step=global_step, save_async=save_async)


def make(**options: Any) -> ContractOnlyCheckpointer:
    """Factory for ``--checkpointer=tests.contract_ckpt:make``: takes no options."""
    if options:
        raise TypeError(f"the contract-only checkpointer takes no options, got {sorted(options)}")
    return ContractOnlyCheckpointer()
