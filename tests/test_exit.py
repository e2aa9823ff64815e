"""An async save in flight when the interpreter exits is completed, or the exit says it was lost.

Real interpreters (``python -c``), real exits: falling off the end of the script with ``atexit``'s
``ck.close`` registered, and a SIGTERM handler that calls ``sys.exit`` (what trainers do on a
preemption notice) during an async save. The background save is held in its writes until the
interpreter has begun to exit (an event set by an exit hook that runs before refckpt's), so the save is in flight at exit on
every run: no timing luck. Before refckpt waited at exit, both lost the save with exit status 0
("cannot schedule new futures after interpreter shutdown")."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent('''
    import atexit, os, signal, sys, threading
    import torch
    from refckpt import DistributedCheckpointer, FileIO, SavePoint

    root, how = sys.argv[1], sys.argv[2]

    # Registered after refckpt's own exit hook, so it runs first (threading's exit hooks run
    # last-registered first): the exit has begun when it is set.
    exiting = threading.Event()
    threading._register_atexit(exiting.set)

    class HeldUntilExit(FileIO):
        """Holds the background writes until the interpreter has begun to exit (at most 60 s)."""
        def mark(self, point, **info):
            if str(point) == str(SavePoint.SHARDS):
                exiting.wait(60)
            if how == "fails" and str(point) == str(SavePoint.PUBLISH):
                raise OSError(28, "No space left on device (injected)")

    ck = DistributedCheckpointer(io=HeldUntilExit(), pin_memory=False)
    atexit.register(ck.close)
    state = {"model": {"w": torch.arange(1 << 18, dtype=torch.float32)}}  # 1 MiB: a state >= 256 KiB
    if how == "sigterm":
        signal.signal(signal.SIGTERM, lambda *a: sys.exit(143))
    ck.save(root, state, global_step=1, save_async=True)
    if how == "sigterm":
        os.kill(os.getpid(), signal.SIGTERM)  # the handler's SystemExit ends the script here
        print("NOT REACHED")
''')


# falling off the end is extended: faults.suite's test_an_async_save_in_flight_at_exit_is_published_or_the_exit_fails
# runs that exit (plain and through atexit) for refckpt in `pytest -n 8`; each variant is an interpreter importing torch
@pytest.mark.parametrize("how,code", [pytest.param("falls_off_the_end", 0, marks=pytest.mark.extended),
                                      ("sigterm", 143), ("fails", 1)])
def test_an_async_save_in_flight_at_exit_completes_or_the_exit_fails(tmp_path, how, code):
    root = str(tmp_path / "root")
    p = subprocess.run([sys.executable, "-c", SCRIPT, root, how], capture_output=True, text=True, timeout=120)
    out = p.stdout + p.stderr
    assert p.returncode == code, out
    assert "waiting for the async save of step 1" in out, out
    published = os.path.isfile(os.path.join(root, "global_step_1", ".metadata"))
    if how == "fails":
        assert not published and "did not complete" in out and "No space left" in out, out
    else:
        assert published, out
        assert "cannot schedule new futures" not in out and "NOT REACHED" not in out, out
