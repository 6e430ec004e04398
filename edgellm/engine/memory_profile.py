"""GPU memory sizing like vLLM's --gpu-memory-utilization: measure the peak of the largest step
the scheduler can plan, and give the KV cache what is left of the allowed share of the GPU.

    budget = gpu_memory_utilization * total
             - peak bytes torch allocated in the profile step (weights included)
             - memory used outside torch's allocator (CUDA context, cuBLAS workspaces)

The profile step is a prefill of max_num_batched_tokens dummy tokens in one sequence over a
cache just large enough for it, plus the logits of max_num_seqs rows (what sampling a full decode
step holds at once). It runs through the same ModelRunner as real steps, so it compiles the
Triton kernels of the prefill path on the way.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from edgellm.config import EngineConfig
from edgellm.engine.runner import ModelRunner
from edgellm.engine.scheduler import ScheduledSeq, SchedulerOutput
from edgellm.engine.sequence import Sequence
from edgellm.models.decoder import CausalLM
from edgellm.sampling import SamplingParams

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DeviceMemory:
    """What the device said around the profile step (bytes)."""

    total: int
    used: int  # total - free, after the step (all processes' view of this one's use included)
    torch_reserved: int  # what torch's caching allocator holds
    torch_peak: int  # the most torch had allocated at once during the step


def kv_budget(mem: DeviceMemory, utilization: float) -> int:
    """Bytes for the KV cache: the allowed share of the device less the step's peak and the
    memory outside torch. A ValueError when nothing is left, naming what to change."""
    if not 0.0 < utilization <= 1.0:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {utilization}")
    outside_torch = max(mem.used - mem.torch_reserved, 0)
    budget = int(utilization * mem.total) - mem.torch_peak - outside_torch
    if budget <= 0:
        raise ValueError(
            f"no GPU memory left for the KV cache: {utilization:.2f} x {mem.total / 2**30:.1f} GiB "
            f"allowed, the largest step peaks at {mem.torch_peak / 2**30:.2f} GiB and "
            f"{outside_torch / 2**30:.2f} GiB are used outside torch; raise "
            "gpu_memory_utilization or lower max_num_batched_tokens"
        )
    return budget


@torch.inference_mode()
def profile_step(
    model: CausalLM,
    block_size: int,
    kv_dtype: torch.dtype,
    device: torch.device,
    num_tokens: int,
    num_logit_rows: int,
) -> tuple[int, ...]:
    """Run the largest step once (see the module docstring) and drop what it allocated; returns
    the logits' shape. The model's attention layers are left bound to the step's small cache: the
    engine's runner binds its own after this."""
    blocks = -(-num_tokens // block_size)
    runner = ModelRunner(model, blocks, block_size, kv_dtype, device)
    seq = Sequence("memory-profile", [0] * num_tokens, SamplingParams(max_tokens=1), [], 0)
    seq.block_table = list(range(blocks))
    batch, _ = runner.build_batch(SchedulerOutput([ScheduledSeq(seq, num_tokens)]))
    hidden = model(batch)
    rows = hidden[-1:].expand(num_logit_rows, -1).contiguous()
    shape = tuple(model.compute_logits(rows, [False] * num_logit_rows, None).shape)
    del runner, hidden, rows
    return shape


def measure(device: torch.device, step: Callable[[], object]) -> DeviceMemory:
    """What the device says around `step()` (a profile_step with its arguments bound), run on a
    CUDA device with the allocator's peak reset before it."""
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    step()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    mem = DeviceMemory(total, total - free, torch.cuda.memory_reserved(device), peak)
    logger.info(
        "memory profile: the largest step peaks at %.2f GiB (weights included); %.2f GiB used "
        "outside torch; %.1f GiB in all",
        peak / 2**30,
        max(mem.used - mem.torch_reserved, 0) / 2**30,
        total / 2**30,
    )
    return mem


def measured_kv_budget(
    model: CausalLM,
    config: EngineConfig,
    device: torch.device,
    kv_dtype: torch.dtype,
    requested_len: int,
) -> int | None:
    """The KV budget from a profile of the largest step, on CUDA when the config gives no
    kv_cache_memory; None otherwise (the cache is then sized from the config alone)."""
    if device.type != "cuda" or config.kv_cache_memory is not None:
        return None
    mem = measure(
        device,
        lambda: profile_step(
            model,
            config.block_size,
            kv_dtype,
            device,
            min(config.max_num_batched_tokens, requested_len),
            config.max_num_seqs,
        ),
    )
    return kv_budget(mem, config.gpu_memory_utilization)
