"""The OpenAPI schema the app serves at /openapi.json (behind the API key).

The generation routes parse their bodies themselves (to fix the order of checks, server/app.py),
so FastAPI cannot see their request models: `json_body` names the model in a route's
`openapi_extra`, and `openapi_schema` adds the models' JSON schemas to the components.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from edgellm.server.chat_request import ChatCompletionRequest
from edgellm.server.completion_request import CompletionRequest


def json_body(model: type[BaseModel]) -> dict[str, Any]:
    """The OpenAPI request body of a route that parses its body itself."""
    return {
        "requestBody": {
            "required": True,
            "content": {
                "application/json": {"schema": {"$ref": f"#/components/schemas/{model.__name__}"}}
            },
        }
    }


def openapi_schema(app: FastAPI) -> dict[str, Any]:
    """FastAPI's schema of the app's routes plus the request models; built once, then cached
    on the app."""
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
        _, defs = models_json_schema(
            [(ChatCompletionRequest, "validation"), (CompletionRequest, "validation")],
            ref_template="#/components/schemas/{model}",
        )
        schema.setdefault("components", {}).setdefault("schemas", {}).update(defs.get("$defs", {}))
        app.openapi_schema = schema
    return app.openapi_schema
