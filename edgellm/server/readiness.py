"""Whether the served engines are up: loading -> ready, or failed.

`edgellm serve` binds its port first and loads the model in the background, so that a router or a
Kubernetes readiness probe sees the replica at once and knows it is not ready yet: /health answers
503 {"status": "loading"} until the load (and the warm-up) has finished, then 200. The model routes
answer an OpenAI-shaped 503 (code "model_loading", Retry-After) meanwhile. A load that fails leaves
the state "failed" (/health 503 {"status": "error"}) and calls `on_failure`, which `edgellm serve`
uses to stop the server and report the error as a start-up failure.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from edgellm.server.errors import APIError

logger = logging.getLogger(__name__)

T = TypeVar("T")

LOADING, READY, FAILED = "loading", "ready", "failed"


class Readiness:
    """The app's load state; `run` drives `load` (if any) to the end and records how it ended.

    Without a load function the app is ready from the start (its engines were built before it)."""

    def __init__(
        self,
        load: Callable[[], Awaitable[None]] | None = None,
        on_failure: Callable[[BaseException], None] | None = None,
    ) -> None:
        self.load = load
        self.on_failure = on_failure
        self.state = LOADING if load is not None else READY
        self.error: BaseException | None = None
        self._task: asyncio.Task[None] | None = None

    @property
    def ready(self) -> bool:
        return self.state == READY

    def start(self) -> None:
        """Start the load on the running event loop (the app's lifespan calls this)."""
        if self.load is not None and self._task is None:
            self._task = asyncio.create_task(self._run(self.load), name="edgellm-load")

    async def stop(self) -> None:
        """Cancel a load still in progress (the server is shutting down)."""
        if self._task is not None and not self._task.done():
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass

    async def _run(self, load: Callable[[], Awaitable[None]]) -> None:
        try:
            await load()
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # noqa: BLE001  (recorded, reported through on_failure)
            self.state, self.error = FAILED, exc
            logger.critical("loading the model failed: %s: %s", type(exc).__name__, exc)
            if self.on_failure is not None:
                self.on_failure(exc)
            return
        self.state = READY
        logger.info("model loaded; the server is ready")

    def health(self) -> tuple[int, dict[str, Any]] | None:
        """/health's answer while not ready; None once ready (the engines' own checks follow)."""
        if self.state == LOADING:
            return 503, {"status": "loading"}
        if self.state == FAILED:
            return 503, {
                "status": "error",
                "error": f"loading the model failed: {type(self.error).__name__}",
            }
        return None

    def require(self) -> None:
        """Raise the 503 a model route answers while the model is not loaded."""
        if self.state == LOADING:
            raise APIError(
                503,
                "The model is still loading; retry shortly.",
                code="model_loading",
                headers={"Retry-After": "5"},
            )
        if self.state == FAILED:
            raise APIError(
                503,
                "The model failed to load; the server is shutting down.",
                code="model_load_failed",
            )


async def in_thread(fn: Callable[[], T], name: str = "edgellm-loader") -> T:
    """Run a blocking `fn` on its own daemon thread and await its result.

    A daemon thread, not the loop's default executor: a server stopped mid-load exits without
    waiting for the load to finish (asyncio.run joins the default executor's threads)."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[T] = loop.create_future()

    def succeed(result: T) -> None:
        if not future.done():
            future.set_result(result)

    def fail(exc: BaseException) -> None:
        if not future.done():
            future.set_exception(exc)

    def target() -> None:
        try:
            result = fn()
        except BaseException as exc:  # noqa: BLE001  (handed to the awaiting coroutine)
            _call_soon(loop, fail, exc)
            return
        _call_soon(loop, succeed, result)

    threading.Thread(target=target, name=name, daemon=True).start()
    return await future


def _call_soon(loop: asyncio.AbstractEventLoop, fn: Callable[..., None], *args: Any) -> None:
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:
        pass  # the loop has closed: nobody is waiting for the result
