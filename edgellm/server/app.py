"""The FastAPI app: OpenAI routes, /health, /metrics, API-key and body-size guard.

Bodies are read and parsed here (not by FastAPI's injector) so that the
order of checks is fixed: key (401) -> size (413) -> JSON and types (400) ->
model (404) -> prompt and parameters (400) -> queue bound (503).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from pydantic import ValidationError
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from edgellm.server.errors import APIError, from_validation_error, install_handlers
from edgellm.server.metrics import CONTENT_TYPE, ServerMetrics
from edgellm.server.protocol import ChatCompletionRequest, CompletionRequest
from edgellm.server.responses import complete, stream
from edgellm.server.serving import ClientGone, Run, ServedModel, prepare

logger = logging.getLogger(__name__)

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


@dataclass
class ServerSettings:
    api_key: str | None = None
    metrics_public: bool = False  # serve /metrics without the API key
    max_body_bytes: int = 4 << 20


class Guard:
    """API key (constant-time compare) on every path but /health (and /metrics when public);
    bodies over the size limit are refused from their Content-Length before any is read."""

    def __init__(self, app: ASGIApp, settings: ServerSettings) -> None:
        self.app = app
        self.settings = settings
        self.key = settings.api_key.encode() if settings.api_key else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        headers = dict(scope.get("headers") or [])
        open_path = path == "/health" or (path == "/metrics" and self.settings.metrics_public)
        if self.key is not None and not open_path:
            auth = headers.get(b"authorization", b"")
            token = auth[7:].strip() if auth[:7].lower() == b"bearer " else b""
            if not hmac.compare_digest(token, self.key):
                err = APIError(401, "Incorrect or missing API key. Send it as 'Authorization: Bearer <key>'.",
                               code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
                await err.response()(scope, receive, send)
                return
        length = headers.get(b"content-length")
        if length is not None:
            try:
                too_big = int(length) > self.settings.max_body_bytes
            except ValueError:
                too_big = False
            if too_big:
                await _too_big(self.settings.max_body_bytes).response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _too_big(limit: int) -> APIError:
    return APIError(413, f"The request body is larger than this server's limit of {limit} bytes.",
                    code="request_too_large")


async def _read_body(request: Request, limit: int) -> bytes:
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise _too_big(limit)
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
               on_startup: Callable[[], Awaitable[None]] | None = None) -> FastAPI:
    """An app over already-built engines; on_startup (e.g. warm-up) runs before it accepts requests."""
    settings = settings or ServerSettings()
    by_name: dict[str, ServedModel] = {}
    for served in models:
        for name in served.names:
            if name in by_name:
                raise ValueError(f"served model name {name!r} is used twice")
            by_name[name] = served
    metrics = ServerMetrics(lambda: {m.name: m.engine for m in models})
    for served in models:
        served.metrics = metrics

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if on_startup is not None:
            await on_startup()
        yield

    app = FastAPI(title="edgellm", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)
    app.state.models = models
    app.state.metrics = metrics
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
        raw = await _read_body(request, settings.max_body_bytes)
        try:
            req = cls.model_validate_json(raw)
        except ValidationError as exc:
            raise from_validation_error(exc) from None
        served = lookup(req.model)
        prep = prepare(served, req, arrival)
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

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await handle(request, ChatCompletionRequest)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await handle(request, CompletionRequest)

    def model_card(name: str, served: ServedModel) -> dict[str, Any]:
        return {"id": name, "object": "model", "created": served.created, "owned_by": "edgellm",
                "root": served.name, "parent": None, "max_model_len": served.engine.max_model_len}

    @app.get("/v1/models")
    async def list_models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card(n, s) for n, s in by_name.items()]}

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str) -> dict[str, Any]:
        return model_card(model_id, lookup(model_id))

    @app.get("/health")
    async def health() -> Response:
        dead = [m.name for m in models if not _engine_alive(m.engine)]
        if dead:
            return JSONResponse({"status": "error", "dead_engines": dead}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    return app


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
