"""Reading the results of GuideLLM and `edgellm bench` for benchmarks/guidellm_check.py: each
tool's JSON -> the same few metrics (decode time, throughput, TTFT percentiles), their ratios
in a table, and the mean over rounds."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any


def _stat(dist: dict[str, Any], key: str) -> float:
    if key == "mean":
        return float(dist["mean"])
    return float(dist["percentiles"][key])


def parse_guidellm(path: Path) -> dict[str, Any]:
    """The metrics of a GuideLLM benchmarks JSON (its first benchmark), successful requests only."""
    bench = json.loads(path.read_text())["benchmarks"][0]
    m = bench["metrics"]
    ok = {
        name: m[name]["successful"]
        for name in (
            "time_to_first_token_ms",
            "inter_token_latency_ms",
            "time_per_output_token_ms",
            "output_tokens_per_second",
            "request_latency",
            "output_token_count",
            "prompt_token_count",
        )
    }
    totals = m["request_totals"]
    duration = float(bench["duration"])
    out_tokens = float(ok["output_token_count"]["total_sum"])
    return {
        "completed": int(totals["successful"]),
        "errored": int(totals["errored"]),
        "incomplete": int(totals["incomplete"]),
        "duration_s": duration,
        "ttft_p50_ms": _stat(ok["time_to_first_token_ms"], "p50"),
        "ttft_p95_ms": _stat(ok["time_to_first_token_ms"], "p95"),
        "ttft_mean_ms": _stat(ok["time_to_first_token_ms"], "mean"),
        # GuideLLM's ITL = (last - first token) / (n - 1): edgellm bench's TPOT.
        "decode_ms_per_token_mean": _stat(ok["inter_token_latency_ms"], "mean"),
        "decode_ms_per_token_p50": _stat(ok["inter_token_latency_ms"], "p50"),
        # GuideLLM's TPOT includes the first token: (last token - start) / n.
        "guidellm_tpot_incl_ttft_mean_ms": _stat(ok["time_per_output_token_ms"], "mean"),
        "e2e_p50_ms": _stat(ok["request_latency"], "p50") * 1000,
        "output_throughput_tok_s": float(ok["output_tokens_per_second"]["mean"]),
        "output_throughput_from_totals_tok_s": out_tokens / duration if duration else math.nan,
        "output_tokens_total": out_tokens,
        "prompt_tokens_mean": _stat(ok["prompt_token_count"], "mean"),
    }


def parse_edgellm(path: Path) -> dict[str, Any]:
    """The same metrics from an `edgellm bench --json` file (its first run)."""
    run = json.loads(path.read_text())["runs"][0]
    return {
        "completed": int(run["completed"]),
        "errored": int(run["failed"]),
        "incomplete": 0,
        "duration_s": float(run["duration_s"]),
        "ttft_p50_ms": float(run["ttft_ms"]["median"]),
        "ttft_p95_ms": float(run["ttft_ms"]["p95"]),
        "ttft_mean_ms": float(run["ttft_ms"]["mean"]),
        "decode_ms_per_token_mean": float(run["tpot_ms"]["mean"]),
        "decode_ms_per_token_p50": float(run["tpot_ms"]["median"]),
        "itl_mean_ms": float(run["itl_ms"]["mean"]),
        "e2e_p50_ms": float(run["e2e_ms"]["median"]),
        "output_throughput_tok_s": float(run["output_token_throughput"]),
        "output_tokens_total": float(run["total_output_tokens"]),
        "prompt_tokens_mean": run["total_input_tokens"] / max(1, run["completed"]),
        "errors": run.get("errors", []),
    }


ROWS = (
    ("TTFT p50 (ms)", "ttft_p50_ms"),
    ("TTFT p95 (ms)", "ttft_p95_ms"),
    ("TTFT mean (ms)", "ttft_mean_ms"),
    ("decode ms/token mean (ITL | TPOT)", "decode_ms_per_token_mean"),
    ("decode ms/token p50", "decode_ms_per_token_p50"),
    ("E2E latency p50 (ms)", "e2e_p50_ms"),
    ("output throughput (tok/s)", "output_throughput_tok_s"),
    ("completed requests", "completed"),
    ("output tokens", "output_tokens_total"),
)


def compare(g: dict[str, Any], e: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per metric of ROWS: both values and edgellm / GuideLLM."""
    rows = []
    for title, key in ROWS:
        gv, ev = float(g[key]), float(e[key])
        rows.append(
            {
                "metric": title,
                "key": key,
                "guidellm": gv,
                "edgellm_bench": ev,
                "ratio_edgellm_over_guidellm": ev / gv if gv else math.nan,
            }
        )
    return rows


def format_table(rows: list[dict[str, Any]]) -> str:
    """The rows of `compare` as a text table."""
    w = max(len(r["metric"]) for r in rows)
    lines = [
        f"{'metric':<{w}}  {'guidellm':>10}  {'edgellm bench':>13}  {'ratio e/g':>9}",
        f"{'-' * w}  {'-' * 10}  {'-' * 13}  {'-' * 9}",
    ]
    for r in rows:
        lines.append(
            f"{r['metric']:<{w}}  {r['guidellm']:>10.1f}  {r['edgellm_bench']:>13.1f}  "
            f"{r['ratio_edgellm_over_guidellm']:>9.3f}"
        )
    return "\n".join(lines)


def mean_of_rounds(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per-metric mean over rounds (numeric fields only)."""
    out: dict[str, Any] = {}
    for key, value in runs[0].items():
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            out[key] = sum(float(r[key]) for r in runs) / len(runs)
    return out
