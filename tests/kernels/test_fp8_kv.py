"""FP8 KV cache: capacity for the same byte budget, scales never silently 1.0,
and greedy output close to the full-precision cache."""

from __future__ import annotations

import torch
from safetensors.torch import load_file, save_file

from edgellm import LLM, SamplingParams


def _prompt() -> list[int]:
    return torch.randint(0, 320, (16,), generator=torch.Generator().manual_seed(4)).tolist()


def test_fp8_capacity_scales_with_element_size(tiny_dir):
    path, _ = tiny_dir("llama")
    for dtype, ratio in (("float32", 4), ("bfloat16", 2)):
        full = LLM(str(path), dtype=dtype, kv_cache_memory=4 << 20).engine.block_manager.num_blocks
        fp8 = LLM(str(path), dtype=dtype, kv_cache_memory=4 << 20, kv_cache_dtype="fp8")
        assert fp8.engine.block_manager.num_blocks == ratio * full
        assert fp8.engine.runner.kv_caches[0].dtype == torch.float8_e4m3fn


def test_fp8_scales_computed_from_first_prefill(tiny_dir):
    path, _ = tiny_dir("llama")
    llm = LLM(str(path), kv_cache_memory=4 << 20, kv_cache_dtype="fp8")
    attn = [layer.self_attn.attn for layer in llm.engine.model.model.layers]
    assert not any(a.scales_known for a in attn)
    llm.generate([_prompt()], SamplingParams(max_tokens=2))
    for a in attn:
        assert a.scales_known and a.k_scale != 1.0 and a.v_scale != 1.0 and a.k_scale > 0


def test_fp8_scales_from_checkpoint(tiny_dir, tmp_path):
    import shutil

    src, _ = tiny_dir("llama")
    dst = tmp_path / "with-scales"
    shutil.copytree(src, dst)
    t = load_file(dst / "model.safetensors")
    for i in range(2):
        t[f"model.layers.{i}.self_attn.k_scale"] = torch.tensor([0.0123 * (i + 1)])
        t[f"model.layers.{i}.self_attn.v_scale"] = torch.tensor(0.0456 * (i + 1))
    save_file(t, dst / "model.safetensors")
    llm = LLM(str(dst), kv_cache_memory=4 << 20, kv_cache_dtype="fp8")
    attn = [layer.self_attn.attn for layer in llm.engine.model.model.layers]
    assert [round(a.k_scale, 6) for a in attn] == [0.0123, 0.0246]
    assert [round(a.v_scale, 6) for a in attn] == [0.0456, 0.0912]
    llm.generate([_prompt()], SamplingParams(max_tokens=2))
    assert [round(a.k_scale, 6) for a in attn] == [0.0123, 0.0246]  # not recomputed


def test_fp8_greedy_agrees_with_full_precision(tiny_dir):
    path, _ = tiny_dir("llama")
    greedy = SamplingParams(max_tokens=256, temperature=0.0, ignore_eos=True)
    ref = LLM(str(path), kv_cache_memory=8 << 20).generate([_prompt()], greedy)[0].outputs[0].token_ids
    fp8 = LLM(str(path), kv_cache_memory=8 << 20, kv_cache_dtype="fp8")
    got = fp8.generate([_prompt()], greedy)[0].outputs[0].token_ids
    # teacher-forced: fp8-cache logits along the reference continuation pick the same top-1
    full = LLM(str(path), kv_cache_memory=8 << 20).prompt_logits([_prompt() + ref])[0][len(_prompt()) - 1:-1]
    logits = fp8.prompt_logits([_prompt() + ref])[0][len(_prompt()) - 1:-1]
    agree = (logits.argmax(-1) == torch.tensor(ref)).float().mean().item()
    top2 = full.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 0.1 * full.std()  # decisions not within fp8 rounding of a tie
    agree_clear = (logits.argmax(-1) == torch.tensor(ref))[clear].float().mean().item()
    rel = ((logits - full).abs().max() / full.abs().max()).item()
    prefix = next((i for i, (a, b) in enumerate(zip(got, ref)) if a != b), len(ref))
    print(f"fp8 KV: teacher-forced top-1 agreement {agree:.3f} over 256 tokens "
          f"({agree_clear:.3f} where the fp32 top-2 margin exceeds 0.1 std, {int(clear.sum())} tokens); "
          f"max logit error {rel:.3f} of the max; free-running greedy identical for {prefix} tokens")
    # measured: 0.914 overall, 0.979 on clear decisions, logit error 0.13 (a random model with sharp
    # weights is far more sensitive than a trained one: SmolLM2-135M agrees on 98% of 256 tokens)
    assert agree >= 0.85 and agree_clear >= 0.95 and rel < 0.25
