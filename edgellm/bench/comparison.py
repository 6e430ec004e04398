"""The report of benchmarks/compare_servers.py: a result holds, per server, its levels (one row
per workload and concurrency); `ratios` compares edgellm with each other server, `print_report`
prints the table, `plot` draws TTFT CDFs, throughput and per-stream decode speed."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any


def _fmt(x: Any, spec: str = ".1f") -> str:
    return (
        "n/a" if x is None or (isinstance(x, float) and not math.isfinite(x)) else format(x, spec)
    )


def level_row(report: dict[str, Any], server: str, workload: str, c: int) -> dict[str, Any] | None:
    """The row of `server` for `workload` at concurrency c in a report (None when it has none)."""
    entry = report["servers"].get(server) or {}
    for row in entry.get("levels", []):
        if row["workload"] == workload and row["concurrency"] == c:
            return row
    return None


def ratios(report: dict[str, Any], levels: list[int]) -> dict[str, list[dict[str, Any]]]:
    """edgellm / other for throughputs (>1: edgellm faster); other / edgellm for TTFT (>1: edgellm
    sooner)."""
    out: dict[str, list[dict[str, Any]]] = {}
    for other in ("hf", "llama-server"):
        rows = []
        for c in levels:
            e, o = level_row(report, "edgellm", "random", c), level_row(report, other, "random", c)
            if not e or not o:
                continue

            def div(a: float, b: float) -> float:
                return a / b if b and math.isfinite(a) and math.isfinite(b) else math.nan

            rows.append(
                {
                    "concurrency": c,
                    "output_tok_s_x": div(e["output_tok_s"], o["output_tok_s"]),
                    "decode_per_stream_x": div(
                        e["decode_tok_s_per_stream"], o["decode_tok_s_per_stream"]
                    ),
                    "ttft_p50_speedup_x": div(o["ttft_p50_ms"], e["ttft_p50_ms"]),
                    "ttft_p95_speedup_x": div(o["ttft_p95_ms"], e["ttft_p95_ms"]),
                }
            )
        if rows:
            out[f"edgellm_vs_{other}"] = rows
    return out


def print_report(report: dict[str, Any]) -> None:
    m = report["machine"]
    print(
        f"\n{m['cpu']}, {m['cores']} cores, {m['threads']} threads, torch {m['torch']}, {m['date']}"
    )
    if m.get("busy"):
        print(
            f"warning: busy machine (load average {m['load_average_start']:.1f} at start): "
            "numbers distorted"
        )
    s = report["settings"]
    print(
        f"random workload: {s['input_len']} prompt tokens, {s['output_len']} output tokens "
        "(ignore_eos), "
        f"greedy, chat endpoint\n"
    )
    head = [
        "server",
        "workload",
        "streams",
        "ok/sent",
        "TTFT p50 ms",
        "TTFT p95 ms",
        "decode tok/s/stream",
        "output tok/s",
    ]
    rows = []
    for name, entry in report["servers"].items():
        if entry.get("status") != "ok":
            rows.append([name, "-", "-", "-", entry.get("status", "?"), "", "", ""])
            continue
        for r in entry["levels"]:
            rows.append(
                [
                    name,
                    r["workload"],
                    str(r["concurrency"]),
                    f"{r['completed']}/{r['requests']}",
                    _fmt(r["ttft_p50_ms"]),
                    _fmt(r["ttft_p95_ms"]),
                    _fmt(r["decode_tok_s_per_stream"]),
                    _fmt(r["output_tok_s"]),
                ]
            )
    widths = [
        max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(head)
    ]
    print(" | ".join(h.rjust(w) for h, w in zip(head, widths)))
    print("-+-".join("-" * w for w in widths))
    for r in rows:
        print(" | ".join(v.rjust(w) for v, w in zip(r, widths)))
    for name, entry in report["servers"].items():
        if entry.get("status") != "ok":
            print(f"\n{name}: {entry.get('status')}: {entry.get('reason', '')}")
    for key, rows_ in report["ratios"].items():
        print(f"\n{key.replace('_', ' ')} (>1: edgellm better)")
        print(" streams | output tok/s x | decode/stream x | TTFT p50 speedup | TTFT p95 speedup")
        for r in rows_:
            print(
                f" {r['concurrency']:>7} | {_fmt(r['output_tok_s_x'], '.2f'):>14} | "
                f"{_fmt(r['decode_per_stream_x'], '.2f'):>15} | "
                f"{_fmt(r['ttft_p50_speedup_x'], '.2f'):>16} | "
                f"{_fmt(r['ttft_p95_speedup_x'], '.2f'):>16}"
            )
    rl = report.get("roofline") or {}
    if rl.get("bytes_per_token"):
        print(
            f"\ndecode roofline: read bandwidth {_fmt(rl['read_GBps'])} GB/s / "
            f"{rl['bytes_per_token'] / 1e6:.1f} MB of weights per token ({rl['weights']['dtype']}, "
            f"cpu kernels {rl['weights']['cpu_kernels']}) = {_fmt(rl['roofline_tok_s'])} tok/s; "
            f"edgellm single stream {_fmt(rl.get('edgellm_single_stream_tok_s'))} tok/s = "
            f"{_fmt(100 * rl.get('fraction', math.nan))}% of it"
        )
    elif rl.get("error"):
        print(f"\ndecode roofline: not computed ({rl['error']})")


def plot(report: dict[str, Any], path: Path, cdf_level: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    for name, entry in report["servers"].items():
        if entry.get("status") != "ok":
            continue
        row = level_row(report, name, "random", cdf_level)
        if row and row["ttft_samples_ms"]:
            xs = row["ttft_samples_ms"]
            axes[0].step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post", label=name)
        rows = [r for r in entry["levels"] if r["workload"] == "random"]
        cs = [r["concurrency"] for r in rows]
        axes[1].plot(cs, [r["output_tok_s"] for r in rows], marker="o", label=name)
        axes[2].plot(cs, [r["decode_tok_s_per_stream"] for r in rows], marker="o", label=name)
    rl = report.get("roofline") or {}
    if rl.get("roofline_tok_s"):
        axes[2].axhline(
            rl["roofline_tok_s"], color="gray", ls="--", lw=1, label="edgellm weights roofline"
        )
    axes[0].set(title=f"TTFT CDF at {cdf_level} concurrent streams", xlabel="ms", ylabel="fraction")
    axes[0].set_xscale("log")
    axes[1].set(title="Total output throughput", xlabel="concurrent streams", ylabel="tok/s")
    axes[2].set(
        title="Decode speed per stream (1 / median TPOT)",
        xlabel="concurrent streams",
        ylabel="tok/s",
    )
    levels = report["settings"]["levels"]
    for ax in axes[1:]:
        ax.set_xscale("log", base=2)
        ax.set_xticks(levels, [str(c) for c in levels])
        ax.set_ylim(bottom=0)
    axes[0].set_ylim(0, 1.02)
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    m = report["machine"]
    fig.suptitle(
        f"SmolLM2-135M-Instruct Q4_1 on {m['cpu']} ({m['threads']} threads), {m['date'][:10]}",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# -------------------------------------------------------------------------- main
