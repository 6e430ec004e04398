"""W8 GEMM with group scales and offsets, y = x @ W^T (+ bias), dequantizing W in registers:
W[n, k] = codes[n, k] * scales[g, n] (+ offsets[g, n]), g = k // group_size. It is how GGUF's
5-, 6- and 8-bit types and the K-quants that are not 4-bit stay quantized on CUDA (their blocks
decoded once at load to int8 codes and per-group scales, quant/gguf_blocks.int8_codes); the
mixed shards of a Q4_K_M qkv (Q4_K q/k, Q6_K v) run here as one weight.

`w8g_gemm` (Triton, fp32 accumulation; launch, split-K and autotuning in gemm_common) and
`w8g_gemm_ref` (torch: dequantize, fp32 matmul).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .gemm_common import (
    KEY,
    check_activation,
    k_range,
    launch_gemm,
    mma,
    store_tile,
    tile_ids,
    tuned,
)


@triton.jit
def _w8g_gemm_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    o_ptr,
    bias_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_xk,
    stride_wn,
    stride_wk,
    stride_sg,
    stride_sn,
    stride_og,
    stride_on_,
    stride_om,
    stride_on,
    stride_os,
    M_BUCKET,
    GROUP_SIZE: tl.constexpr,
    HAS_OFFSETS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SPLIT_K: tl.constexpr,
    EMULATE_BF16: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    # x [M, K], codes int8 [N, K], scales / offsets [G, N] fp32, out [M, N] / fp32 partials
    offs_m, offs_n = tile_ids(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    m_mask = offs_m < M
    n_mask = offs_n < N
    k_start, k_end = k_range(K, SPLIT_K, BLOCK_K)
    ONE_GROUP_PER_TILE: tl.constexpr = (not HAS_OFFSETS) and (GROUP_SIZE % BLOCK_K == 0)
    acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < k_end
        x = tl.load(
            x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :] * stride_xk,
            mask=m_mask[:, None] & k_mask[None, :],
            other=0.0,
        )
        kn_mask = k_mask[:, None] & n_mask[None, :]
        q = tl.load(
            w_ptr + offs_k[:, None] * stride_wk + offs_n[None, :] * stride_wn, mask=kn_mask, other=0
        )
        if ONE_GROUP_PER_TILE:
            # int8 codes are exact in any float dtype: scale after the dot
            s = tl.load(
                s_ptr + (k0 // GROUP_SIZE) * stride_sg + offs_n * stride_sn, mask=n_mask, other=0.0
            )
            part = mma(x, q, tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32), EMULATE_BF16)
            acc += part * s[None, :]
        else:
            g = offs_k // GROUP_SIZE
            s = tl.load(
                s_ptr + g[:, None] * stride_sg + offs_n[None, :] * stride_sn,
                mask=kn_mask,
                other=0.0,
            )
            w = q.to(tl.float32) * s
            if HAS_OFFSETS:
                w += tl.load(
                    o_ptr + g[:, None] * stride_og + offs_n[None, :] * stride_on_,
                    mask=kn_mask,
                    other=0.0,
                )
            acc = mma(x, w, acc, EMULATE_BF16)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    store_tile(out_ptr, acc, offs_m, offs_n, M, N, stride_om, stride_on, stride_os, EMULATE_BF16)


def _prune(configs, named_args, **kwargs):
    """Prefer BLOCK_K that divides the group (one scale row per tile)."""
    gs = kwargs.get("GROUP_SIZE", named_args.get("GROUP_SIZE"))
    good = [c for c in configs if gs and gs % c.kwargs["BLOCK_K"] == 0]
    return good or configs


_W8G = (_w8g_gemm_kernel, *tuned(_w8g_gemm_kernel, KEY + ["GROUP_SIZE", "HAS_OFFSETS"], _prune))


def _check(
    codes: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor | None, group_size: int
) -> None:
    n, k = codes.shape
    if codes.dtype != torch.int8 or group_size <= 0 or k % group_size:
        raise ValueError(
            f"bad grouped int8 weight: codes {codes.dtype} {tuple(codes.shape)}, group {group_size}"
        )
    want = (k // group_size, n)
    for t, name in ((scales, "scales"), (offsets, "offsets")):
        if t is not None and (tuple(t.shape) != want or t.dtype != torch.float32):
            raise ValueError(f"{name} must be fp32 {want}, got {t.dtype} {tuple(t.shape)}")


def w8g_gemm(
    x: torch.Tensor,  # [..., K] fp16/bf16/fp32
    codes: torch.Tensor,  # [N, K] int8
    scales: torch.Tensor,  # [K / group_size, N] fp32
    group_size: int,
    offsets: torch.Tensor | None = None,  # [K / group_size, N] fp32
    bias: torch.Tensor | None = None,  # [N]
    split_k: int | None = None,  # decode split override (tests, benchmarks)
) -> torch.Tensor:
    """[..., N] in x's dtype."""
    n, k = codes.shape
    _check(codes, scales, offsets, group_size)
    x2 = check_activation(x, k)
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"bias must be [{n}]")
    o = offsets if offsets is not None else scales

    def args(out, som, son, sos, split):
        return (
            x2, codes, scales, o, bias if bias is not None else scales, out,
            x2.shape[0], n, k,
            x2.stride(0), x2.stride(1), codes.stride(0), codes.stride(1),
            scales.stride(0), scales.stride(1), o.stride(0), o.stride(1),
            som, son, sos,
        )  # fmt: skip

    consts = {"GROUP_SIZE": group_size, "HAS_OFFSETS": offsets is not None}
    out = launch_gemm(_W8G, x2, n, bias, args, consts, split_k)
    return out.reshape(*x.shape[:-1], n)


def w8g_gemm_ref(x, codes, scales, group_size, offsets=None, bias=None, **_) -> torch.Tensor:
    _check(codes, scales, offsets, group_size)
    k = codes.shape[1]
    g = torch.arange(k, device=codes.device) // group_size
    w = codes.float() * scales.t()[:, g]
    if offsets is not None:
        w += offsets.t()[:, g]
    y = x.float() @ w.t()
    if bias is not None:
        y += bias.float()
    return y.to(x.dtype)
