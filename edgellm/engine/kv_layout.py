"""The KV cache's pools: one for every layer, or a global pool plus the sliding-window layers' own.

A model whose layers all attend globally (or all through a window) gets one pool of pages over
every layer (engine/block_manager.py). A model that mixes the two (Gemma 3: five sliding layers to
one global; EXAONE 4: three to one) gets two (engine/window_blocks.py): the global layers' pages
hold the whole context, the sliding layers' pages only what the window reaches.

Sizing the window pool: between steps a running sequence holds at most ceil((W - 1) / bs) + 1
window pages (those the next query's window reaches), and a step's chunk of n tokens adds at most
ceil(n / bs) + 1 more, so the live sequences never hold more than
max_num_seqs * (ceil((W - 1) / bs) + 2) + ceil(max_num_batched_tokens / bs) pages. The pool gets
that many, or as many as one shared pool would have had if that is fewer, and the rest of the
budget goes to the global layers' pages: with a long context the cache then holds far more tokens
than one pool over every layer would.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from edgellm.config import EngineConfig
from edgellm.engine.block_manager import BlockManager
from edgellm.engine.kv_sizing import cache_budget, size_kv_cache
from edgellm.engine.runner import kv_cache_bytes_per_block
from edgellm.engine.window_blocks import HybridBlockManager
from edgellm.models.decoder import CausalLM

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class KVLayout:
    num_blocks: int  # pages of the global layers (of every layer with one pool)
    max_model_len: int
    window: int | None = None  # the sliding layers' widest window, when they have their own pool
    num_window_blocks: int | None = None  # that pool's pages


def separate_window(model: CausalLM) -> tuple[int, int] | None:
    """(widest window, number of sliding layers) when the model mixes sliding-window and global
    layers; None when one pool serves every layer."""
    windows = model.config.sliding_windows
    sliding = [w for w in windows if w is not None]
    if not sliding or len(sliding) == len(windows):
        return None
    return max(sliding), len(sliding)


def window_pool_cap(config: EngineConfig, window: int) -> int:
    """The most window pages live sequences can hold at once (the module docstring)."""
    bs = config.block_size
    per_seq = -(-(window - 1) // bs) + 2
    return config.max_num_seqs * per_seq + -(-config.max_num_batched_tokens // bs)


def plan_kv_cache(
    model: CausalLM,
    config: EngineConfig,
    device: torch.device,
    kv_dtype: torch.dtype,
    requested_len: int,
    measured_budget: int | None = None,
) -> KVLayout:
    """The pools' sizes and the max_model_len they allow (engine/kv_sizing.py's rules)."""
    bs = config.block_size
    per_all = kv_cache_bytes_per_block(model, bs, kv_dtype)
    split = separate_window(model)
    budget = cache_budget(config, device, measured_budget)
    # the budget read once (MemAvailable moves), handed on as the one size_kv_cache uses
    if split is None or budget < per_all:  # one pool (a budget short of a block errors there)
        num_blocks, max_len = size_kv_cache(
            per_all, config, device, kv_dtype, requested_len, budget
        )
        return KVLayout(num_blocks, max_len)
    window, num_sliding = split
    per_window = kv_cache_bytes_per_block(model, bs, kv_dtype, num_sliding)
    per_global = per_all - per_window
    num_window = min(budget // per_all, window_pool_cap(config, window))
    num_blocks, max_len = size_kv_cache(
        per_global,
        config,
        device,
        kv_dtype,
        requested_len,
        budget,
        num_window * per_window,
    )
    logger.info(
        "KV cache: %d sliding-window layers (window %d) keep %d blocks of their own (%.1f MiB); "
        "the %d global layers' blocks above hold %d tokens (one pool over every layer: %d)",
        num_sliding,
        window,
        num_window,
        num_window * per_window / 2**20,
        model.config.num_layers - num_sliding,
        num_blocks * bs,
        budget // per_all * bs,
    )
    return KVLayout(num_blocks, max_len, window, num_window)


def make_block_manager(layout: KVLayout, config: EngineConfig, record_events: bool) -> BlockManager:
    """The block manager for these pools."""
    if layout.window is None or layout.num_window_blocks is None:
        return BlockManager(
            layout.num_blocks, config.block_size, config.enable_prefix_caching, record_events
        )
    return HybridBlockManager(
        layout.num_blocks,
        layout.num_window_blocks,
        config.block_size,
        layout.window,
        config.enable_prefix_caching,
        record_events,
    )
