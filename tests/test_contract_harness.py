"""The suite's own machinery for judging by contract (``faults.contract``, ``faults.findings``,
``faults.suite._common``): declared capabilities and their misspellings, options refused by
value, advisories reported or (``--strict-advisories``) failed, a hung forked resume reported
with its stack, errors that are not ``Exception`` turned into advisories."""

from __future__ import annotations

import os
import textwrap

import pytest

from faults import findings
from faults.contract import Capability, Checkpointer, capabilities_of
from faults.suite import _common
from faults.training import NOT_AN_EXCEPTION, _error


class _Declares:
    capabilities = ("keep_last", Capability.OVERWRITE)

    def __init__(self, keep_last: int | None = None, overwrite: bool = False) -> None:
        if keep_last == 1:
            raise ValueError("keep_last must be at least 2")  # as torchtitan refuses it


def test_capabilities_come_from_the_factory_or_what_it_builds():
    assert capabilities_of(_Declares) == {Capability.KEEP_LAST, Capability.OVERWRITE}

    def factory():
        return _Declares()

    assert capabilities_of(factory) == {Capability.KEEP_LAST, Capability.OVERWRITE}  # from the instance

    def nothing():
        return object()

    assert capabilities_of(nothing) == frozenset()


def test_a_misspelled_capability_is_an_error_not_a_silent_skip():
    class Typo:
        capabilities = ("keep-last",)

    with pytest.raises(ValueError, match="keep-last.*known: .*keep_last.*sync_only"):
        capabilities_of(Typo)


def test_refckpt_and_the_contract_only_checkpointer_satisfy_the_protocol():
    import refckpt
    from tests.contract_ckpt import make

    assert isinstance(refckpt.DistributedCheckpointer(), Checkpointer)
    assert isinstance(make(), Checkpointer)
    assert capabilities_of(make) == frozenset()
    assert capabilities_of(refckpt.DistributedCheckpointer) == frozenset(Capability)


def test_options_skip_when_undeclared_or_refused_by_value():
    assert _common.accepts(_Declares, keep_last=2) and not _common.accepts(_Declares, keep_last=1)
    assert not _common.accepts(_Declares, extra_state_per_rank=False)  # not declared
    with pytest.raises(pytest.skip.Exception, match="refuses {'keep_last': 1} when built: ValueError"):
        _common.make(_Declares, keep_last=1)
    with pytest.raises(pytest.skip.Exception, match="does not declare capability embedded_extra_state"):
        _common.make(_Declares, extra_state_per_rank=False)
    assert isinstance(_common.make(_Declares, keep_last=3), _Declares)


def test_errors_that_are_not_exceptions_become_advisories():
    from torch.distributed.checkpoint.api import CheckpointException

    findings.take()
    e = CheckpointException("save", {0: (RuntimeError("disk full"), None)})
    _common.refused(e, "a failed async save")
    _common.refused(RuntimeError("fine"), "a refused save")
    assert findings.take() == [
        "a failed async save raised torch.distributed.checkpoint.api.CheckpointException, which is not an "
        "Exception subclass: a trainer's `except Exception` does not catch it"]
    text = _error(e)  # what a rank sends back
    assert text.startswith(NOT_AN_EXCEPTION) and "rank 0: RuntimeError: disk full" in text
    _common.refused_in_rank([None, text, _error(OSError("x"))], "a save")
    assert [m.split(",")[0] for m in findings.take()] == ["a save raised torch.distributed.checkpoint.api.CheckpointException"]


def test_a_hung_forked_call_fails_with_the_stack_where_it_hung(tmp_path):
    fifo = str(tmp_path / "fifo")
    os.mkfifo(fifo)

    def block_on_the_fifo():
        with open(fifo, "rb") as f:  # no writer: blocks forever
            return f.read()

    with pytest.raises(AssertionError) as ei:
        _common.in_child(block_on_the_fifo, timeout=2, what="a resume")
    msg = str(ei.value)
    assert "a resume: no answer within 2 s (hung; killed)" in msg
    assert "block_on_the_fifo" in msg and "test_contract_harness.py" in msg  # the frame that hung


def test_a_forked_call_never_runs_the_parents_garbage_finalizers():
    """Garbage the parent has not collected yet, whose finalizer waits on a lock another thread
    of the parent holds (as a process group's destructor waits on its threads): a collection in
    the forked child would run that finalizer, and no thread is left there to release the lock.
    The child must not collect what it inherited. (Without ``gc.freeze()`` in the child, the
    call below hangs and fails after its 5 s.)"""
    import gc
    import threading

    held = threading.Lock()

    class WaitsOnAThread:
        def __init__(self) -> None:
            self.cycle = self

        def __del__(self) -> None:
            with held:
                pass

    held.acquire()
    gc.disable()
    try:
        WaitsOnAThread()  # unreachable at once, but in a cycle: only a collection finalizes it
        assert _common.in_child(lambda: gc.collect() >= 0, timeout=5, what="a collection") is True
    finally:
        held.release()
        gc.enable()
        gc.collect()


ADVISING_TEST = textwrap.dedent("""
    from faults.findings import advise

    def test_advises():
        advise("saves over a complete step in place")

    def test_clean():
        pass
""")


def test_advisories_pass_and_are_listed_and_strict_fails_them(pytester, pytestconfig):
    """In-process runs (nothing here starts a world or imports torch; a fresh process costs
    seconds): the plugin is the installed one, as the outer session loaded it."""
    pytester.makepyfile(test_adv=ADVISING_TEST)
    xml = pytester.path / "report.xml"
    plugin = [] if pytestconfig.pluginmanager.hasplugin("faults") else ["-p", "faults.plugin"]
    plain = pytester.runpytest("-p", "no:randomly", "-p", "no:cacheprovider", *plugin, f"--junitxml={xml}")
    plain.assert_outcomes(passed=2)
    plain.stdout.fnmatch_lines(["*hardening advisories*", "*test_advises: saves over a complete step in place"])
    assert 'name="faults-advisory" value="saves over a complete step in place"' in xml.read_text()
    strict = pytester.runpytest("-p", "no:randomly", "-p", "no:cacheprovider", *plugin, "--strict-advisories")
    strict.assert_outcomes(passed=1, failed=1)
    strict.stdout.fnmatch_lines(["*[[]advisory[]] saves over a complete step in place*"])
