"""Decoding the same requests through the fused C++ decode pass and through the layers, for the
tests that compare the two (tests/kernels/test_cpu_native.py, tests/engine/test_kv_dtype.py)."""

from __future__ import annotations


def decode_both_ways(llm, prompts, max_tokens: int):
    """(fused outputs, layer-path outputs, fused calls that ran) for greedy decoding with logprobs:
    the same requests through the fused C++ decode pass (models/fused_decode.py), then layer by
    layer."""
    from edgellm import SamplingParams

    model = llm.engine.model.model
    fused = model.fused
    assert fused is not None
    for layer in model.layers:  # the fused pass keeps the MLP intermediate in fp32, like this
        layer.mlp.bf16_intermediate = False
    ran = []

    def counting(*args):
        out = fused(*args)
        ran.append(out is not None)
        return out

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=2)
    model.fused = counting
    try:
        got = llm.generate(prompts, params) if isinstance(prompts[0], list) and isinstance(prompts[0][0], int) \
            else llm.chat(prompts, params)
    finally:
        model.fused = None
    try:
        want = llm.generate(prompts, params) if isinstance(prompts[0], list) and isinstance(prompts[0][0], int) \
            else llm.chat(prompts, params)
    finally:
        model.fused = fused
    return got, want, ran


def logprob_gap(got, want) -> float:
    """The largest difference of the sampled tokens' logprobs between two runs' outputs."""
    return max(abs(a[0] - b[0]) for g, w in zip(got, want)
               for a, b in zip(g.outputs[0].logprobs, w.outputs[0].logprobs))


def check_fused_against_layers(path, kv_cache_dtype: str, cache_dtype, seed: int, lengths, max_tokens: int,
                               max_gap: float) -> None:
    """A tiny checkpoint in mode fast with that KV cache (`cache_dtype` its pages), random prompts
    of `lengths` tokens greedily decoded both ways: the fused pass ran, the tokens are the same
    and the sampled tokens' logprobs differ by less than max_gap."""
    import torch

    from edgellm import LLM

    llm = LLM(str(path), kv_cache_memory=1 << 20, cpu_quant="fast", kv_cache_dtype=kv_cache_dtype,
              enable_prefix_caching=False)
    assert {a.kv_cache.dtype for a in llm.engine.model.attention_layers()} == {cache_dtype}
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, 300, (n,), generator=g).tolist() for n in lengths]
    got, want, ran = decode_both_ways(llm, prompts, max_tokens)
    assert any(ran)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert logprob_gap(got, want) < max_gap
