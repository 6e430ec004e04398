"""Engine outputs -> OpenAI response bodies: the JSON response, the SSE events, usage,
logprobs in both OpenAI shapes, and edgellm_timing."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import AsyncIterator
from typing import Any

from edgellm.engine.output import RequestOutput
from edgellm.server import tool_output
from edgellm.server.chunking import SentenceChunker
from edgellm.server.errors import APIError
from edgellm.server.serving import ClientGone, Prepared, Run, ServedModel, dumps

logger = logging.getLogger(__name__)

_MIN_LOGPROB = -9999.0  # JSON has no -inf; OpenAI sends this floor too


# ------------------------------------------------------------ shared pieces
class _Choice:
    def __init__(self, chunk_chars: int | None) -> None:
        self.chunker = SentenceChunker(chunk_chars) if chunk_chars else None
        self.started = False  # has any text (and the role) gone out
        self.lp_sent = 0  # logprob entries already sent
        self.text_offset = 0
        self.last_token_time: float | None = None
        self.final: RequestOutput | None = None


def _logprobs_chat(
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


def _logprobs_completion(
    served: ServedModel,
    entries: list[tuple[float, list[tuple[int, float]]]],
    token_ids: list[int],
    choice: _Choice,
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


def timing(prep: Prepared, finals: list[RequestOutput]) -> dict[str, Any]:
    """edgellm_timing: what the request spent where (ms), from the server's receipt of it."""
    ms = [f.metrics for f in finals if f.metrics is not None]
    t0 = prep.arrival
    sched = [m.first_scheduled for m in ms if m.first_scheduled is not None]
    first = [m.first_token for m in ms if m.first_token is not None]
    done = [m.finished for m in ms if m.finished is not None]
    gen = sum(m.num_generated_tokens for m in ms)
    out: dict[str, Any] = {
        "queue_ms": None,
        "prefill_ms": None,
        "ttft_ms": None,
        "e2e_ms": None,
        "decode_tokens_per_s": None,
    }
    if sched:
        out["queue_ms"] = round((min(sched) - t0) * 1000, 3)
    if sched and first:
        out["prefill_ms"] = round((min(first) - min(sched)) * 1000, 3)
    if first:
        out["ttft_ms"] = round((min(first) - t0) * 1000, 3)
    if done:
        out["e2e_ms"] = round((max(done) - t0) * 1000, 3)
    if first and done and gen > len(ms) and max(done) > min(first):
        out["decode_tokens_per_s"] = round((gen - len(ms)) / (max(done) - min(first)), 2)
    out["prompt_tokens"] = sum(prep.prompt_lens)
    out["cached_tokens"] = _cached_tokens(prep, finals)
    out["completion_tokens"] = gen
    return out


def _cached_tokens(prep: Prepared, finals: list[RequestOutput]) -> int:
    by_prompt: dict[int, int] = {}
    for sub, f in zip(prep.subs, finals):
        if f.metrics is not None:
            by_prompt[sub.prompt_index] = max(
                by_prompt.get(sub.prompt_index, 0), f.metrics.num_cached_tokens
            )
    return sum(by_prompt.values())


def usage(prep: Prepared, finals: list[RequestOutput]) -> dict[str, Any]:
    prompt = sum(prep.prompt_lens)
    completion = sum(len(f.outputs[0].token_ids) for f in finals)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": _cached_tokens(prep, finals)},
    }


def _finish_reason(out: RequestOutput) -> str:
    reason = out.outputs[0].finish_reason or "stop"
    return reason if reason in ("stop", "length") else "stop"


def timing_headers(t: dict[str, Any]) -> dict[str, str]:
    names = {
        "queue_ms": "x-edgellm-queue-ms",
        "prefill_ms": "x-edgellm-prefill-ms",
        "ttft_ms": "x-edgellm-ttft-ms",
        "e2e_ms": "x-edgellm-e2e-ms",
        "decode_tokens_per_s": "x-edgellm-decode-tokens-per-s",
    }
    return {h: str(t[k]) for k, h in names.items() if t.get(k) is not None and math.isfinite(t[k])}


def _observe_itl(run: Run, choice: _Choice, out: RequestOutput) -> None:
    if not out.delta_token_ids:
        return
    now = time.monotonic()
    m = run.served.metrics
    if choice.last_token_time is not None and m is not None:
        m.itl.labels(run.served.name).observe(now - choice.last_token_time)
    choice.last_token_time = now


# ------------------------------------------------------------ non-streaming
async def complete(run: Run) -> tuple[dict[str, Any], dict[str, str]]:
    prep = run.prep
    choices = {s.index: _Choice(None) for s in prep.subs}
    async for index, out in run.events():
        _observe_itl(run, choices[index], out)
        if out.finished:
            choices[index].final = out
    finals: list[RequestOutput] = []
    for s in prep.subs:
        final = choices[s.index].final
        assert final is not None  # events() ends only when every sub-request has finished
        finals.append(final)
    want_lp = prep.subs[0].params.logprobs is not None
    body_choices = []
    for sub, out in zip(prep.subs, finals):
        c = out.outputs[0]
        lp = None
        if want_lp and c.logprobs is not None:
            lp = (
                _logprobs_chat(run.served, c.logprobs, c.token_ids)
                if prep.kind == "chat"
                else _logprobs_completion(run.served, c.logprobs, c.token_ids, choices[sub.index])
            )
        if prep.kind == "chat":
            msg: dict[str, Any] = {"role": "assistant", "content": c.text}
            finish = _finish_reason(out)
            if prep.tools is not None:
                msg, finish = tool_output.message(prep.tools, c.text, finish)
            body_choices.append(
                {"index": sub.index, "message": msg, "logprobs": lp, "finish_reason": finish}
            )
        else:
            body_choices.append(
                {
                    "index": sub.index,
                    "text": c.text,
                    "logprobs": lp,
                    "finish_reason": _finish_reason(out),
                }
            )
    t = timing(prep, finals)
    body = {
        "id": prep.request_id,
        "object": "chat.completion" if prep.kind == "chat" else "text_completion",
        "created": prep.created,
        "model": prep.model,
        "choices": body_choices,
        "usage": usage(prep, finals),
        "system_fingerprint": None,
        "edgellm_timing": t,
    }
    return body, timing_headers(t)


# ---------------------------------------------------------------- streaming
async def stream(run: Run) -> AsyncIterator[str]:
    """SSE events. No event goes out before the first token's text (it would fake TTFT)."""
    prep = run.prep
    req = prep.request
    chat = prep.kind == "chat"
    opts = req.stream_options
    chunk_chars = opts.max_chunk_chars if opts is not None and req.chunking == "sentence" else None
    choices = {s.index: _Choice(chunk_chars) for s in prep.subs}
    want_lp = prep.subs[0].params.logprobs is not None
    include_usage = bool(opts and opts.include_usage)
    obj = "chat.completion.chunk" if chat else "text_completion"
    head = (
        f'{{"id":"{prep.request_id}","object":"{obj}","created":{prep.created},'
        f'"model":{dumps(prep.model)},'
    )
    finals: dict[int, RequestOutput] = {}

    calls = (
        {s.index: tool_output.StreamedCalls(prep.tools) for s in prep.subs} if prep.tools else None
    )

    def event(
        index: int,
        text: str | None,
        out: RequestOutput,
        finish: str | None,
        extra: dict[str, Any] | None = None,
        delta_body: dict[str, Any] | None = None,
    ) -> str:
        choice = choices[index]
        lp = None
        if want_lp:
            entries = (out.outputs[0].logprobs or [])[choice.lp_sent :]
            ids = out.outputs[0].token_ids[choice.lp_sent :]
            choice.lp_sent += len(entries)
            lp = (
                _logprobs_chat(run.served, entries, ids)
                if chat
                else _logprobs_completion(run.served, entries, ids, choice)
            )
        if chat:
            delta: dict[str, Any] = {}
            if not choice.started:
                delta["role"] = "assistant"
            if text is not None:
                delta["content"] = text
            if delta_body:
                delta.update(delta_body)
            body: dict[str, Any] = {
                "index": index,
                "delta": delta,
                "logprobs": lp,
                "finish_reason": finish,
            }
        else:
            body = {"index": index, "text": text or "", "logprobs": lp, "finish_reason": finish}
        choice.started = True
        tail = "".join(f',"{k}":{dumps(v)}' for k, v in (extra or {}).items())
        return f'data: {head}"choices":[{dumps(body)}]{tail}}}\n\n'

    try:
        async for index, out in run.events():
            choice = choices[index]
            _observe_itl(run, choice, out)
            if calls is not None:  # tool calls: the parser decides what each delta is
                deltas = calls[index].feed(out.delta_text)
                if not out.finished:
                    for d in deltas:
                        yield event(index, None, out, None, delta_body=d)
                    continue
                finals[index] = out
                more, reason = calls[index].finish(_finish_reason(out))
                deltas += more
                extra = None
                if not run.unfinished and not include_usage:
                    extra = {"edgellm_timing": timing(prep, [finals[s.index] for s in prep.subs])}
                for d in deltas[:-1]:
                    yield event(index, None, out, None, delta_body=d)
                last_delta = deltas[-1] if deltas else ({} if choice.started else {"content": ""})
                yield event(index, None, out, reason, extra, delta_body=last_delta)
                continue
            if choice.chunker is not None:
                pieces = choice.chunker.push(out.delta_text)
                if out.finished:
                    rest = choice.chunker.flush()
                    if rest:
                        pieces.append(rest)
            else:
                pieces = [out.delta_text] if out.delta_text else []
            if not out.finished:
                for piece in pieces:
                    yield event(index, piece, out, None)
                continue
            finals[index] = out
            last = not run.unfinished
            extra = None
            if last and not include_usage:
                extra = {"edgellm_timing": timing(prep, [finals[s.index] for s in prep.subs])}
            for piece in pieces[:-1]:
                yield event(index, piece, out, None)
            final_text = pieces[-1] if pieces else ("" if not choice.started else None)
            yield event(index, final_text, out, _finish_reason(out), extra)
        if include_usage:
            ordered = [finals[s.index] for s in prep.subs]
            yield (
                f'data: {head}"choices":[],"usage":{dumps(usage(prep, ordered))},'
                f'"edgellm_timing":{dumps(timing(prep, ordered))}}}\n\n'
            )
    except APIError as err:
        yield f"data: {dumps(err.body())}\n\n"
    except ClientGone:
        return
    except Exception:  # a bug here must not leak a trace into the stream
        logger.exception("stream %s failed", prep.request_id)
        internal = APIError(
            500, "The server had an error while processing your request.", code="internal_error"
        )
        yield f"data: {dumps(internal.body())}\n\n"
    finally:
        run.close()
    yield "data: [DONE]\n\n"
