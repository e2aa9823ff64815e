"""A pytest plugin (``-p tests._broken_injector``) that breaks the harness on purpose: the step
injector raises ``ZeroDivisionError``, as a bug in the harness would. tests/test_recordless.py
checks that such a test is reported as an ERROR naming the harness, never as the checkpointer's
FAILED violation."""

from __future__ import annotations


def pytest_configure(config) -> None:
    import faults.strategies

    def broken(step_dir, how, rng=None):
        return 1 // 0

    faults.strategies._damage_step = broken
