"""The CUDA backend: the Triton kernels (edgellm/kernels/kv_cache.py, paged_attention.py)."""

from __future__ import annotations

import torch

from edgellm.attention.base import AttentionBackend
from edgellm.batch import AttentionMetadata


class TritonAttention(AttentionBackend):
    name = "triton"

    def write_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        cache: torch.Tensor,
        meta: AttentionMetadata,
        k_scale: float,
        v_scale: float,
    ) -> None:
        from edgellm.kernels.kv_cache import write_kv_triton

        write_kv_triton(key, value, cache, meta.slot_mapping, k_scale, v_scale)

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
        from edgellm.kernels.paged_attention_triton import paged_attention_triton

        return paged_attention_triton(
            query,
            key,
            value,
            cache,
            meta.block_tables,
            meta.seq_lens_tensor,
            meta.query_start_loc_tensor,
            meta.num_decodes,
            scale,
            sliding_window,
            k_scale,
            v_scale,
            max_query_len=meta.max_query_len,
            max_seq_len=meta.max_seq_len,
        )
