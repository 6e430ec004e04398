"""The FastAPI app: OpenAI routes, /tokenize, /health, /metrics (edgellm/server/routes/).

Bodies are read and parsed by the routes (not by FastAPI's injector) so that the order of checks
is fixed: headers (431) -> key (401) -> size (413) (those three in server/guard.py) -> model still
loading (503, server/readiness.py) -> JSON and types (400) -> model (404) -> prompt and
parameters (400) -> queue bound (503). When the queue is already full, the 503 comes first,
before the body is even read, so that a flood costs next to nothing. /openapi.json describes the
request bodies (the pydantic models) although the routes parse them themselves
(server/openapi.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable

from fastapi import FastAPI

from edgellm.server.errors import install_handlers
from edgellm.server.guard import Guard, ServerSettings
from edgellm.server.openapi import openapi_schema
from edgellm.server.readiness import Readiness
from edgellm.server.routes import completions, health, tokenize
from edgellm.server.routes import models as model_routes
from edgellm.server.routes.state import ServerState
from edgellm.server.served_model import ServedModel

__all__ = ["ServerSettings", "create_app"]


def create_app(
    models: list[ServedModel],
    settings: ServerSettings | None = None,
    on_startup: Callable[[], Awaitable[None]] | None = None,
    readiness: Readiness | None = None,
) -> FastAPI:
    """An app over the served models. on_startup (e.g. warm-up) runs before it accepts requests.

    readiness: None when every engine is built already. Given with a load function, the app starts
    serving at once and `readiness.load` runs in the background (it sets each ServedModel.engine);
    until it has finished, /health and the model routes answer 503 (server/readiness.py).
    A model name used twice is a ValueError."""
    settings = settings or ServerSettings()
    readiness = readiness or Readiness()
    state = ServerState.build(models, settings, readiness)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if on_startup is not None:
            await on_startup()
        readiness.start()
        try:
            yield
        finally:
            await readiness.stop()

    app = FastAPI(
        title="edgellm",
        version=_version(),
        docs_url=None,
        redoc_url=None,
        openapi_url="/openapi.json",
        lifespan=lifespan,
    )
    # FastAPI's documented way to serve a custom schema, which its types do not allow for
    app.openapi = lambda: openapi_schema(app)  # type: ignore[method-assign]
    app.state.server = state
    app.state.models = models
    app.state.metrics = state.metrics
    app.state.readiness = readiness
    install_handlers(app)
    app.add_middleware(Guard, settings=settings)
    # added to the app's own router (not include_router), so that app.routes lists every route
    for routes in (completions, tokenize, model_routes, health):
        routes.add_routes(app.router)
    return app


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("edgellm")
    except Exception:  # noqa: BLE001  (not installed: a source checkout)
        return "0"
