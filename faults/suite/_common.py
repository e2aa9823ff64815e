"""Helpers the suite's tests share: examples per property, building checkpointers with
optional options, resuming a root the way a restarted job does, reading the on-disk contract."""

from __future__ import annotations

import os
import re
import warnings
from typing import Any

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
