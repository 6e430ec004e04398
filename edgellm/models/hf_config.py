"""A transformers config.json (v4 or v5 style, native key names) -> ModelConfig.

Per architecture (models/arch.py) the layer's shape comes from the adapter; what varies between
checkpoints of one architecture comes from the config: rotary (one table, or Gemma 3's one per
layer type), sliding windows (layer_types, a window pattern, Qwen2's max_window_layers),
activation, attention scale, soft-capping.
"""

from __future__ import annotations

from typing import Any

import torch

from edgellm.config import ModelConfig
from edgellm.models.arch import Architecture

_HF_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}

# freq_factors: per-frequency divisors as GGUF files store llama3-style scaling (rope_freqs)
ROPE_TYPES = ("default", "linear", "llama3", "longrope", "yarn", "freq_factors")


def _first(cfg: dict[str, Any], *keys: str, default: Any = None) -> Any:
    for key in keys:
        if cfg.get(key) is not None:
            return cfg[key]
    return default


def _rope_params(cfg: dict[str, Any]) -> tuple[dict | None, dict | None]:
    """(the full-attention layers' rope parameters, the sliding layers' own or None)."""
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and "full_attention" in params:  # Gemma 3, transformers v5
        return params.get("full_attention"), params.get("sliding_attention")
    if isinstance(params, dict) and ("rope_type" in params or "rope_theta" in params):
        return params, None
    scaling = dict(cfg["rope_scaling"]) if cfg.get("rope_scaling") else None
    local = cfg.get("rope_local_base_freq")  # Gemma 3, transformers v4
    return scaling, ({"rope_type": "default", "rope_theta": local} if local is not None else None)


def _rope(
    cfg: dict[str, Any], arch: Architecture, max_pos: int
) -> tuple[float, dict | None, float, float | None]:
    """(theta, scaling dict or None, partial rotary factor, the sliding layers' theta or None)."""
    params, local = _rope_params(cfg)
    theta = (params or {}).get("rope_theta", cfg.get("rope_theta", arch.default_rope_theta))
    scaling: dict | None = dict(params) if params else None
    partial = float(
        _first(
            scaling or {}, "partial_rotary_factor", default=cfg.get("partial_rotary_factor", 1.0)
        )
    )
    if scaling is not None:
        rope_type = scaling.get("rope_type", scaling.get("type", "default"))
        rope_type = {"su": "longrope"}.get(rope_type, rope_type)
        if rope_type == "default":
            scaling = None
        elif rope_type not in ROPE_TYPES:
            raise ValueError(
                f"rope scaling type {rope_type!r} is not supported; supported: {ROPE_TYPES}"
            )
        else:
            scaling["rope_type"] = rope_type
            scaling.setdefault(
                "original_max_position_embeddings",
                cfg.get("original_max_position_embeddings", max_pos),
            )
    local_theta = None
    if local is not None:
        if local.get("rope_type", "default") != "default":
            raise ValueError(
                f"sliding layers' rope type {local.get('rope_type')!r} is not supported (default "
                "only)"
            )
        local_theta = float(local.get("rope_theta", 10000.0))
    return float(theta), scaling, partial, local_theta


def _layer_types(cfg: dict[str, Any], num_layers: int) -> list[str] | None:
    types = cfg.get("layer_types")
    if types:
        if len(types) != num_layers:
            raise ValueError(
                f"config.json: layer_types has {len(types)} entries for {num_layers} layers"
            )
        return list(types)
    pattern = cfg.get("sliding_window_pattern")
    if isinstance(pattern, str) and pattern:  # EXAONE 4: "LLLG"
        return [
            "sliding_attention" if pattern[i % len(pattern)] == "L" else "full_attention"
            for i in range(num_layers)
        ]
    if (
        isinstance(pattern, int) and pattern > 0
    ):  # Gemma 3 and EXAONE 4: every pattern-th layer is global
        return [
            "sliding_attention" if (i + 1) % pattern else "full_attention"
            for i in range(num_layers)
        ]
    return None


def _sliding_windows(cfg: dict[str, Any], arch: Architecture, num_layers: int) -> list[int | None]:
    window = cfg.get("sliding_window")
    if not arch.uses_sliding_window or window is None:
        return [None] * num_layers
    if arch.name in ("qwen2", "qwen3") and not cfg.get("layer_types"):
        if not cfg.get("use_sliding_window", False):
            return [None] * num_layers
        first = int(cfg.get("max_window_layers", num_layers))
        return [int(window) if i >= first else None for i in range(num_layers)]
    default_pattern = {"gemma3": 6, "exaone4": 4}.get(
        arch.name
    )  # their transformers configs' defaults
    if default_pattern and not cfg.get("layer_types") and cfg.get("sliding_window_pattern") is None:
        cfg = {**cfg, "sliding_window_pattern": default_pattern}
    types = _layer_types(cfg, num_layers)
    if types is not None:
        return [int(window) if t == "sliding_attention" else None for t in types]
    return [int(window)] * num_layers


def _activation(cfg: dict[str, Any], arch: Architecture) -> str:
    keys = (
        ("hidden_activation", "hidden_act")
        if arch.name == "gemma3"
        else ("hidden_act", "activation_function")
    )
    return str(_first(cfg, *keys, default="gelu_pytorch_tanh" if arch.name == "gemma3" else "silu"))


def model_config_from_hf(
    cfg: dict[str, Any], arch: Architecture, generation_config: dict[str, Any] | None = None
) -> ModelConfig:
    """Normalize a transformers config.json to a ModelConfig; ValueError names what is missing or
    not supported."""
    try:
        hidden = int(cfg["hidden_size"])
        num_layers = int(_first(cfg, "num_hidden_layers", "num_layers"))
        num_heads = int(cfg["num_attention_heads"])
        vocab = int(cfg["vocab_size"])
        inter = int(cfg["intermediate_size"])
    except (KeyError, TypeError) as exc:
        raise ValueError(f"config.json lacks a required key: {exc}") from None
    if cfg.get("attn_logit_softcapping") is not None:
        raise ValueError("attention logit soft-capping (attn_logit_softcapping) is not supported")
    if cfg.get("use_bidirectional_attention"):
        raise ValueError("bidirectional attention (use_bidirectional_attention) is not supported")
    num_kv = int(_first(cfg, "num_key_value_heads", default=num_heads))
    head_dim = int(_first(cfg, "head_dim", default=hidden // num_heads))
    max_pos = int(_first(cfg, "max_position_embeddings", default=2048))
    theta, scaling, partial, local_theta = _rope(cfg, arch, max_pos)
    windows = _sliding_windows(cfg, arch, num_layers)
    attention_bias = bool(cfg.get("attention_bias", False))
    eos: list[int] = []
    for source in (cfg, generation_config or {}):
        value = source.get("eos_token_id")
        for tok in value if isinstance(value, list) else [value]:
            if tok is not None and int(tok) not in eos:
                eos.append(int(tok))
    scalar = cfg.get("query_pre_attn_scalar") if arch.name == "gemma3" else None
    return ModelConfig(
        architecture=arch.name,
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=inter,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv,
        head_dim=head_dim,
        rms_norm_eps=float(_first(cfg, "rms_norm_eps", "layer_norm_epsilon", default=1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        partial_rotary_factor=partial,
        max_position_embeddings=max_pos,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", arch.tied_by_default)),
        qkv_bias=arch.qkv_bias_always or attention_bias,
        o_bias=attention_bias and not arch.qkv_bias_always,
        mlp_bias=bool(cfg.get("mlp_bias", False)),
        hidden_act=_activation(cfg, arch),
        sliding_windows=windows,
        norm_layout=arch.norm_layout,
        norm_weight_offset=arch.norm_weight_offset,
        qk_norm=arch.qk_norm,
        embed_scale=hidden**0.5 if arch.scaled_embedding else None,
        attn_scale=float(scalar) ** -0.5 if scalar is not None else None,
        local_rope_theta=local_theta,
        # EXAONE 4: a model with sliding layers runs its global layers without rotary
        nope_full_layers=arch.name == "exaone4" and cfg.get("sliding_window") is not None,
        final_logit_softcapping=cfg.get("final_logit_softcapping"),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=eos,
        checkpoint_dtype=_HF_DTYPES.get(
            str(_first(cfg, "torch_dtype", "dtype", default="float32")), torch.float32
        ),
    )
