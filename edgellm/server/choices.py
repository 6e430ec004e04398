"""One choice of a response while it is built (Choice: its sentence chunker, what went out so
far), and what each choice carries: logprobs in both OpenAI shapes (chat's `content` list,
completions' parallel lists), its OpenAI finish_reason, and its inter-token latency metric."""

from __future__ import annotations

import time
from typing import Any

from edgellm.engine.output import RequestOutput
from edgellm.server.chunking import SentenceChunker
from edgellm.server.run import Run
from edgellm.server.served_model import ServedModel

_MIN_LOGPROB = -9999.0  # JSON has no -inf; OpenAI sends this floor too


class Choice:
    def __init__(self, chunk_chars: int | None) -> None:
        self.chunker = SentenceChunker(chunk_chars) if chunk_chars else None
        self.started = False  # has any text (and the role) gone out
        self.lp_sent = 0  # logprob entries already sent
        self.text_offset = 0
        self.last_token_time: float | None = None
        self.final: RequestOutput | None = None


def logprobs_chat(
    served: ServedModel, entries: list[tuple[float, list[tuple[int, float]]]], token_ids: list[int]
) -> dict[str, Any]:
    content = []
    for (lp, top), tid in zip(entries, token_ids):
        s = served.token_text(tid)
        content.append(
            {
                "token": s,
                "logprob": max(lp, _MIN_LOGPROB),
                "bytes": list(s.encode()),
                "top_logprobs": [
                    {
                        "token": (t := served.token_text(i)),
                        "logprob": max(v, _MIN_LOGPROB),
                        "bytes": list(t.encode()),
                    }
                    for i, v in top
                ],
            }
        )
    return {"content": content}


def logprobs_completion(
    served: ServedModel,
    entries: list[tuple[float, list[tuple[int, float]]]],
    token_ids: list[int],
    choice: Choice,
) -> dict[str, Any]:
    tokens, token_lps, tops, offsets = [], [], [], []
    for (lp, top), tid in zip(entries, token_ids):
        s = served.token_text(tid)
        tokens.append(s)
        token_lps.append(max(lp, _MIN_LOGPROB))
        tops.append({served.token_text(i): max(v, _MIN_LOGPROB) for i, v in top})
        offsets.append(choice.text_offset)
        choice.text_offset += len(s)
    return {
        "tokens": tokens,
        "token_logprobs": token_lps,
        "top_logprobs": tops,
        "text_offset": offsets,
    }


def finish_reason(out: RequestOutput) -> str:
    reason = out.outputs[0].finish_reason or "stop"
    return reason if reason in ("stop", "length") else "stop"


def observe_itl(run: Run, choice: Choice, out: RequestOutput) -> None:
    if not out.delta_token_ids:
        return
    now = time.monotonic()
    m = run.served.metrics
    if choice.last_token_time is not None and m is not None:
        m.itl.labels(run.served.name).observe(now - choice.last_token_time)
    choice.last_token_time = now
