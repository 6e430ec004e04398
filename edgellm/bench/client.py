"""The one SSE client of the benchmarks: `sse_events` parses an OpenAI-style stream, `send`
streams one request and times it (TTFT from send to the first non-empty content token, the gap
between content chunks, end to end), `run_load` sends many under an arrival process."""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from edgellm.bench.datasets import BenchRequest


@dataclass
class RequestResult:
    ok: bool
    prompt_len: int
    output_tokens: int = 0
    ttft: float = 0.0  # seconds
    itl: list[float] = field(default_factory=list)  # seconds between content chunks
    e2e: float = 0.0
    error: str = ""
    start: float = 0.0
    text: str = ""  # the content received, joined
    cached_tokens: int | None = (
        None  # usage.prompt_tokens_details.cached_tokens, when the server sends it
    )
    server_timing: dict[str, Any] | None = (
        None  # edgellm_timing of the usage chunk (edgellm serve only)
    )

    @property
    def tpot(self) -> float | None:
        if self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


@dataclass
class Target:
    base_url: str
    model: str
    endpoint: str = "chat"  # chat | completions
    api_key: str | None = None
    ignore_eos: bool = True
    temperature: float = 0.0
    timeout: float = 300.0
    extra_body: dict[str, Any] = field(default_factory=dict)


def _body(target: Target, req: BenchRequest) -> tuple[str, dict[str, Any]]:
    body: dict[str, Any] = {
        "model": target.model,
        "max_tokens": req.output_len,
        "temperature": target.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if target.ignore_eos:
        body["ignore_eos"] = True
    body.update(target.extra_body)
    if target.endpoint == "chat":
        body["messages"] = req.messages or [{"role": "user", "content": req.prompt or ""}]
        return "/v1/chat/completions", body
    body["prompt"] = (
        req.prompt if req.prompt is not None else (req.messages or [{}])[-1].get("content", "")
    )
    return "/v1/completions", body


async def sse_events(resp: httpx.Response) -> AsyncIterator[dict[str, Any]]:
    """The JSON events of an OpenAI-style SSE stream, in order, up to `data: [DONE]` (then an
    empty dict is yielded last, so a caller can tell a finished stream from a cut one)."""
    async for line in resp.aiter_lines():
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            yield {}
            return
        yield json.loads(data)


def content_of(chunk: dict[str, Any]) -> str:
    """The text a streamed chunk carries, or "": chat delta content, a tool call's name and
    argument fragments (a turn that calls a function has begun its output), completion text."""
    for choice in chunk.get("choices") or []:
        delta = choice.get("delta")
        if isinstance(delta, dict) and delta.get("content"):
            return str(delta["content"])
        if isinstance(delta, dict) and delta.get("tool_calls"):
            fns = [call.get("function") or {} for call in delta["tool_calls"]]
            text = "".join((fn.get("name") or "") + (fn.get("arguments") or "") for fn in fns)
            if text:
                return text
        if choice.get("text"):
            return str(choice["text"])
    return ""


async def send(client: httpx.AsyncClient, target: Target, req: BenchRequest) -> RequestResult:
    path, body = _body(target, req)
    headers = {"Authorization": f"Bearer {target.api_key}"} if target.api_key else {}
    result = RequestResult(ok=False, prompt_len=req.prompt_len)
    start = result.start = time.perf_counter()
    last = start
    chunks = 0
    usage_tokens = None
    try:
        async with client.stream(
            "POST",
            target.base_url.rstrip("/") + path,
            json=body,
            headers=headers,
            timeout=target.timeout,
        ) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")[:300]
                result.error = f"HTTP {resp.status_code}: {text}"
                return result
            async for chunk in sse_events(resp):
                if chunk.get("usage"):
                    usage_tokens = chunk["usage"].get("completion_tokens")
                    result.cached_tokens = (chunk["usage"].get("prompt_tokens_details") or {}).get(
                        "cached_tokens"
                    )
                    result.server_timing = chunk.get("edgellm_timing")
                content = content_of(chunk)
                if not content:
                    continue
                result.text += content
                now = time.perf_counter()
                if chunks == 0:
                    result.ttft = now - start
                else:
                    result.itl.append(now - last)
                last = now
                chunks += 1
        result.e2e = time.perf_counter() - start
        result.output_tokens = usage_tokens if usage_tokens is not None else chunks
        result.ok = chunks > 0
        if not result.ok:
            result.error = "no content received"
    except (httpx.HTTPError, json.JSONDecodeError, asyncio.TimeoutError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    return result


def arrival_gaps(n: int, rate: float, burstiness: float, seed: int) -> list[float]:
    """Gaps between request starts: gamma(shape=burstiness, mean=1/rate); burstiness 1 = Poisson."""
    if rate == float("inf") or rate <= 0:
        return [0.0] * n
    rng = random.Random(seed)
    theta = 1.0 / (rate * burstiness)
    return [rng.gammavariate(burstiness, theta) for _ in range(n)]


async def run_load(
    target: Target,
    requests: list[BenchRequest],
    max_concurrency: int | None,
    request_rate: float = float("inf"),
    burstiness: float = 1.0,
    seed: int = 0,
    duration: float | None = None,
    on_done: Callable[[RequestResult], None] | None = None,
) -> tuple[list[RequestResult], float]:
    """Send `requests` under the arrival process; stops at the end or after `duration` seconds."""
    limits = httpx.Limits(max_connections=max(max_concurrency or len(requests), 1) + 4)
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    results: list[RequestResult] = []
    gaps = arrival_gaps(len(requests), request_rate, burstiness, seed)
    async with httpx.AsyncClient(limits=limits, timeout=target.timeout) as client:
        t0 = time.perf_counter()

        async def one(req: BenchRequest) -> None:
            if sem is not None:
                async with sem:
                    res = await send(client, target, req)
            else:
                res = await send(client, target, req)
            results.append(res)
            if on_done:
                on_done(res)

        tasks = []
        for req, gap in zip(requests, gaps):
            if gap:
                await asyncio.sleep(gap)
            if duration is not None and time.perf_counter() - t0 > duration:
                break
            tasks.append(asyncio.create_task(one(req)))
        remaining = None if duration is None else max(0.0, duration - (time.perf_counter() - t0))
        _, pending = await asyncio.wait(tasks, timeout=remaining) if tasks else (set(), set())
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        elapsed = time.perf_counter() - t0
    return results, elapsed


def send_one(target: Target, req: BenchRequest, timeout: float) -> RequestResult | None:
    """One request on its own, outside any measurement (a warm-up or the initial test request);
    None when it got no answer within `timeout` seconds."""
    results, _ = asyncio.run(run_load(target, [req], 1, duration=timeout))
    return results[0] if results else None
