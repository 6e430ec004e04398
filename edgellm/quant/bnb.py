"""bitsandbytes checkpoints (transformers' serialization): 4-bit NF4/FP4, with or
without double quantization, and 8-bit (LLM.int8 weights).

4-bit, per linear (all stored flat, row-major over the [N, K] weight):
  weight uint8 [N*K/2, 1]      two codes per byte, high nibble first
  weight.quant_map [16]        the code book (NF4 or FP4 values)
  weight.absmax                per block of `blocksize` weights: float32, or with
                               double quant uint8 codes decoded as
                               nested_quant_map[code] * nested_absmax[i // nested_blocksize] +
                               nested_offset
  weight.quant_state.bitsandbytes__{nf4,fp4}  uint8 JSON: blocksize, shape, dtype, ...
W = quant_map[code] * absmax[block], returned by bitsandbytes in the state's dtype.
8-bit: weight int8 [N, K], SCB float32 [N]; W = weight * SCB / 127 (bitsandbytes'
constant). LLM.int8's outlier-aware int8 activations are a matmul strategy, not a
storage format: here activations stay in the model dtype.

No kernel keeps these packed: they are dequantized once at load (CPU and CUDA).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from edgellm.quant.linear_method import LinearMethod, ParamLayout, QuantLinearMethod
from edgellm.quant.schemes import QuantScheme, config_error, matches_any
from edgellm.quant.shard_params import empty_param, shard_ranges, stashed

_INV_127 = 7.874015718698502e-3  # bitsandbytes multiplies by this instead of dividing by 127
_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


class BitsAndBytesScheme(QuantScheme):
    name = "bitsandbytes"

    def __init__(self, config: dict[str, Any], cpu_kernels: str | None = None) -> None:
        super().__init__(cpu_kernels)
        four = bool(config.get("load_in_4bit") or config.get("_load_in_4bit"))
        eight = bool(config.get("load_in_8bit") or config.get("_load_in_8bit"))
        if four == eight:
            raise config_error(
                "bitsandbytes", "a config that is not exactly one of load_in_4bit/8bit", config
            )
        self.bits = 4 if four else 8
        if four:
            self.quant_type = str(config.get("bnb_4bit_quant_type", "fp4"))
            if self.quant_type not in ("nf4", "fp4"):
                raise config_error(
                    "bitsandbytes", f"bnb_4bit_quant_type {self.quant_type!r}", config
                )
            storage = str(config.get("bnb_4bit_quant_storage", "uint8"))
            if storage != "uint8":
                raise config_error("bitsandbytes", f"bnb_4bit_quant_storage {storage!r}", config)
            self.double_quant = bool(config.get("bnb_4bit_use_double_quant", False))
        elif config.get("llm_int8_has_fp16_weight"):
            raise config_error("bitsandbytes", "llm_int8_has_fp16_weight=true", config)
        self.ignore = list(config.get("llm_int8_skip_modules") or [])

    def is_ignored(self, name: str) -> bool:
        return matches_any(name, self.ignore, substring=True)

    def quantized_method(self, prefix: str, checkpoint_names: Sequence[str]) -> LinearMethod:
        return BnB4bitMethod(self) if self.bits == 4 else BnB8bitMethod(self)


class BnB4bitMethod(QuantLinearMethod):
    scheme: BitsAndBytesScheme

    def create_weights(
        self, layer: nn.Module, input_size: int, output_size: int, dtype: torch.dtype
    ) -> dict[str, ParamLayout]:
        names = [
            "weight",
            "weight.absmax",
            "weight.quant_map",
            f"weight.quant_state.bitsandbytes__{self.scheme.quant_type}",
        ]
        if self.scheme.double_quant:
            names += ["weight.nested_absmax", "weight.nested_quant_map"]
        return {n: ParamLayout(output_dim=None, stash=True) for n in names}

    def dequantize(self, layer: nn.Module) -> torch.Tensor:
        state_name = f"weight.quant_state.bitsandbytes__{self.scheme.quant_type}"
        parts = {name: dict(stashed(layer, name)) for name in layer.layouts if name != "bias"}
        ranges = shard_ranges(layer)
        rows = []
        for shard, blob in stashed(layer, state_name):
            where = f"{layer.prefix}" + (f" (shard {shard})" if shard else "")
            try:
                state = json.loads(bytes(blob.to(torch.uint8).tolist()).decode())
            except (UnicodeDecodeError, json.JSONDecodeError) as exc:
                raise ValueError(f"{where}: unreadable bitsandbytes quant_state ({exc})") from None
            start, end = ranges[shard]
            shape = [end - start, layer.input_size]
            if list(state.get("shape", [])) != shape:
                raise ValueError(f"{where}: quant_state shape {state.get('shape')} != {shape}")
            if state.get("quant_type", self.scheme.quant_type) != self.scheme.quant_type:
                raise ValueError(
                    f"{where}: quant_state says {state.get('quant_type')!r}, "
                    f"config says {self.scheme.quant_type!r}"
                )
            if ("nested_blocksize" in state) != self.scheme.double_quant:
                raise ValueError(
                    f"{where}: double quantization differs from bnb_4bit_use_double_quant"
                )
            rows.append(
                self._dequant_one(state, {k: v[shard] for k, v in parts.items()}, shape, where)
            )
        return torch.cat(rows, 0) if len(rows) > 1 else rows[0]

    def _dequant_one(
        self, state: dict[str, Any], t: dict[str, torch.Tensor], shape: list[int], where: str
    ) -> torch.Tensor:
        numel = shape[0] * shape[1]
        blocksize = int(state["blocksize"])
        blocks = -(-numel // blocksize)
        packed = t["weight"].reshape(-1).to(torch.uint8)
        if packed.numel() != -(-numel // 2):
            raise ValueError(
                f"{where}: weight has {packed.numel()} bytes, expected {-(-numel // 2)}"
            )
        codes = torch.stack((packed >> 4, packed & 15), -1).reshape(-1)[:numel].long()
        if self.scheme.double_quant:
            nested = int(state["nested_blocksize"])
            absmax_codes = t["weight.absmax"].reshape(-1).long()
            nested_absmax = t["weight.nested_absmax"].reshape(-1).float()
            if absmax_codes.numel() != blocks or nested_absmax.numel() != -(-blocks // nested):
                raise ValueError(f"{where}: absmax sizes do not match blocksize {blocksize}")
            idx = torch.arange(blocks) // nested
            absmax = t["weight.nested_quant_map"].float()[absmax_codes] * nested_absmax[idx]
            absmax = absmax + float(state["nested_offset"])
        else:
            absmax = t["weight.absmax"].reshape(-1).float()
            if absmax.numel() != blocks:
                raise ValueError(f"{where}: absmax has {absmax.numel()} blocks, expected {blocks}")
        quant_map = t["weight.quant_map"].float().reshape(-1)
        if quant_map.numel() != 16:
            raise ValueError(f"{where}: quant_map has {quant_map.numel()} entries, expected 16")
        w = quant_map[codes] * absmax[torch.arange(numel) // blocksize]
        dtype = _DTYPES.get(str(state.get("dtype", "float32")).replace("torch.", ""), torch.float32)
        return w.to(dtype).float().reshape(shape)


class BnB8bitMethod(QuantLinearMethod):
    def create_weights(
        self, layer: nn.Module, input_size: int, output_size: int, dtype: torch.dtype
    ) -> dict[str, ParamLayout]:
        empty_param(layer, "weight", (output_size, input_size), torch.int8)
        empty_param(layer, "SCB", (output_size,), torch.float32)
        return {
            "weight": ParamLayout(output_dim=0),
            "SCB": ParamLayout(output_dim=0),
            "weight_format": ParamLayout(output_dim=None, stash=True, optional=True),
        }

    def dequantize(self, layer: nn.Module) -> torch.Tensor:
        for _shard, fmt in stashed(layer, "weight_format"):
            # 0 = "row", the only serialized one
            if fmt.numel() != 1 or int(fmt.reshape(-1)[0]) != 0:
                raise ValueError(f"weight_format {fmt.tolist()} (only the row-major format loads)")
        return layer.weight.data.float() * layer.SCB.data[:, None] * _INV_127
