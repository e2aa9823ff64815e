"""refckpt: a reference distributed checkpointer for PyTorch on ``torch.distributed.checkpoint``.

Public surface (stable names)::

    from refckpt import DistributedCheckpointer, initialize_optimizer_state
    ckpt = DistributedCheckpointer(extra_state_per_rank=True)
    ckpt.save(root, state, global_step=step, save_async=False)
    path = ckpt.load_latest(root, state)        # or: ckpt.load(ckpt.find_latest_checkpoint(root), state)
"""

from . import errors
from .checkpointer import EXTRA_STATE_EMBEDDED, EXTRA_STATE_PER_RANK, DistributedCheckpointer
from .durable import FileIO
from .layout import LATEST_CHECKPOINT_FILE, STEP_PREFIX, check_step_dir, find_latest_checkpoint
from .optim import get_training_state, initialize_optimizer_state, set_training_state
from .protocol import SavePoint

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

__version__ = "0.1.0"  # the one version source (pyproject.toml reads it)
