"""Split-K ("flash decoding") for decodes over long contexts: one sequence's context spread over
several programs, each writing a partial softmax (accumulator, sum, max), then merged by a reduce
kernel. Launched by paged_attention_triton when the decode programs alone cannot fill the GPU."""

from __future__ import annotations

from .attention_tiles import attend_range, jit, round_to_bf16, tl


@jit
def paged_decode_split_kernel(
    part_acc_ptr,  # [num_decodes, Hq, S, BLOCK_D] fp32, unnormalized p @ v
    part_l_ptr,  # [num_decodes, Hq, S] fp32
    part_m_ptr,  # [num_decodes, Hq, S] fp32 (log2 domain)
    q_ptr,  # [T, Hq, D]; decode i is token i
    k_cache_ptr,  # [NB, BS, Hkv, D]
    v_cache_ptr,  # [NB, BS, Hkv, D]
    block_tables_ptr,  # [B, max_blocks]
    seq_lens_ptr,  # [B]
    qk_scale,
    window,
    partition_size,  # context positions per split, a multiple of BLOCK_N
    num_splits,
    stride_qt,
    stride_qh,
    stride_qd,
    stride_bt,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_cd,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_H: tl.constexpr,  # GROUP padded (>= 16 for tl.dot)
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    IS_FP8: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    SOFT_BF16: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    # grid: (decodes, kv heads, splits). Split s covers positions
    # [s * partition_size, (s + 1) * partition_size) of the context; empty ones
    # write l = 0 and m = -1e30, which the reduction weighs as zero.
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)

    rows = tl.arange(0, BLOCK_H)
    head = kv_head * GROUP + rows
    row_valid = rows < GROUP
    q_pos = tl.where(row_valid, seq_len - 1, -1)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    q = tl.load(
        q_ptr
        + seq.to(tl.int64) * stride_qt
        + head[:, None] * stride_qh
        + offs_d[None, :] * stride_qd,
        mask=row_valid[:, None] & d_mask[None, :],
        other=0,
    )  # [H, D]
    if SOFT_BF16:
        q = q.to(tl.float32)

    lo = split * partition_size
    hi = tl.minimum(seq_len, lo + partition_size)
    if USE_WINDOW:
        lo = tl.maximum(lo, seq_len - window)
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    m_i = tl.full([BLOCK_H], -1.0e30, dtype=tl.float32)
    acc, l_i, m_i = attend_range(
        acc,
        l_i,
        m_i,
        q,
        q_pos,
        k_cache_ptr,
        v_cache_ptr,
        block_tables_ptr + seq.to(tl.int64) * stride_bt,
        kv_head,
        lo,
        hi,
        qk_scale,
        window,
        stride_cb,
        stride_cs,
        stride_ch,
        stride_cd,
        HEAD_DIM,
        BLOCK_D,
        BLOCK_N,
        BLOCK_SIZE,
        IS_FP8,
        USE_WINDOW,
        SOFT_BF16,
        DOT_PRECISION,
    )
    part = (seq.to(tl.int64) * (GROUP * tl.num_programs(1)) + head) * num_splits + split  # [H]
    tl.store(part_acc_ptr + part[:, None] * BLOCK_D + offs_d[None, :], acc, mask=row_valid[:, None])
    tl.store(part_l_ptr + part, l_i, mask=row_valid)
    tl.store(part_m_ptr + part, m_i, mask=row_valid)


@jit
def paged_decode_reduce_kernel(
    out_ptr,  # [T, Hq, D]
    part_acc_ptr,  # [num_decodes, Hq, S, BLOCK_D]
    part_l_ptr,  # [num_decodes, Hq, S]
    part_m_ptr,  # [num_decodes, Hq, S]
    out_scale,
    num_splits,
    stride_ot,
    stride_oh,
    stride_od,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,
    SOFT_BF16: tl.constexpr,
):
    # grid: (decodes, query heads): merge the splits' partial softmaxes.
    seq = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < num_splits
    part = (seq.to(tl.int64) * tl.num_programs(1) + head) * num_splits + offs_s  # [S]
    m = tl.load(part_m_ptr + part, mask=s_mask, other=-1.0e30)
    l_s = tl.load(part_l_ptr + part, mask=s_mask, other=0.0)
    acc = tl.load(
        part_acc_ptr + part[:, None] * BLOCK_D + offs_d[None, :], mask=s_mask[:, None], other=0.0
    )  # [S, D]
    w = tl.exp2(m - tl.max(m, 0))  # [S]
    l_total = tl.sum(l_s * w, 0)
    out = tl.sum(acc * w[:, None], 0) * (out_scale / l_total)  # [D]
    if SOFT_BF16:
        out = round_to_bf16(out)
    tl.store(
        out_ptr + seq.to(tl.int64) * stride_ot + head * stride_oh + offs_d * stride_od,
        out.to(out_ptr.dtype.element_ty),
        mask=offs_d < HEAD_DIM,
    )
