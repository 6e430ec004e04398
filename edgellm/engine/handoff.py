"""What passes between the asyncio callers of AsyncEngine and its engine thread.

Inward: `PendingAdd`, a request accepted by `generate` and waiting in the inbox for the engine
thread to add it. Outward: `RequestStream`, the outputs of one request queued on its caller's
event loop, which the caller reads with `stream_outputs`; the engine thread hands over one item
with `send`, or a step's outputs grouped by event loop (`route`) with one call per loop
(`deliver`). A closed loop has nobody listening, and
what is sent to it is dropped.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass
from typing import Any

from edgellm.engine.output import RequestOutput
from edgellm.sampling import SamplingParams


class RequestStream:
    """Outputs of one request, handed from the engine thread to the event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self.finished = False


async def stream_outputs(
    stream: RequestStream, abort: Callable[[], None]
) -> AsyncGenerator[RequestOutput, None]:
    """The request's outputs as they arrive, up to the finished one; an exception handed over is
    raised. Leaving early (the caller closed the stream) calls `abort`."""
    try:
        while True:
            item = await stream.queue.get()
            if isinstance(item, BaseException):
                raise item
            yield item
            if item.finished:
                stream.finished = True
                return
    finally:
        if not stream.finished:
            abort()


@dataclass
class PendingAdd:
    request_id: str
    prompt_ids: list[int]
    prompt_text: str | None
    params: SamplingParams
    stream: RequestStream
    grammar: Any = None  # the compiled structured-output grammar
    priority: int = 0


Batches = dict[asyncio.AbstractEventLoop, list[tuple[RequestStream, RequestOutput | BaseException]]]


def route(streams: dict[str, RequestStream], outputs: list[RequestOutput]) -> Batches:
    """The outputs of requests with a stream in `streams`, grouped by their stream's loop; a
    finished request's stream leaves `streams`. Called under the lock that guards `streams`."""
    by_loop: Batches = {}
    for out in outputs:
        stream = streams.get(out.request_id)
        if stream is None:
            continue
        if out.finished:
            del streams[out.request_id]
        by_loop.setdefault(stream.loop, []).append((stream, out))
    return by_loop


def deliver(by_loop: Batches) -> None:
    for loop, items in by_loop.items():
        try:
            loop.call_soon_threadsafe(put_all, items)
        except RuntimeError:
            pass  # the caller's loop is closed: nobody is listening


def send(stream: RequestStream, item: RequestOutput | BaseException) -> None:
    try:
        stream.loop.call_soon_threadsafe(put_all, [(stream, item)])
    except RuntimeError:
        pass  # the caller's loop is closed: nobody is listening


def put_all(items: list[tuple[RequestStream, RequestOutput | BaseException]]) -> None:
    """Runs on the streams' event loop."""
    for stream, item in items:
        stream.queue.put_nowait(item)
