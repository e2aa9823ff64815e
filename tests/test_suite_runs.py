"""The shipped resilience suite as a user runs it (``pytest --pyargs faults.suite``, installed
package, ``--checkpointer`` options), as mutation testing (:mod:`faults.killmatrix`): the
independent checkpointer on plain DCP passes the whole suite, and every one-bug mutant in
``tests/mutants.py`` is failed by the suite. The kill matrix is printed (``-s`` or the captured
output of a failure shows it).

The matrix runs as two pytest processes: the independent checkpointer through the whole suite;
the mutants, each through the one suite test that kills it (``KILLERS``: a test that draws
nothing, so the kill does not depend on the Hypothesis seed) under ``--kill-first``, followed by
a test that ``--kill-first`` must then skip. Two, not more: each pytest process pays about
6 CPU s (its interpreter, torch, its forkserver) before its first test, and this run is
CPU-bound; split five ways they cost 36 CPU s, of which 30 s was that start-up. A mutant that
its pinned test no longer kills fails here even if a later suite test would kill it: then find
the new killer with ``python -m faults killmatrix --mutants tests.mutants --full``.

refckpt itself goes through the suite in this repository's own run: ``faults/suite`` is in
``testpaths``, judged with the default ``--checkpointer``."""

from __future__ import annotations

import glob
import importlib
import inspect
import os

import pytest

from faults.killmatrix import format_matrix, run, verdict
from tests.mutants import MUTANTS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
INDEPENDENT = "tests.independent_ckpt:make"
# What a user's run of the suite at --hypothesis-seed=0 fails first for each mutant (the kill
# matrix of docs/faults.md), or, where that test draws examples (no_completeness_check,
# no_size_check, no_fallback_on_missing_extra, unprimed_optimizer), the deterministic test
# that kills it too. "{}" is the mutant's spec.
DAMAGE = "test_contract::test_each_kind_of_damage_falls_back_to_the_previous_step[{}-"
KILLERS = {
    "pointer_before_commit": "test_crash_states::test_every_crash_state_of_a_save_resumes[{}-new-step]",
    "trusts_pointer": DAMAGE + "missing_commit]",
    "no_completeness_check": DAMAGE + "missing_commit]",
    "no_size_check": DAMAGE + "truncated_payload]",
    "no_checksum": "test_contract::test_corrupt_payload_never_loads_silently[{}]",
    "no_dir_fsync": "test_crash_states::test_acknowledged_save_survives_power_loss[{}-sync]",
    "fsync_before_flush": "test_crash_states::test_acknowledged_save_survives_power_loss[{}-sync]",
    "retention_leaks_descriptors": "test_leftovers::test_repeated_saves_and_loads_leak_nothing[{}]",
    "retention_keeps_the_oldest": "test_leftovers::test_repeated_saves_and_loads_leak_nothing[{}]",
    "unprimed_optimizer": "test_contract::test_fresh_unprimed_optimizer_gets_every_moment[{}-sync]",
    "embedded_rank_variant_extra": "test_multirank::test_multi_rank_round_trip[{}-w2-sync-per_rank]",
    "swallowed_async_error": "test_contract::test_failed_async_save_is_raised_and_never_published[{}-write]",
    "pointer_in_place": "test_crash_states::test_every_crash_state_of_a_save_resumes[{}-new-step]",
    "retention_deletes_newest": "test_contract::test_retention_keeps_the_newest_complete_steps[{}-1]",
    "overwrite_in_place": "test_crash_states::test_every_crash_state_of_a_save_resumes[{}-overwrite]",
    "overwrites_silently": "test_contract::test_saving_over_a_complete_step_is_refused_or_safe[{}]",
    "no_fallback_on_missing_extra": DAMAGE + "missing_extra_state]",
    "async_no_snapshot": "test_contract::test_async_save_holds_values_at_the_call[{}]",
    "unsafe_metadata_unpickle": "test_contract::test_no_code_runs_from_checkpoint_bytes[{}-commit_record]",
    "retention_follows_links": "test_integrity::test_deep_tree_in_a_step_breaks_neither_resume_nor_retention_nor_later_saves[{}]",
    "lazy_verify_fallback": "test_exact_resume::test_a_fallback_never_mixes_two_steps[{}]",
    "unchecked_extra_state": ("test_exact_resume::test_extra_state_users_keep_round_trips_exactly_or_is_refused_at_save"
                              "[{}-numpy_rng]"),
    "caller_error_falls_back": "test_caller_errors::test_load_latest_does_not_fall_back_on_a_callers_mistake[{}-none]",
    "unbounded_record": "test_exact_resume::test_hostile_bytes_stay_within_a_memory_bound[{}-record_of_objects]",
    "interrupt_becomes_exception": "test_process_events::test_an_interrupt_during_a_save_leaves_ranks_agreeing"
                                   "[{}-w2-sigint-first-op-rank0]",
    "daemon_async_save": "test_process_events::test_an_async_save_in_flight_at_exit_is_published_or_the_exit_fails"
                         "[{}-plain]",
    "fork_inherits_pending": "test_process_events::test_a_child_forked_during_a_save_resumes_on_its_own[{}]",
    "unagreed_caller_error": "test_process_events::test_one_ranks_bad_state_fails_every_rank_quickly[{}-w2]",
    "interrupt_skips_agreement": "test_process_events::test_an_interrupt_during_a_save_leaves_ranks_agreeing"
                                 "[{}-w2-sigint-first-op-rank0]",
    "load_latest_never_relists": "test_shared_root::test_a_reader_in_another_pid_namespace_is_never_deleted_under_and_"
                                 "never_pins_forever[{}-load_latest-root]",
    "sweeps_this_step_only": "test_shared_root::test_interrupted_saves_leave_bounded_disk[{}]",
    "sweeps_live_staging": "test_shared_root::test_two_writers_of_different_steps_never_fail_each_other[{}]",
}
# Run after every killer: --kill-first must skip it for each (already failed) mutant.
AFTER_THE_KILL = "test_links::test_pointer_linked_out_of_the_root[{}]"
DRAWS = ("given(", "budget(", "run_state_machine_as_test")  # how a suite test asks Hypothesis for examples


def _spec(mutant: str) -> str:
    return f"tests.mutants:{mutant}"


def _name(test_id: str) -> str:
    """``module::function`` as :func:`faults.killmatrix.run` names a test in its results."""
    return test_id.split("[")[0]


def test_every_mutant_has_a_killer_that_draws_nothing():
    assert len(MUTANTS) >= 10
    assert set(KILLERS) == set(MUTANTS)
    for mutant, killer in KILLERS.items():
        module, function = _name(killer).split("::")
        fn = getattr(importlib.import_module(f"faults.suite.{module}"), function)
        source = inspect.getsource(fn)
        assert not any(d in source for d in DRAWS), f"{mutant}: {killer} draws examples"


SUITE_MODULES = sorted(os.path.basename(p)[:-3] for p in glob.glob(os.path.join(ROOT, "faults", "suite", "test_*.py")))


@pytest.mark.extended  # the whole suite once more (refckpt and contract_ckpt pass it in the default run)
@pytest.mark.slow(seconds=40)
def test_the_independent_checkpointer_passes_the_whole_suite():
    """Every module of the suite judges the independent checkpointer, and nothing fails."""
    assert len(SUITE_MODULES) >= 9 and "test_contract" in SUITE_MODULES and "test_state_machine" in SUITE_MODULES
    out = run([INDEPENDENT], [], full=True, workers=0, budget=2, world_sizes="2", cwd=ROOT,
              targets=[f"faults.suite.{m}" for m in SUITE_MODULES])
    table = format_matrix(out)
    print(table)
    r = out["results"][INDEPENDENT]
    assert out["returncode"] == 0 and not r["failed"], table + "\n" + "\n".join(out["summary"])
    # every module judged it: passed, or skipped for a capability it does not declare (the reason says so)
    for m in SUITE_MODULES:
        passed = [t for t in r["passed"] if t.split("::")[0] == m]
        reasons = [why for t, why in zip(r["skipped"], r["skip_reasons"]) if t.split("::")[0] == m]
        assert passed or (reasons and all("capabilit" in w or "declare" in w for w in reasons)), (m, table, reasons)
    assert {t.split("::")[0] for t in r["passed"] + r["skipped"]} == set(SUITE_MODULES), table


#: The killers run in this many tests (a share of the mutants each), so that xdist spreads them
#: over its workers instead of one worker running every killer in turn.
KILLER_SHARES = 5


@pytest.mark.extended  # ~450 CPU s for 32 mutants: the extended profile (and `python -m faults killmatrix`)
@pytest.mark.slow(seconds=30)
@pytest.mark.parametrize("share", range(KILLER_SHARES))
def test_each_mutant_is_failed_by_its_killer(share):
    names = sorted(KILLERS)[share::KILLER_SHARES]
    mutants = [_spec(m) for m in names]
    targets = [f"faults.suite.{KILLERS[m].format(_spec(m))}" for m in names]
    targets += [f"faults.suite.{AFTER_THE_KILL.format(s)}" for s in mutants]
    out = run([], mutants, workers=0, budget=2, world_sizes="2", cwd=ROOT, targets=targets)
    table = format_matrix(out)
    print(table)
    ok, wrong = verdict(out)
    assert ok, "\n".join(wrong) + "\n" + table
    for m in names:
        r = out["results"][_spec(m)]
        assert r["failed"] == [_name(KILLERS[m])] and not r["passed"], (m, table)
        assert r["skipped"] == [_name(AFTER_THE_KILL)], (m, table)
        assert r["skip_reasons"][0].startswith(f"--kill-first: {_spec(m)} already failed "), r["skip_reasons"]


def test_the_kill_matrix_goes_into_the_docs_between_its_markers_only(tmp_path):
    """``python -m faults killmatrix --docs FILE`` replaces what lies between its markers, stamped
    with the command, and keeps every other byte; a file without the markers is refused."""
    from faults.killmatrix import BEGIN, END, splice_docs

    doc = tmp_path / "faults.md"
    doc.write_text(f"before\n{BEGIN} old stamp -->\nold table\n{END}\nafter\n")
    splice_docs(str(doc), "| new | table |\n", "python -m faults killmatrix --docs faults.md")
    text = doc.read_text()
    assert text.startswith("before\n" + BEGIN) and text.endswith(f"\n{END}\nafter\n")
    assert "| new | table |" in text and "old table" not in text and "--docs faults.md" in text
    (tmp_path / "plain.md").write_text("no markers\n")
    with pytest.raises(SystemExit, match="expected one line"):
        splice_docs(str(tmp_path / "plain.md"), "x", "cmd")
