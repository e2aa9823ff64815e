"""Mutation testing's bookkeeping in a pytest session: ``--kill-first``.

The kill matrix (:mod:`faults.killmatrix`) runs the resilience suite once over correct
checkpointers and one-bug mutants, each a ``--checkpointer``; a mutant is *killed* by its first
failing test, so the rest of its tests are skipped. :class:`KillFirst` is that bookkeeping: it
puts each checkpointer's tests on one xdist worker (``xdist_group``), notes each checkpointer's
first failure, and skips its later tests. :mod:`faults.plugin` registers it with the plugin
manager only when ``--kill-first`` is given (as xdist registers its ``DSession`` only under
``--dist``), so a plain run carries none of it.

:func:`strip_group` and :func:`spec_of` read the checkpointer out of a test id, here and in the
kill matrix's and the audit's junit reports.
"""

from __future__ import annotations

from collections.abc import Iterable

import pytest

__all__ = ["KillFirst", "strip_group", "spec_of", "PLUGIN_NAME"]

#: The name :class:`KillFirst` is registered under.
PLUGIN_NAME = "faults-kill-first"


def strip_group(nodeid: str) -> str:
    """``nodeid`` without the ``@group`` suffix pytest-xdist's ``--dist loadgroup`` appends to the
    ids of ``xdist_group`` tests (``test_x[spec]@checkpointer-spec``; with pytest 8, where xdist
    can set it)."""
    cut = nodeid.rfind("]@")
    return nodeid[:cut + 1] if cut >= 0 else nodeid.split("@", 1)[0] if "[" not in nodeid else nodeid


def spec_of(name: str, specs: Iterable[str]) -> str | None:
    """The checkpointer of ``specs`` a test judges, from its id or junit name (``test[spec-...]``)."""
    name = strip_group(name)
    inside = name[name.index("[") + 1:-1] if "[" in name else ""
    for spec in sorted(specs, key=len, reverse=True):
        if inside == spec or inside.startswith(spec + "-"):
            return spec
    return None


class KillFirst:
    """Once a test fails for a ``--checkpointer``, skip that checkpointer's remaining tests."""

    def __init__(self, specs: Iterable[str]) -> None:
        self.specs = sorted(specs, key=len, reverse=True)
        #: checkpointer spec -> the id of its first failed test
        self.killed: dict[str, str] = {}

    def _spec(self, item_or_report: pytest.Item | pytest.TestReport) -> str | None:
        return spec_of(item_or_report.nodeid, self.specs)

    # tryfirst, and registered after faults.plugin, so it runs before the plugin's own
    # collection hook (which leaves tests that already have an xdist_group alone) and before
    # xdist's, which reads the marks.
    @pytest.hookimpl(tryfirst=True)
    def pytest_collection_modifyitems(self, items: list[pytest.Item]) -> None:
        """One xdist worker per checkpointer, so that it can stop at the first kill."""
        for item in items:
            spec = self._spec(item)
            if spec is not None:
                item.add_marker(pytest.mark.xdist_group(f"checkpointer-{spec}"))

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.failed:
            spec = self._spec(report)
            if spec is not None:
                self.killed.setdefault(spec, report.nodeid)

    def pytest_runtest_setup(self, item: pytest.Item) -> None:
        spec = self._spec(item)
        killed = self.killed.get(spec) if spec is not None else None
        if killed is not None:
            pytest.skip(f"--kill-first: {spec} already failed {killed}")
