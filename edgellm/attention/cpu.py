"""The CPU backend for fp32 models: decode rows through the C++ kernel (one program per sequence
and kv head, K and V read once from the pages: edgellm/kernels/csrc/cpu/attention.cpp), prefill
chunks in `prefill_dtype` (bf16 or fp32; their causal part by the C++ kernel over the pages,
csrc/cpu/prefill_attention.cpp, in fp32 math, where it applies and measured faster than torch's
flash in that dtype, else by torch's SDPA), with shared-prefix
("cascade") attention when several chunks start with the same cached blocks
(edgellm/attention/cpu_cascade.py). Without a
prefill dtype (mode exact) prefill chunks run as the reference does, one at a time in fp32.
"""

from __future__ import annotations

from typing import Any

import torch

from edgellm.attention.base import AttentionBackend
from edgellm.attention.cpu_cascade import cascade_prefill
from edgellm.batch import AttentionMetadata
from edgellm.kernels.cpu_native import decode_tables
from edgellm.kernels.paged_attention import (
    decode_rows_ref,
    prefill_rows_ref,
    write_kv_ref,
)


class CpuAttention(AttentionBackend):
    name = "cpu"

    def __init__(
        self,
        native: Any,
        prefill_dtype: torch.dtype | None = None,
        prefix_kernel: str = "flash",
        causal_kernel: bool | None = None,
    ) -> None:
        """native: the C++ module (edgellm/kernels/cpu_native.load); prefill_dtype: prefill
        chunks' dtype, with cascade attention (None: the query's, one chunk at a time);
        prefix_kernel: how cascade attends the shared prefix (edgellm/attention/cpu_prefix.py);
        causal_kernel: whether prefill chunks run their causal attention by the C++ kernel over
        their pages (csrc/cpu/prefill_attention.cpp, fp32 math; None: where measured faster,
        prefill_causal_kernel); needs a prefill dtype."""
        self.native = native
        self.prefill_dtype = prefill_dtype
        self.prefix_kernel = prefix_kernel
        if causal_kernel is None:
            causal_kernel = prefill_causal_kernel(native, prefill_dtype)
        self.native_prefill = native if causal_kernel and prefill_dtype is not None else None

    def write_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        cache: torch.Tensor,
        meta: AttentionMetadata,
        k_scale: float,
        v_scale: float,
    ) -> None:
        write_kv_ref(key, value, cache, meta.slot_mapping, k_scale, v_scale)

    def attend(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int | None,
        k_scale: float,
        v_scale: float,
    ) -> torch.Tensor:
        return self.paged(
            query,
            key,
            value,
            cache,
            meta.block_tables,
            meta.seq_lens,
            meta.query_start_loc,
            meta.num_decodes,
            scale,
            sliding_window,
            k_scale,
            v_scale,
            meta.step_cache,
        )

    def paged(
        self,
        query,
        key,
        value,
        kv_cache,
        block_tables,
        seq_lens,
        query_start_loc,
        num_decodes,
        scale,
        sliding_window=None,
        k_scale=1.0,
        v_scale=1.0,
        step_cache=None,
    ) -> torch.Tensor:
        """attend() with paged_attention_ref's arguments."""
        out = torch.empty_like(query)
        if num_decodes:
            if (
                self.native is not None
                and query.dtype == torch.float32
                and kv_cache.dtype in NATIVE_CACHE_DTYPES
                and kv_cache.is_contiguous()
            ):
                plan = step_cache.get("cpp_decode") if step_cache is not None else None
                if plan is None:
                    plan = decode_tables(block_tables, seq_lens, num_decodes)
                    if step_cache is not None:
                        step_cache["cpp_decode"] = plan
                out[:num_decodes] = self.native.decode_attention(
                    query[:num_decodes].contiguous(),
                    kv_cache,
                    *plan,
                    float(scale),
                    int(sliding_window or 0),
                )
            else:
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
        if num_decodes == len(seq_lens):
            return out
        first = num_decodes
        native_prefill = (
            self.native_prefill
            if sliding_window is None
            and query.dtype == torch.float32
            and kv_cache.dtype in NATIVE_CACHE_DTYPES
            and query.shape[2] in PREFILL_HEAD_DIMS
            and query.stride(2) == 1
            and query.stride(1) == query.shape[2]
            and kv_cache.shape[2] % 16 == 0
            and kv_cache.is_contiguous()
            else None
        )
        if self.prefill_dtype is not None and sliding_window is None:
            first = cascade_prefill(
                query,
                key,
                value,
                kv_cache,
                block_tables.long(),
                seq_lens,
                query_start_loc,
                num_decodes,
                scale,
                k_scale,
                v_scale,
                self.prefill_dtype,
                step_cache,
                out,
                self.prefix_kernel,
                self.native,
                native_prefill,
            )
        if native_prefill is not None:
            if first < len(seq_lens):  # the chunks left, in one call
                qs, qe = query_start_loc[first], query_start_loc[-1]
                out[qs:qe] = native_prefill.prefill_attention_many(
                    query[qs:qe],
                    kv_cache,
                    block_tables[first:].long(),
                    seq_lens[first:],
                    [query_start_loc[i] - qs for i in range(first, len(seq_lens) + 1)],
                    [0] * (len(seq_lens) - first),
                    scale,
                )[0]
            return out
        prefill_rows_ref(
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
            self.prefill_dtype or query.dtype,
            out,
        )
        return out


PREFILL_HEAD_DIMS = (64, 96, 128, 256)  # what csrc/cpu/prefill_attention.cpp is built for
NATIVE_CACHE_DTYPES = (torch.float32, torch.float16)  # pages the C++ kernels read (fp32 math)


def prefill_causal_kernel(native: Any, prefill_dtype: torch.dtype | None) -> bool:
    """Whether prefill chunks run the C++ causal kernel: a tuned prefill dtype, and the kernel
    measured faster than torch's flash in that dtype on this CPU (edgellm/attention/cpu_dtype.py);
    per call also an fp32 query, a head dim of PREFILL_HEAD_DIMS, pages of a multiple of 16 tokens
    and no sliding window (else torch's flash)."""
    from edgellm.attention.cpu_dtype import causal_kernel

    return prefill_dtype is not None and causal_kernel(native, prefill_dtype)
