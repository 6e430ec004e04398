"""Tiny random-weight models of every supported architecture, saved the way
transformers saves them (real config.json + model.safetensors, native names). The tests
(tests/helpers/tiny_models.py) and benchmarks/gpu_check.py build theirs here.

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
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        )
    if arch == "llama_tied":  # SmolLM2 style: tied embeddings, plain rope
        return transformers.LlamaConfig(
            **{**COMMON, "tie_word_embeddings": True, "num_key_value_heads": 1}
        )
    if arch == "mistral":  # sliding window smaller than the test sequences
        return transformers.MistralConfig(**COMMON, sliding_window=24)
    if arch == "qwen2":  # q/k/v biases; Qwen2.5's long-context yarn rope scaling
        return transformers.Qwen2Config(
            **COMMON,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 32,
            },
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
    head_dim = COMMON["hidden_size"] // COMMON["num_attention_heads"]
    if arch == "llama32":  # Llama-3.2 1B/3B style: tied embeddings and llama3 rope
        return transformers.LlamaConfig(
            **{**COMMON, "tie_word_embeddings": True},
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 32.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        )
    if arch == "qwen3":  # q/k RMSNorm per head, no biases
        return transformers.Qwen3Config(
            **COMMON,
            head_dim=head_dim,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        )
    if arch == "gemma3":  # one sliding layer (window smaller than the prompts), one global
        return transformers.Gemma3TextConfig(
            **{**COMMON, "tie_word_embeddings": True},
            head_dim=head_dim,
            query_pre_attn_scalar=24,  # an attention scale other than head_dim ** -0.5
            sliding_window=24,
            layer_types=["sliding_attention", "full_attention"],
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "rope_theta": 1000000.0, "factor": 2.0},
            },
            final_logit_softcapping=30.0,
        )
    if (
        arch == "gemma3_6"
    ):  # what a GGUF can say of Gemma 3: every 6th layer global, scale 1/sqrt(head_dim)
        return transformers.Gemma3TextConfig(
            **{**COMMON, "tie_word_embeddings": True, "num_hidden_layers": 6},
            head_dim=head_dim,
            query_pre_attn_scalar=head_dim,
            sliding_window=24,
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "rope_theta": 1000000.0, "factor": 2.0},
            },
            final_logit_softcapping=30.0,
        )
    if arch == "exaone4":  # post-norms, q/k norms; hybrid: the global layer takes no rotary
        return transformers.Exaone4Config(
            **COMMON,
            head_dim=head_dim,
            sliding_window=24,
            layer_types=["sliding_attention", "full_attention"],
        )
    if arch == "phi4mini":  # phi3 with partial rotary (3/4 of the head) and tied embeddings
        rot_half = int(head_dim * 0.75) // 2
        return transformers.Phi3Config(
            **{**COMMON, "tie_word_embeddings": True},
            partial_rotary_factor=0.75,
            original_max_position_embeddings=48,
            rope_parameters={
                "rope_type": "longrope",
                "rope_theta": 10000.0,
                "partial_rotary_factor": 0.75,
                "short_factor": [1.0 + 0.05 * i for i in range(rot_half)],
                "long_factor": [1.0 + 0.5 * i for i in range(rot_half)],
                "original_max_position_embeddings": 48,
            },
            sliding_window=None,
            pad_token_id=0,
        )
    raise KeyError(arch)


ARCHS = [
    "llama",
    "llama_tied",
    "mistral",
    "qwen2",
    "phi3",
    "exaone",
    "llama32",
    "qwen3",
    "gemma3",
    "exaone4",
    "phi4mini",
]


def build_tiny(arch: str, out: Path, seed: int = 0) -> tuple[Path, torch.nn.Module]:
    """Save a tiny random model to `out`; returns (dir, the transformers model in fp32 eval
    mode)."""
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
