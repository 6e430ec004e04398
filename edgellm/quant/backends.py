"""The chooser of a weight-quantized linear's matmul: what a QuantLinearMethod runs once its
format has decoded the checkpoint tensors (edgellm/quant/linear_method.py builds it at load).

- CUDA (or Triton's interpreter in tests): int4 (AWQ, GPTQ, compressed-tensors, GGUF
  Q4_0/Q4_1/Q4_K) in the W4A16 kernel, GGUF's other types as int8 codes in the grouped W8
  kernel (linear_kernels/triton.py).
- CPU mode "auto": the integer-dot kernel over int8-quantized activations
  (linear_kernels/cpu_int.py) wherever its can_implement accepts the weight.
- CPU mode "fast": int4 through torch's int4 GEMV and bf16 copies (linear_kernels/cpu_fast.py).
- Everything else, and CPU mode "exact": the weight dequantized once with the format's exact
  formula (linear_kernels/dense.py).

8-bit formats with their own activation rules (W8A8, FP8) build their kernels in their scheme
(linear_kernels/w8a8.py). A weight a kernel cannot take falls back to the dense path with one
log line naming the layer and the reason.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch
from torch import nn

from edgellm.quant.linear_kernels.dense import DenseKernel
from edgellm.quant.linear_kernels.triton import (
    TritonInt4Kernel,
    TritonInt8GroupedKernel,
    use_triton,
)

if TYPE_CHECKING:
    from edgellm.platform import Platform
    from edgellm.quant.linear_method import QuantLinearMethod

logger = logging.getLogger(__name__)


def layer_device(layer: nn.Module) -> torch.device:
    return getattr(layer, "device", None) or torch.device("cpu")


def build_kernel(method: QuantLinearMethod, layer: nn.Module, platform: Platform):
    """The matmul for a loaded weight-quantized linear (see the module docstring)."""
    device = layer_device(layer)
    codes = method.int4(layer)
    if use_triton(device):
        if codes is not None:
            return TritonInt4Kernel(codes, device)
        if (codes8 := method.int8(layer)) is not None:
            return TritonInt8GroupedKernel(codes8, device)
    elif platform.cpu_quant == "auto" and (
        codes is not None or (codes := method.int8(layer)) is not None
    ):
        from edgellm.quant.linear_kernels.cpu_int import CpuIntDotKernel

        native = platform.native()
        ok, why = CpuIntDotKernel.can_implement(
            codes=codes, platform=platform, native=native, dtype=layer.dtype
        )
        if ok:
            return CpuIntDotKernel(codes, native, platform)
        logger.info("%s: %s; dequantized instead", layer.prefix, why)
    elif platform.cpu_quant == "fast" and codes is not None:
        from edgellm.quant.linear_kernels.cpu_fast import CpuInt4Kernel

        kernel = CpuInt4Kernel.build(codes, layer.dtype, platform)
        if kernel is not None:
            return kernel
        logger.info(
            "%s: int4 shapes unsuited to the CPU int4 GEMV; dequantized instead", layer.prefix
        )
    return DenseKernel(method.dequantize(layer).to(device=device, dtype=layer.dtype))
