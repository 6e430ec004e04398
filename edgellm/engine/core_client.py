"""EngineProcess: AsyncEngine's interface, with the engine core in a process of its own
(engine/core_process.py holds the core's side and the messages).

The API process keeps the tokenizer (sent over once the core has loaded, so the chat template
and the request checks run here, before anything is queued), one RequestStream per request, and
a reader thread that routes the core's outputs to their streams' event loops. The reader does
little else, so the event loop never waits on the engine and the engine never waits on the loop.
Adds, aborts and compiles go to the pipe through a writer thread, so a caller never blocks on a
full pipe while the core is in a long step. If the core dies, every open request and every later
one gets EngineDeadError.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing
import queue
import threading
from collections.abc import AsyncIterator
from collections.abc import Sequence as Seq
from concurrent.futures import Future
from contextlib import aclosing

from edgellm.config import EngineConfig
from edgellm.engine import request_checks
from edgellm.engine.async_engine import EngineDeadError
from edgellm.engine.core_process import EngineFacts, raised, run_core
from edgellm.engine.handoff import RequestStream, deliver, route, send, stream_outputs
from edgellm.engine.output import RequestOutput
from edgellm.sampling import SamplingParams

logger = logging.getLogger(__name__)

STOP_TIMEOUT_S = 10.0


class EngineProcess:
    def __init__(self, config: EngineConfig) -> None:
        """Start the core and wait until it has loaded the model; raises what loading raised."""
        self.config = config
        ctx = multiprocessing.get_context("spawn")  # fork would copy the API side's threads
        self._conn, child = ctx.Pipe(duplex=True)
        self._proc = ctx.Process(
            target=run_core,
            args=(config, child, logging.getLogger().getEffectiveLevel()),
            name="edgellm-engine-core",
            daemon=True,
        )
        self._proc.start()
        child.close()  # so that the core's exit reads as EOF here
        try:
            first = self._conn.recv()
        except EOFError:
            self._proc.join(STOP_TIMEOUT_S)
            raise RuntimeError(
                f"the engine process exited while loading (exit code {self._proc.exitcode})"
            ) from None
        if first[0] == "failed":
            self._proc.join(STOP_TIMEOUT_S)
            raise raised(first[1])
        facts: EngineFacts = first[1]
        self.tokenizer = facts.tokenizer
        self.max_model_len = facts.max_model_len
        self._vocab_size = facts.vocab_size
        self._cache_info = facts.cache_info
        self._stats = facts.stats
        self._lock = threading.Lock()  # streams, compiles and counters
        self._streams: dict[str, RequestStream] = {}
        self._compiles: dict[int, Future] = {}
        self._keys = itertools.count()
        self._adds_sent = 0
        self._dead: BaseException | None = None
        self._outbox: queue.SimpleQueue[tuple | None] = queue.SimpleQueue()
        self._reader = threading.Thread(target=self._read, name="edgellm-core-reader", daemon=True)
        self._writer = threading.Thread(target=self._send, name="edgellm-core-writer", daemon=True)
        self._reader.start()
        self._writer.start()

    # ----------------------------------------------------------------- facts
    @property
    def scheduling_policy(self) -> str:
        return self.config.scheduling_policy

    def cache_info(self) -> dict[str, str]:
        return dict(self._cache_info)

    def stats(self) -> dict[str, float]:
        """The core's figures after its last step, plus the adds still in the pipe."""
        with self._lock:
            s = dict(self._stats)
            s["num_pending_adds"] = (
                s.get("num_pending_adds", 0) + self._adds_sent - s.pop("adds_received", 0)
            )
        return s

    @property
    def num_requests(self) -> int:
        with self._lock:
            return len(self._streams)

    # ------------------------------------------------------------------ API
    def prepare(
        self, prompt: str | Seq[int], params: SamplingParams
    ) -> tuple[str | None, list[int]]:
        """Tokenize and validate in the caller's thread; raises ValueError on bad input."""
        return request_checks.prepare(
            self.tokenizer, prompt, params, self.max_model_len, self._vocab_size
        )

    async def compile_grammar(self, params: SamplingParams) -> None:
        """Compile (or find cached) the grammar of params.structured_outputs in the core, off its
        stepping thread; raises StructuredOutputError (a ValueError) if it cannot be compiled."""
        if params.structured_outputs is None:
            return
        future: Future = Future()
        with self._lock:
            self._check_alive()
            key = next(self._keys)
            self._compiles[key] = future
            self._write(("compile", key, params))
        await asyncio.wrap_future(future)

    async def generate(
        self,
        request_id: str,
        prompt: str | Seq[int],
        params: SamplingParams,
        prepared: tuple[str | None, list[int]] | None = None,
        priority: int = 0,
    ) -> AsyncIterator[RequestOutput]:
        """As AsyncEngine.generate: stream the request's outputs; closing the stream aborts it."""
        self._check_alive()
        request_checks.check_priority(priority, self.config.scheduling_policy)
        text, ids = prepared or self.prepare(prompt, params)
        await self.compile_grammar(params)  # a bad grammar fails here, before the request exists
        stream = RequestStream(asyncio.get_running_loop())
        with self._lock:
            self._check_alive()
            if request_id in self._streams:
                raise ValueError(f"request id {request_id!r} is already in use")
            self._streams[request_id] = stream
            self._adds_sent += 1
            self._write(("add", request_id, ids, text, params, priority))
        async with aclosing(stream_outputs(stream, lambda: self.abort(request_id))) as outs:
            async for out in outs:
                yield out

    def abort(self, request_id: str) -> None:
        """Abort from any thread; the core frees the request's blocks before its next step."""
        with self._lock:
            self._streams.pop(request_id, None)
            if self._dead is None:
                self._write(("abort", request_id))

    def shutdown(self) -> None:
        with self._lock:
            if self._dead is None:
                self._write(("stop",))
        self._outbox.put(None)  # the writer ends after the stop message
        self._proc.join(STOP_TIMEOUT_S)
        if self._proc.is_alive():
            logger.warning("the engine process did not stop in %.0f s; terminating", STOP_TIMEOUT_S)
            self._proc.terminate()
            self._proc.join(STOP_TIMEOUT_S)
        self._reader.join(STOP_TIMEOUT_S)
        self._writer.join(STOP_TIMEOUT_S)

    # ------------------------------------------------------------- internals
    def _check_alive(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(f"the engine has stopped: {self._dead}")

    def _write(self, msg: tuple) -> None:
        """Queue a message for the core (any thread; never blocks)."""
        self._outbox.put(msg)

    def _send(self) -> None:
        """The writer thread: messages to the pipe in the order they were queued."""
        while (msg := self._outbox.get()) is not None:
            try:
                self._conn.send(msg)
            except OSError:  # the core is gone: the reader sees the pipe close and fails everyone
                return

    def _read(self) -> None:
        reason = "the engine process exited"
        try:
            while True:
                msg = self._conn.recv()
                kind = msg[0]
                if kind == "outputs":
                    self._deliver(msg[1], msg[2])
                elif kind == "stats":
                    with self._lock:
                        self._stats = msg[1]
                elif kind == "rejected":
                    with self._lock:
                        stream = self._streams.pop(msg[1], None)
                    if stream is not None:
                        send(stream, raised(msg[2]))
                elif kind == "compiled":
                    with self._lock:
                        future = self._compiles.pop(msg[1], None)
                    if future is not None:
                        _settle(future, None if msg[2] is None else raised(msg[2]))
                elif kind == "dead":
                    reason = f"the engine stopped: {msg[1]}"
                    break
        except (EOFError, OSError):
            pass
        code = self._proc.exitcode
        self._die(EngineDeadError(reason if code in (None, 0) else f"{reason} (code {code})"))

    def _deliver(self, outputs: list[RequestOutput], stats: dict[str, float]) -> None:
        with self._lock:
            self._stats = stats
            by_loop = route(self._streams, outputs)
        deliver(by_loop)

    def _die(self, exc: EngineDeadError) -> None:
        with self._lock:
            self._dead = self._dead or exc
            streams, self._streams = list(self._streams.values()), {}
            compiles, self._compiles = list(self._compiles.values()), {}
        for stream in streams:
            send(stream, EngineDeadError("engine shut down"))
        for future in compiles:
            _settle(future, EngineDeadError("engine shut down"))


def _settle(future: Future, error: BaseException | None) -> None:
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(error)
