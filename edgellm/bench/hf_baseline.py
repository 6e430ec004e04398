"""A plain transformers server behind the same OpenAI API as `edgellm serve`: the baseline that
benchmarks/compare_servers.py measures edgellm against (benchmarks/hf_baseline_server.py runs
it). `create_app` serves POST /v1/chat/completions and /v1/completions (streaming or not),
GET /v1/models and GET /health over the static batches of edgellm/bench/hf_batching.py."""

from __future__ import annotations

import json
import logging
import time
import uuid
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from edgellm.bench.hf_batching import Batcher, Job

logger = logging.getLogger("hf_baseline")

DEFAULT_NAME = "hf-baseline"


class BadRequest(ValueError):
    pass


def _prompt_ids(tokenizer: Any, body: dict[str, Any], chat: bool) -> list[int]:
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise BadRequest("'messages' must be a non-empty list")
        norm = []
        for m in messages:
            if not isinstance(m, dict) or "role" not in m:
                raise BadRequest("each message needs a 'role'")
            content = m.get("content") or ""
            if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
                content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
            norm.append({"role": m["role"], "content": str(content)})
        text = tokenizer.apply_chat_template(norm, add_generation_prompt=True, tokenize=False)
        return list(tokenizer.encode(text, add_special_tokens=False))
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return list(tokenizer.encode(prompt, add_special_tokens=False))
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return list(prompt)
    raise BadRequest("'prompt' must be a string or a list of token ids (one prompt per request)")


def _job(tokenizer: Any, body: dict[str, Any], chat: bool, max_len: int) -> Job:
    ids = _prompt_ids(tokenizer, body, chat)
    max_tokens = body.get("max_completion_tokens") or body.get("max_tokens") or 16
    if not isinstance(max_tokens, int) or max_tokens < 1:
        raise BadRequest("'max_tokens' must be a positive integer")
    if len(ids) + max_tokens > max_len:
        raise BadRequest(
            f"prompt ({len(ids)} tokens) + max_tokens ({max_tokens}) exceeds the context "
            f"({max_len})"
        )
    temperature = body.get("temperature")
    temperature = 1.0 if temperature is None else float(temperature)
    if temperature < 0:
        raise BadRequest("'temperature' must be >= 0")
    return Job(ids, max_tokens, bool(body.get("ignore_eos", False)), temperature)


def create_app(
    model: Any,
    tokenizer: Any,
    served_name: str = DEFAULT_NAME,
    max_batch_size: int = 16,
    batch_window_ms: float = 20.0,
) -> Any:
    batcher = Batcher(model, tokenizer, max_batch_size, batch_window_ms / 1000)
    max_len = int(getattr(model.config, "max_position_embeddings", 2048) or 2048)

    @asynccontextmanager
    async def lifespan(_app: Any):
        batcher.start()
        try:
            yield
        finally:
            await batcher.stop()

    app = FastAPI(lifespan=lifespan)
    app.state.batcher = batcher

    def error(status: int, message: str, kind: str = "invalid_request_error") -> JSONResponse:
        return JSONResponse(
            {"error": {"message": message, "type": kind, "param": None, "code": None}},
            status_code=status,
        )

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {
            "object": "list",
            "data": [
                {"id": served_name, "object": "model", "created": 0, "owned_by": "transformers"}
            ],
        }

    async def handle(request: Request, chat: bool) -> Any:
        try:
            body = await request.json()
            if not isinstance(body, dict):
                raise BadRequest("the body must be a JSON object")
            job = _job(tokenizer, body, chat, max_len)
        except (BadRequest, ValueError, TypeError) as exc:
            return error(400, str(exc) or "bad request")
        batcher.submit(job)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        created = int(time.time())
        model_name = str(body.get("model") or served_name)
        opts = body.get("stream_options") or {}
        include_usage = isinstance(opts, dict) and bool(opts.get("include_usage"))
        if body.get("stream"):
            return StreamingResponse(
                _stream(job, rid, created, model_name, chat, include_usage),
                media_type="text/event-stream",
            )
        try:
            text, finish = await _collect(job)
        except RuntimeError as exc:
            return error(500, str(exc), "server_error")
        finally:
            job.cancelled = job.finish_reason is None
        choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": finish}
        if chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        return {
            "id": rid,
            "object": "chat.completion" if chat else "text_completion",
            "created": created,
            "model": model_name,
            "choices": [choice],
            "usage": _usage(job),
        }

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Any:
        return await handle(request, chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        return await handle(request, chat=False)

    return app


def _usage(job: Job) -> dict[str, int]:
    n = len(job.token_ids)
    return {
        "prompt_tokens": len(job.prompt_ids),
        "completion_tokens": n,
        "total_tokens": len(job.prompt_ids) + n,
    }


async def _collect(job: Job) -> tuple[str, str]:
    assert job.queue is not None
    parts = []
    while True:
        kind, payload = await job.queue.get()
        if kind == "delta":
            parts.append(payload)
        elif kind == "done":
            return "".join(parts), payload
        else:
            raise RuntimeError(payload)


async def _stream(job: Job, rid: str, created: int, model: str, chat: bool, include_usage: bool):
    """OpenAI SSE chunks; the first carries the role and the first text (no empty event first)."""
    assert job.queue is not None
    obj = "chat.completion.chunk" if chat else "text_completion"
    started = False

    def chunk(text: str | None, finish: str | None) -> str:
        nonlocal started
        if chat:
            delta: dict[str, Any] = {} if started else {"role": "assistant"}
            if text is not None:
                delta["content"] = text
            choice: dict[str, Any] = {
                "index": 0,
                "delta": delta,
                "logprobs": None,
                "finish_reason": finish,
            }
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
        started = True
        body = {"id": rid, "object": obj, "created": created, "model": model, "choices": [choice]}
        return f"data: {json.dumps(body)}\n\n"

    try:
        while True:
            kind, payload = await job.queue.get()
            if kind == "delta":
                yield chunk(payload, None)
            elif kind == "done":
                yield chunk(
                    "" if started else None, payload if payload in ("stop", "length") else "stop"
                )
                break
            else:
                err = {
                    "error": {
                        "message": payload,
                        "type": "server_error",
                        "param": None,
                        "code": None,
                    }
                }
                yield f"data: {json.dumps(err)}\n\n"
                break
        if include_usage:
            body = {
                "id": rid,
                "object": obj,
                "created": created,
                "model": model,
                "choices": [],
                "usage": _usage(job),
            }
            yield f"data: {json.dumps(body)}\n\n"
        yield "data: [DONE]\n\n"
    finally:
        if job.finish_reason is None:
            job.cancelled = True  # the client went away: its row stops at the next step
