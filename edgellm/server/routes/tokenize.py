"""POST /tokenize: vLLM's route (server/tokenize.py), what token-aware routers route by.

Checks: model still loading (503) -> body over the size limit (413) -> JSON and fields (400) ->
model (404) -> the chat or prompt (400). A client gone while sending gets a 499.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from starlette.responses import JSONResponse, Response

from edgellm.server.routes.body import read_body
from edgellm.server.routes.state import AppState
from edgellm.server.run import ClientGone
from edgellm.server.tokenize import parse_body, tokenize


def add_routes(router: APIRouter) -> None:
    """POST /tokenize."""
    router.add_api_route("/tokenize", tokenize_route, methods=["POST"])


async def tokenize_route(request: Request, state: AppState) -> Response:
    """vLLM's /tokenize (server/tokenize.py): what token-aware routers route by."""
    state.readiness.require()
    try:
        body = parse_body(await read_body(request, state.settings.max_body_bytes))
    except ClientGone:
        return Response(status_code=499)
    return JSONResponse(tokenize(state.lookup(body.get("model")), body))
