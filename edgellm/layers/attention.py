"""Attention over the paged KV cache: write this step's K/V, then attend.

The backend follows the cache's device: the torch reference on CPU, the
Triton kernels on CUDA. Both share the cache layout documented in
edgellm/kernels/paged_attention.py.

FP8 KV cache: K and V are stored as float8_e4m3fn divided by per-layer
scales. The scales come from the checkpoint (compressed-tensors writes
`self_attn.k_scale` / `v_scale`) when present; otherwise they are computed
from the first prefill (absmax / 448 with 2x headroom) and logged.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from edgellm.batch import AttentionMetadata
from edgellm.kernels.paged_attention import paged_attention_ref, write_kv_ref

logger = logging.getLogger(__name__)

FP8_MAX = 448.0
FP8_HEADROOM = 2.0  # scales from one prefill leave room for larger activations later


class Attention(nn.Module):
    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        sliding_window: int | None = None,
        layer_index: int = 0,
        scale: float | None = None,
    ) -> None:
        """scale: of q.k before softmax; None: head_dim ** -0.5."""
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5 if scale is None else scale
        self.sliding_window = sliding_window
        self.layer_index = layer_index
        # Bound by the engine after the cache is allocated: [2, NB, BS, Hkv, D].
        self.kv_cache: torch.Tensor | None = None
        self.k_scale = 1.0
        self.v_scale = 1.0
        self.scales_known = False  # fp8: set from the checkpoint, else from the first prefill
        self.cpp_decode = False  # fp32 on CPU: decode rows through edgellm/kernels/cpu_native.py
        self.prefill_dtype: torch.dtype | None = None  # CPU "fast" mode: bf16 prefill attention

    def bind_cache(self, cache: torch.Tensor, k_scale: float | None, v_scale: float | None) -> None:
        self.kv_cache = cache
        if k_scale is not None and v_scale is not None:
            self.k_scale, self.v_scale, self.scales_known = float(k_scale), float(v_scale), True

    def _calibrate(self, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k_scale = max(float(k.abs().max()), 1e-6) * FP8_HEADROOM / FP8_MAX
        self.v_scale = max(float(v.abs().max()), 1e-6) * FP8_HEADROOM / FP8_MAX
        self.scales_known = True
        logger.info("fp8 KV scales of layer %d computed from the first prefill: k_scale=%.4g v_scale=%.4g",
                    self.layer_index, self.k_scale, self.v_scale)

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D] -> [T, Hq, D]."""
        cache = self.kv_cache
        if cache is None:
            raise RuntimeError("attention called before the KV cache was bound")
        if cache.dtype == torch.float8_e4m3fn and not self.scales_known:
            self._calibrate(k, v)
        if cache.is_cuda:
            from edgellm.kernels.kv_cache import write_kv_triton
            from edgellm.kernels.paged_attention import paged_attention_triton

            write_kv_triton(k, v, cache, meta.slot_mapping, self.k_scale, self.v_scale)
            return paged_attention_triton(
                q, k, v, cache, meta.block_tables, meta.seq_lens_tensor, meta.query_start_loc_tensor,
                meta.num_decodes, self.scale, self.sliding_window, self.k_scale, self.v_scale,
                max_query_len=meta.max_query_len, max_seq_len=meta.max_seq_len,
            )
        write_kv_ref(k, v, cache, meta.slot_mapping, self.k_scale, self.v_scale)
        return paged_attention_ref(
            q, k, v, cache, meta.block_tables, meta.seq_lens, meta.query_start_loc,
            meta.num_decodes, self.scale, self.sliding_window, self.k_scale, self.v_scale,
            step_cache=meta.step_cache, cpp_decode=self.cpp_decode, prefill_dtype=self.prefill_dtype,
        )
