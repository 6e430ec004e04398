"""Every EDGELLM_* environment variable the library reads, in one place, typed.

Each accessor reads the environment when it is called (at model load or start-up, never at
import and never per step), so a test or a launcher can set a variable before building an engine.
The CLI's flags win over these; these win over the built-in defaults.
"""

from __future__ import annotations

import os
from pathlib import Path

CPU_QUANT = "EDGELLM_CPU_QUANT"  # auto | exact | fast: kernels for quantized linears on CPU
CPU_ISA = "EDGELLM_CPU_ISA"  # avx2 | avx512 | amx: cap the instruction-set level used on CPU
CPU_NATIVE = "EDGELLM_CPU_NATIVE"  # cpp (default) | torch: the C++ CPU kernels or the torch paths
CPU_PACKED = "EDGELLM_CPU_PACKED"  # 0: keep bf16 copies in the plain layout (no oneDNN blocking)
CPU_DENSE_CACHE_MB = "EDGELLM_CPU_DENSE_CACHE_MB"  # budget of dense weight copies per model
CACHE = "EDGELLM_CACHE"  # build and conversion cache directory
API_KEY = "EDGELLM_API_KEY"  # the server's API key when --api-key is not given
LLAMA_SERVER = "EDGELLM_LLAMA_SERVER"  # the llama-server binary the benchmarks compare with
OUT = "OUT"  # the folder whose files a lent GPU machine hands back (benchmarks/gpu_check.py)
TRITON_ON_CPU = (
    "EDGELLM_TRITON_ON_CPU"  # 1 (with TRITON_INTERPRET=1): Triton kernels on CPU tensors
)


def _get(name: str) -> str | None:
    value = os.environ.get(name)
    return value.strip() if value is not None and value.strip() else None


def cpu_quant() -> str | None:
    value = _get(CPU_QUANT)
    return value.lower() if value else None


def cpu_isa() -> str | None:
    value = _get(CPU_ISA)
    return value.lower() if value else None


def cpu_native_enabled() -> bool:
    return (_get(CPU_NATIVE) or "cpp").lower() != "torch"


def cpu_packed_enabled() -> bool:
    return _get(CPU_PACKED) != "0"


def cpu_dense_cache_bytes() -> int:
    value = _get(CPU_DENSE_CACHE_MB) or "2048"
    try:
        mb = float(value)
    except ValueError:
        raise ValueError(f"{CPU_DENSE_CACHE_MB}={value!r}: a number of MiB expected") from None
    if mb < 0:
        raise ValueError(f"{CPU_DENSE_CACHE_MB}={value!r}: must be >= 0")
    return int(mb * (1 << 20))


def cache_dir() -> Path:
    value = _get(CACHE)
    return Path(value).expanduser() if value else Path.home() / ".cache" / "edgellm"


def api_key() -> str | None:
    return _get(API_KEY)


def triton_interpret() -> bool:
    return (_get("TRITON_INTERPRET") or "0").lower() in ("1", "true", "on", "yes")


def triton_on_cpu() -> bool:
    return triton_interpret() and _get(TRITON_ON_CPU) == "1"


def llama_server() -> str | None:
    return _get(LLAMA_SERVER)


def out_dir() -> Path | None:
    value = _get(OUT)
    return Path(value).expanduser() if value else None
