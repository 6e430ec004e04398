"""OpenAI-shaped errors: {"error": {"message", "type", "param", "code"}} with the right status."""

from __future__ import annotations

import json
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse, Response

logger = logging.getLogger(__name__)

_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    403: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    431: "invalid_request_error",
    429: "rate_limit_exceeded",
    500: "internal_server_error",
    503: "service_unavailable",
}


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        type: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _TYPES.get(status, "invalid_request_error")
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def from_validation_error(exc: ValidationError) -> APIError:
    """The first pydantic error, phrased like OpenAI's 'Invalid type for ...' messages."""
    errors = exc.errors(include_url=False)
    if not errors:
        return bad_request("invalid request body")
    err = errors[0]
    # drop union-branch names ("str", "list[str]") pydantic adds to the location
    loc = [
        str(p)
        for p in err.get("loc", ())
        if not (isinstance(p, str) and ("[" in p or p in ("str", "int", "float", "bool")))
    ]
    param = ".".join(loc) or None
    kind = err.get("type", "")
    if kind == "missing":
        msg = f"Missing required parameter: '{param}'."
    elif kind in ("json_invalid", "json_type"):
        msg = f"We could not parse the JSON body of your request. ({err.get('msg')})"
        param = None
    elif kind == "model_type" and not loc:
        msg = "The request body must be a JSON object."
    else:
        msg = f"Invalid value for '{param}': {err.get('msg')}." if param else str(err.get("msg"))
    return bad_request(msg, param=param, code="invalid_type" if kind.endswith("_type") else None)


def install_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> Response:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> Response:
        return bad_request(
            f"invalid request: {exc.errors()[0].get('msg') if exc.errors() else exc}"
        ).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> Response:
        if exc.status_code == 404:
            return APIError(
                404, f"Not found: {request.method} {request.url.path}", code="not_found"
            ).response()
        if exc.status_code == 405:
            return APIError(
                405,
                f"Method {request.method} is not allowed on {request.url.path}",
                code="method_not_allowed",
            ).response()
        return APIError(exc.status_code, str(exc.detail)).response()

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> Response:
        # log the trace, never send it
        logger.exception("unhandled error in %s %s", request.method, request.url.path)
        return APIError(
            500, "The server had an error while processing your request.", code="internal_error"
        ).response()


def sse_error(err: APIError) -> str:
    return f"data: {json.dumps(err.body())}\n\n"
