"""AsyncEngine: the LLMEngine stepping on a background thread, for the server.

Callers (asyncio) get an async stream of outputs per request. Adds and aborts
go through an inbox the engine thread drains before every step, so the
engine's state is only ever touched by its own thread; an aborted request's
KV blocks are free before the next step runs. An exception inside a step
fails the requests of that step and the engine keeps serving the rest.

What crosses between the two sides is in engine/handoff.py; the thread's
upkeep outside its steps (matmul warm-up, heap trim when idle) in
engine/upkeep.py.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator
from collections.abc import Sequence as Seq
from contextlib import aclosing
from typing import Any

from edgellm.config import EngineConfig
from edgellm.engine.engine import LLMEngine
from edgellm.engine.guarded import abort_or_fail, add_or_fail, step_or_fail
from edgellm.engine.handoff import (
    PendingAdd,
    RequestStream,
    deliver,
    route,
    send,
    stream_outputs,
)
from edgellm.engine.output import RequestOutput
from edgellm.engine.upkeep import TRIM_AFTER_IDLE_S, release_memory, warm_matmuls
from edgellm.sampling import SamplingParams

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    pass


class AsyncEngine:
    def __init__(self, engine: LLMEngine | EngineConfig) -> None:
        """Given a config, the engine is built on the engine thread itself: torch's CPU kernels
        keep an OpenMP thread team per thread that used them, and stepping on a second thread
        after loading on the first would run two teams on the same cores."""
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._adds: list[PendingAdd] = []
        self._aborts: list[str] = []
        self._streams: dict[str, RequestStream] = {}
        self._stopped = False
        self._dead: BaseException | None = None
        self.last_step_time = 0.0
        if isinstance(engine, LLMEngine):
            self.engine = engine
            self._thread = threading.Thread(target=self._loop, name="edgellm-engine", daemon=True)
            self._thread.start()
            return
        built = threading.Event()
        failure: list[BaseException] = []

        def build_then_loop() -> None:
            try:
                self.engine = LLMEngine(engine)
                warm_matmuls(self.engine)  # on this thread too, for the same reason
            except BaseException as exc:  # noqa: BLE001  (handed to the constructor's caller)
                failure.append(exc)
                return
            finally:
                built.set()
            self._loop()

        self._thread = threading.Thread(target=build_then_loop, name="edgellm-engine", daemon=True)
        self._thread.start()
        built.wait()
        if failure:
            self._thread.join()
            raise failure[0]

    # ----------------------------------------------------------------- facts
    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def config(self) -> EngineConfig:
        return self.engine.config

    @property
    def scheduling_policy(self) -> str:
        return self.engine.config.scheduling_policy

    def cache_info(self) -> dict[str, str]:
        """The KV cache's configuration (fixed once built), as LLMEngine.cache_info."""
        return self.engine.cache_info()

    def stats(self) -> dict[str, float]:
        with self._lock:
            s = self.engine.stats()
            s["num_pending_adds"] = len(self._adds)
        return s

    @property
    def num_requests(self) -> int:
        """Requests accepted and not yet finished (queued in the inbox included)."""
        with self._lock:
            return len(self._streams)

    # ------------------------------------------------------------------ API
    def prepare(
        self, prompt: str | Seq[int], params: SamplingParams
    ) -> tuple[str | None, list[int]]:
        """Tokenize and validate in the caller's thread; raises ValueError on bad input."""
        return self.engine.prepare(prompt, params)

    async def compile_grammar(self, params: SamplingParams) -> None:
        """Compile (or find cached) the grammar of params.structured_outputs, off the engine thread;
        raises StructuredOutputError (a ValueError) if it cannot be compiled."""
        if params.structured_outputs is not None:
            await asyncio.wrap_future(self.engine.grammar_future(params))

    async def generate(
        self,
        request_id: str,
        prompt: str | Seq[int],
        params: SamplingParams,
        prepared: tuple[str | None, list[int]] | None = None,
        priority: int = 0,
    ) -> AsyncIterator[RequestOutput]:
        """Submit a request and stream its outputs; closing the stream aborts the request.
        priority: lower runs sooner (the priority scheduling policy; ValueError if not 0 under
        fcfs)."""
        if self._dead is not None:
            raise EngineDeadError(f"the engine has stopped: {self._dead}")
        self.engine.validate_priority(priority)
        text, ids = prepared or self.prepare(prompt, params)
        grammar = None
        if params.structured_outputs is not None:
            # compiled on the grammar thread: the engine keeps stepping the others meanwhile
            grammar = await asyncio.wrap_future(self.engine.grammar_future(params))
        stream = RequestStream(asyncio.get_running_loop())
        with self._wake:
            if self._dead is not None or self._stopped:
                raise EngineDeadError("the engine has stopped")
            if request_id in self._streams:
                raise ValueError(f"request id {request_id!r} is already in use")
            self._streams[request_id] = stream
            self._adds.append(PendingAdd(request_id, ids, text, params, stream, grammar, priority))
            self._wake.notify()
        # closed at once when the caller leaves early, so the abort is not left to the GC
        async with aclosing(stream_outputs(stream, lambda: self.abort(request_id))) as outs:
            async for out in outs:
                yield out

    def abort(self, request_id: str) -> None:
        """Abort from any thread; the request's blocks are freed before the next step."""
        with self._wake:
            self._aborts.append(request_id)
            self._wake.notify()

    def shutdown(self) -> None:
        with self._wake:
            self._stopped = True
            self._wake.notify()
        self._thread.join(timeout=10)

    # --------------------------------------------------------- engine thread
    def _deliver(self, outputs: list[RequestOutput]) -> None:
        with self._lock:
            by_loop = route(self._streams, outputs)
        deliver(by_loop)

    def _drain_inbox(self) -> None:
        with self._lock:
            adds, self._adds = self._adds, []
            aborts, self._aborts = self._aborts, []
        aborted = set(aborts)
        failed: list[tuple[RequestStream, RequestOutput | BaseException]] = []
        for add in adds:
            if add.request_id in aborted:
                with self._lock:
                    self._streams.pop(add.request_id, None)
                continue
            refused = add_or_fail(
                self.engine,
                add.request_id,
                add.prompt_ids,
                add.prompt_text,
                add.params,
                add.grammar,
                add.priority,
            )
            if refused is not None:
                with self._lock:
                    self._streams.pop(add.request_id, None)
                failed.append((add.stream, refused))
        for rid in aborts:
            abort_or_fail(self.engine, rid)
            with self._lock:
                self._streams.pop(rid, None)
        for stream, error in failed:
            send(stream, error)

    def _idle(self) -> bool:
        return not self._adds and not self._aborts and not self.engine.has_unfinished_requests()

    def _loop(self) -> None:
        worked = False  # since memory was last handed back
        try:
            while True:
                with self._wake:
                    if not self._stopped and self._idle():
                        # after a burst, give freed heap back once the engine has been idle a moment
                        self._wake.wait(timeout=TRIM_AFTER_IDLE_S if worked else None)
                    if self._stopped:
                        break
                    idle = self._idle()
                if idle:
                    if worked:
                        release_memory()
                        worked = False
                    continue
                self._iterate()
                worked = True
        except BaseException as exc:
            logger.critical(
                "the engine loop stopped: %s: %s", type(exc).__name__, exc, exc_info=True
            )
            self._dead = exc
        finally:
            self.engine.close()
            if self._dead is None:
                self._dead = EngineDeadError("engine shut down")
            # tell every listener, including requests that arrived after the loop ended
            with self._lock:
                streams, self._streams = list(self._streams.values()), {}
                self._adds = []
            for stream in streams:
                send(stream, EngineDeadError("engine shut down"))

    def _iterate(self) -> None:
        """Drain the inbox and run one step. A failure fails the requests it concerned; the
        engine goes on serving the others."""
        try:
            self._drain_inbox()
        except Exception:
            logger.exception("engine inbox failed; failing every unfinished request")
            self.engine.step_request_ids = None
            self._deliver(
                self.engine.fail_step("internal error in the engine (adding or aborting requests)")
            )
            with self._lock:  # requests lost between the inbox and the engine
                pending = {a.request_id for a in self._adds}
                lost = [
                    (rid, st)
                    for rid, st in self._streams.items()
                    if rid not in self.engine.seqs and rid not in pending
                ]
                for rid, _ in lost:
                    del self._streams[rid]
            for _, stream in lost:
                send(stream, RuntimeError("internal error in the engine (adding the request)"))
            return
        if not self.engine.has_unfinished_requests():
            return
        start = time.perf_counter()
        outputs = step_or_fail(self.engine)
        self.last_step_time = time.perf_counter() - start
        if outputs:
            self._deliver(outputs)
