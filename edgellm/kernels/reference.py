"""Plain torch references for the CPU integer-dot matmuls (edgellm/kernels/csrc/cpu/qgemm.cpp).

No fast paths here: the C++ kernels are tested against these on fresh random data.
"""

from __future__ import annotations

import torch

ACT_BLOCK = 32  # columns per activation scale


def quantize_rows_ref(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
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


def int_weight_ref(q: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor | None, group: int) -> torch.Tensor:
    """W [N, K] fp32 = scale[n, g] * q[n, k] (+ offset[n, g]), q the integer codes."""
    w = q.float().reshape(q.shape[0], -1, group) * scale.float()[..., None]
    if offset is not None:
        w = w + offset.float()[..., None]
    return w.reshape(q.shape)


def int_linear_ref(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor | None,
                   group: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """What qgemm.int_linear computes, in float64: the activations rounded by quantize_rows_ref,
    times the exact weight. [M, N] fp64."""
    codes, d, _ = quantize_rows_ref(x, group)
    y = dequantize_rows_ref(codes, d).double() @ int_weight_ref(q, scale, offset, group).double().t()
    return y if bias is None else y + bias.double()
