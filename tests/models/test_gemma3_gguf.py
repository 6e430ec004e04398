"""The real Gemma 3 270M Q4_K_M GGUF (a second real model: K-quants, the Gemma 3 layout, a 262k
SentencePiece vocabulary, a file without a chat template), slow tier.

- exact mode's prompt logits equal transformers' own GGUF loading of the same file (which
  dequantizes every tensor to fp32) within fp32 tolerance, and greedy continuations are the
  same tokens, also past the sliding window, cold and from the prefix cache;
- the default (auto) mode keeps the top-1 of the exact logits on the prompts' positions where
  the exact margin is clear;
- end of generation comes from the file's vocabulary (`<end_of_turn>` as well as `<eos>`) and
  the chat template, which the file lacks, is Gemma's own, and `edgellm serve --model <file>` serves it to the openai client.
"""

from __future__ import annotations

import os

import pytest
import torch

from edgellm import LLM, SamplingParams
from edgellm.bench.models import gemma3_270m_path
from tests.helpers.serverutil import serving

pytestmark = pytest.mark.slow

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village by the sea, there lived",
    "<start_of_turn>user\nName three colours.<end_of_turn>\n<start_of_turn>model\n",
]


@pytest.fixture(scope="module")
def gemma_path():
    return gemma3_270m_path()


@pytest.fixture(scope="module")
def hf_model(gemma_path):
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(gemma_path.parent), gguf_file=gemma_path.name, dtype=torch.float32
    )
    return model.eval()


@pytest.fixture(scope="module")
def exact(gemma_path):
    return LLM(str(gemma_path), cpu_quant="exact", max_model_len=512)


def _ids(llm, text):
    return llm.engine.tokenizer.encode(text)


def test_exact_logits_and_greedy_equal_transformers_gguf_loading(exact, hf_model):
    for text in PROMPTS:
        ids = _ids(exact, text)
        ours = exact.prompt_logits([ids])[0].float()
        with torch.no_grad():
            theirs = hf_model(torch.tensor([ids])).logits[0].float()
        assert ours.shape == theirs.shape
        scale = theirs.abs().max().item()
        assert (ours - theirs).abs().max().item() <= 1e-4 * scale, text
        assert torch.equal(ours.argmax(-1), theirs.argmax(-1)), text
    for text in PROMPTS[:2]:
        ids = _ids(exact, text)
        out = exact.generate([ids], SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
        with torch.no_grad():
            ref = hf_model.generate(
                torch.tensor([ids]), max_new_tokens=16, do_sample=False, min_new_tokens=16
            )[0, len(ids) :].tolist()
        assert out[0].outputs[0].token_ids == ref, text


def test_past_the_window_with_the_window_layers_own_pages(gemma_path, hf_model):
    """A prompt longer than the 512-token window: the sliding layers keep only the pages their
    window reaches (engine/window_blocks.py), and greedy decoding equals transformers', first
    cold, then from the prefix cache (a hit whose window pages start past the prompt's head)."""
    llm = LLM(str(gemma_path), cpu_quant="exact", max_model_len=1024, max_num_seqs=4)
    bm = llm.engine.block_manager
    assert bm.window_size == 512 and bm.window.num_blocks < bm.num_blocks
    text = " ".join(f"Item {i}: the {['red', 'green', 'blue'][i % 3]} box." for i in range(90))
    ids = _ids(llm, text)
    assert 600 < len(ids) < 1000
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    with torch.no_grad():
        ref = hf_model.generate(
            torch.tensor([ids]), max_new_tokens=8, do_sample=False, min_new_tokens=8
        )[0, len(ids) :].tolist()
    cold = llm.generate([ids], params)[0]
    warm = llm.generate([ids], params)[0]
    assert cold.outputs[0].token_ids == ref
    assert warm.outputs[0].token_ids == ref
    assert warm.metrics.num_cached_tokens >= len(ids) - 16
    assert bm.num_held_pages == 0


def test_auto_mode_keeps_the_exact_top1_where_the_margin_is_clear(gemma_path, exact):
    auto = LLM(str(gemma_path), max_model_len=512)  # the default cpu_quant
    agree = total = 0
    for text in PROMPTS:
        ids = _ids(exact, text)
        want, got = exact.prompt_logits([ids])[0].float(), auto.prompt_logits([ids])[0].float()
        top2 = want.topk(2, dim=-1).values
        clear = (top2[:, 0] - top2[:, 1]) > 1.0  # nats
        agree += int((got.argmax(-1) == want.argmax(-1))[clear].sum())
        total += int(clear.sum())
    assert total >= 20
    assert agree == total, f"auto changed the top-1 on {total - agree} of {total} clear positions"


def test_the_file_says_how_turns_end_and_how_chats_are_written(exact):
    tok = exact.engine.tokenizer
    end_of_turn = tok.hf.convert_tokens_to_ids("<end_of_turn>")
    assert (
        tok.hf.eos_token_id in exact.engine.eos_token_ids
        and end_of_turn in exact.engine.eos_token_ids
    )
    text = tok.render_chat(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    )
    assert text == "<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\n"


def test_served_to_the_openai_client(gemma_path, tmp_path):
    from openai import OpenAI

    with serving(
        ["--model", str(gemma_path), "--max-model-len", "512"], tmp_path / "serve.log"
    ) as srv:
        client = OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0)
        models = client.models.list().data
        assert len(models) == 1
        done = client.completions.create(
            model=models[0].id, prompt=PROMPTS[0], max_tokens=12, temperature=0
        )
        assert done.choices[0].text.strip() and done.usage.completion_tokens <= 12
        streamed = "".join(
            c.choices[0].text
            for c in client.completions.create(
                model=models[0].id, prompt=PROMPTS[0], max_tokens=12, temperature=0, stream=True
            )
            if c.choices
        )
        assert streamed == done.choices[0].text
        chat = client.chat.completions.create(
            model=models[0].id,
            max_tokens=16,
            temperature=0,
            messages=[{"role": "user", "content": "Name three colours."}],
        )
        assert chat.choices[0].finish_reason in ("stop", "length")
        assert chat.usage.prompt_tokens == len(
            _chat_tokens(gemma_path, [{"role": "user", "content": "Name three colours."}])
        )


def _chat_tokens(path, messages):  # the chat as the server's tokenizer renders it
    from edgellm.loader import resolve_checkpoint
    from edgellm.tokenizer import Tokenizer

    ck = resolve_checkpoint(str(path))
    return Tokenizer.load(
        ck.path, ck.kind, fallback_template=ck.fallback_chat_template
    ).encode_chat(messages)
