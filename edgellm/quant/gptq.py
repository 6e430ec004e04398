"""GPTQ checkpoints (AutoGPTQ, GPTQModel): int4, symmetric or not, act-order via g_idx.

On disk, for a linear with N outputs and K inputs, group g (G groups):
  qweight int32 [K/8, N]  packed along the input dim (nibble i of row j = input 8j+i)
  qzeros  int32 [G, N/8]  packed along the output dim; v1 stores zero-1 (4-bit wrap)
  scales  [G, N]
  g_idx   int32 [K]       group of each input row (shuffled when desc_act=true)
W = (q - z) * s[g_idx]. The output dim is dim 1. checkpoint_format gptq_v2 stores
the zeros themselves.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from edgellm.kernels.int4_layouts import unpack_int4
from edgellm.quant.int_codes import Int4Codes
from edgellm.quant.linear_method import LinearMethod, ParamLayout, QuantLinearMethod
from edgellm.quant.schemes import QuantScheme, config_error
from edgellm.quant.shard_params import common_g_idx, dequantize_g_idx, empty_param, shard_g_idx


class GPTQScheme(QuantScheme):
    name = "gptq"

    def __init__(self, config: dict[str, Any], cpu_kernels: str | None = None) -> None:
        super().__init__(cpu_kernels)
        bits = config.get("bits", 4)
        if bits != 4:
            raise config_error("GPTQ", f"bits={bits} (int4 only)", config)
        fmt = str(config.get("checkpoint_format") or config.get("format") or "gptq").lower()
        if fmt not in ("gptq", "gptq_v2"):
            raise config_error("GPTQ", f"checkpoint_format {fmt!r} (gptq and gptq_v2 only)", config)
        self.zero_offset = 1 if fmt == "gptq" else 0
        if config.get("lm_head"):
            raise config_error("GPTQ", "a quantized lm_head", config)
        if config.get("dynamic"):
            raise config_error("GPTQ", "per-module `dynamic` overrides", config)
        self.group_size = int(config.get("group_size", 128))
        self.desc_act = bool(config.get("desc_act", False))
        blocks = config.get("modules_in_block_to_quantize")
        self.only = [m for group in blocks for m in group] if blocks else None

    def is_ignored(self, name: str) -> bool:
        return self.only is not None and not any(name.endswith("." + m) for m in self.only)

    def quantized_method(self, prefix: str, checkpoint_names: Sequence[str]) -> LinearMethod:
        return GPTQLinearMethod(self)


class GPTQLinearMethod(QuantLinearMethod):
    scheme: GPTQScheme

    def create_weights(
        self, layer: nn.Module, input_size: int, output_size: int, dtype: torch.dtype
    ) -> dict[str, ParamLayout]:
        gs = self.scheme.group_size if self.scheme.group_size > 0 else input_size
        if input_size % 8 or output_size % 8:
            raise ValueError(
                f"GPTQ: {layer.prefix} needs inputs and outputs that are multiples of 8 "
                f"(has {input_size} x {output_size})"
            )
        self.group_size = gs
        self.groups = -(-input_size // gs)
        empty_param(layer, "qweight", (input_size // 8, output_size), torch.int32)
        empty_param(layer, "qzeros", (self.groups, output_size // 8), torch.int32)
        empty_param(layer, "scales", (self.groups, output_size), torch.float32)
        return {
            "qweight": ParamLayout(output_dim=1),
            "qzeros": ParamLayout(output_dim=1, pack_factor=8),
            "scales": ParamLayout(output_dim=1),
            # per shard (each shard of a fused module has its own); act-order needs it
            "g_idx": ParamLayout(output_dim=None, stash=True, optional=not self.scheme.desc_act),
        }

    def _codes(self, layer: nn.Module) -> Int4Codes:
        q = unpack_int4(layer.qweight.data, 0).t()
        z = unpack_int4(layer.qzeros.data, 1).t() + self.scheme.zero_offset
        return Int4Codes(q, z, layer.scales.data.t(), self.group_size)

    def int4(self, layer: nn.Module) -> Int4Codes | None:
        same, g_idx = common_g_idx(shard_g_idx(layer, "g_idx", self.groups))
        if not same:
            return None  # shards ordered differently: dequantized per shard instead
        codes = self._codes(layer)
        codes.g_idx = g_idx
        return codes

    def dequantize(self, layer: nn.Module) -> torch.Tensor:
        return dequantize_g_idx(layer, self._codes(layer), shard_g_idx(layer, "g_idx", self.groups))
