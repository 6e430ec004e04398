"""FP8 (float8_e4m3fn) weight GEMMs y = x @ (w * w_scale)^T (+ bias).

Two paths, one kernel:
- W8A8 (sm89+): activations quantized to fp8 per token (dynamic:
  x_scale = max(absmax(row) / 448, 1 / (448 * 512)), or a static input_scale),
  fp8 x fp8 dot with fp32 accumulation, y = acc * x_scale[m] * w_scale[n].
- weight-only (W8A16, any GPU): fp8 weight bytes decoded in registers by bit
  manipulation (no fp8 hardware needed) to x's dtype, y = (x @ w^T) * w_scale.

Quantizing activations: on a GPU `.to(tl.float8e4nv)` rounds to nearest even
(cvt.rn.satfinite). The Triton 3.9 interpreter's fp32 -> float8e4nv cast is
wrong at binade edges and does not round ties to even, so under
TRITON_INTERPRET=1 the kernel builds the e4m3 bit pattern itself (round to
nearest even), bit-exact with torch's `.to(torch.float8_e4m3fn)`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .gemm_common import (
    channel_scale,
    check_activation,
    check_device,
    interpreting,
    k_range,
    launch_gemm,
    mma,
    store_tile,
    tile_ids,
    tuned,
)

FP8_MAX = 448.0
MIN_SCALE = 1.0 / (FP8_MAX * 512.0)  # keeps all-zero rows finite
_FP8_MAX = tl.constexpr(FP8_MAX)
_MIN_SCALE = tl.constexpr(MIN_SCALE)


def fp8_activations_supported(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


# -- activation quantization --


@triton.jit
def _fp32_to_e4m3_bits(v):
    """fp32 (|v| <= 448) -> e4m3fn bit pattern (uint8), round to nearest even."""
    bits = v.to(tl.int32, bitcast=True)
    sign = (bits >> 31) & 1
    mag = bits & 0x7FFFFFFF
    # normal range: drop 20 mantissa bits with RNE, rebias exponent 127 -> 7 (120 << 3 = 960)
    normal = ((mag + 0x7FFFF + ((mag >> 20) & 1)) >> 20) - 960
    # subnormal range (|v| < 2^-6): code = rne(|v| * 2^9); 2^23 trick rounds half to even
    a = tl.abs(v) * 512.0
    sub = ((a + 8388608.0) - 8388608.0).to(tl.int32)
    code = tl.where(mag < 0x3C800000, sub, normal)  # 0x3C800000 = 2^-6
    return (code | (sign << 7)).to(tl.uint8)


@triton.jit
def _max_combine(a, b):
    return tl.maximum(a, b)


@triton.jit
def _fp8_quant_kernel(
    x_ptr,
    xq_ptr,
    xs_ptr,
    static_ptr,
    K,
    stride_xm,
    stride_qm,
    STATIC: tl.constexpr,
    SOFTWARE_RNE: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    # x [M, K] -> xq [M, K] fp8 (uint8 view when SOFTWARE_RNE), xs [M] fp32; one row per program
    row = tl.program_id(0)
    x_row = x_ptr + row * stride_xm
    if STATIC:
        scale = tl.load(static_ptr).to(tl.float32)
    else:
        amax = tl.full((BLOCK_K,), 0.0, tl.float32)
        for k0 in range(0, K, BLOCK_K):
            offs = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_row + offs, mask=offs < K, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(x))
        scale = tl.maximum(
            tl.fdiv(tl.reduce(amax, 0, _max_combine), _FP8_MAX, ieee_rounding=True), _MIN_SCALE
        )
    tl.store(xs_ptr + row, scale)
    for k0 in range(0, K, BLOCK_K):
        offs = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_row + offs, mask=offs < K, other=0.0).to(tl.float32)
        # ieee division: torch's reference divides exactly, the fast approximate one would not
        v = tl.clamp(tl.fdiv(x, scale, ieee_rounding=True), -_FP8_MAX, _FP8_MAX)
        if SOFTWARE_RNE:
            q = _fp32_to_e4m3_bits(v)
        else:
            q = v.to(xq_ptr.dtype.element_ty)
        tl.store(xq_ptr + row * stride_qm + offs, q, mask=offs < K)


def quant_fp8_per_token(
    x: torch.Tensor,  # [M, K] fp16/bf16/fp32
    input_scale: torch.Tensor | None = None,  # [1] static scale; None = dynamic per token
) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (xq [M, K] float8_e4m3fn, x_scale [M, 1] fp32) with x ~= xq * x_scale."""
    m, k = x.shape
    check_device(x)
    if x.stride(1) != 1:
        x = x.contiguous()
    xq = torch.empty((m, k), device=x.device, dtype=torch.float8_e4m3fn)
    xs = torch.empty((m, 1), device=x.device, dtype=torch.float32)
    software = interpreting()
    static = input_scale if input_scale is not None else xs
    if input_scale is not None and input_scale.numel() != 1:
        raise ValueError("static input_scale must hold one value")
    if m:
        _fp8_quant_kernel[(m,)](
            x,
            xq.view(torch.uint8) if software else xq,
            xs,
            static,
            k,
            x.stride(0),
            xq.stride(0),
            STATIC=input_scale is not None,
            SOFTWARE_RNE=software,
            BLOCK_K=min(1024 if not software else 256, triton.next_power_of_2(k)),
        )
    return xq, xs


def quant_fp8_per_token_ref(x, input_scale=None) -> tuple[torch.Tensor, torch.Tensor]:
    xf = x.float()
    if input_scale is None:
        xs = (xf.abs().amax(-1, keepdim=True) / FP8_MAX).clamp_min(MIN_SCALE)
    else:
        xs = input_scale.float().reshape(1, 1).expand(x.shape[0], 1).contiguous()
    return (xf / xs).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), xs


# -- GEMM --


@triton.jit
def _e4m3_bits_to_fp16(b):
    """e4m3fn bytes -> fp16 exactly: place sign/exponent/mantissa in an fp16 and rescale by
    2^(15-7); fp16 subnormals cover e4m3 subnormals. (0x7F/0xFF NaN are not expected.)"""
    b = b.to(tl.uint16)
    h = ((b & 0x80) << 8) | ((b & 0x7F) << 7)
    return h.to(tl.float16, bitcast=True) * 256.0


@triton.jit
def _fp8_gemm_kernel(
    x_ptr,
    w_ptr,
    xs_ptr,
    ws_ptr,
    bias_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_xk,
    stride_wn,
    stride_wk,
    stride_ws,
    stride_om,
    stride_on,
    stride_os,
    M_BUCKET,
    ACT_FP8: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SPLIT_K: tl.constexpr,
    EMULATE_BF16: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    # x [M, K] (fp8 when ACT_FP8, with xs [M]), w [N, K] (fp8, or its uint8 bytes),
    # ws [N] (stride 0: per-tensor), out [M, N] or fp32 partials [SPLIT_K, M, N]
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
            other=0.0,
        )
        if ACT_FP8:
            acc = tl.dot(x, w, acc)
        else:
            acc = mma(x, _e4m3_bits_to_fp16(w), acc, EMULATE_BF16)
    if ACT_FP8:
        acc *= tl.load(xs_ptr + offs_m, mask=m_mask, other=0.0)[:, None]
    acc *= tl.load(ws_ptr + offs_n * stride_ws, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    store_tile(out_ptr, acc, offs_m, offs_n, M, N, stride_om, stride_on, stride_os, EMULATE_BF16)


_FP8 = (_fp8_gemm_kernel, *tuned(_fp8_gemm_kernel))


def fp8_gemm(
    x: torch.Tensor,  # [..., K] fp16/bf16/fp32
    weight: torch.Tensor,  # [N, K] float8_e4m3fn
    weight_scale: torch.Tensor,  # [N, 1] per channel or [1] per tensor
    input_scale: torch.Tensor | None = None,  # [1] static activation scale (W8A8 only)
    bias: torch.Tensor | None = None,
    use_fp8_activations: bool | None = None,  # None: W8A8 where the GPU has fp8 (sm89+)
    split_k: int | None = None,
) -> torch.Tensor:
    """[..., N] in x's dtype."""
    n, k = weight.shape
    if weight.dtype != torch.float8_e4m3fn:
        raise TypeError(f"weight must be float8_e4m3fn, got {weight.dtype}")
    x2 = check_activation(x, k)
    ws, ws_stride = channel_scale(weight_scale, n)
    if use_fp8_activations is None:
        use_fp8_activations = fp8_activations_supported(x.device)
    if use_fp8_activations:
        xa, xs = quant_fp8_per_token(x2, input_scale)
        w = weight
    else:
        xa, xs, w = x2, ws, weight.view(torch.uint8)

    def args(out, som, son, sos, split):
        return (
            xa,
            w,
            xs,
            ws,
            bias if bias is not None else ws,
            out,
            x2.shape[0],
            n,
            k,
            xa.stride(0),
            xa.stride(1),
            w.stride(0),
            w.stride(1),
            ws_stride,
            som,
            son,
            sos,
        )

    consts = dict(ACT_FP8=use_fp8_activations, OUT_DTYPE=x.dtype)
    out = launch_gemm(_FP8, xa, n, bias, args, consts, split_k)
    return out.reshape(*x.shape[:-1], n)


def fp8_gemm_ref(
    x, weight, weight_scale, input_scale=None, bias=None, use_fp8_activations=False, **_
) -> torch.Tensor:
    ws = weight_scale.float().reshape(-1, 1)
    x2 = x.reshape(-1, x.shape[-1])
    if use_fp8_activations:
        xq, xs = quant_fp8_per_token_ref(x2, input_scale)
        y = (xq.float() @ weight.float().t()) * xs * ws.t()
    else:
        y = x2.float() @ (weight.float() * ws).t()
    if bias is not None:
        y += bias.float()
    return y.to(x.dtype).reshape(*x.shape[:-1], weight.shape[0])
