"""Integer weight codes with group scales: the exact forms formats decode to and kernels take.

Int4Codes (unpacked int4 with zeros, scales, optional act-order g_idx and offsets) and
Int8Codes (int8 with group scales and optional offsets), each with its exact float32
`dequantize`; SplitScales, the integer-times-base form of K-quant scales that both may carry.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class SplitScales:
    """Group values [N, G] as integer multipliers times a base that G / B consecutive groups share
    (GGUF's K-quants: a 4- to 8-bit scale or minimum per group, an fp16 per 256 columns), so that
    values() = mult * base is exact in fp32. Kernels may store this form instead of the values
    (edgellm/kernels/csrc/cpu/qgemm_n16.h's compact scales)."""

    mult: torch.Tensor  # [N, G] integers within -128..127
    base: torch.Tensor  # [N, B] fp32

    def values(self) -> torch.Tensor:
        from edgellm.kernels.reference import expand_compact_ref

        return expand_compact_ref(self.mult, self.base)

    def repeat_groups(self, rep: int) -> SplitScales:
        """The same values in groups `rep` times finer."""
        return SplitScales(self.mult.repeat_interleave(rep, 1), self.base)

    @staticmethod
    def cat(parts: list[SplitScales | None]) -> SplitScales | None:
        """Row-wise concatenation; None when a part has no split or the parts' shapes differ."""
        if any(p is None for p in parts):
            return None
        shapes = {(p.mult.shape[1], p.base.shape[1]) for p in parts if p is not None}
        if len(shapes) != 1:
            return None
        return SplitScales(
            torch.cat([p.mult for p in parts if p is not None], 0),
            torch.cat([p.base for p in parts if p is not None], 0),
        )


@dataclass
class Int8Codes:
    """int8 weights with group scales: W[n, k] = scales[n, g] * codes[n, k] (+ offsets[n, g]),
    g = k // group_size (GGUF Q8_0: groups of 32 with an fp16 scale; the 5- and 6-bit and
    K-quant types: see quant/gguf_blocks.py, groups of 16 or 32, fp32 scales, some offsets)."""

    codes: torch.Tensor  # [N, K] int8
    scales: torch.Tensor  # [N, K / group_size] float
    group_size: int
    offsets: torch.Tensor | None = None  # [N, K / group_size] float
    scale_split: SplitScales | None = None  # scales in split form, where the format has one
    offset_split: SplitScales | None = None  # offsets likewise (None: none, or no split form)

    def dequantize(self) -> torch.Tensor:
        """W [N, K] float32 with one rounding per element (two with offsets)."""
        n, k = self.codes.shape
        w = (
            self.codes.float().reshape(n, k // self.group_size, self.group_size)
            * self.scales.float()[..., None]
        )
        if self.offsets is not None:
            w = w + self.offsets.float()[..., None]
        return w.reshape(n, k)


@dataclass
class Int4Codes:
    """Unpacked int4: W[n, k] = (codes[n, k] - zeros[n, g]) * scales[n, g] + offsets[n, g],
    g = g_idx[k] or k // group_size. zeros None = 8 (symmetric) when there are no
    offsets, else 0: GGUF Q4_1 is W = codes * d + m, m the block minimum."""

    codes: torch.Tensor  # [N, K] int 0..15
    zeros: torch.Tensor | None  # [N, G] int
    scales: torch.Tensor  # [N, G] float
    group_size: int
    g_idx: torch.Tensor | None = None  # [K]
    offsets: torch.Tensor | None = None  # [N, G] float
    scale_split: SplitScales | None = None  # as Int8Codes'
    offset_split: SplitScales | None = None

    def dequantize(self) -> torch.Tensor:
        """W [N, K] float32 with one rounding per element (exact for fp16/bf16 scales)."""
        k = self.codes.shape[1]
        g = (
            self.g_idx.long()
            if self.g_idx is not None
            else torch.arange(k, device=self.codes.device) // self.group_size
        )
        q = self.codes.float()
        if self.zeros is not None:
            q = q - self.zeros.float()[:, g]
        elif self.offsets is None:
            q = q - 8.0
        w = q * self.scales.float()[:, g]
        if self.offsets is not None:
            w = w + self.offsets.float()[:, g]
        return w
