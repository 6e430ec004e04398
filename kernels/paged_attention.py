"""Attention over a paged KV cache: torch reference (the CPU backend).

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
        key, value = (key.float() / k_scale).clamp(-448, 448), (value.float() / v_scale).clamp(-448, 448)
    flat[0].index_copy_(0, slot_mapping, key.to(kv_cache.dtype))
    flat[1].index_copy_(0, slot_mapping, value.to(kv_cache.dtype))


def _gather(
    cache: torch.Tensor,  # [NB, BS, Hkv, D]
    block_tables: torch.Tensor,  # [B, max_blocks]
    length: int,
    dtype: torch.dtype,
    scale: float,
) -> torch.Tensor:
    """[B, Hkv, length, D] in `dtype`, dequantized when the cache is fp8."""
    block_size = cache.shape[1]
    nblocks = -(-length // block_size)
    x = cache[block_tables[:, :nblocks]]  # [B, nblocks, BS, Hkv, D]
    x = x.reshape(x.shape[0], nblocks * block_size, x.shape[3], x.shape[4])[:, :length]
    if cache.dtype == torch.float8_e4m3fn:
        x = x.to(torch.float32) * scale
    return x.to(dtype).transpose(1, 2)


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
) -> torch.Tensor:
    out = torch.empty_like(query)
    dtype = query.dtype
    block_tables = block_tables.long()
    if num_decodes:
        lens = torch.tensor(seq_lens[:num_decodes])
        max_len = int(lens.max())
        k = _gather(kv_cache[0], block_tables[:num_decodes], max_len, dtype, k_scale)
        v = _gather(kv_cache[1], block_tables[:num_decodes], max_len, dtype, v_scale)
        kv_pos = torch.arange(max_len)[None, :]
        mask = kv_pos < lens[:, None]
        if sliding_window is not None:
            mask &= kv_pos > (lens[:, None] - 1 - sliding_window)
        q = query[:num_decodes].unsqueeze(2)  # [B, Hq, 1, D]
        o = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask[:, None, None, :], scale=scale, enable_gqa=True
        )
        out[:num_decodes] = o.squeeze(2)
    for i in range(num_decodes, len(seq_lens)):
        start, end = query_start_loc[i], query_start_loc[i + 1]
        q_len, ctx = end - start, seq_lens[i]
        q = query[start:end].transpose(0, 1).unsqueeze(0)  # [1, Hq, q_len, D]
        if ctx == q_len and kv_cache.dtype != torch.float8_e4m3fn:
            k = key[start:end].transpose(0, 1).unsqueeze(0)
            v = value[start:end].transpose(0, 1).unsqueeze(0)
        else:
            k = _gather(kv_cache[0], block_tables[i : i + 1], ctx, dtype, k_scale)
            v = _gather(kv_cache[1], block_tables[i : i + 1], ctx, dtype, v_scale)
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
    return out
