"""The OpenAI-compatible server, end to end: `edgellm serve` on 127.0.0.1 (a real uvicorn in a
subprocess, the embedded default model, models.yaml with warm_prompts), driven by the official
openai client (sync and async) and by raw HTTP where the wire format itself is under test."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
import time
import uuid

import httpx
import openai
import pytest

from edgellm.server.chunking import is_sentence_end
from tests.helpers.serverutil import ServerProcess, free_port  # noqa: F401  (free_port: re-exported)

MODEL = "test-model"
MAX_MODEL_LEN = 1024
BODY_LIMIT = 256 * 1024  # small, so an over-limit upload fits in the socket buffers
WARM = ("You are Captain Voicebox, a cheerful assistant for the crew of a space station. Keep every "
        "answer under twenty words, and never use lists or markdown.")
STORY = [{"role": "user", "content": "Write a long story about a dragon who learns to bake bread."}]


# ------------------------------------------------------------- the server
@pytest.fixture(scope="session")
def server(tmp_path_factory):
    d = tmp_path_factory.mktemp("serve")
    cfg = d / "models.yaml"
    cfg.write_text(f"models:\n  {MODEL}:\n    source: default\n    max_model_len: {MAX_MODEL_LEN}\n"
                   f"    warm_prompts:\n      - {json.dumps(WARM)}\n")
    # exact CPU kernels: tests here compare concurrent answers with sequential ones token for token,
    # which only the batch-invariant mode guarantees (auto may take a dense matmul for large steps)
    srv = ServerProcess(["--config", str(cfg), "--model", MODEL, "--served-model-name", MODEL, "alias-model",
                         "--cpu-quant", "exact",
                         "--kv-cache-memory", "256M", "--max-request-body", f"{BODY_LIMIT // 1024}K"], d / "server.log")
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="session")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="session")
def aclient_factory(server):
    return lambda: openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="session")
def tokenizer():
    from edgellm.loader import default_model_path
    from edgellm.tokenizer import Tokenizer

    return Tokenizer.load(default_model_path(), "gguf")


def metrics(server: ServerProcess) -> dict[str, float]:
    """name{labels} -> value, from /metrics (labels dropped when only model_name)."""
    out: dict[str, float] = {}
    for line in httpx.get(server.url + "/metrics").text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        key, value = line.rsplit(" ", 1)
        key = re.sub(r'\{model_name="[^"]*"\}', "", key)
        out[key] = float(value)
    return out


def chat_text(stream) -> tuple[str, list]:
    chunks = list(stream)
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices), chunks


def error_body(exc: openai.APIStatusError) -> dict:
    body = exc.response.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    return body["error"]


# ------------------------------------------------------------- endpoints
def test_health_and_models(server, client):
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    models = client.models.list()
    assert {m.id for m in models.data} == {MODEL, "alias-model"}
    assert all(m.object == "model" and m.owned_by == "edgellm" for m in models.data)
    card = httpx.get(server.url + f"/v1/models/{MODEL}").json()
    assert card["max_model_len"] == MAX_MODEL_LEN  # from models.yaml


def test_chat_stream_equals_nonstream_and_usage(client, tokenizer):
    full = client.chat.completions.create(model=MODEL, messages=STORY, max_tokens=16, temperature=0,
                                          logprobs=True)
    assert full.object == "chat.completion" and full.id.startswith("chatcmpl-")
    assert abs(full.created - time.time()) < 120
    text = full.choices[0].message.content
    assert full.choices[0].message.role == "assistant"
    assert full.choices[0].finish_reason == "length"
    assert full.usage.prompt_tokens == len(tokenizer.encode_chat(STORY))
    assert full.usage.completion_tokens == 16 == len(full.choices[0].logprobs.content)
    assert full.usage.total_tokens == full.usage.prompt_tokens + 16

    streamed, chunks = chat_text(client.chat.completions.create(
        model=MODEL, messages=STORY, max_tokens=16, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    assert streamed == text and text
    first = chunks[0].choices[0].delta
    assert first.role == "assistant" and first.content  # role rides on the first token, never empty
    assert all(c.choices[0].delta.role is None for c in chunks[1:] if c.choices)
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]
    assert len({c.id for c in chunks}) == 1 and chunks[0].object == "chat.completion.chunk"
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage is not None
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (
        full.usage.prompt_tokens, 16, full.usage.total_tokens)
    assert all(c.usage is None for c in chunks[:-1])


def test_completions_stream_equals_nonstream_and_usage(client, tokenizer):
    prompt = "The three most important inventions in history are"
    full = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
    assert full.object == "text_completion" and full.id.startswith("cmpl-")
    assert full.usage.prompt_tokens == len(tokenizer.encode(prompt))
    assert full.usage.completion_tokens == 12 and full.choices[0].finish_reason == "length"
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0,
                                            stream=True))
    assert "".join(c.choices[0].text for c in chunks) == full.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "length"
    # the same prompt as token ids gives the same text
    ids = client.completions.create(model=MODEL, prompt=tokenizer.encode(prompt), max_tokens=12, temperature=0)
    assert ids.choices[0].text == full.choices[0].text
    # a batch of prompts: one choice each, in order
    batch = client.completions.create(model=MODEL, prompt=[prompt, "Hello, my name is"], max_tokens=4,
                                      temperature=0)
    assert [c.index for c in batch.choices] == [0, 1]
    assert full.choices[0].text.startswith(batch.choices[0].text)


def test_async_client_stream_and_nonstream(aclient_factory):
    async def run():
        ac = aclient_factory()
        msgs = [{"role": "user", "content": "What is the capital of France?"}]
        full = await ac.chat.completions.create(model=MODEL, messages=msgs, max_tokens=12, temperature=0)
        stream = await ac.chat.completions.create(model=MODEL, messages=msgs, max_tokens=12, temperature=0,
                                                  stream=True)
        text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
        cfull = await ac.completions.create(model="alias-model", prompt="1, 2, 3,", max_tokens=8, temperature=0)
        cstream = await ac.completions.create(model="alias-model", prompt="1, 2, 3,", max_tokens=8,
                                              temperature=0, stream=True)
        ctext = "".join([c.choices[0].text async for c in cstream])
        await ac.close()
        return full.choices[0].message.content, text, cfull.choices[0].text, ctext

    a, b, c, d = asyncio.run(run())
    assert a == b and a
    assert c == d and c


def test_sixteen_concurrent_streams(client, aclient_factory):
    prompts = [f"Write one sentence about the number {i}." for i in range(4)]
    refs = [client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": p}],
                                           max_tokens=16, temperature=0).choices[0].message.content
            for p in prompts]

    async def one(ac, p):
        stream = await ac.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": p}],
                                                  max_tokens=16, temperature=0, stream=True)
        parts, finish = [], None
        async for c in stream:
            parts.append(c.choices[0].delta.content or "")
            finish = c.choices[0].finish_reason or finish
        return "".join(parts), finish

    async def run():
        ac = aclient_factory()
        try:
            return await asyncio.gather(*[one(ac, prompts[i % 4]) for i in range(16)])
        finally:
            await ac.close()

    outs = asyncio.run(run())
    assert len(outs) == 16
    for i, (text, finish) in enumerate(outs):
        assert text == refs[i % 4], i
        assert finish in ("stop", "length")


def test_disconnect_mid_stream_aborts_and_frees_kv(server, client):
    before = metrics(server)
    stream = client.completions.create(model=MODEL, prompt="Once upon a time " * 30, max_tokens=900,
                                       extra_body={"ignore_eos": True}, temperature=0, stream=True)
    for got, _ in enumerate(stream, 1):
        if got == 3:
            break
    during = metrics(server)
    assert during["vllm:num_requests_running"] == 1
    assert during["edgellm:kv_blocks_used"] > 0
    stream.close()  # the listener hangs up (barge-in)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        after = metrics(server)
        if after["vllm:num_requests_running"] == 0 and after["edgellm:kv_blocks_used"] == 0:
            break
        time.sleep(0.02)
    assert after["vllm:num_requests_running"] == 0
    assert after["edgellm:kv_blocks_used"] == 0
    assert after["edgellm:kv_blocks_free"] == after["edgellm:kv_blocks_total"]
    key = 'vllm:request_success_total{finished_reason="abort",model_name="test-model"}'
    assert after[key] == before.get(key, 0) + 1
    # far fewer tokens than asked for were generated
    assert after["vllm:generation_tokens_total"] - before.get("vllm:generation_tokens_total", 0) < 900


def test_disconnect_non_stream_aborts(server):
    with pytest.raises(httpx.TimeoutException):
        httpx.post(server.url + "/v1/completions", timeout=1.0,
                   json={"model": MODEL, "prompt": "Hello", "max_tokens": 900, "ignore_eos": True})
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        m = metrics(server)
        if m["vllm:num_requests_running"] == 0 and m["edgellm:kv_blocks_used"] == 0:
            break
        time.sleep(0.02)
    assert m["vllm:num_requests_running"] == 0 and m["edgellm:kv_blocks_used"] == 0


# ------------------------------------------------------------ SSE on the wire
def test_sse_wire_format(server):
    with httpx.stream("POST", server.url + "/v1/chat/completions", timeout=60, json={
            "model": MODEL, "messages": STORY, "max_tokens": 6, "temperature": 0, "stream": True}) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        assert r.headers["cache-control"] == "no-cache"
        assert r.headers["x-accel-buffering"] == "no"
        raw = r.read().decode()
    events = raw.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    payloads = [json.loads(e[len("data: "):]) for e in events[:-2]]
    assert all(e.startswith("data: ") for e in events[:-1])
    first = payloads[0]["choices"][0]["delta"]
    assert first["role"] == "assistant" and first["content"]
    assert payloads[-1]["choices"][0]["finish_reason"] == "length"
    assert "edgellm_timing" in payloads[-1]


# ------------------------------------------------------------- voice extras
def _sentence_stream(client, max_chunk_chars=80, **kw):
    opts = {"chunking": "sentence", "max_chunk_chars": max_chunk_chars}
    return [c for c in client.completions.create(model=MODEL, temperature=0, stream=True, stream_options=opts, **kw)]


def _check_chunks(chunks: list[str], max_chars: int) -> None:
    assert len(chunks) >= 2
    for c in chunks[:-1]:
        assert len(c) <= max_chars
        assert is_sentence_end(c) or c.endswith(" ") or len(c) == max_chars, repr(c)


def test_sentence_chunking_english(client):
    kw = {"prompt": "Here are five short facts about the sun. Fact one:", "max_tokens": 48}
    token_text = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, temperature=0, stream=True, **kw))
    chunks = _sentence_stream(client, **kw)
    texts = [c.choices[0].text for c in chunks]
    assert "".join(texts) == token_text
    _check_chunks(texts, 80)
    assert sum(is_sentence_end(t) for t in texts[:-1]) >= 1
    assert len(texts) < 48  # whole sentences, not tokens
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")


def test_sentence_chunking_korean(client):
    line = "한국어 문장: 오늘은 날씨가 좋아요. 내일도 좋을까요? 네, 그렇습니다.\n"
    kw = {"prompt": line * 2 + "한국어 문장:", "max_tokens": 64}
    token_text = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, temperature=0, stream=True, **kw))
    texts = [c.choices[0].text for c in _sentence_stream(client, **kw)]
    assert "".join(texts) == token_text
    _check_chunks(texts, 80)
    korean_ends = [t for t in texts[:-1] if re.search(r"[\uac00-\ud7a3][.?!]\s*$", t)]
    assert len(korean_ends) >= 2, texts


def test_sentence_chunking_chat(client):
    msgs = [{"role": "user", "content": "Tell me about the moon in three sentences."}]
    ref = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=40, temperature=0)
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=msgs, max_tokens=40, temperature=0, stream=True,
        stream_options={"chunking": "sentence", "include_usage": True}))
    texts = [c.choices[0].delta.content or "" for c in chunks if c.choices]
    assert "".join(texts) == ref.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].usage.completion_tokens == ref.usage.completion_tokens
    assert all(is_sentence_end(t) or len(t) == 200 or t.endswith(" ") for t in texts[:-1])


def test_timing_in_body_headers_and_final_chunk(client):
    raw = client.chat.completions.with_raw_response.create(model=MODEL, messages=STORY, max_tokens=8,
                                                           temperature=0)
    resp = raw.parse()
    t = resp.model_extra["edgellm_timing"]
    assert 0 < t["ttft_ms"] <= t["e2e_ms"]
    assert t["queue_ms"] >= 0 and t["prefill_ms"] > 0
    assert abs(t["queue_ms"] + t["prefill_ms"] - t["ttft_ms"]) < 1.0
    assert t["decode_tokens_per_s"] > 0
    assert t["completion_tokens"] == resp.usage.completion_tokens == 8
    assert float(raw.headers["x-edgellm-ttft-ms"]) == t["ttft_ms"]
    for h in ("x-edgellm-queue-ms", "x-edgellm-prefill-ms", "x-edgellm-e2e-ms", "x-edgellm-decode-tokens-per-s"):
        assert float(raw.headers[h]) >= 0
    chunks = list(client.chat.completions.create(model=MODEL, messages=STORY, max_tokens=8, temperature=0,
                                                 stream=True))
    assert chunks[-1].model_extra["edgellm_timing"]["ttft_ms"] > 0
    assert all("edgellm_timing" not in (c.model_extra or {}) for c in chunks[:-1])


def test_warm_prompt_gives_prefix_cache_hit_on_first_request(client):
    def first(system: str):
        return client.chat.completions.create(
            model=MODEL, max_tokens=2, temperature=0,
            messages=[{"role": "system", "content": system}, {"role": "user", "content": "How far is Mars?"}])

    warm = first(WARM)  # no request before this one used WARM: only start-up warmed it
    cached = warm.usage.prompt_tokens_details.cached_tokens
    assert cached >= 32 and cached % 16 == 0
    assert warm.model_extra["edgellm_timing"]["cached_tokens"] == cached
    cold = first(f"{uuid.uuid4().hex} is your name. " + WARM)
    assert cold.usage.prompt_tokens_details.cached_tokens == 0


# ------------------------------------------------------------ request fields
def test_stop_strings(client):
    msgs = [{"role": "user", "content": "Count from 1 to 20."}]
    ref = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=24, temperature=0)
    text = ref.choices[0].message.content
    stop = text.split()[2]  # a string the greedy output is known to contain
    want = text[:text.index(stop)]
    stopped = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=24, temperature=0,
                                             stop=[stop, "never-appears"])
    assert stopped.choices[0].message.content == want
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.usage.completion_tokens < ref.usage.completion_tokens
    streamed, _ = chat_text(client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=24,
                                                           temperature=0, stop=stop, stream=True))
    assert streamed == want


def test_seed_and_n(client):
    kw = {"model": MODEL, "messages": [{"role": "user", "content": "Invent a name for a cat."}], "max_tokens": 10,
              "temperature": 1.0}
    a = client.chat.completions.create(seed=7, **kw).choices[0].message.content
    b = client.chat.completions.create(seed=7, **kw).choices[0].message.content
    c = client.chat.completions.create(seed=8, **kw).choices[0].message.content
    assert a == b
    both = client.chat.completions.create(seed=7, n=2, **kw)
    assert [ch.index for ch in both.choices] == [0, 1]
    assert [ch.message.content for ch in both.choices] == [a, c]  # n runs as seeds 7, 8
    assert both.usage.completion_tokens == sum(
        len(client.chat.completions.create(seed=s, logprobs=True, **kw).choices[0].logprobs.content) for s in (7, 8))
    # streamed n: each choice gets its role once and finishes once
    chunks = list(client.chat.completions.create(seed=7, n=2, stream=True, **kw))
    for i, ref in enumerate([a, c]):
        mine = [ch.choices[0] for ch in chunks if ch.choices and ch.choices[0].index == i]
        assert "".join(m.delta.content or "" for m in mine) == ref
        assert sum(m.delta.role == "assistant" for m in mine) == 1
        assert sum(m.finish_reason is not None for m in mine) == 1


def test_penalties_change_greedy_output(client):
    kw = {"model": MODEL, "prompt": "the the the the the the the the the the", "max_tokens": 16, "temperature": 0}
    plain = client.completions.create(**kw).choices[0].text
    freq = client.completions.create(frequency_penalty=2.0, **kw).choices[0].text
    rep = client.completions.create(extra_body={"repetition_penalty": 1.8}, **kw).choices[0].text
    pres = client.completions.create(presence_penalty=2.0, **kw).choices[0].text
    assert plain.count("the") > freq.count("the")
    assert rep != plain and pres != plain


def test_ignore_eos_and_min_tokens(client):
    kw = {"model": MODEL, "messages": [{"role": "user", "content": "Reply with just the word yes."}],
              "max_tokens": 48, "temperature": 0}
    short = client.chat.completions.create(**kw)
    n = short.usage.completion_tokens
    assert short.choices[0].finish_reason == "stop" and n < 40
    forced = client.chat.completions.create(extra_body={"ignore_eos": True}, **kw)
    assert forced.usage.completion_tokens == 48 and forced.choices[0].finish_reason == "length"
    floor = client.chat.completions.create(extra_body={"min_tokens": n + 6}, **kw)
    assert floor.usage.completion_tokens >= n + 6


def test_logprobs(client):
    resp = client.chat.completions.create(model=MODEL, messages=STORY, max_tokens=8, temperature=0,
                                          logprobs=True, top_logprobs=3)
    content = resp.choices[0].logprobs.content
    assert len(content) == resp.usage.completion_tokens == 8
    for entry in content:
        tops = [t.logprob for t in entry.top_logprobs]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True)
        assert entry.logprob == pytest.approx(tops[0])  # greedy picks the most likely token
        assert entry.logprob <= 0 and bytes(entry.bytes).decode() == entry.token
    assert "".join(e.token for e in content) == resp.choices[0].message.content
    # streamed: the entries arrive spread over the chunks, same numbers
    chunks = list(client.chat.completions.create(model=MODEL, messages=STORY, max_tokens=8, temperature=0,
                                                 logprobs=True, top_logprobs=3, stream=True))
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in content])
    comp = client.completions.create(model=MODEL, prompt="Paris is the capital of", max_tokens=5,
                                     temperature=0, logprobs=2)
    lp = comp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert all(len(t) == 2 for t in lp.top_logprobs)
    assert lp.text_offset[0] == 0 and "".join(lp.tokens) == comp.choices[0].text


def test_content_parts_unknown_fields_user_and_max_completion_tokens(client):
    q = "What color is the sky?"
    plain = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": q}],
                                           max_tokens=10, temperature=0)
    parts = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": [{"type": "text", "text": "What color "},
                                                            {"type": "text", "text": "is the sky?"}]}],
        max_tokens=10, temperature=0, user="caller-42", extra_body={"frobnicate": {"x": 1}, "service_tier": "auto", "priority": 0})
    assert parts.choices[0].message.content == plain.choices[0].message.content
    capped = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": q}],
                                            max_completion_tokens=3, temperature=0)
    assert capped.usage.completion_tokens == 3


# ------------------------------------------------------------------ errors
@pytest.mark.parametrize("body, param", [
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": "5"}, "max_tokens"),
    ({"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}, "temperature"),
    ({"messages": [{"role": "user", "content": "x"}], "stream": "yes"}, "stream"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages.0.content"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages.0.role"),
    ({"messages": "hello"}, "messages"),
    ({}, "messages"),
    ({"messages": [{"role": "user", "content": "x"}], "temperature": -1}, "temperature"),
    ({"messages": [{"role": "user", "content": "x"}], "top_p": 0}, "top_p"),
    ({"messages": [{"role": "user", "content": "x"}], "n": 0}, "n"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, "max_tokens"),
    ({"messages": [{"role": "user", "content": "x"}], "presence_penalty": 5}, "presence_penalty"),
    ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 3}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 30}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "stop": ["a"] * 40}, "stop"),
    ({"messages": [{"role": "user", "content": "x"}], "stream_options": {"include_usage": True}},
     "stream_options"),
    ({"messages": [{"role": "user", "content": "x"}], "stream": True, "stream_options": {"chunking": "word"}},
     "stream_options.chunking"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages.content.0.type"),
    ({"messages": []}, "messages"),
])
def test_bad_chat_requests_are_400(server, body, param):
    r = httpx.post(server.url + "/v1/chat/completions", json={"model": MODEL, **body}, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error" and err["param"] == param, err
    assert "Traceback" not in r.text


def test_bad_json_and_non_object_bodies(server):
    for raw in (b"{bad", b"[1, 2]", b"", b"null"):
        r = httpx.post(server.url + "/v1/completions", content=raw, headers={"content-type": "application/json"})
        assert r.status_code == 400, raw
        assert r.json()["error"]["type"] == "invalid_request_error"


def test_wrong_type_through_openai_client(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=4, extra_body={"top_k": "ten"})
    assert info.value.status_code == 400
    assert error_body(info.value)["param"] == "top_k"


def test_prompt_too_long_names_the_limit(client):
    long = "hello " * (MAX_MODEL_LEN + 100)
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": long}], max_tokens=4)
    err = error_body(info.value)
    assert err["code"] == "context_length_exceeded" and str(MAX_MODEL_LEN) in err["message"]
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="hello", max_tokens=MAX_MODEL_LEN)
    err = error_body(info.value)
    assert err["code"] == "context_length_exceeded" and str(MAX_MODEL_LEN) in err["message"]
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt=[10**7], max_tokens=2)
    assert "vocabulary" in error_body(info.value)["message"]
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="", max_tokens=2)


def test_unknown_model_and_route_are_404(server, client):
    for name in ("nope", "/etc/passwd", "../models.yaml", "default"):
        with pytest.raises(openai.NotFoundError) as info:
            client.chat.completions.create(model=name, messages=[{"role": "user", "content": "x"}], max_tokens=2)
        err = error_body(info.value)
        assert err["code"] == "model_not_found" and err["param"] == "model"
    r = httpx.get(server.url + "/v1/nothing-here")
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    r = httpx.get(server.url + "/v1/chat/completions")
    assert r.status_code == 405 and set(r.json()["error"]) == {"message", "type", "param", "code"}


def test_body_over_limit_is_413(server):
    big = {"model": MODEL, "prompt": "x" * (BODY_LIMIT + 1000), "max_tokens": 1}
    r = httpx.post(server.url + "/v1/completions", json=big, timeout=60)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    assert str(BODY_LIMIT) in r.json()["error"]["message"]

    def chunked():  # no Content-Length: the limit is enforced while reading
        yield b'{"prompt": "'
        for _ in range(5):
            yield b"x" * (BODY_LIMIT // 4)
        yield b'"}'

    r = httpx.post(server.url + "/v1/completions", content=chunked(), timeout=60)
    assert r.status_code == 413
    # just under the limit is fine
    ok = {"model": MODEL, "prompt": "Hi", "max_tokens": 1, "padding": "x" * (BODY_LIMIT - 200)}
    assert httpx.post(server.url + "/v1/completions", json=ok, timeout=60).status_code == 200


def test_metrics_names_and_counts(server, client):
    client.completions.create(model=MODEL, prompt="Hi", max_tokens=3, temperature=0)
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(server.url + "/metrics").text
    names = {f.name for f in text_string_to_metric_families(text)}
    for want in ("vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds",
                 "vllm:e2e_request_latency_seconds", "vllm:request_queue_time_seconds",
                 "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "edgellm:kv_blocks_used", "edgellm:kv_blocks_free", "vllm:gpu_prefix_cache_hit_rate",
                 "vllm:prefix_cache_queries", "vllm:prefix_cache_hits", "vllm:prompt_tokens",
                 "vllm:generation_tokens", "vllm:request_success"):
        assert want in names, want
    m = metrics(server)
    assert m["vllm:time_to_first_token_seconds_count"] >= 1
    assert m["vllm:inter_token_latency_seconds_count"] >= 2
    assert m["vllm:prompt_tokens_total"] > 0 and m["vllm:generation_tokens_total"] >= 3
    assert m["vllm:prefix_cache_hits_total"] > 0  # the warm prompt, at least


# ------------------------------------------------------------ edgellm bench
def test_bench_against_the_server(server, tmp_path):
    """`edgellm bench` drives the real server: voice workload, fixed output lengths, JSON + plot."""
    out, png = tmp_path / "bench.json", tmp_path / "bench.png"
    proc = subprocess.run(
        [sys.executable, "-m", "edgellm.cli", "bench", "--base-url", server.url, "--model", MODEL,
         "--dataset", "voice", "--system-prompt-len", "64", "--user-len", "8", "--output-len", "6",
         "--num-prompts", "6", "--sweep", "1,3", "--goodput", "ttft:60000", "--json", str(out),
         "--plot", str(png), "--no-progress"],
        capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "Time to First Token" in proc.stdout
    runs = json.loads(out.read_text())["runs"]
    assert [r["concurrency"] for r in runs] == [1, 3]
    for r in runs:
        assert r["completed"] == 6 and r["failed"] == 0
        assert r["total_output_tokens"] == 36  # ignore_eos: exactly output-len tokens each
        assert 0 < r["ttft_ms"]["median"] <= r["e2e_ms"]["median"]
        assert r["goodput"]["requests"] == 6
    assert png.stat().st_size > 10_000


def test_bench_stops_when_the_initial_test_request_fails(server):
    """Like `vllm bench serve`, one unmeasured request goes first; when it fails the benchmark
    says so and stops instead of timing errors."""
    proc = subprocess.run(
        [sys.executable, "-m", "edgellm.cli", "bench", "--base-url", server.url, "--model", "no-such-model",
         "--num-prompts", "3", "--input-len", "8", "--output-len", "2", "--no-progress"],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 1
    assert "initial test request failed" in proc.stderr and "404" in proc.stderr
    assert "Time to First Token" not in proc.stdout
