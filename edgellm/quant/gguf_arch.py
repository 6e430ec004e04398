"""Per-architecture GGUF metadata: llama.cpp's tensor names -> the HF checkpoint names the
decoder's adapters read, and the `{arch}.*` keys -> an HF-style config.json dict.

Conventions of llama.cpp's converter (convert_hf_to_gguf.py) undone here:
  - Llama: q/k rows permuted for its rope layout (`permuted_qk`, undone on whole rows, so also
    on raw quantized blocks);
  - Gemma: RMSNorm weights stored as 1 + w (the (1 + w) norm folded in; `norm_shift` 1 is
    subtracted again, as transformers' own GGUF loader does);
  - rotary tables stored as tensors: `rope_freqs` (llama3-style scaling, per-frequency divisors)
    and Phi-3's longrope `rope_factors_long/short` become the config's rope scaling;
  - Phi-3 / Phi-4-mini: q/k/v fused in attn_qkv, gate and up fused in ffn_up, partial rotary as
    `rope.dimension_count`, a window of 0 meaning none;
  - Gemma 3: what llama.cpp hard-codes rather than stores (every 6th layer global, the sliding
    layers' rope base 10000, the attention scale) is set as llama.cpp sets it.
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
_FFN_NORM_POST_ATTN = (
    (_LAYER + r"ffn_norm\.weight$", r"model.layers.\1.post_attention_layernorm.weight"),
)
_GEMMA_NORMS = (  # pre- and post-norms around attention and the MLP
    (_LAYER + r"post_attention_norm\.weight$", r"model.layers.\1.post_attention_layernorm.weight"),
    (_LAYER + r"ffn_norm\.weight$", r"model.layers.\1.pre_feedforward_layernorm.weight"),
    (_LAYER + r"post_ffw_norm\.weight$", r"model.layers.\1.post_feedforward_layernorm.weight"),
)
_EXAONE4_NORMS = (  # post-norms only: no norm before attention or the MLP
    (_LAYER + r"post_attention_norm\.weight$", r"model.layers.\1.post_attention_layernorm.weight"),
    (_LAYER + r"post_ffw_norm\.weight$", r"model.layers.\1.post_feedforward_layernorm.weight"),
)
_PHI3 = (  # fused q/k/v, and gate/up fused into ffn_up (gate rows first, as in HF's gate_up_proj)
    (_LAYER + r"attn_qkv\.weight$", r"model.layers.\1.self_attn.qkv_proj.weight"),
    (_LAYER + r"ffn_up\.weight$", r"model.layers.\1.mlp.gate_up_proj.weight"),
)
# llama.cpp's linears (the tensors that may stay quantized)
LINEAR = re.compile(
    _LAYER + r"(attn_q|attn_k|attn_v|attn_qkv|attn_output|ffn_gate|ffn_up|ffn_down)\.weight$"
)
# rotary tables llama.cpp stores as tensors; they become config entries (GGUFCheckpoint._config)
ROPE_TENSORS = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")


def _gemma3_config(cfg: dict[str, Any], get: Callable[..., Any]) -> dict[str, Any]:
    """llama.cpp's Gemma 3 rules where the file is silent: every 6th layer global unless a
    per-layer pattern is stored, the sliding layers' rope base 10000 unless `rope.freq_base_swa`,
    queries scaled by 1/sqrt(head_dim) (the 27B, 62 layers: 1/sqrt(hidden / heads))."""
    from transformers import Gemma3TextConfig

    extra: dict[str, Any] = {}
    for key, name in (
        ("final_logit_softcapping", "final_logit_softcapping"),
        ("attn_logit_softcapping", "attn_logit_softcapping"),
    ):
        if get(key) is not None:
            extra[name] = float(get(key))
    _sliding_layers(extra, cfg["num_hidden_layers"], get)
    theta = cfg.pop("rope_theta")
    full = {"rope_type": "default", "rope_theta": theta, **(cfg.pop("rope_scaling", None) or {})}
    local = float(get("rope.freq_base_swa", 10000.0))
    extra["rope_parameters"] = {
        "sliding_attention": {"rope_type": "default", "rope_theta": local},
        "full_attention": full,
    }
    heads = cfg["num_attention_heads"]
    extra["query_pre_attn_scalar"] = (
        cfg["hidden_size"] // heads if cfg["num_hidden_layers"] == 62 else cfg["head_dim"]
    )
    full_cfg = Gemma3TextConfig(
        **{k: v for k, v in cfg.items() if k not in ("model_type", "torch_dtype")}, **extra
    ).to_dict()
    full_cfg["model_type"] = "gemma3_text"
    full_cfg["architectures"] = ["Gemma3ForCausalLM"]
    full_cfg["torch_dtype"] = "float32"
    return full_cfg


def _sliding_layers(out: dict[str, Any], layers: int, get: Callable[..., Any]) -> None:
    """`attention.sliding_window` and `sliding_window_pattern` (per layer, true: sliding; or n:
    every n-th layer global, as llama.cpp's set_swa_pattern) as HF's sliding_window and
    layer_types."""
    window, pattern = get("attention.sliding_window"), get("attention.sliding_window_pattern")
    if not window:
        return
    out["sliding_window"] = int(window)
    if isinstance(pattern, int) and pattern > 0:
        pattern = [i % pattern < pattern - 1 for i in range(layers)]
    if pattern is not None:
        out["layer_types"] = ["sliding_attention" if p else "full_attention" for p in pattern]


def _exaone4_config(cfg: dict[str, Any], get: Callable[..., Any]) -> dict[str, Any]:
    _sliding_layers(cfg, cfg["num_hidden_layers"], get)
    cfg["architectures"] = ["Exaone4ForCausalLM"]
    return cfg


def _phi3_config(cfg: dict[str, Any], get: Callable[..., Any]) -> dict[str, Any]:
    window = get("attention.sliding_window")  # 0 marks Phi-4 (no window)
    cfg["sliding_window"] = int(window) if window else None
    cfg["architectures"] = ["Phi3ForCausalLM"]
    return cfg


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
    "gemma3": GGUFArch(
        "gemma3_text", _COMMON + _QK_NORM + _GEMMA_NORMS, norm_shift=1.0, finish=_gemma3_config
    ),
    "exaone4": GGUFArch("exaone4", _COMMON + _QK_NORM + _EXAONE4_NORMS, finish=_exaone4_config),
    "phi3": GGUFArch("phi3", _PHI3 + _COMMON + _FFN_NORM_POST_ATTN, finish=_phi3_config),
}
