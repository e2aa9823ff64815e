"""The layering the folder listing promises (docs/design.md, "Layout"), enforced on the source.

* ``refckpt/`` is the library: nothing under it imports the fault harness (``faults``), the
  benchmarks, the tests, or a test-only package, at module level or inside a function.
* The library core (everything in ``refckpt/`` outside ``refckpt/tools/`` and the ``python -m
  refckpt`` entry point) does not import the user tools: tools depend on the core, never the reverse.
* ``import faults`` (the pytest plugin's package) imports no torch; its public names load lazily.
"""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

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


def test_import_faults_is_cheap_and_every_public_name_resolves():
    """``import faults`` -- which loading the pytest plugin does in every pytest run where refckpt is
    installed -- imports neither torch nor any module of the harness, and neither does the plugin
    itself; then every name of ``faults.__all__`` resolves (PEP 562) to its module's own object."""
    code = """
import importlib, sys
import faults
assert "torch" not in sys.modules, "import faults imported torch"
assert not [m for m in sys.modules if m.startswith("faults.")], sorted(m for m in sys.modules if m.startswith("faults."))
import faults.plugin
assert "torch" not in sys.modules, "import faults.plugin imported torch"
assert len(faults.__all__) == len(set(faults.__all__)) and set(faults.__all__) == set(faults._MODULE_OF), "two lists"
for name in faults.__all__:
    module = importlib.import_module("faults." + faults._MODULE_OF[name])
    assert getattr(faults, name) is getattr(module, name), name
    assert name in dir(faults), name
try:
    faults.no_such_name
except AttributeError as e:
    assert "no_such_name" in str(e)
else:
    raise AssertionError("faults.no_such_name resolved")
print("ok", len(faults.__all__))
"""
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith("ok ")
