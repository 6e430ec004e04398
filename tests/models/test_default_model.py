"""The embedded default model (SmolLM2-135M-Instruct, Q4_1 GGUF) end to end:
weights identical to transformers' own GGUF loading, a factual chat answer,
stop strings cut across token boundaries, Korean detokenized cleanly."""

from __future__ import annotations

import pytest
import torch

from edgellm import LLM, SamplingParams
from edgellm.loader import default_model_path

GREEDY = SamplingParams(max_tokens=48, temperature=0.0)


@pytest.fixture(scope="module")
def llm():
    # exact CPU kernels: these tests compare with transformers' logits and batched with solo
    # answers token for token; the default mode's int8 activations are tested against their own
    # reference in tests/quant/test_formats.py and tests/kernels/test_cpu_native.py
    return LLM(kv_cache_memory=64 << 20, cpu_quant="exact")


def test_logits_equal_transformers_gguf_loader(llm):
    from transformers import AutoModelForCausalLM

    path = default_model_path()
    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    ids = llm.get_tokenizer().encode_chat([{"role": "user", "content": "Name three colors."}])
    with torch.no_grad():
        want = hf(torch.tensor([ids])).logits[0]
    got = llm.prompt_logits([ids])[0]
    assert (got - want).abs().max().item() < 1e-3


def test_chat_answers_a_factual_question(llm):
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}], GREEDY)[0]
    assert "Paris" in out.outputs[0].text
    assert out.outputs[0].finish_reason == "stop"  # ended with <|im_end|>, not the length limit


def test_stop_tokens_leave_their_text_out(llm):
    """A stop token (EOS, stop_token_ids) ends the text without its own text, also when special
    tokens are decoded (skip_special_tokens false, as Mistral's tool calls need); with
    include_stop_str_in_output it is kept (vLLM's rules)."""
    ask = [{"role": "user", "content": "What is the capital of France?"}]
    out = llm.chat(ask, SamplingParams(max_tokens=48, temperature=0.0, skip_special_tokens=False))[0].outputs[0]
    eos = llm.get_tokenizer().hf.eos_token
    assert out.finish_reason == "stop" and out.stop_reason is None and out.token_ids[-1] == llm.get_tokenizer().eos_token_ids[0]
    assert "Paris" in out.text and eos not in out.text
    tok = llm.get_tokenizer()
    third = out.token_ids[2]
    cut = llm.chat(ask, SamplingParams(max_tokens=48, temperature=0.0, stop_token_ids=[third]))[0].outputs[0]
    assert cut.token_ids == out.token_ids[:3] and cut.stop_reason == third
    assert cut.text == tok.decode(out.token_ids[:2]) and tok.decode([third]).strip()
    kept = llm.chat(ask, SamplingParams(max_tokens=48, temperature=0.0, stop_token_ids=[third],
                                        include_stop_str_in_output=True))[0].outputs[0]
    assert kept.text == tok.decode(out.token_ids[:3])


def test_generate_batch_equals_one_by_one(llm):
    prompts = ["The sky is", "Once upon a time", "def add(a, b):"]
    together = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
    alone = [llm.generate(p, GREEDY)[0].outputs[0].token_ids for p in prompts]
    assert together == alone


def test_stop_string_across_token_boundary(llm):
    prompt = [{"role": "user", "content": "Write two sentences about the ocean."}]
    full = llm.chat(prompt, SamplingParams(max_tokens=40, temperature=0.0))[0].outputs[0]
    tok = llm.get_tokenizer()
    # pick a stop string that starts inside one token and ends inside a later one
    pieces = [tok.decode([t]) for t in full.token_ids]
    offsets, pos = [], 0
    for piece in pieces:
        offsets.append(pos)
        pos += len(piece)
    i = next(i for i in range(3, len(pieces) - 2) if len(pieces[i]) >= 3 and len(pieces[i + 1]) >= 2)
    start = offsets[i] + 1
    stop = full.text[start:offsets[i + 1] + 2]
    assert full.text.find(stop) == start, "the stop string must first occur where it was cut"
    out = llm.chat(prompt, SamplingParams(max_tokens=40, temperature=0.0, stop=[stop]))[0].outputs[0]
    assert out.text == full.text[:start]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    kept = llm.chat(prompt, SamplingParams(max_tokens=40, temperature=0.0, stop=[stop],
                                           include_stop_str_in_output=True))[0].outputs[0]
    assert kept.text == full.text[:start] + stop


def test_korean_streams_without_broken_characters(llm):
    tok = llm.get_tokenizer()
    text = "안녕하세요. 오늘 날씨가 정말 좋네요! 커피 한 잔 할까요?"
    ids = tok.encode(text, add_special_tokens=False)
    assert len(ids) > len(text.replace(" ", "")) // 2  # byte-level BPE splits the syllables
    detok = tok.detokenizer([1, 2, 3], skip_special_tokens=True)
    deltas = [detok.step(t) for t in ids]
    deltas.append(detok.flush())
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == tok.decode(ids)
    assert sum(1 for d in deltas if d == "") > 0  # some tokens had to be held back


def test_seeded_sampling_reproducible_on_real_model(llm):
    chat = [{"role": "user", "content": "Tell me a story."}]
    p = SamplingParams(max_tokens=24, temperature=0.9, top_p=0.95, seed=11)
    a = llm.chat([chat, chat], p)
    b = llm.chat(chat, p)
    assert len(b[0].outputs[0].token_ids) > 5
    assert a[0].outputs[0].token_ids == a[1].outputs[0].token_ids == b[0].outputs[0].token_ids
    c = llm.chat(chat, SamplingParams(max_tokens=24, temperature=0.9, top_p=0.95, seed=12))
    assert c[0].outputs[0].token_ids != b[0].outputs[0].token_ids


def test_n_completions_and_logprobs(llm):
    params = SamplingParams(max_tokens=8, temperature=1.0, n=3, seed=3, logprobs=2, ignore_eos=True)
    out = llm.generate("Hello", params)[0]
    assert [o.index for o in out.outputs] == [0, 1, 2]
    assert len({tuple(o.token_ids) for o in out.outputs}) > 1
    for o in out.outputs:
        assert len(o.logprobs) == len(o.token_ids)
        assert all(lp <= 0 and len(top) == 2 for lp, top in o.logprobs)


def test_chat_template_override_as_long_string_or_file(tmp_path):
    from edgellm.tokenizer import Tokenizer

    template = ("{# " + "x" * 5000 + " #}{% for m in messages %}[{{ m['role'] }}]: {{ m['content'] }}\n"
                "{% endfor %}[assistant]:")
    tok = Tokenizer.load(default_model_path(), "gguf", chat_template=template)
    assert tok.render_chat([{"role": "user", "content": "hi"}]) == "[user]: hi\n[assistant]:"
    f = tmp_path / "template.jinja"
    f.write_text(template)
    tok = Tokenizer.load(default_model_path(), "gguf", chat_template=str(f))
    assert tok.render_chat([{"role": "user", "content": "hi"}]) == "[user]: hi\n[assistant]:"
