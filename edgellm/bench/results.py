"""Where benchmark results go and how they are written: benchmarks/results/ of the checkout,
one JSON file per run, headed by what was measured, when, and the command that measured it."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"


def header(doc: str | None, script: str) -> dict[str, Any]:
    """{"what": the first line of the script's docstring, "date": local "YYYY-MM-DD HH:MM",
    "command": how the script was called} for the top of a result."""
    return {
        "what": (doc or "").strip().splitlines()[0] if doc else "",
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "command": f"python benchmarks/{Path(script).name} " + " ".join(sys.argv[1:]),
    }


def write_json(path: str | Path, data: dict[str, Any]) -> Path:
    """Write data as indented JSON to path (its folder created), say so on stdout, return it."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=2) + "\n")
    print(f"wrote {out}")
    return out
