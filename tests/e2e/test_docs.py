"""docs/ARCHITECTURE.md and the README stay true to the tree: every file path they name exists
(the section on where the code differs from the design card names old paths on purpose), and
every module of the package is named in the architecture notes."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PATH = re.compile(r"\b(?:edgellm|benchmarks|tests|docs)/[A-Za-z0-9_/.-]+\.(?:py|cpp|h|sh|md|yaml|jinja|json)\b")


def _current(doc: Path) -> str:
    text = doc.read_text()
    return text.split("## Where the code differs from the design card")[0]


def test_every_path_the_docs_name_exists():
    missing = {}
    for doc in (ROOT / "docs" / "ARCHITECTURE.md", ROOT / "README.md", ROOT / "pyproject.toml"):
        gone = sorted({p for p in PATH.findall(_current(doc)) if not (ROOT / p).exists()})
        if gone:
            missing[doc.name] = gone
    assert not missing, missing


def test_every_module_is_named_in_the_architecture_notes():
    text = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    unnamed = [str(p.relative_to(ROOT)) for p in sorted((ROOT / "edgellm").rglob("*.py"))
               if p.name != "__init__.py" and p.stem not in text]
    assert not unnamed, unnamed
