"""Attention over the paged KV cache: write this step's K/V, then attend.

The backend is chosen once per device: the torch reference on CPU, the Triton
kernels on CUDA (when available). Both share the cache layout documented in
kernels/paged_attention.py.
"""

from __future__ import annotations

import torch
from torch import nn

from edgellm.batch import AttentionMetadata
from edgellm.kernels.paged_attention import paged_attention_ref, write_kv_ref


class Attention(nn.Module):
    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        sliding_window: int | None = None,
    ) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5
        self.sliding_window = sliding_window
        # Bound by the engine after the cache is allocated: [2, NB, BS, Hkv, D].
        self.kv_cache: torch.Tensor | None = None
        self.k_scale = 1.0
        self.v_scale = 1.0

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D] -> [T, Hq, D]."""
        if self.kv_cache is None:
            raise RuntimeError("attention called before the KV cache was bound")
        write_kv_ref(k, v, self.kv_cache, meta.slot_mapping, self.k_scale, self.v_scale)
        return paged_attention_ref(
            q, k, v, self.kv_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc,
            meta.num_decodes, self.scale, self.sliding_window, self.k_scale, self.v_scale,
        )
