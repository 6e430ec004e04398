"""What `benchmarks/gpu_check.py` shares with its tests: `run_section` (one section in its own
try: its status, error text, duration and numbers), `TARGETS` (the GPU path's goals) and
`targets` (each goal next to the number measured), and `summary` (the final printed table)."""

from __future__ import annotations

import math
import time
import traceback
from collections.abc import Callable
from typing import Any

SECTIONS = {
    "a": "kernels: correctness and timing at model shapes",
    "b": "engine end to end: greedy tokens against the CPU fp32 path",
    "c": "edgellm serve of a Phi-3.5-mini-shaped int4 checkpoint",
    "d": "CUDA graphs for decode: tokens against eager, decode tok/s with and without",
}
# (key, what, comparison, goal, unit)
TARGETS = [
    ("w4a16_gemv_speedup", "W4A16 GEMV at batch 1 / fp16 cuBLAS (worst linear)", ">=", 3.0, "x"),
    (
        "decode_attention_hbm_share",
        "paged decode attention / copy bandwidth, longest ctx",
        ">=",
        0.70,
        "",
    ),
    ("ttft_1k_ms", "Phi-3.5-mini int4 TTFT, long prompt (median)", "<", 50.0, "ms"),
    ("ttft_p95_max_streams_ms", "TTFT p95 at the most streams", "<", 200.0, "ms"),
]


def parse_sections(text: str) -> list[str]:
    """'a,b' -> ['a', 'b'] (order kept, duplicates dropped); ValueError on an unknown name."""
    names = [s.strip() for s in text.split(",") if s.strip()]
    unknown = [s for s in names if s not in SECTIONS]
    if unknown or not names:
        raise ValueError(
            f"unknown section(s) {unknown or text!r}: choose from {','.join(SECTIONS)}"
        )
    return list(dict.fromkeys(names))


def run_section(name: str, fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """fn() -> its numbers; returns {"status": "ok", "seconds", **numbers}, or {"status":
    "failed", "error", "seconds"} when it raises (printed; the run goes on). A section may
    itself return status "failed" with an error (a part of it failed, the rest ran)."""
    print(f"== section {name}: {SECTIONS[name]}", flush=True)
    t0 = time.monotonic()
    try:
        result = {"status": "ok", **fn()}
    except Exception as exc:  # noqa: BLE001  (a failing section is a result, not the end)
        traceback.print_exc()
        result = {"status": "failed", "error": f"{type(exc).__name__}: {exc}"}
    result["seconds"] = time.monotonic() - t0
    if result["status"] != "ok":
        print(f"== section {name} FAILED: {result.get('error', '')[:500]}", flush=True)
    return result


def _w4a16_gemv(a: dict[str, Any]) -> float:
    rows = [r for r in a.get("gemm", []) if r["M"] == 1 and r["kernel"] == "w4a16"]
    values = [r["speedup_vs_fp16"] for r in rows if "error" not in r]
    return min(values) if values else math.nan


def _decode_attention(a: dict[str, Any]) -> float:
    rows = [r for r in a.get("attention", []) if r["q_len"] == 1 and "error" not in r]
    copy = a.get("ceilings", {}).get("copy_GBps", math.nan)
    if not rows:
        return math.nan
    longest = max(r["ctx"] for r in rows)
    return min(r["GBps"] for r in rows if r["ctx"] == longest) / copy


def targets(sections: dict[str, dict[str, Any]], judged: bool) -> list[dict[str, Any]]:
    """Each target with the value measured (NaN when its section did not run or failed there)
    and whether it is met (None when not judged: a dry run, or no value)."""
    a, c = sections.get("a", {}), sections.get("c", {})
    streams = c.get("streams", {})
    values = {
        "w4a16_gemv_speedup": _w4a16_gemv(a),
        "decode_attention_hbm_share": _decode_attention(a),
        "ttft_1k_ms": c.get("long_prompt_ttft_ms", {}).get("median", math.nan),
        "ttft_p95_max_streams_ms": (
            streams[max(streams, key=int)]["ttft_p95_ms"] if streams else math.nan
        ),
    }
    out = []
    for key, what, op, goal, unit in TARGETS:
        value = values[key]
        met = None
        if judged and not math.isnan(value):
            met = value >= goal if op == ">=" else value < goal
        out.append(
            {
                "key": key,
                "what": what,
                "target": f"{op} {goal:g}{unit}",
                "value": value,
                "unit": unit,
                "met": met,
            }
        )
    return out


def summary(sections: dict[str, dict[str, Any]], goals: list[dict[str, Any]]) -> list[str]:
    """The final table: each section's status and duration, then each target."""
    lines = [f"{'section':8s} {'status':8s} {'seconds':>8s}  detail"]
    for name, s in sections.items():
        detail = SECTIONS[name] if s["status"] == "ok" else s.get("error", "not selected")[:160]
        lines.append(f"{name:8s} {s['status']:8s} {s.get('seconds', 0.0):8.1f}  {detail}")
    lines.append("")
    lines.append(f"{'target':52s} {'goal':>10s} {'measured':>10s}  met")
    for g in goals:
        met = {True: "yes", False: "NO", None: "-"}[g["met"]]
        lines.append(f"{g['what']:52s} {g['target']:>10s} {g['value']:10.3g}  {met}")
    return lines
