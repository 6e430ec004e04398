"""LinearMethod: what one linear layer's parameters are and how its matmul runs.

A LinearMethod owns a layer's parameters: what they are called on disk, their shapes
(ParamLayout: along which dim a fused module's shards are concatenated) and the matmul.
UnquantizedLinearMethod is the plain float weight.

Weight-only formats subclass QuantLinearMethod: the format only decodes its tensors
(exactly: `dequantize`, and where it is plain int4, `int4`); the base picks the matmul
(edgellm/quant/backends.py): the Triton kernels on CUDA, and on CPU what the load's
Platform says (edgellm/platform.py: integer dots in mode auto, dequantized once in mode
exact).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from edgellm.quant.shard_params import free_params

if TYPE_CHECKING:
    from edgellm.quant.int_codes import Int4Codes, Int8Codes
    from edgellm.quant.schemes import QuantScheme


@dataclass(frozen=True)
class ParamLayout:
    """How a checkpoint tensor of a linear relates to the layer's output features.

    output_dim: the tensor dim indexing output features (None: not sharded).
    pack_factor: output features per element along output_dim (8 for int4
    packed along the output dim, else 1).
    stash: not preallocated; each shard's tensor is kept as loaded in
    `layer.stash[name][shard]` (shard "" = the whole fused tensor) for
    process_weights_after_loading to assemble: per-tensor scales of fused
    shards, tensors whose shape only the file knows, or blobs.
    optional: a checkpoint may omit it.
    """

    output_dim: int | None = 0
    pack_factor: int = 1
    stash: bool = False
    optional: bool = False


class LinearMethod(ABC):
    """Owns one linear layer's parameters and its matmul."""

    @abstractmethod
    def create_weights(
        self, layer: nn.Module, input_size: int, output_size: int, dtype: torch.dtype
    ) -> dict[str, ParamLayout]:
        """Register the parameters on `layer` (empty) and return their layouts, keyed by
        the checkpoint's parameter names (stashed ones may contain dots and need no attribute)."""

    @abstractmethod
    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """y = x @ W.T + bias, for x [..., input_size]."""

    def process_weights_after_loading(self, layer: nn.Module) -> None:  # noqa: B027 (optional hook)
        """Repack or convert once all shards are in (e.g. into a kernel's preferred layout)."""


class UnquantizedLinearMethod(LinearMethod):
    def create_weights(
        self, layer: nn.Module, input_size: int, output_size: int, dtype: torch.dtype
    ) -> dict[str, ParamLayout]:
        layer.weight = nn.Parameter(
            torch.empty(output_size, input_size, dtype=dtype), requires_grad=False
        )
        return {"weight": ParamLayout(output_dim=0)}

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return F.linear(x, layer.weight, bias)


class QuantLinearMethod(LinearMethod):
    """A weight-quantized linear: the format decodes, edgellm/quant/backends.py chooses the matmul.

    Subclasses implement `create_weights` and `dequantize` (exact float32 W [N, K]),
    and `int4` where the weights are plain int4 codes with group scales.
    """

    def __init__(self, scheme: QuantScheme) -> None:
        self.scheme = scheme

    @abstractmethod
    def dequantize(self, layer: nn.Module) -> torch.Tensor:
        """W [N, K] float32, exactly as the format defines it."""

    def int4(self, layer: nn.Module) -> Int4Codes | None:
        """The weights as int4 codes with group scales, when the format is that (else None)."""
        return None

    def int8(self, layer: nn.Module) -> Int8Codes | None:
        """The weights as int8 codes with group scales, when the format is that (else None)."""
        return None

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        from edgellm.quant.backends import build_kernel

        layer.kernel = build_kernel(self, layer, self.scheme.platform)
        free_params(layer, [n for n in layer.layouts if n != "bias"])

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return layer.kernel(x, bias)
