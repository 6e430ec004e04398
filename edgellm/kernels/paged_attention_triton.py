"""The Triton backend of paged attention, `paged_attention_triton` (its reference and the cache
layout: paged_attention.py): argument checks, tile sizes, the split-K choice and the launches.
Every context position, this step's included, is read from the pages, so prefix caching and
chunked prefill need nothing special. Two kernels: paged_attention_kernel.py, over (sequence,
block of query tokens, kv head) for prefill chunks and, when not split, decodes; and
paged_decode_split.py, a split-K ("flash decoding") pair for decodes over long contexts, which
spreads one sequence's context over several programs and merges their partial softmaxes. An fp8
cache is read as bytes and decoded exactly, with the scales folded into the softmax scale and the
output.
"""

from __future__ import annotations

import math

import torch

from .attention_tiles import triton
from .kv_cache import check_triton_device
from .paged_attention_kernel import paged_attention_kernel
from .paged_decode_split import paged_decode_reduce_kernel, paged_decode_split_kernel

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
    for name, t in (
        ("block_tables", block_tables),
        ("seq_lens_tensor", seq_lens_tensor),
        ("query_start_loc_tensor", query_start_loc_tensor),
    ):
        if t.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name} must be int32/int64, got {t.dtype}")
    if not 0 <= num_decodes <= num_seqs:
        raise ValueError(f"num_decodes {num_decodes} outside [0, {num_seqs}]")
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1, got {sliding_window}")
    tensors = (query, kv_cache, block_tables, seq_lens_tensor, query_start_loc_tensor)
    if any(t.device != query.device for t in tensors):
        raise ValueError("all tensors must be on one device")
    interpreted = check_triton_device(paged_attention_kernel, query.device)

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
        "GROUP": group,
        "HEAD_DIM": head_dim,
        "BLOCK_D": block_d,
        "BLOCK_N": block_n,
        "BLOCK_SIZE": block_size,
        "IS_FP8": is_fp8,
        "USE_WINDOW": sliding_window is not None,
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
        paged_decode_split_kernel[(num_decodes, num_kv_heads, num_splits)](
            part_acc,
            part_l,
            part_m,
            query,
            k_cache,
            v_cache,
            block_tables,
            seq_lens_tensor,
            qk_scale,
            window,
            partition,
            num_splits,
            *query.stride(),
            block_tables.stride(0),
            *k_cache.stride(),
            BLOCK_H=max(16, triton.next_power_of_2(group)),
            **common,
            num_warps=4,
        )
        paged_decode_reduce_kernel[(num_decodes, num_heads)](
            out,
            part_acc,
            part_l,
            part_m,
            out_scale,
            num_splits,
            *out.stride(),
            HEAD_DIM=head_dim,
            BLOCK_D=block_d,
            BLOCK_S=triton.next_power_of_2(num_splits),
            SOFT_BF16=common["SOFT_BF16"],
            num_warps=1,
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
    paged_attention_kernel[grid](
        out,
        query,
        k_cache,
        v_cache,
        block_tables,
        seq_lens_tensor,
        query_start_loc_tensor,
        qk_scale,
        out_scale,
        window,
        seq_offset,
        *query.stride(),
        *out.stride(),
        block_tables.stride(0),
        *k_cache.stride(),
        BLOCK_M=block_m,
        BLOCK_Q=block_q,
        **common,
        num_warps=4,
    )
    return out
