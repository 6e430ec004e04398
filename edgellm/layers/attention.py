"""Attention over the paged KV cache: write this step's K/V, then attend.

The backend (edgellm/attention/: torch reference, CPU, Triton) is chosen once per load
(edgellm/layer_ops.py) and given at construction. All share the cache layout documented in
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

from edgellm.attention.base import AttentionBackend
from edgellm.attention.torch_ref import TorchRefAttention
from edgellm.batch import AttentionMetadata

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
        backend: AttentionBackend | None = None,
    ) -> None:
        """scale: of q.k before softmax; None: head_dim ** -0.5. backend: None, the torch
        reference."""
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
        self.backend = backend or TorchRefAttention()

    def bind_cache(self, cache: torch.Tensor, k_scale: float | None, v_scale: float | None) -> None:
        self.kv_cache = cache
        if k_scale is not None and v_scale is not None:
            self.k_scale, self.v_scale, self.scales_known = float(k_scale), float(v_scale), True

    def _calibrate(self, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k_scale = max(float(k.abs().max()), 1e-6) * FP8_HEADROOM / FP8_MAX
        self.v_scale = max(float(v.abs().max()), 1e-6) * FP8_HEADROOM / FP8_MAX
        self.scales_known = True
        logger.info(
            "fp8 KV scales of layer %d computed from the first prefill: k_scale=%.4g v_scale=%.4g",
            self.layer_index,
            self.k_scale,
            self.v_scale,
        )

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D] -> [T, Hq, D]."""
        cache = self.kv_cache
        if cache is None:
            raise RuntimeError("attention called before the KV cache was bound")
        if self.sliding_window is not None and meta.window is not None:
            meta = meta.window  # this layer's pages are the window pool's
        if cache.dtype == torch.float8_e4m3fn and not self.scales_known:
            self._calibrate(k, v)
        self.backend.write_kv(k, v, cache, meta, self.k_scale, self.v_scale)
        return self.backend.attend(
            q, k, v, cache, meta, self.scale, self.sliding_window, self.k_scale, self.v_scale
        )
