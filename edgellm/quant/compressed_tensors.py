"""compressed-tensors checkpoints (llm-compressor): `pack-quantized` int4 (and int8,
W8A16), `int-quantized` int8 (W8A8 or weight-only) and `float-quantized` FP8.

For a linear with N outputs, K inputs, group g (README of the fixtures):
  pack-quantized   weight_packed int32 [N, K/8] along K (codes = q + 8); weight_scale
                   [N, K/g]; weight_shape int64 [2]; asymmetric: weight_zero_point int32
                   [N/8, K/g] along N (+8); actorder "group": weight_g_idx [K]
  int-quantized    weight int8 [N, K]; weight_scale [N, 1] (channel) or [1] (tensor)
  float-quantized  weight float8_e4m3fn [N, K]; weight_scale as above
  activations      dynamic per token (nothing on disk) or static per tensor (input_scale [1])
The output dim is dim 0. Per-tensor scales of fused shards are kept per shard:
weight scales are expanded to per-channel (exact); shards with different static
input scales quantize the activations once per shard (exact).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from edgellm.quant.compressed_tensors_config import CTGroup, parse_group
from edgellm.quant.compressed_tensors_methods import FP8Method, Int8Method, PackedMethod
from edgellm.quant.linear_method import LinearMethod, UnquantizedLinearMethod
from edgellm.quant.schemes import QuantScheme, config_error, matches_any


class CompressedTensorsScheme(QuantScheme):
    name = "compressed-tensors"

    def __init__(self, config: dict[str, Any], cpu_kernels: str | None = None) -> None:
        super().__init__(cpu_kernels)
        status = config.get("quantization_status", "compressed")
        if status != "compressed":
            raise config_error(
                "compressed-tensors", f"quantization_status {status!r} (compressed only)", config
            )
        for key in ("sparsity_config", "transform_config"):
            if config.get(key):
                raise config_error("compressed-tensors", key, config)
        groups = config.get("config_groups") or {}
        if not groups:
            raise config_error("compressed-tensors", "a config without config_groups", config)
        top = config.get("format")
        self.groups = [parse_group(n, g, top, config) for n, g in groups.items()]
        self.ignore = list(config.get("ignore") or [])

    def is_ignored(self, name: str) -> bool:
        return matches_any(name, self.ignore)

    def _group(self, name: str) -> CTGroup | None:
        return next((g for g in self.groups if g.targets_linear(name)), None)

    def quantized_method(self, prefix: str, checkpoint_names: Sequence[str]) -> LinearMethod:
        found = {self._group(n) for n in checkpoint_names}
        if len(found) > 1:
            raise ValueError(
                f"compressed-tensors: {', '.join(checkpoint_names)} (fused into {prefix}) "
                f"belong to different config groups"
            )
        group = found.pop()
        if group is None:
            return UnquantizedLinearMethod()  # targeted by no group
        cls = {
            "pack-quantized": PackedMethod,
            "int-quantized": Int8Method,
            "float-quantized": FP8Method,
        }[group.format]
        return cls(self, group)
