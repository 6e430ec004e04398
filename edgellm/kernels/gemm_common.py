"""Shared plumbing of the quantized GEMM kernels (dequant_gemm, fp8_gemm): output-tile
order, split-K ranges, autotune configs and the launch/reduce wrapper, and the
workarounds the Triton 3.9 interpreter needs for bf16.

Decode (M <= 16) runs split-K: SPLIT_K programs per output tile write fp32
partials that torch sums (deterministic, no atomics); prefill runs one tile per
program. On a GPU both are autotuned keyed on (M bucket, N, K); under
TRITON_INTERPRET=1 one small fixed config is used (autotuning there is too slow).

The kernels call only builtins of triton.language, none of its @jit helpers
(tl.cdiv, tl.zeros, tl.max, ...): if triton was imported before TRITON_INTERPRET=1
was set, those stay compiled-mode functions that the interpreter cannot call,
and reloading these modules would not be enough.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import triton
import triton.language as tl

DECODE_MAX_M = 16


def interpreting() -> bool:
    """Whether these kernels were built for Triton's CPU interpreter (TRITON_INTERPRET=1
    when this module was imported)."""
    return type(tile_ids).__name__ == "InterpretedFunction"


def check_device(t: torch.Tensor) -> None:
    if not (t.is_cuda or interpreting()):
        raise ValueError(
            "Triton GEMMs need CUDA tensors (or TRITON_INTERPRET=1); on CPU use the *_ref ops"
        )


# -- launch plumbing shared with fp8_gemm --

_PREFILL_CONFIGS = [
    triton.Config(
        {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8}, num_warps=w, num_stages=s
    )
    for bm, bn, bk, w, s in [
        (128, 128, 64, 8, 3),
        (128, 256, 64, 8, 3),
        (128, 64, 64, 4, 4),
        (64, 128, 64, 4, 4),
        (64, 64, 64, 4, 4),
        (64, 128, 128, 4, 3),
        (32, 64, 128, 4, 4),
        (32, 128, 64, 4, 4),
        (128, 128, 32, 4, 4),
    ]
]
_DECODE_CONFIGS = [
    triton.Config(
        {"BLOCK_M": 16, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 1}, num_warps=w, num_stages=s
    )
    for bn, bk, w, s in [
        (32, 128, 4, 4),
        (64, 128, 4, 4),
        (128, 128, 4, 3),
        (32, 256, 4, 3),
        (64, 256, 4, 3),
        (64, 64, 2, 5),
        (128, 64, 4, 4),
        (256, 64, 8, 3),
    ]
]
_INTERPRET_DECODE = {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 64, "GROUP_M": 1}
_INTERPRET_PREFILL = {"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 64, "GROUP_M": 4}
KEY = ["M_BUCKET", "N", "K", "SPLIT_K"]


def tuned(kernel, key: list[str] = KEY, prune: Callable | None = None):
    """(decode, prefill) autotuned variants of one jit kernel."""
    prune_by = {"early_config_prune": prune} if prune else None
    return tuple(
        triton.autotune(configs=cfgs, key=key, prune_configs_by=prune_by)(kernel)
        for cfgs in (_DECODE_CONFIGS, _PREFILL_CONFIGS)
    )


@functools.cache
def _num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def plan_split_k(m: int, n: int, k: int, device: torch.device) -> int:
    """Decode: split K until the grid roughly fills the GPU (>= 256 of K per split)."""
    if m > DECODE_MAX_M:
        return 1
    sms = _num_sms(device.index or 0) if device.type == "cuda" else 8
    split, tiles = 1, triton.cdiv(n, 64)
    while split < 16 and tiles * split < 2 * sms and k // (split * 2) >= 256:
        split *= 2
    return split


def launch_gemm(
    kernels: tuple,  # (plain jit kernel, tuned decode, tuned prefill)
    x2: torch.Tensor,  # [M, K]
    n: int,
    bias: torch.Tensor | None,
    args: Callable[
        [torch.Tensor, int, int, int, int], tuple
    ],  # (out, stride_om, stride_on, stride_os, split)
    consts: dict,
    split_k: int | None,
) -> torch.Tensor:
    """Allocate the output (or split-K partials), launch, reduce. Returns [M, N] in x's dtype
    unless consts['OUT_DTYPE'] says otherwise."""
    m, k = x2.shape
    check_device(x2)
    out_dtype = consts.pop("OUT_DTYPE", x2.dtype)
    if m == 0:
        return torch.empty((0, n), device=x2.device, dtype=out_dtype)
    split = split_k or plan_split_k(m, n, k, x2.device)
    if split > 1:
        out = torch.empty((split, m, n), device=x2.device, dtype=torch.float32)
        strides = (out.stride(1), out.stride(2), out.stride(0))
    else:
        out = torch.empty((m, n), device=x2.device, dtype=out_dtype)
        strides = (out.stride(0), out.stride(1), 0)
    decode = m <= DECODE_MAX_M
    plain, tuned_decode, tuned_prefill = kernels
    emulate_bf16 = interpreting() and torch.bfloat16 in (x2.dtype, out_dtype)
    meta = dict(
        consts, HAS_BIAS=bias is not None and split == 1, SPLIT_K=split, EMULATE_BF16=emulate_bf16
    )
    full_args = args(out, *strides, split) + (triton.next_power_of_2(m),)
    if interpreting():
        meta.update(_INTERPRET_DECODE if decode else _INTERPRET_PREFILL)
        kernel = plain
    else:
        kernel = tuned_decode if decode else tuned_prefill

    def grid(meta_):
        return (triton.cdiv(m, meta_["BLOCK_M"]) * triton.cdiv(n, meta_["BLOCK_N"]), split)

    kernel[grid](*full_args, **meta)
    if split > 1:
        out = out.sum(0)
        if bias is not None:
            out += bias.float()
        out = out.to(out_dtype)
    return out


@triton.jit
def tile_ids(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """Grouped (L2-friendly) order of output tiles: program 0 -> rows/cols of its tile."""
    pid = tl.program_id(0)
    num_m = (M + BLOCK_M - 1) // BLOCK_M
    num_n = (N + BLOCK_N - 1) // BLOCK_N
    width = GROUP_M * num_n
    first_m = (pid // width) * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % size_m
    pid_n = (pid % width) // size_m
    return pid_m * BLOCK_M + tl.arange(0, BLOCK_M), pid_n * BLOCK_N + tl.arange(0, BLOCK_N)


@triton.jit
def k_range(K, SPLIT_K: tl.constexpr, BLOCK_K: tl.constexpr):
    """[k_start, k_end) of this split; starts are multiples of BLOCK_K."""
    per_split = ((K + SPLIT_K - 1) // SPLIT_K + BLOCK_K - 1) // BLOCK_K * BLOCK_K
    k_start = tl.program_id(1) * per_split
    return k_start, tl.minimum(k_start + per_split, K)


@triton.jit
def _round_to_bf16(v):
    """fp32 -> the nearest-even bf16 value, kept in fp32."""
    bits = v.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def mma(x, w, acc, EMULATE_BF16: tl.constexpr):
    """acc + x @ w, w rounded to x's dtype first. The 3.9 interpreter multiplies bf16
    storage as raw integers and converts int -> bf16 wrongly, so under it (bf16 x only)
    the same product runs in fp32 on bf16-rounded values: exact, as on tensor cores."""
    if EMULATE_BF16:
        return tl.dot(
            x.to(tl.float32), _round_to_bf16(w.to(tl.float32)), acc, input_precision="ieee"
        )
    else:
        return tl.dot(x, w.to(x.dtype), acc, input_precision="ieee")


@triton.jit
def store_tile(
    out_ptr, acc, offs_m, offs_n, M, N, stride_om, stride_on, stride_os, EMULATE_BF16: tl.constexpr
):
    """Write this program's tile (split-K: its fp32 partial slice)."""
    if EMULATE_BF16 and out_ptr.dtype.element_ty == tl.bfloat16:
        acc = _round_to_bf16(acc)  # the interpreter's own fp32 -> bf16 truncates
    ptrs = (
        out_ptr
        + tl.program_id(1) * stride_os
        + offs_m[:, None] * stride_om
        + offs_n[None, :] * stride_on
    )
    tl.store(
        ptrs, acc.to(out_ptr.dtype.element_ty), mask=(offs_m < M)[:, None] & (offs_n < N)[None, :]
    )


def check_activation(x: torch.Tensor, k: int) -> torch.Tensor:
    if x.shape[-1] != k:
        raise ValueError(f"x has {x.shape[-1]} input features, the weight {k}")
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise TypeError(f"unsupported activation dtype {x.dtype}")
    return x.reshape(-1, k)


def channel_scale(scale: torch.Tensor, n: int) -> tuple[torch.Tensor, int]:
    """[N, 1] / [N] / [1] / [] -> (flat tensor, stride: 0 for per-tensor)."""
    flat = scale.reshape(-1)
    if flat.numel() not in (1, n):
        raise ValueError(f"weight scale must have 1 or {n} elements, got {tuple(scale.shape)}")
    return flat, (0 if flat.numel() == 1 else flat.stride(0))
