"""An engine's figures for /metrics: its KV cache's configuration (fixed once built) as vLLM's
cache_config_info labels, and its gauges and counters now (requests running and waiting, KV
blocks held, prefix-cache lookups and hits, preemptions, steps)."""

from __future__ import annotations

from edgellm.config import EngineConfig
from edgellm.engine.block_manager import BlockManager
from edgellm.engine.scheduler import Scheduler


def kv_cache_info(config: EngineConfig, block_manager: BlockManager) -> dict[str, str]:
    """The KV cache's configuration as vLLM's cache_config_info labels (values are str())."""
    return {
        "block_size": str(config.block_size),
        "cache_dtype": config.kv_cache_dtype,
        "enable_prefix_caching": str(bool(config.enable_prefix_caching)),
        "num_gpu_blocks": str(block_manager.num_blocks),
    }


def engine_stats(scheduler: Scheduler, bm: BlockManager, num_steps: int) -> dict[str, float]:
    return {
        "num_running": len(scheduler.running),
        "num_waiting": len(scheduler.waiting),
        "kv_blocks_total": bm.num_blocks,
        "kv_blocks_held": bm.num_held_blocks,
        "kv_usage": bm.num_held_blocks / bm.num_blocks,
        "prefix_cache_queries": bm.prefix_queries,
        "prefix_cache_hits": bm.prefix_hits,
        "num_preemptions": scheduler.num_preemptions,
        "num_steps": num_steps,
    }
