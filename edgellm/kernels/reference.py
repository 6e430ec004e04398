"""Plain torch references for the CPU integer-dot matmuls (edgellm/kernels/csrc/cpu/qgemm.cpp).

No fast paths here: the C++ kernels are tested against these on fresh random data.
"""

from __future__ import annotations

import torch

ACT_BLOCK = 32  # columns per activation scale


def quantize_rows_ref(
    x: torch.Tensor, group: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [M, K] fp32 -> (codes [M, K] int8, d [M, K / 32] fp32, dsum [M, K / group] fp32) by the
    Q8_0 rule: d = absmax / 127 per 32-column block, codes = round-half-even(x * (1 / d))
    (0 where d == 0); dsum = per group, the sum over its blocks of d * sum(codes) (group 16: d times
    the half block's sum)."""
    m, k = x.shape
    blocks = x.float().reshape(m, k // ACT_BLOCK, ACT_BLOCK)
    d = blocks.abs().amax(-1) / 127.0
    inv = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
    codes = torch.round(blocks * inv[..., None])
    sub = min(group, ACT_BLOCK)  # group 16: per half block
    sums = d[..., None] * codes.reshape(m, k // ACT_BLOCK, ACT_BLOCK // sub, sub).sum(-1)
    dsum = sums.reshape(m, k // sub).reshape(m, k // group, group // sub).sum(-1)
    return codes.to(torch.int8).reshape(m, k), d, dsum


def dequantize_rows_ref(codes: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    m, k = codes.shape
    return (codes.float().reshape(m, k // ACT_BLOCK, ACT_BLOCK) * d[..., None]).reshape(m, k)


def pack_int4_blocks_ref(q: torch.Tensor) -> torch.Tensor:
    """codes [N, K] in 0..15 -> [N, K / 2] uint8: each 32-column block as 16 bytes, byte j holding
    code j (low nibble) and code j + 16 (high nibble), the layout qgemm.cpp reads."""
    n, k = q.shape
    b = q.to(torch.uint8).reshape(n, k // ACT_BLOCK, 2, ACT_BLOCK // 2)
    return (b[:, :, 0] | (b[:, :, 1] << 4)).reshape(n, k // 2).contiguous()


def unpack_int4_blocks_ref(packed: torch.Tensor) -> torch.Tensor:
    n, half = packed.shape
    b = packed.reshape(n, half // (ACT_BLOCK // 2), ACT_BLOCK // 2)
    return torch.stack((b & 15, b >> 4), 2).reshape(n, half * 2)


def int_weight_ref(
    q: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor | None, group: int
) -> torch.Tensor:
    """W [N, K] fp32 = scale[n, g] * q[n, k] (+ offset[n, g]), q the integer codes."""
    w = q.float().reshape(q.shape[0], -1, group) * scale.float()[..., None]
    if offset is not None:
        w = w + offset.float()[..., None]
    return w.reshape(q.shape)


def int_linear_ref(
    x: torch.Tensor,
    q: torch.Tensor,
    scale: torch.Tensor,
    offset: torch.Tensor | None,
    group: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """What qgemm.int_linear computes, in float64: the activations rounded by quantize_rows_ref,
    times the exact weight. [M, N] fp64."""
    codes, d, _ = quantize_rows_ref(x, group)
    y = (
        dequantize_rows_ref(codes, d).double()
        @ int_weight_ref(q, scale, offset, group).double().t()
    )
    return y if bias is None else y + bias.double()


N16 = 16  # output rows per tile of the n16 layout


def n16_zero(bits: int) -> int:
    """What the n16 layout adds to a code to store it unsigned: 0 for int4, 2^(bits - 1) else."""
    return 0 if bits == 4 else 1 << (bits - 1)


def n16_block_bytes(bits: int) -> int:
    """Bytes of one 32-column block of an n16 tile: 256 (int4), 320 (5 bits), 384 (6), 512 (8)."""
    return {4: 256, 5: 320, 6: 384, 8: 512}[bits]


def n16_bits(codes: torch.Tensor) -> int:
    """The narrowest n16 storage of int8 codes: 5 bits for codes within -16..15, 6 within
    -32..31, else 8."""
    lo, hi = (int(codes.min()), int(codes.max())) if codes.numel() else (0, 0)
    for bits in (5, 6):
        if -n16_zero(bits) <= lo and hi < n16_zero(bits):
            return bits
    return 8


def n16_other_zero(bits: int) -> int | None:
    """The other zero a width may be stored with (qgemm_n16.h): int4 codes -8..7 stored + 8
    (symmetric int4), 5-bit codes 0..31 stored as they are; None for 6 and 8 bits."""
    return {4: 8, 5: 0}.get(bits)


def pack_int_n16_ref(q: torch.Tensor, bits: int, zero: int | None = None) -> torch.Tensor:
    """codes [N, K] (int4: 0..15; 5 / 6 bits: -16..15 / -32..31; int8: -128..127; with the other
    zero, int4 -8..7 and 5 bits 0..31) -> the n16 layout qgemm_n16.h reads,
    [ceil(N / 16), K / 32, n16_block_bytes(bits)] uint8: per tile of 16 output rows and 32-column
    block, e[r * 64 + n * 4 + j] = code(16 t + n, 32 b + 4 r + j) + zero (default n16_zero(bits));
    int4 packs byte i = e[i] | e[i + 256] << 4; 5 / 6 bits store those bytes of e's low nibbles,
    then per higher bit c (4, then 5) a 64-byte plane whose byte j holds bit c of e[64 k + j] in
    its bit k. Rows past N hold stored code 0."""
    n, k = q.shape
    nt = -(-n // N16)
    e = torch.zeros(nt * N16, k, dtype=torch.int16)
    e[:n] = q.to(torch.int16) + (n16_zero(bits) if zero is None else zero)
    if n and (int(e[:n].min()) < 0 or int(e[:n].max()) >= 1 << bits):
        raise ValueError(f"codes do not fit {bits} bits stored with zero {zero}")
    e = (
        e.reshape(nt, N16, k // ACT_BLOCK, 8, 4)
        .permute(0, 2, 3, 1, 4)
        .reshape(nt, k // ACT_BLOCK, 512)
    )
    if bits == 8:
        return e.to(torch.uint8).contiguous()
    parts = [(e[..., :256] & 15) | ((e[..., 256:] & 15) << 4)]
    rows = e.reshape(nt, k // ACT_BLOCK, 8, 64)  # [.., layout row k, byte j]
    weights = (1 << torch.arange(8, dtype=torch.int16))[:, None]
    for bit in range(4, bits):
        parts.append((((rows >> bit) & 1) * weights).sum(-2))
    return torch.cat(parts, -1).to(torch.uint8).contiguous()


def unpack_int_n16_ref(
    packed: torch.Tensor, n: int, bits: int, zero: int | None = None
) -> torch.Tensor:
    """pack_int_n16_ref's codes back: [n, K] int16."""
    nt, nb, _ = packed.shape
    e = packed.to(torch.int16)
    if bits != 8:
        codes = torch.cat((e[..., :256] & 15, e[..., :256] >> 4), -1)
        for i, bit in enumerate(range(4, bits)):
            plane = e[..., 256 + 64 * i : 320 + 64 * i]  # [.., 64]
            high = (plane[..., None, :] >> torch.arange(8, dtype=torch.int16)[:, None]) & 1
            codes = codes | (high.reshape(nt, nb, 512) << bit)
        e = codes
    e = e - (n16_zero(bits) if zero is None else zero)
    return e.reshape(nt, nb, 8, N16, 4).permute(0, 3, 1, 2, 4).reshape(nt * N16, nb * ACT_BLOCK)[:n]


def tile_n16_ref(v: torch.Tensor) -> torch.Tensor:
    """Per-row values [N, G] (scales, offsets) -> [ceil(N / 16), G, 16], rows past N zero."""
    n, g = v.shape
    nt = -(-n // N16)
    out = torch.zeros(nt * N16, g, dtype=v.dtype)
    out[:n] = v
    return out.reshape(nt, N16, g).transpose(1, 2).contiguous()


def compact_scales_n16_ref(mult: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
    """Group values [N, G] = mult [N, G] (integers within -128..127) x base [N, B] (fp32, each
    shared by G / B consecutive groups) -> the compact form qgemm_n16.h reads, int8
    [ceil(N / 16), G * 16 + B * 64]: per tile the multipliers as tile_n16_ref lays them out, then
    the bases' fp32 bytes [B, 16]. Rows past N have multiplier and base 0."""
    n, g = mult.shape
    if g % base.shape[1]:
        raise ValueError(f"{base.shape[1]} bases do not divide {g} groups")
    m = tile_n16_ref(mult.to(torch.int8)).reshape(-1, g * N16)
    b = tile_n16_ref(base.float()).reshape(m.shape[0], -1).view(torch.int8)
    return torch.cat((m, b), 1).contiguous()


def expand_compact_ref(mult: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
    """The values [N, G] fp32 the compact form (mult [N, G], base [N, B]) stands for."""
    return mult.float() * base.float().repeat_interleave(mult.shape[1] // base.shape[1], 1)
