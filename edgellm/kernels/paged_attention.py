"""Attention over a paged KV cache: the plain torch reference and the Triton kernels (the
backends built on them: edgellm/attention/).

Cache layout, shared with the Triton kernels:
    kv_cache [2, num_blocks, block_size, num_kv_heads, head_dim]  (0: K, 1: V)
Token t of a sequence lives in block block_table[t // block_size] at offset
t % block_size; its flat slot is block * block_size + offset.

A step's tokens are flattened: the first `num_decodes` sequences contribute
one query token each (decode), the rest a chunk each (prefill, possibly over
a cached prefix). seq_lens are context lengths after this step's tokens.

The Triton backend (`paged_attention_triton`, below the reference) reads every
context position, this step's included, from the pages, so prefix caching and
chunked prefill need nothing special. It has two kernels: one over
(sequence, block of query tokens, kv head) for prefill chunks and, when not
split, decodes; and a split-K ("flash decoding") pair for decodes over long
contexts, which spreads one sequence's context over several programs and merges
their partial softmaxes. An fp8 cache is read as bytes and decoded exactly,
with the scales folded into the softmax scale and the output.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .kv_cache import check_triton_device

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only install: the torch reference still works
    triton = None
    tl = None


def write_kv_ref(
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor,  # [T, Hkv, D]
    kv_cache: torch.Tensor,  # [2, NB, BS, Hkv, D]
    slot_mapping: torch.Tensor,  # [T] int64
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    num_slots = kv_cache.shape[1] * kv_cache.shape[2]
    flat = kv_cache.view(2, num_slots, kv_cache.shape[3], kv_cache.shape[4])
    if kv_cache.dtype == torch.float8_e4m3fn:
        key, value = (key.float() / k_scale).clamp(-448, 448), (value.float() / v_scale).clamp(-448, 448)
        # index_copy_ has no fp8 kernel on CPU; copying the bytes is the same thing.
        flat = flat.view(torch.uint8)
        key = key.to(kv_cache.dtype).view(torch.uint8)
        value = value.to(kv_cache.dtype).view(torch.uint8)
    flat[0].index_copy_(0, slot_mapping, key.to(flat.dtype))
    flat[1].index_copy_(0, slot_mapping, value.to(flat.dtype))


def gather_kv(
    kv_cache: torch.Tensor,  # [2, NB, BS, Hkv, D]
    block_tables: torch.Tensor,  # [B, max_blocks] int64
    length: int,
    dtype: torch.dtype,
    k_scale: float,
    v_scale: float,
    idx: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V [B, Hkv, length, D] in `dtype` (dequantized when the cache is fp8).

    One index_select over whole blocks for K and V together: contiguous
    block-sized copies, several times faster on CPU than advanced indexing.
    idx: the flattened block ids (block_tables[:, :nblocks]) when the caller has them.
    """
    block_size = kv_cache.shape[2]
    batch = block_tables.shape[0]
    nblocks = -(-length // block_size)
    if idx is None:
        idx = block_tables[:, :nblocks].reshape(-1)
    kv = torch.index_select(kv_cache, 1, idx)  # [2, B * nblocks, BS, Hkv, D]
    kv = kv.view(2, batch, nblocks * block_size, kv_cache.shape[3], kv_cache.shape[4])[:, :, :length]
    k, v = kv[0], kv[1]
    if kv_cache.dtype == torch.float8_e4m3fn:
        k, v = k.to(torch.float32) * k_scale, v.to(torch.float32) * v_scale
    return k.to(dtype).transpose(1, 2), v.to(dtype).transpose(1, 2)


def paged_attention_ref(
    query: torch.Tensor,  # [T, Hq, D]
    key: torch.Tensor,  # [T, Hkv, D]  this step's keys (already written to the cache)
    value: torch.Tensor,  # [T, Hkv, D]
    kv_cache: torch.Tensor,  # [2, NB, BS, Hkv, D]
    block_tables: torch.Tensor,  # [B, max_blocks] int32/int64
    seq_lens: list[int],  # [B] context length after this step
    query_start_loc: list[int],  # [B + 1]
    num_decodes: int,
    scale: float,
    sliding_window: int | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    step_cache: dict | None = None,
) -> torch.Tensor:
    """Attention over the paged cache in plain torch: [T, Hq, D]. step_cache: a dict shared by
    the layers of one step, holding what every layer would otherwise rebuild (the decode mask and
    gather indices); None: computed here."""
    out = torch.empty_like(query)
    if num_decodes:
        out[:num_decodes] = decode_rows_ref(query, kv_cache, block_tables, seq_lens, num_decodes, scale,
                                            sliding_window, k_scale, v_scale, step_cache)
    prefill_rows_ref(query, key, value, kv_cache, block_tables, seq_lens, query_start_loc, num_decodes, scale,
                     sliding_window, k_scale, v_scale, query.dtype, out)
    return out


def decode_rows_ref(query, kv_cache, block_tables, seq_lens, num_decodes, scale, sliding_window=None,
                    k_scale=1.0, v_scale=1.0, step_cache=None) -> torch.Tensor:
    """The first num_decodes sequences' one query row each: [num_decodes, Hq, D] (SDPA over each
    context gathered from its pages, an additive mask for the lengths and the window)."""
    dtype = query.dtype
    key_ = ("decode", sliding_window)
    plan = step_cache.get(key_) if step_cache is not None else None
    if plan is None:
        tables = block_tables[:num_decodes].long()
        lens = torch.tensor(seq_lens[:num_decodes])
        max_len = max(seq_lens[:num_decodes])
        kv_pos = torch.arange(max_len)[None, :]
        mask = kv_pos < lens[:, None]
        if sliding_window is not None:
            mask &= kv_pos > (lens[:, None] - 1 - sliding_window)
        nblocks = -(-max_len // kv_cache.shape[2])
        # additive form, built once: SDPA would turn a boolean mask into it in every layer
        bias = torch.zeros(mask.shape, dtype=dtype).masked_fill_(~mask, float("-inf"))
        plan = (tables, max_len, bias[:, None, None, :], tables[:, :nblocks].reshape(-1))
        if step_cache is not None:
            step_cache[key_] = plan
    tables, max_len, mask, idx = plan
    k, v = gather_kv(kv_cache, tables, max_len, dtype, k_scale, v_scale, idx)
    q = query[:num_decodes].unsqueeze(2)  # [B, Hq, 1, D]
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    return o.squeeze(2)


def prefill_rows_ref(query, key, value, kv_cache, block_tables, seq_lens, query_start_loc, first, scale,
                     sliding_window, k_scale, v_scale, dtype, out) -> None:
    """Prefill chunks [first, B) one at a time, computed in `dtype` (causal SDPA over the chunk's
    own keys when it is the whole context, else over its pages with a mask), into out's rows."""
    for i in range(first, len(seq_lens)):
        start, end = query_start_loc[i], query_start_loc[i + 1]
        q_len, ctx = end - start, seq_lens[i]
        q = query[start:end].transpose(0, 1).unsqueeze(0).to(dtype)  # [1, Hq, q_len, D]
        if ctx == q_len and kv_cache.dtype != torch.float8_e4m3fn:
            k = key[start:end].transpose(0, 1).unsqueeze(0).to(dtype)
            v = value[start:end].transpose(0, 1).unsqueeze(0).to(dtype)
        else:
            k, v = gather_kv(kv_cache, block_tables[i : i + 1].long(), ctx, dtype, k_scale, v_scale)
        if sliding_window is None and ctx == q_len:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
        else:
            q_pos = torch.arange(ctx - q_len, ctx)[:, None]
            kv_pos = torch.arange(ctx)[None, :]
            mask = kv_pos <= q_pos
            if sliding_window is not None:
                mask &= kv_pos > q_pos - sliding_window
            o = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask[None, None], scale=scale, enable_gqa=True
            )
        out[start:end] = o.squeeze(0).transpose(0, 1)


# ---------------------------------------------------------------------------
# Triton backend
# ---------------------------------------------------------------------------


def _jit(fn):
    return triton.jit(fn) if triton is not None else fn


@_jit
def _round_to_bf16(x):
    # fp32 tile -> fp32 tile holding the nearest-even bf16 value. Only used under
    # the interpreter, whose fp32 -> bf16 cast truncates; exact values cast exactly.
    bits = x.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
    return bits.to(tl.float32, bitcast=True)


@_jit
def _fp8_bytes_to_fp16(code):
    # uint8 tile of e4m3fn codes -> fp16 tile holding value / 256, exact for every
    # finite code (normals and subnormals): e4m3 (bias 7) placed into fp16's bit
    # fields (bias 15) keeps the mantissa and scales by 2^-8. Needs no fp8 types,
    # so it runs on any GPU and in the interpreter. Codes 0x7f/0xff (NaN) are never
    # written (writes are clamped to +-448).
    c = code.to(tl.int32)
    half = ((c & 0x80) << 8) | ((c & 0x7F) << 7)
    return half.to(tl.int16).to(tl.float16, bitcast=True)


@_jit
def _attend_range(
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
    stride_cb, stride_cs, stride_ch, stride_cd,
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
            mask=kv_valid[None, :] & d_mask[:, None], other=0,
        )  # [D, N]
        v = tl.load(
            v_cache_ptr + base[:, None] + offs_d[None, :] * stride_cd,
            mask=kv_valid[:, None] & d_mask[None, :], other=0,
        )  # [N, D]
        if IS_FP8:
            k = _fp8_bytes_to_fp16(k)
            v = _fp8_bytes_to_fp16(v)
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
            p = _round_to_bf16(p)  # what a bf16 GPU dot would see
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, l_i, m_i


@_jit
def _paged_attention_kernel(
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
    stride_qt, stride_qh, stride_qd,
    stride_ot, stride_oh, stride_od,
    stride_bt,
    stride_cb, stride_cs, stride_ch, stride_cd,
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
        q_ptr + q_row[:, None] * stride_qt + head[:, None] * stride_qh
        + offs_d[None, :] * stride_qd,
        mask=row_valid[:, None] & d_mask[None, :], other=0,
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
    acc, l_i, m_i = _attend_range(
        acc, l_i, m_i, q, q_pos, k_cache_ptr, v_cache_ptr,
        block_tables_ptr + seq.to(tl.int64) * stride_bt, kv_head, lo, hi, qk_scale, window,
        stride_cb, stride_cs, stride_ch, stride_cd,
        HEAD_DIM, BLOCK_D, BLOCK_N, BLOCK_SIZE, IS_FP8, USE_WINDOW, SOFT_BF16, DOT_PRECISION,
    )
    out = acc * (out_scale / tl.where(l_i == 0.0, 1.0, l_i))[:, None]
    if SOFT_BF16:
        out = _round_to_bf16(out)
    tl.store(
        out_ptr + q_row[:, None] * stride_ot + head[:, None] * stride_oh
        + offs_d[None, :] * stride_od,
        out.to(out_ptr.dtype.element_ty),
        mask=row_valid[:, None] & d_mask[None, :],
    )


@_jit
def _paged_decode_split_kernel(
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
    stride_qt, stride_qh, stride_qd,
    stride_bt,
    stride_cb, stride_cs, stride_ch, stride_cd,
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
        q_ptr + seq.to(tl.int64) * stride_qt + head[:, None] * stride_qh
        + offs_d[None, :] * stride_qd,
        mask=row_valid[:, None] & d_mask[None, :], other=0,
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
    acc, l_i, m_i = _attend_range(
        acc, l_i, m_i, q, q_pos, k_cache_ptr, v_cache_ptr,
        block_tables_ptr + seq.to(tl.int64) * stride_bt, kv_head, lo, hi, qk_scale, window,
        stride_cb, stride_cs, stride_ch, stride_cd,
        HEAD_DIM, BLOCK_D, BLOCK_N, BLOCK_SIZE, IS_FP8, USE_WINDOW, SOFT_BF16, DOT_PRECISION,
    )
    part = (seq.to(tl.int64) * (GROUP * tl.num_programs(1)) + head) * num_splits + split  # [H]
    tl.store(part_acc_ptr + part[:, None] * BLOCK_D + offs_d[None, :], acc, mask=row_valid[:, None])
    tl.store(part_l_ptr + part, l_i, mask=row_valid)
    tl.store(part_m_ptr + part, m_i, mask=row_valid)


@_jit
def _paged_decode_reduce_kernel(
    out_ptr,  # [T, Hq, D]
    part_acc_ptr,  # [num_decodes, Hq, S, BLOCK_D]
    part_l_ptr,  # [num_decodes, Hq, S]
    part_m_ptr,  # [num_decodes, Hq, S]
    out_scale,
    num_splits,
    stride_ot, stride_oh, stride_od,
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
        out = _round_to_bf16(out)
    tl.store(
        out_ptr + seq.to(tl.int64) * stride_ot + head * stride_oh + offs_d * stride_od,
        out.to(out_ptr.dtype.element_ty),
        mask=offs_d < HEAD_DIM,
    )


_num_sms_cache: dict[int, int] = {}


def _num_sms(device: torch.device) -> int:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _num_sms_cache:
        _num_sms_cache[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _num_sms_cache[index]


def _pick_num_kv_splits(
    device: torch.device, num_decodes: int, num_kv_heads: int, max_seq_len: int, block_n: int
) -> int:
    """Split decodes' contexts only when the decode programs alone cannot fill the GPU."""
    if device.type != "cuda" or num_decodes == 0:
        return 1
    programs = num_decodes * num_kv_heads
    wanted = -(-2 * _num_sms(device) // programs)
    # Keep at least 4 tiles per split so the merge stays cheap.
    return max(1, min(wanted, -(-max_seq_len // (4 * block_n)), 64))


def paged_attention_triton(
    query: torch.Tensor,  # [T, Hq, D]
    key: torch.Tensor,  # [T, Hkv, D]  this step's keys (already written to the cache)
    value: torch.Tensor,  # [T, Hkv, D]
    kv_cache: torch.Tensor,  # [2, NB, BS, Hkv, D]
    block_tables: torch.Tensor,  # [B, max_blocks] int32/int64
    seq_lens_tensor: torch.Tensor,  # [B] int32/int64, context length after this step
    query_start_loc_tensor: torch.Tensor,  # [B + 1] int32/int64
    num_decodes: int,
    scale: float,
    sliding_window: int | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    max_query_len: int | None = None,
    max_seq_len: int | None = None,
    num_kv_splits: int | None = None,
) -> torch.Tensor:
    """Attention over the paged cache, as `paged_attention_ref`; returns [T, Hq, D].

    K/V are read from the cache only (key/value are checked, not read).
    max_query_len and max_seq_len are upper bounds that spare a device sync when
    given. num_kv_splits: split-K for the decodes (None: chosen from the GPU
    size; 1: decodes go through the main kernel).
    """
    if query.dim() != 3 or key.dim() != 3 or key.shape != value.shape:
        raise ValueError(
            f"query [T, Hq, D], key/value [T, Hkv, D]; got {tuple(query.shape)}, {tuple(key.shape)}"
        )
    num_tokens, num_heads, head_dim = query.shape
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2:
        raise ValueError(f"kv_cache must be [2, NB, BS, Hkv, D], got {tuple(kv_cache.shape)}")
    _, _, block_size, num_kv_heads, cache_dim = kv_cache.shape
    if cache_dim != head_dim or tuple(key.shape) != (num_tokens, num_kv_heads, head_dim):
        raise ValueError(
            f"shapes disagree: query {tuple(query.shape)}, key {tuple(key.shape)}, "
            f"cache {tuple(kv_cache.shape)}"
        )
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    if query.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"query dtype {query.dtype} is not fp32/fp16/bf16")
    is_fp8 = kv_cache.dtype == torch.float8_e4m3fn
    if not is_fp8 and kv_cache.dtype != query.dtype:
        raise ValueError(
            f"kv_cache dtype {kv_cache.dtype} must be the query's {query.dtype} or float8_e4m3fn"
        )
    num_seqs = seq_lens_tensor.shape[0]
    if block_tables.dim() != 2 or block_tables.shape[0] != num_seqs:
        raise ValueError(
            f"block_tables must be [B={num_seqs}, max_blocks], got {tuple(block_tables.shape)}"
        )
    if query_start_loc_tensor.shape != (num_seqs + 1,):
        raise ValueError(f"query_start_loc_tensor must be [B + 1 = {num_seqs + 1}]")
    for name, t in (("block_tables", block_tables), ("seq_lens_tensor", seq_lens_tensor),
                    ("query_start_loc_tensor", query_start_loc_tensor)):
        if t.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name} must be int32/int64, got {t.dtype}")
    if not 0 <= num_decodes <= num_seqs:
        raise ValueError(f"num_decodes {num_decodes} outside [0, {num_seqs}]")
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1, got {sliding_window}")
    tensors = (query, kv_cache, block_tables, seq_lens_tensor, query_start_loc_tensor)
    if any(t.device != query.device for t in tensors):
        raise ValueError("all tensors must be on one device")
    interpreted = check_triton_device(_paged_attention_kernel, query.device)

    out = torch.empty_like(query)
    if num_tokens == 0 or num_seqs == 0:
        return out
    group = num_heads // num_kv_heads
    block_d = max(16, triton.next_power_of_2(head_dim))  # tl.dot needs dims >= 16
    block_n = 64 if block_d <= 128 else 32
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    if is_fp8:
        k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
    qk_scale = scale * math.log2(math.e) * (k_scale * 256.0 if is_fp8 else 1.0)
    out_scale = v_scale * 256.0 if is_fp8 else 1.0
    common = {
        "GROUP": group, "HEAD_DIM": head_dim, "BLOCK_D": block_d, "BLOCK_N": block_n,
        "BLOCK_SIZE": block_size, "IS_FP8": is_fp8, "USE_WINDOW": sliding_window is not None,
        # The interpreter's bf16 tl.dot is wrong and its fp32 -> bf16 cast truncates.
        "SOFT_BF16": interpreted and query.dtype == torch.bfloat16,
        "DOT_PRECISION": "ieee" if query.dtype == torch.float32 else "tf32",
    }
    window = sliding_window or 0

    if num_kv_splits is None:
        if num_decodes and max_seq_len is None and query.device.type == "cuda":
            max_seq_len = int(seq_lens_tensor[:num_decodes].max())
        num_kv_splits = _pick_num_kv_splits(
            query.device, num_decodes, num_kv_heads, max_seq_len or 0, block_n
        )
    seq_offset = 0
    if num_decodes and num_kv_splits > 1:
        if max_seq_len is None:
            max_seq_len = int(seq_lens_tensor[:num_decodes].max())
        partition = -(-max(-(-max_seq_len // num_kv_splits), 1) // block_n) * block_n
        num_splits = -(-max_seq_len // partition)
        f32 = {"dtype": torch.float32, "device": query.device}
        part_acc = torch.empty(num_decodes, num_heads, num_splits, block_d, **f32)
        part_l = torch.empty(num_decodes, num_heads, num_splits, **f32)
        part_m = torch.empty_like(part_l)
        _paged_decode_split_kernel[(num_decodes, num_kv_heads, num_splits)](
            part_acc, part_l, part_m, query, k_cache, v_cache, block_tables, seq_lens_tensor,
            qk_scale, window, partition, num_splits,
            *query.stride(), block_tables.stride(0), *k_cache.stride(),
            BLOCK_H=max(16, triton.next_power_of_2(group)), **common, num_warps=4,
        )
        _paged_decode_reduce_kernel[(num_decodes, num_heads)](
            out, part_acc, part_l, part_m, out_scale, num_splits, *out.stride(),
            HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_S=triton.next_power_of_2(num_splits),
            SOFT_BF16=common["SOFT_BF16"], num_warps=1,
        )
        seq_offset = num_decodes
    if seq_offset == num_seqs:
        return out

    if max_query_len is None:
        if seq_offset == 0 and num_decodes == num_seqs:
            max_query_len = 1
        else:
            q_lens = query_start_loc_tensor[1:] - query_start_loc_tensor[:-1]
            max_query_len = int(q_lens[seq_offset:].max())
    # Small tiles for decode-sized queries, bigger ones to reuse K/V across a prefill chunk.
    block_m = max(16 if max_query_len * group <= 16 else 64, triton.next_power_of_2(group))
    block_q = block_m // group
    grid = (num_seqs - seq_offset, triton.cdiv(max_query_len, block_q), num_kv_heads)
    _paged_attention_kernel[grid](
        out, query, k_cache, v_cache, block_tables, seq_lens_tensor, query_start_loc_tensor,
        qk_scale, out_scale, window, seq_offset,
        *query.stride(), *out.stride(), block_tables.stride(0), *k_cache.stride(),
        BLOCK_M=block_m, BLOCK_Q=block_q, **common, num_warps=4,
    )
    return out
