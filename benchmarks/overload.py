"""Overload: --factor times more concurrent streamed requests than the server admits
(max_num_seqs + max_waiting_requests), in --waves waves that each start at the same moment.

The excess must get 503 + Retry-After at once (an OpenAI error object; the openai SDK retries it
after Retry-After), memory must stay flat, every admitted request must finish with the answer the
same prompt gets served alone (greedy), and the TTFT of admitted requests must stay bounded: the
queue bound caps the wait at (max_waiting_requests / max_num_seqs) answers' time.

    python benchmarks/overload.py                  # 5 waves of 80 (capacity 4 + 4) against a fresh server
Writes benchmarks/results/overload.json.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections import Counter
from typing import Any

import httpx

from edgellm.bench import reliability as rl
from edgellm.bench.machine import machine_info
from edgellm.bench.reliability_probes import complete_once, stream_chat, wait_idle
from edgellm.bench.reliability_prompts import TOPICS, chat_body
from edgellm.bench.reliability_report import is_openai_error, ms, print_table, write_result
from edgellm.bench.report import percentile


def question(i: int) -> str:
    return f"In one sentence, why visit {TOPICS[i]}?"


async def sample_rss(t: rl.Target, stop: asyncio.Event, out: list[float]) -> None:
    while not stop.is_set():
        rss = t.rss_mb()
        if rss is not None:
            out.append(rss)
        await asyncio.sleep(0.05)


async def overload(args: argparse.Namespace, t: rl.Target) -> dict[str, Any]:
    capacity = t.max_num_seqs + t.max_waiting_requests
    per_wave = capacity * args.factor
    limits = httpx.Limits(max_connections=per_wave + 8, max_keepalive_connections=per_wave + 8)
    async with httpx.AsyncClient(timeout=httpx.Timeout(300.0), limits=limits) as client:
        # references: each question alone (non-streamed, greedy)
        refs: dict[int, str] = {}
        for i in range(args.questions):
            _, data, _ = await complete_once(client, t, chat_body(t.model, question(i), args.max_tokens,
                                                                  stream=False))
            refs[i] = data["choices"][0]["message"]["content"]
        await wait_idle(t)
        await asyncio.sleep(2.0)
        rss_before = t.rss_mb()
        rss: list[float] = []
        stop = asyncio.Event()
        sampler = asyncio.create_task(sample_rss(t, stop, rss))
        results: list[dict[str, Any]] = []
        probes: list[float] = []
        t0 = time.perf_counter()
        for wave in range(args.waves):
            async def one(i: int, wave: int = wave) -> dict[str, Any]:
                q = i % args.questions
                r = await stream_chat(client, t, chat_body(t.model, question(q), args.max_tokens))
                return {"wave": wave, "i": i, "status": r.status, "ttft": r.ttft, "e2e": r.e2e,
                        "headers_at": r.headers_at, "retry_after": r.retry_after, "error": r.error,
                        "correct": r.status == 200 and r.done and r.text == refs[q]}

            async def probe_full(wave: int = wave) -> None:
                # once the burst is sorted, a lone newcomer at the full server: how fast is its 503?
                await asyncio.sleep(0.5)
                while len(probes) < (wave + 1) * 5:
                    m = await asyncio.to_thread(t.metrics)
                    if m.get("edgellm:requests_in_flight", 0) < capacity:
                        break  # no longer full
                    r = await stream_chat(client, t, chat_body(t.model, question(0), args.max_tokens))
                    if r.status == 503:
                        probes.append(r.headers_at or 0.0)

            wave_results, _ = await asyncio.gather(asyncio.gather(*[one(i) for i in range(per_wave)]), probe_full())
            results += wave_results
            await wait_idle(t)
        duration = time.perf_counter() - t0
        await asyncio.sleep(2.0)
        rss_after = t.rss_mb()
        stop.set()
        await sampler
        after = await wait_idle(t)

    statuses = Counter(str(r["status"]) for r in results)
    admitted = [r for r in results if r["status"] == 200]
    rejected = [r for r in results if r["status"] in (429, 503)]
    bad_rejects = [r for r in rejected if not r["retry_after"] or not is_openai_error(r["error"])]
    other_5xx = [r for r in results if r["status"] and r["status"] >= 500 and r["status"] != 503]
    wrong = [r for r in admitted if not r["correct"]]
    ttfts = [r["ttft"] for r in admitted if r["ttft"] is not None]
    reject_lat = [r["headers_at"] for r in rejected if r["headers_at"] is not None]
    rss_peak = max(rss) if rss else None
    fails = []
    if other_5xx or any(r["error"] for r in admitted):
        fails.append(f"{len(other_5xx)} 5xx other than 503; errors in admitted streams")
    if bad_rejects:
        fails.append(f"{len(bad_rejects)} rejections without Retry-After or an OpenAI error object")
    if wrong:
        fails.append(f"{len(wrong)} admitted answers differ from the same prompt served alone")
    if len(admitted) < capacity * args.waves:
        fails.append(f"only {len(admitted)} admitted; capacity is {capacity} per wave")
    if reject_lat and max(reject_lat) > args.max_reject_s:
        fails.append(f"a rejection took {max(reject_lat):.2f} s (limit {args.max_reject_s})")
    if rss_peak is not None and rss_before is not None and rss_peak - rss_before > args.rss_tolerance_mb:
        fails.append(f"RSS peaked {rss_peak - rss_before:.1f} MB over its start")
    if after.get("edgellm:kv_blocks_used", 0) or after.get("edgellm:requests_in_flight", 0):
        fails.append("KV blocks or admission slots still held after the waves")
    return {
        "test": "overload", "result": "fail" if fails else "pass", "failures": fails,
        "capacity": capacity, "concurrent_per_wave": per_wave, "waves": args.waves, "duration_s": round(duration, 1),
        "statuses": dict(statuses), "admitted": len(admitted), "rejected": len(rejected),
        "rejected_with_retry_after": sum(1 for r in rejected if r["retry_after"]),
        "other_5xx": len(other_5xx), "admitted_wrong_output": len(wrong),
        "reject_latency_ms": {"p50": ms(percentile(reject_lat, 50)), "p95": ms(percentile(reject_lat, 95)),
                              "max": ms(max(reject_lat, default=None))},
        "lone_503_at_full_server_ms": {"count": len(probes), "p50": ms(percentile(probes, 50)),
                                       "max": ms(max(probes, default=None))},
        "admitted_ttft_ms": {"p50": ms(percentile(ttfts, 50)), "p95": ms(percentile(ttfts, 95)), "max": ms(max(ttfts, default=None))},
        "admitted_e2e_ms": {"p50": ms(percentile([r["e2e"] for r in admitted], 50)),
                            "p95": ms(percentile([r["e2e"] for r in admitted], 95))},
        "rss_mb": {"before": rss_before, "peak": rss_peak, "after": rss_after,
                   "peak_delta": None if rss_peak is None or rss_before is None else round(rss_peak - rss_before, 1),
                   "after_delta": None if rss_after is None or rss_before is None else round(rss_after - rss_before, 1)},
        "after": {"kv_blocks_held": after.get("edgellm:kv_blocks_used"),
                  "in_flight": after.get("edgellm:requests_in_flight", 0)},
        "server_log": t.log_problems(), "machine": machine_info(),
        "server": {"max_num_seqs": t.max_num_seqs, "max_waiting_requests": t.max_waiting_requests},
        "max_tokens": args.max_tokens,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--factor", type=int, default=10, help="concurrent requests per wave / capacity")
    p.add_argument("--waves", type=int, default=5)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--questions", type=int, default=8, help="distinct prompts (each also served alone first)")
    p.add_argument("--max-reject-s", type=float, default=2.0, help="slowest acceptable 503")
    p.add_argument("--rss-tolerance-mb", type=float, default=64.0)
    rl.add_server_args(p)
    p.set_defaults(max_num_seqs=4, max_waiting_requests=4)
    args = p.parse_args()
    with rl.server(args) as t:
        result = asyncio.run(overload(args, t))
    path = write_result("overload", args, result)
    print_table([("result", result["result"]),
                 ("capacity / concurrent", f"{result['capacity']} / {result['concurrent_per_wave']} x {args.waves}"),
                 ("statuses", result["statuses"]), ("503 with Retry-After", result["rejected_with_retry_after"]),
                 ("503 latency in the burst", result["reject_latency_ms"]),
                 ("503 latency, lone newcomer", result["lone_503_at_full_server_ms"]),
                 ("admitted TTFT p50/p95/max", result["admitted_ttft_ms"]),
                 ("admitted wrong output", result["admitted_wrong_output"]),
                 ("RSS before/peak/after", result["rss_mb"]), ("failures", result["failures"] or "none"),
                 ("json", path)])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
