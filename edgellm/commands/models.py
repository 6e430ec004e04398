"""`edgellm models`: the model registry (models.yaml) as a table, each entry's files checked
(exit 1 when any is missing or bad)."""

from __future__ import annotations

import argparse
from typing import Any


def cmd_models(args: argparse.Namespace) -> int:
    from edgellm.registry import load_registry

    specs = load_registry(args.config, check_files=False)
    if not specs:
        print(f"{args.config}: no models")
        return 0
    rows = [("NAME", "SOURCE", "QUANT", "KV", "MAX LEN", "WARM", "STATUS")]
    bad = 0
    for spec in specs.values():
        try:
            spec.check_files()
            status = "ok"
        except ValueError as exc:
            status = f"error: {exc}"
            bad += 1
        rows.append(
            (
                spec.name,
                spec.source,
                spec.quantization,
                spec.kv_cache_dtype,
                str(spec.max_model_len or "model"),
                str(len(spec.warm_prompts)),
                status,
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    for row in rows:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths)) + "  " + row[-1])
    return 1 if bad else 0


def add_models_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser("models", help="list the model registry (models.yaml)")
    p.add_argument("--config", default="models.yaml")
    p.set_defaults(func=cmd_models)
    return p
