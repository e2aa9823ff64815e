"""Retention and listing on a root with many step directories: O(N), and flat per directory.

A root holding ``N`` leftover step directories (unfinished saves, ``global_step_1`` ..
``global_step_N``) below three complete steps. Per ``N``, in this process, once each:

* ``find_latest_checkpoint(root)`` (valid pointer);
* ``list_root(root)``, what ``refckpt ls ROOT`` runs (the newest :data:`refckpt.tools.readers.LS_LIMIT`
  examined, the rest counted by name), and ``list_root(root, limit=None)`` (``refckpt ls --all``);
* one ``save(keep_last=3)``, whose retention deletes all ``N`` leftovers;
* the file system's own floor for that: ``os.replace`` aside and ``os.rmdir`` of ``N`` empty
  directories, nothing else.

Each row gives the wall time, the time per directory, and the operations counted while it ran
(listings of the root, completeness checks), which is what the tests judge
(``tests/test_retention_readers.py``); the times are for people. The documented command writes
the table into ``docs/retention.md`` between its markers::

    python -m benchmarks.retention --counts 1000,20000 --docs docs/retention.md
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import shutil
import sys
import tempfile
import time
import warnings
from collections.abc import Iterator
from typing import Any

__all__ = ["OpCounts", "count_ops", "build_root", "measure", "table", "write_docs", "main"]

BEGIN = "<!-- retention:begin (python -m benchmarks.retention --docs docs/retention.md) -->"
END = "<!-- retention:end -->"
KEEP_LAST = 3


class OpCounts:
    """Listings of the root and completeness checks made inside :func:`count_ops`."""

    def __init__(self, root: str) -> None:
        self.root = os.path.abspath(root)
        self.listings = 0
        self.checks = 0


@contextlib.contextmanager
def count_ops(root: str) -> Iterator[OpCounts]:
    """Count ``os.listdir`` of ``root`` and calls of ``check_step_dir`` (by the library's own
    modules: layout, commit, readers), calling the real functions."""
    import refckpt.commit
    import refckpt.layout
    import refckpt.tools.readers

    counts = OpCounts(root)
    real_listdir = os.listdir
    real_check = refckpt.layout.check_step_dir

    def listdir(path: Any = ".") -> list[str]:
        if isinstance(path, (str, os.PathLike)) and os.path.abspath(os.fspath(path)) == counts.root:
            counts.listings += 1
        return real_listdir(path)

    def check(path: str, root: str | None = None):
        counts.checks += 1
        return real_check(path, root)

    modules = (refckpt.layout, refckpt.commit, refckpt.tools.readers)
    os.listdir = listdir  # type: ignore[assignment]
    for m in modules:
        m.check_step_dir = check  # type: ignore[attr-defined]
    try:
        yield counts
    finally:
        os.listdir = real_listdir
        for m in modules:
            m.check_step_dir = real_check  # type: ignore[attr-defined]


def _state(step: int) -> dict[str, Any]:
    import torch

    return {"model": {"w": torch.full((4,), float(step))}, "extra_state": {"global_step": step}}


def save(root: str, step: int, keep_last: int | None = None) -> None:
    """One single-process save of a tiny state (DCP's no-process-group warning silenced)."""
    from refckpt import DistributedCheckpointer

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        DistributedCheckpointer(keep_last=keep_last).save(root, _state(step), global_step=step)


def build_root(root: str, leftovers: int) -> int:
    """Three complete steps (``leftovers + 1`` ..), then ``leftovers`` unfinished step directories
    below them (a crash loop, or retention that never ran). Returns the newest step."""
    os.makedirs(root, exist_ok=True)
    for step in range(leftovers + 1, leftovers + 4):
        save(root, step)
    for step in range(1, leftovers + 1):
        os.mkdir(os.path.join(root, f"global_step_{step}"))
    return leftovers + 3


def _timed(root: str, fn) -> tuple[float, OpCounts]:
    with count_ops(root) as ops:
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0, ops


def measure(base: str, n: int) -> dict[str, Any]:
    """The rows for ``n`` leftover step directories (see the module docstring)."""
    from refckpt.layout import find_latest_checkpoint, list_step_dirs
    from refckpt.tools.readers import list_root

    root = os.path.join(base, f"root-{n}")
    newest = build_root(root, n)
    dirs = n + 3
    rows: dict[str, Any] = {"dirs": dirs}
    want = os.path.join(root, f"global_step_{newest}")
    s, ops = _timed(root, lambda: find_latest_checkpoint(root))
    assert find_latest_checkpoint(root) == want
    rows["find_latest"] = (s, ops.listings, ops.checks)
    s, ops = _timed(root, lambda: list_root(root))
    rows["ls"] = (s, ops.listings, ops.checks)
    s, ops = _timed(root, lambda: list_root(root, limit=None))
    rows["ls_all"] = (s, ops.listings, ops.checks)
    s, ops = _timed(root, lambda: save(root, newest + 1, keep_last=KEEP_LAST))
    rows["save"] = (s, ops.listings, ops.checks)
    left = [step for step, _ in list_step_dirs(root)]
    assert left == list(range(newest + 1, newest + 1 - KEEP_LAST, -1)), left
    shutil.rmtree(root)
    rows["floor"] = (_floor(os.path.join(base, f"floor-{n}"), n), 0, 0)
    return rows


def _floor(root: str, n: int) -> float:
    """What the file system alone takes to do what retention does to ``n`` empty step
    directories: rename each aside and remove it (no listing, no check)."""
    os.makedirs(root)
    names = [f"global_step_{i}" for i in range(1, n + 1)]
    for name in names:
        os.mkdir(os.path.join(root, name))
    t0 = time.perf_counter()
    for name in names:
        doomed = os.path.join(root, f".{name}.deleting")
        os.replace(os.path.join(root, name), doomed)
        os.rmdir(doomed)
    s = time.perf_counter() - t0
    os.rmdir(root)
    return s


ROWS = {
    "save": f"one save(keep_last={KEEP_LAST}): retention deletes every leftover",
    "find_latest": "find_latest_checkpoint (valid pointer)",
    "ls": "refckpt ls (list_root: the newest 100 examined)",
    "ls_all": "refckpt ls --all (list_root(limit=None): every one examined)",
    "floor": "file system alone: rename aside + rmdir of as many empty directories",
}


def table(results: dict[int, dict[str, Any]]) -> str:
    lines = ["| operation | step dirs | wall s | µs per dir | root listings | completeness checks |",
             "|---|---:|---:|---:|---:|---:|"]
    for key, what in ROWS.items():
        for n in sorted(results):
            r = results[n]
            s, listings, checks = r[key]
            lines.append(f"| {what} | {r['dirs']:,} | {s:.3f} | {s / r['dirs'] * 1e6:.1f} | {listings} | {checks:,} |")
    return "\n".join(lines)


def _machine() -> str:
    return f"{platform.python_implementation()} {platform.python_version()}, {os.cpu_count()} CPUs, {platform.system()}"


def write_docs(path: str, text: str) -> None:
    """Replace what lies between the markers in ``path`` (the whole generated section)."""
    with open(path, encoding="utf-8") as f:
        doc = f.read()
    if BEGIN not in doc or END not in doc:
        raise SystemExit(f"{path}: no {BEGIN!r} ... {END!r} markers to replace between")
    head, rest = doc.split(BEGIN, 1)
    tail = rest.split(END, 1)[1]
    with open(path, "w", encoding="utf-8") as f:
        f.write(f"{head}{BEGIN}\n{text}\n{END}{tail}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.retention", description=__doc__.split("\n\n")[0])
    p.add_argument("--counts", default="1000,20000", help="leftover step directories per root (default 1000,20000)")
    p.add_argument("--docs", help="write the table into this markdown file, between its markers")
    p.add_argument("--dir", help="where to build the roots (default: a temp dir, removed after)")
    args = p.parse_args(argv)
    counts = [int(c) for c in args.counts.split(",")]
    base = args.dir or tempfile.mkdtemp(prefix="refckpt-retention-")
    try:
        save(os.path.join(base, "warm-up"), 1)  # the first save of a process pays for imports and DCP's setup
        results = {}
        for n in counts:
            results[n] = measure(base, n)
            print(f"{n} leftovers: " + ", ".join(f"{k} {v[0]:.3f} s ({v[0] / results[n]['dirs'] * 1e6:.1f} µs/dir)"
                                                for k, v in results[n].items() if k != "dirs"), file=sys.stderr)
    finally:
        if not args.dir:
            shutil.rmtree(base, ignore_errors=True)
    text = table(results) + f"\n\nMeasured on {_machine()}, warm dentry cache, one run each.\n"
    print(text)
    if args.docs:
        write_docs(args.docs, text)
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
