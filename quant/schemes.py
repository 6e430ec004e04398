"""The one place quantization plugs in.

A QuantScheme is chosen from a checkpoint's `quantization_config` (or a
GGUF's tensor types). For every linear layer it hands out a LinearMethod,
which owns that layer's parameters: what they are called on disk, their
shapes, along which dim a fused module's shards are concatenated, and how
the matmul runs. Layers and the loader never branch on the format.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class ParamLayout:
    """How a parameter relates to the layer's output features.

    output_dim: the tensor dim indexing output features (None: not sharded,
    e.g. a per-tensor scale that every shard must agree on).
    pack_factor: output features per element along output_dim (8 for int4
    packed along the output dim, else 1).
    """

    output_dim: int | None = 0
    pack_factor: int = 1


class LinearMethod(ABC):
    """Owns one linear layer's parameters and its matmul."""

    @abstractmethod
    def create_weights(
        self, layer: nn.Module, input_size: int, output_size: int, dtype: torch.dtype
    ) -> dict[str, ParamLayout]:
        """Register the parameters on `layer` (empty) and return their layouts."""

    @abstractmethod
    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """y = x @ W.T + bias, for x [..., input_size]."""

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Repack or convert once all shards are in (e.g. into a kernel's preferred layout)."""


class UnquantizedLinearMethod(LinearMethod):
    def create_weights(
        self, layer: nn.Module, input_size: int, output_size: int, dtype: torch.dtype
    ) -> dict[str, ParamLayout]:
        layer.weight = nn.Parameter(torch.empty(output_size, input_size, dtype=dtype), requires_grad=False)
        return {"weight": ParamLayout(output_dim=0)}

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return F.linear(x, layer.weight, bias)


class QuantScheme(ABC):
    """A checkpoint format: hands out a LinearMethod per linear layer."""

    name: str = "none"

    @abstractmethod
    def linear_method(self, prefix: str) -> LinearMethod:
        """The method for the linear at module path `prefix` (e.g. model.layers.0.mlp.down_proj)."""


class Unquantized(QuantScheme):
    name = "none"

    def linear_method(self, prefix: str) -> LinearMethod:
        return UnquantizedLinearMethod()


def scheme_from_config(quantization_config: dict[str, Any] | None) -> QuantScheme:
    """Pick the scheme for a checkpoint; a format we cannot run exactly is an error, never a guess."""
    if not quantization_config:
        return Unquantized()
    method = quantization_config.get("quant_method") or quantization_config.get("format") or "?"
    raise ValueError(
        f"quantization format {method!r} is not supported by this build "
        f"(quantization_config={quantization_config})"
    )
