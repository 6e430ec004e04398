"""TTFT and decode speed of `edgellm serve` for 1 and 8 concurrent streams (a simple client loop).

Starts the server on a free port (the embedded default model unless --model),
then for each concurrency level runs that many closed-loop streaming clients
(the streaming client of `edgellm bench`). Every request is a voice-agent turn: the same
system prompt (warmed into the prefix cache at start-up), a different user
question, a fixed number of output tokens (ignore_eos). TTFT is measured on
the client, from sending the request to the first content chunk; decode
tokens/s per stream is (tokens - 1) / (last chunk - first chunk).

    python benchmarks/serve_latency.py                      # starts a server, prints a table
    python benchmarks/serve_latency.py --url http://127.0.0.1:8000 --model NAME   # an existing server

Prints a table and writes benchmarks/results/serve_latency.json. No asserts.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path

import httpx

from edgellm import env
from edgellm.bench.client import Target, send
from edgellm.bench.datasets import BenchRequest
from edgellm.bench.machine import machine_info
from edgellm.bench.report import percentile
from edgellm.bench.results import RESULTS, header, write_json
from edgellm.bench.servers import ServerProcess

SYSTEM = ("You are a friendly voice assistant for a travel company. Answer in two or three short spoken "
          "sentences, without lists or markdown.")
QUESTIONS = [
    "What should I pack for a week in Iceland?", "Is Lisbon nice in winter?", "How do I get from Tokyo to Kyoto?",
    "What is a good day trip from Rome?", "When is the best time to visit Peru?", "Can I see the aurora in March?",
    "What is the tipping custom in Japan?", "How long is the flight from Paris to New York?",
    "Which Greek island is quietest?", "Do I need a visa for Canada?", "What food should I try in Seoul?",
    "Is it safe to drive in Scotland?", "What is there to do in Oslo?", "How cold is Prague in January?",
    "Where can I go snorkeling in Europe?", "What is the best way to see Bali?",
]


async def one_request(client: httpx.AsyncClient, target: Target, question: str, max_tokens: int) -> dict:
    """One streamed voice turn: TTFT and decode rate seen by the client, the server's own TTFT and
    cached prompt tokens (from edgellm_timing)."""
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    r = await send(client, target, BenchRequest(messages, None, 0, max_tokens))
    if not r.ok:
        raise RuntimeError(f"request failed: {r.error}")
    decode_s = sum(r.itl)
    timing = r.server_timing or {}
    return {"ttft": r.ttft, "decode_tps": (r.output_tokens - 1) / decode_s if decode_s > 0 else float("nan"),
            "tokens": r.output_tokens, "server_ttft_ms": timing.get("ttft_ms"),
            "cached": timing.get("cached_tokens")}


async def level(url: str, model: str, concurrency: int, per_client: int, max_tokens: int) -> dict:
    """`concurrency` closed-loop clients, `per_client` requests each; the level's summary."""
    target = Target(url, model, "chat", env.api_key(), ignore_eos=True, timeout=600)
    results: list[dict] = []

    async with httpx.AsyncClient(timeout=600) as client:

        async def worker(w: int) -> None:
            for i in range(per_client):
                q = QUESTIONS[(w * per_client + i) % len(QUESTIONS)]
                results.append(await one_request(client, target, q, max_tokens))

        t0 = time.perf_counter()
        await asyncio.gather(*[worker(w) for w in range(concurrency)])
        wall = time.perf_counter() - t0
    ttft = [r["ttft"] * 1000 for r in results]
    tps = [r["decode_tps"] for r in results]
    return {
        "concurrency": concurrency, "requests": len(results), "max_tokens": max_tokens,
        "ttft_p50_ms": percentile(ttft, 50), "ttft_p95_ms": percentile(ttft, 95),
        "server_ttft_p50_ms": percentile([r["server_ttft_ms"] for r in results if r["server_ttft_ms"]], 50),
        "decode_tps_per_stream": statistics.mean(tps),
        "total_tokens_per_s": sum(r["tokens"] for r in results) / wall,
        "mean_cached_prompt_tokens": statistics.mean(r["cached"] or 0 for r in results),
    }


def start_server(args: argparse.Namespace, log_dir: Path) -> tuple[ServerProcess, str]:
    """`edgellm serve` of args.model (default: the embedded model) with SYSTEM warmed, ready;
    returns it and its served name."""
    cfg = log_dir / "models.yaml"
    source = str(Path(args.model).resolve()) if args.model else "default"
    cfg.write_text(f"models:\n  bench:\n    source: {json.dumps(source)}\n"
                   f"    warm_prompts: [{json.dumps(SYSTEM)}]\n")
    server = ServerProcess(["--config", str(cfg), "--model", "bench", "--kv-cache-memory",
                            args.kv_cache_memory], log_dir / "server.log")
    server.wait_ready(300)
    return server, "bench"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default=None, help="an already running server (default: start one)")
    ap.add_argument("--model", default=None, help="served name with --url; a model path otherwise")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--requests-per-client", type=int, default=None,
                    help="default: 8 for one stream, 3 per client above that")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--kv-cache-memory", default="512M")
    ap.add_argument("--out", default=str(RESULTS / "serve_latency.json"))
    args = ap.parse_args()

    server = None
    log_dir = Path(tempfile.mkdtemp())
    if args.url:
        url, model = args.url.rstrip("/"), args.model or "smollm2-135m-instruct"
    else:
        server, model = start_server(args, log_dir)
        url = server.url
    try:
        asyncio.run(level(url, model, 1, 1, 4))  # warm-up
        rows = []
        for c in args.concurrency:
            per = args.requests_per_client or (8 if c == 1 else 3)
            rows.append(asyncio.run(level(url, model, c, per, args.max_tokens)))
    finally:
        if server is not None:
            server.stop()

    machine = machine_info()
    print(f"\nedgellm serve latency: {model} on {machine['cpu']}, {machine['cores']} CPUs, "
          f"{args.max_tokens} output tokens per request\n")
    head = ("streams", "requests", "TTFT p50 ms", "TTFT p95 ms", "server TTFT p50", "decode tok/s/stream",
            "total tok/s", "cached prompt tok")
    print(" | ".join(head))
    print(" | ".join("-" * len(h) for h in head))
    for r in rows:
        print(" | ".join([
            f"{r['concurrency']:>{len(head[0])}}", f"{r['requests']:>{len(head[1])}}",
            f"{r['ttft_p50_ms']:>{len(head[2])}.1f}", f"{r['ttft_p95_ms']:>{len(head[3])}.1f}",
            f"{r['server_ttft_p50_ms']:>{len(head[4])}.1f}", f"{r['decode_tps_per_stream']:>{len(head[5])}.1f}",
            f"{r['total_tokens_per_s']:>{len(head[6])}.1f}", f"{r['mean_cached_prompt_tokens']:>{len(head[7])}.1f}",
        ]))
    write_json(args.out, {**header(__doc__, __file__), "model": model, "machine": machine,
                          "rows": rows})


if __name__ == "__main__":
    main()
