"""The C++ decode attention (kernels/cpu_attention.py) against the torch reference on fresh random
caches: GQA, scattered block tables, lengths on and off block edges, sliding windows, a mixed
decode + prefill step; and the fast-mode engine using it end to end."""

from __future__ import annotations

import pytest
import torch

from edgellm.kernels import cpu_attention
from edgellm.kernels.paged_attention import paged_attention_ref, write_kv_ref


@pytest.fixture(scope="module")
def built():
    module = cpu_attention.load()
    assert module is not None, "the C++ decode attention did not build (g++ and torch headers needed)"
    return module


@pytest.mark.parametrize("hq,hkv,d,window", [(9, 3, 64, None), (4, 4, 32, None), (6, 2, 48, 13), (8, 1, 16, 40)])
def test_decode_matches_the_reference(built, hq, hkv, d, window):
    g = torch.Generator().manual_seed(hq * 100 + d)
    nb, bs = 37, 16
    cache = torch.randn(2, nb, bs, hkv, d, generator=g)
    lens = [1, 15, 16, 17, 63, 100, 5]
    b = len(lens)
    tables = torch.stack([torch.randperm(nb, generator=g)[:8] for _ in range(b)]).to(torch.int32)
    q = torch.randn(b, hq, d, generator=g)
    scale = d ** -0.5
    want = paged_attention_ref(q, q[:, :hkv], q[:, :hkv], cache, tables, lens, list(range(b + 1)), b,
                               scale, window)
    got = cpu_attention.decode_attention(q, cache, tables.long(), torch.tensor(lens), scale, window)
    assert (got - want).abs().max().item() < 1e-5
    # through the reference's own switch, sharing a step cache like the layers of a step do
    step: dict = {}
    for _ in range(2):
        via = paged_attention_ref(q, q[:, :hkv], q[:, :hkv], cache, tables, lens, list(range(b + 1)), b,
                                  scale, window, step_cache=step, cpp_decode=True)
        assert torch.equal(via, got)


def test_mixed_step_prefill_rows_stay_on_the_reference(built):
    g = torch.Generator().manual_seed(5)
    nb, bs, hq, hkv, d = 20, 16, 6, 2, 32
    cache = torch.zeros(2, nb, bs, hkv, d)
    # two decodes (contexts 30 and 7) and a 9-token prefill chunk over 12 cached tokens
    lens, qlens = [30, 7, 21], [1, 1, 9]
    tables = torch.tensor([[3, 9, 0], [4, 0, 0], [11, 12, 0]], dtype=torch.int32)
    for i, n in enumerate(lens):
        slots = torch.tensor([int(tables[i, t // bs]) * bs + t % bs for t in range(n)])
        write_kv_ref(torch.randn(n, hkv, d, generator=g), torch.randn(n, hkv, d, generator=g), cache, slots)
    starts = [0, 1, 2, 11]
    q = torch.randn(sum(qlens), hq, d, generator=g)
    k = torch.randn(sum(qlens), hkv, d, generator=g)  # already in the cache for the reference's purposes
    want = paged_attention_ref(q, k, k, cache, tables, lens, starts, 2, d ** -0.5)
    got = paged_attention_ref(q, k, k, cache, tables, lens, starts, 2, d ** -0.5, cpp_decode=True)
    assert (got[:2] - want[:2]).abs().max().item() < 1e-5
    assert torch.equal(got[2:], want[2:])


def test_bad_tables_are_refused(built):
    cache = torch.randn(2, 4, 16, 2, 32)
    q = torch.randn(1, 2, 32)
    with pytest.raises(RuntimeError, match="block id out of the cache"):
        cpu_attention.decode_attention(q, cache, torch.tensor([[7]]), torch.tensor([5]), 0.1)
    with pytest.raises(RuntimeError, match="sequence length out of its block table"):
        cpu_attention.decode_attention(q, cache, torch.tensor([[1]]), torch.tensor([17]), 0.1)


def test_fast_engine_decodes_through_it(built, monkeypatch):
    from edgellm import LLM, SamplingParams

    llm = LLM(kv_cache_memory=16 << 20, max_model_len=256, cpu_quant="fast", enable_prefix_caching=False)
    assert all(a.cpp_decode for a in llm.engine.model.attention_layers())
    calls = []
    original = cpu_attention.decode_attention

    def counted(*args, **kwargs):
        calls.append(args[0].shape[0])
        return original(*args, **kwargs)

    monkeypatch.setattr(cpu_attention, "decode_attention", counted)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompts = [[{"role": "user", "content": "What is the capital of France?"}],
               [{"role": "user", "content": "Name three colours."}]]
    got = [o.outputs[0].token_ids for o in llm.chat(prompts, params)]
    assert calls and max(calls) == 2
    monkeypatch.setattr(cpu_attention, "decode_attention", original)
    for a in llm.engine.model.attention_layers():
        a.cpp_decode = False
    want = [o.outputs[0].token_ids for o in llm.chat(prompts, params)]
    assert got == want


def test_disabled_build_falls_back_to_the_reference(built, monkeypatch):
    monkeypatch.setattr(cpu_attention, "_module", None)
    monkeypatch.setattr(cpu_attention, "_failed", False)
    monkeypatch.setenv(cpu_attention.ENV, "torch")
    assert cpu_attention.load() is None
    g = torch.Generator().manual_seed(11)
    cache = torch.randn(2, 6, 16, 2, 32, generator=g)
    q = torch.randn(2, 4, 32, generator=g)
    tables = torch.tensor([[1, 2], [5, 0]], dtype=torch.int32)
    args = (q, q[:, :2], q[:, :2], cache, tables, [20, 9], [0, 1, 2], 2, 0.2)
    assert torch.equal(paged_attention_ref(*args, cpp_decode=True), paged_attention_ref(*args))
