"""The per-step data handed from the runner to the model: explicit, no globals."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class AttentionMetadata:
    """Where this step's tokens sit in the paged KV cache.

    Sequences are ordered decodes first (one query token each), then prefill
    chunks. seq_lens are context lengths after this step's tokens.
    """

    slot_mapping: torch.Tensor  # [T] int64: block * block_size + offset
    block_tables: torch.Tensor  # [B, max_blocks] int32, padded with 0
    seq_lens: list[int]  # [B]
    query_start_loc: list[int]  # [B + 1]
    num_decodes: int
    seq_lens_tensor: torch.Tensor  # [B] int32 (for kernels)
    query_start_loc_tensor: torch.Tensor  # [B + 1] int32 (for kernels)
    max_query_len: int = 1  # host-side maxima, so kernels need no device sync to size their grid
    max_seq_len: int = 1
    # what every layer's attention would otherwise rebuild (masks, gather indices), filled by the
    # first layer that needs it
    step_cache: dict = field(default_factory=dict)
    # the sliding-window layers' own view (slots and tables in their pool, engine/window_blocks.py)
    # when the model keeps them apart; None: every layer reads the fields above
    window: AttentionMetadata | None = None


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    attn: AttentionMetadata
    logits_indices: torch.Tensor  # [N] rows of the hidden states to project to logits
    seq_total_lens: torch.Tensor | None = (
        None  # [T] tokens known to each token's sequence (longrope)
    )
