"""The test tree keeps its shape: test modules live in the folder of the package part they test,
shared code lives in tests/helpers/, and no test module imports another (so no test depends on
which module pytest happened to import first)."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
FOLDERS = {"engine", "models", "kernels", "quant", "server", "tools", "bench", "e2e", "helpers"}


def test_test_modules_live_in_the_package_folders():
    loose = sorted(p.name for p in TESTS.glob("*.py") if p.name not in {"__init__.py", "conftest.py"})
    assert not loose, f"move these into a folder of tests/: {loose}"
    folders = {p.name for p in TESTS.iterdir() if p.is_dir() and not p.name.startswith((".", "__"))}
    assert folders == FOLDERS, folders ^ FOLDERS
    for folder in FOLDERS:
        assert (TESTS / folder / "__init__.py").exists(), folder
    assert not list((TESTS / "helpers").glob("test_*.py")), "helpers hold no tests"


def _imported(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
    return names


def test_tests_import_helpers_never_other_tests():
    offenders = {}
    for path in sorted(TESTS.rglob("*.py")):
        bad = sorted(m for m in _imported(path) if m.startswith("tests.") and not m.startswith("tests.helpers"))
        bad += sorted(m for m in _imported(path) if m.startswith("benchmarks"))
        if bad:
            offenders[str(path.relative_to(TESTS))] = bad
    assert not offenders, offenders
