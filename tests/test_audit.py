"""``python -m faults audit``: the junit parsing and aggregation on a handmade report (pass,
violation, setup error, advisory property, strict-mode advisory failure, skips, xdist's
``@group`` suffix), the markdown and exit status from a canned report, and one real run in a
subprocess: refckpt has no violation, a one-bug mutant has violations with reasons."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys

import pytest

from faults import audit as A

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SPEC = "tests.mutants:trusts_pointer"
P = "test_each_kind_of_pointer_damage_still_finds_the_newest_step"

JUNIT = f"""<?xml version="1.0" encoding="utf-8"?>
<testsuites name="pytest tests"><testsuite name="pytest" errors="1" failures="3" skipped="3" tests="10">
<testcase classname="faults.suite.test_contract" name="{P}[{SPEC}-absent]" time="0.5"/>
<testcase classname="faults.suite.test_contract" name="{P}[{SPEC}-torn]@checkpointer-{SPEC}" time="0.1">
  <failure message="AssertionError: pointer torn: resumed /tmp/pytest-of-u/pytest-7/popen-gw0/test_each_kind0/global_step_1,\
 the newest complete checkpoint is /tmp/pytest-of-u/pytest-7/popen-gw0/test_each_kind0/global_step_12&#10;assert False">def\
 test(): ...
E       AssertionError: pointer torn: resumed ...</failure>
</testcase>
<testcase classname="faults.suite.test_contract" name="test_round_trip_is_bitwise[{SPEC}]" time="0.2">
  <error message="failed on setup with &quot;ValueError: cannot build the checkpointer&quot;">@pytest.fixture ...
E       ValueError: cannot build the checkpointer</error>
</testcase>
<testcase classname="faults.suite.test_contract" name="test_saving_over_a_complete_step_is_refused_or_safe[{SPEC}]" time="0.3">
  <properties><property name="faults-suite" value="{{'examples': 1}}"/>
  <property name="faults-advisory" value="accepted a save over complete step 2 without declaring overwrite"/></properties>
</testcase>
<testcase classname="faults.suite.test_contract" name="test_failed_async_save_is_raised_and_never_published[{SPEC}-stage]"\
 time="0.3">
  <properties><property name="faults-advisory" value="a failed async save raised builtins.KeyboardInterrupt, which is not an\
 Exception subclass"/>
  <property name="faults-advisory" value="raise_for_failed_async_save raised builtins.SystemExit, which is not an Exception\
 subclass"/></properties>
  <failure message="Failed: [advisory] a failed async save raised builtins.KeyboardInterrupt, which is not an Exception\
 subclass&#10;raise_for_failed_async_save raised builtins.SystemExit, which is not an Exception subclass">[advisory] a\
 failed async save raised builtins.KeyboardInterrupt, which is not an Exception subclass
raise_for_failed_async_save raised builtins.SystemExit, which is not an Exception subclass</failure>
</testcase>
<testcase classname="faults.suite.test_contract" name="test_corrupt_payload_never_loads_silently[{SPEC}]" time="0.3">
  <failure message="Failed: [advisory] loading a bit-flipped step raised builtins.SystemExit, which is not an Exception\
 subclass">[advisory] loading a bit-flipped step raised builtins.SystemExit, which is not an Exception subclass</failure>
</testcase>
<testcase classname="faults.suite.test_contract" name="test_resume_lands_on_newest_complete_step[{SPEC}]" time="2.0">
  <failure message="ExceptionGroup: Hypothesis found 2 distinct failures. (2 sub-exceptions)">  + Exception Group Traceback\
 (most recent call last):
  | ExceptionGroup: Hypothesis found 2 distinct failures. (2 sub-exceptions)
  +-+---------------- 1 ----------------
    | AssertionError: steps [1, 3], damaged [3], pointer keep: resumed None, the newest complete checkpoint is step 1</failure>
</testcase>
<testcase classname="faults.suite.test_contract" name="test_retention_keeps_the_newest_complete_steps[{SPEC}-1]" time="0.0">
  <skipped type="pytest.skip" message="checkpointer does not declare capability keep_last\
 (faults.contract.Capability)">/x/_common.py:82: checkpointer does not declare capability keep_last\
 (faults.contract.Capability)</skipped>
</testcase>
<testcase classname="faults.suite.test_contract" name="test_retention_keeps_the_newest_complete_steps[{SPEC}-2]" time="0.0">
  <skipped type="pytest.skip" message="checkpointer does not declare capability keep_last\
 (faults.contract.Capability)">/x/_common.py:82: ...</skipped>
</testcase>
<testcase classname="faults.suite.test_multirank" name="test_multi_rank_round_trip[{SPEC}-w2-sync]" time="0.0">
  <skipped type="pytest.skip" message="{SPEC}: torchtitan is not installed">/x/plugin.py:1: ...</skipped>
</testcase>
</testsuite></testsuites>
"""


def by_property(results):
    return {r.property: r for r in results}


def test_junit_parsing_covers_every_outcome():
    results = A.parse_junit(JUNIT, SPEC)
    got = by_property(results)
    assert len(results) == 10
    assert [r.property for r in results] == sorted(r.property for r in results)

    assert got[f"{P}[absent]"].outcome == "pass" and got[f"{P}[absent]"].reason == ""
    torn = got[f"{P}[torn]"]  # the @group suffix is dropped with the spec
    assert (torn.outcome, torn.severity) == ("fail", "violation")
    assert torn.reason == ("AssertionError: pointer torn: resumed <tmp>/global_step_1, the newest complete "
                           "checkpoint is <tmp>/global_step_12"), torn.reason
    setup = got["test_round_trip_is_bitwise"]
    assert setup.outcome == "fail" and setup.reason == "setup error: ValueError: cannot build the checkpointer"
    group = got["test_resume_lands_on_newest_complete_step"]
    assert group.outcome == "fail" and group.reason.startswith("AssertionError: steps [1, 3], damaged [3]"), group.reason

    passed_with = got["test_saving_over_a_complete_step_is_refused_or_safe"]
    assert (passed_with.outcome, passed_with.severity) == ("advisory", "advisory")
    assert passed_with.reason == "accepted a save over complete step 2 without declaring overwrite"
    strict = got["test_failed_async_save_is_raised_and_never_published[stage]"]
    assert strict.outcome == "advisory" and len(strict.advisories) == 2
    assert strict.reason.startswith("a failed async save raised builtins.KeyboardInterrupt") and "(+1 more)" in strict.reason
    strict_no_props = got["test_corrupt_payload_never_loads_silently"]
    assert strict_no_props.outcome == "advisory"
    assert strict_no_props.advisories == ["loading a bit-flipped step raised builtins.SystemExit, which is not an "
                                          "Exception subclass"]

    assert got["test_retention_keeps_the_newest_complete_steps[1]"].outcome == "skip"
    assert got["test_multi_rank_round_trip[w2-sync]"].reason == f"{SPEC}: torchtitan is not installed"

    assert A.counts(results) == {"pass": 1, "fail": 3, "advisory": 3, "skip": 3, "harness-error": 0}
    rows = A.findings(results)
    assert [r["severity"] for r in rows] == ["violation"] * 3 + ["advisory"] * 4  # one row per advisory message
    assert [r["property"] for r in rows[:3]] == sorted(r["property"] for r in rows[:3])
    assert A.skips(results) == [("checkpointer does not declare capability keep_last (faults.contract.Capability)", 2),
                                (f"{SPEC}: torchtitan is not installed", 1)]


def test_property_names_and_specs():
    assert A.property_name(f"{P}[{SPEC}-nul]", SPEC) == f"{P}[nul]"
    assert A.property_name(f"test_x[{SPEC}]@checkpointer-{SPEC}", SPEC) == "test_x"
    assert A.property_name(f"test_x[w2-{SPEC}]", SPEC) == "test_x[w2]"
    assert A.property_name("test_plain", SPEC) == "test_plain"
    assert A.resolve_spec("refckpt") == "refckpt:DistributedCheckpointer"
    assert A.resolve_spec("veomni") == "faults.adapters.veomni:VeOmni"
    assert A.resolve_spec(SPEC) == SPEC
    with pytest.raises(ValueError, match="MODULE:FACTORY"):
        A.resolve_spec("nonsense")


def test_progress_lines_are_salvaged_when_a_run_is_killed():
    text = (f"faults/suite/test_contract.py::{P}[{SPEC}-absent] PASSED [ 14%]\n"
            f"[gw0] [ 28%] FAILED faults/suite/test_contract.py::{P}[{SPEC}-torn] \n"
            f"faults/suite/test_contract.py::{P}[{SPEC}-stale] ")
    got = by_property(A.parse_progress(text, SPEC, "no report: the run timed out"))
    assert set(got) == {f"{P}[absent]", f"{P}[torn]"}
    assert got[f"{P}[torn]"].outcome == "fail" and got[f"{P}[torn]"].reason == "no report: the run timed out"


def canned_report(*, violation: bool) -> dict:
    results = A.parse_junit(JUNIT, SPEC)
    if not violation:
        results = [r for r in results if r.outcome != "fail"]

    def entry(name, spec, rs, wall):
        return {"name": name, "spec": spec, "package": None, "version": "n/a", "status": "completed", "complete": True,
                "returncode": 0, "wall_s": wall, "pytest_command": [], "counts": A.counts(rs),
                "results": [], "findings": A.findings(rs), "skips": [{"reason": k, "tests": n} for k, n in A.skips(rs)],
                "output_tail": None}

    return {"command": "python -m faults audit --checkpointer x", "date": "2026-01-01 00:00 UTC",
            "options": {"budget": 4, "world_sizes": "1,2", "seed": 0, "strict": False, "keyword": None},
            "versions": {"python": "3.11", "torch": "2.x"}, "platform": "linux",
            "checkpointers": [entry(SPEC, SPEC, results, 12.3), entry("refckpt", "refckpt:DistributedCheckpointer", [], 1.0)]}


def test_markdown_is_sorted_and_stamped_and_exit_status(monkeypatch, tmp_path, capsys):
    report = canned_report(violation=True)
    text = A.format_markdown(report)
    assert "`python -m faults audit --checkpointer x`" in text
    assert ("| checkpointer | package | version | passed | violations | advisories | skipped | harness errors "
            "| wall time |") in text
    assert text.index("## `refckpt`") < text.index(f"## `{SPEC}`")  # sorted by name
    swapped = dict(report, checkpointers=report["checkpointers"][::-1])
    assert A.format_markdown(swapped) == text
    assert "| `test_round_trip_is_bitwise` | violation | setup error: ValueError: cannot build the checkpointer |" in text
    assert "| checkpointer does not declare capability keep_last (faults.contract.Capability) | 2 |" in text

    for violation, fail_on, want in ((True, [], 0), (True, ["--fail-on", "violation"], 1),
                                     (False, ["--fail-on", "violation"], 0), (False, ["--fail-on", "advisory"], 1)):
        canned = canned_report(violation=violation)
        monkeypatch.setattr(A, "audit", lambda names, canned=canned, **kw: canned)
        md, js = tmp_path / "a.md", tmp_path / "a.json"
        assert A.main(["--checkpointer", "refckpt", "--markdown", str(md), "--json", str(js), *fail_on]) == want
        assert md.read_text() == A.format_markdown(canned)
        assert json.loads(js.read_text())["checkpointers"][0]["spec"] == SPEC
    capsys.readouterr()


@pytest.mark.parametrize("argv", [["--checkpointer", "nonsense"], [], ["--checkpointer", "refckpt", "--world-sizes", "0"]])
def test_usage_errors_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as e:
        A.main(argv)
    assert e.value.code == 2
    capsys.readouterr()


def test_the_subcommand_is_listed(capsys):
    from faults.__main__ import main

    with pytest.raises(SystemExit):
        main(["--help"])
    assert "audit" in capsys.readouterr().out


@pytest.mark.extended  # 5 fresh interpreters importing torch: about 20 s alone, several times that under -n 8
@pytest.mark.slow(seconds=30)  # 5 fresh processes (the audit, a version probe and a suite run per checkpointer)
def test_a_real_audit_of_refckpt_and_a_mutant(tmp_path):
    """The suite's pointer-damage and corrupt-payload tests, for real, in a subprocess per
    checkpointer: refckpt passes them, ``trusts_pointer`` is caught with reasons."""
    md, js = tmp_path / "audit.md", tmp_path / "audit.json"
    argv = ["--checkpointer", "refckpt", "--checkpointer", SPEC, "-k", "each_kind_of_pointer_damage or corrupt_payload",
            "--world-sizes", "1", "-n", "0", "--fault-budget", "1", "--timeout", "300",
            "--markdown", str(md), "--json", str(js)]
    proc = subprocess.run([sys.executable, "-m", "faults", "audit", *argv], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "[2/2] tests.mutants:trusts_pointer" in proc.stderr  # progress
    report = json.loads(js.read_text())
    assert report["command"] == "python -m faults audit " + shlex.join(argv)
    assert report["versions"]["python"] and report["versions"]["torch"] != "not installed"
    by = {c["name"]: c for c in report["checkpointers"]}
    ref, mutant = by["refckpt"], by[SPEC]
    assert ref["spec"] == "refckpt:DistributedCheckpointer" and ref["package"] == "refckpt"
    assert ref["version"] and not ref["version"].startswith("not installed"), ref["version"]
    assert ref["status"] == "completed" and ref["wall_s"] > 0
    assert ref["counts"]["fail"] == 0 and ref["counts"]["pass"] >= 8, ref
    assert mutant["status"] == "completed"
    assert mutant["counts"]["fail"] >= 1, mutant["counts"]
    violations = [f for f in mutant["findings"] if f["severity"] == "violation"]
    assert violations and all(f["reason"] and "\n" not in f["reason"] for f in violations)
    assert all(f["property"].startswith("test_") and SPEC not in f["property"] for f in violations)
    text = md.read_text()
    assert report["command"] in text
    assert "| checkpointer | package | version | passed | violations | advisories | skipped | harness errors |" in text
    assert f"| `{violations[0]['property']}` | violation |" in text


def test_findings_are_diagnosed_by_the_adapters_patterns():
    from faults.audit import explain

    notes = {
        "violation:*|*empty_cache*": "cpu host",
        "violation:test_multi_rank_round_trip[[]w[2-9]-async-*": "deadlock",
        "violation:test_multi_rank_round_trip*": "partial optimizer",
        "advisory:test_*linked*": "follows links",
    }
    assert explain("test_round_trip_is_bitwise", "violation", notes, "AttributeError: torch.cpu.empty_cache") == "cpu host"
    assert explain("test_multi_rank_round_trip[w2-async-fsdp2]", "violation", notes, "timeout") == "deadlock"
    assert explain("test_multi_rank_round_trip[w1-async-fsdp2]", "violation", notes, "Missing key") == "partial optimizer"
    assert explain("test_file_linked_out_of_the_root[shard]", "advisory", notes) == "follows links"
    assert explain("test_file_linked_out_of_the_root[shard]", "violation", notes) == ""  # severity must match
    # every shipped adapter's patterns parse and name a defect
    import faults.adapters.dcp as dcp

    assert dcp.FINDINGS and all(isinstance(v, str) and v for v in dcp.FINDINGS.values())
    assert explain("test_no_code_runs_from_checkpoint_bytes[commit_record]", "violation", dcp.FINDINGS).startswith(
        "code execution")


def test_rediagnose_reapplies_the_adapters_findings_without_running(tmp_path, capsys):
    """``--rediagnose JSON`` writes the tables again with each adapter's current FINDINGS (imported in a
    subprocess, as the audit does): explanations stripped from the committed docs/audit.json come back,
    the verdicts and the recorded command stay as they were."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, "docs", "audit.json")) as f:
        report = json.load(f)
    report["checkpointers"] = [c for c in report["checkpointers"] if c["name"] == "torchsave"]
    (ck,) = report["checkpointers"]
    want = [f["explanation"] for f in ck["findings"]]
    assert want and all(want)
    for f in ck["findings"]:
        f["explanation"] = ""
    src, out, md = tmp_path / "in.json", tmp_path / "out.json", tmp_path / "out.md"
    src.write_text(json.dumps(report))
    assert A.main(["--rediagnose", str(src), "--json", str(out), "--markdown", str(md)]) == 0
    got = json.loads(out.read_text())
    assert [f["explanation"] for f in got["checkpointers"][0]["findings"]] == want
    assert got["command"] == report["command"] and got["checkpointers"][0]["results"] == ck["results"]
    assert "not diagnosed" not in md.read_text() and report["command"] in md.read_text()
