"""Mutation testing of the resilience suite: run ``faults.suite`` against correct checkpointers
(which must pass) and one-bug mutants (each must be failed), in one pytest run, and print
the kill matrix.

    python -m faults killmatrix --correct refckpt:DistributedCheckpointer \\
        --correct tests.independent_ckpt:make --mutants tests.mutants [--full] [-n 2]

``--mutants MODULE`` takes every factory in ``MODULE.MUTANTS`` (name -> factory, each also a
module attribute). By default each mutant stops at its first failing test (``--kill-first``:
:mod:`faults.killfirst`); ``--full`` runs every test against every mutant and prints which tests
kill which mutant.
"""

from __future__ import annotations

import argparse
import importlib
import os
import shlex
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET

from .contract import DEFAULT_CHECKPOINTER
from .killfirst import spec_of

__all__ = ["run", "main"]


def _mutant_specs(module: str) -> list[str]:
    mod = importlib.import_module(module)
    return [f"{module}:{name}" for name in mod.MUTANTS]


def run(correct: list[str], mutants: list[str], *, full: bool = False, workers: int = 2, budget: int = 3,
        world_sizes: str = "2", extra: list[str] | None = None, cwd: str | None = None,
        targets: list[str] | None = None) -> dict:
    """Run the suite once over every checkpointer; return per-spec outcomes and the timing.
    ``targets``: what ``--pyargs`` collects (default the whole suite, ``faults.suite``; or modules
    and test ids such as ``faults.suite.test_contract::test_x[spec]``)."""
    specs = correct + mutants
    with tempfile.TemporaryDirectory() as tmp:
        xml = os.path.join(tmp, "junit.xml")
        cmd = [sys.executable, "-m", "pytest", "--pyargs", *(targets or ["faults.suite"]), "-q", "-p", "no:cacheprovider",
               "-p", "no:randomly", f"--junitxml={xml}", f"--fault-budget={budget}", f"--world-sizes={world_sizes}",
               "--hypothesis-seed=0", "-n", str(workers)]
        if workers > 0:
            cmd += ["--dist", "loadgroup"]
        if not full:
            cmd.append("--kill-first")
        for s in specs:
            cmd.append(f"--checkpointer={s}")
        cmd += extra or []
        t0 = time.monotonic()
        proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True,
                              env={**os.environ, "FAULTS_SUITE_NO_SHRINK": "1"})
        wall = time.monotonic() - t0
        if not os.path.exists(xml):
            raise RuntimeError(f"the suite did not run:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
        tree = ET.parse(xml)
    results: dict[str, dict] = {s: {"passed": [], "failed": [], "skipped": [], "skip_reasons": []} for s in specs}
    for case in tree.iter("testcase"):
        name = case.get("name", "")
        spec = spec_of(name, specs)
        if spec is None:
            continue
        test = f"{case.get('classname', '').rsplit('.', 1)[-1]}::{name.split('[')[0]}"
        if case.find("failure") is not None or case.find("error") is not None:
            results[spec]["failed"].append(test)
        elif (skipped := case.find("skipped")) is not None:
            results[spec]["skipped"].append(test)
            results[spec]["skip_reasons"].append(skipped.get("message", ""))
        else:
            results[spec]["passed"].append(test)
    # pytest's closing line and the suite's per-property counts; not the findings listed per test
    # (``path::test[...]: ...``), whose reasons may say "failed" too
    summary = [line for line in proc.stdout.splitlines()
               if "::" not in line and ("examples" in line or " passed" in line or " failed" in line)]
    return {"specs": specs, "correct": correct, "mutants": mutants, "results": results, "wall_s": wall,
            "returncode": proc.returncode, "summary": summary}


def format_matrix(out: dict) -> str:
    lines = ["| checkpointer | expected | outcome | tests passed / failed | killed by |", "|---|---|---|---|---|"]
    for spec in out["specs"]:
        r = out["results"][spec]
        want = "pass" if spec in out["correct"] else "killed"
        got = "killed" if r["failed"] else ("pass" if r["passed"] else "not run")
        ok = "ok" if got == want else "**WRONG**"
        killers = sorted({t.split("::")[-1] for t in r["failed"]})
        lines.append(f"| `{spec.split(':')[-1] if spec in out['mutants'] else spec}` | {want} | {got} ({ok}) | "
                     f"{len(r['passed'])} / {len(r['failed'])} | {', '.join(killers) or '-'} |")
    return "\n".join(lines)


def verdict(out: dict) -> tuple[bool, list[str]]:
    wrong = []
    for spec in out["specs"]:
        r = out["results"][spec]
        if spec in out["correct"] and (r["failed"] or not r["passed"]):
            wrong.append(f"{spec} should pass the suite: failed {r['failed'] or 'nothing ran'}")
        if spec in out["mutants"] and not r["failed"]:
            wrong.append(f"{spec} survived the suite")
    return not wrong, wrong


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m faults killmatrix", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--correct", action="append", default=[], metavar="MODULE:FACTORY",
                    help=f"a checkpointer that must pass (repeatable; default: {DEFAULT_CHECKPOINTER})")
    ap.add_argument("--mutants", action="append", default=[], metavar="MODULE",
                    help="a module whose MUTANTS dict names factories that must each be killed")
    ap.add_argument("--mutant", action="append", default=[], metavar="MODULE:FACTORY", help="one mutant")
    ap.add_argument("--full", action="store_true", help="run every test against every mutant")
    ap.add_argument("-n", "--workers", type=int, default=2, help="pytest-xdist workers (default 2)")
    ap.add_argument("--fault-budget", type=int, default=3, help="examples per property (default 3)")
    ap.add_argument("--world-sizes", default="2", help="world sizes for multi-rank tests (default 2)")
    ap.add_argument("--docs", metavar="FILE", default=None,
                    help=f"also write the matrix between the markers {BEGIN!r} ... {END!r} of FILE (e.g. docs/faults.md)")
    args = ap.parse_args(argv)
    sys.path.insert(0, os.getcwd())
    correct = args.correct or [DEFAULT_CHECKPOINTER]
    mutants = [s for m in args.mutants for s in _mutant_specs(m)] + args.mutant
    out = run(correct, mutants, full=args.full, workers=args.workers, budget=args.fault_budget,
              world_sizes=args.world_sizes, cwd=os.getcwd())
    print(format_matrix(out))
    for line in out["summary"]:
        print(line)
    ok, wrong = verdict(out)
    killed = sum(1 for s in mutants if out["results"][s]["failed"])
    print(f"{killed}/{len(mutants)} mutants killed, {sum(1 for s in correct if not out['results'][s]['failed'])}/"
          f"{len(correct)} correct checkpointers passed, in {out['wall_s']:.0f} s")
    for w in wrong:
        print("WRONG:", w)
    tally = (f"{killed}/{len(mutants)} mutants killed, {sum(1 for s in correct if not out['results'][s]['failed'])}/"
             f"{len(correct)} correct checkpointers passed, in {out['wall_s']:.0f} s")
    if args.docs:
        command = "python -m faults killmatrix " + " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))
        splice_docs(args.docs, f"{format_matrix(out)}\n\n{tally}\n", command)
    return 0 if ok else 1


BEGIN = "<!-- killmatrix:begin"
END = "<!-- killmatrix:end -->"


def splice_docs(path: str, text: str, command: str) -> None:
    """Replace what lies between the markers of ``path`` (a line starting :data:`BEGIN`, a line
    :data:`END`) with ``text``, stamped with the command and the date; everything else is kept."""
    import datetime
    import re

    with open(path, encoding="utf-8") as f:
        doc = f.read()
    begins = [m.start() for m in re.finditer("^" + re.escape(BEGIN) + ".*$", doc, re.M)]
    ends = [m.start() for m in re.finditer("^" + re.escape(END) + "$", doc, re.M)]
    if len(begins) != 1 or len(ends) != 1 or ends[0] < begins[0]:
        raise SystemExit(f"{path}: expected one line starting {BEGIN!r}, then one line {END!r}")
    head = (f"{BEGIN} generated {datetime.date.today().isoformat()} by `{command}` (suite at its --fault-budget and "
            f"--world-sizes; first kill per mutant unless --full): do not edit by hand, rerun the command -->\n\n")
    new = doc[:begins[0]] + head + text.rstrip("\n") + "\n\n" + doc[ends[0]:]
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(new)
    os.replace(tmp, path)
