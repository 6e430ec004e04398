"""The main paged-attention Triton kernel, `paged_attention_kernel`: one program per (sequence,
block of query tokens, kv head), for prefill chunks and for decodes that are not split. The GROUP
query heads sharing a kv head are rows of one tile, so each K/V tile is loaded once; every context
position, this step's included, is read from the pages. An fp8 cache is read as bytes (scales
folded into qk_scale and out_scale). Launched by paged_attention_triton.
"""

from __future__ import annotations

from .attention_tiles import attend_range, jit, round_to_bf16, tl


@jit
def paged_attention_kernel(
    out_ptr,  # [T, Hq, D]
    q_ptr,  # [T, Hq, D]
    k_cache_ptr,  # [NB, BS, Hkv, D]  (uint8 view when fp8)
    v_cache_ptr,  # [NB, BS, Hkv, D]
    block_tables_ptr,  # [B, max_blocks]
    seq_lens_ptr,  # [B]
    query_start_loc_ptr,  # [B + 1]
    qk_scale,
    out_scale,  # v_scale * 256 when fp8, else 1
    window,
    seq_offset,  # first sequence handled (decodes may go to the split-K kernel)
    stride_qt,
    stride_qh,
    stride_qd,
    stride_ot,
    stride_oh,
    stride_od,
    stride_bt,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_cd,
    GROUP: tl.constexpr,  # query heads per kv head
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,  # rows = BLOCK_Q tokens x GROUP heads (padded)
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    IS_FP8: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    SOFT_BF16: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    # grid: (sequences, blocks of BLOCK_Q query tokens, kv heads). The GROUP query
    # heads sharing a kv head are rows of one tile, so each K/V tile is loaded once.
    seq = tl.program_id(0) + seq_offset
    q_block = tl.program_id(1)
    kv_head = tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if q_block * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    prefix_len = seq_len - q_len

    rows = tl.arange(0, BLOCK_M)
    tok = q_block * BLOCK_Q + rows // GROUP  # [M] token index within the chunk
    head = kv_head * GROUP + rows % GROUP  # [M]
    row_valid = (rows // GROUP < BLOCK_Q) & (tok < q_len)
    q_pos = tl.where(row_valid, prefix_len + tok, -1)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    q_row = (q_start + tok).to(tl.int64)
    q = tl.load(
        q_ptr
        + q_row[:, None] * stride_qt
        + head[:, None] * stride_qh
        + offs_d[None, :] * stride_qd,
        mask=row_valid[:, None] & d_mask[None, :],
        other=0,
    )  # [M, D]
    if SOFT_BF16:
        q = q.to(tl.float32)  # the interpreter's bf16 dot is broken; bf16 * bf16 is exact in fp32

    first_pos = prefix_len + q_block * BLOCK_Q
    hi = tl.minimum(seq_len, first_pos + BLOCK_Q)
    lo = 0
    if USE_WINDOW:
        lo = tl.maximum(first_pos - window + 1, 0)

    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
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
    out = acc * (out_scale / tl.where(l_i == 0.0, 1.0, l_i))[:, None]
    if SOFT_BF16:
        out = round_to_bf16(out)
    tl.store(
        out_ptr
        + q_row[:, None] * stride_ot
        + head[:, None] * stride_oh
        + offs_d[None, :] * stride_od,
        out.to(out_ptr.dtype.element_ty),
        mask=row_valid[:, None] & d_mask[None, :],
    )
