"""pytest plugin of a mutation run's stats (``-p mutation_hits``): the functions ranks and
other processes reached during a test (written by this folder's ``sitecustomize``) are added
to that test's hits before mutmut's own teardown hook attributes them."""

from __future__ import annotations

import os

import pytest

_offsets: dict[str, int] = {}


def _hits_dir() -> str | None:
    if os.environ.get("MUTANT_UNDER_TEST") != "stats":
        return None
    return os.environ.get("MUTMUT_HITS_DIR") or None


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_logstart(nodeid, location):
    hits_dir = _hits_dir()
    if hits_dir is None:
        return
    _read_new(hits_dir)  # whatever arrived between tests belongs to no test
    epoch = os.path.join(hits_dir, "epoch")
    with open(epoch, "a"):
        pass
    os.utime(epoch)  # a new window: each process records its functions again


def _read_new(hits_dir: str) -> set[str]:
    names: set[str] = set()
    for entry in os.listdir(hits_dir):
        if not entry.endswith(".hits"):
            continue
        path = os.path.join(hits_dir, entry)
        with open(path, "rb") as f:
            f.seek(_offsets.get(path, 0))
            data = f.read()
        end = data.rfind(b"\n") + 1  # a line being written is read next time
        _offsets[path] = _offsets.get(path, 0) + end
        names.update(line for line in data[:end].decode().splitlines() if line)
    return names


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_teardown(item, nextitem):
    hits_dir = _hits_dir()
    if hits_dir is None:
        return
    from mutmut.state import state

    state()._stats.update(_read_new(hits_dir))


def _remove(path: str) -> None:
    """Remove a tree however deep (``rm -rf`` walks it without recursing in Python: a mutant that
    breaks refckpt's iterative removal leaves a 1,200-level tree, which pytest's own clean-up,
    recursing in Python, fails on with RecursionError)."""
    import subprocess

    subprocess.run(["rm", "-rf", "--", path], check=False)


@pytest.hookimpl(tryfirst=True)
def pytest_sessionstart(session):
    """Trees an earlier mutant's session could not remove (pytest renames them ``garbage-*``)
    would make pytest's clean-up at the end of this session raise, which mutmut reads as exit
    255, "timeout": a survivor counted as killed. Remove them first."""
    import glob
    import tempfile

    root = os.environ.get("PYTEST_DEBUG_TEMPROOT") or tempfile.gettempdir()
    for garbage in glob.glob(os.path.join(root, "pytest-of-*", "garbage-*")):
        _remove(garbage)


@pytest.hookimpl(tryfirst=True)
def pytest_sessionfinish(session, exitstatus):
    """This session's temporary trees, removed before pytest's own clean-up sees them."""
    factory = getattr(session.config, "_tmp_path_factory", None)
    base = getattr(factory, "_basetemp", None) if factory is not None else None
    if base is not None and os.path.isdir(base):
        _remove(str(base))
