"""Loader: fused modules stored split or fused, tied heads, sharded checkpoints."""

from __future__ import annotations

import json
import shutil

import torch
from safetensors.torch import load_file, save_file

from edgellm import LLM


def _logits(path, prompt):
    return LLM(str(path), kv_cache_memory=1 << 20).prompt_logits([prompt])[0]


PROMPT = [5, 17, 99, 3, 250, 41, 8]


def test_phi3_with_gate_up_and_qkv_split_on_disk(tiny_dir, tmp_path):
    src, _ = tiny_dir("phi3")
    dst = tmp_path / "split"
    shutil.copytree(src, dst)
    t = load_file(dst / "model.safetensors")
    inter, q = 96, 64
    kv = 2 * 16
    for name in [n for n in t if n.endswith("gate_up_proj.weight")]:
        w = t.pop(name)
        t[name.replace("gate_up_proj", "gate_proj")] = w[:inter].clone()
        t[name.replace("gate_up_proj", "up_proj")] = w[inter:].clone()
    for name in [n for n in t if n.endswith("qkv_proj.weight")]:
        w = t.pop(name)
        t[name.replace("qkv_proj", "q_proj")] = w[:q].clone()
        t[name.replace("qkv_proj", "k_proj")] = w[q:q + kv].clone()
        t[name.replace("qkv_proj", "v_proj")] = w[q + kv:].clone()
    save_file(t, dst / "model.safetensors")
    assert torch.equal(_logits(src, PROMPT), _logits(dst, PROMPT))


def test_tied_checkpoint_with_stored_head_copy(tiny_dir, tmp_path):
    src, _ = tiny_dir("llama_tied")
    dst = tmp_path / "tied"
    shutil.copytree(src, dst)
    t = load_file(dst / "model.safetensors")
    assert "lm_head.weight" not in t
    t["lm_head.weight"] = t["model.embed_tokens.weight"].clone()
    save_file(t, dst / "model.safetensors")
    assert torch.equal(_logits(src, PROMPT), _logits(dst, PROMPT))


def test_sharded_checkpoint_with_index(tiny_dir, tmp_path):
    src, _ = tiny_dir("qwen2")
    dst = tmp_path / "sharded"
    shutil.copytree(src, dst)
    t = load_file(dst / "model.safetensors")
    (dst / "model.safetensors").unlink()
    names = sorted(t)
    half = len(names) // 2
    weight_map = {}
    for i, part in enumerate((names[:half], names[half:])):
        fname = f"model-0000{i + 1}-of-00002.safetensors"
        save_file({n: t[n] for n in part}, dst / fname)
        weight_map.update({n: fname for n in part})
    (dst / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    assert torch.equal(_logits(src, PROMPT), _logits(dst, PROMPT))
