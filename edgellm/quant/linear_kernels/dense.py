"""The fallback matmul of every format: the weight dequantized once (model dtype), F.linear."""

from __future__ import annotations

import torch
import torch.nn.functional as F


class DenseKernel:
    """y = x W^T with W dequantized once (model dtype): the exact path."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.weight = weight

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return F.linear(x, self.weight, bias)
