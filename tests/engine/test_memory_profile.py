"""GPU memory sizing (vLLM's --gpu-memory-utilization): the budget arithmetic, and the profile
step itself run on CPU on a real tiny model (the CUDA measurement around it needs a GPU)."""

from __future__ import annotations

import pytest
import torch

from edgellm.config import EngineConfig
from edgellm.engine.kv_sizing import size_kv_cache
from edgellm.engine.memory_profile import DeviceMemory, kv_budget, profile_step
from edgellm.llm import LLM

GIB = 1 << 30


def test_budget_is_the_allowed_share_less_the_peak_and_memory_outside_torch():
    mem = DeviceMemory(total=80 * GIB, used=12 * GIB, torch_reserved=11 * GIB, torch_peak=9 * GIB)
    assert kv_budget(mem, 0.9) == int(0.9 * 80 * GIB) - 9 * GIB - 1 * GIB
    assert kv_budget(mem, 0.5) == 40 * GIB - 10 * GIB
    # torch holding more than the device reports used (rounding) is not negative memory
    assert kv_budget(DeviceMemory(80 * GIB, 5 * GIB, 6 * GIB, 9 * GIB), 0.9) == int(0.9 * 80 * GIB) - 9 * GIB


def test_nothing_left_and_bad_utilization_are_errors():
    with pytest.raises(ValueError, match="no GPU memory left .* raise gpu_memory_utilization"):
        kv_budget(DeviceMemory(16 * GIB, 14 * GIB, 13 * GIB, 13 * GIB), 0.8)
    for bad in (0.0, 1.5):
        with pytest.raises(ValueError, match="gpu_memory_utilization"):
            kv_budget(DeviceMemory(16 * GIB, 1, 1, 1), bad)
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        EngineConfig(gpu_memory_utilization=1.2)


def test_a_measured_budget_sizes_the_cache_unless_kv_cache_memory_is_given():
    cpu = torch.device("cpu")
    assert size_kv_cache(1000, EngineConfig(block_size=16), cpu, torch.float16, 64, 50_000)[0] == 50
    assert size_kv_cache(1000, EngineConfig(block_size=16, kv_cache_memory=7_000), cpu, torch.float16, 64,
                         50_000)[0] == 7


def test_profile_step_runs_the_largest_step_on_a_real_model(tiny_dir):
    src, _ = tiny_dir("gemma3")  # sliding and global layers, a window smaller than the step
    llm = LLM(str(src), kv_cache_memory=1 << 20, cpu_quant="exact")
    model = llm.engine.model
    assert profile_step(model, 16, torch.float32, torch.device("cpu"), 77, 5) == (5, model.config.vocab_size)
