"""Summaries of a benchmark run: percentiles, throughput, goodput, table, plot."""

from __future__ import annotations

import math
from typing import Any

from edgellm.bench.client import RequestResult

PERCENTILES = (50, 90, 95, 99)


def percentile(values: list[float], p: float) -> float:
    """The p-th percentile (p in 0..100) of values: linear interpolation between the closest
    ranks, numpy's default ("linear") method, so p50 of [1, 2, 3, 4] is 2.5. NaN when values is
    empty. Every benchmark uses this one, so their percentiles compare."""
    if not values:
        return math.nan
    xs = sorted(values)
    k = (len(xs) - 1) * p / 100
    lo, hi = math.floor(k), math.ceil(k)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def _stats(values_s: list[float]) -> dict[str, float]:
    ms = [v * 1000 for v in values_s]
    out = {"mean": sum(ms) / len(ms) if ms else math.nan}
    out["median"] = percentile(ms, 50)
    for p in PERCENTILES[1:]:
        out[f"p{p}"] = percentile(ms, p)
    return out


def parse_goodput(specs: list[str] | None) -> dict[str, float]:
    """['ttft:200', 'tpot:50'] -> {'ttft': 200.0, 'tpot': 50.0} (milliseconds)."""
    slos: dict[str, float] = {}
    for spec in specs or []:
        for part in spec.split():
            name, _, value = part.partition(":")
            if name not in ("ttft", "tpot", "e2e") or not value:
                raise ValueError(f"bad --goodput {part!r}: use ttft:MS, tpot:MS or e2e:MS")
            slos[name] = float(value)
    return slos


def _meets(r: RequestResult, slos: dict[str, float]) -> bool:
    values = {"ttft": r.ttft, "tpot": r.tpot or 0.0, "e2e": r.e2e}
    return r.ok and all(values[k] * 1000 <= v for k, v in slos.items())


def summarize(
    results: list[RequestResult],
    elapsed: float,
    slos: dict[str, float] | None = None,
    label: str = "",
) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_len for r in ok)
    itl = [x for r in ok for x in r.itl]
    tpot = [t for r in ok if (t := r.tpot) is not None]
    summary: dict[str, Any] = {
        "label": label,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "duration_s": elapsed,
        "request_throughput": len(ok) / elapsed if elapsed else math.nan,
        "output_token_throughput": out_tokens / elapsed if elapsed else math.nan,
        "total_token_throughput": (in_tokens + out_tokens) / elapsed if elapsed else math.nan,
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "ttft_ms": _stats([r.ttft for r in ok]),
        "tpot_ms": _stats(tpot),
        "itl_ms": _stats(itl),
        "e2e_ms": _stats([r.e2e for r in ok]),
        "decode_tokens_per_s_per_stream": (1000 / _stats(tpot)["median"]) if tpot else math.nan,
    }
    if slos:
        good = sum(1 for r in ok if _meets(r, slos))
        summary["goodput"] = {
            "slo_ms": slos,
            "requests": good,
            "request_goodput": good / elapsed if elapsed else math.nan,
        }
    return summary


def format_table(summary: dict[str, Any]) -> str:
    lines = [f"============ edgellm bench {summary['label']} ============"]
    lines.append(f"{'Successful requests:':40s}{summary['completed']:>12d}")
    lines.append(f"{'Failed requests:':40s}{summary['failed']:>12d}")
    lines.append(f"{'Benchmark duration (s):':40s}{summary['duration_s']:>12.2f}")
    lines.append(f"{'Total input tokens:':40s}{summary['total_input_tokens']:>12d}")
    lines.append(f"{'Total generated tokens:':40s}{summary['total_output_tokens']:>12d}")
    lines.append(f"{'Request throughput (req/s):':40s}{summary['request_throughput']:>12.2f}")
    lines.append(
        f"{'Output token throughput (tok/s):':40s}{summary['output_token_throughput']:>12.2f}"
    )
    lines.append(
        f"{'Total token throughput (tok/s):':40s}{summary['total_token_throughput']:>12.2f}"
    )
    if "goodput" in summary:
        g = summary["goodput"]
        lines.append(f"{'Request goodput (req/s):':40s}{g['request_goodput']:>12.2f}")
    for key, title in (
        ("ttft_ms", "Time to First Token"),
        ("tpot_ms", "Time per Output Token (excl. 1st)"),
        ("itl_ms", "Inter-token Latency"),
        ("e2e_ms", "End-to-end Latency"),
    ):
        s = summary[key]
        lines.append(f"{'-' * 12}{title}{'-' * max(1, 40 - len(title))}")
        lines.append(f"{'Mean (ms):':40s}{s['mean']:>12.2f}")
        lines.append(f"{'Median (ms):':40s}{s['median']:>12.2f}")
        for p in PERCENTILES[1:]:
            lines.append(f"{f'P{p} (ms):':40s}{s[f'p{p}']:>12.2f}")
    if summary["errors"]:
        lines.append("errors: " + "; ".join(summary["errors"]))
    lines.append("=" * 52)
    return "\n".join(lines)


def plot(runs: list[tuple[str, list[RequestResult], dict[str, Any]]], path: str) -> None:
    """CDFs of TTFT and ITL per run; throughput vs concurrency when there are several runs."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ncols = 3 if len(runs) > 1 else 2
    fig, axes = plt.subplots(1, ncols, figsize=(5 * ncols, 4))
    for label, results, _ in runs:
        ok = [r for r in results if r.ok]
        for ax, values in (
            (axes[0], [r.ttft * 1000 for r in ok]),
            (axes[1], [x * 1000 for r in ok for x in r.itl]),
        ):
            xs = sorted(values)
            if xs:
                ax.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], label=label)
    axes[0].set(title="TTFT CDF", xlabel="ms", ylabel="fraction")
    axes[1].set(title="Inter-token latency CDF", xlabel="ms", ylabel="fraction")
    for ax in axes[:2]:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    if len(runs) > 1:
        xs = [s.get("concurrency", i) for i, (_, _, s) in enumerate(runs)]
        axes[2].plot(xs, [s["output_token_throughput"] for _, _, s in runs], marker="o")
        axes[2].set(
            title="Output throughput vs concurrency", xlabel="concurrent streams", ylabel="tok/s"
        )
        axes[2].grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
