"""refckpt: a reference distributed checkpointer for PyTorch on ``torch.distributed.checkpoint``.

Public surface (stable names)::

    from refckpt import DistributedCheckpointer, initialize_optimizer_state
    ckpt = DistributedCheckpointer(extra_state_per_rank=True)
    ckpt.save(root, state, global_step=step, save_async=False)
    path = ckpt.load_latest(root, state)        # or: ckpt.load(ckpt.find_latest_checkpoint(root), state)

The names below are imported from their modules on first use (PEP 562), so importing a light
module of the package (``refckpt.errors``, ``refckpt._enum``; the fault harness's pytest plugin
does, in every pytest run) does not import torch. The layout of the modules is in docs/design.md.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"  # the one version source (pyproject.toml reads it)

#: public name -> the module of this package that defines it
_MODULE_OF = {
    "DistributedCheckpointer": "checkpointer",
    "EXTRA_STATE_PER_RANK": "checkpointer",
    "EXTRA_STATE_EMBEDDED": "checkpointer",
    "initialize_optimizer_state": "optim",
    "get_training_state": "optim",
    "set_training_state": "optim",
    "find_latest_checkpoint": "layout",
    "check_step_dir": "layout",
    "STEP_PREFIX": "layout",
    "LATEST_CHECKPOINT_FILE": "layout",
    "FileIO": "durable",
    "SavePoint": "protocol",
}

__all__ = [
    "DistributedCheckpointer",
    "initialize_optimizer_state",
    "get_training_state",
    "set_training_state",
    "find_latest_checkpoint",
    "check_step_dir",
    "STEP_PREFIX",
    "LATEST_CHECKPOINT_FILE",
    "EXTRA_STATE_PER_RANK",
    "EXTRA_STATE_EMBEDDED",
    "FileIO",
    "SavePoint",
    "errors",
]

if TYPE_CHECKING:  # pragma: no cover - what type checkers see; at run time, __getattr__ below
    from . import errors
    from .checkpointer import EXTRA_STATE_EMBEDDED, EXTRA_STATE_PER_RANK, DistributedCheckpointer
    from .durable import FileIO
    from .layout import LATEST_CHECKPOINT_FILE, STEP_PREFIX, check_step_dir, find_latest_checkpoint
    from .optim import get_training_state, initialize_optimizer_state, set_training_state
    from .protocol import SavePoint


def __getattr__(name: str) -> Any:
    if name == "errors":
        value: Any = importlib.import_module(".errors", __name__)
    elif name in _MODULE_OF:
        value = getattr(importlib.import_module(f".{_MODULE_OF[name]}", __name__), name)
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value  # once imported, a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
