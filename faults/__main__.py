"""``python -m faults demo|matrix|campaign|killmatrix|powerloss|audit|repro|torchrun-suite``: a crash mid-save and a
bitwise resume, the fault matrix or a seeded campaign against refckpt, power-loss crash states, the resilience
suite's kill matrix over correct checkpointers and mutants, the audit of any checkpointer, a finding as a standalone
reproducer script, or the checks that kill no rank inside a job torchrun launched."""

from __future__ import annotations

import argparse
import os
import sys


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["killmatrix"]:
        from .killmatrix import main as killmatrix

        return killmatrix(argv[1:])
    if argv[:1] == ["powerloss"]:
        from .powerloss import main as powerloss

        return powerloss(argv[1:])
    if argv[:1] == ["torchrun-suite"]:
        from .torchrun_suite import main as torchrun_suite

        return torchrun_suite(argv[1:])
    if argv[:1] == ["audit"]:
        from .audit import main as audit

        return audit(argv[1:])
    if argv[:1] == ["repro"]:
        from .repro import main as repro

        return repro(argv[1:])
    p = argparse.ArgumentParser(prog="python -m faults", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("matrix", help="run every cell of the fault matrix and print the table of outcomes")
    m.add_argument("--world-sizes", default="1,2,4")
    m.add_argument("--modes", default="sync,async")
    m.add_argument("--kinds", default="", help="comma-separated fault kinds (default: all)")
    m.add_argument("--markdown", help="also write the table (and every cell) to this file")
    m.add_argument("--readme", help="replace the table between the fault-matrix markers of this file (and, "
                   "unless --markdown says where, write every cell to fault-matrix.md beside it)")
    c = sub.add_parser("campaign", help="a seeded random mix of faults in real worlds, with a summary table")
    c.add_argument("--seed", type=int, default=0)
    c.add_argument("--rounds", type=int, default=30)
    c.add_argument("--world-sizes", default="1,2,4")
    d = sub.add_parser("demo", help="SIGKILL a rank in the middle of a save on 2 gloo ranks, then resume bitwise",
                       description=(
        "Train on 2 gloo ranks with checkpoints at steps 2 and 4, SIGKILL rank 1 in the middle of the "
        "save of step 6 (fault point shard.fsync), resume in fresh processes, and check that resume "
        "landed on step 4 with parameters, optimizer moments and extra state bitwise equal to an "
        "uninterrupted run (recomputed from scratch), and that training continued from it stays "
        "bitwise equal. Exit 0: it held; 1: a restored state differs or a world failed; 2: bad --dir."))
    d.add_argument("--dir", help="checkpoint root to keep (a new or empty directory; default: a temp dir, removed)")
    sub.add_parser("powerloss", help="power-loss crash states of a save, resumed for real "
                   "(python -m faults powerloss --help)")
    sub.add_parser("killmatrix", help="the resilience suite against correct checkpointers and mutants "
                   "(python -m faults killmatrix --help)")
    sub.add_parser("torchrun-suite", help="inside a torchrun job: the suite's checks that kill no rank, in the "
                   "job's world (python -m faults torchrun-suite --help)")
    sub.add_parser("audit", help="the resilience suite against each checkpointer (refckpt, dcp, torchtitan, veomni, "
                   "MODULE:FACTORY), with a findings table (python -m faults audit --help)")
    sub.add_parser("repro", help="a finding (NODEID --checkpointer SPEC) as a standalone script, torch and the "
                   "checkpointer only, that exits 1 while the defect is present (python -m faults repro --help)")
    args = p.parse_args(argv)
    if args.cmd == "demo":
        return _demo(args.dir)
    sizes = tuple(int(x) for x in args.world_sizes.split(","))
    if args.cmd == "matrix":
        from .matrix import cells, format_summary, format_table, run_all

        sel = [c for c in cells(sizes, tuple(args.modes.split(",")))
               if not args.kinds or c.kind in args.kinds.split(",")]
        outcomes = run_all(sel, log=lambda s: print(s, file=sys.stderr, flush=True))
        text = format_summary(outcomes)
        print(text)
        markdown = args.markdown
        if args.readme and not markdown:  # the summary's stamp links every cell beside it
            markdown = os.path.join(os.path.dirname(os.path.abspath(args.readme)), "fault-matrix.md")
        if markdown:
            with open(markdown, "w") as f:
                f.write(text + "\n\n<details><summary>every cell</summary>\n\n" + format_table(outcomes) + "\n\n</details>\n")
        if args.readme:
            _splice(args.readme, text)
        return 0 if all(o.ok for o in outcomes) else 1
    from .campaign import run_campaign

    summary = run_campaign(args.seed, args.rounds, sizes, log=lambda s: print(s, file=sys.stderr, flush=True))
    print(summary.table())
    for o in summary.failures:
        print(f"FAIL {o.cell.id}: {o.detail}")
    return 0 if not summary.failures else 1


def _demo(root: str | None) -> int:
    from refckpt.errors import CheckpointError

    from .demo import run_demo
    from .world import WorldError

    try:
        return run_demo(root, say=lambda line: print(line, flush=True))
    except CheckpointError as e:
        print(f"faults demo: error: {e}", file=sys.stderr)
        return 2
    except WorldError as e:
        print(f"faults demo: FAIL: {type(e).__name__}: {e}", file=sys.stderr)
        return 1


BEGIN, END = "<!-- fault-matrix:begin (python -m faults matrix --readme docs/faults.md) -->", "<!-- fault-matrix:end -->"


def _splice(path: str, text: str) -> None:
    import datetime

    with open(path) as f:
        doc = f.read()
    if BEGIN not in doc or END not in doc:
        raise SystemExit(f"{path}: no {BEGIN} ... {END} markers to replace")
    head, rest = doc.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    stamp = (f"Generated {datetime.date.today().isoformat()} on this machine by `python -m faults matrix --readme {path}` "
             "(every cell: [fault-matrix.md](fault-matrix.md)).")
    with open(path, "w") as f:
        f.write(f"{head}{BEGIN}\n{stamp}\n\n{text}\n{END}{tail}")


if __name__ == "__main__":
    raise SystemExit(main())
