"""The engine core in a process of its own: LLMEngine stepping on that process's main thread, fed
and read through one pipe by EngineProcess (engine/core_client.py) in the API server's process.

Why a process: on a CPU the step's compute threads and the API server's event loop (HTTP, SSE,
JSON) share the cores, and in one process the engine thread also waits for the GIL after every
C++ call the loop's work has interleaved with. Here the core's only Python work is its own.

The pipe carries tuples whose first item names the message (a socketpair between the two
processes of this program, which no other process can open). Exceptions cross as error_of()
tuples and are raised again on the API side as the same kind of error.
API -> core: ("add", request_id, prompt_ids, prompt_text, params, priority), ("abort",
request_id), ("compile", key, params), ("stop",).
core -> API: ("ready", EngineFacts) or ("failed", error) once at start; ("outputs",
[RequestOutput], stats) after every step; ("rejected", request_id, error) for an add the
engine refused; ("compiled", key, error or None); ("stats", stats) after an inbox with no
step; ("dead", message) if the loop itself breaks.
An add whose grammar is still compiling (on the engine's grammar thread) waits here without
holding up the others' steps. The core exits on ("stop",) or when the pipe closes.
"""

from __future__ import annotations

import logging
import signal
from concurrent.futures import Future
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from edgellm.config import EngineConfig
from edgellm.engine.engine import LLMEngine
from edgellm.engine.guarded import abort_or_fail, add_or_fail, step_or_fail
from edgellm.engine.upkeep import (
    TRIM_AFTER_IDLE_S,
    freeze_startup_heap,
    release_memory,
    warm_matmuls,
)
from edgellm.structured.spec import StructuredOutputError
from edgellm.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

GRAMMAR_POLL_S = 0.002  # how often an idle core looks at grammars still compiling
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


@dataclass
class EngineFacts:
    """What the API side needs of the engine, fixed once it has loaded."""

    tokenizer: Tokenizer | None
    max_model_len: int
    vocab_size: int
    cache_info: dict[str, str]
    stats: dict[str, float]


Error = tuple[str, str, "str | None"]  # (kind, message, request field) as the pipe carries it


def error_of(exc: BaseException) -> Error:
    """What the API side needs of an exception to raise its like: a request's own errors keep
    their kind (so they stay 400s, with the field they name); anything else is an internal error
    that carries its type's name."""
    if isinstance(exc, StructuredOutputError):
        return ("structured", str(exc), exc.param)
    if isinstance(exc, ValueError):  # CheckpointError and the request checks are ValueErrors
        return ("value", str(exc), None)
    if isinstance(exc, TypeError):
        return ("type", str(exc), None)
    return ("internal", f"{type(exc).__name__}: {exc}", None)


def raised(error: Error) -> BaseException:
    """The exception the API side raises for an error_of()."""
    kind, message, param = error
    if kind == "structured":
        return StructuredOutputError(message, param)
    if kind == "value":
        return ValueError(message)
    if kind == "type":
        return TypeError(message)
    return RuntimeError(message)


def run_core(config: EngineConfig, conn: Connection, log_level: int) -> None:
    """The process's entry: load, report ready (or why not), then serve the pipe until stopped."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C stops the API server, which stops us
    logging.basicConfig(level=log_level, format=LOG_FORMAT)
    try:
        engine = LLMEngine(config)
        warm_matmuls(engine)
    except BaseException as exc:  # noqa: BLE001  (handed to the API side, which raises it)
        conn.send(("failed", error_of(exc)))
        return
    facts = EngineFacts(
        engine.tokenizer,
        engine.max_model_len,
        engine.model_config.vocab_size,
        engine.cache_info(),
        engine.stats(),
    )
    freeze_startup_heap()
    conn.send(("ready", facts))
    CoreLoop(engine, conn).run()


class CoreLoop:
    def __init__(self, engine: LLMEngine, conn: Connection) -> None:
        self.engine = engine
        self.conn = conn
        self.adds_received = 0
        self.compiling: list[tuple[int, Future]] = []  # ("compile", key) asked, not yet answered
        self.waiting: list[tuple[tuple, Future]] = []  # adds whose grammar is compiling
        self.stopped = False

    def stats(self) -> dict[str, float]:
        s = self.engine.stats()
        s["adds_received"] = self.adds_received
        s["num_pending_adds"] = len(self.waiting)
        return s

    def run(self) -> None:
        worked = False  # since memory was last handed back
        try:
            while not self.stopped:
                busy = self.engine.has_unfinished_requests()
                if busy:
                    timeout: float | None = 0.0
                elif self.compiling or self.waiting:
                    timeout = GRAMMAR_POLL_S
                else:  # after a burst, give freed heap back once idle a moment
                    timeout = TRIM_AFTER_IDLE_S if worked else None
                if self.conn.poll(timeout):
                    self._drain()
                    if not self.engine.has_unfinished_requests():
                        self.conn.send(("stats", self.stats()))
                elif worked and not busy:
                    release_memory()
                    worked = False
                self._settle_grammars()
                if self.stopped or not self.engine.has_unfinished_requests():
                    continue
                outputs = step_or_fail(self.engine)
                worked = True
                self.conn.send(("outputs", outputs, self.stats()))
        except (EOFError, OSError):
            pass  # the API side is gone
        except BaseException as exc:
            logger.critical(
                "the engine core stopped: %s: %s", type(exc).__name__, exc, exc_info=True
            )
            try:
                self.conn.send(("dead", f"{type(exc).__name__}: {exc}"))
            except OSError:
                pass
        finally:
            self.engine.close()

    def _drain(self) -> None:
        while not self.stopped and self.conn.poll(0):
            msg = self.conn.recv()
            kind = msg[0]
            if kind == "add":
                self.adds_received += 1
                self._add(msg)
            elif kind == "abort":
                self._abort(msg[1])
            elif kind == "compile":
                self.compiling.append((msg[1], self._grammar(msg[2])))
            elif kind == "stop":
                self.stopped = True
            else:
                logger.error("engine core: unknown message %r", kind)

    def _grammar(self, params: Any) -> Future:
        try:
            return self.engine.grammar_future(params)
        except Exception as exc:  # noqa: BLE001  (no structured outputs here: the caller's error)
            failed: Future = Future()
            failed.set_exception(exc)
            return failed

    def _add(self, msg: tuple) -> None:
        params = msg[4]
        if params.structured_outputs is not None:
            future = self._grammar(params)
            if not future.done():
                self.waiting.append((msg, future))
                return
            self._add_compiled(msg, future)
        else:
            self._add_compiled(msg, None)

    def _add_compiled(self, msg: tuple, future: Future | None) -> None:
        _, rid, ids, text, params, priority = msg
        error: BaseException | None = None
        grammar = None
        if future is not None:
            error = future.exception()
            grammar = None if error is not None else future.result()
        if error is None:
            error = add_or_fail(self.engine, rid, ids, text, params, grammar, priority)
        if error is not None:
            self.conn.send(("rejected", rid, error_of(error)))

    def _abort(self, rid: str) -> None:
        before = len(self.waiting)
        self.waiting = [(m, f) for m, f in self.waiting if m[1] != rid]
        if len(self.waiting) == before:
            abort_or_fail(self.engine, rid)

    def _settle_grammars(self) -> None:
        if self.compiling:
            still = []
            for key, future in self.compiling:
                if future.done():
                    exc = future.exception()
                    self.conn.send(("compiled", key, None if exc is None else error_of(exc)))
                else:
                    still.append((key, future))
            self.compiling = still
        if self.waiting:
            ready: list[tuple[tuple, Future]] = []
            waiting: list[tuple[tuple, Future]] = []
            for item in self.waiting:
                (ready if item[1].done() else waiting).append(item)
            self.waiting = waiting
            for msg, future in ready:
                self._add_compiled(msg, future)
