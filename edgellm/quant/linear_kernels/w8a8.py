"""8-bit weights (compressed-tensors int-quantized / float-quantized): W8A8 int8 with exact
integer math on CPU, W8A16, and FP8 (W8A8 where the GPU has fp8, weight-only elsewhere); on CUDA
the Triton kernels, on CPU torch with the formats' own rounding."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from edgellm.quant.linear_kernels.triton import use_triton

INT8_ACT_RANGE = (
    127.5  # compressed-tensors: absmax / ((q_max - q_min) / 2), then round and clamp to int8
)
Segment = tuple[
    int, int, "torch.Tensor | None"
]  # output rows [start, end) sharing a static input scale


def quant_int8_ref(
    x: torch.Tensor, static_scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (int8 codes, fp32 scale [M, 1]) as compressed-tensors quantizes activations:
    scale = absmax / 127.5 per token (or the static one), q = clamp(round(x / scale), -128, 127)."""
    xf = x.float()
    if static_scale is None:
        scale = (xf.abs().amax(-1, keepdim=True) / INT8_ACT_RANGE).clamp_min(
            torch.finfo(torch.float32).tiny
        )
    else:
        scale = static_scale.float().reshape(1, 1).expand(x.shape[0], 1)
    return torch.round(xf / scale).clamp_(-128, 127).to(torch.int8), scale


class Int8W8A8Kernel:
    """int8 activations (per token, or static per shard) x int8 weights, int32 accumulation.
    CPU: torch._int_mm (exact integer math); CUDA: activations quantized the same way,
    dequantized, and fed to the W8A16 Triton kernel."""

    def __init__(
        self,
        weight: torch.Tensor,
        scale: torch.Tensor,
        segments: list[Segment],
        device: torch.device,
    ) -> None:
        self.weight = weight.to(device).contiguous()
        self.scale = scale.to(device)
        self.segments = [(a, b, None if s is None else s.to(device)) for a, b, s in segments]
        self.cuda = use_triton(device)

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        parts = []
        for start, end, static in self.segments:
            xq, xs = quant_int8_ref(x2, static)
            w, ws = self.weight[start:end], self.scale[start:end]
            if self.cuda:
                from edgellm.kernels.int8_gemm import w8a16_gemm

                parts.append(w8a16_gemm((xq.float() * xs).to(x.dtype), w, ws[:, None]).float())
            elif x2.shape[0]:
                parts.append(torch._int_mm(xq, w.t()).float() * xs * ws)
            else:
                parts.append(x2.new_zeros((0, end - start), dtype=torch.float32))
        y = torch.cat(parts, -1) if len(parts) > 1 else parts[0]
        if bias is not None:
            y = y + bias.float()
        return y.to(x.dtype).reshape(*x.shape[:-1], y.shape[-1])


class Int8WeightOnlyKernel:
    """W8A16: CUDA the Triton kernel; CPU the dequantized weight (exact)."""

    def __init__(
        self, weight: torch.Tensor, scale: torch.Tensor, device: torch.device, dtype: torch.dtype
    ) -> None:
        self.cuda = use_triton(device)
        if self.cuda:
            self.weight, self.scale = weight.to(device), scale.to(device)[:, None]
        else:
            self.dense = (weight.float() * scale[:, None]).to(dtype)

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.cuda:
            from edgellm.kernels.int8_gemm import w8a16_gemm

            return w8a16_gemm(x, self.weight, self.scale, bias)
        return F.linear(x, self.dense, bias)


class FP8Kernel:
    """CUDA: the FP8 Triton GEMM (W8A8 on sm89+, weight-only dequant elsewhere), per
    input-scale segment. CPU: the weight dequantized once (exact, fp32), activations
    quantized to fp8 and back exactly as the W8A8 kernel does."""

    def __init__(
        self,
        weight: torch.Tensor,
        scale: torch.Tensor,
        segments: list[Segment],
        activations: str | None,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        self.cuda = use_triton(device)
        self.activations = activations  # None (weight-only) | "token" | "tensor"
        self.segments = [(a, b, None if s is None else s.to(device)) for a, b, s in segments]
        if self.cuda:
            self.weight = weight.to(device)
            self.scale = scale.to(device)[:, None]
        else:
            self.dense = (weight.float() * scale[:, None]).to(dtype)

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        from edgellm.kernels.fp8_gemm import (
            fp8_activations_supported,
            fp8_gemm,
            quant_fp8_per_token_ref,
        )
        from edgellm.kernels.gemm_common import interpreting

        x2 = x.reshape(-1, x.shape[-1])
        parts = []
        # W8A8 where the GPU has fp8 (sm89+) or under the interpreter; weight-only elsewhere
        act_fp8 = self.activations is not None and (
            fp8_activations_supported(x.device) or interpreting()
        )
        for start, end, static in self.segments:
            b = None if bias is None else bias[start:end]
            if self.cuda:
                parts.append(
                    fp8_gemm(
                        x2,
                        self.weight[start:end],
                        self.scale[start:end],
                        static,
                        b,
                        use_fp8_activations=act_fp8,
                    )
                )
                continue
            xa = x2
            if self.activations is not None:
                xq, xs = quant_fp8_per_token_ref(x2, static)
                xa = (xq.float() * xs).to(x.dtype)
            parts.append(F.linear(xa, self.dense[start:end], b))
        y = torch.cat(parts, -1) if len(parts) > 1 else parts[0]
        return y.reshape(*x.shape[:-1], y.shape[-1])
