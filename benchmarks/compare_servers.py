"""edgellm serve side by side with the alternatives, in one run on this machine.

Starts each server in turn on the embedded default model (SmolLM2-135M-Instruct,
Q4_1 GGUF), one at a time so they never share the CPU, and drives each with
`edgellm bench`'s load generator (the same requests, streamed over the same
OpenAI API) at fixed concurrencies:

  - edgellm     `python -m edgellm.cli serve` (continuous batching, paged KV cache);
  - hf          benchmarks/hf_baseline_server.py: transformers generate() with static
                batching (fp32 on CPU, the GGUF dequantized at load);
  - llama-server  llama.cpp's C++ server on the same GGUF file (continuous batching,
                16 slots), when a binary is found at $EDGELLM_LLAMA_SERVER or
                ~/.cache/edgellm/llama.cpp/build/bin/llama-server; skipped otherwise.

Per server and concurrency: TTFT p50/p95, decode tokens/s per stream (1 / median
TPOT), total output tokens/s; then edgellm's ratios to each alternative. Also the
decode roofline: this machine's memory read bandwidth (best of a few large torch
sums) over the weight bytes one decode step reads in the model as edgellm loads it,
and edgellm's single-stream fraction of it.

    python benchmarks/compare_servers.py                       # concurrency 1,4,16, random 128 in / 64 out
    python benchmarks/compare_servers.py --voice               # plus the voice workload at 8 streams
    python benchmarks/compare_servers.py --servers edgellm,hf --concurrency 1,4
    python benchmarks/compare_servers.py --quick               # a short smoke run

Writes benchmarks/results/compare_servers.json and .png (--quick: compare_servers_quick.*).
Every server start and every benchmark level is bounded in time; servers are always
stopped. No asserts: the numbers are reported as measured.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from edgellm.bench.comparison import level_row, plot, print_report, ratios
from edgellm.bench.llama_cpp import LLAMA_DEFAULT, find_llama_server, llama_flags
from edgellm.bench.machine import machine_info, read_bandwidth
from edgellm.bench.roofline import edgellm_roofline_bytes
from edgellm.bench.servers import Server, free_port, served_model

ROOT = Path(__file__).resolve().parent.parent
RESULTS = Path(__file__).resolve().parent / "results"
SERVERS = ("edgellm", "hf", "llama-server")


def build_servers(args: argparse.Namespace, log_dir: Path, gguf: Path) -> tuple[list[Server], dict[str, str]]:
    """The servers to run, and why any asked-for one is skipped."""
    wanted = [s.strip() for s in args.servers.split(",") if s.strip()]
    for name in wanted:
        if name not in SERVERS:
            raise SystemExit(f"unknown server {name!r}: choose from {', '.join(SERVERS)}")
    servers, skipped = [], {}
    py = sys.executable
    threads = str(args.threads)
    torch_env = {"OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads}
    if "edgellm" in wanted:
        port = free_port()
        source = ["--model", str(gguf)] if args.model else ["--config", str(ROOT / "models.yaml")]
        cmd = [py, "-m", "edgellm.cli", "serve", *source, "--host", "127.0.0.1",
               "--port", str(port), "--no-access-log", *args.edgellm_arg]
        servers.append(Server("edgellm", cmd, port, log_dir, torch_env, cwd=ROOT))
    if "hf" in wanted:
        port = free_port()
        cmd = [py, str(Path(__file__).parent / "hf_baseline_server.py"), "--model", str(gguf), "--port", str(port),
               "--max-batch-size", str(args.hf_max_batch_size), "--batch-window-ms", str(args.hf_batch_window_ms),
               "--threads", threads]
        servers.append(Server("hf", cmd, port, log_dir, torch_env, cwd=ROOT))
    if "llama-server" in wanted:
        binary = find_llama_server(args.llama_server)
        if binary is None:
            skipped["llama-server"] = (
                f"no llama-server binary (looked at --llama-server, $EDGELLM_LLAMA_SERVER and {LLAMA_DEFAULT}); "
                "build it from the llama.cpp vendored in the llama-cpp-python sdist to include it")
        else:
            port = free_port()
            slots = max(16, max(args.levels))
            per_slot = args.context_per_request
            ctx = max(4096, slots * per_slot)
            flags = llama_flags(binary)
            cmd = [str(binary), "-m", str(gguf), "-c", str(ctx), "-np", str(slots), "-t", threads,
                   "--port", str(port), "--host", "127.0.0.1"]
            if "--cont-batching" in flags:
                cmd.append("--cont-batching")
            if "--jinja" in flags:
                cmd.append("--jinja")  # the GGUF's own chat template, as the other servers use
            if "--threads-batch" in flags:
                cmd += ["--threads-batch", threads]
            server = Server("llama-server", cmd, port, log_dir, cwd=ROOT)
            if "--no-repack" in flags:
                # Some VMs list AMX in /proc/cpuinfo without letting a process use its tiles; ggml's
                # AMX matmul (reached through weight repacking) then faults at the first graph.
                # ggml has no repacked layout for Q4_1 besides AMX's, so with repacking off the
                # linears run the AVX2/AVX-512 kernels llama.cpp uses on CPUs without AMX.
                server.fallback = ([*cmd, "--no-repack"], "retrying with --no-repack (no AMX repacked weights)")
            servers.append(server)
    return servers, skipped


# -------------------------------------------------------------------------- bench
def bench_server(server: Server, tokenizer: Any, args: argparse.Namespace) -> dict[str, Any]:
    """Warm up, then one run per concurrency level (plus the voice workload with --voice)."""
    from edgellm.bench.client import Target, run_load, send_one
    from edgellm.bench.datasets import random_requests, voice_requests_warmed
    from edgellm.bench.report import summarize

    model = served_model(server.url)
    target = Target(server.url, model, "chat", None, ignore_eos=True, timeout=args.request_timeout)
    warm = random_requests(tokenizer, 2, 16, 4, 0.0, 12345, True)
    asyncio.run(run_load(target, warm, 1, duration=args.bench_timeout))
    levels: list[dict[str, Any]] = []
    runs = [("random", c) for c in args.levels] + ([("voice", args.voice_concurrency)] if args.voice else [])
    for workload, c in runs:
        n = max(args.min_prompts, args.prompts_per_stream * c)
        if workload == "voice":
            # one turn first, not measured: the system prompt is then in whatever prompt cache
            # the server keeps, as for a deployed agent (llama-server: in one slot of its 16)
            first, reqs = voice_requests_warmed(tokenizer, n, 512, 32, 64, args.seed)
            send_one(target, first, args.bench_timeout)
        else:
            reqs = random_requests(tokenizer, n, args.input_len, args.output_len, 0.0, args.seed, True)
        t = time.perf_counter()
        results, elapsed = asyncio.run(run_load(target, reqs, c, duration=args.bench_timeout))
        s = summarize(results, elapsed, label=f"{server.name} {workload} c={c}")
        row = {
            "workload": workload, "concurrency": c, "requests": n, "completed": s["completed"],
            "failed": s["failed"] + (n - len(results)), "errors": s["errors"], "duration_s": s["duration_s"],
            "ttft_p50_ms": s["ttft_ms"]["median"], "ttft_p95_ms": s["ttft_ms"]["p95"],
            "tpot_median_ms": s["tpot_ms"]["median"],
            "decode_tok_s_per_stream": s["decode_tokens_per_s_per_stream"],
            "output_tok_s": s["output_token_throughput"], "itl_p95_ms": s["itl_ms"]["p95"],
            "ttft_samples_ms": sorted(r.ttft * 1000 for r in results if r.ok),
        }
        levels.append(row)
        print(f"  {server.name:>12} {workload:>6} c={c:<3} {row['completed']}/{n} ok  "
              f"TTFT p50 {row['ttft_p50_ms']:8.1f} ms  p95 {row['ttft_p95_ms']:8.1f} ms  "
              f"decode {row['decode_tok_s_per_stream']:6.1f} tok/s/stream  total {row['output_tok_s']:7.1f} tok/s  "
              f"({time.perf_counter() - t:.0f}s)", flush=True)
    return {"model": model, "levels": levels}


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None,
                    help="a GGUF file served by every server (default: the embedded default model)")
    ap.add_argument("--servers", default=",".join(SERVERS), help="comma-separated subset of " + ", ".join(SERVERS))
    ap.add_argument("--concurrency", default="1,4,16", help="comma-separated concurrency levels")
    ap.add_argument("--prompts-per-stream", type=int, default=3, help="requests per level = this x concurrency")
    ap.add_argument("--min-prompts", type=int, default=8, help="at least this many requests per level")
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--voice", action="store_true",
                    help="also the voice workload (512-token shared system prompt, 32-token user turn, 64 out)")
    ap.add_argument("--voice-concurrency", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="CPU threads for every server")
    ap.add_argument("--start-timeout", type=float, default=600.0, help="seconds for a server to become ready")
    ap.add_argument("--bench-timeout", type=float, default=900.0, help="seconds per benchmark level")
    ap.add_argument("--request-timeout", type=float, default=600.0)
    ap.add_argument("--hf-max-batch-size", type=int, default=16)
    ap.add_argument("--hf-batch-window-ms", type=float, default=20.0)
    ap.add_argument("--llama-server", default=None, help="llama-server binary (default: $EDGELLM_LLAMA_SERVER, "
                                                         "then ~/.cache/edgellm/llama.cpp/build/bin)")
    ap.add_argument("--edgellm-arg", action="append", default=[],
                    help="extra argument for `edgellm serve` (repeatable), e.g. --edgellm-arg=--max-num-seqs=32")
    ap.add_argument("--no-roofline", dest="roofline", action="store_false")
    ap.add_argument("--quick", action="store_true",
                    help="smoke run: concurrency 1,4, 64 in / 16 out, 2 requests per stream; *_quick outputs")
    ap.add_argument("--out", default=None, help="JSON path (default: benchmarks/results/compare_servers.json)")
    args = ap.parse_args()
    if args.quick:
        args.concurrency = "1,4" if args.concurrency == "1,4,16" else args.concurrency
        args.prompts_per_stream, args.min_prompts = 2, 3
        args.input_len, args.output_len = 64, 16
        args.bench_timeout = min(args.bench_timeout, 300.0)
    args.levels = sorted({int(x) for x in args.concurrency.split(",") if x.strip()})
    # context per llama-server slot: prompt (+ chat template) + output, with headroom
    need = (512 + 32 + 64 if args.voice else 0, args.input_len + args.output_len)
    args.context_per_request = 1 << math.ceil(math.log2(max(need) + 96))
    default_name = "compare_servers_quick" if args.quick else "compare_servers"
    args.out = Path(args.out) if args.out else RESULTS / f"{default_name}.json"
    return args


def main() -> int:
    args = parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from edgellm.loader import default_model_path
    from edgellm.tokenizer import Tokenizer

    gguf = Path(args.model) if args.model else Path(default_model_path())
    tokenizer = Tokenizer.load(gguf, "gguf")
    if tokenizer is None:
        raise SystemExit(f"{gguf}: no tokenizer")
    info = machine_info(args.threads)
    print(f"{info['cpu']}, {info['cores']} cores, torch {info['torch']}, load average {info['load_average_start']:.1f}")
    cores = info["cores"] or 1
    info["busy"] = bool(info["load_average_start"] and info["load_average_start"] > 0.5 * cores)
    if info["busy"]:
        print(f"warning: this machine is busy (load average {info['load_average_start']:.1f} on {cores} cores). "
              "Multi-threaded matmuls stall when their threads are descheduled, so every number below "
              "is distorted; rerun on an idle machine for figures worth quoting.")
    bandwidth = read_bandwidth(args.threads) if args.roofline else math.nan
    if args.roofline:
        print(f"memory read bandwidth: {bandwidth:.1f} GB/s (best of 5 sums over 512 MiB, {args.threads} threads)")

    log_dir = Path(tempfile.mkdtemp(prefix="compare_servers_"))
    servers, skipped = build_servers(args, log_dir, gguf)
    report: dict[str, Any] = {
        "machine": info,
        "model": {"gguf": gguf.name, "path": str(gguf)},
        "settings": {"levels": args.levels, "input_len": args.input_len, "output_len": args.output_len,
                     "prompts_per_stream": args.prompts_per_stream, "min_prompts": args.min_prompts,
                     "voice": args.voice, "voice_concurrency": args.voice_concurrency, "quick": args.quick,
                     "hf_max_batch_size": args.hf_max_batch_size, "hf_batch_window_ms": args.hf_batch_window_ms,
                     "endpoint": "chat", "temperature": 0.0, "ignore_eos": True},
        "servers": {},
    }
    for name, why in skipped.items():
        print(f"skipping {name}: {why}")
        report["servers"][name] = {"status": "skipped", "reason": why}

    edgellm_kernels = None
    for server in servers:
        print(f"\n== {server.name}: {' '.join(server.cmd)}", flush=True)
        entry: dict[str, Any] = {"command": server.cmd}
        try:
            note = server.start_or_fallback(args.start_timeout)
            if note:
                entry["note"] = note
                entry["command"] = server.cmd
            print(f"  ready in {server.load_s:.0f}s", flush=True)
            entry.update(bench_server(server, tokenizer, args))
            entry["status"] = "ok"
            entry["load_s"] = server.load_s
            entry["load_average_before_start"] = server.load_average_before
        except (RuntimeError, httpx.HTTPError, OSError) as exc:
            entry.update(status="failed", reason=str(exc)[-2000:])
            print(f"  {server.name} failed: {str(exc)[-1500:]}", flush=True)
        finally:
            server.stop()
        if server.name == "edgellm":
            found = re.search(r"cpu kernels (\w+)", server.log_tail(10**6))
            edgellm_kernels = found.group(1) if found else None
            entry["cpu_kernels"] = edgellm_kernels
        report["servers"][server.name] = entry
    info["load_average_end"] = os.getloadavg()[0] if hasattr(os, "getloadavg") else None

    report["ratios"] = ratios(report, args.levels)
    if args.roofline:
        rl: dict[str, Any] = {"read_GBps": bandwidth}
        try:
            weights = edgellm_roofline_bytes(edgellm_kernels, Path(args.model) if args.model else None)
            rl.update(weights=weights, bytes_per_token=weights["total"],
                      roofline_tok_s=bandwidth * 1e9 / weights["total"])
            single = level_row(report, "edgellm", "random", 1)
            if single:
                rl["edgellm_single_stream_tok_s"] = single["decode_tok_s_per_stream"]
                rl["fraction"] = single["decode_tok_s_per_stream"] / rl["roofline_tok_s"]
        except Exception as exc:  # noqa: BLE001  (the serving numbers stand without it)
            rl["error"] = f"{type(exc).__name__}: {exc}"
        report["roofline"] = rl

    print_report(report)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2, default=str))
    png = args.out.with_suffix(".png")
    cdf_level = 4 if 4 in args.levels else args.levels[len(args.levels) // 2]
    plot(report, png, cdf_level)
    print(f"\nwrote {args.out} and {png}")
    failed = [name for name, e in report["servers"].items() if e.get("status") == "failed"]
    if failed:
        print(f"failed: {', '.join(failed)}; server logs kept in {log_dir}")
        return 1
    shutil.rmtree(log_dir, ignore_errors=True)
    return 0

if __name__ == "__main__":
    sys.exit(main())
