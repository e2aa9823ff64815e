"""The layering the folder listing promises (docs/design.md, "Layout"), enforced on the source.

* ``refckpt/`` is the library: nothing under it imports the fault harness (``faults``), the
  benchmarks, the tests, or a test-only package, at module level or inside a function.
* The library core (everything in ``refckpt/`` outside ``refckpt/tools/`` and the ``python -m
  refckpt`` entry point) does not import the user tools: tools depend on the core, never the reverse.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
LIBRARY = ROOT / "refckpt"
NOT_FROM_THE_LIBRARY = ("faults", "benchmarks", "tests", "pytest", "hypothesis", "xdist", "_pytest")


def imported_modules(path: pathlib.Path) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in ``path``, relative ones resolved."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = ".".join(path.relative_to(ROOT).with_suffix("").parts[:-1])
    if path.name == "__init__.py":
        package = ".".join(path.relative_to(ROOT).parts[:-1])
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            found.append((node.lineno, mod))
            found += [(node.lineno, f"{mod}.{a.name}") for a in node.names]
    return found


def library_files() -> list[pathlib.Path]:
    files = sorted(LIBRARY.rglob("*.py"))
    assert len(files) > 15, f"expected the library under {LIBRARY}"
    return files


@pytest.mark.parametrize("path", library_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_the_library_imports_no_harness(path):
    bad = [(line, mod) for line, mod in imported_modules(path)
           if mod.split(".")[0] in NOT_FROM_THE_LIBRARY]
    assert not bad, f"{path.relative_to(ROOT)} imports {bad}: the library must stand alone (pip install refckpt)"


@pytest.mark.parametrize("path", [p for p in library_files()
                                  if "tools" not in p.relative_to(LIBRARY).parts and p.name != "__main__.py"],
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_the_core_does_not_import_the_tools(path):
    bad = [(line, mod) for line, mod in imported_modules(path) if mod.startswith("refckpt.tools")]
    assert not bad, f"{path.relative_to(ROOT)} imports {bad}: the tools sit on the core, not under it"


def test_the_scan_sees_relative_and_nested_imports(tmp_path):
    """The scanner is not blind: a function-level ``from faults.x import y`` and a relative import
    that climbs out of the package are both reported."""
    pkg = tmp_path / "refckpt" / "tools"
    pkg.mkdir(parents=True)
    f = pkg / "m.py"
    f.write_text("def g():\n    from faults.world import World\n    from ..checkpointer import X\n    import hypothesis\n")
    global ROOT
    old, ROOT = ROOT, tmp_path
    try:
        mods = [m for _, m in imported_modules(f)]
    finally:
        ROOT = old
    assert "faults.world" in mods and "refckpt.checkpointer" in mods and "hypothesis" in mods
