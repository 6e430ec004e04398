"""The results of the reliability scripts (benchmarks/abort_storm.py, overload.py, soak.py):
times in milliseconds, the check that an error body has OpenAI's shape, the JSON file under
benchmarks/results/ and the table printed to stdout.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

from edgellm.bench.results import RESULTS


def ms(x: float | None) -> float | None:
    """Seconds -> milliseconds rounded to 0.1; None for None or NaN (an empty percentile)."""
    return None if x is None or math.isnan(x) else round(x * 1000, 1)


def is_openai_error(body: Any) -> bool:
    """{"error": {"message": non-empty str, "type": str, "param": str|None, "code": str|None}}."""
    if not isinstance(body, dict) or set(body) != {"error"}:
        return False
    err = body["error"]
    return (
        isinstance(err, dict)
        and set(err) == {"message", "type", "param", "code"}
        and isinstance(err["message"], str)
        and bool(err["message"])
        and isinstance(err["type"], str)
        and (err["param"] is None or isinstance(err["param"], str))
        and (err["code"] is None or isinstance(err["code"], str))
    )


def write_result(name: str, args: argparse.Namespace, result: dict[str, Any]) -> Path:
    """Write result as JSON to --json (default benchmarks/results/NAME.json); returns the path."""
    path = Path(args.json) if args.json else RESULTS / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    return path


def print_table(rows: list[tuple[str, Any]]) -> None:
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
