"""Per-architecture adapters: config keys and checkpoint tensor names.

Every supported architecture runs through the one decoder in decoder.py. An
adapter only says (1) how to read its config.json into a ModelConfig and
(2) how its checkpoint names map onto the decoder's modules, including which
on-disk tensors are shards of a fused module (q/k/v -> qkv_proj,
gate/up -> gate_up_proj).
"""

from __future__ import annotations

import re
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

import torch

from edgellm.config import ModelConfig

# Shards of the fused modules, in the order they are concatenated.
QKV_SHARDS = ("q", "k", "v")
GATE_UP_SHARDS = ("gate", "up")

_HF_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}

_ROPE_TYPES = ("default", "linear", "llama3", "longrope", "yarn")


@dataclass(frozen=True)
class TensorTarget:
    """Where one checkpoint tensor goes: a module path, its parameter, and the shard."""

    module: str  # e.g. "model.layers.3.self_attn.qkv_proj"
    param: str  # e.g. "weight", "bias", "qweight"
    shard: str | None  # "q"/"k"/"v"/"gate"/"up", or None for the whole tensor


@dataclass(frozen=True)
class Architecture:
    name: str
    model_types: tuple[str, ...]
    hf_classes: tuple[str, ...]
    default_rope_theta: float = 10000.0
    # regex renames applied first (checkpoint name -> Llama-style name)
    renames: tuple[tuple[str, str], ...] = ()
    # Llama-style module name -> (fused module, shard)
    stacked: tuple[tuple[str, str, str], ...] = field(
        default=(
            ("q_proj", "qkv_proj", "q"),
            ("k_proj", "qkv_proj", "k"),
            ("v_proj", "qkv_proj", "v"),
            ("gate_proj", "gate_up_proj", "gate"),
            ("up_proj", "gate_up_proj", "up"),
        )
    )
    qkv_bias_always: bool = False  # Qwen2: q/k/v carry biases regardless of config
    fused_on_disk: bool = False  # Phi-3: transformers' own modules are qkv_proj / gate_up_proj
    uses_sliding_window: bool = False

    def map_tensor_name(self, name: str, module_names: Collection[str] | None = None) -> TensorTarget | None:
        """Checkpoint tensor name -> target; None for tensors that carry no weights we use.

        Parameter names may contain dots (bitsandbytes' `q_proj.weight.absmax`), so given the
        model's module names the split is at the longest prefix naming a known module;
        without them (or when none is known) it is at the last dot.
        """
        for pattern, repl in self.renames:
            name = re.sub(pattern, repl, name)
        if "rotary_emb.inv_freq" in name:
            return None  # some checkpoints store the recomputable rope table
        parts = name.split(".")
        last_dot = self._target(".".join(parts[:-1]), parts[-1])
        if module_names is None:
            return last_dot
        for i in range(len(parts) - 1, 0, -1):
            target = self._target(".".join(parts[:i]), ".".join(parts[i:]))
            if target.module in module_names:
                return target
        return last_dot

    def _target(self, module: str, param: str) -> TensorTarget:
        parent, _, leaf = module.rpartition(".")
        for src, dst, shard in self.stacked:
            if leaf == src:
                return TensorTarget(f"{parent}.{dst}", param, shard)
        return TensorTarget(module, param, None)

    def checkpoint_modules(self, fused: str) -> tuple[str, ...]:
        """What this architecture's checkpoints (and their quantization ignore lists) call the
        decoder's fused module: itself (Phi-3) or its shards (q_proj, k_proj, v_proj)."""
        if self.fused_on_disk:
            return (fused,)
        return tuple(src for src, dst, _ in self.stacked if dst == fused)


LLAMA = Architecture("llama", ("llama",), ("LlamaForCausalLM",))
MISTRAL = Architecture("mistral", ("mistral",), ("MistralForCausalLM",), uses_sliding_window=True)
QWEN2 = Architecture(
    "qwen2", ("qwen2",), ("Qwen2ForCausalLM",), qkv_bias_always=True, uses_sliding_window=True
)
PHI3 = Architecture("phi3", ("phi3",), ("Phi3ForCausalLM",), uses_sliding_window=True, fused_on_disk=True)
EXAONE = Architecture(
    "exaone",
    ("exaone",),
    ("ExaoneForCausalLM",),
    default_rope_theta=500000.0,
    renames=(
        (r"^transformer\.wte\.", "model.embed_tokens."),
        (r"^transformer\.h\.", "model.layers."),
        (r"^transformer\.ln_f\.", "model.norm."),
        (r"\.attn\.attention\.", ".self_attn."),
        (r"\.self_attn\.out_proj\.", ".self_attn.o_proj."),
        (r"\.ln_1\.", ".input_layernorm."),
        (r"\.ln_2\.", ".post_attention_layernorm."),
        (r"\.mlp\.c_fc_0\.", ".mlp.gate_proj."),
        (r"\.mlp\.c_fc_1\.", ".mlp.up_proj."),
        (r"\.mlp\.c_proj\.", ".mlp.down_proj."),
    ),
)

ARCHITECTURES: dict[str, Architecture] = {a.name: a for a in (LLAMA, MISTRAL, QWEN2, PHI3, EXAONE)}


def resolve_architecture(hf_config: dict[str, Any], override: str | None = None) -> Architecture:
    if override:
        if override in ARCHITECTURES:
            return ARCHITECTURES[override]
        for arch in ARCHITECTURES.values():
            if override in arch.hf_classes:
                return arch
        raise ValueError(f"unknown architecture override {override!r}; known: {sorted(ARCHITECTURES)}")
    model_type = hf_config.get("model_type")
    for arch in ARCHITECTURES.values():
        if model_type in arch.model_types:
            return arch
    for cls in hf_config.get("architectures") or []:
        for arch in ARCHITECTURES.values():
            if cls in arch.hf_classes:
                return arch
    raise ValueError(
        f"unsupported architecture: model_type={model_type!r}, "
        f"architectures={hf_config.get('architectures')!r}; supported model types: "
        f"{sorted(t for a in ARCHITECTURES.values() for t in a.model_types)}"
    )


def _first(cfg: dict[str, Any], *keys: str, default: Any = None) -> Any:
    for key in keys:
        if cfg.get(key) is not None:
            return cfg[key]
    return default


def _rope(cfg: dict[str, Any], arch: Architecture, max_pos: int) -> tuple[float, dict | None, float]:
    """(theta, scaling dict or None, partial rotary factor) from old or new config styles."""
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and ("rope_type" in params or "rope_theta" in params):
        theta = params.get("rope_theta", cfg.get("rope_theta", arch.default_rope_theta))
        scaling: dict | None = dict(params)
    else:
        theta = cfg.get("rope_theta", arch.default_rope_theta)
        scaling = dict(cfg["rope_scaling"]) if cfg.get("rope_scaling") else None
    partial = float(_first(scaling or {}, "partial_rotary_factor",
                           default=cfg.get("partial_rotary_factor", 1.0)))
    if scaling is not None:
        rope_type = scaling.get("rope_type", scaling.get("type", "default"))
        rope_type = {"su": "longrope"}.get(rope_type, rope_type)
        if rope_type == "default":
            scaling = None
        elif rope_type not in _ROPE_TYPES:
            raise ValueError(f"rope scaling type {rope_type!r} is not supported; supported: {_ROPE_TYPES}")
        else:
            scaling["rope_type"] = rope_type
            scaling.setdefault(
                "original_max_position_embeddings",
                cfg.get("original_max_position_embeddings", max_pos),
            )
    return float(theta), scaling, partial


def _sliding_windows(cfg: dict[str, Any], arch: Architecture, num_layers: int) -> list[int | None]:
    window = cfg.get("sliding_window")
    if not arch.uses_sliding_window or window is None:
        return [None] * num_layers
    layer_types = cfg.get("layer_types")
    if layer_types:
        return [int(window) if t == "sliding_attention" else None for t in layer_types]
    if arch.name == "qwen2":
        if not cfg.get("use_sliding_window", False):
            return [None] * num_layers
        first = int(cfg.get("max_window_layers", num_layers))
        return [int(window) if i >= first else None for i in range(num_layers)]
    return [int(window)] * num_layers


def model_config_from_hf(
    cfg: dict[str, Any], arch: Architecture, generation_config: dict[str, Any] | None = None
) -> ModelConfig:
    """Normalize a transformers config.json (v4 or v5 style, native key names) to a ModelConfig."""
    try:
        hidden = int(cfg["hidden_size"])
        num_layers = int(_first(cfg, "num_hidden_layers", "num_layers"))
        num_heads = int(cfg["num_attention_heads"])
        vocab = int(cfg["vocab_size"])
        inter = int(cfg["intermediate_size"])
    except (KeyError, TypeError) as exc:
        raise ValueError(f"config.json lacks a required key: {exc}") from None
    num_kv = int(_first(cfg, "num_key_value_heads", default=num_heads))
    head_dim = int(_first(cfg, "head_dim", default=hidden // num_heads))
    max_pos = int(_first(cfg, "max_position_embeddings", default=2048))
    theta, scaling, partial = _rope(cfg, arch, max_pos)
    attention_bias = bool(cfg.get("attention_bias", False))
    eos: list[int] = []
    for source in (cfg, generation_config or {}):
        value = source.get("eos_token_id")
        for tok in value if isinstance(value, list) else [value]:
            if tok is not None and int(tok) not in eos:
                eos.append(int(tok))
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
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=arch.qkv_bias_always or attention_bias,
        o_bias=attention_bias and not arch.qkv_bias_always,
        mlp_bias=bool(cfg.get("mlp_bias", False)),
        hidden_act=str(_first(cfg, "hidden_act", "activation_function", default="silu")),
        sliding_windows=_sliding_windows(cfg, arch, num_layers),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=eos,
        checkpoint_dtype=_HF_DTYPES.get(str(_first(cfg, "torch_dtype", "dtype", default="float32")),
                                        torch.float32),
    )
