"""Loaded by every fresh interpreter of a mutation run (``benchmarks.mutation`` puts this folder
on PYTHONPATH): ranks, forkservers, ``python -m`` children of the suite.

mutmut learns which tests reach which function from its trampolines, in the pytest process
only: a rank records its calls in its own memory and they are lost, so a function that only
ranks call would have no tests and its mutants would read "no tests". During mutmut's stats run
(``MUTANT_UNDER_TEST=stats``) this appends each function a process reaches to a file of its own
under ``MUTMUT_HITS_DIR``, once per test window (``mutation_hits`` moves the window at each
test's start); the pytest process reads them back at each test's teardown.
"""

from __future__ import annotations

import os
from typing import Any


def _install() -> None:
    hits_dir = os.environ.get("MUTMUT_HITS_DIR")
    if not hits_dir or os.environ.get("MUTANT_UNDER_TEST") != "stats":
        return
    try:
        from mutmut.mutation import trampoline
    except ImportError:
        return
    epoch_file = os.path.join(hits_dir, "epoch")
    original = trampoline.record_trampoline_hit
    state: dict[str, Any] = {"epoch": -1, "seen": set(), "fd": -1, "pid": -1}

    def record(name: str, caller: str | None = None) -> None:
        try:
            epoch = os.stat(epoch_file).st_mtime_ns
        except OSError:
            epoch = 0
        pid = os.getpid()
        if state["pid"] != pid:  # first call, or a forked child of a process that recorded
            state.update(pid=pid, fd=os.open(os.path.join(hits_dir, f"{pid}.hits"),
                                             os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644),
                         seen=set(), epoch=-1)
        if epoch != state["epoch"]:
            state["epoch"], state["seen"] = epoch, set()
        seen = state["seen"]
        if name not in seen:
            seen.add(name)
            os.write(state["fd"], f"{name}\n".encode())
        try:
            original(name, caller)
        except Exception:  # mutmut's own bookkeeping in a rank: nothing reads it there
            pass

    trampoline.record_trampoline_hit = record


_install()
