"""The transformers baseline server (edgellm/bench/hf_baseline.py, hf_batching.py; run by
benchmarks/hf_baseline_server.py): static batches
are left-padded, so every row must decode exactly as it would alone, stop on its own
terms, and stream OpenAI-shaped chunks that `edgellm bench` can time."""

from __future__ import annotations

import asyncio

import pytest
import torch

from edgellm.bench import hf_baseline, hf_batching
from tests.helpers.serverutil import ThreadServer, build_tiny_chat_model

QUESTIONS = ["Hi", "What is the capital of France, and why is it famous?", "Name three colors."]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(model dir, model, tokenizer, eos ids, pad id) for a tiny Llama with the real tokenizer."""
    path = build_tiny_chat_model(tmp_path_factory.mktemp("hf-baseline"))
    model, tok = hf_batching.load(str(path))
    eos, pad = hf_batching.prepare_model(model, tok)
    return path, model, tok, eos, pad


def _chat_ids(tok, question: str) -> list[int]:
    text = tok.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True, tokenize=False)
    return list(tok.encode(text, add_special_tokens=False))


def _solo(model, ids: list[int], n: int) -> list[int]:
    """Greedy tokens of one unpadded prompt, with generate() and nothing else."""
    with torch.inference_mode():
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return out[0, len(ids):].tolist()


def test_left_padded_batch_decodes_like_each_prompt_alone(tiny):
    _, model, tok, eos, pad = tiny
    prompts = [_chat_ids(tok, q) for q in QUESTIONS]
    assert len({len(p) for p in prompts}) == 3  # different lengths: real padding
    lengths = [6, 10, 8]
    jobs = [hf_batching.Job(p, n, ignore_eos=True, temperature=0.0) for p, n in zip(prompts, lengths)]
    hf_batching.generate_batch(model, tok, jobs, eos, pad)
    for job, p, n in zip(jobs, prompts, lengths):
        assert job.token_ids == _solo(model, p, n)
        assert job.finish_reason == "length"
        assert job.sent_text == tok.decode(job.token_ids, skip_special_tokens=True)


def test_rows_stop_on_their_own_eos_and_max_tokens(tiny):
    _, model, tok, _, pad = tiny
    a, b = (_chat_ids(tok, q) for q in QUESTIONS[:2])
    ref = _solo(model, a, 8)
    stop_token = ref[3]
    stops_at = ref.index(stop_token) + 1  # the first time it comes up
    jobs = [hf_batching.Job(a, 8, ignore_eos=False), hf_batching.Job(b, 8, ignore_eos=True)]
    hf_batching.generate_batch(model, tok, jobs, {stop_token}, pad)
    assert jobs[0].finish_reason == "stop" and jobs[0].token_ids == ref[:stops_at]
    assert jobs[1].finish_reason == "length" and jobs[1].token_ids == _solo(model, b, 8)


def test_two_concurrent_streams_share_a_batch_and_are_openai_shaped(tiny):
    import openai

    _, model, tok, _, _ = tiny
    app = hf_baseline.create_app(model, tok, "tiny", max_batch_size=8, batch_window_ms=400)
    expected = [_solo(model, _chat_ids(tok, q), 7) for q in QUESTIONS[:2]]

    async def stream(client, question: str) -> list:
        s = await client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": question}], max_tokens=7, temperature=0,
            stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        return [chunk async for chunk in s]

    async def run(url: str):
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
        try:
            chats = await asyncio.gather(*(stream(client, q) for q in QUESTIONS[:2]))
            completion = await client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=4,
                                                         temperature=0, stream=True, extra_body={"ignore_eos": True})
            texts = [c async for c in completion]
            models = await client.models.list()
            return chats, texts, models
        finally:
            await client.close()

    with ThreadServer(app) as server:
        chats, text_chunks, models = asyncio.run(run(server.url))
    assert [m.id for m in models.data] == ["tiny"]
    assert 2 in app.state.batcher.batch_sizes  # the two chats ran as one batch

    for chunks, ids in zip(chats, expected):
        content = [c for c in chunks if c.choices]
        assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
        first = content[0].choices[0].delta
        assert first.role == "assistant" and first.content  # role and first text together
        assert all(c.choices[0].delta.role is None for c in content[1:])
        assert content[-1].choices[0].finish_reason == "length"
        assert all(c.choices[0].finish_reason is None for c in content[:-1])
        text = "".join(c.choices[0].delta.content or "" for c in content)
        assert text == tok.decode(ids, skip_special_tokens=True)
        usage = chunks[-1]
        assert usage.choices == [] and usage.usage.completion_tokens == 7
        assert usage.usage.prompt_tokens + 7 == usage.usage.total_tokens

    assert all(c.object == "text_completion" for c in text_chunks)
    assert text_chunks[-1].choices[0].finish_reason == "length"
    assert "".join(c.choices[0].text for c in text_chunks)
