"""One OpenAI request -> validated, tokenized engine sub-requests (prepare -> Prepared).

A request with P prompts and n choices runs as P x n engine requests (choice
index p * n + j), each a Sub; run.py runs them.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, replace
from typing import Any

from edgellm.llm import expand_n
from edgellm.sampling import SamplingParams
from edgellm.server.chat_request import ChatCompletionRequest
from edgellm.server.completion_request import CompletionRequest
from edgellm.server.errors import APIError, bad_request
from edgellm.server.served_model import ServedModel
from edgellm.tools.families import choose_parser
from edgellm.tools.spec import ToolPlan, template_takes_tools, with_generic_prompt


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
