"""GGUF checkpoints (llama.cpp): metadata -> HF-style config, tensors -> HF names.

Quantized weights of the decoder's linears stay in their GGUF blocks (raw
uint8 rows, [N, K / block * block_bytes]) and load through GGUFScheme
(quant/gguf_scheme.py), which the config announces as quantization_config
{"quant_method": "gguf", "linear_types": {hf name: type}}. Everything else
(embeddings, norms, the head) is dequantized here with the gguf package's
reference dequantizers. The file's header is read by quant/gguf_file.py.
Names, config keys and llama.cpp's converter conventions per architecture
(Llama's permuted q/k rows, Gemma's 1 + w norms) live in quant/gguf_arch.py.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from edgellm.quant.gguf_arch import ARCHES, LINEAR, ROPE_TENSORS
from edgellm.quant.gguf_file import GGUFFile, GGUFFormatError
from edgellm.quant.gguf_vocab import end_of_generation_ids, fallback_chat_template

_FLOAT_TYPES = ("F32", "F16", "BF16", "F64")


class GGUFError(ValueError):
    pass


def _open(path: Path) -> GGUFFile:
    try:
        return GGUFFile(path)
    except (GGUFFormatError, OSError, ValueError) as exc:
        raise GGUFError(f"{path}: not a readable GGUF file ({type(exc).__name__}: {exc})") from None


def _field(reader: GGUFFile, key: str, default: Any = None) -> Any:
    value = reader.fields.get(key)
    return default if value is None else value


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
        if arch not in ARCHES:
            raise GGUFError(
                f"{self.path}: GGUF architecture {arch!r} is not supported (supported: "
                f"{', '.join(sorted(ARCHES))})"
            )
        self.gguf_arch = arch
        self.arch = ARCHES[arch]
        self.model_type, self.permuted_qk = self.arch.model_type, self.arch.permuted_qk
        # HF names of linear weights kept as raw GGUF blocks -> their GGML type name
        self.linear_types = {
            self.arch.hf_name(t.name): t.tensor_type.name
            for t in self.reader.tensors
            if LINEAR.match(t.name) and t.tensor_type.name not in _FLOAT_TYPES
        }
        self.config = self._config()
        # what HF checkpoints say in generation_config.json and tokenizer_config.json
        self.generation_config = {"eos_token_id": end_of_generation_ids(self.reader.fields)}
        self.fallback_chat_template = fallback_chat_template(arch, self.reader.fields)
        if self.linear_types:
            self.config["quantization_config"] = {
                "quant_method": "gguf",
                "linear_types": self.linear_types,
            }

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
        rot = get("rope.dimension_count")
        if rot is not None and int(rot) != cfg["head_dim"]:
            cfg["partial_rotary_factor"] = int(rot) / cfg["head_dim"]
        cfg.update(self._rope_scaling(get))
        return self.arch.finish(cfg, get) if self.arch.finish is not None else cfg

    def _vector(self, name: str) -> list[float] | None:
        from gguf.quants import dequantize

        found = [t for t in self.reader.tensors if t.name == name]
        return (
            dequantize(found[0].data, found[0].tensor_type).reshape(-1).tolist() if found else None
        )

    def _rope_scaling(self, get: Any) -> dict[str, Any]:
        """The config's rope_scaling from the `rope.scaling.*` keys and the rotary tensors."""
        freqs = self._vector("rope_freqs.weight")
        long, short = (
            self._vector("rope_factors_long.weight"),
            self._vector("rope_factors_short.weight"),
        )
        scaling = get("rope.scaling.type")
        if freqs is not None:  # llama.cpp divides each rotary frequency by its factor
            return {"rope_scaling": {"rope_type": "freq_factors", "factors": freqs}}
        if long is not None and short is not None:
            orig = get("rope.scaling.original_context_length")
            return {
                "rope_scaling": {
                    "rope_type": "longrope",
                    "long_factor": long,
                    "short_factor": short,
                    "attention_factor": get("rope.scaling.attn_factor"),
                    **({"original_max_position_embeddings": int(orig)} if orig else {}),
                }
            }
        if scaling == "linear":
            return {
                "rope_scaling": {"rope_type": "linear", "factor": float(get("rope.scaling.factor"))}
            }
        if scaling not in (None, "none"):
            raise GGUFError(f"{self.path}: rope scaling {scaling!r} in GGUF is not supported")
        return {}

    def tensors(self, keep_quantized: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, tensor) for every tensor in the file: raw uint8 blocks [N, row bytes] for
        the linears in `linear_types` (unless keep_quantized is False), float32 for the rest."""
        from gguf.constants import GGML_QUANT_SIZES
        from gguf.quants import dequantize

        heads = self.config["num_attention_heads"]
        kv_heads = self.config["num_key_value_heads"]
        for t in self.reader.tensors:
            if t.name in ROPE_TENSORS:
                continue  # in the config (_rope_scaling)
            name = self.arch.hf_name(t.name)
            if name is None:
                raise GGUFError(
                    f"{self.path}: unexpected tensor {t.name!r} for architecture {self.gguf_arch}"
                )
            shape = tuple(int(d) for d in reversed(t.shape))  # GGUF lists dims innermost first
            if keep_quantized and name in self.linear_types:
                block, block_bytes = GGML_QUANT_SIZES[t.tensor_type]
                rows = int(np.prod(shape[:-1]))
                if shape[-1] % block or t.data.size != rows * shape[-1] // block * block_bytes:
                    raise GGUFError(f"{self.path}: tensor {t.name!r} is truncated or misshapen")
                w = torch.from_numpy(np.array(t.data, dtype=np.uint8)).reshape(rows, -1)
            else:
                try:
                    arr = dequantize(t.data, t.tensor_type)
                except Exception as exc:
                    raise GGUFError(
                        f"{self.path}: cannot read tensor {t.name!r} ({t.tensor_type.name}): {exc}"
                    ) from None
                if int(np.prod(arr.shape)) != int(np.prod(shape)):
                    raise GGUFError(f"{self.path}: tensor {t.name!r} is truncated")
                w = torch.from_numpy(np.array(arr, dtype=np.float32)).reshape(
                    shape
                )  # a copy: the file is mapped read-only
                if self.arch.norm_shift and name.endswith("norm.weight"):
                    w -= self.arch.norm_shift
            if self.permuted_qk and (".q_proj." in name or ".k_proj." in name):
                w = _unpermute(w, heads if ".q_proj." in name else kv_heads)
            yield name, w

    def chat_template(self) -> str | None:
        return _field(self.reader, "tokenizer.chat_template")
