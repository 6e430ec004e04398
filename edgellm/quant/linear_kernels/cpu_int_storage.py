"""How the integer-dot kernels (cpu_int.CpuIntDotKernel) store a weight's codes and group scales:
the narrowest code width the n16 layout holds them in, fp16 scales where that is lossless, and
the compact form of K-quant scales (int8 multipliers times an fp32 base per 256 columns,
edgellm/kernels/csrc/cpu/qgemm_n16.h). Every choice here keeps the values bit for bit; it only
changes how many bytes a decode step reads.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from edgellm.quant.int_codes import Int4Codes, Int8Codes


def stored_codes(q: torch.Tensor) -> tuple[int, int]:
    """(bits, zero) the n16 layout stores int8 codes [N, K] in: the narrowest width they fit
    (reference.n16_bits) with that width's zero, except that codes within 0..31 (Q5_1 and Q5_K's)
    are stored in 5 bits as they are (zero 0, reference.n16_other_zero)."""
    from edgellm.kernels.reference import n16_bits, n16_zero

    bits = n16_bits(q)
    if bits == 6 and int(q.min()) >= 0 and int(q.max()) <= 31:
        return 5, 0
    return bits, n16_zero(bits)


def symmetric_int4(codes: Int4Codes) -> bool:
    """Whether W = scale * (q - 8) with no offsets (GGUF Q4_0, symmetric GPTQ / compressed-tensors):
    the n16 layout then stores q as the codes q - 8 with zero 8, and no offsets."""
    if codes.offsets is not None:
        return False
    return codes.zeros is None or bool((codes.zeros == 8).all())


def fp16_if_exact(scale: torch.Tensor) -> torch.Tensor:
    """fp16 when every value is exactly an fp16 value, else fp32."""
    h = scale.half()
    return h.contiguous() if torch.equal(h.float(), scale.float()) else scale.float().contiguous()


def fp16_pair_if_exact(
    scale: torch.Tensor, offset: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Both in fp16 when both are exactly fp16 values (halves the bytes a decode step reads for
    g = 32), else both fp32."""
    hs, ho = scale.half(), offset.half()
    if torch.equal(hs.float(), scale) and torch.equal(ho.float(), offset):
        return hs.contiguous(), ho.contiguous()
    return scale.contiguous(), offset.contiguous()


def int4_affine(codes: Int4Codes) -> tuple[torch.Tensor, torch.Tensor]:
    """Int4Codes' W = (q - zero) * scale + offset as W = scale * q + offset', fp32 [N, G] each.
    For fp16 scales and integer zeros, scale * zero is exact in fp32, so W is unchanged."""
    scale = codes.scales.float()
    zero = (
        codes.zeros.float() if codes.zeros is not None else (8.0 if codes.offsets is None else 0.0)
    )
    offset = -scale * zero
    if codes.offsets is not None:
        offset = offset + codes.offsets.float()
    return scale, offset


def compact_scales(
    codes: Int4Codes | Int8Codes, scale: torch.Tensor, offset: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(scale, offset) tensors in the n16 layout's compact form (reference.compact_scales_n16_ref;
    offset empty where `offset` is) when the codes carry split forms (SplitScales) of exactly the
    values `scale` and `offset` [N, G] the kernel is to use and that takes fewer bytes than
    tile_n16_ref of them; else None. Q4_K: 48 bytes of scales and minimums per 32 columns of 16
    outputs instead of 128 in fp32."""
    from edgellm.kernels.reference import compact_scales_n16_ref

    ss, os_ = codes.scale_split, codes.offset_split
    has_offset = offset.numel() > 0
    if ss is None or (has_offset and os_ is None):
        return None
    if not torch.equal(ss.values(), scale.float()):
        return None
    if has_offset and not torch.equal(os_.values(), offset.float()):
        return None
    n, groups = ss.mult.shape
    if groups * 16 + ss.base.shape[1] * 64 >= groups * 16 * scale.element_size():
        return None
    s = compact_scales_n16_ref(ss.mult, ss.base)
    return s, compact_scales_n16_ref(os_.mult, os_.base) if has_offset else torch.empty(0)
