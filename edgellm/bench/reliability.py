"""Shared pieces of the reliability scripts (benchmarks/abort_storm.py, overload.py, soak.py).

Each script either starts `edgellm serve` itself (the embedded default model, with the knobs
below) or drives an existing server (--base-url; pass --pid to have its memory measured).
Figures go to stdout and to a JSON file under benchmarks/results/. No asserts: each result
carries "result": "pass" | "fail" and the reasons, and the CI tests read those.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from edgellm.bench.client import content_of, sse_events
from edgellm.bench.results import RESULTS
from edgellm.bench.servers import ServerProcess, rss_bytes, scrape

MODEL = "reliability"
SYSTEM = (
    "You are a friendly voice assistant for a travel company. Answer in two or three short spoken "
    "sentences, without lists or markdown."
)
TOPICS = [
    "Iceland",
    "Lisbon",
    "Kyoto",
    "Rome",
    "Peru",
    "the aurora",
    "Japan",
    "New York",
    "Greek islands",
    "Canada",
    "Seoul",
    "Scotland",
    "Oslo",
    "Prague",
    "snorkeling",
    "Bali",
    "Cairo",
    "Patagonia",
    "Vienna",
    "Hanoi",
    "Marrakesh",
    "Sydney",
    "Lapland",
    "Havana",
]
WORDS = [
    "river",
    "mountain",
    "coffee",
    "window",
    "lantern",
    "harbor",
    "garden",
    "violin",
    "market",
    "winter",
    "summer",
    "rocket",
    "pencil",
    "forest",
    "desert",
    "island",
    "bridge",
    "castle",
    "meadow",
    "thunder",
    "silver",
    "copper",
    "velvet",
    "marble",
    "candle",
    "ladder",
    "anchor",
    "falcon",
    "orchard",
    "glacier",
    "canyon",
    "prairie",
    "compass",
    "meteor",
    "saddle",
    "tunnel",
    "beacon",
]


def add_server_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("server")
    g.add_argument("--base-url", default=None, help="an existing server (default: start one)")
    g.add_argument("--model", default=MODEL, help="served model name on an existing server")
    g.add_argument(
        "--pid", type=int, default=None, help="the existing server's pid, to read its RSS"
    )
    g.add_argument("--max-num-seqs", type=int, default=8)
    g.add_argument("--max-waiting-requests", type=int, default=8)
    g.add_argument("--max-model-len", type=int, default=1024)
    g.add_argument("--kv-cache-memory", default="256M")
    g.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        help="the prefill chunk budget per step (server default: 2048)",
    )
    g.add_argument("--api-key", default=None)
    p.add_argument(
        "--json",
        default=None,
        help="where to write the result (default benchmarks/results/NAME.json)",
    )


@dataclass
class Target:
    url: str
    model: str
    pid: int | None
    headers: dict[str, str] = field(default_factory=dict)
    log_path: Path | None = None
    max_num_seqs: int = 0
    max_waiting_requests: int = 0

    def rss_mb(self) -> float | None:
        return rss_bytes(self.pid) / 2**20 if self.pid else None

    def metrics(self) -> dict[str, float]:
        return scrape(self.url, self.headers)

    def log_problems(self) -> dict[str, int]:
        """Tracebacks and ERROR lines the server logged (only when this script started it)."""
        if self.log_path is None:
            return {}
        text = self.log_path.read_text(errors="replace")
        return {
            "tracebacks": text.count("Traceback"),
            "error_lines": text.count(" ERROR ") + text.count("ERROR:"),
            "critical_lines": text.count("CRITICAL"),
        }


@contextlib.contextmanager
def server(args: argparse.Namespace) -> Iterator[Target]:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    if args.base_url:
        yield Target(
            args.base_url.rstrip("/"),
            args.model,
            args.pid,
            headers,
            max_num_seqs=args.max_num_seqs,
            max_waiting_requests=args.max_waiting_requests,
        )
        return
    with tempfile.TemporaryDirectory() as d:
        cfg = Path(d) / "models.yaml"
        cfg.write_text(
            f"models:\n  {MODEL}:\n    source: default\n    max_model_len: {args.max_model_len}\n"
            f"    warm_prompts:\n      - {json.dumps(SYSTEM)}\n"
        )
        extra = ["--api-key", args.api_key] if args.api_key else []
        if args.max_num_batched_tokens:
            extra += ["--max-num-batched-tokens", str(args.max_num_batched_tokens)]
        srv = ServerProcess(
            [
                "--config",
                str(cfg),
                "--model",
                MODEL,
                "--kv-cache-memory",
                args.kv_cache_memory,
                "--max-num-seqs",
                str(args.max_num_seqs),
                "--max-waiting-requests",
                str(args.max_waiting_requests),
                *extra,
            ],
            Path(d) / "server.log",
        )
        try:
            srv.wait_ready()
            yield Target(
                srv.url,
                MODEL,
                srv.proc.pid,
                headers,
                Path(d) / "server.log",
                args.max_num_seqs,
                args.max_waiting_requests,
            )
        finally:
            srv.stop()
            # a log with errors in it is kept next to the results, for a post-mortem
            log = Path(d) / "server.log"
            if log.is_file():
                text = log.read_bytes()
                if b"Traceback" in text or b" ERROR " in text or b"CRITICAL" in text:
                    out = RESULTS / f"{Path(sys.argv[0]).stem}.server.log"
                    out.write_bytes(text[-2_000_000:])
                    print(f"the server logged errors: {out}")


def chat_body(
    model: str,
    question: str,
    max_tokens: int,
    *,
    stream: bool = True,
    system: str | None = SYSTEM,
    **extra: Any,
) -> dict[str, Any]:
    msgs = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": question}
    ]
    return {
        "model": model,
        "messages": msgs,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": stream,
        **extra,
    }


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


def ms(x: float | None) -> float | None:
    """Seconds -> milliseconds rounded to 0.1; None for None or NaN (an empty percentile)."""
    return None if x is None or math.isnan(x) else round(x * 1000, 1)


def is_openai_error(body: Any) -> bool:
    """{"error": {"message": non-empty str, "type": str, "param": str|None, "code": str|None}}."""
    if not isinstance(body, dict) or set(body) != {"error"}:
        return False
    err = body["error"]
    return (
        isinstance(err, dict)
        and set(err) == {"message", "type", "param", "code"}
        and isinstance(err["message"], str)
        and bool(err["message"])
        and isinstance(err["type"], str)
        and (err["param"] is None or isinstance(err["param"], str))
        and (err["code"] is None or isinstance(err["code"], str))
    )


def write_result(name: str, args: argparse.Namespace, result: dict[str, Any]) -> Path:
    """Write result as JSON to --json (default benchmarks/results/NAME.json); returns the path."""
    path = Path(args.json) if args.json else RESULTS / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    return path


def print_table(rows: list[tuple[str, Any]]) -> None:
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
