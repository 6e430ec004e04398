"""The interface every attention backend implements.

A backend writes a step's K/V into the paged cache and attends over it (the cache layout and the
step's flattening: edgellm/kernels/paged_attention.py). The layer (edgellm/layers/attention.py)
owns the per-layer state (scales, window, the bound cache); the backend owns how the math runs.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from edgellm.batch import AttentionMetadata


class AttentionBackend(ABC):
    name = "base"

    @abstractmethod
    def write_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        cache: torch.Tensor,
        meta: AttentionMetadata,
        k_scale: float,
        v_scale: float,
    ) -> None:
        """Store key / value [T, Hkv, D] at meta.slot_mapping (fp8 caches: divided by the
        scales)."""

    @abstractmethod
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
        """query [T, Hq, D] (key / value: this step's, already written) -> [T, Hq, D]:
        softmax(q k^T * scale) v over each sequence's context, causal, within the window."""
