"""What the layers of one model run, decided once per load and handed to them at construction.

LayerOps.for_load reads the load's Platform (CPU mode and ISA, edgellm/platform.py), the device
and the model dtype:
- CUDA: the Triton attention kernels; everything else is plain torch on the GPU.
- CPU, fp32 models: the CPU attention backend (C++ decode rows when the kernels built). In modes
  fast, and auto with a quantized checkpoint, also: prefill attention in bf16 (fast), or in auto
  in the dtype measured faster at load where the CPU has bf16 units, else fp32
  (edgellm/attention/cpu_dtype.py), with shared-prefix attention (its prefix product by the
  kernel measured faster at load, edgellm/attention/cpu_prefix.py); RMSNorm, rotary and
  SiLU-and-mul in C++;
  and (fast, or auto with bf16 units) a bf16 MLP intermediate on steps whose two MLP linears
  round to bf16 anyway. Mode exact keeps transformers' math: prefill chunks one at a time in fp32.
- Anything else (a bf16 model on CPU): the plain torch reference.
No layer changes what it runs after construction.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from edgellm.attention.base import AttentionBackend
from edgellm.attention.torch_ref import TorchRefAttention

if TYPE_CHECKING:
    from edgellm.platform import Platform


@dataclass(frozen=True)
class LayerOps:
    attention: AttentionBackend = field(default_factory=TorchRefAttention)
    native: Any = None  # the C++ module for RMSNorm, rotary, SiLU-and-mul (None: torch ops)
    bf16_mlp: bool = False  # MLPs may keep a bf16 intermediate (MLP._bf16_step decides per step)

    @classmethod
    def for_load(
        cls, platform: Platform, device: torch.device | str, dtype: torch.dtype, quantized: bool
    ) -> LayerOps:
        device = torch.device(device)
        if device.type == "cuda":
            from edgellm.attention.triton import TritonAttention

            return cls(TritonAttention())
        if device.type != "cpu" or dtype != torch.float32:
            return cls()
        from edgellm.attention.cpu import CpuAttention

        native = platform.native()
        fast = platform.cpu_quant == "fast"
        tuned = fast or (platform.cpu_quant == "auto" and quantized)
        if not tuned:
            return cls(CpuAttention(native))
        from edgellm.attention.cpu_dtype import prefill_dtype
        from edgellm.attention.cpu_prefix import prefix_kernel

        prefill = torch.bfloat16 if fast else prefill_dtype(native, platform.isa.bf16_units)
        attention = CpuAttention(native, prefill, prefix_kernel(native, prefill))
        return cls(attention, native, fast or platform.isa.bf16_units)

    def describe(self) -> str:
        parts = [f"attention {self.attention.name}"]
        if self.native is not None:
            parts.append("C++ norm/rotary/silu")
        if self.bf16_mlp:
            parts.append("bf16 MLP intermediate")
        return ", ".join(parts)
