"""GET /v1/models and /v1/models/{id}: OpenAI's model cards, one per name a model answers to.

Both answer 503 while the model loads (server/readiness.py); an unknown id is a 404.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from edgellm.server.routes.state import AppState
from edgellm.server.served_model import ServedModel


def add_routes(router: APIRouter) -> None:
    """GET /v1/models and /v1/models/{id}."""
    router.add_api_route("/v1/models", list_models, methods=["GET"])
    router.add_api_route("/v1/models/{model_id:path}", get_model, methods=["GET"])


def model_card(name: str, served: ServedModel) -> dict[str, Any]:
    """OpenAI's model object plus vLLM's `root` (the model's first name) and `max_model_len`."""
    return {
        "id": name,
        "object": "model",
        "created": served.created,
        "owned_by": "edgellm",
        "root": served.name,
        "parent": None,
        "max_model_len": served.engine.max_model_len,
    }


async def list_models(state: AppState) -> dict[str, Any]:
    state.readiness.require()
    return {"object": "list", "data": [model_card(n, s) for n, s in state.by_name.items()]}


async def get_model(model_id: str, state: AppState) -> dict[str, Any]:
    state.readiness.require()
    return model_card(model_id, state.lookup(model_id))
