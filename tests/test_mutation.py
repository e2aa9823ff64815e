"""benchmarks.mutation (issue 29): the sampling, scoring, gate and page of the mutation run,
checked on hand-made verdicts (running mutmut itself takes most of an hour: the page it made is
docs/mutation.md, and `python -m benchmarks.mutation --gate BASE` is CI's mutation job)."""

from __future__ import annotations

import json
import subprocess

import pytest

from benchmarks import mutation as M


def test_module_of_maps_mutmut_names_to_files():
    assert M.module_of("refckpt.storage.writer.x_open_write__mutmut_3") == "refckpt/storage/writer.py"
    assert M.module_of("refckpt.checkpointer.xǁDistributedCheckpointerǁsave__mutmut_12") == "refckpt/checkpointer.py"


def test_sample_is_seeded_per_module_and_uniform():
    names = {"a.py": [f"a.x_f__mutmut_{i}" for i in range(50)], "b.py": [f"b.x_g__mutmut_{i}" for i in range(3)]}
    one = M.sample(names, 5, seed=1)
    assert one == M.sample(names, 5, seed=1)
    assert len(one["a.py"]) == 5 and set(one["a.py"]) <= set(names["a.py"])
    assert one["b.py"] == sorted(names["b.py"])  # fewer than asked: all of them
    assert M.sample(names, 5, seed=2)["a.py"] != one["a.py"]
    # adding a module leaves the other modules' draws alone
    assert M.sample({**names, "c.py": ["c.x_h__mutmut_1"]}, 5, seed=1)["a.py"] == one["a.py"]
    assert M.sample(names, None, seed=1)["a.py"] == sorted(names["a.py"])


def test_score_counts_killed_over_non_equivalent():
    statuses = {"m1": "killed", "m2": "timeout", "m3": "survived", "m4": "survived", "m5": "not checked",
                "m6": "segfault"}
    s = M.score(statuses, equivalent=["m4"])
    assert (s["mutants"], s["killed"], s["survived"], s["equivalent"]) == (5, 3, 2, 1)
    assert s["score"] == pytest.approx(3 / 4)
    assert M.score({}, [])["score"] == 1.0
    # a harness crash (mutmut's worker exited 255: its "timeout") is no kill
    assert M.score({"m1": "killed", "m2": M.HARNESS_CRASH}, [])["killed"] == 1
    # outside the runner's reach: out of the denominator, like an equivalent one
    s = M.score(statuses, equivalent=["m4"], outside=["m3"])
    assert (s["outside"], s["counted"], s["score"]) == (1, 3, 1.0)


def test_outside_counts_for_the_suite_runner_only():
    notes = {"mutant": {"m2": {"class": "outside"}}}
    statuses = {"m1": "killed", "m2": "no tests"}
    assert M.score_for(statuses, notes, "suite")["score"] == 1.0
    assert M.score_for(statuses, notes, "repo")["score"] == 0.5


def _results(statuses, module="refckpt/commit.py"):
    return {"suite": {module: {"status": statuses, "diff": {}}}}


def test_gate_fails_below_the_floor_and_names_the_survivors():
    notes = {"floors": {"default": 0.9}, "mutant": {"m3": {"class": "equivalent"}}}
    ok = _results({"m1": "killed", "m2": "killed", "m3": "survived"})
    assert M.gate(ok, notes, ["refckpt/commit.py"]) == []
    bad = _results({"m1": "killed", "m2": "survived", "m3": "survived"})
    [msg] = M.gate(bad, notes, ["refckpt/commit.py"])
    assert "50%" in msg and "m2" in msg and "m3" not in msg.split("surviving:")[1]
    [msg] = M.gate(_results({}), notes, ["refckpt/commit.py"])
    assert "no mutant was judged" in msg


def test_gate_fails_below_the_recorded_score():
    notes = {"floors": {"default": 0.5}, "mutant": {}}
    recorded = _results({"m1": "killed", "m2": "killed", "m3": "killed"})
    now = _results({"m1": "killed", "m2": "killed", "m3": "survived"})
    [msg] = M.gate(now, notes, ["refckpt/commit.py"], recorded=recorded)
    assert "recorded" in msg and "m3" in msg
    assert M.gate(now, notes, ["refckpt/commit.py"]) == []  # 67% is above the floor alone


def test_render_lists_every_survivor_with_its_class():
    results = {"suite": {"refckpt/commit.py": {"status": {"refckpt.commit.x_a__mutmut_1": "survived",
                                                           "refckpt.commit.x_a__mutmut_2": "killed"},
                                                "diff": {"refckpt.commit.x_a__mutmut_1": "-    x = 1\n+    x = 2"}}},
               "repo": {}, "meta": {"population": {"refckpt/commit.py": 10}}}
    notes = {"mutant": {"refckpt.commit.x_a__mutmut_1": {"class": "gap", "why": "w", "killed_by": "test_x"}}}
    page = M.render(results, notes)
    assert "| commit | 10 | 1 / 2 (0 eq.) | 50% |" in page
    assert "### `refckpt.commit.x_a__mutmut_1` -- gap" in page and "Killed by: test_x" in page
    assert "refckpt.commit.x_a__mutmut_2`" not in page
    unclassified = M.render(results, {})
    assert "-- unclassified" in unclassified


def test_changed_modules_sees_committed_and_uncommitted_changes(tmp_path):
    def git(*a):
        subprocess.run(["git", *a], cwd=tmp_path, check=True, capture_output=True)

    git("init", "-q")
    git("-c", "user.email=a@b", "-c", "user.name=a", "commit", "-q", "--allow-empty", "-m", "base")
    (tmp_path / "refckpt" / "storage").mkdir(parents=True)
    (tmp_path / "refckpt" / "commit.py").write_text("x = 1\n")
    (tmp_path / "refckpt" / "optim.py").write_text("x = 1\n")
    git("add", ".")
    git("-c", "user.email=a@b", "-c", "user.name=a", "commit", "-q", "-m", "two")
    (tmp_path / "refckpt" / "storage" / "verify.py").write_text("x = 1\n")
    git("add", ".")  # staged, not committed
    assert M.changed_modules("HEAD~1", cwd=tmp_path) == ["refckpt/commit.py", "refckpt/storage/verify.py"]
    # a change to the suite (a weakened test) gates every module
    (tmp_path / "faults" / "suite").mkdir(parents=True)
    (tmp_path / "faults" / "suite" / "test_x.py").write_text("def test_x(): pass\n")
    git("add", ".")
    assert M.changed_modules("HEAD", cwd=tmp_path) == list(M.MODULES)


def test_the_mutation_job_runs_the_gate_from_the_change_base():
    """The CI job (its own workflow, allowed longer than the tests') runs .ci/run-mutation with
    the change's base; that installs mutmut pinned and runs the gate."""
    import yaml

    with open(M.ROOT / ".github" / "workflows" / "ci-mutation.yml", encoding="utf-8") as f:
        doc = yaml.safe_load(f)
    triggers = doc.get("on", doc.get(True))
    assert {"push", "pull_request"} <= set(triggers)
    [job] = doc["jobs"].values()
    assert job["steps"][0]["with"]["fetch-depth"] == 0  # the base commit must be there to diff against
    runs = [s["run"] for s in job["steps"] if "run" in s]
    assert len(runs) == 1 and runs[0].startswith("bash .ci/run-mutation ") and "base.sha" in runs[0]
    script = (M.ROOT / ".ci" / "run-mutation").read_text()
    assert "-e '.[mutation]'" in script and 'python -m benchmarks.mutation --gate "$base"' in script
    assert "mutmut==" in (M.ROOT / "pyproject.toml").read_text()


def test_the_recorded_page_is_what_the_recorded_verdicts_render_to():
    """docs/mutation.md is generated: re-rendering docs/mutation.json with the notes gives it
    back byte for byte (a survivor classified by hand in the page and not in the notes fails)."""
    if not M.RESULTS.exists():
        pytest.fail("docs/mutation.json is missing: run python -m benchmarks.mutation --docs docs/mutation.md")
    results = json.loads(M.RESULTS.read_text())
    assert M.DOC.read_text() == M.render(results, M.load_notes()) + "\n"


def test_independent_samples_pages_are_what_their_verdicts_render_to():
    """An independent sample (``--results docs/mutation-seedN.json --docs docs/mutation-seedN.md``)
    is generated the same way; every survivor in it is classified."""
    pages = sorted(M.DOC.parent.glob("mutation-*.md"))
    for page in pages:
        results = json.loads(page.with_suffix(".json").read_text())
        commands = results["meta"]["commands"]
        assert commands and all(c.endswith(f"--docs {page.relative_to(M.ROOT)}") for c in commands.values())
        text = M.render(results, M.load_notes(), independent=True)
        assert page.read_text() == text + "\n"
        assert "-- unclassified" not in text, page
        assert "## Gate" not in text


def test_every_recorded_survivor_is_classified():
    results = json.loads(M.RESULTS.read_text())
    notes = M.load_notes().get("mutant", {})
    missing = sorted({name for runner in M.RUNNERS for entry in results.get(runner, {}).values()
                      for name, status in entry.get("status", {}).items()
                      if status not in M.KILLED
                      and notes.get(name, {}).get("class") not in ("equivalent", "gap", "outside")})
    assert not missing, f"unclassified survivors (classify them in {M.NOTES}): {missing}"


def test_what_the_suite_cannot_reach_the_repository_tests_kill():
    """A mutant classed *outside* (no checkpointer call reaches it) is out of the suite's score
    because the repository's own tests were run on it and killed it -- or its note says, as an
    open gap, why no test here can (it is then listed as such on the page). The repo verdicts are
    the recorded run's and every independent sample's (each judged on its own mutants)."""
    repo: dict[str, str] = {}
    for path in [M.RESULTS, *sorted(M.DOC.parent.glob("mutation-*.json"))]:
        results = json.loads(path.read_text())
        repo.update({n: s for entry in results.get("repo", {}).values() for n, s in entry.get("status", {}).items()})
    notes = M.load_notes()["mutant"]
    for name in M.classified(M.load_notes(), "outside"):
        if notes[name].get("killed_by", "").startswith("open:"):
            assert repo.get(name) not in M.KILLED, f"{name} is killed now: its note still says open"
            continue
        if repo.get(name) not in M.KILLED and notes[name].get("by_hand"):
            continue  # killed when applied by hand, which the note records (mutmut missed the test: see it)
        assert repo.get(name) in M.KILLED, f"{name} is classed outside the suite, but the repo runner gave {repo.get(name)}"
