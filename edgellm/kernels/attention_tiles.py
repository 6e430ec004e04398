"""Triton building blocks the paged attention kernels share: one tile loop of online softmax
over a range of context positions (`attend_range`), exact fp8 (e4m3fn) byte decoding, and
round-to-nearest-even bf16 for the interpreter (whose own cast truncates)."""

from __future__ import annotations

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only install: the torch references still work
    triton = None
    tl = None


def jit(fn):
    return triton.jit(fn) if triton is not None else fn


@jit
def round_to_bf16(x):
    # fp32 tile -> fp32 tile holding the nearest-even bf16 value. Only used under
    # the interpreter, whose fp32 -> bf16 cast truncates; exact values cast exactly.
    bits = x.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
    return bits.to(tl.float32, bitcast=True)


@jit
def fp8_bytes_to_fp16(code):
    # uint8 tile of e4m3fn codes -> fp16 tile holding value / 256, exact for every
    # finite code (normals and subnormals): e4m3 (bias 7) placed into fp16's bit
    # fields (bias 15) keeps the mantissa and scales by 2^-8. Needs no fp8 types,
    # so it runs on any GPU and in the interpreter. Codes 0x7f/0xff (NaN) are never
    # written (writes are clamped to +-448).
    c = code.to(tl.int32)
    half = ((c & 0x80) << 8) | ((c & 0x7F) << 7)
    return half.to(tl.int16).to(tl.float16, bitcast=True)


@jit
def attend_range(
    acc,  # [M, BLOCK_D] fp32, running sum of p @ v
    l_i,  # [M] fp32, running softmax denominator
    m_i,  # [M] fp32, running max of the scores (log2 domain)
    q,  # [M, BLOCK_D] compute dtype
    q_pos,  # [M] int32 absolute position of each row's token; -1 on padding rows
    k_cache_ptr,  # [NB, BS, Hkv, D]
    v_cache_ptr,  # [NB, BS, Hkv, D]
    block_table_ptr,  # [max_blocks] this sequence's row
    kv_head,
    lo,  # first context position to visit
    hi,  # one past the last
    qk_scale,  # softmax scale * log2(e) (* k_scale * 256 when fp8)
    window,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_cd,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    IS_FP8: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    SOFT_BF16: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    for start in range(lo, hi, BLOCK_N):
        kv_pos = start + offs_n  # [N]
        kv_valid = kv_pos < hi
        # Each position may sit on a different page; BLOCK_N need not match BLOCK_SIZE.
        page = tl.load(block_table_ptr + kv_pos // BLOCK_SIZE, mask=kv_valid, other=0).to(tl.int64)
        base = page * stride_cb + (kv_pos % BLOCK_SIZE) * stride_cs + kv_head * stride_ch  # [N]
        k = tl.load(
            k_cache_ptr + base[None, :] + offs_d[:, None] * stride_cd,
            mask=kv_valid[None, :] & d_mask[:, None],
            other=0,
        )  # [D, N]
        v = tl.load(
            v_cache_ptr + base[:, None] + offs_d[None, :] * stride_cd,
            mask=kv_valid[:, None] & d_mask[None, :],
            other=0,
        )  # [N, D]
        if IS_FP8:
            k = fp8_bytes_to_fp16(k)
            v = fp8_bytes_to_fp16(v)
        k = k.to(q.dtype)
        v = v.to(q.dtype)

        s = tl.dot(q, k, input_precision=DOT_PRECISION) * qk_scale  # [M, N]
        # Causal (padding rows, q_pos -1, see nothing) and inside [lo, hi): a split's
        # range can end before the query's position.
        allowed = (kv_pos[None, :] <= q_pos[:, None]) & kv_valid[None, :]
        if USE_WINDOW:
            allowed = allowed & (kv_pos[None, :] > q_pos[:, None] - window)
        s = tl.where(allowed, s, float("-inf"))

        # m_i starts at a finite floor, so fully masked rows give exp2(-inf) = 0, never NaN.
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])  # [M, N]
        l_i = l_i * alpha + tl.sum(p, 1)
        if SOFT_BF16:
            p = round_to_bf16(p)  # what a bf16 GPU dot would see
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, l_i, m_i
