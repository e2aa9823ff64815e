"""Library code talks through :mod:`logging` under the ``refckpt`` and ``faults`` loggers; only
command-line entry points write to stdout/stderr.

The source scan reads every module of ``refckpt/``, ``faults/`` and ``faults/suite/`` with
:mod:`ast`; the allow-lists below say which functions produce a command's output and why.
"""

from __future__ import annotations

import ast
import logging
import os
from collections.abc import Iterator

import pytest

from refckpt import DistributedCheckpointer, get_training_state
from refckpt.layout import LATEST_CHECKPOINT_FILE, find_latest_checkpoint

from . import _builders as B

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE_ROOTS = ("refckpt", "faults", "benchmarks")
#: Modules of the command-line interface as a whole (being rewritten elsewhere): their output
#: is the command's output.
CLI_MODULES = {"refckpt/tools/cli.py", "refckpt/tools/example.py", "refckpt/tools/readers.py", "faults/demo.py",
               "benchmarks/cli.py", "benchmarks/measure.py", "benchmarks/swing.py", "benchmarks/scale.py",  # benchmarks: commands
               "benchmarks/retention.py",
               "faults/smoke.py",  # .ci/device-smoke: its output is the summary lines
               "benchmarks/mutation.py",  # `python -m benchmarks.mutation`: its report
               "faults/repro.py"}  # `python -m faults repro` and the reproducer script it writes (run_script is its main)
#: Functions that produce a command's output, by module. Each is a ``main`` or reached only
#: from that module's ``main``; printing anywhere inside one (lambdas included) is allowed.
CLI_FUNCTIONS = {
    "faults/__main__.py": {"main", "_demo"},  # _demo: the demo's transcript
    "faults/killmatrix.py": {"main"},
    "faults/audit.py": {"main", "_log"},  # _log: the audit's progress lines on stderr
    "faults/powerloss.py": {"main"},
    "faults/torchrun_suite.py": {"main"},  # rank 0's report, every rank's usage error or skip
}
#: Modules that still log to the package root "refckpt" instead of ``__name__`` (their records
#: land under "refckpt" all the same); owned by concurrent work, to move to ``__name__``.
LOG_FUNCTIONS = {"debug", "info", "warning", "warn", "error", "exception", "critical", "log", "basicConfig"}


def _modules() -> Iterator[tuple[str, str, ast.Module]]:
    """(path relative to the repository, dotted module name, syntax tree) of every module."""
    for top in PACKAGE_ROOTS:
        for d, _, names in sorted(os.walk(os.path.join(ROOT, top))):
            for name in sorted(names):
                if not name.endswith(".py"):
                    continue
                rel = os.path.relpath(os.path.join(d, name), ROOT).replace(os.sep, "/")
                with open(os.path.join(ROOT, rel), encoding="utf-8") as f:
                    tree = ast.parse(f.read(), filename=rel)
                dotted = rel[:-3].replace("/", ".").removesuffix(".__init__")
                yield rel, dotted, tree


def _calls_with_function(tree: ast.Module) -> Iterator[tuple[ast.Call, str | None]]:
    """Every call in ``tree`` with the outermost function it sits in (None: module level)."""

    def walk(node: ast.AST, outer: str | None) -> Iterator[tuple[ast.Call, str | None]]:
        for child in ast.iter_child_nodes(node):
            inner = outer
            if outer is None and isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                inner = child.name
            if isinstance(child, ast.Call):
                yield child, outer
            yield from walk(child, inner)

    yield from walk(tree, None)


def _dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    return "?"


def _writes_output(call: ast.Call) -> bool:
    name = _dotted(call.func)
    return name == "print" or name in ("sys.stdout.write", "sys.stderr.write")


def test_only_command_line_entry_points_write_output() -> None:
    found = []
    for rel, _dotted_name, tree in _modules():
        if rel in CLI_MODULES:
            continue
        allowed = CLI_FUNCTIONS.get(rel, set())
        for call, function in _calls_with_function(tree):
            if _writes_output(call) and function not in allowed:
                found.append(f"{rel}:{call.lineno} in {function or 'module level'}: {_dotted(call.func)}(...)")
    assert not found, "library code writes output; log through logging.getLogger(__name__) instead:\n" + \
        "\n".join(found)


def test_command_line_allow_list_is_current() -> None:
    """Every allowed function exists, writes output, and is ``main`` or called by ``main``."""
    trees = {rel: tree for rel, _, tree in _modules()}
    for rel, functions in CLI_FUNCTIONS.items():
        defs = {n.name: n for n in trees[rel].body if isinstance(n, ast.FunctionDef)}
        assert "main" in defs, f"{rel}: no main()"
        used_by_main = {_dotted(n).rsplit(".", 1)[-1] for n in ast.walk(defs["main"])
                        if isinstance(n, (ast.Name, ast.Attribute))}
        for function in functions:
            assert function in defs, f"{rel}: {function}() is allow-listed but gone"
            assert function == "main" or function in used_by_main, f"{rel}: main() does not use {function}()"
            assert any(_writes_output(c) for c in ast.walk(defs[function]) if isinstance(c, ast.Call)), \
                f"{rel}: {function}() writes no output; drop it from CLI_FUNCTIONS"


def test_loggers_are_named_after_their_module() -> None:
    found = []
    for rel, dotted, tree in _modules():
        if rel in CLI_MODULES:
            continue
        allowed = {dotted}
        for call, _function in _calls_with_function(tree):
            name = _dotted(call.func)
            if name == "logging.getLogger":
                arg = call.args[0] if call.args else None
                if isinstance(arg, ast.Name) and arg.id == "__name__":
                    continue
                if isinstance(arg, ast.Constant) and arg.value in allowed:
                    continue
                found.append(f"{rel}:{call.lineno}: logging.getLogger({ast.unparse(arg) if arg else ''})")
            elif name.startswith("logging.") and name.split(".", 1)[1] in LOG_FUNCTIONS:
                found.append(f"{rel}:{call.lineno}: {name}() logs to (or configures) the root logger")
    assert not found, "expected log = logging.getLogger(__name__):\n" + "\n".join(found)


def test_module_names_are_under_the_three_loggers() -> None:
    assert {dotted.split(".")[0] for _, dotted, _ in _modules()} == {"refckpt", "faults", "benchmarks"}


# ---------------------------------------------------------------------------------------
# What a user's logging configuration sees
# ---------------------------------------------------------------------------------------


def _refckpt_records(caplog) -> list[tuple[str, int, str]]:
    return [(r.name, r.levelno, r.getMessage()) for r in caplog.records
            if r.name == "refckpt" or r.name.startswith("refckpt.")]


def test_fallback_from_a_corrupt_checkpoint_is_logged_under_refckpt(ckpt, caplog) -> None:
    root, s4, s42 = ckpt
    shard = os.path.join(s42, B.SHARD)
    start, _end = B.item_range(shard, "model.0.weight")
    B.flip_bit(shard, start)
    model, opt = B.make(99, "adamw")
    state = get_training_state(model, opt, {})
    caplog.set_level(logging.WARNING, logger="refckpt")
    with pytest.warns(UserWarning, match="fall back"):
        assert DistributedCheckpointer().load_latest(root, state) == s4
    records = _refckpt_records(caplog)
    assert (logging.WARNING, f"resumed from {s4} after skipping damaged {[s42]}") in [r[1:] for r in records]
    errors = [msg for _, level, msg in records if level == logging.ERROR]
    assert len(errors) == 1 and s42 in errors[0] and "ALL ranks fall back" in errors[0]


def test_refckpt_logger_level_governs_module_loggers(ckpt, caplog) -> None:
    """A stale pointer is noted at INFO by ``refckpt.layout``: shown when the user sets the
    "refckpt" logger to INFO, not at its WARNING."""
    root, _s4, s42 = ckpt
    with open(os.path.join(root, LATEST_CHECKPOINT_FILE), "w") as f:
        f.write("4\n")
    caplog.set_level(logging.WARNING, logger="refckpt")
    assert find_latest_checkpoint(root) == s42
    assert _refckpt_records(caplog) == []
    caplog.set_level(logging.INFO, logger="refckpt")
    assert find_latest_checkpoint(root) == s42
    assert _refckpt_records(caplog) == [
        ("refckpt.layout", logging.INFO, f"pointer {LATEST_CHECKPOINT_FILE} names step 4; newest complete step is 42")
    ]
