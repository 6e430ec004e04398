"""GGUF checkpoints (llama.cpp): metadata -> HF-style config, tensors -> HF names.

Tensors are dequantized to float here (the gguf package's reference
dequantizers); llama.cpp stores Llama's q/k projections with rows permuted
for its rope layout, which is undone so the weights match the HF ones.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

# GGUF architecture -> (HF model_type, q/k rows permuted by llama.cpp's converter)
_ARCHES = {"llama": ("llama", True), "qwen2": ("qwen2", False)}

_NAMES = [
    (r"^token_embd\.weight$", "model.embed_tokens.weight"),
    (r"^output_norm\.weight$", "model.norm.weight"),
    (r"^output\.weight$", "lm_head.weight"),
    (r"^blk\.(\d+)\.attn_norm\.weight$", r"model.layers.\1.input_layernorm.weight"),
    (r"^blk\.(\d+)\.ffn_norm\.weight$", r"model.layers.\1.post_attention_layernorm.weight"),
    (r"^blk\.(\d+)\.attn_q\.(weight|bias)$", r"model.layers.\1.self_attn.q_proj.\2"),
    (r"^blk\.(\d+)\.attn_k\.(weight|bias)$", r"model.layers.\1.self_attn.k_proj.\2"),
    (r"^blk\.(\d+)\.attn_v\.(weight|bias)$", r"model.layers.\1.self_attn.v_proj.\2"),
    (r"^blk\.(\d+)\.attn_output\.weight$", r"model.layers.\1.self_attn.o_proj.weight"),
    (r"^blk\.(\d+)\.ffn_gate\.weight$", r"model.layers.\1.mlp.gate_proj.weight"),
    (r"^blk\.(\d+)\.ffn_up\.weight$", r"model.layers.\1.mlp.up_proj.weight"),
    (r"^blk\.(\d+)\.ffn_down\.weight$", r"model.layers.\1.mlp.down_proj.weight"),
]


class GGUFError(ValueError):
    pass


def _open(path: Path) -> Any:
    from gguf import GGUFReader

    try:
        return GGUFReader(str(path))
    except Exception as exc:  # the reader raises assorted errors on corrupt files
        raise GGUFError(f"{path}: not a readable GGUF file ({type(exc).__name__}: {exc})") from None


def _field(reader: Any, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    if field is None:
        return default
    return field.contents()


def hf_name(gguf_name: str) -> str | None:
    for pattern, repl in _NAMES:
        if re.match(pattern, gguf_name):
            return re.sub(pattern, repl, gguf_name)
    return None


def _unpermute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's convert-time permutation of q/k rows (weights [out, in] or bias [out])."""
    dim = w.shape[0] // n_head // 2
    return w.reshape(n_head, dim, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)


class GGUFCheckpoint:
    """A GGUF file seen as an HF checkpoint: a config dict and HF-named tensors."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.reader = _open(self.path)
        arch = _field(self.reader, "general.architecture")
        if arch not in _ARCHES:
            raise GGUFError(f"{self.path}: GGUF architecture {arch!r} is not supported ({sorted(_ARCHES)})")
        self.gguf_arch = arch
        self.model_type, self.permuted_qk = _ARCHES[arch]
        self.config = self._config()

    def _config(self) -> dict[str, Any]:
        a = self.gguf_arch

        def get(key: str, default: Any = None) -> Any:
            return _field(self.reader, f"{a}.{key}", default)

        names = {t.name for t in self.reader.tensors}
        heads = int(get("attention.head_count"))
        hidden = int(get("embedding_length"))
        tokens = _field(self.reader, "tokenizer.ggml.tokens")
        cfg: dict[str, Any] = {
            "model_type": self.model_type,
            "hidden_size": hidden,
            "intermediate_size": int(get("feed_forward_length")),
            "num_hidden_layers": int(get("block_count")),
            "num_attention_heads": heads,
            "num_key_value_heads": int(get("attention.head_count_kv", heads)),
            "head_dim": int(get("attention.key_length", hidden // heads)),
            "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-6)),
            "rope_theta": float(get("rope.freq_base", 10000.0)),
            "max_position_embeddings": int(get("context_length", 2048)),
            "vocab_size": int(get("vocab_size", len(tokens) if tokens is not None else 0)),
            "tie_word_embeddings": "output.weight" not in names,
            "bos_token_id": _field(self.reader, "tokenizer.ggml.bos_token_id"),
            "eos_token_id": _field(self.reader, "tokenizer.ggml.eos_token_id"),
            "torch_dtype": "float32",
        }
        scaling = get("rope.scaling.type")
        if scaling == "linear":
            cfg["rope_scaling"] = {"rope_type": "linear", "factor": float(get("rope.scaling.factor"))}
        elif scaling not in (None, "none"):
            raise GGUFError(f"{self.path}: rope scaling {scaling!r} in GGUF is not supported")
        return cfg

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, float32 tensor) for every tensor in the file."""
        from gguf.quants import dequantize

        heads = self.config["num_attention_heads"]
        kv_heads = self.config["num_key_value_heads"]
        for t in self.reader.tensors:
            name = hf_name(t.name)
            if name is None:
                raise GGUFError(f"{self.path}: unexpected tensor {t.name!r}")
            try:
                arr = dequantize(t.data, t.tensor_type)
            except Exception as exc:
                raise GGUFError(
                    f"{self.path}: cannot read tensor {t.name!r} ({t.tensor_type.name}): {exc}"
                ) from None
            shape = tuple(int(d) for d in reversed(t.shape))  # GGUF lists dims innermost first
            if int(np.prod(arr.shape)) != int(np.prod(shape)):
                raise GGUFError(f"{self.path}: tensor {t.name!r} is truncated")
            w = torch.from_numpy(np.array(arr, dtype=np.float32)).reshape(shape)  # a copy: the file is mapped read-only
            if self.permuted_qk and (".q_proj." in name or ".k_proj." in name):
                w = _unpermute(w, heads if ".q_proj." in name else kv_heads)
            yield name, w

    def chat_template(self) -> str | None:
        return _field(self.reader, "tokenizer.chat_template")
