"""Per-architecture adapters: config keys and checkpoint tensor names.

Every supported architecture runs through the one decoder in decoder.py. An
adapter only says (1) the shape of its layers (norm layout, q/k norms, scaled
embedding; models/hf_config.py reads the rest of config.json into a ModelConfig)
and (2) how its checkpoint names map onto the decoder's modules, including which
on-disk tensors are shards of a fused module (q/k/v -> qkv_proj,
gate/up -> gate_up_proj).
"""

from __future__ import annotations

import re
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

# Shards of the fused modules, in the order they are concatenated.
QKV_SHARDS = ("q", "k", "v")
GATE_UP_SHARDS = ("gate", "up")


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
    # the layer's shape (ModelConfig has the same fields; models/hf_config.py copies them)
    norm_layout: str = "pre"
    norm_weight_offset: float = 0.0
    qk_norm: bool = False
    scaled_embedding: bool = False  # embeddings times sqrt(hidden)
    tied_by_default: bool = False  # tie_word_embeddings when config.json does not say

    def map_tensor_name(
        self, name: str, module_names: Collection[str] | None = None
    ) -> TensorTarget | None:
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
PHI3 = Architecture(
    "phi3", ("phi3",), ("Phi3ForCausalLM",), uses_sliding_window=True, fused_on_disk=True
)
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

# Gemma 3 and EXAONE 4 name their norms by position; the decoder names them by role:
# post_attention_layernorm is the norm before the MLP (Llama's meaning), attn_output_norm and
# mlp_output_norm the norms on each branch's output.
_BRANCH_OUTPUT_NORMS = (
    (r"\.post_attention_layernorm\.", ".attn_output_norm."),
    (r"\.pre_feedforward_layernorm\.", ".post_attention_layernorm."),
    (r"\.post_feedforward_layernorm\.", ".mlp_output_norm."),
)
QWEN3 = Architecture(
    "qwen3", ("qwen3",), ("Qwen3ForCausalLM",), uses_sliding_window=True, qk_norm=True
)
GEMMA3 = Architecture(
    "gemma3",
    ("gemma3_text",),
    ("Gemma3ForCausalLM",),
    default_rope_theta=1_000_000.0,
    renames=_BRANCH_OUTPUT_NORMS,
    uses_sliding_window=True,
    norm_layout="sandwich",
    norm_weight_offset=1.0,
    qk_norm=True,
    scaled_embedding=True,
    tied_by_default=True,
)
EXAONE4 = Architecture(
    "exaone4",
    ("exaone4",),
    ("Exaone4ForCausalLM",),
    default_rope_theta=1_000_000.0,
    renames=_BRANCH_OUTPUT_NORMS,
    uses_sliding_window=True,
    norm_layout="post",
    qk_norm=True,
)

ARCHITECTURES: dict[str, Architecture] = {
    a.name: a for a in (LLAMA, MISTRAL, QWEN2, QWEN3, PHI3, EXAONE, GEMMA3, EXAONE4)
}


def resolve_architecture(hf_config: dict[str, Any], override: str | None = None) -> Architecture:
    if override:
        if override in ARCHITECTURES:
            return ARCHITECTURES[override]
        for arch in ARCHITECTURES.values():
            if override in arch.hf_classes:
                return arch
        raise ValueError(
            f"unknown architecture override {override!r}; known: {sorted(ARCHITECTURES)}"
        )
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
