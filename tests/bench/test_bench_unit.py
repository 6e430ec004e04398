"""edgellm bench internals: percentiles, arrivals, summaries, datasets."""

from __future__ import annotations

import math
import statistics

import pytest

from edgellm.bench.client import RequestResult, arrival_gaps, content_of
from edgellm.bench.datasets import random_requests, voice_requests
from edgellm.bench.report import parse_goodput, percentile, summarize


def test_percentile_matches_numpy_linear():
    import numpy as np

    xs = [3.0, 1.0, 9.0, 4.0, 7.5, 2.0, 11.0]
    for p in (0, 50, 90, 95, 99, 100):
        assert percentile(xs, p) == pytest.approx(float(np.percentile(xs, p)))


def test_poisson_and_gamma_arrivals_have_the_requested_rate():
    gaps = arrival_gaps(4000, rate=5.0, burstiness=1.0, seed=1)
    assert statistics.mean(gaps) == pytest.approx(0.2, rel=0.06)
    bursty = arrival_gaps(4000, rate=5.0, burstiness=0.25, seed=1)
    assert statistics.mean(bursty) == pytest.approx(0.2, rel=0.15)
    assert statistics.pstdev(bursty) > 1.5 * statistics.pstdev(gaps)  # burstier than Poisson
    assert arrival_gaps(3, float("inf"), 1.0, 0) == [0.0, 0.0, 0.0]


def test_summary_metrics_and_goodput():
    rs = [
        RequestResult(True, 10, output_tokens=5, ttft=0.1, itl=[0.02] * 4, e2e=0.18),
        RequestResult(True, 20, output_tokens=3, ttft=0.3, itl=[0.05] * 2, e2e=0.4),
        RequestResult(False, 5, error="HTTP 503: busy"),
    ]
    s = summarize(rs, elapsed=2.0, slos=parse_goodput(["ttft:200"]))
    assert s["completed"] == 2 and s["failed"] == 1
    assert s["output_token_throughput"] == pytest.approx(4.0)
    assert s["total_token_throughput"] == pytest.approx((30 + 8) / 2)
    assert s["ttft_ms"]["median"] == pytest.approx(200.0)
    assert s["tpot_ms"]["mean"] == pytest.approx(((0.18 - 0.1) / 4 + (0.4 - 0.3) / 2) / 2 * 1000)
    assert s["goodput"]["requests"] == 1
    assert "HTTP 503: busy" in s["errors"]
    with pytest.raises(ValueError):
        parse_goodput(["latency:3"])
    assert math.isnan(summarize([], 1.0)["ttft_ms"]["median"])


class _WordTokenizer:
    def encode(self, text, add_special_tokens=False):
        return text.split()

    def decode(self, ids):
        return " ".join(ids)


def test_datasets_hit_requested_lengths():
    tok = _WordTokenizer()
    reqs = random_requests(tok, 50, input_len=40, output_len=16, range_ratio=0.5, seed=3, chat=True)
    lens = [len(r.messages[0]["content"].split()) for r in reqs]
    assert min(lens) >= 20 and max(lens) <= 60 and len(set(lens)) > 5
    assert all(r.prompt_len == n for r, n in zip(reqs, lens))
    voice = voice_requests(tok, 5, system_len=100, user_len=8, output_len=64, seed=0)
    systems = {r.messages[0]["content"] for r in voice}
    assert len(systems) == 1 and len(next(iter(systems)).split()) == 100
    assert len({r.messages[1]["content"] for r in voice}) == 5


def test_persona_conversations_share_a_prompt_per_persona_and_grow_turn_by_turn():
    from edgellm.bench.conversations import persona_conversations, turn_request

    tok = _WordTokenizer()
    convs = persona_conversations(tok, personas=3, callers=9, turns=4, system_len=50, user_len=6,
                                  output_len=10, seed=1)
    assert sorted(c.persona for c in convs) == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert [c.persona for c in convs] != sorted(c.persona for c in convs)  # callers interleaved
    systems = {c.persona: c.system for c in convs}
    assert all(c.system == systems[c.persona] for c in convs)
    firsts = {s.split()[3] for s in systems.values()}  # "You are persona N." then the words
    assert len(firsts) == 3 and len({s.split()[4] for s in systems.values()}) >= 2
    assert all(len(c.user_turns) == 4 and all(len(u.split()) == 6 for u in c.user_turns) for c in convs)
    assert len({u for c in convs for u in c.user_turns}) == 36
    c = convs[0]
    history = [{"role": "user", "content": c.user_turns[0]}, {"role": "assistant", "content": "an answer"}]
    req = turn_request(c, history, 1)
    assert req.messages == [{"role": "system", "content": c.system}, *history,
                            {"role": "user", "content": c.user_turns[1]}]
    assert req.prompt_len == 50 + 2 * 6 + 10 and req.output_len == 10
    with pytest.raises(ValueError):
        persona_conversations(tok, 0, 3, 1, 5, 5, 5, 0)


def test_a_tool_call_delta_is_output_like_content():
    """A turn that calls a function has begun its output with the call's first fragment: the
    benchmark's TTFT counts it, as it counts content (and a usage-only chunk carries none)."""
    first = {"choices": [{"index": 0, "delta": {"tool_calls": [
        {"index": 0, "id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": ""}}]}}]}
    more = {"choices": [{"index": 0, "delta": {"tool_calls": [
        {"index": 0, "function": {"arguments": '{"city": "서울"}'}}]}}]}
    assert content_of(first) == "get_weather"
    assert content_of(more) == '{"city": "서울"}'
    assert content_of({"choices": [{"index": 0, "delta": {"content": "Hi"}}]}) == "Hi"
    assert content_of({"choices": [], "usage": {"completion_tokens": 3}}) == ""
    assert content_of({"choices": [{"index": 0, "delta": {"role": "assistant"}}]}) == ""
