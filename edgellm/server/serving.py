"""One OpenAI request -> validated, tokenized engine sub-requests (prepare) -> a Run.

A request with P prompts and n choices runs as P x n engine requests (choice
index p * n + j); their outputs are merged through one queue. Closing a run
(the client went away, or the stream ended early) aborts every sub-request
that has not finished, so its KV blocks are free before the next step.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from typing import Any

from edgellm.engine.output import RequestOutput
from edgellm.llm import expand_n
from edgellm.sampling import SamplingParams
from edgellm.server.errors import APIError, bad_request
from edgellm.server.metrics import ServerMetrics
from edgellm.server.protocol import ChatCompletionRequest, CompletionRequest
from edgellm.tools.families import check_parser_name, choose_parser
from edgellm.tools.spec import ToolPlan, template_takes_tools, with_generic_prompt

logger = logging.getLogger(__name__)


def dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


@dataclass
class ServedModel:
    """One engine and the names it answers to."""

    names: list[str]
    engine: Any  # AsyncEngine
    max_waiting_requests: int
    metrics: ServerMetrics | None = None
    inflight: int = 0  # admitted sub-requests not yet finished
    created: int = field(default_factory=lambda: int(time.time()))
    # the format of tool calls in its output (a tools.families.PARSERS name); None: the one its
    # chat template asks for, else hermes
    tool_parser: str | None = None
    _token_text: dict[int, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.tool_parser is not None:
            check_parser_name(self.tool_parser)

    @property
    def name(self) -> str:
        return self.names[0]

    def token_text(self, token_id: int) -> str:
        text = self._token_text.get(token_id)
        if text is None:
            tok = self.engine.tokenizer
            text = (
                tok.decode([token_id], skip_special_tokens=False)
                if tok is not None
                else f"<{token_id}>"
            )
            if len(self._token_text) < 200_000:
                self._token_text[token_id] = text
        return text

    @property
    def capacity(self) -> int:
        """Sequences in flight at most: the running batch plus the waiting line."""
        return int(self.engine.engine.config.max_num_seqs) + self.max_waiting_requests

    @property
    def full(self) -> bool:
        return self.inflight >= self.capacity

    def overloaded(self) -> APIError:
        """503 + Retry-After, as OpenAI answers 'engine overloaded' (its 429 means a per-key rate
        limit, which this server has none of); clients, the openai SDK included, retry both."""
        if self.metrics is not None:
            self.metrics.rejected.labels("503").inc()
        return APIError(
            503,
            f"The server is overloaded ({self.inflight} requests in flight, "
            f"room for {self.capacity}); retry shortly.",
            code="server_overloaded",
            headers={"Retry-After": "1"},
        )

    def admit(self, num: int) -> None:
        """Bounded queue: refuse when the waiting line would pass its bound."""
        if num > self.capacity:  # could never run: retrying would not help
            raise bad_request(
                f"this request needs {num} sequences (prompts x n) but the server runs at "
                f"most {self.capacity} at once",
                param="n",
                code="too_many_sequences",
            )
        if self.inflight + num > self.capacity:
            raise self.overloaded()
        self.add_inflight(num)

    def add_inflight(self, delta: int) -> None:
        self.inflight += delta
        if self.metrics is not None:
            self.metrics.inflight.labels(self.name).set(self.inflight)


@dataclass
class Sub:
    index: int  # choice index
    prompt_index: int
    request_id: str
    text: str | None
    ids: list[int]
    params: SamplingParams
    priority: int = 0


@dataclass
class Prepared:
    kind: str  # "chat" | "completion"
    served: ServedModel
    request: ChatCompletionRequest | CompletionRequest
    request_id: str
    created: int
    arrival: float
    subs: list[Sub]
    prompt_lens: list[int]
    tools: ToolPlan | None = None  # chat with tools (mode other than "none"): outputs are parsed

    @property
    def model(self) -> str:
        return self.request.model or self.served.name


# ------------------------------------------------------------------ prepare
def _context_error(prompt_len: int, max_tokens: int | None, limit: int, what: str) -> APIError:
    if max_tokens is None:
        msg = (
            f"This model's maximum context length is {limit} tokens. However, your {what} "
            "resulted in "
            f"{prompt_len} tokens (at most {limit - 1} leave room for one output token). "
            f"Please reduce the length of the {what}."
        )
    else:
        msg = (
            f"This model's maximum context length is {limit} tokens. However, you requested "
            f"{prompt_len + max_tokens} tokens ({prompt_len} in the {what}, {max_tokens} in the "
            f"completion). Please reduce the length of the {what} or completion."
        )
    return bad_request(
        msg, param="messages" if what == "messages" else "prompt", code="context_length_exceeded"
    )


def _check_priority(engine: Any, priority: int) -> None:
    """vLLM's rule: a priority other than 0 needs the priority scheduling policy."""
    if priority != 0 and engine.scheduling_policy != "priority":
        raise bad_request(
            f"Got priority {priority} but priority scheduling is not enabled on this "
            f"server (it runs --scheduling-policy {engine.scheduling_policy}).",
            param="priority",
        )


def chat_prompt(
    served: ServedModel, req: ChatCompletionRequest
) -> tuple[str, list[int], ToolPlan | None]:
    """The chat rendered by the model's template (tools in the template, or in the generic prompt
    when the template takes none), its token ids, and the tool plan (None without tools)."""
    tok = served.engine.tokenizer
    if tok is None:
        raise bad_request(
            "this model has no tokenizer, so no chat template; use /v1/completions with token ids",
            param="messages",
        )
    tools = req.tool_plan()
    if tools is not None and tools.mode == "none":
        tools = None
    conversation = req.conversation()
    kwargs = dict(req.chat_template_kwargs or {})
    if tools is not None:
        template = tok.hf.chat_template
        tools = replace(tools, parser_name=choose_parser(served.tool_parser, template))
        if template_takes_tools(template):
            kwargs["tools"] = tools.tools
        else:
            conversation = with_generic_prompt(conversation, tools.tools)
    try:
        text = tok.render_chat(conversation, req.add_generation_prompt, **kwargs)
    except APIError:
        raise
    except Exception as exc:  # noqa: BLE001  (jinja raises its own errors for bad roles/orders)
        raise bad_request(
            f"the chat template could not render these messages: {exc}", param="messages"
        ) from None
    return text, tok.encode(text, add_special_tokens=False), tools


def text_prompt_ids(served: ServedModel, prompt: str, add_special_tokens: bool = True) -> list[int]:
    """A completion prompt's token ids (the tokenizer's special tokens added, as for generation)."""
    tok = served.engine.tokenizer
    if tok is None:
        raise bad_request(
            "this model has no tokenizer: give the prompt as token ids", param="prompt"
        )
    return tok.encode(prompt, add_special_tokens=add_special_tokens)


def prepare(
    served: ServedModel, req: ChatCompletionRequest | CompletionRequest, arrival: float
) -> Prepared:
    req.check()
    engine = served.engine
    _check_priority(engine, req.priority)
    if isinstance(req, ChatCompletionRequest):
        kind, what, prefix = "chat", "messages", "chatcmpl-"
        chat_text, chat_ids, tools = chat_prompt(served, req)
        prompts: list[tuple[str | None, list[int]]] = [(chat_text, chat_ids)]
    else:
        kind, what, prefix = "completion", "prompt", "cmpl-"
        tools = None
        prompts = [
            (p, text_prompt_ids(served, p)) if isinstance(p, str) else (None, list(p))
            for p in req.prompts()
        ]

    limit = engine.max_model_len
    requested = req.requested_max_tokens()
    if requested is not None and requested < 1:
        raise bad_request(f"max_tokens must be at least 1, got {requested}", param="max_tokens")
    request_id = prefix + uuid.uuid4().hex
    subs: list[Sub] = []
    for p_idx, (text, ids) in enumerate(prompts):
        if len(ids) >= limit:
            raise _context_error(len(ids), None, limit, what)
        if requested is not None and len(ids) + requested > limit:
            raise _context_error(len(ids), requested, limit, what)
        params = req.sampling_params(requested if requested is not None else limit - len(ids))
        if tools is not None:
            params = tools.sampling(params)
        try:
            engine.prepare(ids, params)
        except ValueError as exc:
            raise bad_request(str(exc), param=what) from None
        for j, sp in enumerate(expand_n(params)):
            index = p_idx * params.n + j
            subs.append(Sub(index, p_idx, f"{request_id}-{index}", text, ids, sp, req.priority))
    return Prepared(
        kind,
        served,
        req,
        request_id,
        int(time.time()),
        arrival,
        subs,
        [len(ids) for _, ids in prompts],
        tools,
    )


# ---------------------------------------------------------------------- run
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
