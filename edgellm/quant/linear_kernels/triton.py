"""The CUDA matmuls of weight-only formats: int4 repacked once into the W4A16 Triton kernel's
layout, and int8 codes with group scales (GGUF's 5/6/8-bit types and K-quants) in the grouped
W8 kernel. The same kernels run on CPU tensors under Triton's interpreter in tests."""

from __future__ import annotations

import torch

from edgellm import env
from edgellm.quant.int_codes import Int4Codes, Int8Codes


def use_triton(device: torch.device) -> bool:
    """CUDA runs the Triton kernels. Tests can run the same path on CPU tensors under
    the Triton interpreter (TRITON_INTERPRET=1 and EDGELLM_TRITON_ON_CPU=1)."""
    return device.type == "cuda" or env.triton_on_cpu()


class TritonInt4Kernel:
    """The W4A16 dequant-GEMM over the canonical layout (edgellm/kernels/int4_layouts)."""

    def __init__(self, codes: Int4Codes, device: torch.device) -> None:
        from edgellm.kernels.int4_layouts import repack_int4

        w = repack_int4(
            codes.codes,
            codes.zeros,
            codes.scales,
            codes.group_size,
            codes.g_idx,
            offsets=codes.offsets,
        )
        for name, value in vars(w).items():
            if isinstance(value, torch.Tensor):
                setattr(w, name, value.to(device))
        self.weight = w

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        from edgellm.kernels.dequant_gemm import w4a16_gemm

        return w4a16_gemm(x, **vars(self.weight), bias=bias)


class TritonInt8GroupedKernel:
    """int8 codes with group scales and offsets through the grouped W8 GEMM
    (edgellm/kernels/grouped_gemm)."""

    def __init__(self, codes: Int8Codes, device: torch.device) -> None:
        self.codes = codes.codes.to(device=device, dtype=torch.int8).contiguous()
        self.scales = codes.scales.float().t().contiguous().to(device)
        offsets = codes.offsets
        self.offsets = None if offsets is None else offsets.float().t().contiguous().to(device)
        self.group_size = codes.group_size

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        from edgellm.kernels.grouped_gemm import w8g_gemm

        return w8g_gemm(x, self.codes, self.scales, self.group_size, self.offsets, bias=bias)
