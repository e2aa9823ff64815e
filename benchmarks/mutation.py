"""``python -m benchmarks.mutation``: mutation testing of refckpt's protocol modules with mutmut
(issue 29), judged by two runners, each reported on its own:

* ``suite``: ``faults.suite`` against refckpt (``--fault-budget 2 --world-sizes 1,2``), the
  product's verdict -- the base configuration, ``[tool.mutmut]`` in pyproject.toml;
* ``repo``: the repository's own tests (:data:`REPO_TESTS`, the files that exercise the
  protocol modules; the default profile, extended tests skip).

Each runner has its own mutmut folder (``mutants/suite``, ``mutants/repo``; git-ignored), so its
cache -- which tests reach which function (mutmut's stats), each mutant's verdict keyed by the
hash of its function -- survives between runs: a second run only tests the mutants of functions
that changed. What mutmut alone would get wrong here, and what this wrapper adds:

* the suite's ranks are other processes (a forkserver, spawned or ``python -m`` children): the
  mutated tree goes on ``PYTHONPATH`` so that they import it (not the editable install's
  checkout), and they inherit ``MUTANT_UNDER_TEST`` from the mutant's worker, in which the
  forkserver starts (mutmut's ``process_isolation = "forkserver"``);
* mutmut learns which tests reach a function in the pytest process only; the functions ranks
  reach are recorded by ``benchmarks/_mutation_site`` (sitecustomize + a pytest plugin) and
  merged into each test's hits, so that a function only ranks call is not "no tests".

A full run of the suite runner does not fit an hour on 2 cores (~5,000 mutants, tens of seconds
each), so the default is a seeded uniform sample per module (``--sample``, ``--seed``); ``--full``
runs every mutant of the selected modules. The verdicts go to ``docs/mutation.json``; the page
``docs/mutation.md`` is rendered from it and from the classifications of the survivors in
``benchmarks/mutation_notes.toml`` (``--docs``; ``--render`` re-renders without running).
``--gate BASE`` runs the suite runner on the modules changed since BASE and fails when one
scores below its floor in the notes file.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import shutil
import subprocess
import sys
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import tomllib

ROOT = Path(__file__).resolve().parent.parent
SITE = ROOT / "benchmarks" / "_mutation_site"
NOTES = ROOT / "benchmarks" / "mutation_notes.toml"
RESULTS = ROOT / "docs" / "mutation.json"
DOC = ROOT / "docs" / "mutation.md"

#: The protocol modules (issue 29), by the names the doc uses.
MODULES = {
    "refckpt/commit.py": "commit",
    "refckpt/layout.py": "layout",
    "refckpt/record.py": "record",
    "refckpt/durable.py": "durable",
    "refckpt/storage/writer.py": "storage.writer",
    "refckpt/storage/reader.py": "storage.reader",
    "refckpt/storage/verify.py": "storage.verify",
    "refckpt/checkpointer.py": "checkpointer",
}
RUNNERS = ("suite", "repo")
#: The repository's tests that exercise the protocol modules in the default profile (the rest
#: test the harness, adapters, benchmarks and tools, and would only lengthen mutmut's stats run).
REPO_TESTS = [
    "tests/test_integrity.py", "tests/test_layout.py", "tests/test_checkpointer_world.py",
    "tests/test_powerloss.py", "tests/test_record_flips.py", "tests/test_retention_readers.py",
    "tests/test_transactional_load.py", "tests/test_shared_root.py", "tests/test_caller_errors.py",
    "tests/test_fast_paths.py", "tests/test_hostile.py", "tests/test_deferred.py", "tests/test_exit.py",
    "tests/test_protocol_edges.py", "tests/test_interop.py", "tests/test_cli.py", "tests/test_memory_bounds.py",
    "tests/test_fsdp.py", "tests/test_format_speed.py",
]
#: mutmut's verdicts that count as killed: a failing test, pytest's internal error, a timeout
#: (a hang the suite's watchdogs turn into a failure), a crash of the worker.
KILLED = {"killed", "timeout", "segfault"}
#: What mutmut's forkserver worker exits with when running the tests raised instead of returning
#: pytest's status (``os._exit(-1)``): mutmut maps it to "timeout", but nothing timed out and no
#: test failed -- seen when pytest's own clean-up of an earlier session's 1,200-level tree raised
#: RecursionError. Reported as a harness crash, never as a kill, and run again.
HARNESS_EXIT = 255
HARNESS_CRASH = "harness crash"
DEFAULT_SAMPLE = 8
DEFAULT_SEED = 29


# ---------------------------------------------------------------------------------------
# Sampling and scores (pure: tests/test_mutation.py checks them without running mutmut)
# ---------------------------------------------------------------------------------------


def module_of(mutant: str) -> str:
    """``refckpt.storage.writer.x_open_write__mutmut_3`` -> ``refckpt/storage/writer.py``."""
    dotted = mutant.split(".x_", 1)[0].split(".xǁ", 1)[0]
    return dotted.replace(".", "/") + ".py"


def sample(names_by_module: dict[str, Sequence[str]], per_module: int | None, seed: int) -> dict[str, list[str]]:
    """A uniform sample of ``per_module`` mutants of each module, drawn from the sorted names
    with a generator seeded by ``seed`` and the module (so adding a module leaves the others'
    draws alone); ``None``: every mutant."""
    out = {}
    for module, names in sorted(names_by_module.items()):
        ordered = sorted(names)
        if per_module is None or per_module >= len(ordered):
            out[module] = ordered
        else:
            out[module] = sorted(random.Random(f"{seed}:{module}").sample(ordered, per_module))
    return out


def score(statuses: dict[str, str], equivalent: Iterable[str], outside: Iterable[str] = ()) -> dict[str, Any]:
    """Killed over the mutants that count: not equivalent, and not ``outside`` the runner's
    reach (code the checkpointer contract never calls: for the suite runner, the mutants the
    notes class ``outside``, which the repository's tests must kill instead). Mutants not run
    (no verdict) do not count."""
    eq, out = set(equivalent), set(outside)
    judged = {m: s for m, s in statuses.items() if s not in ("not checked", "skipped")}
    killed = sorted(m for m, s in judged.items() if s in KILLED)
    survived = sorted(m for m, s in judged.items() if s not in KILLED)
    equiv = sorted(m for m in survived if m in eq)
    outs = sorted(m for m in survived if m in out and m not in eq)
    denominator = len(judged) - len(equiv) - len(outs)
    return {
        "mutants": len(judged),
        "killed": len(killed),
        "survived": len(survived),
        "equivalent": len(equiv),
        "outside": len(outs),
        "counted": denominator,
        "score": (len(killed) / denominator) if denominator else 1.0,
    }


def classified(notes: dict[str, Any], cls: str) -> list[str]:
    """The mutants the notes give class ``cls`` (equivalent, gap, outside)."""
    return [m for m, n in notes.get("mutant", {}).items() if n.get("class") == cls]


def score_for(statuses: dict[str, str], notes: dict[str, Any], runner: str) -> dict[str, Any]:
    """:func:`score` with the notes' classes: ``outside`` counts as out of reach for the suite
    runner only (the repo runner must kill those)."""
    return score(statuses, classified(notes, "equivalent"), classified(notes, "outside") if runner == "suite" else ())


def load_notes(path: Path = NOTES) -> dict[str, Any]:
    with open(path, "rb") as f:
        return tomllib.load(f)


def gate(results: dict[str, Any], notes: dict[str, Any], modules: Iterable[str], runner: str = "suite",
         recorded: dict[str, Any] | None = None) -> list[str]:
    """The modules whose score under ``runner`` is below their floor (the notes' ``[floors]``,
    default 90%) or below the score ``recorded`` for them (docs/mutation.json), as messages."""
    floors = notes.get("floors", {}).get(runner, {})
    excluded = set(classified(notes, "equivalent")) | (set(classified(notes, "outside")) if runner == "suite" else set())
    failures = []
    for module in modules:
        statuses = results.get(runner, {}).get(module, {}).get("status", {})
        if not statuses:
            failures.append(f"{module}: no mutant was judged under {runner}")
            continue
        s = score_for(statuses, notes, runner)
        lost = sorted(m for m, st in statuses.items() if st not in KILLED and m not in excluded)
        floor = float(floors.get(module, notes.get("floors", {}).get("default", 0.9)))
        if s["score"] + 1e-9 < floor:
            failures.append(f"{module}: {runner} score {s['score']:.0%} ({s['killed']}/{s['counted']}) "
                            f"is below its floor {floor:.0%}; surviving: {', '.join(lost)}")
            continue
        before = (recorded or {}).get(runner, {}).get(module, {}).get("status", {})
        if before:
            r = score_for(before, notes, runner)
            if s["score"] + 1e-9 < r["score"]:
                failures.append(f"{module}: {runner} score {s['score']:.0%} is below its recorded {r['score']:.0%} "
                                f"(docs/mutation.json); surviving: {', '.join(lost)}")
    return failures


#: Paths whose change can weaken the suite runner itself (its tests, the harness they run on, the
#: repository's pytest configuration, mutmut's): a change to any of them gates every module.
RUNNER_PATHS = ("faults/", "conftest.py", "pyproject.toml")


def changed_modules(base: str, cwd: Path = ROOT) -> list[str]:
    """The protocol modules a change touches: ``git diff --name-only BASE`` (committed and
    uncommitted), in :data:`MODULES`' order; every module when the change touches the suite or
    the harness (:data:`RUNNER_PATHS`): a weakened test weakens every module's score."""
    out = subprocess.run(["git", "diff", "--name-only", base, "--"], cwd=cwd, capture_output=True, text=True,
                         check=True).stdout
    touched = set(out.split())
    if any(p.startswith(RUNNER_PATHS) for p in touched):
        return list(MODULES)
    return [m for m in MODULES if m in touched]


# ---------------------------------------------------------------------------------------
# Running mutmut
# ---------------------------------------------------------------------------------------


def _workdir(name: str) -> Path:
    """``mutants/NAME`` (a runner's name, or ``gate``): the folder mutmut runs in, with the
    checkout's parts linked in; mutmut writes its own ``mutants/`` (the mutated copy and its
    cache) inside it."""
    work = ROOT / "mutants" / name
    work.mkdir(parents=True, exist_ok=True)
    for name in ("refckpt", "faults", "tests", "benchmarks", "conftest.py", "pyproject.toml"):
        link = work / name
        if not link.is_symlink():
            if link.exists():
                shutil.rmtree(link) if link.is_dir() else link.unlink()
            link.symlink_to(ROOT / name)
    return work


def _configure(runner: str, work: Path) -> None:
    from mutmut import configuration

    configuration.reset_config()
    cfg = configuration.config()
    plugin = ["-p", "mutation_hits"]
    if runner == "suite":
        cfg = dataclasses.replace(cfg, pytest_add_cli_args=[*cfg.pytest_add_cli_args, *plugin])
    else:
        cfg = dataclasses.replace(cfg, pytest_add_cli_args=["-p", "no:cacheprovider", *plugin],
                                  pytest_add_cli_args_test_selection=list(REPO_TESTS))
    configuration._config = cfg
    hits = work / "hits"
    shutil.rmtree(hits, ignore_errors=True)
    hits.mkdir()
    os.environ["MUTMUT_HITS_DIR"] = str(hits)
    # Ranks, forkservers and `python -m` children import the mutated tree, and load the hit
    # recorder; the editable install's finder comes after sys.path, so this wins over it.
    os.environ["PYTHONPATH"] = os.pathsep.join([str(work / "mutants"), str(SITE)])
    sys.path.insert(0, str(SITE))


def _generate(max_children: int) -> dict[str, list[str]]:
    from mutmut import __main__ as mm
    from mutmut.mutation.data import SourceFileMutationData
    from mutmut.utils.file_utils import copy_also_copy_files, copy_src_dir, setup_source_paths, walk_mutatable_files

    Path("mutants").mkdir(exist_ok=True)
    copy_src_dir()
    copy_also_copy_files()
    setup_source_paths()
    mm.create_mutants(max_children)
    names: dict[str, list[str]] = {}
    for path in walk_mutatable_files():
        data = SourceFileMutationData(path=path)
        data.load()
        names[str(path)] = list(data.exit_code_by_key)
    return names


def _verdicts(names: Iterable[str]) -> dict[str, str]:
    from mutmut.mutation.data import SourceFileMutationData
    from mutmut.stats import status_by_exit_code

    wanted = set(names)
    out = {}
    for module in MODULES:
        data = SourceFileMutationData(path=module)
        data.load()
        for name, code in data.exit_code_by_key.items():
            if name in wanted:
                out[name] = HARNESS_CRASH if code == HARNESS_EXIT else status_by_exit_code[code]
    return out


def _forget_harness_crashes(names: Iterable[str], codes: Iterable[int] = (HARNESS_EXIT,)) -> int:
    """Reset the verdicts of ``names`` that are harness crashes (exit 255) to "not checked", so
    that they run again: mutmut reads 255 as "timeout", which would count them as killed.
    ``codes``: the exit codes to forget (``--rerun-survivors`` adds the survivors' 0 and 33: mutmut
    re-tests a mutant when its function changes, not when a test that could kill it is added)."""
    from mutmut.mutation.data import SourceFileMutationData

    wanted, forget, count = set(names), set(codes), 0
    for module in MODULES:
        data = SourceFileMutationData(path=module)
        data.load()
        dirty = False
        for name, code in data.exit_code_by_key.items():
            if name in wanted and code in forget:
                data.exit_code_by_key[name] = None
                dirty, count = True, count + 1
        if dirty:
            data.save()
    return count


def _diff(name: str) -> str:
    from mutmut.mutation.diff_apply import get_diff_for_mutant

    try:
        diff = get_diff_for_mutant(name, path=module_of(name))
    except Exception as e:  # a mutant mutmut cannot show is still listed
        return f"(no diff: {e})"
    lines = [ln for ln in diff.splitlines() if ln.startswith(("-", "+")) and not ln.startswith(("---", "+++"))]
    return "\n".join(lines)


def run_runner(runner: str, modules: Sequence[str], per_module: int | None, seed: int, max_children: int,
               only: Sequence[str] | None = None, fresh: bool = False, work: str | None = None,
               rerun_survivors: bool = False) -> dict[str, Any]:
    """Run mutmut for ``runner`` on the sample of ``modules`` (or only the mutants ``only``),
    in a child process so that each runner has a clean interpreter; returns its verdicts.
    ``fresh``: drop mutmut's cache first. mutmut re-tests a mutant when its function changes,
    not when the tests do, so a cached "killed" outlives a weakened test: the gate and a run
    after the suite changed must start fresh. ``work``: the folder under ``mutants/`` (default the
    runner's; the gate uses its own, so that it never drops the recorded run's cache)."""
    work = work or runner
    if fresh:
        shutil.rmtree(ROOT / "mutants" / work / "mutants", ignore_errors=True)
    out_file = ROOT / "mutants" / f"{work}.result.json"
    out_file.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "benchmarks.mutation", "--_child", runner, "--_work", work, "--seed", str(seed),
           "--max-children", str(max_children), "--modules", *modules]
    cmd += ["--full"] if per_module is None else ["--sample", str(per_module)]
    if rerun_survivors:
        cmd += ["--rerun-survivors"]
    if only is not None:
        cmd += ["--only", *only]
    start = time.monotonic()
    proc = subprocess.run(cmd, cwd=ROOT)
    if proc.returncode != 0 or not out_file.exists():
        raise SystemExit(f"mutmut's {runner} run failed (exit {proc.returncode})")
    result = json.loads(out_file.read_text())
    result["wall_s"] = round(time.monotonic() - start)
    return result


def _child(runner: str, modules: Sequence[str], per_module: int | None, seed: int, max_children: int,
           only: Sequence[str] | None, work_name: str | None = None, rerun_survivors: bool = False) -> None:
    work = _workdir(work_name or runner)
    os.chdir(work)
    _configure(runner, work)
    from mutmut import __main__ as mm

    names = _generate(max_children)
    population = {m: len(names.get(m, [])) for m in modules}
    picked = sample({m: names.get(m, []) for m in modules}, per_module, seed)
    chosen = [n for m in modules for n in picked[m]]
    if only is not None:
        chosen = [n for n in chosen if n in set(only)]
    forgotten = _forget_harness_crashes(chosen, (HARNESS_EXIT, 0, 33) if rerun_survivors else (HARNESS_EXIT,))
    if forgotten:
        print(f"{forgotten} harness crashes (exit 255) of an earlier run are run again", flush=True)
    todo = [n for n, s in _verdicts(chosen).items() if s == "not checked"]
    if todo:
        try:
            mm._run(todo, max_children)
        except SystemExit as e:
            if e.code not in (0, None):
                raise
    # every mutant of the sample, with the verdict the cache holds (``--only`` ran some of them
    # again; the others keep theirs, or "not checked" where this runner never ran them)
    verdicts = _verdicts([n for m in modules for n in picked[m]])
    result = {
        "population": population,
        "modules": {m: {"status": {n: verdicts.get(n, "not checked") for n in picked[m]},
                        "diff": {n: _diff(n) for n in picked[m]}} for m in modules},
    }
    (ROOT / "mutants" / f"{work_name or runner}.result.json").write_text(json.dumps(result, indent=1, ensure_ascii=False))


# ---------------------------------------------------------------------------------------
# The page
# ---------------------------------------------------------------------------------------


def render(results: dict[str, Any], notes: dict[str, Any], independent: bool = False) -> str:
    """The page. ``independent``: ``results`` are not the recorded run's but an independent
    sample's, kept in its own verdicts file (``--results``, whose command is in its meta); its page
    names that command and has no gate section."""
    mutant_notes = notes.get("mutant", {})
    meta = results.get("meta", {})
    commands = meta.get("commands", {})
    command = " then ".join(f"`{c}`" for c in commands.values()) if independent else None
    results_file = meta.get("results", "docs/mutation.json") if independent else "docs/mutation.json"
    lines = [
        "# Mutation testing of the protocol modules" + (f" (independent sample, seed {meta.get('seed', '?')})"
                                                        if command else ""),
        "",
        f"<!-- Generated by {command or '`python -m benchmarks.mutation --docs docs/mutation.md`'} (runs mutmut,",
        f"     cached in mutants/; `--render` re-renders this page from {results_file} and",
        "     benchmarks/mutation_notes.toml without running). Do not edit by hand: classify survivors",
        "     in benchmarks/mutation_notes.toml. -->",
        "",
        "mutmut mutates one function at a time (comparisons, booleans, constants, strings, arguments,",
        "deleted calls, returns) and runs the tests that reach that function; a mutant is *killed* when",
        "one fails or hangs past mutmut's timeout (mutmut's \"timeout\" also covers exit 255, a crash of its",
        "worker: the wrapper reports those as harness crashes, never kills, and runs them again). The",
        "score is killed / (judged - equivalent), and for",
        "the suite runner also minus the mutants *outside* the contract's reach (code no checkpointer",
        "call runs, such as the `refckpt verify` tool's: the repository's tests must kill those).",
        "",
        f"- Sample: {meta.get('sample', '?')} mutants per module, uniform, seed {meta.get('seed', '?')} "
        f"(`--full` runs every mutant); the population is every mutant mutmut makes of the module.",
        f"- Runner `suite`: `faults.suite` against refckpt, `{meta.get('suite_args', '')}`.",
        f"- Runner `repo`: the repository's tests of the protocol modules ({', '.join(REPO_TESTS)}), "
        f"default profile{meta.get('repo_scope', '')}.",
        f"- Wall time: {meta.get('wall', '?')}.",
        "",
        "| module | population | suite: killed / counted | suite score | repo: killed / counted | repo score "
        "| either runner: killed / non-equivalent |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    population = meta.get("population", {})
    for module, short in MODULES.items():
        cells = [short, str(population.get(module, "?"))]
        for runner in RUNNERS:
            statuses = results.get(runner, {}).get(module, {}).get("status", {})
            if not statuses:
                cells += ["-", "-"]
                continue
            s = score_for(statuses, notes, runner)
            extra = f"{s['equivalent']} eq." + (f", {s['outside']} outside" if s["outside"] else "")
            cells += [f"{s['killed']} / {s['counted']} ({extra})", f"{s['score']:.0%}"]
        cells.append(_either(results, module, notes))
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "## Survivors", "",
              "Each survivor of either runner, classified in benchmarks/mutation_notes.toml: *equivalent*",
              "(cannot change behaviour, with why), *outside* (the suite cannot reach it, with why; the",
              "repository's tests kill it) or *gap* (with the property or test that now kills it, or",
              "`open` and why).", ""]
    survivors: dict[str, dict[str, str]] = {}
    diffs: dict[str, str] = {}
    for runner in RUNNERS:
        for entry in results.get(runner, {}).values():
            for name, status in entry.get("status", {}).items():
                diffs.setdefault(name, entry.get("diff", {}).get(name, ""))
                survivors.setdefault(name, {})[runner] = status
    rows = {n: v for n, v in survivors.items() if any(s not in KILLED for s in v.values())}
    if not rows:
        lines.append("None.")
    for name in sorted(rows, key=lambda n: (list(MODULES).index(module_of(n)) if module_of(n) in MODULES else 99, n)):
        note = mutant_notes.get(name, {})
        verdicts = ", ".join(f"{r}: {s}" for r, s in sorted(rows[name].items()))
        cls = note.get("class", "unclassified")
        lines.append(f"### `{name}` -- {cls}")
        lines.append("")
        lines.append(f"{verdicts}.")
        lines.append("")
        if diffs.get(name):
            lines += ["```diff", diffs[name], "```", ""]
        if note.get("why"):
            lines.append(f"Why: {note['why']}")
            lines.append("")
        if cls in ("gap", "outside"):
            lines.append(f"Killed by: {note.get('killed_by', 'open')}")
            lines.append("")
        if note.get("by_hand"):
            lines.append(f"Checked by hand: {note['by_hand']}")
            lines.append("")
    if command:
        lines += ["The recorded run, the gate and its floors: docs/mutation.md.", ""]
        return "\n".join(lines)
    floors = notes.get("floors", {})
    lines += ["## Gate", "",
              "`python -m benchmarks.mutation --gate BASE` (the `mutation` workflow, .github/workflows/ci-mutation.yml)",
              "runs the suite runner on the protocol modules a change touches (`git diff BASE`) and fails",
              f"when a module's score is below its floor (default {float(floors.get('default', 0.9)):.0%}; per module in",
              "benchmarks/mutation_notes.toml `[floors.suite]`) or below its score recorded here; a change under",
              "`faults/` (the suite itself) gates every module.", ""]
    demo = notes.get("gate_demo", {})
    if demo:
        lines += [f"Shown failing on a weakened test ({demo.get('date', '?')}): {demo.get('change', '')}", "",
                  "```", demo.get("output", "").strip(), "```", "", demo.get("remark", ""), ""]
    return "\n".join(lines)


def _either(results: dict[str, Any], module: str, notes: dict[str, Any]) -> str:
    """Killed by the suite or the repository's tests (by a runner, or applied by hand with the test
    that fails named in its note), over the sample's non-equivalent mutants that at least one runner
    judged: the project's strength on the module, whoever holds it."""
    by_name: dict[str, list[str]] = {}
    for runner in RUNNERS:
        for name, status in results.get(runner, {}).get(module, {}).get("status", {}).items():
            if status not in ("not checked", "skipped"):
                by_name.setdefault(name, []).append(status)
    if not by_name:
        return "-"
    eq = set(classified(notes, "equivalent"))
    by_hand = {n for n, note in notes.get("mutant", {}).items() if note.get("by_hand")}  # applied by hand: killed
    counted = [n for n, sts in by_name.items() if not (n in eq and not any(st in KILLED for st in sts))]
    killed = [n for n in counted if any(st in KILLED for st in by_name[n]) or n in by_hand]
    return f"{len(killed)} / {len(counted)} ({len(killed) / len(counted):.0%})" if counted else "-"


def _merge(results: dict[str, Any], runner: str, result: dict[str, Any]) -> None:
    results.setdefault(runner, {})
    for module, entry in result["modules"].items():
        results[runner][module] = entry
    meta = results.setdefault("meta", {})
    meta.setdefault("population", {}).update(result["population"])
    meta.setdefault("wall_s", {})[runner] = result["wall_s"]


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.mutation", description=__doc__.split("\n\n")[0])
    p.add_argument("--runner", choices=[*RUNNERS, "both"], default="both")
    p.add_argument("--modules", nargs="+", default=list(MODULES), choices=list(MODULES), metavar="PATH")
    p.add_argument("--sample", type=int, default=DEFAULT_SAMPLE, help="mutants per module (default %(default)s)")
    p.add_argument("--full", action="store_true", help="every mutant of the modules, not a sample")
    p.add_argument("--seed", type=int, default=DEFAULT_SEED)
    p.add_argument("--max-children", type=int, default=1, help="mutants run at once (default 1: 2 cores, shared)")
    p.add_argument("--fresh", action="store_true",
                   help="drop mutmut's cache first (needed after the tests changed: it re-tests only changed functions)")
    p.add_argument("--rerun-survivors", action="store_true",
                   help="run the surviving mutants again (after a test that may kill them was added)")
    p.add_argument("--repo-on-survivors", action="store_true",
                   help="run the repo runner only on the mutants the suite runner left alive")
    p.add_argument("--docs", type=Path, help="write the page here (and docs/mutation.json beside it)")
    p.add_argument("--render", action="store_true", help="only re-render --docs from docs/mutation.json and the notes")
    p.add_argument("--gate", metavar="BASE", help="run the suite runner on the modules changed since BASE and check floors")
    p.add_argument("--only", nargs="+", metavar="MUTANT", help="run only these mutants of the sample")
    p.add_argument("--results", type=Path, default=RESULTS,
                   help="verdicts file (default docs/mutation.json, the recorded run the gate compares with); "
                        "an independent sample keeps its own, with its own --work cache and --docs page")
    p.add_argument("--work", help="mutmut's folder under mutants/ (default the runner's name)")
    p.add_argument("--_child", choices=RUNNERS, help=argparse.SUPPRESS)
    p.add_argument("--_work", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    per_module = None if args.full else args.sample

    if args._child:
        _child(args._child, args.modules, per_module, args.seed, args.max_children, args.only, args._work,
               args.rerun_survivors)
        return 0

    notes = load_notes()
    if args.gate:
        modules = [m for m in changed_modules(args.gate) if m in args.modules]
        if not modules:
            print("mutation gate: no protocol module changed")
            return 0
        print(f"mutation gate: {', '.join(modules)}")
        result = run_runner("suite", modules, per_module, args.seed, args.max_children, fresh=True, work="gate")
        results: dict[str, Any] = {}
        _merge(results, "suite", result)
        recorded = json.loads(RESULTS.read_text()) if RESULTS.exists() else None
        failures = gate(results, notes, modules, recorded=recorded)
        for module in modules:
            s = score_for(results["suite"][module]["status"], notes, "suite")
            print(f"  {module}: {s['killed']}/{s['counted']} = {s['score']:.0%}")
        for f in failures:
            print(f"FAIL {f}")
        return 1 if failures else 0

    results_path: Path = args.results
    independent = results_path.resolve() != RESULTS.resolve()

    def work_of(runner: str) -> str | None:  # mutmut's folder: each runner its own under --runner both
        return f"{args.work}-{runner}" if args.work and args.runner == "both" else args.work
    if args.render:
        results = json.loads(results_path.read_text())
    else:
        runners = RUNNERS if args.runner == "both" else (args.runner,)
        done: dict[str, dict[str, Any]] = {}
        for runner in runners:
            only = args.only
            if runner == "repo" and args.repo_on_survivors:
                before = json.loads(results_path.read_text()) if results_path.exists() else {}
                suite = done["suite"]["modules"] if "suite" in done else before.get("suite", {})
                only = [n for m in args.modules for n, s in suite.get(m, {}).get("status", {}).items()
                        if s not in KILLED]
            done[runner] = run_runner(runner, args.modules, per_module, args.seed, args.max_children, only,
                                      fresh=args.fresh, rerun_survivors=args.rerun_survivors,
                                      work=work_of(runner))
        # read again only now: a run of the other runner may have written its verdicts meanwhile
        results = json.loads(results_path.read_text()) if results_path.exists() else {}
        for runner, result in done.items():
            _merge(results, runner, result)
        meta = results.setdefault("meta", {})
        if independent:  # each runner's command, for the page (the repo runner often runs after the suite's)
            meta["results"] = str(args.results)
            for runner in done:
                how = "--repo-on-survivors" if runner == "repo" and args.repo_on_survivors else \
                    "--fresh" if args.fresh else ""
                meta.setdefault("commands", {})[runner] = " ".join(filter(None, [
                    f"python -m benchmarks.mutation --runner {runner} --seed {args.seed} --sample {args.sample}",
                    f"--work {work_of(runner) or runner}", how, f"--results {args.results} --docs {args.docs}"]))
        meta.update(sample="every" if per_module is None else per_module, seed=args.seed,
                    suite_args=" ".join(_suite_args()),
                    repo_scope=" (only the suite's survivors)" if args.repo_on_survivors else "")
        if args.only is None and set(args.modules) == set(MODULES) and not args.rerun_survivors:
            # the time of a whole run of the sample (a rerun of some mutants does not replace it)
            walls = {r: v for r, v in meta.get("wall_s", {}).items() if r in done}
            whole = meta.setdefault("whole_wall_s", {})
            whole.update(walls)
            meta["wall"] = ", ".join(f"{r} {whole[r] // 60} min {whole[r] % 60} s" for r in RUNNERS if r in whole) + \
                f" for the whole sample, fresh (max-children {args.max_children}, 2 cores shared with the other runner)"
        results_path.write_text(json.dumps(results, indent=1, ensure_ascii=False, sort_keys=True) + "\n")
    if args.docs:
        args.docs.write_text(render(results, notes, independent) + "\n")
    return 0


def _suite_args() -> list[str]:
    with open(ROOT / "pyproject.toml", "rb") as f:
        cfg = tomllib.load(f)["tool"]["mutmut"]
    return [*cfg["pytest_add_cli_args_test_selection"], *cfg["pytest_add_cli_args"][2:]]


if __name__ == "__main__":
    sys.exit(main())
