"""The KV cache's element type (edgellm/config.kv_cache_torch_dtype, chosen at load): what each
kv_cache_dtype gives on each device and CPU mode, and an fp16 cache through the whole CPU engine:
the fused decode pass and the layer path write and read it alike, and its outputs stay within
fp16's rounding of the fp32 cache's."""

from __future__ import annotations

import pytest
import torch

from edgellm.config import EngineConfig, kv_cache_torch_dtype
from edgellm.kernels import cpu_native
from tests.helpers.fused_paths import check_fused_against_layers


@pytest.mark.parametrize(
    "name,model,device,fast,want",
    [
        ("fp16", torch.float32, "cpu", False, torch.float16),
        ("fp32", torch.float32, "cpu", True, torch.float32),  # mode auto's kernels, fp32 pages
        ("float16", torch.bfloat16, "cuda", False, torch.float16),
        ("fp8", torch.float32, "cpu", True, torch.float8_e4m3fn),
        ("auto", torch.float32, "cpu", True, torch.float16),  # integer dots run on CPU
        ("auto", torch.float32, "cpu", False, torch.float32),  # exact linears: transformers' math
        ("auto", torch.bfloat16, "cpu", True, torch.bfloat16),  # a bf16 model keeps its dtype
        ("auto", torch.bfloat16, "cuda", True, torch.bfloat16),
    ],
)
def test_what_each_kv_cache_dtype_gives(name, model, device, fast, want):
    assert kv_cache_torch_dtype(name, model, device, fast) == want


def test_an_unknown_kv_cache_dtype_is_refused_by_name():
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, fp32"):
        EngineConfig(kv_cache_dtype="int4")


def test_auto_is_fp16_only_where_the_load_runs_integer_dots(tiny_dir):
    """The default model (Q4_1) in mode auto runs integer dots: fp16 pages; in mode exact, and an
    unquantized model in mode auto (exact fp32 linears, transformers' logits), fp32 pages."""
    from edgellm import LLM

    path, _ = tiny_dir("llama")
    for source, mode, want in ((None, "auto", torch.float16), (None, "exact", torch.float32),
                               (str(path), "auto", torch.float32)):
        llm = LLM(source, kv_cache_memory=8 << 20, max_model_len=64, cpu_quant=mode)
        assert {a.kv_cache.dtype for a in llm.engine.model.attention_layers()} == {want}


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_fused_decode_with_an_fp16_cache(tiny_dir, arch):
    """The fused pass rounds K/V to fp16 as the layer path does (nearest even) and reads them back
    exactly; the paths' K/V differ only by fp32 summation noise before rounding, which can move a
    value to the neighbouring fp16 number (a relative 2^-11): measured gaps ~1e-6, where a wrong
    page, a truncating conversion or a stale slot moves logprobs by 1e-2 and more. (Gemma 3: its
    sliding-window layers keep their own pool of pages.)"""
    assert cpu_native.load() is not None, "the C++ CPU kernels did not build"
    path, _ = tiny_dir(arch)
    check_fused_against_layers(path, "fp16", torch.float16, 11, (7, 26), 28, 1e-3)


def test_an_fp16_cache_stays_within_its_rounding_of_the_fp32_one(tiny_dir):
    """The same prompts' logits (mode auto, chunked so that later chunks read the earlier ones'
    K/V from the pages through the C++ prefill kernel) with an fp16 and an fp32 cache: they differ
    by what rounding K/V to 11 significant bits makes of them, a small fraction of the logits' own
    spread; the fp32 cache's equal the unchunked run's up to summation order."""
    from edgellm import LLM

    path, _ = tiny_dir("qwen2")
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 300, (n,), generator=g).tolist() for n in (40, 71)]
    logits = {}
    for kv in ("fp16", "fp32"):
        # capped at avx2: fp32 prefill attention over the pages on every CPU (with bf16 units
        # auto may attend in bf16, which would round both caches' values alike)
        llm = LLM(str(path), kv_cache_memory=1 << 20, cpu_quant="auto", cpu_isa="avx2", kv_cache_dtype=kv,
                  max_num_batched_tokens=32)
        assert llm.engine.model.attention_layers()[0].kv_cache.dtype == getattr(torch, f"float{kv[2:]}")
        logits[kv] = llm.prompt_logits(prompts)
    for a, b in zip(logits["fp16"], logits["fp32"]):
        gap = (a - b).abs().max().item()
        assert 0 < gap < 0.02 * b.std().item()  # measured 0.006x
