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


def pack_int_n16_ref(q: torch.Tensor, bits: int) -> torch.Tensor:
    """codes [N, K] (int4: 0..15; int8: -128..127) -> the n16 layout qgemm_n16.h reads,
    [ceil(N / 16), K / 32, 256 (int4) | 512 (int8)] uint8: per tile of 16 output rows and
    32-column block, e[r * 64 + n * 4 + j] = code(16 t + n, 32 b + 4 r + j) (int8: + 128);
    int4 packs byte i = e[i] | e[i + 256] << 4. Rows past N hold 0."""
    n, k = q.shape
    nt = -(-n // N16)
    e = torch.zeros(nt * N16, k, dtype=torch.int16)
    e[:n] = q.to(torch.int16) + (128 if bits == 8 else 0)
    e = (
        e.reshape(nt, N16, k // ACT_BLOCK, 8, 4)
        .permute(0, 2, 3, 1, 4)
        .reshape(nt, k // ACT_BLOCK, 512)
    )
    if bits == 4:
        e = e[..., :256] | (e[..., 256:] << 4)
    return e.to(torch.uint8).contiguous()


def unpack_int_n16_ref(packed: torch.Tensor, n: int, bits: int) -> torch.Tensor:
    """pack_int_n16_ref's codes back: [n, K] int16."""
    nt, nb, _ = packed.shape
    e = packed.to(torch.int16)
    if bits == 4:
        e = torch.cat((e & 15, e >> 4), -1)
    else:
        e = e - 128
    return e.reshape(nt, nb, 8, N16, 4).permute(0, 3, 1, 2, 4).reshape(nt * N16, nb * ACT_BLOCK)[:n]


def tile_n16_ref(v: torch.Tensor) -> torch.Tensor:
    """Per-row values [N, G] (scales, offsets) -> [ceil(N / 16), G, 16], rows past N zero."""
    n, g = v.shape
    nt = -(-n // N16)
    out = torch.zeros(nt * N16, g, dtype=v.dtype)
    out[:n] = v
    return out.reshape(nt, N16, g).transpose(1, 2).contiguous()
