"""Bad input gets a clear error naming the problem, and the engine keeps working."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from edgellm import LLM, SamplingParams
from edgellm.loader import CheckpointError


@pytest.fixture(scope="module")
def llama(tiny_dir):
    return tiny_dir("llama")[0]


@pytest.fixture(scope="module")
def llm(llama):
    return LLM(str(llama), kv_cache_memory=1 << 20, max_model_len=64)


def copy_ckpt(src, tmp_path):
    dst = tmp_path / "ckpt"
    shutil.copytree(src, dst)
    return dst


def test_prompt_longer_than_max_model_len(llm):
    with pytest.raises(ValueError, match=r"64 tokens.*at most 63"):
        llm.generate([list(range(64))])
    assert llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2))[0].outputs[0].token_ids


def test_empty_prompt(llm):
    with pytest.raises(ValueError, match="empty"):
        llm.generate([[]])


def test_out_of_vocab_token(llm):
    with pytest.raises(ValueError, match="out of the vocabulary"):
        llm.generate([[1, 2, 99999]])


def test_vllm_prompt_dicts(llm):
    """vLLM's TokensPrompt dict is the same prompt as its token ids, alone or in a list; a dict
    with other keys, or a prompt of another type, is a TypeError that says what a prompt is."""
    greedy = SamplingParams(max_tokens=4, temperature=0)
    want = [o.outputs[0].token_ids for o in llm.generate([[1, 2, 3], [4, 5]], greedy)]
    got = llm.generate([{"prompt_token_ids": [1, 2, 3]}, {"prompt_token_ids": [4, 5]}], greedy)
    assert [o.outputs[0].token_ids for o in got] == want
    assert llm.generate({"prompt_token_ids": [1, 2, 3]}, greedy)[0].outputs[0].token_ids == want[0]
    with pytest.raises(TypeError, match="'prompt' \\(text\\) or 'prompt_token_ids'"):
        llm.generate({"prompt_ids": [1, 2, 3]})
    with pytest.raises(TypeError, match="got float"):
        llm.generate([[1, 2], 3.5])
    assert not llm.engine.has_unfinished_requests()


def test_text_prompt_without_tokenizer(llm):
    with pytest.raises(ValueError, match="no tokenizer"):
        llm.generate("hello")


def test_failed_batch_leaves_nothing_behind(llm):
    with pytest.raises(ValueError):
        llm.generate([[1, 2, 3], []])
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.block_manager.num_held_blocks == 0


def test_generation_stops_at_max_model_len(llm):
    out = llm.generate([list(range(60))], SamplingParams(max_tokens=100, ignore_eos=True))[0].outputs[0]
    assert len(out.token_ids) == 4 and out.finish_reason == "length"


@pytest.mark.parametrize("kwargs", [dict(max_tokens=0), dict(temperature=-1.0)])
def test_bad_sampling_params(kwargs):
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        SamplingParams(**kwargs)


def test_unknown_model_path(tmp_path):
    with pytest.raises(CheckpointError, match="model not found"):
        LLM(str(tmp_path / "nope"))


def test_missing_tensor_is_named(llama, tmp_path):
    dst = copy_ckpt(llama, tmp_path)
    tensors = load_file(dst / "model.safetensors")
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    save_file(tensors, dst / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"missing tensors: model\.layers\.1\.self_attn\.qkv_proj\.weight \(shard k\)"):
        LLM(str(dst), kv_cache_memory=1 << 20)


def test_unexpected_tensor_is_named(llama, tmp_path):
    dst = copy_ckpt(llama, tmp_path)
    tensors = load_file(dst / "model.safetensors")
    tensors["model.layers.0.mlp.extra_proj.weight"] = torch.zeros(2, 2)
    save_file(tensors, dst / "model.safetensors")
    with pytest.raises(CheckpointError, match="extra_proj"):
        LLM(str(dst), kv_cache_memory=1 << 20)


def test_wrong_shape_is_named(llama, tmp_path):
    dst = copy_ckpt(llama, tmp_path)
    tensors = load_file(dst / "model.safetensors")
    tensors["model.norm.weight"] = torch.ones(7)
    save_file(tensors, dst / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"model\.norm\.weight.*\(7,\)"):
        LLM(str(dst), kv_cache_memory=1 << 20)


def test_truncated_safetensors(llama, tmp_path):
    dst = copy_ckpt(llama, tmp_path)
    f = dst / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    with pytest.raises(CheckpointError, match="model.safetensors"):
        LLM(str(dst), kv_cache_memory=1 << 20)


def test_config_not_json(llama, tmp_path):
    dst = copy_ckpt(llama, tmp_path)
    (dst / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="config.json: not valid JSON"):
        LLM(str(dst), kv_cache_memory=1 << 20)


def test_unknown_architecture(llama, tmp_path):
    dst = copy_ckpt(llama, tmp_path)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["model_type"], cfg["architectures"] = "gpt_neox", ["GPTNeoXForCausalLM"]
    (dst / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="unsupported architecture.*gpt_neox"):
        LLM(str(dst), kv_cache_memory=1 << 20)


def test_unsupported_quantization(llama, tmp_path):
    dst = copy_ckpt(llama, tmp_path)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "hqq", "nbits": 3}
    (dst / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="hqq"):
        LLM(str(dst), kv_cache_memory=1 << 20)


def test_pickle_checkpoints_are_refused(llama, tmp_path):
    dst = copy_ckpt(llama, tmp_path)
    (dst / "model.safetensors").rename(dst / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="safetensors"):
        LLM(str(dst), kv_cache_memory=1 << 20)


def test_kv_budget_too_small_for_max_model_len(llama):
    with pytest.raises(ValueError, match="max_model_len 512"):
        LLM(str(llama), kv_cache_memory=64 << 10, max_model_len=512)
