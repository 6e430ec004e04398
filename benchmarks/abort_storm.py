"""Abort storm: many streamed requests, each cancelled at a random point by closing the connection.

Cancel points, drawn per request:
  before_headers   hang up within a few ms of sending (the server may not have read the body)
  before_token     hang up after the response headers, before the first token
  mid_prefill      a long prompt (~800 tokens, unique so the prefix cache cannot help), hang up
                   part-way through its measured prefill time
  mid_decode       hang up after 1-24 streamed tokens of a 256-token answer

Meanwhile a probe sends a short greedy request every --probe-interval seconds and checks it gets
a 200 with the same answer as before the storm ("the server answers normally throughout").

Afterwards: 0 running, 0 waiting, 0 KV blocks held (blocks kept only by the prefix cache, at
refcount 0, are free), 0 requests in flight, and the server's RSS compared with its RSS after a
warm-up (the first --warmup requests of the storm; the allocator has seen every shape by then).

    python benchmarks/abort_storm.py                       # 10,000 requests against a fresh server
    python benchmarks/abort_storm.py --requests 200        # the CI size
Writes benchmarks/results/abort_storm.json.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time
from collections import Counter
from typing import Any

import httpx

from edgellm.bench import reliability as rl
from edgellm.bench.machine import machine_info
from edgellm.bench.reliability_probes import complete_once, stream_chat, wait_idle
from edgellm.bench.reliability_prompts import TOPICS, WORDS, chat_body
from edgellm.bench.reliability_report import ms, print_table, write_result
from edgellm.bench.report import percentile

MODES = ("before_headers", "before_token", "mid_prefill", "mid_decode")


def long_question(rng: random.Random, n_words: int) -> str:
    return f"[{rng.random():.12f}] Summarize this: " + " ".join(rng.choice(WORDS) for _ in range(n_words))


async def probe_loop(client: httpx.AsyncClient, t: rl.Target, expected: str, interval: float,
                     stop: asyncio.Event, out: list[dict[str, Any]]) -> None:
    body = chat_body(t.model, "What is the capital of France?", 12, stream=False)
    while not stop.is_set():
        try:
            status, data, latency = await complete_once(client, t, body)
            text = data["choices"][0]["message"]["content"] if status == 200 else None
            ttft = data["edgellm_timing"]["ttft_ms"] / 1000 if status == 200 else None
            out.append({"status": status, "ok": status == 200 and text == expected, "latency": latency,
                        "ttft": ttft})
        except httpx.HTTPError as exc:
            out.append({"status": None, "ok": False, "latency": None, "exc": type(exc).__name__})
        try:
            await asyncio.wait_for(stop.wait(), timeout=interval)
        except asyncio.TimeoutError:
            pass


async def one(client: httpx.AsyncClient, t: rl.Target, rng: random.Random, i: int, prefill_s: float,
              long_words: int) -> dict[str, Any]:
    mode = rng.choice(MODES)
    topic = rng.choice(TOPICS)
    if mode == "before_headers":
        res = await stream_chat(client, t, chat_body(t.model, f"Tell me about {topic} ({i}).", 64),
                                stop_after_s=rng.uniform(0.0, 0.01))
    elif mode == "before_token":
        # hang up as soon as the headers are in (they go out before the first token)
        res = await stream_chat(client, t, chat_body(t.model, f"Tell me about {topic} ({i}).", 64),
                                stop_after_tokens=0)
    elif mode == "mid_prefill":
        body = chat_body(t.model, long_question(rng, long_words), 64)
        res = await stream_chat(client, t, body, stop_after_s=rng.uniform(0.1, 0.9) * prefill_s)
    else:
        body = chat_body(t.model, f"Describe a trip to {topic}, day by day ({i}).", 256, ignore_eos=True)
        res = await stream_chat(client, t, body, stop_after_tokens=rng.randint(1, 24))
    # where the hang-up really happened
    if res.status is None:
        actual = "before_headers"
    elif res.status != 200:
        actual = f"http_{res.status}"
    elif res.tokens == 0:
        actual = "mid_prefill" if mode == "mid_prefill" else "before_token"
    else:
        actual = "mid_decode"
    return {"mode": mode, "actual": actual, "status": res.status, "tokens": res.tokens,
            "error": res.error, "completed": res.done}


async def storm(args: argparse.Namespace, t: rl.Target) -> dict[str, Any]:
    rng = random.Random(args.seed)
    limits = httpx.Limits(max_connections=args.concurrency + 4, max_keepalive_connections=4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(120.0), limits=limits) as client:
        # the reference answer, and how long a long prompt takes to prefill here
        body = chat_body(t.model, "What is the capital of France?", 12, stream=False)
        status, data, _ = await complete_once(client, t, body)
        expected = data["choices"][0]["message"]["content"]
        status, data, _ = await complete_once(
            client, t, chat_body(t.model, long_question(rng, args.long_words), 1, stream=False))
        prefill_s = data["edgellm_timing"]["ttft_ms"] / 1000
        m0 = t.metrics()
        rss_start = t.rss_mb()

        probes: list[dict[str, Any]] = []
        stop = asyncio.Event()
        probe = asyncio.create_task(probe_loop(client, t, expected, args.probe_interval, stop, probes))
        results: list[dict[str, Any]] = []
        rss_samples: list[float] = []
        sem = asyncio.Semaphore(args.concurrency)
        t0 = time.perf_counter()
        next_report = t0 + 30

        async def worker(i: int, into: list[dict[str, Any]]) -> None:
            nonlocal next_report
            async with sem:
                into.append(await one(client, t, rng, i, prefill_s, args.long_words))
            if len(into) % 50 == 0 and t.pid:
                rss_samples.append(t.rss_mb() or 0.0)
            if time.perf_counter() > next_report:
                next_report += 30
                print(f"  {len(results)}/{args.requests} requests, {time.perf_counter() - t0:.0f}s", flush=True)

        # warm-up: the same mix, so that the allocator has seen every shape before the baseline
        warm: list[dict[str, Any]] = []
        await asyncio.gather(*[worker(-1 - i, warm) for i in range(args.warmup)])
        await wait_idle(t, 60)
        await asyncio.sleep(2.0)  # the engine hands freed heap back after 1 s idle
        rss_warm = t.rss_mb()
        await asyncio.gather(*[worker(i, results) for i in range(args.requests)])
        duration = time.perf_counter() - t0
        stop.set()
        await probe
        after = await wait_idle(t, 60)
        await asyncio.sleep(2.0)
        rss_end = t.rss_mb()
        # and it still answers, exactly
        status, data, _ = await complete_once(client, t, body)
        final_ok = status == 200 and data["choices"][0]["message"]["content"] == expected

    actual = Counter(r["actual"] for r in results)

    def busy(status: int | None, error: Any) -> bool:
        # the queue bound at work: hung-up requests hold their seats until the server notices (ms), and
        # the next request may arrive first; a 503 + Retry-After is the documented answer, not a failure
        return status == 503 and isinstance(error, dict) and error.get("error", {}).get("code") == "server_overloaded"

    busy_503 = sum(1 for r in results if busy(r["status"], r["error"]))
    five_xx = sum(1 for r in results if r["status"] and r["status"] >= 500 and not busy(r["status"], r["error"]))
    five_xx += sum(1 for p in probes if p["status"] and p["status"] >= 500)
    stream_errors = sum(1 for r in results if r["error"] is not None and not busy(r["status"], r["error"]))
    probe_fail = sum(1 for p in probes if not p["ok"])
    abort_key = f'vllm:request_success_total{{finished_reason="abort",model_name="{t.model}"}}'
    aborts = after.get(abort_key, 0) - m0.get(abort_key, 0)
    leaked = after.get("edgellm:kv_blocks_used", -1)
    rss_delta = None if rss_end is None or rss_warm is None else round(rss_end - rss_warm, 1)
    problems = t.log_problems()
    fails = []
    if leaked != 0:
        fails.append(f"{leaked} KV blocks still held")
    if after.get("vllm:num_requests_running", 0) or after.get("vllm:num_requests_waiting", 0):
        fails.append("requests still running or waiting")
    if after.get("edgellm:requests_in_flight", 0):
        fails.append("admission slots still held")
    if five_xx or stream_errors:
        fails.append(f"{five_xx} 5xx responses, {stream_errors} error events")
    if probe_fail or not final_ok:
        fails.append(f"{probe_fail} probe failures (final ok: {final_ok})")
    if rss_delta is not None and rss_delta > args.rss_tolerance_mb:
        fails.append(f"RSS grew {rss_delta} MB after warm-up (tolerance {args.rss_tolerance_mb})")
    if problems.get("tracebacks") or problems.get("critical_lines"):
        fails.append(f"server log: {problems}")
    return {
        "test": "abort_storm", "result": "fail" if fails else "pass", "failures": fails,
        "requests": args.requests, "concurrency": args.concurrency, "duration_s": round(duration, 1),
        "cancel_points": dict(actual), "completed_before_cancel": sum(r["completed"] for r in results),
        "server_aborts_counted": aborts, "long_prompt_prefill_ms": round(prefill_s * 1000, 1),
        "after": {"running": after.get("vllm:num_requests_running"), "waiting": after.get("vllm:num_requests_waiting"),
                  "kv_blocks_held": leaked, "kv_blocks_total": after.get("edgellm:kv_blocks_total"),
                  "in_flight": after.get("edgellm:requests_in_flight", 0)},
        "rss_mb": {"start": rss_start, "after_warmup": rss_warm, "end": rss_end, "delta_after_warmup": rss_delta,
                   "max_sampled": max(rss_samples) if rss_samples else None,
                   "every_50_requests": [round(x, 1) for x in rss_samples][:: max(1, len(rss_samples) // 100)]},
        "five_xx": five_xx, "error_events": stream_errors, "busy_503": busy_503,
        "probes": {"count": len(probes), "failed": probe_fail,
                   "e2e_p50_ms": ms(percentile([p["latency"] for p in probes if p["latency"]], 50)),
                   "e2e_max_ms": ms(max((p["latency"] for p in probes if p["latency"]), default=None)),
                   "ttft_p50_ms": ms(percentile([p["ttft"] for p in probes if p.get("ttft")], 50)),
                   "ttft_max_ms": ms(max((p["ttft"] for p in probes if p.get("ttft")), default=None))},
        "final_request_ok": final_ok, "server_log": problems, "machine": machine_info(),
        "server": {"max_num_seqs": t.max_num_seqs, "max_waiting_requests": t.max_waiting_requests},
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=10_000)
    p.add_argument("--concurrency", type=int, default=12)
    p.add_argument("--warmup", type=int, default=200, help="storm requests before the RSS baseline (extra)")
    p.add_argument("--long-words", type=int, default=700, help="words in a mid-prefill prompt (~1.1 tokens each)")
    p.add_argument("--probe-interval", type=float, default=2.0)
    p.add_argument("--rss-tolerance-mb", type=float, default=8.0)
    p.add_argument("--seed", type=int, default=0)
    rl.add_server_args(p)
    # room for the probe beside the storm, and prefill in chunks so that a hang-up lands between them
    p.set_defaults(max_num_seqs=16, max_waiting_requests=16, max_num_batched_tokens=256)
    args = p.parse_args()
    with rl.server(args) as t:
        result = asyncio.run(storm(args, t))
    path = write_result("abort_storm", args, result)
    print_table([("result", result["result"]), ("requests", result["requests"]),
                 ("duration", f"{result['duration_s']} s"), ("cancel points", result["cancel_points"]),
                 ("after: running/waiting", f"{result['after']['running']}/{result['after']['waiting']}"),
                 ("after: KV blocks held", result["after"]["kv_blocks_held"]),
                 ("RSS after warm-up -> end", (f"{result['rss_mb']['after_warmup']} -> {result['rss_mb']['end']} MB "
                                               f"(delta {result['rss_mb']['delta_after_warmup']} MB)")),
                 ("5xx / error events", f"{result['five_xx']} / {result['error_events']}"),
                 ("probes ok", f"{result['probes']['count'] - result['probes']['failed']}/{result['probes']['count']}"),
                 ("failures", result["failures"] or "none"), ("json", path)])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
