"""W4A16 weight-only GEMM y = x @ W^T (+ bias), dequantizing int4 W in registers, over the
canonical int4 layout (see int4_layouts: AWQ, GPTQ and compressed-tensors are repacked into it
once at load; GGUF Q4_1/Q4_K add per-group offsets). The int8 W8A16 GEMM: int8_gemm.

`_w4a16_gemm_kernel` (Triton, fp32 accumulation) + `w4a16_gemm`, the wrapper that checks shapes,
+ `w4a16_gemm_ref` (torch: dequantize, fp32 matmul; the CPU backend). Split-K decode, autotuning
and launch live in gemm_common.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .gemm_common import (  # noqa: F401  (interpreting: re-exported for callers and tests)
    KEY,
    check_activation,
    interpreting,
    k_range,
    launch_gemm,
    mma,
    store_tile,
    tile_ids,
    tuned,
)
from .int4_layouts import Int4Weight, unpack_int4_weight


@triton.jit
def _w4a16_gemm_kernel(
    x_ptr,
    qw_ptr,
    s_ptr,
    z_ptr,
    o_ptr,
    gidx_ptr,
    perm_ptr,
    bias_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_xk,
    stride_qk,
    stride_qn,
    stride_sg,
    stride_sn,
    stride_zg,
    stride_zn,
    stride_og,
    stride_on_,
    stride_om,
    stride_on,
    stride_os,
    M_BUCKET,
    GROUP_SIZE: tl.constexpr,
    HAS_ZEROS: tl.constexpr,
    HAS_OFFSETS: tl.constexpr,
    HAS_GIDX: tl.constexpr,
    HAS_PERM: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SPLIT_K: tl.constexpr,
    EMULATE_BF16: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    # x [M, K], qweight [K/8, N] int32, scales [G, N], zeros [G, N] uint8, offsets [G, N] fp32
    # (w = q * s + o, no zero code), g_idx/perm [K], out [M, N] (or fp32 partials [SPLIT_K, M, N])
    offs_m, offs_n = tile_ids(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    m_mask = offs_m < M
    n_mask = offs_n < N
    k_start, k_end = k_range(K, SPLIT_K, BLOCK_K)
    # one scale row per K tile unless groups are gathered or straddle tiles
    ONE_GROUP_PER_TILE: tl.constexpr = (
        (not HAS_GIDX) and (not HAS_OFFSETS) and (GROUP_SIZE % BLOCK_K == 0)
    )
    acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < k_end
        if HAS_PERM:
            x_cols = tl.load(perm_ptr + offs_k, mask=k_mask, other=0)
        else:
            x_cols = offs_k
        x = tl.load(
            x_ptr + offs_m[:, None] * stride_xm + x_cols[None, :] * stride_xk,
            mask=m_mask[:, None] & k_mask[None, :],
            other=0.0,
        )
        kn_mask = k_mask[:, None] & n_mask[None, :]
        words = tl.load(
            qw_ptr + (offs_k // 8)[:, None] * stride_qk + offs_n[None, :] * stride_qn,
            mask=kn_mask,
            other=0,
        )
        q = (words >> ((offs_k % 8) * 4)[:, None]) & 0xF  # [BLOCK_K, BLOCK_N]
        if ONE_GROUP_PER_TILE:
            g = k0 // GROUP_SIZE
            s = tl.load(s_ptr + g * stride_sg + offs_n * stride_sn, mask=n_mask, other=0.0)
            if HAS_ZEROS:
                z = tl.load(z_ptr + g * stride_zg + offs_n * stride_zn, mask=n_mask, other=8).to(
                    tl.int32
                )
            else:
                z = tl.full((BLOCK_N,), 8, tl.int32)
            # (q - z) are small integers, exact in any float dtype: scale after the dot
            part = mma(
                x, q - z[None, :], tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32), EMULATE_BF16
            )
            acc += part * s.to(tl.float32)[None, :]
        else:
            if HAS_GIDX:
                g = tl.load(gidx_ptr + offs_k, mask=k_mask, other=0)
            else:
                g = offs_k // GROUP_SIZE
            s = tl.load(
                s_ptr + g[:, None] * stride_sg + offs_n[None, :] * stride_sn,
                mask=kn_mask,
                other=0.0,
            )
            if HAS_OFFSETS:
                o = tl.load(
                    o_ptr + g[:, None] * stride_og + offs_n[None, :] * stride_on_,
                    mask=kn_mask,
                    other=0.0,
                )
                w = q.to(tl.float32) * s.to(tl.float32) + o
            else:
                if HAS_ZEROS:
                    z = tl.load(
                        z_ptr + g[:, None] * stride_zg + offs_n[None, :] * stride_zn,
                        mask=kn_mask,
                        other=8,
                    ).to(tl.float32)
                else:
                    z = 8.0
                w = (q.to(tl.float32) - z) * s.to(tl.float32)
            acc = mma(x, w, acc, EMULATE_BF16)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    store_tile(out_ptr, acc, offs_m, offs_n, M, N, stride_om, stride_on, stride_os, EMULATE_BF16)


def _prune_w4(configs, named_args, **kwargs):
    """Prefer BLOCK_K that divides the group (one scale row per tile)."""
    gs = kwargs.get("GROUP_SIZE", named_args.get("GROUP_SIZE"))
    if kwargs.get("HAS_GIDX", named_args.get("HAS_GIDX")) or gs is None:
        return configs
    good = [c for c in configs if gs % c.kwargs["BLOCK_K"] == 0]
    return good or configs


_W4A16 = (
    _w4a16_gemm_kernel,
    *tuned(_w4a16_gemm_kernel, KEY + ["GROUP_SIZE", "HAS_GIDX"], _prune_w4),
)


def w4a16_gemm(
    x: torch.Tensor,  # [..., K] fp16/bf16/fp32
    qweight: torch.Tensor,  # [K/8, N] int32 (canonical, see int4_layouts)
    scales: torch.Tensor,  # [G, N]
    zeros: torch.Tensor | None,  # [G, N] uint8 zero codes; None = 8
    g_idx: torch.Tensor | None,  # [K] int32; None = k // group_size
    group_size: int,
    bias: torch.Tensor | None = None,  # [N]
    perm: torch.Tensor | None = None,  # [K] int32
    split_k: int | None = None,  # decode split override (tests, benchmarks)
    offsets: torch.Tensor | None = None,  # [G, N] fp32: w = q * s + o (GGUF Q4_1 / Q4_K)
) -> torch.Tensor:
    """[..., N] in x's dtype."""
    k, n = qweight.shape[0] * 8, qweight.shape[1]
    x2 = check_activation(x, k)
    groups_needed = 1 if g_idx is not None else triton.cdiv(k, group_size)
    if qweight.dtype != torch.int32 or scales.shape[1] != n or scales.shape[0] < groups_needed:
        raise ValueError(
            f"bad int4 weight: qweight {qweight.dtype} {tuple(qweight.shape)}, "
            f"scales {tuple(scales.shape)}, group_size {group_size}"
        )
    if zeros is not None and (zeros.shape != scales.shape or zeros.dtype != torch.uint8):
        raise ValueError(
            f"zeros must be uint8 {tuple(scales.shape)}, got {zeros.dtype} {tuple(zeros.shape)}"
        )
    if offsets is not None and (
        offsets.shape != scales.shape or offsets.dtype != torch.float32 or zeros is not None
    ):
        raise ValueError(
            f"offsets must be fp32 {tuple(scales.shape)} without zeros, got {offsets.dtype} "
            f"{tuple(offsets.shape)}"
        )
    for t, name in ((g_idx, "g_idx"), (perm, "perm")):
        if t is not None and (t.shape != (k,) or t.dtype != torch.int32):
            raise ValueError(f"{name} must be int32 [{k}]")
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"bias must be [{n}]")
    z = zeros if zeros is not None else scales  # placeholder pointers when absent
    o = offsets if offsets is not None else scales
    dummy = qweight

    def args(out, som, son, sos, split):
        return (
            x2,
            qweight,
            scales,
            z,
            o,
            g_idx if g_idx is not None else dummy,
            perm if perm is not None else dummy,
            bias if bias is not None else dummy,
            out,
            x2.shape[0],
            n,
            k,
            x2.stride(0),
            x2.stride(1),
            qweight.stride(0),
            qweight.stride(1),
            scales.stride(0),
            scales.stride(1),
            z.stride(0),
            z.stride(1),
            o.stride(0),
            o.stride(1),
            som,
            son,
            sos,
        )

    consts = dict(
        GROUP_SIZE=group_size,
        HAS_ZEROS=zeros is not None,
        HAS_OFFSETS=offsets is not None,
        HAS_GIDX=g_idx is not None,
        HAS_PERM=perm is not None,
    )
    out = launch_gemm(_W4A16, x2, n, bias, args, consts, split_k)
    return out.reshape(*x.shape[:-1], n)


def w4a16_gemm_ref(
    x, qweight, scales, zeros, g_idx, group_size, bias=None, perm=None, offsets=None, **_
) -> torch.Tensor:
    w = unpack_int4_weight(Int4Weight(qweight, scales, zeros, g_idx, perm, group_size, offsets))
    y = x.float() @ w.t()
    if bias is not None:
        y += bias.float()
    return y.to(x.dtype)
