"""The first gate of every request: header size (431), API key (401), declared body size (413).

ServerSettings holds the limits; Guard is the ASGI middleware that applies them before any route
runs, so that a refused request costs next to nothing.
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass

from starlette.types import ASGIApp, Receive, Scope, Send

from edgellm.server.errors import APIError


@dataclass
class ServerSettings:
    api_key: str | None = None
    metrics_public: bool = False  # serve /metrics without the API key
    max_body_bytes: int = 4 << 20
    max_header_bytes: int = 16 << 10  # request target + header names and values


class Guard:
    """Header size limit (431); API key (constant-time compare) on every path but /health (and
    /metrics when public); bodies over the size limit are refused from their Content-Length before
    any is read."""

    def __init__(self, app: ASGIApp, settings: ServerSettings) -> None:
        self.app = app
        self.settings = settings
        self.key = settings.api_key.encode() if settings.api_key else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        raw_headers = scope.get("headers") or []
        # h11 bounds what it buffers before a header block is complete; a complete block that is
        # still too big (it arrived in one read) is refused here, before anything else
        size = (
            len(scope.get("raw_path") or b"")
            + len(scope.get("query_string") or b"")
            + sum(len(k) + len(v) + 4 for k, v in raw_headers)
        )
        if size > self.settings.max_header_bytes:
            err = APIError(
                431,
                f"The request's headers are larger than this server's limit of "
                f"{self.settings.max_header_bytes} bytes.",
                code="request_header_fields_too_large",
            )
            await err.response()(scope, receive, send)
            return
        headers = dict(raw_headers)
        open_path = path == "/health" or (path == "/metrics" and self.settings.metrics_public)
        if self.key is not None and not open_path:
            auth = headers.get(b"authorization", b"")
            token = auth[7:].strip() if auth[:7].lower() == b"bearer " else b""
            if not hmac.compare_digest(token, self.key):
                err = APIError(
                    401,
                    "Incorrect or missing API key. Send it as 'Authorization: Bearer <key>'.",
                    code="invalid_api_key",
                    headers={"WWW-Authenticate": "Bearer"},
                )
                await err.response()(scope, receive, send)
                return
        length = headers.get(b"content-length")
        if length is not None:
            try:
                too_big = int(length) > self.settings.max_body_bytes
            except ValueError:
                too_big = False
            if too_big:
                await body_too_big(self.settings.max_body_bytes).response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


def body_too_big(limit: int) -> APIError:
    return APIError(
        413,
        f"The request body is larger than this server's limit of {limit} bytes.",
        code="request_too_large",
    )
