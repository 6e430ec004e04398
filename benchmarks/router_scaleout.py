"""edgellm serve replicas behind a cache-aware router against round-robin, in one run.

Starts --replicas `edgellm serve` processes on 127.0.0.1 (free ports, small KV caches, each with
--threads torch threads), puts a router from PyPI in front (vllm-router or sglang-router, Rust; each
run one router and policy), and drives it with the multi-turn voice workload of
edgellm/bench/conversations.py: --personas distinct --system-len-token system prompts, --callers
callers (each speaking to one persona, --turns turns over the real answers so far, --think-time
seconds between turns), --concurrency callers on the line at once. The replicas are restarted
before every run, so each run starts from cold caches and sees the same requests. Last, one replica
with --reference-factor times the KV memory takes the same workload directly: the hit rate one
cache big enough for every persona reaches.

Per run: the prefix-cache hit rate (prefix cache hits / queries, in tokens, summed over the
replicas' /metrics counters across the run), requests per replica, TTFT p50/p95/p99, output
tokens/s. Then per router: cache-aware hit rate / the reference's (target >= 0.9) and cache-aware
TTFT p95 / round-robin's (target <= 0.5), both from the same run of this script.

    python benchmarks/router_scaleout.py                      # the default runs and the reference
    python benchmarks/router_scaleout.py --runs vllm-router:round_robin,vllm-router:cache_aware

Writes benchmarks/results/router_scaleout.json. No asserts: the numbers are reported as measured.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from importlib import metadata
from pathlib import Path
from typing import Any

from edgellm.bench.client import Target, run_load
from edgellm.bench.conversations import persona_conversations, run_conversations
from edgellm.bench.datasets import random_requests
from edgellm.bench.machine import machine_info
from edgellm.bench.report import summarize
from edgellm.bench.results import header, write_json
from edgellm.bench.servers import Server, free_port, scrape, served_model

RESULTS = Path(__file__).resolve().parent / "results"
ROUTERS = {"vllm-router": ("vllm_router", "warning"), "sglang-router": ("sglang_router", "warn")}
POLICIES = ("round_robin", "cache_aware")
COUNTERS = ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total")


def router_cmd(name: str, policy: str, port: int, workers: list[str]) -> list[str]:
    module, log_level = ROUTERS[name]
    return [sys.executable, "-m", f"{module}.launch_router", "--host", "127.0.0.1", "--port", str(port),
            "--worker-urls", *workers, "--policy", policy, "--prometheus-port", str(free_port()),
            "--log-level", log_level]


def replica_servers(n: int, kv_memory: str, threads: int, log_dir: Path, tag: str) -> list[Server]:
    env = {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    servers = []
    for i in range(n):
        port = free_port()
        cmd = [sys.executable, "-m", "edgellm.cli", "serve", "--port", str(port), "--no-access-log",
               "--kv-cache-memory", kv_memory]
        servers.append(Server(f"{tag}-{i}", cmd, port, log_dir, env))
    return servers


def start_all(servers: list[Server], timeout: float) -> None:
    with ThreadPoolExecutor(len(servers)) as pool:
        list(pool.map(lambda s: s.start(timeout), servers))


def counters(url: str) -> dict[str, float]:
    m = scrape(url)
    out = {k: m.get(k, 0.0) for k in COUNTERS}
    out["requests"] = sum(v for k, v in m.items() if k.startswith("vllm:request_success_total"))
    out["preemptions"] = m.get("vllm:num_preemptions_total", 0.0)
    return out


def warm_up(target: Target, tokenizer: Any) -> None:
    """Two short unrelated turns, not measured: connections, the router's first forwards."""
    asyncio.run(run_load(target, random_requests(tokenizer, 2, 16, 4, 0.0, 12345, True), 1, duration=300))


def drive(target: Target, tokenizer: Any, args: argparse.Namespace) -> tuple[dict[str, Any], list]:
    convs = persona_conversations(tokenizer, args.personas, args.callers, args.turns, args.system_len,
                                  args.user_len, args.output_len, args.seed)
    results, elapsed = asyncio.run(run_conversations(target, convs, args.concurrency, args.think_time,
                                                     duration=args.duration))
    return summarize(results, elapsed, label=target.base_url), results


def measured_run(name: str, url: str, replicas: list[Server], model: str, tokenizer: Any,
                 args: argparse.Namespace) -> dict[str, Any]:
    target = Target(url, model, "chat", None, ignore_eos=True, timeout=600.0)
    warm_up(target, tokenizer)
    before = {s.url: counters(s.url) for s in replicas}
    load0 = os.getloadavg()[0]
    summary, results = drive(target, tokenizer, args)
    after = {s.url: counters(s.url) for s in replicas}
    per = [{"replica": u, **{k: after[u][k] - before[u][k] for k in after[u]}} for u in after]
    queries = sum(p[COUNTERS[0]] for p in per)
    hits = sum(p[COUNTERS[1]] for p in per)
    row = {
        "run": name, "hit_rate": hits / queries if queries else float("nan"),
        "prefix_cache_queries_tokens": queries, "prefix_cache_hits_tokens": hits,
        "requests_per_replica": [p["requests"] for p in per], "preemptions": sum(p["preemptions"] for p in per),
        "client_cached_tokens": sum(r.cached_tokens or 0 for r in results if r.ok),
        "completed": summary["completed"], "failed": summary["failed"], "errors": summary["errors"],
        "turns_sent": len(results), "turns_planned": args.callers * args.turns,
        "ttft_p50_ms": summary["ttft_ms"]["median"], "ttft_p95_ms": summary["ttft_ms"]["p95"],
        "ttft_p99_ms": summary["ttft_ms"]["p99"], "e2e_p50_ms": summary["e2e_ms"]["median"],
        "output_tok_s": summary["output_token_throughput"], "request_s": summary["request_throughput"],
        "decode_tok_s_per_stream": summary["decode_tokens_per_s_per_stream"], "duration_s": summary["duration_s"],
        "load_average_start": load0, "load_average_end": os.getloadavg()[0],
    }
    print(f"{name:28s} hit rate {row['hit_rate']:6.1%}  TTFT p50 {row['ttft_p50_ms']:7.0f} p95 "
          f"{row['ttft_p95_ms']:7.0f} ms  {row['output_tok_s']:6.1f} tok/s  per replica "
          f"{[int(x) for x in row['requests_per_replica']]}  ({row['completed']} ok, {row['failed']} failed, "
          f"load {load0:.1f}->{row['load_average_end']:.1f})", flush=True)
    return row


def ratios(rows: list[dict[str, Any]]) -> dict[str, Any]:
    by = {r["run"]: r for r in rows}
    ref = by.get("reference")
    out: dict[str, Any] = {}
    for router in ROUTERS:
        # round-robin is the same policy whichever router runs it
        rr = by.get(f"{router}:round_robin") or next((r for n, r in by.items() if n.endswith(":round_robin")), None)
        ca = by.get(f"{router}:cache_aware")
        if ca is None:
            continue
        o: dict[str, Any] = {}
        if ref:
            o["hit_rate_vs_reference"] = ca["hit_rate"] / ref["hit_rate"]
            o["hit_rate_target_met"] = o["hit_rate_vs_reference"] >= 0.9
        if rr:
            o["ttft_p95_vs_round_robin"] = ca["ttft_p95_ms"] / rr["ttft_p95_ms"]
            o["ttft_p95_target_met"] = o["ttft_p95_vs_round_robin"] <= 0.5
            o["ttft_p50_vs_round_robin"] = ca["ttft_p50_ms"] / rr["ttft_p50_ms"]
            o["throughput_vs_round_robin"] = ca["output_tok_s"] / rr["output_tok_s"]
        out[router] = o
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", default="vllm-router:round_robin,vllm-router:cache_aware,sglang-router:cache_aware",
                    help="router:policy pairs, comma-separated (routers: vllm-router, sglang-router; policies: "
                         "round_robin, cache_aware)")
    ap.add_argument("--no-reference", dest="reference", action="store_false")
    ap.add_argument("--replicas", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per replica")
    ap.add_argument("--kv-cache-memory", default="120M", help="per replica")
    ap.add_argument("--reference-factor", type=int, default=3, help="KV memory of the reference replica, x")
    ap.add_argument("--personas", type=int, default=6)
    ap.add_argument("--system-len", type=int, default=512)
    ap.add_argument("--user-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=48)
    ap.add_argument("--callers", type=int, default=48)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--concurrency", type=int, default=12)
    ap.add_argument("--think-time", type=float, default=1.0)
    ap.add_argument("--duration", type=float, default=900.0, help="stop a run after this many seconds")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(RESULTS / "router_scaleout.json"))
    args = ap.parse_args()
    from edgellm.loader import default_model_path
    from edgellm.tokenizer import Tokenizer

    runs = [tuple(s.split(":", 1)) for s in args.runs.split(",") if s.strip()]
    for router, policy in runs:
        if router not in ROUTERS or policy not in POLICIES:
            ap.error(f"unknown run {router}:{policy} (routers {list(ROUTERS)}, policies {list(POLICIES)})")
    tokenizer = Tokenizer.load(Path(default_model_path()), "gguf")
    log_dir = Path(tempfile.mkdtemp(prefix="edgellm-router-"))
    machine = machine_info(args.threads)
    cores = os.cpu_count() or 1
    note = (f"{args.replicas} replicas x {args.threads} torch thread(s) on {cores} cores, router and load "
            f"generator on the same cores; shared machine: compare ratios within one run")
    print(note, f"(logs in {log_dir})", flush=True)
    rows: list[dict[str, Any]] = []
    for router, policy in runs:
        replicas = replica_servers(args.replicas, args.kv_cache_memory, args.threads, log_dir, f"{router}-{policy}")
        port = free_port()
        front = Server(f"{router}-{policy}", router_cmd(router, policy, port, [s.url for s in replicas]),
                       port, log_dir)
        try:
            start_all(replicas, 900)
            front.start(120)
            rows.append(measured_run(f"{router}:{policy}", front.url, replicas, served_model(replicas[0].url),
                                     tokenizer, args))
        finally:
            front.stop()
            for s in replicas:
                s.stop()
    if args.reference:
        number, unit = args.kv_cache_memory[:-1], args.kv_cache_memory[-1]
        big = f"{float(number) * args.reference_factor:g}{unit}"
        (ref,) = replica_servers(1, big, args.threads, log_dir, "reference")
        try:
            start_all([ref], 900)
            rows.append(measured_run("reference", ref.url, [ref], served_model(ref.url), tokenizer, args))
            rows[-1]["kv_cache_memory"] = big
        finally:
            ref.stop()
    targets = ratios(rows)
    for router, o in targets.items():
        print(router, {k: round(v, 3) if isinstance(v, float) else v for k, v in o.items()})
    versions = {}
    for dist in ROUTERS:
        try:
            versions[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            versions[dist] = None
    write_json(args.out, {**header(__doc__, __file__), "machine": machine, "note": note,
                          "router_versions": versions,
                          "config": {k: v for k, v in vars(args).items() if k not in ("out",)},
                          "runs": rows, "targets": targets})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
