"""GGUF checkpoints (llama.cpp): metadata -> HF-style config, tensors -> HF names.

Quantized weights of the decoder's linears stay in their GGUF blocks (raw
uint8 rows, [N, K / block * block_bytes]) and load through GGUFScheme, which
the config announces as quantization_config {"quant_method": "gguf",
"linear_types": {hf name: type}}. Everything else (embeddings, norms, the
head) is dequantized here with the gguf package's reference dequantizers. The file's
header is read by quant/gguf_file.py.
Names, config keys and llama.cpp's converter conventions per architecture
(Llama's permuted q/k rows, Gemma's 1 + w norms) live in quant/gguf_arch.py.

GGUFScheme: the blocks decode to integer codes with group scales
(quant/gguf_blocks.py): Q4_0, Q4_1 and Q4_K are int4 and run on the int4
kernels (Q4_0 on the CUDA W4A16 kernel too); Q5_0/Q5_1/Q5_K/Q6_K/Q3_K/Q2_K/
Q8_0/IQ4_NL/IQ4_XS, and modules whose shards mix types, are int8 codes for the
CPU integer-dot kernel. Where a kernel cannot take them (another CPU mode,
CUDA for all but Q4_0, types without an integer decoding), the weight is
dequantized once at load with gguf-py's reference dequantizer.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from edgellm.quant import gguf_blocks
from edgellm.quant.gguf_arch import ARCHES, LINEAR, ROPE_TENSORS
from edgellm.quant.gguf_file import GGUFFile, GGUFFormatError
from edgellm.quant.gguf_vocab import end_of_generation_ids, fallback_chat_template
from edgellm.quant.int_codes import Int4Codes, Int8Codes
from edgellm.quant.linear_method import (
    LinearMethod,
    ParamLayout,
    QuantLinearMethod,
    UnquantizedLinearMethod,
)
from edgellm.quant.schemes import QuantScheme
from edgellm.quant.shard_params import shard_ranges, stashed

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


# -- the scheme: raw GGUF blocks -> kernels ---------------------------------------------


class GGUFScheme(QuantScheme):
    name = "gguf"

    def __init__(self, config: dict[str, Any], cpu_kernels: str | None = None) -> None:
        super().__init__(cpu_kernels)
        self.linear_types: dict[str, str] = dict(config.get("linear_types") or {})
        from gguf import GGMLQuantizationType

        for name, type_name in self.linear_types.items():
            if type_name not in GGMLQuantizationType.__members__:
                raise GGUFError(f"GGUF tensor {name}: unknown type {type_name!r}")

    def _type(self, module: str) -> str | None:
        return self.linear_types.get(f"{module}.weight")

    def linear_method(self, prefix: str, checkpoint_names: Sequence[str] = ()) -> LinearMethod:
        names = list(checkpoint_names) or [prefix]
        types = [self._type(n) for n in names]
        if all(t is None for t in types):
            return UnquantizedLinearMethod()
        if any(t is None for t in types):
            raise GGUFError(
                f"GGUF: the shards of {prefix} mix float and quantized tensors: "
                f"{dict(zip(names, types))}"
            )
        return GGUFLinearMethod(self, types)  # type: ignore[arg-type]

    def quantized_method(self, prefix: str, checkpoint_names: Sequence[str]) -> LinearMethod:
        raise AssertionError("GGUFScheme picks methods in linear_method")


class GGUFLinearMethod(QuantLinearMethod):
    """Raw GGUF blocks per shard (shards may differ in type, as in Q4_K_M's q/k/v)."""

    scheme: GGUFScheme

    def __init__(self, scheme: GGUFScheme, types: list[str]) -> None:
        super().__init__(scheme)
        self.types = types  # per shard, in shard order (one: the whole module)

    def create_weights(
        self, layer: nn.Module, input_size: int, output_size: int, dtype: torch.dtype
    ) -> dict[str, ParamLayout]:
        return {"weight": ParamLayout(output_dim=None, stash=True)}

    def _parts(self, layer: nn.Module) -> list[tuple[str, str, torch.Tensor]]:
        """[(shard, type, raw rows)] in output order, shapes checked."""
        from gguf import GGMLQuantizationType
        from gguf.constants import GGML_QUANT_SIZES

        ranges = shard_ranges(layer)
        out = []
        for shard, raw in stashed(layer, "weight"):
            if len(self.types) == 1:
                type_name = self.types[0]
            elif shard:
                type_name = self.types[layer.shards.index(shard)]
            else:
                raise ValueError(
                    f"GGUF: one tensor for the whole of {layer.prefix}, typed per shard"
                )
            block, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType[type_name]]
            start, end = ranges[shard]
            expected = (end - start, layer.input_size // block * block_bytes)
            if layer.input_size % block or tuple(raw.shape) != expected:
                raise ValueError(
                    f"GGUF {type_name} weight{' [' + shard + ']' if shard else ''} has "
                    f"shape {tuple(raw.shape)}, expected {expected}"
                )
            out.append((shard, type_name, raw))
        return out

    def int4(self, layer: nn.Module) -> Int4Codes | None:
        """All shards int4 types (Q4_0, Q4_1, Q4_K): one Int4Codes, groups of 32; Q4_0 alone stays
        symmetric (the CUDA kernel's form), mixed with the others it takes offsets m = -8 d."""
        parts = self._parts(layer)
        kinds = {t for _, t, _ in parts}
        if not kinds <= set(gguf_blocks.INT4_TYPES):
            return None
        decoded = [gguf_blocks.int4_codes(raw, t) for _, t, raw in parts]
        codes = torch.cat([c.codes for c in decoded], 0)
        scales = torch.cat([c.scales.float() for c in decoded], 0)
        if kinds == {"Q4_0"}:
            return Int4Codes(codes, None, scales, 32)
        offsets = torch.cat(
            [c.offsets if c.offsets is not None else -8.0 * c.scales.float() for c in decoded], 0
        )
        return Int4Codes(codes, None, scales, 32, offsets=offsets)

    def int8(self, layer: nn.Module) -> Int8Codes | None:
        """Shards of any integer-decodable type (gguf_blocks.SUPPORTED) as one Int8Codes, in the
        finest group among them (16 when any is Q6_K/Q3_K/Q2_K); None when some type has no
        integer decoding (it is dequantized)."""
        parts = self._parts(layer)
        types = [t for _, t, _ in parts]
        if not set(types) <= set(gguf_blocks.SUPPORTED):
            return None
        group = min(gguf_blocks.group_of(t) for t in types)
        return gguf_blocks.concat_int8(
            [gguf_blocks.int8_codes(raw, t, group) for _, t, raw in parts]
        )

    def dequantize(self, layer: nn.Module) -> torch.Tensor:
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        rows = []
        for _shard, type_name, raw in self._parts(layer):
            arr = dequantize(raw.numpy(), GGMLQuantizationType[type_name])
            rows.append(
                torch.from_numpy(np.array(arr, dtype=np.float32)).reshape(
                    raw.shape[0], layer.input_size
                )
            )
        return torch.cat(rows, 0) if len(rows) > 1 else rows[0]
