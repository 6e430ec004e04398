"""Engine outputs -> OpenAI response bodies: the JSON response (complete) and the SSE events
(stream), for chat and text completions."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from typing import Any

from edgellm.engine.output import RequestOutput
from edgellm.server import tool_output
from edgellm.server.choices import (
    Choice,
    finish_reason,
    logprobs_chat,
    logprobs_completion,
    observe_itl,
)
from edgellm.server.errors import APIError
from edgellm.server.run import ClientGone, Run
from edgellm.server.usage import timing, timing_headers, usage

logger = logging.getLogger(__name__)


def dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


# ------------------------------------------------------------ non-streaming
async def complete(run: Run) -> tuple[dict[str, Any], dict[str, str]]:
    prep = run.prep
    choices = {s.index: Choice(None) for s in prep.subs}
    async for index, out in run.events():
        observe_itl(run, choices[index], out)
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
                logprobs_chat(run.served, c.logprobs, c.token_ids)
                if prep.kind == "chat"
                else logprobs_completion(run.served, c.logprobs, c.token_ids, choices[sub.index])
            )
        if prep.kind == "chat":
            msg: dict[str, Any] = {"role": "assistant", "content": c.text}
            finish = finish_reason(out)
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
                    "finish_reason": finish_reason(out),
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
    choices = {s.index: Choice(chunk_chars) for s in prep.subs}
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
                logprobs_chat(run.served, entries, ids)
                if chat
                else logprobs_completion(run.served, entries, ids, choice)
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
            observe_itl(run, choice, out)
            if calls is not None:  # tool calls: the parser decides what each delta is
                deltas = calls[index].feed(out.delta_text)
                if not out.finished:
                    for d in deltas:
                        yield event(index, None, out, None, delta_body=d)
                    continue
                finals[index] = out
                more, reason = calls[index].finish(finish_reason(out))
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
            yield event(index, final_text, out, finish_reason(out), extra)
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
