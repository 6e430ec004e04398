"""How many KV-cache blocks a load gets, and the max_model_len they allow.

The budget is `kv_cache_memory` bytes when given; else on CUDA what the memory profile leaves of
`gpu_memory_utilization` x the GPU (edgellm/engine/memory_profile.py); else
`kv_cache_memory_fraction` of the memory available now (MemAvailable on CPU, capped at 1 GiB: the
CPU cache is zeroed up front and a small model needs far less than a fraction of RAM).
"""

from __future__ import annotations

import logging

import torch

from edgellm.config import EngineConfig

logger = logging.getLogger(__name__)

CPU_DEFAULT_KV_CAP = 1 << 30


def available_memory(device: torch.device) -> int:
    """Bytes free for the cache on `device` now (4 GiB when the host does not say)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 4 << 30


def cache_budget(
    config: EngineConfig, device: torch.device, measured_budget: int | None = None
) -> int:
    """The cache's bytes: kv_cache_memory, else `measured_budget` (CUDA:
    edgellm/engine/memory_profile.py), else the fraction above."""
    if config.kv_cache_memory is not None:
        return config.kv_cache_memory
    if measured_budget is not None:
        return measured_budget
    budget = int(available_memory(device) * config.kv_cache_memory_fraction)
    if device.type == "cpu":
        budget = min(budget, CPU_DEFAULT_KV_CAP)
    return budget


def size_kv_cache(
    per_block: int,
    config: EngineConfig,
    device: torch.device,
    kv_dtype: torch.dtype,
    requested_len: int,
    measured_budget: int | None = None,
    reserved: int = 0,
) -> tuple[int, int]:
    """(num_blocks, max_model_len) for blocks of `per_block` bytes, from cache_budget() less
    `reserved` bytes (the sliding-window layers' own pool, engine/kv_layout.py). max_model_len is
    `requested_len`, capped (with a warning) by what the cache holds when the user did not ask for
    it; a ValueError when the budget holds no block, or less than an explicit max_model_len."""
    budget = cache_budget(config, device, measured_budget) - reserved
    num_blocks = max(budget, 0) // per_block
    capacity = num_blocks * config.block_size
    if num_blocks < 1:
        raise ValueError(
            f"KV cache budget of {budget} bytes holds no block ({per_block} bytes per "
            f"{config.block_size}-token block); raise kv_cache_memory"
        )
    if capacity < requested_len:
        if config.max_model_len:
            raise ValueError(
                f"max_model_len {config.max_model_len} needs {requested_len} KV tokens but the "
                f"cache budget ({budget} bytes) holds {capacity}; raise kv_cache_memory or lower "
                "max_model_len"
            )
        logger.warning(
            "max_model_len capped from %d to %d by the KV cache budget", requested_len, capacity
        )
        requested_len = capacity
    logger.info(
        "KV cache: %d blocks x %d tokens = %d tokens (%.1f MiB, %s); max_model_len %d",
        num_blocks,
        config.block_size,
        capacity,
        num_blocks * per_block / 2**20,
        str(kv_dtype).replace("torch.", ""),
        requested_len,
    )
    return num_blocks, requested_len
