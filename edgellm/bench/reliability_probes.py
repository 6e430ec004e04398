"""The requests the reliability scripts (benchmarks/abort_storm.py, overload.py, soak.py) send to
a server under test: a streamed chat completion that can hang up after some tokens or seconds
(`stream_chat`, its `StreamResult`), a non-streamed one (`complete_once`), and waiting until the
server's /metrics say it is idle (`wait_idle`).
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from typing import Any

import httpx

from edgellm.bench.client import content_of, sse_events
from edgellm.bench.reliability import Target


@dataclass
class StreamResult:
    status: int | None = None  # None: no response headers before the client hung up
    text: str = ""
    tokens: int = 0  # content events
    ttft: float | None = None
    e2e: float | None = None
    error: dict[str, Any] | None = None  # an error object (HTTP body or an SSE event)
    retry_after: str | None = None
    done: bool = False  # saw data: [DONE]
    finish_reason: str | None = None
    headers_at: float | None = None


async def stream_chat(
    client: httpx.AsyncClient,
    t: Target,
    body: dict[str, Any],
    *,
    stop_after_tokens: int | None = None,
    stop_after_s: float | None = None,
    path: str = "/v1/chat/completions",
) -> StreamResult:
    """Send a streaming request; hang up (close the connection) after `stop_after_tokens` content
    events or `stop_after_s` seconds, whichever comes first; else read to the end."""
    res = StreamResult()
    t0 = time.perf_counter()

    async def run() -> None:
        async with client.stream("POST", t.url + path, json=body, headers=t.headers) as r:
            res.status = r.status_code
            res.headers_at = time.perf_counter() - t0
            res.retry_after = r.headers.get("retry-after")
            if r.status_code != 200:
                raw = await r.aread()
                try:
                    res.error = json.loads(raw)
                except ValueError:
                    res.error = {"unparsed": raw[:200].decode(errors="replace")}
                return
            if stop_after_tokens == 0:
                return  # hang up with the headers in, before any token
            async for event in sse_events(r):
                if not event:
                    res.done = True
                    break
                if "error" in event:
                    res.error = event
                    continue
                for choice in event.get("choices") or []:
                    piece = content_of({"choices": [choice]})
                    if piece:
                        if res.ttft is None:
                            res.ttft = time.perf_counter() - t0
                        res.text += piece
                        res.tokens += 1
                    if choice.get("finish_reason"):
                        res.finish_reason = choice["finish_reason"]
                if stop_after_tokens is not None and res.tokens >= stop_after_tokens:
                    return  # leaving the context closes the connection mid-stream

    try:
        if stop_after_s is not None:
            await asyncio.wait_for(run(), timeout=stop_after_s)
        else:
            await run()
    except asyncio.TimeoutError:
        pass  # hung up on purpose
    res.e2e = time.perf_counter() - t0
    return res


async def complete_once(
    client: httpx.AsyncClient, t: Target, body: dict[str, Any]
) -> tuple[int, Any, float]:
    t0 = time.perf_counter()
    r = await client.post(t.url + "/v1/chat/completions", json=body, headers=t.headers)
    try:
        data = r.json()
    except ValueError:
        data = {"unparsed": r.text[:200]}
    return r.status_code, data, time.perf_counter() - t0


async def wait_idle(t: Target, timeout: float = 60.0) -> dict[str, float]:
    """Poll /metrics until nothing runs, waits or holds KV blocks (or the timeout passes)."""
    deadline = time.monotonic() + timeout
    while True:
        m = await asyncio.to_thread(t.metrics)
        if (
            m.get("vllm:num_requests_running", 0) == 0
            and m.get("vllm:num_requests_waiting", 0) == 0
            and m.get("edgellm:kv_blocks_used", 0) == 0
            and m.get("edgellm:requests_in_flight", 0) == 0
        ):
            return m
        if time.monotonic() > deadline:
            return m
        await asyncio.sleep(0.1)
