"""A Q4_K_M-style GGUF (Q4_K linears, Q6_K for v and down in some layers, as llama-quantize's
Q4_K_M mix does) on a tiny Llama wide enough for 256-weight super-blocks: the exact path equals
transformers running the file's dequantized weights, and the default CPU mode keeps every linear
quantized (int4 for all-Q4_K modules, int8 codes for the mixed ones, stored in 6 bits: Q4_K's
0..15 and Q6_K's -32..31 both fit) within the integer-dot bound."""

from __future__ import annotations

import pytest
import torch
import transformers

from edgellm import LLM
from edgellm.layers.linear import Linear
from edgellm.loader import load_model, resolve_checkpoint
from tests.helpers.gguf_files import Q4_K_M, encode_q4_k, encode_q6_k, write_llama_gguf


@pytest.fixture(scope="module")
def kquant(tmp_path_factory):
    """(gguf path, {hf linear: reference weight}, transformers model holding those weights)."""
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=320, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                   initializer_range=0.05, tie_word_embeddings=False)
    hf = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    path, reference = write_llama_gguf(hf, tmp_path_factory.mktemp("kq") / "tiny-q4_k_m.gguf", Q4_K_M,
                                       embed_type="F32")
    with torch.no_grad():
        for name, w in reference.items():
            hf.get_submodule(name).weight.copy_(w)
    return path, reference, hf


def test_encoders_write_blocks_near_the_weights():
    w = torch.randn(8, 512).numpy() * 0.05
    from gguf import GGMLQuantizationType as T
    from gguf.quants import dequantize

    for encode, qtype, tol in ((encode_q4_k, T.Q4_K, 0.12), (encode_q6_k, T.Q6_K, 0.03)):
        back = dequantize(encode(w).reshape(8, -1), qtype).reshape(w.shape)
        assert abs(back - w).max() < tol * abs(w).max(), qtype.name


def test_exact_path_equals_transformers_on_the_dequantized_weights(kquant):
    path, _, hf = kquant
    llm = LLM(str(path), kv_cache_memory=4 << 20, cpu_quant="exact")
    prompts = [[5, 17, 200, 3, 99, 41, 7], list(range(30, 70))]
    for p, got in zip(prompts, llm.prompt_logits(prompts)):
        with torch.no_grad():
            want = hf(torch.tensor([p])).logits[0]
        assert (got - want).abs().max().item() < 1e-4


def test_auto_mode_keeps_every_k_quant_linear_quantized(kquant):
    from edgellm.kernels.reference import dequantize_rows_ref, quantize_rows_ref

    path, reference, _ = kquant
    model = load_model(resolve_checkpoint(path), torch.float32, cpu_kernels="auto")
    # (stored bits, group): the n16 layout (every AVX2 CPU) keeps the mixed modules' codes in 6 bits
    want_bits = {"model.layers.0.self_attn.qkv_proj": (6, 16), "model.layers.0.mlp.down_proj": (6, 16),
                 "model.layers.1.self_attn.qkv_proj": (4, 32), "model.layers.1.mlp.down_proj": (4, 32)}
    torch.manual_seed(1)
    seen = 0
    for name, module in model.named_modules():
        if not isinstance(module, Linear) or name == "lm_head":
            continue
        kernel = module.kernel
        assert type(kernel).__name__ == "CpuIntDotKernel", name
        assert (kernel.bits, kernel.group) == want_bits.get(name, (4, 32)), name
        kernel.max_rows = 1 << 62  # integer dots at every size
        base, _, leaf = name.rpartition(".")
        parts = ([f"{base}.{s}" for s in ("q_proj", "k_proj", "v_proj")] if leaf == "qkv_proj" else
                 [f"{base}.{s}" for s in ("gate_proj", "up_proj")] if leaf == "gate_up_proj" else [name])
        w = torch.cat([reference[p] for p in parts], 0).double()
        for rows in (1, 6):
            x = torch.randn(rows, w.shape[1])
            codes, d, _ = quantize_rows_ref(x, 32)
            want = dequantize_rows_ref(codes, d).double() @ w.t()
            got = module(x).double()
            assert (got - want).abs().max() <= 1e-5 * want.abs().max(), (name, rows)
        seen += 1
    assert seen == 8


def test_auto_mode_generates_like_the_exact_path(kquant):
    """Greedy tokens of the two paths agree wherever the exact path's top two logits are apart by
    more than the int8 activation rounding can move them (0.5 here; checked per step)."""
    path, _, _ = kquant
    from edgellm import SamplingParams

    exact = LLM(str(path), kv_cache_memory=4 << 20, cpu_quant="exact")
    auto = LLM(str(path), kv_cache_memory=4 << 20, cpu_quant="auto")
    prompt = [5, 17, 200, 3, 99, 41, 7, 12]
    params = SamplingParams(max_tokens=12, temperature=0.0)
    want = exact.generate([prompt], params)[0].outputs[0].token_ids
    got = auto.generate([prompt], params)[0].outputs[0].token_ids
    logits = exact.prompt_logits([prompt + list(want)])[0][len(prompt) - 1:]
    for i, (a, b) in enumerate(zip(got, want)):
        if a != b:
            top2 = logits[i].topk(2).values
            assert (top2[0] - top2[1]).item() < 0.5, (i, got, want)
            break


def test_narrow_codes_decode_bit_for_bit_like_int8_codes(kquant, monkeypatch):
    """The mixed modules' codes stored in 6 bits give the same sums as stored in 8: greedy decoding
    through the fused C++ pass (which reads the width from the block size) and through the layers
    returns the same tokens and the same logprobs, bit for bit, either way."""
    import edgellm.kernels.reference as reference
    from tests.helpers.fused_paths import decode_both_ways

    path, _, _ = kquant
    prompts = [[5, 17, 200, 3, 99, 41, 7, 12], list(range(30, 51))]
    runs = []
    for bits in (6, 8):
        if bits == 8:
            monkeypatch.setattr(reference, "n16_bits", lambda codes: 8)
        llm = LLM(str(path), kv_cache_memory=4 << 20, cpu_quant="auto", enable_prefix_caching=False)
        kernel = llm.engine.model.model.layers[0].self_attn.qkv_proj.kernel
        assert (kernel.bits, kernel.qweight.shape[-1]) == (bits, {6: 384, 8: 512}[bits])
        fused, layers, ran = decode_both_ways(llm, prompts, 12)
        assert any(ran)
        runs.append([(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in fused + layers])
    assert runs[0] == runs[1]
