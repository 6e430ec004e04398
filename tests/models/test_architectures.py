"""Every architecture, token for token against transformers' own implementation.

For each tiny random model: greedy LLM.generate of a batch of prompts of
different lengths, submitted together, equals transformers' generate run on
each prompt alone — with prefix caching hitting a shared prefix, with a
token budget that forces chunked prefill, and with a KV budget that forces
preemption. prompt_logits matches transformers' logits to 1e-4 (fp32).
"""

from __future__ import annotations

import zlib

import pytest
import torch

from edgellm import LLM, SamplingParams
from edgellm.engine.runner import kv_cache_bytes_per_block
from tests.helpers.tiny_models import ARCHS

NEW_TOKENS = 32
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)


def _prompts(seed: int, vocab: int = 320) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    shared = torch.randint(0, vocab, (37,), generator=g).tolist()  # > 2 blocks of 16
    tails = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (5, 19, 1)]
    alone = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (3, 58)]
    return [shared + t for t in tails] + alone


def _reference(hf_model, prompts: list[list[int]]) -> list[list[int]]:
    hf_model.generation_config.eos_token_id = None  # generate exactly NEW_TOKENS, like ignore_eos
    hf_model.generation_config.pad_token_id = 0
    out = []
    with torch.no_grad():
        for p in prompts:
            x = torch.tensor([p])  # explicit mask: a prompt may contain the pad id
            ids = hf_model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=NEW_TOKENS,
                                    do_sample=False)
            out.append(ids[0, len(p):].tolist())
    return out


@pytest.fixture(scope="module", params=ARCHS)
def arch_case(request, tiny_dir):
    path, hf_model = tiny_dir(request.param)
    prompts = _prompts(zlib.crc32(request.param.encode()) % 1000)
    return request.param, path, hf_model, prompts, _reference(hf_model, prompts)


def _tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def test_prefix_caching_matches_transformers(arch_case):
    arch, path, _, prompts, ref = arch_case
    llm = LLM(str(path), kv_cache_memory=2 << 20, enable_prefix_caching=True)
    first = llm.generate(prompts, GREEDY)
    assert _tokens(first) == ref
    second = llm.generate(prompts, GREEDY)  # the shared prefix and whole prompts are now cached
    assert _tokens(second) == ref
    cached = [o.metrics.num_cached_tokens for o in second]
    assert all(c >= 32 for c in cached[:3]), cached
    assert llm.engine.block_manager.num_held_pages == 0


def test_chunked_prefill_matches_transformers(arch_case):
    arch, path, _, prompts, ref = arch_case
    llm = LLM(str(path), kv_cache_memory=2 << 20, max_num_batched_tokens=13, enable_prefix_caching=False)
    assert _tokens(llm.generate(prompts, GREEDY)) == ref
    assert llm.engine.block_manager.num_held_pages == 0


def test_preemption_matches_transformers(arch_case):
    arch, path, _, prompts, ref = arch_case
    probe = LLM(str(path), kv_cache_memory=1 << 20)
    per_block = kv_cache_bytes_per_block(probe.engine.model, 16, torch.float32)
    # 8 blocks = 128 tokens: one sequence fits, five together (up to 90 tokens each) do not
    llm = LLM(str(path), kv_cache_memory=8 * per_block, max_model_len=128, enable_prefix_caching=True)
    assert _tokens(llm.generate(prompts, GREEDY)) == ref
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.block_manager.num_held_pages == 0


def test_prompt_logits_match_transformers(arch_case):
    arch, path, hf_model, prompts, _ = arch_case
    llm = LLM(str(path), kv_cache_memory=2 << 20, max_num_batched_tokens=29)
    logits = llm.prompt_logits(prompts)
    for p, got in zip(prompts, logits):
        with torch.no_grad():
            want = hf_model(torch.tensor([p])).logits[0].float()
        assert got.dtype == torch.float32 and got.shape == want.shape
        assert (got - want).abs().max().item() < 1e-4


def test_bfloat16_runs_close_to_fp32(tiny_dir):
    path, hf_model = tiny_dir("llama")
    prompt = _prompts(3)[0]
    fp32 = LLM(str(path), kv_cache_memory=1 << 20).prompt_logits([prompt])[0]
    bf16 = LLM(str(path), dtype="bfloat16", kv_cache_memory=1 << 20).prompt_logits([prompt])[0]
    assert bf16.dtype == torch.float32
    err = (bf16 - fp32).abs().max() / fp32.abs().max()
    assert 0 < err < 0.05  # bf16 differs (so it really ran in bf16) but stays close
