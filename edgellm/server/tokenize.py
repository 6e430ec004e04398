"""vLLM's POST /tokenize: the token ids a completion prompt or a chat would be served with.

Token-aware routers ask a replica for them before they route: vllm-router's cache_aware policy
posts the request's `prompt` or `messages` here and keeps a prefix tree of token ids per replica.
A body with `messages` is read as a chat completion body (the chat template, tools and
chat_template_kwargs applied exactly as on /v1/chat/completions, add_generation_prompt default
true); one with `prompt` (a string) is tokenized as /v1/completions does (the tokenizer's special
tokens added unless add_special_tokens is false). The answer is vLLM's: {"count", "max_model_len",
"tokens", "token_strs"} (token_strs only with return_token_strs, else null). continue_final_message
is refused (the templates here always close the last message).
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import ValidationError

from edgellm.server.chat_request import ChatCompletionRequest
from edgellm.server.errors import bad_request, from_validation_error
from edgellm.server.served_model import ServedModel
from edgellm.server.serving import chat_prompt, text_prompt_ids


def parse_body(raw: bytes) -> dict[str, Any]:
    """The JSON object of a /tokenize body, checked for one of `prompt` or `messages`."""
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise bad_request(f"the body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise bad_request("the body must be a JSON object")
    if ("prompt" in body) == ("messages" in body):
        raise bad_request("give exactly one of 'prompt' (a string) or 'messages' (a chat)")
    if "prompt" in body and not isinstance(body["prompt"], str):
        raise bad_request("prompt must be a string", param="prompt")
    for flag in (
        "add_special_tokens",
        "add_generation_prompt",
        "continue_final_message",
        "return_token_strs",
    ):
        if flag in body and not isinstance(body[flag], bool):
            raise bad_request(f"{flag} must be a boolean", param=flag)
    if body.get("continue_final_message"):
        raise bad_request(
            "continue_final_message is not supported by this server",
            param="continue_final_message",
            code="unsupported",
        )
    if body.get("model") is not None and not isinstance(body["model"], str):
        raise bad_request("model must be a string", param="model")
    return body


def tokenize(served: ServedModel, body: dict[str, Any]) -> dict[str, Any]:
    """The answer to a parsed /tokenize body for the served model it names."""
    if "messages" in body:
        try:
            req = ChatCompletionRequest.model_validate(
                {
                    k: v
                    for k, v in body.items()
                    if k not in ("add_special_tokens", "return_token_strs")
                }
            )
        except ValidationError as exc:
            raise from_validation_error(exc) from None
        req.check()
        _, ids, _ = chat_prompt(served, req)
    else:
        ids = text_prompt_ids(served, body["prompt"], body.get("add_special_tokens", True))
    strs = None
    if body.get("return_token_strs"):
        strs = served.engine.tokenizer.hf.convert_ids_to_tokens(ids)
    return {
        "count": len(ids),
        "max_model_len": served.engine.max_model_len,
        "tokens": ids,
        "token_strs": strs,
    }
