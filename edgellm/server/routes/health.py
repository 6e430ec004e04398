"""GET /health and /metrics: what probes and Prometheus ask.

/health: the load state first (503 while loading or after a failed load, server/readiness.py),
then 503 {"status": "error", "dead_engines": [...]} when an engine's step thread has stopped,
else 200 {"status": "ok"}. /metrics: the Prometheus text of server/metrics.py. Both are open
without the API key where server/guard.py says so.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from starlette.responses import JSONResponse, Response

from edgellm.server.metrics import CONTENT_TYPE
from edgellm.server.routes.state import AppState


def add_routes(router: APIRouter) -> None:
    """GET /health and /metrics."""
    router.add_api_route("/health", health, methods=["GET"])
    router.add_api_route("/metrics", prometheus, methods=["GET"])


async def health(state: AppState) -> Response:
    loading = state.readiness.health()
    if loading is not None:
        status, body = loading
        return JSONResponse(body, status_code=status)
    dead = [m.name for m in state.models if not engine_alive(m.engine)]
    if dead:
        return JSONResponse({"status": "error", "dead_engines": dead}, status_code=503)
    return JSONResponse({"status": "ok"})


async def prometheus(state: AppState) -> Response:
    return Response(state.metrics.render(), media_type=CONTENT_TYPE)


def engine_alive(engine: Any) -> bool:
    """False once an engine's step thread has stopped (an engine without one counts as alive)."""
    thread = getattr(engine, "_thread", None)
    return thread is None or thread.is_alive()
