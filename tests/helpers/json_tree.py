"""Reading the JSON a benchmark script wrote."""

from __future__ import annotations

from typing import Any


def numbers(tree: Any) -> list[float]:
    """Every number in a JSON tree (bools excluded)."""
    if isinstance(tree, dict):
        return [x for v in tree.values() for x in numbers(v)]
    if isinstance(tree, list):
        return [x for v in tree for x in numbers(v)]
    return [tree] if isinstance(tree, (int, float)) and not isinstance(tree, bool) else []
