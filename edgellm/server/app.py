"""The FastAPI app: OpenAI routes, /health, /metrics.

Bodies are read and parsed here (not by FastAPI's injector) so that the
order of checks is fixed: headers (431) -> key (401) -> size (413) (those three in
server/guard.py) -> model still loading (503, server/readiness.py) -> JSON and types (400) ->
model (404) -> prompt and parameters (400) -> queue bound (503). When the
queue is already full, the 503 comes first, before the body is even read, so
that a flood costs next to nothing. /openapi.json describes the request
bodies (the pydantic models) although the routes parse them themselves.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel, ValidationError
from pydantic.json_schema import models_json_schema
from starlette.requests import ClientDisconnect
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from edgellm.server.errors import APIError, bad_request, from_validation_error, install_handlers
from edgellm.server.guard import Guard, ServerSettings, body_too_big
from edgellm.server.metrics import CONTENT_TYPE, ServerMetrics
from edgellm.server.protocol import ChatCompletionRequest, CompletionRequest
from edgellm.server.readiness import Readiness
from edgellm.server.responses import complete, stream
from edgellm.server.serving import ClientGone, Run, ServedModel, prepare
from edgellm.server.tokenize import parse_body, tokenize
from edgellm.structured import StructuredOutputError

logger = logging.getLogger(__name__)

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}

__all__ = ["ServerSettings", "create_app"]


_INLINE_PREPARE_BYTES = 32 * 1024
_PREPARE_POOL: ThreadPoolExecutor | None = None


def _prepare_pool() -> ThreadPoolExecutor:
    global _PREPARE_POOL
    if _PREPARE_POOL is None:
        _PREPARE_POOL = ThreadPoolExecutor(max_workers=1, thread_name_prefix="edgellm-prepare")
    return _PREPARE_POOL


async def _read_body(request: Request, limit: int) -> bytes:
    body = bytearray()
    try:
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                raise body_too_big(limit)
    except ClientDisconnect:  # hung up while sending: nobody to answer
        raise ClientGone() from None
    return bytes(body)


async def _watch_disconnect(request: Request, run: Run) -> None:
    """Barge-in: a client that goes away aborts its request at once."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            if run.unfinished:
                logger.info("client disconnected; aborting %s", run.prep.request_id)
            run.close()
            return


def create_app(models: list[ServedModel], settings: ServerSettings | None = None,
               on_startup: Callable[[], Awaitable[None]] | None = None,
               readiness: Readiness | None = None) -> FastAPI:
    """An app over the served models. on_startup (e.g. warm-up) runs before it accepts requests.

    readiness: None when every engine is built already. Given with a load function, the app starts
    serving at once and `readiness.load` runs in the background (it sets each ServedModel.engine);
    until it has finished, /health and the model routes answer 503 (server/readiness.py)."""
    settings = settings or ServerSettings()
    readiness = readiness or Readiness()
    by_name: dict[str, ServedModel] = {}
    for served in models:
        for name in served.names:
            if name in by_name:
                raise ValueError(f"served model name {name!r} is used twice")
            by_name[name] = served
    metrics = ServerMetrics(lambda: {m.name: m.engine for m in models if m.engine is not None})
    for served in models:
        served.metrics = metrics

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if on_startup is not None:
            await on_startup()
        readiness.start()
        try:
            yield
        finally:
            await readiness.stop()

    app = FastAPI(title="edgellm", version=_version(), docs_url=None, redoc_url=None,
                  openapi_url="/openapi.json", lifespan=lifespan)
    app.openapi = lambda: _openapi(app)  # type: ignore[method-assign]
    app.state.models = models
    app.state.metrics = metrics
    app.state.readiness = readiness
    install_handlers(app)
    app.add_middleware(Guard, settings=settings)

    def lookup(name: str | None) -> ServedModel:
        if name is None:
            return models[0]
        served = by_name.get(name)
        if served is None:
            raise APIError(404, f"The model '{name}' does not exist. Served models: {', '.join(by_name)}.",
                           param="model", code="model_not_found")
        return served

    async def handle(request: Request, cls: type[ChatCompletionRequest | CompletionRequest]) -> Response:
        arrival = time.monotonic()
        readiness.require()
        if all(m.full for m in models):  # overloaded: refuse at once, before reading or tokenizing
            raise models[0].overloaded()
        try:
            raw = await _read_body(request, settings.max_body_bytes)
        except ClientGone:
            return Response(status_code=499)
        try:
            req = cls.model_validate_json(raw)
        except ValidationError as exc:
            raise from_validation_error(exc) from None
        served = lookup(req.model)
        if len(raw) > _INLINE_PREPARE_BYTES:
            # a big prompt takes seconds to render and tokenize (4 MB: ~3.5 s here); off the event loop,
            # one at a time, so that every other stream keeps flowing meanwhile
            prep = await asyncio.get_running_loop().run_in_executor(_prepare_pool(), prepare, served, req, arrival)
        else:
            prep = prepare(served, req, arrival)
        if prep.subs[0].params.structured_outputs is not None:
            try:  # a first-seen schema compiles here (its own thread), so a bad one is a 400 before any byte
                await served.engine.compile_grammar(prep.subs[0].params)
            except StructuredOutputError as exc:
                raise bad_request(str(exc), param=exc.param) from None
            except ValueError as exc:
                raise bad_request(str(exc)) from None
        served.admit(len(prep.subs))
        run = Run(prep)
        run.start()
        if req.stream:
            return _RunStream(run, _sse(request, run), media_type="text/event-stream", headers=SSE_HEADERS)
        watcher = asyncio.create_task(_watch_disconnect(request, run))
        try:
            body, headers = await complete(run)
        except ClientGone:
            return Response(status_code=499)
        finally:
            watcher.cancel()
            run.close()
        return JSONResponse(body, headers=headers)

    async def _sse(request: Request, run: Run) -> AsyncIterator[str]:
        watcher = asyncio.create_task(_watch_disconnect(request, run))
        try:
            async for event in stream(run):
                yield event
        finally:
            watcher.cancel()
            run.close()

    @app.post("/v1/chat/completions", openapi_extra=_json_body(ChatCompletionRequest))
    async def chat_completions(request: Request) -> Response:
        return await handle(request, ChatCompletionRequest)

    @app.post("/v1/completions", openapi_extra=_json_body(CompletionRequest))
    async def completions(request: Request) -> Response:
        return await handle(request, CompletionRequest)

    @app.post("/tokenize")
    async def tokenize_route(request: Request) -> Response:
        """vLLM's /tokenize (server/tokenize.py): what token-aware routers route by."""
        readiness.require()
        try:
            body = parse_body(await _read_body(request, settings.max_body_bytes))
        except ClientGone:
            return Response(status_code=499)
        return JSONResponse(tokenize(lookup(body.get("model")), body))

    def model_card(name: str, served: ServedModel) -> dict[str, Any]:
        return {"id": name, "object": "model", "created": served.created, "owned_by": "edgellm",
                "root": served.name, "parent": None, "max_model_len": served.engine.max_model_len}

    @app.get("/v1/models")
    async def list_models() -> dict[str, Any]:
        readiness.require()
        return {"object": "list", "data": [model_card(n, s) for n, s in by_name.items()]}

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str) -> dict[str, Any]:
        readiness.require()
        return model_card(model_id, lookup(model_id))

    @app.get("/health")
    async def health() -> Response:
        loading = readiness.health()
        if loading is not None:
            status, body = loading
            return JSONResponse(body, status_code=status)
        dead = [m.name for m in models if not _engine_alive(m.engine)]
        if dead:
            return JSONResponse({"status": "error", "dead_engines": dead}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    return app


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("edgellm")
    except Exception:  # noqa: BLE001  (not installed: a source checkout)
        return "0"


def _json_body(model: type[BaseModel]) -> dict[str, Any]:
    """The OpenAPI request body of a route that parses its body itself (to fix the order of checks)."""
    return {"requestBody": {"required": True, "content": {"application/json": {
        "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}}


def _openapi(app: FastAPI) -> dict[str, Any]:
    """FastAPI's schema plus the request models (served at /openapi.json, behind the API key)."""
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
        _, defs = models_json_schema([(ChatCompletionRequest, "validation"), (CompletionRequest, "validation")],
                                     ref_template="#/components/schemas/{model}")
        schema.setdefault("components", {}).setdefault("schemas", {}).update(defs.get("$defs", {}))
        app.openapi_schema = schema
    return app.openapi_schema


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


def _engine_alive(engine: Any) -> bool:
    thread = getattr(engine, "_thread", None)
    return thread is None or thread.is_alive()
