"""Tiny random-weight models of every supported architecture, saved the way
transformers saves them (real config.json + model.safetensors, native names).

Weights are scaled up from the default init so that logits are peaked: with
near-uniform logits two tokens can tie within float rounding and greedy
decoding would compare noise, not the implementation.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import transformers
from transformers import AutoModelForCausalLM

COMMON = dict(
    vocab_size=320,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    initializer_range=0.15,
    tie_word_embeddings=False,
)


def tiny_config(arch: str) -> transformers.PretrainedConfig:
    if arch == "llama":  # Llama-3.x style: llama3 rope scaling
        return transformers.LlamaConfig(
            **COMMON,
            rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                             "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                             "original_max_position_embeddings": 64},
        )
    if arch == "llama_tied":  # SmolLM2 style: tied embeddings, plain rope
        return transformers.LlamaConfig(**{**COMMON, "tie_word_embeddings": True, "num_key_value_heads": 1})
    if arch == "mistral":  # sliding window smaller than the test sequences
        return transformers.MistralConfig(**COMMON, sliding_window=24)
    if arch == "qwen2":  # q/k/v biases; Qwen2.5's long-context yarn rope scaling
        return transformers.Qwen2Config(
            **COMMON,
            rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                             "original_max_position_embeddings": 32},
        )
    if arch == "phi3":  # fused qkv/gate_up, longrope with short/long factors
        half = COMMON["hidden_size"] // COMMON["num_attention_heads"] // 2
        return transformers.Phi3Config(
            **{**COMMON, "max_position_embeddings": 512},
            original_max_position_embeddings=48,
            rope_parameters={
                "rope_type": "longrope",
                "rope_theta": 10000.0,
                "short_factor": [1.0 + 0.05 * i for i in range(half)],
                "long_factor": [1.0 + 0.5 * i for i in range(half)],
                "original_max_position_embeddings": 48,
            },
            sliding_window=None,
            pad_token_id=0,
        )
    if arch == "exaone":
        return transformers.ExaoneConfig(**COMMON)
    raise KeyError(arch)


ARCHS = ["llama", "llama_tied", "mistral", "qwen2", "phi3", "exaone"]


def build_tiny(arch: str, out: Path, seed: int = 0) -> tuple[Path, torch.nn.Module]:
    """Save a tiny random model to `out`; returns (dir, the transformers model in fp32 eval mode)."""
    torch.manual_seed(seed)
    cfg = tiny_config(arch)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "bias" in name:
                p.normal_(0, 0.1)  # random biases so that a dropped bias shows up
            elif "norm" in name or "ln_" in name:
                p.uniform_(0.8, 1.2)
    model.save_pretrained(out)
    if arch == "exaone":
        _exaone_native_config(out)
    return out, model


def _exaone_native_config(out: Path) -> None:
    """Write config.json with EXAONE 3.x's own key names, as the released checkpoints have them."""
    path = out / "config.json"
    cfg = json.loads(path.read_text())
    cfg["architectures"] = ["ExaoneForCausalLM"]
    cfg["num_layers"] = cfg.pop("num_hidden_layers")
    cfg["layer_norm_epsilon"] = cfg.pop("rms_norm_eps")
    cfg["activation_function"] = cfg.pop("hidden_act")
    rope = cfg.pop("rope_parameters")
    cfg["rope_theta"] = rope["rope_theta"]
    cfg["rope_scaling"] = None
    path.write_text(json.dumps(cfg, indent=2))
