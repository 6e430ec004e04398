"""Attention over a paged KV cache: the plain torch references (the backends built on them and
on the kernels: edgellm/attention/; the Triton kernels: paged_attention_triton.py).

Cache layout, shared with the Triton kernels:
    kv_cache [2, num_blocks, block_size, num_kv_heads, head_dim]  (0: K, 1: V)
Token t of a sequence lives in block block_table[t // block_size] at offset
t % block_size; its flat slot is block * block_size + offset.

A step's tokens are flattened: the first `num_decodes` sequences contribute
one query token each (decode), the rest a chunk each (prefill, possibly over
a cached prefix). seq_lens are context lengths after this step's tokens.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


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
        key, value = (
            (key.float() / k_scale).clamp(-448, 448),
            (value.float() / v_scale).clamp(-448, 448),
        )
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
    kv = kv.view(2, batch, nblocks * block_size, kv_cache.shape[3], kv_cache.shape[4])[
        :, :, :length
    ]
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
        out[:num_decodes] = decode_rows_ref(
            query,
            kv_cache,
            block_tables,
            seq_lens,
            num_decodes,
            scale,
            sliding_window,
            k_scale,
            v_scale,
            step_cache,
        )
    prefill_rows_ref(
        query,
        key,
        value,
        kv_cache,
        block_tables,
        seq_lens,
        query_start_loc,
        num_decodes,
        scale,
        sliding_window,
        k_scale,
        v_scale,
        query.dtype,
        out,
    )
    return out


def decode_rows_ref(
    query,
    kv_cache,
    block_tables,
    seq_lens,
    num_decodes,
    scale,
    sliding_window=None,
    k_scale=1.0,
    v_scale=1.0,
    step_cache=None,
) -> torch.Tensor:
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


def prefill_rows_ref(
    query,
    key,
    value,
    kv_cache,
    block_tables,
    seq_lens,
    query_start_loc,
    first,
    scale,
    sliding_window,
    k_scale,
    v_scale,
    dtype,
    out,
) -> None:
    """Prefill chunks [first, B) one at a time, computed in `dtype` (causal SDPA over the chunk's
    own keys when it is the whole context, else over its pages with a mask), into out's rows.
    With a sliding window, only the pages from the one the chunk's first query reaches are read
    (the earlier ones may be released: engine/window_blocks.py)."""
    block_size = kv_cache.shape[2]
    for i in range(first, len(seq_lens)):
        start, end = query_start_loc[i], query_start_loc[i + 1]
        q_len, ctx = end - start, seq_lens[i]
        q = query[start:end].transpose(0, 1).unsqueeze(0).to(dtype)  # [1, Hq, q_len, D]
        lo = 0  # the first context position read, on a block boundary
        if ctx == q_len and kv_cache.dtype != torch.float8_e4m3fn:
            k = key[start:end].transpose(0, 1).unsqueeze(0).to(dtype)
            v = value[start:end].transpose(0, 1).unsqueeze(0).to(dtype)
        else:
            table = block_tables[i : i + 1].long()
            if sliding_window is not None:
                lo = max(0, ctx - q_len - sliding_window + 1) // block_size * block_size
                table = table[:, lo // block_size :]
            k, v = gather_kv(kv_cache, table, ctx - lo, dtype, k_scale, v_scale)
        if sliding_window is None and ctx == q_len:
            o = F.scaled_dot_product_attention(
                q, k, v, is_causal=True, scale=scale, enable_gqa=True
            )
        else:
            q_pos = torch.arange(ctx - q_len, ctx)[:, None]
            kv_pos = torch.arange(lo, ctx)[None, :]
            mask = kv_pos <= q_pos
            if sliding_window is not None:
                mask &= kv_pos > q_pos - sliding_window
            o = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask[None, None], scale=scale, enable_gqa=True
            )
        out[start:end] = o.squeeze(0).transpose(0, 1)
