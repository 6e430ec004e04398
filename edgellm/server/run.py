"""A Run: the live engine sub-requests of one prepared request, their outputs merged into one
queue (each tagged with its choice index).

Closing a run (the client went away, or the stream ended early) aborts every sub-request
that has not finished, so its KV blocks are free before the next step.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

from edgellm.engine.output import RequestOutput
from edgellm.server.errors import APIError, bad_request
from edgellm.server.serving import Prepared, Sub

logger = logging.getLogger(__name__)


class ClientGone(Exception):
    """The run was closed (the client disconnected) before it finished."""


_CLOSED = ClientGone()


class Run:
    """The live sub-requests of one HTTP request, merged into one event queue.

    Whoever starts a Run must close() it whatever happens (the app does so in
    a finally around the response): close() aborts every sub-request still in
    the engine and gives its admission slot back, even if nobody ever read
    the events.
    """

    def __init__(self, prep: Prepared) -> None:
        self.prep = prep
        self.served = prep.served
        self.queue: asyncio.Queue[tuple[int, RequestOutput | BaseException]] = asyncio.Queue()
        self.unfinished = {s.index for s in prep.subs}  # not yet seen finished by the reader
        self.live = {s.index for s in prep.subs}  # holding an admission slot / an engine request
        self.tasks: list[asyncio.Task[None]] = []
        self.closed = False

    def start(self) -> None:
        for sub in self.prep.subs:
            self.tasks.append(asyncio.create_task(self._pump(sub)))

    def _release(self, index: int) -> bool:
        if index in self.live:
            self.live.discard(index)
            self.served.add_inflight(-1)
            return True
        return False

    async def _pump(self, sub: Sub) -> None:
        gen = self.served.engine.generate(
            sub.request_id, sub.ids, sub.params, prepared=(sub.text, sub.ids), priority=sub.priority
        )
        try:
            async with contextlib.aclosing(gen):
                async for out in gen:
                    if out.finished and self._release(sub.index):
                        self._observe(out)
                    self.queue.put_nowait((sub.index, out))
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # noqa: BLE001  (handed to the reader)
            self._release(sub.index)  # failed, so no longer in the engine
            self.queue.put_nowait((sub.index, exc))

    async def events(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        while self.unfinished:
            index, item = await self.queue.get()
            if item is _CLOSED:
                raise ClientGone()
            if isinstance(item, BaseException):
                raise _engine_exception(item)
            if item.finished:
                self.unfinished.discard(index)
                if item.outputs[0].finish_reason == "error" and item.error_param is not None:
                    raise bad_request(item.error or "bad request", param=item.error_param)
                if item.outputs[0].finish_reason == "error":
                    logger.error("request %s failed in the engine: %s", item.request_id, item.error)
                    raise APIError(
                        500,
                        f"The engine failed this request: {item.error or 'unknown error'}",
                        code="engine_error",
                    )
            yield index, item
        if self.closed:
            raise ClientGone()

    def _observe(self, out: RequestOutput) -> None:
        m = self.served.metrics
        if m is not None:
            m.observe_finished(
                self.served.name,
                self.prep.arrival,
                out.metrics,
                out.outputs[0].finish_reason or "abort",
            )

    def close(self) -> None:
        """Abort whatever is still running (idempotent; safe before start)."""
        if self.closed:
            return
        self.closed = True
        for sub in self.prep.subs:
            if self._release(sub.index):
                self.served.engine.abort(sub.request_id)
                if self.served.metrics is not None:
                    self.served.metrics.success.labels(self.served.name, "abort").inc()
        self.unfinished.clear()
        for task in self.tasks:
            if not task.done():
                task.cancel()
        self.queue.put_nowait((-1, _CLOSED))  # wake a reader blocked on the queue


def _engine_exception(exc: BaseException) -> APIError:
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, ValueError):
        return bad_request(str(exc))
    name = type(exc).__name__
    if name == "EngineDeadError":
        return APIError(
            503, "The engine has stopped; the server is shutting down.", code="engine_dead"
        )
    logger.error("request failed: %s: %s", name, exc)
    return APIError(
        500, "The server had an error while processing your request.", code="internal_error"
    )
