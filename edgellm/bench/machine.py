"""The machine a benchmark result was measured on, and its memory bandwidth.

`machine_info` is the one description every script writes next to its numbers: CPU model, its
instruction-set flags that matter for the kernels, cores, memory, GPU (when torch sees one),
versions, date, load average at the start, and the checkout's commit. `read_bandwidth` and
`bandwidth` probe memory bandwidth with large torch sums and copies.
"""

from __future__ import annotations

import datetime as dt
import math
import os
import platform
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
FLAGS = (
    "avx2",
    "fma",
    "f16c",
    "avx512f",
    "avx512bw",
    "avx512_vnni",
    "avx512_bf16",
    "amx_tile",
    "amx_int8",
    "amx_bf16",
    "avx_vnni",
    "asimd",
    "sve",
)


def _cpuinfo_field(name: str) -> str | None:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(name):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def cpu_name() -> str:
    """The CPU's model name (from /proc/cpuinfo on Linux, else what `platform` knows)."""
    return _cpuinfo_field("model name") or platform.processor() or platform.machine()


def cpu_flags() -> list[str]:
    """The CPU flags among FLAGS that /proc/cpuinfo lists (empty where it cannot be read)."""
    have = set((_cpuinfo_field("flags") or _cpuinfo_field("Features") or "").split())
    return [f for f in FLAGS if f in have]


def memory_gib() -> float:
    """Total memory in GiB (from /proc/meminfo; NaN where it cannot be read)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    return math.nan


def load_average() -> float:
    """The 1-minute load average (NaN where the OS has none)."""
    try:
        return round(os.getloadavg()[0], 2)
    except (AttributeError, OSError):
        return math.nan


def gpu() -> dict[str, Any] | None:
    """Name, memory (GiB) and compute capability of GPU 0, or None when torch sees no GPU."""
    import torch

    if not torch.cuda.is_available():
        return None
    props = torch.cuda.get_device_properties(0)
    return {
        "name": props.name,
        "memory_gib": round(props.total_memory / 2**30, 1),
        "capability": f"{props.major}.{props.minor}",
        "count": torch.cuda.device_count(),
    }


def commit() -> str | None:
    """The checkout's short commit, with +dirty when tracked files changed (None outside git)."""

    def git(*args: str) -> str:
        run = subprocess.run(
            ["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=10, check=False
        )
        return run.stdout.strip()

    try:
        rev = git("rev-parse", "--short", "HEAD")
        dirty = git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):
        return None
    return (rev + ("+dirty" if dirty else "")) or None


def machine_info(threads: int | None = None) -> dict[str, Any]:
    """The machine a result was measured on: cpu, cpu_flags, cores, memory_gib, gpu, threads
    (torch's when not given), torch/python/transformers versions, platform, date (UTC), load
    average at the start and edgellm_commit."""
    import torch

    info: dict[str, Any] = {
        "cpu": cpu_name(),
        "cpu_flags": cpu_flags(),
        "cores": os.cpu_count(),
        "memory_gib": memory_gib(),
        "gpu": gpu(),
        "threads": threads if threads is not None else torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "load_average_start": load_average(),
    }
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except ImportError:
        pass
    info["edgellm_commit"] = commit()
    return info


def describe(info: dict[str, Any]) -> str:
    """One line for a console report: CPU, cores, threads, torch, load average."""
    return (
        f"{info['cpu']}, {info['cores']} cores, torch {info['torch']}, {info['threads']} threads, "
        f"load average {info['load_average_start']:.1f} at start"
    )


def best_of(fn: Callable[[], Any], repeats: int, inner: int = 1) -> float:
    """Seconds per call of fn: the minimum over `repeats` rounds of `inner` calls, after one
    unmeasured call (the minimum, since the machine may be shared)."""
    fn()
    best = math.inf
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(inner):
            fn()
        best = min(best, (time.perf_counter() - t) / inner)
    return best


def bandwidth(repeats: int = 5, mbytes: int = 256, threads: int | None = None) -> dict[str, float]:
    """Memory bandwidth in GB/s over tensors of `mbytes` MiB (far beyond the caches):
    {"copy_GBps": read+write bytes of a copy, "read_GBps": bytes of a sum}, each the best of
    `repeats`."""
    import torch

    n = mbytes << 20
    a = torch.ones(n // 4)
    b = torch.empty_like(a)
    copy = best_of(lambda: b.copy_(a), repeats)
    a = b = None
    return {"copy_GBps": 2 * n / copy / 1e9, "read_GBps": read_bandwidth(threads, repeats, mbytes)}


def read_bandwidth(threads: int | None = None, repeats: int = 5, mbytes: int = 512) -> float:
    """Memory read bandwidth in GB/s: the best of `repeats` sums over `mbytes` MiB of fp32 on
    `threads` torch threads (torch's setting when not given)."""
    import torch

    if threads:
        torch.set_num_threads(threads)
    a = torch.ones((mbytes << 20) // 4)
    return (mbytes << 20) / best_of(a.sum, repeats) / 1e9
