"""KV pools: one over every layer, or a global pool plus the sliding-window layers' own; the split
holds more context in the same bytes, and that context decodes exactly as transformers does."""

from __future__ import annotations

import torch

from edgellm import LLM, SamplingParams
from edgellm.config import EngineConfig
from edgellm.engine.block_manager import BlockManager
from edgellm.engine.kv_layout import window_pool_cap
from edgellm.engine.runner import kv_cache_bytes_per_block
from edgellm.engine.window_blocks import HybridBlockManager


def test_uniform_models_keep_one_pool(tiny_dir):
    path, _ = tiny_dir("qwen3")
    llm = LLM(str(path), kv_cache_memory=1 << 20)
    assert type(llm.engine.block_manager) is BlockManager
    assert llm.engine.runner.window_null is None


def test_the_window_pool_frees_budget_for_a_context_one_pool_cannot_hold(tiny_dir):
    """Tiny Gemma 3 (one sliding layer, window 24; one global layer): a budget of 16 blocks over
    both layers holds 256 tokens in one pool. Split, the window layer needs only
    window_pool_cap blocks and the global layer gets the rest: a 300-token prompt fits, without
    preemption, and greedy decoding equals transformers'."""
    path, hf_model = tiny_dir("gemma3")
    probe = LLM(str(path), kv_cache_memory=1 << 20)
    per_all = kv_cache_bytes_per_block(probe.engine.model, 16, probe.engine.kv_dtype)
    per_layer = kv_cache_bytes_per_block(probe.engine.model, 16, probe.engine.kv_dtype, 1)
    del probe
    cfg = dict(kv_cache_memory=16 * per_all, max_num_seqs=1, max_num_batched_tokens=32)
    llm = LLM(str(path), **cfg)
    bm = llm.engine.block_manager
    assert isinstance(bm, HybridBlockManager) and bm.window_size == 24
    cap = window_pool_cap(EngineConfig(**cfg), 24)
    assert bm.window.num_blocks == cap == 6
    assert bm.num_blocks == (16 * per_all - cap * per_layer) // per_layer == 26
    assert llm.engine.max_model_len == 26 * 16  # one pool: 16 * 16 = 256

    prompt = torch.randint(0, 320, (300,), generator=torch.Generator().manual_seed(5)).tolist()
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    got = llm.generate([prompt], params)[0].outputs[0].token_ids
    hf_model.generation_config.eos_token_id = None
    hf_model.generation_config.pad_token_id = 0
    with torch.no_grad():
        x = torch.tensor([prompt])
        want = hf_model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=16,
                                 do_sample=False)[0, 300:].tolist()
    assert got == want
    assert llm.engine.scheduler.num_preemptions == 0
    assert bm.num_held_pages == 0


def test_a_small_budget_splits_as_evenly_as_one_pool(tiny_dir):
    """When one pool's blocks are fewer than the window pool's cap, both pools get that many: the
    split never holds less than one pool would."""
    path, _ = tiny_dir("exaone4")
    probe = LLM(str(path), kv_cache_memory=1 << 20)
    per_all = kv_cache_bytes_per_block(probe.engine.model, 16, probe.engine.kv_dtype)
    del probe
    llm = LLM(str(path), kv_cache_memory=8 * per_all)
    bm = llm.engine.block_manager
    assert isinstance(bm, HybridBlockManager)
    assert bm.num_blocks == bm.window.num_blocks == 8
