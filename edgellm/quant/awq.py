"""AWQ "gemm" checkpoints (AutoAWQ, GPTQModel): int4 asymmetric, group-wise.

On disk, for a linear with N outputs and K inputs, group g:
  qweight int32 [K, N/8]  packed along the output dim, AWQ's interleaved nibble order
  qzeros  int32 [K/g, N/8] packed the same way (true zero codes, no offset)
  scales  [K/g, N]
W = (q - z) * s. The output dim is dim 1, so fused shards concatenate there.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from edgellm.kernels.int4_layouts import awq_codes
from edgellm.quant.int_codes import Int4Codes
from edgellm.quant.linear_method import LinearMethod, ParamLayout, QuantLinearMethod
from edgellm.quant.schemes import QuantScheme, config_error, matches_any
from edgellm.quant.shard_params import empty_param


class AWQScheme(QuantScheme):
    name = "awq"

    def __init__(self, config: dict[str, Any], cpu_kernels: str | None = None) -> None:
        super().__init__(cpu_kernels)
        bits = config.get("bits", config.get("w_bit", 4))
        if bits != 4:
            raise config_error("AWQ", f"bits={bits} (int4 only)", config)
        version = str(config.get("version", "gemm")).lower()
        if version != "gemm":
            raise config_error("AWQ", f'version {version!r} (only the "gemm" layout)', config)
        if not config.get("zero_point", True):
            raise config_error("AWQ", "zero_point=false", config)
        self.group_size = int(config.get("group_size", config.get("q_group_size", 128)))
        if self.group_size <= 0:
            raise config_error("AWQ", f"group_size={self.group_size}", config)
        self.ignore = list(config.get("modules_to_not_convert") or [])

    def is_ignored(self, name: str) -> bool:
        return matches_any(name, self.ignore, substring=True)

    def quantized_method(self, prefix: str, checkpoint_names: Sequence[str]) -> LinearMethod:
        return AWQLinearMethod(self)


class AWQLinearMethod(QuantLinearMethod):
    scheme: AWQScheme

    def create_weights(
        self, layer: nn.Module, input_size: int, output_size: int, dtype: torch.dtype
    ) -> dict[str, ParamLayout]:
        gs = self.scheme.group_size
        if input_size % gs or output_size % 8:
            raise ValueError(
                f"AWQ: {layer.prefix} has {input_size} inputs / {output_size} outputs; needs "
                "inputs a "
                f"multiple of group_size {gs} and outputs a multiple of 8"
            )
        groups = input_size // gs
        empty_param(layer, "qweight", (input_size, output_size // 8), torch.int32)
        empty_param(layer, "qzeros", (groups, output_size // 8), torch.int32)
        empty_param(layer, "scales", (groups, output_size), torch.float32)
        return {
            "qweight": ParamLayout(output_dim=1, pack_factor=8),
            "qzeros": ParamLayout(output_dim=1, pack_factor=8),
            "scales": ParamLayout(output_dim=1),
        }

    def int4(self, layer: nn.Module) -> Int4Codes:
        q, z = awq_codes(layer.qweight.data, layer.qzeros.data)
        return Int4Codes(q, z, layer.scales.data.t(), self.scheme.group_size)

    def dequantize(self, layer: nn.Module) -> torch.Tensor:
        return self.int4(layer).dequantize()
