"""W8A16 int8 weight-only GEMM y = x @ (W * scale)^T (+ bias): int8 weights [N, K] with a
per-channel or per-tensor scale, converted in registers to x's dtype (exact in fp16/bf16).

`_w8a16_gemm_kernel` (Triton, fp32 accumulation) + `w8a16_gemm`, the wrapper that checks shapes,
+ `w8a16_gemm_ref` (torch: dequantize, fp32 matmul; the CPU backend). Split-K decode, autotuning
and launch live in gemm_common.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .gemm_common import (
    channel_scale,
    check_activation,
    k_range,
    launch_gemm,
    mma,
    store_tile,
    tile_ids,
    tuned,
)


@triton.jit
def _w8a16_gemm_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    bias_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_xk,
    stride_wn,
    stride_wk,
    stride_s,
    stride_om,
    stride_on,
    stride_os,
    M_BUCKET,
    HAS_BIAS: tl.constexpr,
    SPLIT_K: tl.constexpr,
    EMULATE_BF16: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    # x [M, K], w int8 [N, K], scale [N] (stride 0: per-tensor), out [M, N] / partials
    offs_m, offs_n = tile_ids(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    m_mask = offs_m < M
    n_mask = offs_n < N
    k_start, k_end = k_range(K, SPLIT_K, BLOCK_K)
    acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < k_end
        x = tl.load(
            x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :] * stride_xk,
            mask=m_mask[:, None] & k_mask[None, :],
            other=0.0,
        )
        w = tl.load(
            w_ptr + offs_k[:, None] * stride_wk + offs_n[None, :] * stride_wn,
            mask=k_mask[:, None] & n_mask[None, :],
            other=0,
        )
        acc = mma(x, w, acc, EMULATE_BF16)  # int8 is exact in fp16/bf16
    acc *= tl.load(s_ptr + offs_n * stride_s, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    store_tile(out_ptr, acc, offs_m, offs_n, M, N, stride_om, stride_on, stride_os, EMULATE_BF16)


_W8A16 = (_w8a16_gemm_kernel, *tuned(_w8a16_gemm_kernel))


def w8a16_gemm(
    x: torch.Tensor,  # [..., K]
    weight: torch.Tensor,  # [N, K] int8
    scale: torch.Tensor,  # [N, 1] or [1]
    bias: torch.Tensor | None = None,
    split_k: int | None = None,
) -> torch.Tensor:
    n, k = weight.shape
    if weight.dtype != torch.int8:
        raise TypeError(f"weight must be int8, got {weight.dtype}")
    x2 = check_activation(x, k)
    s, s_stride = channel_scale(scale, n)

    def args(out, som, son, sos, split):
        return (
            x2,
            weight,
            s,
            bias if bias is not None else s,
            out,
            x2.shape[0],
            n,
            k,
            x2.stride(0),
            x2.stride(1),
            weight.stride(0),
            weight.stride(1),
            s_stride,
            som,
            son,
            sos,
        )

    out = launch_gemm(_W8A16, x2, n, bias, args, {}, split_k)
    return out.reshape(*x.shape[:-1], n)


def w8a16_gemm_ref(x, weight, scale, bias=None, **_) -> torch.Tensor:
    w = weight.float() * scale.float().reshape(-1, 1)
    y = x.float() @ w.t()
    if bias is not None:
        y += bias.float()
    return y.to(x.dtype)
