"""Per-architecture GGUF metadata: llama.cpp's tensor names -> the HF checkpoint names the
decoder's adapters read, and the `{arch}.*` keys -> an HF-style config.json dict.

Conventions of llama.cpp's converter (convert_hf_to_gguf.py) undone here:
  - Llama: q/k rows permuted for its rope layout (`permuted_qk`, undone on whole rows, so also
    on raw quantized blocks);
  - Gemma: RMSNorm weights stored as 1 + w (the (1 + w) norm folded in; `norm_shift` 1 is
    subtracted again, as transformers' own GGUF loader does);
  - Gemma 3: what llama.cpp hard-codes rather than stores (every 6th layer global, the sliding
    layers' rope base 10000, the attention scale 1/sqrt(query_pre_attn_scalar = head_dim)) comes
    from transformers' Gemma3TextConfig defaults, as with transformers' GGUF loading.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

_LAYER = r"^blk\.(\d+)\."
_COMMON = (
    (r"^token_embd\.weight$", "model.embed_tokens.weight"),
    (r"^output_norm\.weight$", "model.norm.weight"),
    (r"^output\.weight$", "lm_head.weight"),
    (_LAYER + r"attn_norm\.weight$", r"model.layers.\1.input_layernorm.weight"),
    (_LAYER + r"attn_q\.(weight|bias)$", r"model.layers.\1.self_attn.q_proj.\2"),
    (_LAYER + r"attn_k\.(weight|bias)$", r"model.layers.\1.self_attn.k_proj.\2"),
    (_LAYER + r"attn_v\.(weight|bias)$", r"model.layers.\1.self_attn.v_proj.\2"),
    (_LAYER + r"attn_output\.weight$", r"model.layers.\1.self_attn.o_proj.weight"),
    (_LAYER + r"ffn_gate\.weight$", r"model.layers.\1.mlp.gate_proj.weight"),
    (_LAYER + r"ffn_up\.weight$", r"model.layers.\1.mlp.up_proj.weight"),
    (_LAYER + r"ffn_down\.weight$", r"model.layers.\1.mlp.down_proj.weight"),
)
_QK_NORM = (
    (_LAYER + r"attn_q_norm\.weight$", r"model.layers.\1.self_attn.q_norm.weight"),
    (_LAYER + r"attn_k_norm\.weight$", r"model.layers.\1.self_attn.k_norm.weight"),
)
_FFN_NORM_POST_ATTN = ((_LAYER + r"ffn_norm\.weight$", r"model.layers.\1.post_attention_layernorm.weight"),)
_GEMMA_NORMS = (  # pre- and post-norms around attention and the MLP
    (_LAYER + r"post_attention_norm\.weight$", r"model.layers.\1.post_attention_layernorm.weight"),
    (_LAYER + r"ffn_norm\.weight$", r"model.layers.\1.pre_feedforward_layernorm.weight"),
    (_LAYER + r"post_ffw_norm\.weight$", r"model.layers.\1.post_feedforward_layernorm.weight"),
)
# llama.cpp's linears (the tensors that may stay quantized)
LINEAR = re.compile(_LAYER + r"(attn_q|attn_k|attn_v|attn_output|ffn_gate|ffn_up|ffn_down)\.weight$")


def _gemma3_config(cfg: dict[str, Any], get: Callable[..., Any]) -> dict[str, Any]:
    from transformers import Gemma3TextConfig

    window = get("attention.sliding_window")
    extra = {"sliding_window": int(window)} if window is not None else {}
    for key, name in (("final_logit_softcapping", "final_logit_softcapping"),
                      ("attn_logit_softcapping", "attn_logit_softcapping")):
        if get(key) is not None:
            extra[name] = float(get(key))
    theta = cfg.pop("rope_theta")
    extra["rope_parameters"] = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                "full_attention": {"rope_type": "default", "rope_theta": theta}}
    full = Gemma3TextConfig(**{k: v for k, v in cfg.items() if k not in ("model_type", "torch_dtype")},
                            **extra).to_dict()
    full["model_type"] = "gemma3_text"
    full["architectures"] = ["Gemma3ForCausalLM"]
    full["torch_dtype"] = "float32"
    return full


@dataclass(frozen=True)
class GGUFArch:
    model_type: str
    names: tuple[tuple[str, str], ...]
    permuted_qk: bool = False
    norm_shift: float = 0.0  # the file's norm weights are the HF ones plus this
    finish: Callable[[dict[str, Any], Callable[..., Any]], dict[str, Any]] | None = None

    def hf_name(self, gguf_name: str) -> str | None:
        for pattern, repl in self.names:
            if re.match(pattern, gguf_name):
                return re.sub(pattern, repl, gguf_name)
        return None


ARCHES: dict[str, GGUFArch] = {
    "llama": GGUFArch("llama", _COMMON + _FFN_NORM_POST_ATTN, permuted_qk=True),
    "qwen2": GGUFArch("qwen2", _COMMON + _FFN_NORM_POST_ATTN),
    "qwen3": GGUFArch("qwen3", _COMMON + _FFN_NORM_POST_ATTN + _QK_NORM),
    "gemma3": GGUFArch("gemma3_text", _COMMON + _QK_NORM + _GEMMA_NORMS, norm_shift=1.0, finish=_gemma3_config),
}
