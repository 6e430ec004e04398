"""POST /v1/chat/completions and /v1/completions: an OpenAI body -> a Run -> JSON or SSE.

Checks after the guard's, in this order: model still loading (503) -> every model's queue full
(503, before the body is read) -> body over the size limit (413) -> JSON and types (400) ->
model (404) -> prompt and parameters (400) -> a structured-output grammar that does not compile
(400) -> this model's queue bound (503). A client that goes away, before or during the answer,
gets a 499 and its run is closed, which aborts every engine request it still has.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from fastapi import APIRouter, Request
from pydantic import ValidationError
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from edgellm.server.chat_request import ChatCompletionRequest
from edgellm.server.completion_request import CompletionRequest
from edgellm.server.errors import bad_request, from_validation_error
from edgellm.server.openapi import json_body
from edgellm.server.responses import complete, stream
from edgellm.server.routes.body import read_body, watch_disconnect
from edgellm.server.routes.state import AppState, ServerState
from edgellm.server.run import ClientGone, Run
from edgellm.server.serving import Prepared, prepare
from edgellm.structured import StructuredOutputError

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}

# bodies larger than this are rendered and tokenized off the event loop
_INLINE_PREPARE_BYTES = 32 * 1024
_PREPARE_POOL: ThreadPoolExecutor | None = None


def _prepare_pool() -> ThreadPoolExecutor:
    """One thread for every app in the process: big prompts are prepared one at a time."""
    global _PREPARE_POOL
    if _PREPARE_POOL is None:
        _PREPARE_POOL = ThreadPoolExecutor(max_workers=1, thread_name_prefix="edgellm-prepare")
    return _PREPARE_POOL


def add_routes(router: APIRouter) -> None:
    """POST /v1/chat/completions and /v1/completions."""
    router.add_api_route(
        "/v1/chat/completions",
        chat_completions,
        methods=["POST"],
        openapi_extra=json_body(ChatCompletionRequest),
    )
    router.add_api_route(
        "/v1/completions", completions, methods=["POST"], openapi_extra=json_body(CompletionRequest)
    )


async def chat_completions(request: Request, state: AppState) -> Response:
    return await handle(request, state, ChatCompletionRequest)


async def completions(request: Request, state: AppState) -> Response:
    return await handle(request, state, CompletionRequest)


async def handle(
    request: Request, state: ServerState, cls: type[ChatCompletionRequest | CompletionRequest]
) -> Response:
    """One generation request, checked in the module's order, answered as JSON or as SSE."""
    arrival = time.monotonic()
    state.readiness.require()
    models = state.models
    if all(m.full for m in models):  # overloaded: refuse at once, before reading or tokenizing
        raise models[0].overloaded()
    try:
        raw = await read_body(request, state.settings.max_body_bytes)
    except ClientGone:
        return Response(status_code=499)
    try:
        req = cls.model_validate_json(raw)
    except ValidationError as exc:
        raise from_validation_error(exc) from None
    served = state.lookup(req.model)
    prep: Prepared
    if len(raw) > _INLINE_PREPARE_BYTES:
        # a big prompt takes long to render and tokenize: off the event loop, one at a time, so
        # that every other stream keeps flowing meanwhile
        prep = await asyncio.get_running_loop().run_in_executor(
            _prepare_pool(), prepare, served, req, arrival
        )
    else:
        prep = prepare(served, req, arrival)
    if prep.subs[0].params.structured_outputs is not None:
        # a first-seen schema compiles here (its own thread): a bad one is a 400 before any byte
        try:
            await served.engine.compile_grammar(prep.subs[0].params)
        except StructuredOutputError as exc:
            raise bad_request(str(exc), param=exc.param) from None
        except ValueError as exc:
            raise bad_request(str(exc)) from None
    served.admit(len(prep.subs))
    run = Run(prep)
    run.start()
    if req.stream:
        return _RunStream(
            run, _sse(request, run), media_type="text/event-stream", headers=SSE_HEADERS
        )
    watcher = asyncio.create_task(watch_disconnect(request, run))
    try:
        body, headers = await complete(run)
    except ClientGone:
        return Response(status_code=499)
    finally:
        watcher.cancel()
        run.close()
    return JSONResponse(body, headers=headers)


async def _sse(request: Request, run: Run) -> AsyncIterator[str]:
    watcher = asyncio.create_task(watch_disconnect(request, run))
    try:
        async for event in stream(run):
            yield event
    finally:
        watcher.cancel()
        run.close()


class _RunStream(StreamingResponse):
    """Closes its run however the response ends, even if the body was never started
    (a client gone before the first byte)."""

    def __init__(self, run: Run, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.run = run

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.run.close()
