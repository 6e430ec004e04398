"""Write a step's K/V into the paged cache by slot: Triton kernel (the CUDA backend).

The torch reference is `write_kv_ref` in edgellm/kernels/paged_attention.py, which also
documents the cache layout [2, num_blocks, block_size, num_kv_heads, head_dim].
With an fp8 cache (torch.float8_e4m3fn) values are stored as
clamp(x / scale, -448, 448) rounded to nearest even, exactly like the reference;
they read back as fp8 * scale.

FP8 conversion has two paths. On sm89+ GPUs the kernel uses the hardware
conversion. Elsewhere (the Triton interpreter, whose fp32 -> fp8 cast is wrong at
binade edges and rounds ties away from zero, and GPUs without fp8 types) it
computes the e4m3 bit pattern with integer/float math and stores bytes.
"""

from __future__ import annotations

import torch

from edgellm import env

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only install: the torch reference still works
    triton = None
    tl = None

FP8_MAX = 448.0
FP8_MIN_NORMAL = 2.0**-6

# How a kernel writes fp8 (a constexpr): no fp8, hardware cast, software bit pattern.
FP8_NONE, FP8_HARDWARE, FP8_SOFTWARE = 0, 1, 2


def _jit(fn):
    return triton.jit(fn) if triton is not None else fn


def fp8_scale_from_absmax(x: torch.Tensor, floor: float = 1e-12) -> float:
    """Per-tensor (per-layer) fp8 scale: absmax / 448, so x / scale fits e4m3 exactly at its max."""
    return max(float(x.detach().abs().max()) / FP8_MAX, floor)


def triton_interpreting(kernel: object | None = None) -> bool:
    """True when Triton runs through its CPU interpreter (TRITON_INTERPRET=1 at import)."""
    if kernel is not None:
        return type(kernel).__name__ == "InterpretedFunction"
    return env.triton_interpret()


def check_triton_device(kernel: object, device: torch.device) -> bool:
    """Raise unless `kernel` can run on `device`; returns whether it is interpreted."""
    if triton is None:
        raise RuntimeError("the Triton kernels need `triton` (pip install edgellm[kernels])")
    interpreted = triton_interpreting(kernel)
    if device.type != "cuda" and not interpreted:
        raise RuntimeError(
            "Triton kernels need CUDA tensors; for CPU tensors set TRITON_INTERPRET=1 "
            "before edgellm.kernels is imported"
        )
    return interpreted


def fp8_write_mode(kernel: object, device: torch.device) -> int:
    """FP8_HARDWARE on sm89+ GPUs, else FP8_SOFTWARE (interpreter, older GPUs)."""
    if triton_interpreting(kernel) or device.type != "cuda":
        return FP8_SOFTWARE
    return FP8_HARDWARE if torch.cuda.get_device_capability(device) >= (8, 9) else FP8_SOFTWARE


@_jit
def _fp32_to_e4m3_bits(x):
    # x: fp32 tile already clamped to [-448, 448] -> int32 tile of e4m3fn codes
    # (0..255), rounded to nearest, ties to even; matches torch's .to(float8_e4m3fn).
    bits = x.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    a_bits = bits & 0x7FFFFFFF
    a = a_bits.to(tl.float32, bitcast=True)
    # Normal range: drop 20 of fp32's 23 mantissa bits, rounding to nearest even;
    # a carry out of the mantissa correctly bumps the exponent (127.99 -> 128).
    r = a_bits + 0x7FFFF + ((a_bits >> 20) & 1)
    normal = (((r >> 23) - 120) << 3) | ((r >> 20) & 7)
    # Subnormal range: codes are multiples of 2^-9. a * 512 is exact, and adding
    # 2^23 rounds it to an integer with fp32's own round-to-nearest-even.
    # A result of 8 is the code of 2^-6, the smallest normal: still right.
    sub = ((a * 512.0 + 8388608.0) - 8388608.0).to(tl.int32)
    code = tl.where(a < 0.015625, sub, normal)
    return sign | code


@_jit
def _quantize_fp8(x, scale, FP8_MODE: tl.constexpr):
    # x: any-float tile -> fp8 values (FP8_HARDWARE) or uint8 codes (FP8_SOFTWARE)
    x = tl.math.div_rn(x.to(tl.float32), scale)  # a true division, like the reference
    x = tl.minimum(tl.maximum(x, -448.0), 448.0)
    if FP8_MODE == 1:
        return x.to(tl.float8e4nv)
    return _fp32_to_e4m3_bits(x).to(tl.uint8)


@_jit
def _write_kv_kernel(
    key_ptr,  # [T, Hkv, D]
    value_ptr,  # [T, Hkv, D]
    k_cache_ptr,  # [NB, BS, Hkv, D]  (a uint8 view when FP8_MODE is software)
    v_cache_ptr,  # [NB, BS, Hkv, D]
    slot_mapping_ptr,  # [T]  block * BS + offset; negative: padding, skipped
    k_scale,
    v_scale,
    stride_kt,
    stride_kh,
    stride_kd,
    stride_vt,
    stride_vh,
    stride_vd,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_cd,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    FP8_MODE: tl.constexpr,
):
    # One program per token: all of its heads at once.
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE

    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h[:, None] < NUM_KV_HEADS) & (offs_d[None, :] < HEAD_DIM)  # [BLOCK_H, BLOCK_D]
    dst = (
        block * stride_cb
        + offset * stride_cs
        + offs_h[:, None] * stride_ch
        + offs_d[None, :] * stride_cd
    )  # [BLOCK_H, BLOCK_D]

    k_src = token * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :] * stride_kd
    v_src = token * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :] * stride_vd
    k = tl.load(key_ptr + k_src, mask=mask)
    v = tl.load(value_ptr + v_src, mask=mask)
    if FP8_MODE == 0:
        k = k.to(k_cache_ptr.dtype.element_ty)
        v = v.to(v_cache_ptr.dtype.element_ty)
    else:
        k = _quantize_fp8(k, k_scale, FP8_MODE)
        v = _quantize_fp8(v, v_scale, FP8_MODE)
    tl.store(k_cache_ptr + dst, k, mask=mask)
    tl.store(v_cache_ptr + dst, v, mask=mask)


def write_kv_triton(
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor,  # [T, Hkv, D]
    kv_cache: torch.Tensor,  # [2, NB, BS, Hkv, D]
    slot_mapping: torch.Tensor,  # [T] int32/int64
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Store this step's K/V at their slots (in place), quantizing when the cache is fp8.

    Same result as `write_kv_ref`, bit for bit; negative slots (padding) are skipped.
    Without fp8 the cache dtype must equal the K/V dtype.
    """
    if key.dim() != 3 or key.shape != value.shape:
        raise ValueError(
            f"key/value must both be [T, Hkv, D], got {tuple(key.shape)} / {tuple(value.shape)}"
        )
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2:
        raise ValueError(f"kv_cache must be [2, NB, BS, Hkv, D], got {tuple(kv_cache.shape)}")
    num_tokens, num_kv_heads, head_dim = key.shape
    if tuple(kv_cache.shape[3:]) != (num_kv_heads, head_dim):
        raise ValueError(
            f"kv_cache heads/dim {tuple(kv_cache.shape[3:])} != key {(num_kv_heads, head_dim)}"
        )
    if slot_mapping.shape != (num_tokens,) or slot_mapping.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"slot_mapping must be [T] int32/int64, got {tuple(slot_mapping.shape)} "
            f"{slot_mapping.dtype}"
        )
    is_fp8 = kv_cache.dtype == torch.float8_e4m3fn
    if not is_fp8 and key.dtype != kv_cache.dtype:
        raise ValueError(f"key dtype {key.dtype} != cache dtype {kv_cache.dtype}")
    if not key.dtype.is_floating_point or value.dtype != key.dtype:
        raise ValueError(f"key/value must share a float dtype, got {key.dtype} / {value.dtype}")
    if not (key.device == value.device == kv_cache.device == slot_mapping.device):
        raise ValueError("key, value, kv_cache and slot_mapping must be on one device")
    check_triton_device(_write_kv_kernel, kv_cache.device)
    if num_tokens == 0:
        return

    fp8_mode = fp8_write_mode(_write_kv_kernel, kv_cache.device) if is_fp8 else FP8_NONE
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    if fp8_mode == FP8_SOFTWARE:
        k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
    _write_kv_kernel[(num_tokens,)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        float(k_scale),
        float(v_scale),
        *key.stride(),
        *value.stride(),
        *k_cache.stride(),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=kv_cache.shape[2],
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
        FP8_MODE=fp8_mode,
        num_warps=4 if num_kv_heads * head_dim >= 1024 else 1,
    )
