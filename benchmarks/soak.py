"""Soak: mixed traffic at saturation for --duration seconds.

--concurrency closed-loop clients (default max_num_seqs + 2: the batch is always full and a
couple wait) send a mix of voice-agent requests: greedy chat (streamed, not streamed, with
logprobs, with sentence chunking), greedy completions (one with a ~500-token prompt), seeded
sampling (chat, and n=2), and barge-ins (a greedy stream cut after a few tokens). Every
request's text is checked against the same request served alone before the soak started
(greedy and seeded answers must not depend on what else is in the batch; a barge-in must have
received a prefix of its answer). Every 5 s: the server's RSS, KV blocks held, running/waiting.

Pass: no error response or error event, no mismatch, KV blocks back to 0 at the end, and RSS
flat (after the first 20% of the run, the end is within --rss-tolerance-mb of the start).

    python benchmarks/soak.py                      # 30 minutes against a fresh server
    python benchmarks/soak.py --duration 120       # the CI size
Writes benchmarks/results/soak.json.
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
from edgellm.bench.reliability_probes import stream_chat, wait_idle
from edgellm.bench.reliability_prompts import SYSTEM, TOPICS, WORDS
from edgellm.bench.reliability_report import ms, print_table, write_result
from edgellm.bench.report import percentile

QUESTIONS = [f"What is one thing to see in {t}?" for t in TOPICS[:8]]  # --questions of them are used
COMPLETIONS = ["The three best things about trains are", "Once upon a time, in a small harbor town,",
               "A good packing list for a rainy week:",
               "Notes: " + " ".join(WORDS[i % len(WORDS)] for i in range(0, 7 * 430, 7)) + "\nSummary:"]
SEEDED = [(QUESTIONS[i], 100 + i) for i in range(4)]
KINDS = ["chat_stream", "chat", "chat_logprobs", "chat_sentences", "completion_stream", "completion",
         "seeded_chat", "seeded_n2", "barge_in"]


def chat(model: str, q: str, max_tokens: int, **kw: Any) -> dict[str, Any]:
    return {"model": model, "max_tokens": max_tokens, "temperature": 0,
            "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}], **kw}


async def post(client: httpx.AsyncClient, t: rl.Target, path: str, body: dict[str, Any]) -> tuple[int, Any]:
    r = await client.post(t.url + path, json=body, headers=t.headers)
    try:
        return r.status_code, r.json()
    except ValueError:
        return r.status_code, {"unparsed": r.text[:200]}


async def references(client: httpx.AsyncClient, t: rl.Target, n: int) -> dict[Any, Any]:
    refs: dict[Any, Any] = {}
    for q in QUESTIONS:  # (main() trims the lists to --questions)
        _, d = await post(client, t, "/v1/chat/completions", chat(t.model, q, n))
        refs[("chat", q)] = d["choices"][0]["message"]["content"]
    for p in COMPLETIONS:
        _, d = await post(client, t, "/v1/completions", {"model": t.model, "prompt": p, "max_tokens": n,
                                                          "temperature": 0})
        refs[("completion", p)] = d["choices"][0]["text"]
    for q, seed in SEEDED:
        _, d = await post(client, t, "/v1/chat/completions", chat(t.model, q, n, temperature=0.8, seed=seed))
        refs[("seeded", q, seed)] = d["choices"][0]["message"]["content"]
    for q, seed in SEEDED[:2]:  # n=2 runs as seeds seed and seed+1
        if ("seeded", q, seed + 1) not in refs:
            _, d = await post(client, t, "/v1/chat/completions", chat(t.model, q, n, temperature=0.8, seed=seed + 1))
            refs[("seeded", q, seed + 1)] = d["choices"][0]["message"]["content"]
    return refs


async def one(client: httpx.AsyncClient, t: rl.Target, rng: random.Random, refs: dict[Any, Any], n: int,
              kind: str) -> dict[str, Any]:
    q = rng.choice(QUESTIONS)
    out: dict[str, Any] = {"kind": kind, "ok": False, "status": None, "error": None}
    t0 = time.perf_counter()
    if kind in ("chat_stream", "chat_sentences", "barge_in"):
        extra: dict[str, Any] = {"stream": True}
        if kind == "chat_sentences":
            extra["stream_options"] = {"chunking": "sentence"}
        cut = rng.randint(1, 8) if kind == "barge_in" else None
        r = await stream_chat(client, t, chat(t.model, q, n, **extra), stop_after_tokens=cut)
        out.update(status=r.status, error=r.error, ttft=r.ttft)
        want = refs[("chat", q)]
        out["ok"] = r.status == 200 and r.error is None and (
            want.startswith(r.text) if kind == "barge_in" else (r.done and r.text == want))
    elif kind in ("chat", "chat_logprobs"):
        extra = {"logprobs": True, "top_logprobs": 2} if kind == "chat_logprobs" else {}
        status, d = await post(client, t, "/v1/chat/completions", chat(t.model, q, n, **extra))
        out.update(status=status, error=d.get("error"))
        out["ok"] = status == 200 and d["choices"][0]["message"]["content"] == refs[("chat", q)]
        if status == 200:
            out["ttft"] = d["edgellm_timing"]["ttft_ms"] / 1000
    elif kind in ("completion_stream", "completion"):
        p = rng.choice(COMPLETIONS)
        body = {"model": t.model, "prompt": p, "max_tokens": n, "temperature": 0}
        if kind == "completion_stream":
            r = await stream_chat(client, t, {**body, "stream": True}, path="/v1/completions")
            out.update(status=r.status, error=r.error, ttft=r.ttft)
            out["ok"] = r.status == 200 and r.done and r.error is None and r.text == refs[("completion", p)]
        else:
            status, d = await post(client, t, "/v1/completions", body)
            out.update(status=status, error=d.get("error"))
            out["ok"] = status == 200 and d["choices"][0]["text"] == refs[("completion", p)]
    else:
        q, seed = rng.choice(SEEDED[:2] if kind == "seeded_n2" else SEEDED)
        extra = {"temperature": 0.8, "seed": seed, **({"n": 2} if kind == "seeded_n2" else {})}
        status, d = await post(client, t, "/v1/chat/completions", chat(t.model, q, n, **extra))
        out.update(status=status, error=d.get("error"))
        if status == 200:
            texts = [c["message"]["content"] for c in sorted(d["choices"], key=lambda c: c["index"])]
            out["ok"] = texts == [refs[("seeded", q, seed + j)] for j in range(len(texts))]
    out["e2e"] = time.perf_counter() - t0
    return out


async def soak(args: argparse.Namespace, t: rl.Target) -> dict[str, Any]:
    rng = random.Random(args.seed)
    conc = args.concurrency or t.max_num_seqs + 2  # clients; sequences in flight are capped below
    limits = httpx.Limits(max_connections=conc + 4, max_keepalive_connections=conc + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(300.0), limits=limits) as client:
        refs = await references(client, t, args.max_tokens)
        await wait_idle(t)
        await asyncio.sleep(2.0)
        rss_start = t.rss_mb()
        samples: list[dict[str, Any]] = []
        results: list[dict[str, Any]] = []
        t0 = time.perf_counter()
        deadline = t0 + args.duration

        # Saturation without overload: the clients hold at most `seqs` sequences at once (n=2 holds
        # two), below the server's capacity by a margin for barge-ins whose seats are still being freed.
        seqs = min(t.max_num_seqs + 2, max(1, t.max_num_seqs + t.max_waiting_requests - 2))
        free = [seqs]
        cond = asyncio.Condition()

        async def client_loop() -> None:
            while time.perf_counter() < deadline:
                kind = rng.choice(KINDS)
                need = 2 if kind == "seeded_n2" else 1
                async with cond:
                    await cond.wait_for(lambda need=need: free[0] >= need)
                    free[0] -= need
                try:
                    results.append(await one(client, t, rng, refs, args.max_tokens, kind))
                except (httpx.HTTPError, KeyError, ValueError) as exc:
                    results.append({"kind": kind, "ok": False, "status": None, "error": repr(exc)})
                finally:
                    async with cond:
                        free[0] += need
                        cond.notify_all()

        async def sampler() -> None:
            while time.perf_counter() < deadline:
                m = await asyncio.to_thread(t.metrics)
                samples.append({"t": round(time.perf_counter() - t0, 1), "rss_mb": t.rss_mb(),
                                "kv_blocks_held": m.get("edgellm:kv_blocks_used"),
                                "running": m.get("vllm:num_requests_running"),
                                "waiting": m.get("vllm:num_requests_waiting")})
                await asyncio.sleep(5.0)

        await asyncio.gather(sampler(), *[client_loop() for _ in range(conc)])
        duration = time.perf_counter() - t0
        after = await wait_idle(t)
        await asyncio.sleep(2.0)
        rss_end = t.rss_mb()

    errors = [r for r in results if r["status"] != 200 or r["error"] is not None]
    mismatches = [r for r in results if r["status"] == 200 and r["error"] is None and not r["ok"]]
    steady = [s for s in samples if s["t"] >= 0.2 * args.duration]
    rss_steady = [s["rss_mb"] for s in steady if s["rss_mb"] is not None]
    kv_steady = [s["kv_blocks_held"] for s in steady if s["kv_blocks_held"] is not None]
    half = len(kv_steady) // 2
    slope = None
    if len(rss_steady) >= 3:
        xs = [s["t"] / 60 for s in steady if s["rss_mb"] is not None]
        mx, my = sum(xs) / len(xs), sum(rss_steady) / len(rss_steady)
        den = sum((x - mx) ** 2 for x in xs)
        slope = round(sum((x - mx) * (y - my) for x, y in zip(xs, rss_steady)) / den, 2) if den else None
    rss_warm = rss_steady[0] if rss_steady else None
    fails = []
    if errors:
        fails.append(f"{len(errors)} error responses/events")
    if mismatches:
        fails.append(f"{len(mismatches)} answers differ from the same request served alone "
                     f"({dict(Counter(r['kind'] for r in mismatches))})")
    if after.get("edgellm:kv_blocks_used", 0):
        fails.append(f"{after.get('edgellm:kv_blocks_used')} KV blocks held after the soak")
    if rss_end is not None and rss_start is not None and rss_end - rss_start > args.rss_tolerance_mb:
        fails.append(f"RSS grew {rss_end - rss_start:.1f} MB over the soak (tolerance {args.rss_tolerance_mb})")
    ttfts = [r["ttft"] for r in results if r.get("ttft")]
    return {
        "test": "soak", "result": "fail" if fails else "pass", "failures": fails,
        "duration_s": round(duration, 1), "concurrency": conc, "requests": len(results),
        "by_kind": dict(Counter(r["kind"] for r in results)), "errors": len(errors),
        "error_examples": [str(r["error"])[:200] for r in errors[:5]],
        "mismatches": len(mismatches), "mismatch_kinds": dict(Counter(r["kind"] for r in mismatches)),
        "ttft_ms": {"p50": ms(percentile(ttfts, 50)), "p95": ms(percentile(ttfts, 95))},
        "rss_mb": {"start": rss_start, "steady_first": rss_warm, "steady_max": max(rss_steady, default=None),
                   "end_idle": rss_end, "delta_end_vs_start": None if rss_end is None or rss_start is None
                   else round(rss_end - rss_start, 1), "steady_slope_mb_per_min": slope},
        "kv_blocks_held": {"steady_mean_first_half": round(sum(kv_steady[:half]) / half, 1) if half else None,
                           "steady_mean_second_half": round(sum(kv_steady[half:]) / (len(kv_steady) - half), 1)
                           if len(kv_steady) > half else None, "after": after.get("edgellm:kv_blocks_used"),
                           "total": after.get("edgellm:kv_blocks_total")},
        "samples": samples, "server_log": t.log_problems(), "machine": machine_info(),
        "server": {"max_num_seqs": t.max_num_seqs, "max_waiting_requests": t.max_waiting_requests},
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--duration", type=float, default=1800.0, help="seconds")
    p.add_argument("--concurrency", type=int, default=None, help="default: max_num_seqs + 2")
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--rss-tolerance-mb", type=float, default=16.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--questions", type=int, default=8, help="distinct chat prompts (each served alone first)")
    rl.add_server_args(p)
    args = p.parse_args()
    del QUESTIONS[args.questions:]
    SEEDED[:] = [(q, s) for q, s in SEEDED if q in QUESTIONS]
    if args.questions < 4:
        del COMPLETIONS[1:3]  # keep a short one and the long one
    with rl.server(args) as t:
        result = asyncio.run(soak(args, t))
    path = write_result("soak", args, result)
    print_table([("result", result["result"]), ("duration", f"{result['duration_s']} s"),
                 ("requests", f"{result['requests']} {result['by_kind']}"),
                 ("errors / mismatches", f"{result['errors']} / {result['mismatches']}"),
                 ("TTFT p50/p95", result["ttft_ms"]), ("RSS", {k: v for k, v in result["rss_mb"].items()}),
                 ("KV blocks held", result["kv_blocks_held"]), ("failures", result["failures"] or "none"),
                 ("json", path)])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
