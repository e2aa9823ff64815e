"""Helpers the suite's tests share: examples per property, building checkpointers with
optional options, resuming a root the way a restarted job does, reading the on-disk contract."""

from __future__ import annotations

import os
import pickle
import re
import select
import signal
import time
import traceback
import warnings
from typing import Any, Callable

import pytest
from hypothesis import HealthCheck, Phase, settings

from faults.training import RunConfig, TrainRun, reference_digest

POINTER = "latest_checkpoint_iteration.txt"
STEP_RE = re.compile(r"global_step_(\d+)\Z")


def budget(request, *, scale: float = 1.0, **kw) -> settings:
    """``--fault-budget`` examples (times ``scale``) per property. ``FAULTS_SUITE_NO_SHRINK=1``
    (mutation runs) skips shrinking -- a kill matrix only needs to know *that* a checkpointer
    fails -- and the example database."""
    mutation = bool(os.environ.get("FAULTS_SUITE_NO_SHRINK"))
    phases = [p for p in Phase if p is not Phase.shrink] if mutation else list(Phase)
    n = max(1, round(request.config.getoption("--fault-budget") * scale))
    # Mutation runs use no example database: a kill must come from the seed, the same on every
    # machine, not from failures an earlier local run happened to store. derandomize=False:
    # where CI=true or GITHUB_ACTIONS=true, Hypothesis loads its "ci" profile, which derandomizes
    # and so ignores --hypothesis-seed; the kill matrix then drew other examples in CI than on a
    # developer's machine (a mutant killed locally survived in CI).
    extra = {"database": None, "derandomize": False} if mutation else {}
    return settings(max_examples=n, deadline=None, phases=phases, print_blob=True, **extra,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                           HealthCheck.data_too_large], **kw)


class Stats:
    """Counts what a test exercised (examples, crashes, resumes...); ``faults.plugin`` prints
    the totals at the end of the run, so a green run says how much it actually tried."""

    def __init__(self, request) -> None:
        self.counts: dict[str, int] = {}
        request.node.user_properties.append(("faults-suite", self.counts))

    def add(self, what: str, n: int = 1) -> None:
        self.counts[what] = self.counts.get(what, 0) + n


def make(factory, **options: Any):
    """``factory(**options)``; a checkpointer that does not offer an option skips the test that
    needs it, saying so (``keep_last``, ``overwrite``, ``extra_state_per_rank``)."""
    try:
        return factory(**options)
    except TypeError as e:
        pytest.skip(f"checkpointer does not take {sorted(options)}: {e}")


def step_path(root: str, step: int) -> str:
    return os.path.join(os.path.abspath(root), f"global_step_{step}")


def committed(root: str, step: int) -> bool:
    """The on-disk contract's commit record: ``.metadata`` (or DCP's ``__<R>.metadata``)."""
    d = step_path(root, step)
    try:
        names = os.listdir(d)
    except OSError:
        return False
    return ".metadata" in names or any(n.startswith("__") and n.endswith(".metadata") for n in names)


def steps_on_disk(root: str) -> list[int]:
    try:
        return sorted(int(m.group(1)) for n in os.listdir(root) if (m := STEP_RE.match(n)))
    except OSError:
        return []


def read_pointer(root: str) -> bytes | None:
    try:
        with open(os.path.join(root, POINTER), "rb") as f:
            return f.read()
    except OSError:
        return None


def resume(ck, root: str, cfg: RunConfig, *, unprimed: bool = False) -> tuple[str | None, TrainRun]:
    """A restarted job: fresh objects, ``find_latest_checkpoint``, ``load``, apply."""
    run = TrainRun(cfg)
    path = ck.find_latest_checkpoint(root)
    if path is not None:
        state = run.state(unprimed=unprimed, target=True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ck.load(path, state)
        run.apply(state)
    return (None if path is None else str(path)), run


def assert_resumed(path: str | None, run: TrainRun, root: str, want: int | None, cfg: RunConfig, what: str = "") -> None:
    want_path = None if want is None else step_path(root, want)
    assert path == want_path, f"{what}resumed {path}, the newest complete checkpoint is {want_path}"
    if want is not None:
        assert run.step == want, f"{what}extra_state global_step {run.step}, saved at {want}"
        assert run.digest() == reference_digest(cfg, want), (
            f"{what}state restored from step {want} differs from an uninterrupted run at step {want}")


def in_child(fn: Callable[[], Any], *, timeout: float, what: str) -> Any:
    """``fn()`` in a forked child; returns its (picklable) result.

    For calls that a fault may hang (a FIFO opened for reading), crash (a recursion too deep
    for the C stack) or exhaust: the test fails naming ``what`` -- never hangs or dies with
    it. A hang past ``timeout`` seconds SIGKILLs the child; an exception in ``fn`` fails with
    its traceback. No threads of this process are running when the suite forks (its
    checkpointers are made fresh and have not saved yet), so the child is safe to run."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child's coverage is not collected
        code = 0
        try:
            os.close(r)
            try:
                out = ("ok", fn())
            except BaseException as e:  # noqa: BLE001 - reported to the parent
                out = ("raised", f"{type(e).__name__}: {e}\n{traceback.format_exc()}")
            try:
                data = pickle.dumps(out)
            except Exception as e:  # noqa: BLE001
                data = pickle.dumps(("raised", f"unpicklable result: {e}"))
            view = memoryview(data)
            while view:
                view = view[os.write(w, view):]
        except BaseException:  # noqa: BLE001
            code = 1
        finally:
            os._exit(code)
    os.close(w)
    chunks: list[bytes] = []
    deadline = time.monotonic() + timeout
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([r], [], [], left)[0]:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                raise AssertionError(f"{what}: no answer within {timeout:.0f} s (hung; killed)")
            chunk = os.read(r, 1 << 16)
            if not chunk:
                break
            chunks.append(chunk)
    finally:
        os.close(r)
    status = os.waitpid(pid, 0)[1]
    if not chunks:
        code = os.waitstatus_to_exitcode(status)
        how = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
        raise AssertionError(f"{what}: the process died ({how}) without an answer")
    kind, value = pickle.loads(b"".join(chunks))
    if kind == "raised":
        raise AssertionError(f"{what}: raised {value}")
    return value
