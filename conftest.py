"""Repo-root conftest: load the ``faults`` pytest plugin when it is not installed.

An installed refckpt registers ``faults.plugin`` through its ``pytest11`` entry point; listing
it here as well would register it twice (pytest refuses that), so it is only listed when the
entry point is absent (running from a plain checkout) or plugin autoloading is disabled.
"""

from __future__ import annotations

import importlib.metadata
import os
import sys

# This run starts about a thousand Python processes: 8 xdist workers, ranks, torchrun agents and
# workers, pytest-in-pytest runs of the suite. Where the environment sets PYTHONDONTWRITEBYTECODE
# (this machine's does), each of them compiled every project module again, and every pytest among
# them rewrote the asserts of about 230 modules again (about 4 CPU s per xdist worker). The run
# is CPU-bound on 2 cores, so the repository's own test run caches bytecode (in the git-ignored
# __pycache__ folders) for itself and every process it starts: measured, 598 s -> 451 s wall for
# `pytest -n 8` from a cold cache. Nothing is judged on bytecode; users' runs keep their setting.
if os.environ.pop("PYTHONDONTWRITEBYTECODE", None) is not None:
    sys.dont_write_bytecode = False


def _entry_point_registered() -> bool:
    if os.environ.get("PYTEST_DISABLE_PLUGIN_AUTOLOAD"):
        return False
    try:
        dist = importlib.metadata.distribution("refckpt")
    except importlib.metadata.PackageNotFoundError:
        return False
    return any(ep.group == "pytest11" and ep.name == "faults" for ep in dist.entry_points)


pytest_plugins = ["pytester"]
if not _entry_point_registered():
    pytest_plugins.append("faults.plugin")


#: The contract-only checkpointer of the ``faults_checkpointers`` list (pyproject.toml).
CONTRACT_ONLY = "tests.contract_ckpt:make"
#: How to run the extended profile, which `pytest -n 8` skips (.ci/run runs it right after): the
#: multi-agent torchrun jobs (marked torchrun_job) and the other tests marked extended (the fault
#: matrix's 4-rank cells and most interrupt cells, the whole suite over the independent and the
#: contract-only checkpointers). Both cost more CPU than 2 cores give `pytest -n 8` within its 300 s.
EXTENDED_COMMAND = 'pytest -n 4 --extended -m "extended or torchrun_job"'
TORCHRUN_JOBS_SKIP = (f"a job of several torchrun agents (about 20 CPU s of fresh interpreters): the extended "
                      f"profile, which .ci/run runs after `pytest -n 8`: {EXTENDED_COMMAND}")
EXTENDED_SKIP = (f"the extended profile (the fault matrix's 4-rank cells and the suite's state machine at 4 ranks, "
                 f"4 ranks on 2 cores, the matrix's interrupt cells beyond one per point at 2 ranks, its 2-rank crash "
                 f"cells beyond one mode per point and target, its exit and fork cells; the benchmarks' end-to-end runs; "
                 f"the suite over the "
                 f"independent and the contract-only checkpointers; the power-loss explorer's known-bad protocols; "
                 f"the device workflows' lines on gloo; a real audit), "
                 f"which .ci/run runs after `pytest -n 8`: {EXTENDED_COMMAND}")


def pytest_addoption(parser):
    """Options of this repository's own tests (tests/test_record_flips.py's slower survey, the
    torchrun jobs' profile)."""
    parser.addoption("--record-flips", type=int, default=None, metavar="N",
                     help="single-bit flips tests/test_record_flips.py runs (default: 120)")
    parser.addoption("--record-flips-seed", type=int, default=None, metavar="S",
                     help="which flips tests/test_record_flips.py draws (default: 0)")
    parser.addoption("--extended", action="store_true", default=False,
                     help=f"run the tests marked extended or torchrun_job, which are skipped otherwise ({EXTENDED_COMMAND})")


def _warm_bytecode(config) -> None:
    """On a cold cache (a fresh clone), compile the project once here, in the xdist controller,
    before the workers start. Otherwise each of the 8 workers rewrites the asserts of the same
    ~230 modules at the same moment (about 4 CPU s each), and every forkserver and rank compiles
    what it imports: measured, a fresh clone's first `pytest -n 8` took 283 s against 240-258 s
    warm. Writes the same files pytest and Python would write (pytest's own rewrite functions,
    ``compileall``); any failure just leaves the workers to do it, as before."""
    import compileall
    from pathlib import Path

    root = Path(__file__).resolve().parent
    packages = [root / name for name in ("refckpt", "faults", "benchmarks", "tests")]
    try:
        from _pytest.assertion import assertstate_key, rewrite

        state = config.stash[assertstate_key]
        sources = [root / "conftest.py", *(f for pkg in packages for f in sorted(pkg.rglob("*.py")))]
        pycs = [rewrite.get_cache_dir(f) / (f.name[:-3] + rewrite.PYC_TAIL) for f in sources]
        if all(p.exists() for p in pycs):
            return  # warm: the common case costs one stat per module
        for f, pyc in zip(sources, pycs):
            if rewrite._read_pyc(f, pyc) is None:
                source_hash, co = rewrite._rewrite_test(f, config)
                if rewrite.try_makedirs(pyc.parent):
                    rewrite._write_pyc(state, co, source_hash, pyc)
        for pkg in packages:
            compileall.compile_dir(str(pkg), quiet=2)
    except Exception:  # noqa: BLE001 - an optimisation only
        return


def pytest_configure(config):
    if not hasattr(config, "workerinput") and config.getoption("numprocesses", None) and not sys.dont_write_bytecode:
        _warm_bytecode(config)  # the xdist controller, before it starts the workers
    config.addinivalue_line(
        "markers", "torchrun_job: starts several torchrun agents; runs only with --extended (the extended "
                   f"profile .ci/run runs: {EXTENDED_COMMAND})")
    config.addinivalue_line(
        "markers", f"extended: too much CPU for `pytest -n 8` on 2 cores; runs only with --extended ({EXTENDED_COMMAND})")


#: The suite's tests that run at 4 ranks in the extended profile only, in the repository's own run
#: (a run that names --checkpointer gets every size it asks for): the training-run state machine at
#: 4 ranks on 2 cores was the default run's costliest test (26 CPU s); at 1 and 2 ranks it stays.
EXTENDED_AT_4 = ("faults/suite/test_state_machine.py::",)
#: Variants of the suite's tests that run in the extended profile only, in the repository's own run:
#: test -> the parameters of each variant moved. A reader in another pid namespace is a fresh
#: interpreter there (about 5 CPU s each); the default run keeps the reader that scans the root for
#: the newest step and loads it (``load_latest``, ``root``), which takes every lease the others take.
EXTENDED_VARIANTS = {
    "faults/suite/test_shared_root.py::test_a_reader_in_another_pid_namespace_is_never_deleted_under_and_never_pins_forever":
        ({"mode": "load", "scope": "step"}, {"mode": "load_latest", "scope": "step"}),
}


def _extended_variant(item) -> bool:
    variants = EXTENDED_VARIANTS.get(item.nodeid.split("[", 1)[0], ())
    callspec = getattr(item, "callspec", None)
    return callspec is not None and any(all(callspec.params.get(k) == v for k, v in d.items()) for d in variants)


def pytest_collection_finish(session):
    """Freeze what the process holds once collection is over (torch, the collected items, the
    strategies): the garbage collector's full passes then skip it. Tests that allocate much
    (hypothesis, the state machines, a rank's results) triggered full passes over that whole heap
    in each of the run's eight workers."""
    import gc

    gc.freeze()


def pytest_collection_modifyitems(config, items):
    """Without ``--extended``, skip the tests marked ``torchrun_job`` or ``extended`` (saying where they run).
    Then longest first, so that under ``-n 8`` the long work overlaps the many short tests instead
    of becoming the run's tail: every ``xdist_group`` (a group runs as one serial chain on one
    worker: the larger first, its ``slow`` tests first), then the single tests marked ``slow``
    (the kill matrix, the torchrun jobs, the traced power-loss explorations; ``slow(seconds=N)``
    orders them among themselves), then the rest in collection order. pytest-xdist's ``--dist
    loadgroup`` hands out work in this order only with ``--no-loadscope-reorder`` (pyproject's
    addopts); by default it sorts by tests per group, which put every single slow test last."""
    import pytest

    from faults.plugin import OPT_CHECKPOINTER, item_world_size

    if not config.getoption(OPT_CHECKPOINTER):
        # The suite over the repository's default list judges refckpt (the product's gate) in the
        # default run, and the contract-only checkpointer (tests/contract_ckpt.py) in the extended
        # profile; a run that names --checkpointer gets exactly what it named.
        for item in items:
            if item.nodeid.startswith("faults/suite/") and f"[{CONTRACT_ONLY}" in item.nodeid:
                item.add_marker(pytest.mark.extended)
            elif (item.nodeid.startswith(EXTENDED_AT_4) and (item_world_size(item) or 0) >= 4) or _extended_variant(item):
                item.add_marker(pytest.mark.extended)
    if not config.getoption("--extended"):

        for item in items:
            if item.get_closest_marker("torchrun_job") is not None:
                item.add_marker(pytest.mark.skip(reason=TORCHRUN_JOBS_SKIP))
            elif item.get_closest_marker("extended") is not None:
                item.add_marker(pytest.mark.skip(reason=EXTENDED_SKIP))
    if config.getoption("--kill-first", default=False):
        return  # mutation runs want the cheap tests first: most mutants die there

    from faults.plugin import xdist_group_name

    groups = [xdist_group_name(item) for item in items]
    sizes: dict[str, int] = {}
    for g in groups:
        if g is not None:
            sizes[g] = sizes.get(g, 0) + 1

    def key(i):
        slow = items[i].get_closest_marker("slow")
        seconds = -(slow.kwargs.get("seconds", 0) if slow is not None else 0)
        if groups[i] is not None:
            return (0, -sizes[groups[i]], groups[i], slow is None, seconds, i)
        if slow is not None:
            return (1, seconds, i)
        return (2, i)

    order = sorted(range(len(items)), key=key)
    items[:] = [items[i] for i in order]
