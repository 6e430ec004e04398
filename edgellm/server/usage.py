"""A response's usage (tokens, prompt tokens served from the prefix cache) and edgellm_timing
(where the request spent its time, ms from the server's receipt of it), also as x-edgellm-*
headers."""

from __future__ import annotations

import math
from typing import Any

from edgellm.engine.output import RequestOutput
from edgellm.server.serving import Prepared


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


def timing_headers(t: dict[str, Any]) -> dict[str, str]:
    names = {
        "queue_ms": "x-edgellm-queue-ms",
        "prefill_ms": "x-edgellm-prefill-ms",
        "ttft_ms": "x-edgellm-ttft-ms",
        "e2e_ms": "x-edgellm-e2e-ms",
        "decode_tokens_per_s": "x-edgellm-decode-tokens-per-s",
    }
    return {h: str(t[k]) for k, h in names.items() if t.get(k) is not None and math.isfinite(t[k])}
