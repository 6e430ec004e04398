"""Int4 checkpoint layouts: exact torch packers/unpackers and the one-time repack
into the layout the W4A16 kernel reads.

Every function here speaks one unpacked convention: `q` [N, K] holds unsigned
4-bit codes (0..15), `zeros` [N, G] the zero codes, `scales` [N, G], and
W[n, k] = (q[n, k] - zeros[n, g(k)]) * scales[n, g(k)], g(k) = g_idx[k] or
k // group_size. On disk:

  AWQ "gemm"   qweight [K, N/8] along N, nibble i of word j = column 8j+AWQ_ORDER[i];
               qzeros [G, N/8] the same; scales [G, N].
  GPTQ v1      qweight [K/8, N] along K (nibble i of row j = input row 8j+i);
               qzeros [G, N/8] along N sequentially, stored as zero-1 (4-bit wrap,
               so a stored 0xF reads back as 16); scales [G, N]; g_idx [K].
  compressed-tensors pack-quantized: weight_packed [N, K/8] along K, codes = q+8
               of the signed value (i.e. our unsigned code); weight_scale [N, G];
               weight_zero_point [N/8, G] along N (+8), absent when symmetric (zero 8).

Canonical (`Int4Weight`): GPTQ's qweight [K/8, N] with true zeros as uint8
[G, N] (None = symmetric zero 8), an optional g_idx and an optional row
permutation `perm` (desc_act checkpoints are sorted by group once so the
kernel reads one scale row per K tile; the kernel then gathers x columns).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of an AWQ word holds column 8j + AWQ_ORDER[i]
_AWQ_INVERSE = tuple(AWQ_ORDER.index(c) for c in range(8))
_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)


# -- bit packing along one dim (8 nibbles per int32, nibble i = element 8j+i) --


def pack_int4(codes: torch.Tensor, dim: int) -> torch.Tensor:
    """int codes (0..15) -> int32 with 8 codes per word along `dim`, low nibble first."""
    codes = codes.movedim(dim, -1).to(torch.int32)
    if codes.shape[-1] % 8:
        raise ValueError(f"packed dim must be a multiple of 8, got {codes.shape[-1]}")
    if codes.numel() and (codes.min() < 0 or codes.max() > 15):
        raise ValueError("int4 codes must lie in 0..15")
    nib = codes.reshape(*codes.shape[:-1], -1, 8) << _SHIFTS.to(codes.device)
    packed = nib[..., 0]
    for i in range(1, 8):  # int32 shifts wrap like the on-disk two's complement words
        packed = packed | nib[..., i]
    return packed.movedim(-1, dim).contiguous()


def unpack_int4(packed: torch.Tensor, dim: int) -> torch.Tensor:
    """int32 words -> int32 codes (0..15), 8 per word along `dim`; inverse of pack_int4."""
    words = packed.movedim(dim, -1).to(torch.int32)
    codes = (words[..., None] >> _SHIFTS.to(words.device)) & 0xF
    return codes.reshape(*words.shape[:-1], -1).movedim(-1, dim).contiguous()


def _awq_unpack(packed: torch.Tensor) -> torch.Tensor:  # [R, C/8] -> [R, C]
    codes = unpack_int4(packed, 1)
    return codes.view(codes.shape[0], -1, 8)[..., list(_AWQ_INVERSE)].reshape(codes.shape)


def _awq_pack(codes: torch.Tensor) -> torch.Tensor:  # [R, C] -> [R, C/8]
    c = codes.reshape(codes.shape[0], -1, 8)[..., list(AWQ_ORDER)]
    return pack_int4(c.reshape(codes.shape), 1)


def _group_index(k: int, group_size: int, g_idx: torch.Tensor | None, device) -> torch.Tensor:
    if g_idx is not None:
        return g_idx.to(device=device, dtype=torch.long)
    return torch.arange(k, device=device) // group_size


def dequant_int4_ref(
    q: torch.Tensor,  # [N, K] codes
    zeros: torch.Tensor | None,  # [N, G] codes; None = 8
    scales: torch.Tensor,  # [N, G]
    group_size: int,
    g_idx: torch.Tensor | None = None,  # [K]
) -> torch.Tensor:
    """W [N, K] float32 = (q - zeros[:, g]) * scales[:, g]."""
    g = _group_index(q.shape[1], group_size, g_idx, q.device)
    z = 8.0 if zeros is None else zeros.float()[:, g]
    return (q.float() - z) * scales.float()[:, g]


# -- on-disk formats: pack (from the unpacked convention) and unpack (to W) --


def pack_awq(q: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor) -> dict[str, torch.Tensor]:
    """q [N, K], zeros [N, G], scales [N, G] -> AutoAWQ "gemm" tensors."""
    return {
        "qweight": _awq_pack(q.t()),
        "qzeros": _awq_pack(zeros.t()),
        "scales": scales.t().contiguous(),
    }


def awq_codes(qweight: torch.Tensor, qzeros: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """-> q [N, K], zeros [N, G] (codes)."""
    return _awq_unpack(qweight).t(), _awq_unpack(qzeros).t()


def unpack_awq(
    qweight: torch.Tensor,  # [K, N/8]
    qzeros: torch.Tensor,  # [G, N/8]
    scales: torch.Tensor,  # [G, N]
    group_size: int,
) -> torch.Tensor:
    q, z = awq_codes(qweight, qzeros)
    return dequant_int4_ref(q, z, scales.t(), group_size)


def pack_gptq(
    q: torch.Tensor,  # [N, K]
    zeros: torch.Tensor | None,  # [N, G] codes 1..16 (None: symmetric, 8)
    scales: torch.Tensor,  # [N, G]
    group_size: int,
    g_idx: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """-> GPTQ v1 tensors (qweight, qzeros, scales, g_idx). A zero code 0 cannot be
    stored in v1 (zero-1 wraps to 15 and reads back as 16), as in every v1 writer."""
    n, k = q.shape
    if zeros is None:
        zeros = torch.full_like(scales, 8, dtype=torch.int32)
    if g_idx is None:
        g_idx = torch.arange(k, device=q.device) // group_size
    return {
        "qweight": pack_int4(q.t(), 0),
        "qzeros": pack_int4((zeros.t().to(torch.int32) - 1) & 0xF, 1),
        "scales": scales.t().contiguous(),
        "g_idx": g_idx.to(torch.int32),
    }


def gptq_codes(qweight: torch.Tensor, qzeros: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """-> q [N, K], zeros [N, G] (true zero codes, 1..16)."""
    return unpack_int4(qweight, 0).t(), (unpack_int4(qzeros, 1) + 1).t()


def unpack_gptq(
    qweight: torch.Tensor,  # [K/8, N]
    qzeros: torch.Tensor,  # [G, N/8]
    scales: torch.Tensor,  # [G, N]
    g_idx: torch.Tensor | None,  # [K]
    group_size: int | None = None,  # only when g_idx is None
) -> torch.Tensor:
    q, z = gptq_codes(qweight, qzeros)
    if g_idx is None and group_size is None:
        raise ValueError("unpack_gptq needs g_idx or group_size")
    return dequant_int4_ref(q, z, scales.t(), group_size or 0, g_idx)


def pack_ct_int4(
    q: torch.Tensor,  # [N, K] codes (= signed value + 8)
    scales: torch.Tensor,  # [N, G]
    zeros: torch.Tensor | None = None,  # [N, G] codes (= signed zero point + 8)
) -> dict[str, torch.Tensor]:
    """-> compressed-tensors pack-quantized tensors."""
    out = {
        "weight_packed": pack_int4(q, 1),
        "weight_scale": scales.contiguous(),
        "weight_shape": torch.tensor(list(q.shape), dtype=torch.int64),
    }
    if zeros is not None:
        out["weight_zero_point"] = pack_int4(zeros, 0)
    return out


def ct_group_size(weight_packed: torch.Tensor, weight_scale: torch.Tensor) -> int:
    k, groups = weight_packed.shape[1] * 8, weight_scale.shape[1]
    if k % groups:
        raise ValueError(f"cannot infer group size: K={k}, {groups} groups; pass group_size")
    return k // groups


def unpack_ct_int4(
    weight_packed: torch.Tensor,  # [N, K/8]
    weight_scale: torch.Tensor,  # [N, G]
    weight_zero_point: torch.Tensor | None = None,  # [N/8, G]
    group_size: int | None = None,
    g_idx: torch.Tensor | None = None,  # weight_g_idx [K] (actorder)
) -> torch.Tensor:
    q = unpack_int4(weight_packed, 1)
    z = None if weight_zero_point is None else unpack_int4(weight_zero_point, 0)
    gs = group_size or ct_group_size(weight_packed, weight_scale)
    return dequant_int4_ref(q, z, weight_scale, gs, g_idx)


# -- canonical layout for the kernel --


@dataclass
class Int4Weight:
    """What w4a16_gemm reads; fields are its keyword arguments (w4a16_gemm(x, **vars(w)))."""

    qweight: torch.Tensor  # [K/8, N] int32; nibble i of row j = stored row 8j+i
    scales: torch.Tensor  # [G, N]
    zeros: torch.Tensor | None  # [G, N] uint8 zero codes; None = 8
    g_idx: torch.Tensor | None  # [K] int32 group of each stored row; None = row // group_size
    perm: torch.Tensor | None  # [K] int32 stored row r multiplies x[:, perm[r]]; None = identity
    group_size: int
    offsets: torch.Tensor | None = None  # [G, N] fp32: w = q * s + o (zeros and g_idx None)


def unpack_int4_weight(w: Int4Weight) -> torch.Tensor:
    """Canonical -> W [N, K] float32 in the original input order (the kernel's reference)."""
    q = unpack_int4(w.qweight, 0).t()
    z = None if w.zeros is None else w.zeros.t()
    if w.offsets is not None:
        g = _group_index(q.shape[1], w.group_size, w.g_idx, q.device)
        wt = q.float() * w.scales.float().t()[:, g] + w.offsets.float().t()[:, g]
    else:
        wt = dequant_int4_ref(q, z, w.scales.t(), w.group_size, w.g_idx)
    if w.perm is None:
        return wt
    out = torch.empty_like(wt)
    out[:, w.perm.long()] = wt
    return out


def repack_int4(
    q: torch.Tensor,  # [N, K] codes
    zeros: torch.Tensor | None,  # [N, G] codes
    scales: torch.Tensor,  # [N, G]
    group_size: int,
    g_idx: torch.Tensor | None = None,
    sort_groups: bool = True,
    offsets: torch.Tensor | None = None,  # [N, G]: w = q * s + o (no zero codes, no g_idx)
) -> Int4Weight:
    """Unpacked convention -> canonical (exact). A g_idx that is just row // group_size is
    dropped; a desc_act g_idx whose sort gives that is turned into a row permutation."""
    n, k = q.shape
    if offsets is not None:
        if zeros is not None or g_idx is not None:
            raise ValueError("int4 offsets go without zero codes and without g_idx")
        return Int4Weight(
            pack_int4(q.t(), 0),
            scales.t().contiguous(),
            None,
            None,
            None,
            group_size,
            offsets.t().float().contiguous(),
        )
    if zeros is not None:
        if zeros.min() < 0 or zeros.max() > 255:
            raise ValueError("zero codes out of uint8 range")
        zeros = None if bool((zeros == 8).all()) else zeros.t().to(torch.uint8).contiguous()
    scales = scales.t().contiguous()
    perm = None
    if g_idx is not None:
        g_idx = g_idx.to(device=q.device, dtype=torch.int64)
        plain = torch.arange(k, device=q.device) // group_size
        if torch.equal(g_idx, plain):
            g_idx = None
        elif sort_groups:
            order = torch.argsort(g_idx, stable=True)
            if torch.equal(g_idx[order], plain):
                perm, g_idx, q = order.to(torch.int32), None, q[:, order]
        if g_idx is not None:
            g_idx = g_idx.to(torch.int32).contiguous()
    return Int4Weight(pack_int4(q.t(), 0), scales, zeros, g_idx, perm, group_size)


def repack_awq(qweight, qzeros, scales, group_size: int) -> Int4Weight:
    q, z = awq_codes(qweight, qzeros)
    return repack_int4(q, z, scales.t(), group_size)


def repack_gptq(
    qweight, qzeros, scales, g_idx, group_size: int, sort_groups: bool = True
) -> Int4Weight:
    if group_size <= 0:  # per-channel (-1 in quantize_config)
        group_size = qweight.shape[0] * 8
    q, z = gptq_codes(qweight, qzeros)
    return repack_int4(q, z, scales.t(), group_size, g_idx, sort_groups)


def repack_ct_int4(
    weight_packed,
    weight_scale,
    weight_zero_point=None,
    group_size: int | None = None,
    g_idx: torch.Tensor | None = None,
    sort_groups: bool = True,
) -> Int4Weight:
    q = unpack_int4(weight_packed, 1)
    z = None if weight_zero_point is None else unpack_int4(weight_zero_point, 0)
    gs = group_size or ct_group_size(weight_packed, weight_scale)
    return repack_int4(q, z, weight_scale, gs, g_idx, sort_groups)
