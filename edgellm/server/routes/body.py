"""Reading a request's body under the size limit, and noticing when its client goes away.

The routes read bodies themselves (not through FastAPI's injector) so that the order of checks
stays fixed (server/app.py). A body larger than the limit is a 413 as soon as the bytes read pass
it, whatever its Content-Length said; a client that hangs up while sending raises ClientGone.
"""

from __future__ import annotations

import logging

from starlette.requests import ClientDisconnect, Request

from edgellm.server.guard import body_too_big
from edgellm.server.run import ClientGone, Run

logger = logging.getLogger(__name__)


async def read_body(request: Request, limit: int) -> bytes:
    """The whole body: 413 past `limit` bytes, ClientGone when the client disconnects."""
    body = bytearray()
    try:
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                raise body_too_big(limit)
    except ClientDisconnect:  # hung up while sending: nobody to answer
        raise ClientGone() from None
    return bytes(body)


async def watch_disconnect(request: Request, run: Run) -> None:
    """Barge-in: a client that goes away aborts its request at once (the run is closed)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            if run.unfinished:
                logger.info("client disconnected; aborting %s", run.prep.request_id)
            run.close()
            return
