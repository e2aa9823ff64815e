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
