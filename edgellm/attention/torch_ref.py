"""The plain torch backend: the reference (edgellm/kernels/paged_attention.paged_attention_ref),
on any device torch runs; the CPU default where the C++ kernels are not used."""

from __future__ import annotations

import torch

from edgellm.attention.base import AttentionBackend
from edgellm.batch import AttentionMetadata
from edgellm.kernels.paged_attention import paged_attention_ref, write_kv_ref


class TorchRefAttention(AttentionBackend):
    name = "torch"

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
        return paged_attention_ref(
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
            step_cache=meta.step_cache,
        )
