"""Hardening advisories found while a suite test runs (:data:`faults.contract.ADVISORY`).

A test that meets a gap which loses nothing by itself calls :func:`advise`; the plugin
(:mod:`faults.plugin`) attaches what was advised to the test's report as
``("faults-advisory", message)`` user properties and lists it at the end of the run, and the
test passes -- unless ``--strict-advisories`` is given, which fails it with a message that
starts with ``[advisory]``. Contract violations are plain test failures. Rank processes do
not call this: their results go back to the test, which advises.
"""

from __future__ import annotations

__all__ = ["advise", "take", "ADVISORY_PROPERTY", "STRICT_PREFIX"]

ADVISORY_PROPERTY = "faults-advisory"
STRICT_PREFIX = "[advisory] "
_found: list[str] = []


def advise(message: str) -> None:
    """Record a hardening advisory for the running test (once per distinct message)."""
    if message not in _found:
        _found.append(message)


def take() -> list[str]:
    """The advisories recorded since the last call, in order; clears them."""
    out = list(_found)
    _found.clear()
    return out
