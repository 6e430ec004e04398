"""Request outputs, and turning sampled tokens into text and finish decisions
(EOS, stop ids, max tokens, stop strings with hold-back while streaming)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from edgellm.engine.sequence import FinishReason, Sequence
from edgellm.tokenizer import IncrementalDetokenizer, Tokenizer


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # per token: (chosen logprob, [(token id, logprob) x top-N])
    logprobs: list[tuple[float, list[tuple[int, float]]]] | None = None
    # LLM.chat(tools=...): the parsed calls, OpenAI-shaped {"id", "type", "function": {"name",
    # "arguments"}}
    tool_calls: list[dict[str, Any]] | None = None


@dataclass
class RequestMetrics:
    arrival: float
    first_scheduled: float | None
    first_token: float | None
    finished: float | None
    num_prompt_tokens: int
    num_cached_tokens: int
    num_generated_tokens: int
    num_preemptions: int


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    delta_text: str = ""  # text released since the previous output of this request
    delta_token_ids: list[int] = field(default_factory=list)
    metrics: RequestMetrics | None = None
    prompt_logits: torch.Tensor | None = None
    error: str | None = None
    error_param: str | None = None  # the request field at fault: the error is a 400, not a 500


class TextState:
    """Per-sequence detokenization and stop-string matching.

    `text` is everything decoded so far (cut at a stop string once found);
    `released` is how much of it has been handed out. While stop strings are
    set, a tail of the text that could be the start of one is held back.
    """

    def __init__(self, seq: Sequence, tokenizer: Tokenizer | None) -> None:
        self.detok: IncrementalDetokenizer | None = (
            tokenizer.detokenizer(seq.prompt_token_ids, seq.params.skip_special_tokens)
            if tokenizer is not None
            else None
        )
        self.stops = seq.params.stop_strings
        self.max_stop = max((len(s) for s in self.stops), default=0)
        self.text = ""
        self.released = 0
        self.num_tokens_seen = 0

    def add_token(self, token_id: int) -> str | None:
        """Append one token's text; returns the stop string if the text now contains one."""
        self.num_tokens_seen += 1
        if self.detok is None:
            return None
        start = max(len(self.text) - self.max_stop + 1, 0)
        self.text += self.detok.step(token_id)
        return self._find_stop(start)

    def _find_stop(self, start: int) -> str | None:
        best: tuple[int, str] | None = None
        for stop in self.stops:
            idx = self.text.find(stop, start)
            if idx != -1 and (best is None or idx < best[0]):
                best = (idx, stop)
        if best is None:
            return None
        self.text = self.text[: best[0]]
        return best[1]

    def finish(self, stop: str | None, include_stop: bool) -> None:
        """Stopped by string `stop` (text already cut before it), or by anything else (None)."""
        if stop is not None:
            if include_stop:
                self.text += stop
        elif self.detok is not None:
            self.text += self.detok.flush()

    def release(self, finished: bool) -> str:
        """Text that is safe to hand out now."""
        end = len(self.text)
        if not finished and self.stops:
            # hold back the longest tail that is a prefix of some stop string
            for k in range(min(self.max_stop - 1, end), 0, -1):
                tail = self.text[end - k :]
                if any(s.startswith(tail) for s in self.stops):
                    end -= k
                    break
        delta = self.text[self.released : end]
        self.released = max(self.released, end)
        return delta


def check_finish(seq: Sequence, token_id: int, max_model_len: int) -> FinishReason | None:
    """Finish decision from the token alone (stop strings are checked on the text)."""
    p = seq.params
    n_out = len(seq.output_token_ids)
    if n_out >= p.min_tokens:
        if token_id in seq.eos_token_ids:
            seq.stop_reason = None
            return FinishReason.STOP
        if p.stop_token_ids and token_id in p.stop_token_ids:
            seq.stop_reason = token_id
            return FinishReason.STOP
    if p.max_tokens is not None and n_out >= p.max_tokens:
        return FinishReason.LENGTH
    if seq.num_tokens >= max_model_len:
        return FinishReason.LENGTH
    return None
