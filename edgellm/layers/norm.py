"""RMSNorm, computed in float32 like the reference implementations."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        eps: float = 1e-6,
        dtype: torch.dtype = torch.float32,
        weight_offset: float = 0.0,
        native: Any = None,
    ) -> None:
        """weight_offset: the checkpoint's weight w scales by (offset + w) (Gemma: 1); the loader
        folds it into the weight once (`fold_offset`), in float32 like the reference's 1 + w.
        native: the C++ CPU kernels (edgellm/layer_ops.py), whose one-pass RMSNorm then runs fp32
        rows of multi-row steps; None: torch."""
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype), requires_grad=False)
        self.weight_offset = weight_offset
        self.native = native

    def fold_offset(self) -> None:
        if self.weight_offset:
            self.weight.data.copy_(self.weight.data.float() + self.weight_offset)
            self.weight_offset = 0.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (
            self.native is not None
            and x.dtype == torch.float32
            and self.weight.dtype == torch.float32
            and x.dim() == 2
            and x.shape[0] > 1
            and x.stride(1) == 1
        ):
            return self.native.rms_norm(
                x, self.weight, float(self.eps)
            )  # one pass (csrc/cpu/norm.cpp)
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            # one fused op instead of six; the same fp32 math, bit for bit
            # (tests/models/test_layers.py)
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        input_dtype = x.dtype
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(input_dtype)
