"""KV-cache sizing: blocks from the budget, max_model_len capped or refused, clear errors."""

from __future__ import annotations

import logging

import pytest
import torch

from edgellm.config import EngineConfig
from edgellm.engine.kv_sizing import CPU_DEFAULT_KV_CAP, available_memory, size_kv_cache

CPU = torch.device("cpu")


def test_blocks_from_an_explicit_budget():
    cfg = EngineConfig(kv_cache_memory=10_000, block_size=16)
    assert size_kv_cache(1000, cfg, CPU, torch.float32, 100) == (10, 100)


def test_max_model_len_capped_unless_asked_for(caplog):
    with caplog.at_level(logging.WARNING):
        assert size_kv_cache(1000, EngineConfig(kv_cache_memory=5_000, block_size=16), CPU, torch.float32,
                             4096) == (5, 80)
    assert "capped from 4096 to 80" in caplog.text
    with pytest.raises(ValueError, match="max_model_len 4096 needs 4096 KV tokens .* holds 80"):
        size_kv_cache(1000, EngineConfig(kv_cache_memory=5_000, block_size=16, max_model_len=4096), CPU,
                      torch.float32, 4096)


def test_a_budget_below_one_block_is_an_error():
    with pytest.raises(ValueError, match="holds no block .* raise kv_cache_memory"):
        size_kv_cache(1000, EngineConfig(kv_cache_memory=999, block_size=16), CPU, torch.float32, 64)


def test_cpu_default_budget_is_a_fraction_of_available_memory_capped():
    cfg = EngineConfig(block_size=16)
    per_block = 1 << 20
    blocks, _ = size_kv_cache(per_block, cfg, CPU, torch.float32, 64)
    want = min(int(available_memory(CPU) * cfg.kv_cache_memory_fraction), CPU_DEFAULT_KV_CAP) // per_block
    assert 0 < blocks <= CPU_DEFAULT_KV_CAP // per_block and abs(blocks - want) <= 64  # memory moves a little
