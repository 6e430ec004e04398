"""Quantization primitives shared by the offline quantizers (RTN, GPTQ, AWQ).

One convention throughout: integer weights are held as unsigned codes
`q` in 0..2^b-1 with a zero code `z` per (row, group), W = (q - z) * s.
Symmetric quantization is the special case z = 2^(b-1) (8 for int4, 128 for
int8), which is how compressed-tensors (signed value + 2^(b-1)), GPTQ (zero 8
stored as 7) and the kernels in edgellm/kernels/int4_layouts.py see it.

Scales are rounded to the checkpoint's storage dtype *before* codes are
chosen, so the codes are optimal for the scales that end up on disk.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

FP8_MAX = float(torch.finfo(torch.float8_e4m3fn).max)  # 448


@dataclass(frozen=True)
class IntSpec:
    """Integer weight quantization: bits, symmetry, group size (-1 = one group per row)."""

    bits: int = 4
    symmetric: bool = True
    group_size: int = 128
    min_zero: int = 0  # GPTQ v1 cannot store a zero code 0 (it is written as zero-1)

    @property
    def maxq(self) -> int:
        return (1 << self.bits) - 1

    @property
    def mid(self) -> int:
        return 1 << (self.bits - 1)

    def groups(self, k: int) -> int:
        return 1 if self.group_size <= 0 else k // self.group_size

    def group_len(self, k: int) -> int:
        return k if self.group_size <= 0 else self.group_size


@dataclass
class IntWeight:
    """A quantized linear weight in the unpacked convention (see module doc)."""

    codes: torch.Tensor  # [N, K] int32, 0..maxq
    scales: torch.Tensor  # [N, G] float32 (values exact in the storage dtype)
    zeros: torch.Tensor | None  # [N, G] int32 codes; None = symmetric (mid)
    spec: IntSpec
    g_idx: torch.Tensor | None = None  # [K] group of each input column (act-order "group")

    def group_index(self) -> torch.Tensor:
        k = self.codes.shape[1]
        if self.g_idx is not None:
            return self.g_idx.long()
        return torch.arange(k) // self.spec.group_len(k)

    def dequantize(self) -> torch.Tensor:
        g = self.group_index()
        z = float(self.spec.mid) if self.zeros is None else self.zeros.float()[:, g]
        return (self.codes.float() - z) * self.scales[:, g]


@dataclass
class FP8Weight:
    """float8_e4m3fn weight with per-channel [N, 1] or per-tensor [1] scale."""

    weight: torch.Tensor  # [N, K] float8_e4m3fn
    scale: torch.Tensor  # [N, 1] or [1] float32 (exact in the storage dtype)
    input_scale: torch.Tensor | None = None  # [1] static activation scale

    def dequantize(self) -> torch.Tensor:
        return self.weight.float() * self.scale


def round_scale(scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Scale as it will be stored: rounded to `dtype`, never zero, back in float32."""
    tiny = torch.finfo(dtype).tiny  # smallest normal: a scale never goes subnormal or zero
    return scale.clamp(min=tiny).to(dtype).float()


def int_qparams(
    w: torch.Tensor, spec: IntSpec, scale_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Min-max scale and zero code per row of `w` [N, k] (one group) -> (scale [N], zero [N])."""
    w = w.float()
    if spec.symmetric:
        absmax = w.abs().amax(dim=1)
        absmax = torch.where(absmax == 0, torch.ones_like(absmax), absmax)
        scale = round_scale(absmax / (spec.maxq / 2), scale_dtype)
        return scale, torch.full_like(scale, float(spec.mid))
    xmin = w.amin(dim=1).clamp(max=0)
    xmax = w.amax(dim=1).clamp(min=0)
    both0 = (xmin == 0) & (xmax == 0)
    xmin, xmax = (
        torch.where(both0, -torch.ones_like(xmin), xmin),
        torch.where(both0, torch.ones_like(xmax), xmax),
    )
    scale = round_scale((xmax - xmin) / spec.maxq, scale_dtype)
    zero = torch.round(-xmin / scale).clamp(0, spec.maxq)
    if spec.min_zero:
        low = zero < spec.min_zero
        if bool(low.any()):  # all-positive group: shift the grid so code min_zero is 0.0
            zero = torch.where(low, torch.full_like(zero, float(spec.min_zero)), zero)
            alt = round_scale(xmax / (spec.maxq - spec.min_zero), scale_dtype)
            scale = torch.where(low, alt, scale)
    return scale, zero


def quantize_codes(
    w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, maxq: int
) -> torch.Tensor:
    """Codes for `w` [N, ...] given per-row scale/zero broadcastable to it (float result)."""
    return torch.clamp(torch.round(w / scale) + zero, 0, maxq)


def rtn_quantize(w: torch.Tensor, spec: IntSpec, scale_dtype: torch.dtype) -> IntWeight:
    """Round-to-nearest, group-wise min-max: the baseline every algorithm must beat."""
    n, k = w.shape
    g = spec.group_len(k)
    wg = w.float().reshape(n, k // g, g)
    scales, zeros = int_qparams(wg.reshape(-1, g), spec, scale_dtype)
    scales, zeros = scales.view(n, -1), zeros.view(n, -1)
    codes = quantize_codes(wg, scales[..., None], zeros[..., None], spec.maxq).reshape(n, k)
    return IntWeight(
        codes.to(torch.int32), scales, None if spec.symmetric else zeros.to(torch.int32), spec
    )


def fake_quantize_groups(
    w: torch.Tensor, spec: IntSpec, scale_dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """RTN quantize-dequantize (for searches that only need the rounded weight)."""
    n, k = w.shape
    g = spec.group_len(k)
    wg = w.float().reshape(-1, g)
    scale, zero = int_qparams(wg, spec, scale_dtype)
    q = quantize_codes(wg, scale[:, None], zero[:, None], spec.maxq)
    return ((q - zero[:, None]) * scale[:, None]).reshape(n, k)


def fp8_quantize(w: torch.Tensor, per_channel: bool, scale_dtype: torch.dtype) -> FP8Weight:
    w = w.float()
    absmax = w.abs().amax(dim=1, keepdim=True) if per_channel else w.abs().amax().reshape(1)
    scale = round_scale(absmax / FP8_MAX, scale_dtype)
    q = (w / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return FP8Weight(q, scale)


def fp8_input_scale(absmax: float, scale_dtype: torch.dtype) -> torch.Tensor:
    return round_scale(torch.tensor([max(absmax, 1e-8) / FP8_MAX]), scale_dtype)
