"""A save that runs out of disk, in a process of its own (tests/test_hostile.py runs it).

:func:`run` in a forked child, or ``python -m tests._diskfull MODE ROOT OUT ARG`` from the
repository root (the tmpfs mode, which needs a mount namespace of its own):

* ``rlimit``: ``ROOT`` is a copy of a checkpoint root; the save of step 43 runs under
  ``RLIMIT_FSIZE = ARG`` bytes with ``SIGXFSZ`` ignored, so the kernel fails the first
  write past the limit with ``EFBIG`` (a file-size limit, as a quota or ``ulimit -f`` sets).
  Its own process, because the limit binds every file the process writes.
* ``tmpfs``: ``ROOT`` is the mount point of a size-limited tmpfs that the caller mounted in
  a private mount namespace (``unshare``); the template root ``ARG`` is copied in first, then
  the save of step 43 (with a 256 KiB tensor in its extra state) fills it: ``ENOSPC``.

Then, in the same process (the tmpfs vanishes with it): what the failed save left, which
step resume picks, and what ``load_latest`` restores, written to ``OUT`` with ``torch.save``.
"""

from __future__ import annotations

import os
import resource
import shutil
import signal
import sys
import warnings

import torch

from refckpt import (
    LATEST_CHECKPOINT_FILE,
    DistributedCheckpointer,
    find_latest_checkpoint,
    get_training_state,
    set_training_state,
)
from refckpt.errors import CheckpointError

from . import _builders as B

SAVED_STEP = 43


def run(mode: str, root: str, out: str, arg: str) -> None:
    warnings.simplefilter("ignore")
    extra: dict = {"global_step": SAVED_STEP}
    if mode == "tmpfs":
        shutil.copytree(arg, root, dirs_exist_ok=True)
        extra["blob"] = torch.zeros(65536)
    model, opt = B.make(5, "adamw")
    B.train(model, opt, range(2))
    limits = resource.getrlimit(resource.RLIMIT_FSIZE)
    error = None
    try:
        if mode == "rlimit":
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
            resource.setrlimit(resource.RLIMIT_FSIZE, (int(arg), limits[1]))
        DistributedCheckpointer().save(root, get_training_state(model, opt, extra), global_step=SAVED_STEP)
    except CheckpointError as e:
        cause = e.__cause__
        error = {"type": type(e).__name__, "message": str(e), "is_oserror": isinstance(e, OSError),
                 "errno": getattr(cause, "errno", None)}
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limits)
    with open(os.path.join(root, LATEST_CHECKPOINT_FILE), "rb") as f:
        pointer = f.read()
    fresh, fopt = B.make(99, "adamw")
    state = get_training_state(fresh, fopt, {})
    loaded = DistributedCheckpointer().load_latest(root, state)
    set_training_state(fresh, fopt, state)
    torch.save({"error": error, "entries": sorted(os.listdir(root)), "pointer": pointer,
                "latest": find_latest_checkpoint(root), "loaded": loaded, "params": B.params(fresh),
                "extra": state["extra_state"]}, out)


if __name__ == "__main__":
    run(*sys.argv[1:])
