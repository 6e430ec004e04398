"""What this x86 CPU can run, detected once, and the instruction-set level the CPU kernels use.

Levels, each a superset of the one before:
- "none": no AVX2 (or not x86): the torch paths only.
- "avx2": AVX2 + FMA + F16C (x86-64-v3: Haswell, every AMD Zen). Integer dot products with
  vpmaddubsw / vpmaddwd, or AVX-VNNI's 256-bit vpdpbusd where the CPU has it (Intel client cores
  since Alder Lake, Zen 5); no bf16 units, so no bf16 matmuls.
- "avx512": AVX-512 F/BW/DQ/VL (x86-64-v4: Skylake-SP, Zen 4). VNNI (vpdpbusd) and the bf16
  dot (AVX512-BF16) are extras of this level where the CPU has them.
- "amx": AVX-512 plus AMX tiles with int8 and bf16 (Sapphire Rapids and later).

EDGELLM_CPU_ISA caps the level (e.g. avx2 on an AMX Xeon, so that every level's kernels can be
tested on one machine); naming a level the CPU lacks is an error. The C++ kernels are compiled
for the chosen level (compile_flags), never with -march=native, so a capped build holds no
instruction of a higher level.
"""

from __future__ import annotations

import functools
import logging
import platform
from dataclasses import dataclass

from edgellm import env

logger = logging.getLogger(__name__)

LEVELS = ("none", "avx2", "avx512", "amx")
_AVX2 = ("avx2", "fma", "f16c")
_AVX512 = ("avx512f", "avx512bw", "avx512dq", "avx512vl")
_AMX = ("amx_tile", "amx_int8", "amx_bf16")


@dataclass(frozen=True)
class CpuFeatures:
    """The host's ISA extensions (Linux /proc/cpuinfo names) and its model name."""

    flags: frozenset[str]
    model: str = ""

    def has(self, *names: str) -> bool:
        return all(n in self.flags for n in names)

    @property
    def host_level(self) -> str:
        if not self.has(*_AVX2):
            return "none"
        if not self.has(*_AVX512):
            return "avx2"
        return "amx" if self.has(*_AMX) else "avx512"


@dataclass(frozen=True)
class CpuIsa:
    """The level the CPU kernels run at, and what that level may use on this host."""

    level: str
    features: CpuFeatures

    @property
    def vnni_bits(self) -> int:
        """The width of vpdpbusd at this level: 512 (AVX-512 VNNI), 256 (AVX-VNNI), else 0."""
        if self.level in ("avx512", "amx") and self.features.has("avx512_vnni"):
            return 512
        if self.level != "none" and self.features.has("avx_vnni"):
            return 256
        return 0

    @property
    def vnni(self) -> bool:
        """vpdpbusd at some width."""
        return self.vnni_bits > 0

    @property
    def n16(self) -> bool:
        """The quantized linears and the int8 logits head take the 16-row interleaved layout
        (qgemm_n16.h): at every level with AVX2, by vpdpbusd where the CPU has VNNI, else by
        vpmaddubsw (per 32-column block the same vpmaddubsw count as the row layout, without its
        per-block conversions and horizontal sums; measured against it by
        benchmarks/cpu_int_dot.py, results in benchmarks/results/cpu_int_dot_*.json)."""
        return self.level != "none"

    @property
    def bf16_units(self) -> bool:
        """bf16 matmuls at a useful speed (AMX, or the AVX512-BF16 dot); without them a bf16
        matmul is emulated, far slower than fp32."""
        return self.level == "amx" or (self.level == "avx512" and self.features.has("avx512_bf16"))

    def compile_flags(self) -> list[str]:
        """g++ flags for this level: the x86-64 micro-architecture level plus the extras the host
        has within the level; tuned for the host."""
        if self.level == "none":
            return ["-O3"]
        flags = ["-O3", "-mtune=native"] + (["-mavxvnni"] if self.vnni_bits == 256 else [])
        if self.level == "avx2":
            return flags + ["-march=x86-64-v3"]
        flags.append("-march=x86-64-v4")
        for feature, flag in (("avx512_vnni", "-mavx512vnni"), ("avx512_bf16", "-mavx512bf16")):
            if self.features.has(feature):
                flags.append(flag)
        if self.level == "amx":
            flags += ["-mamx-tile", "-mamx-int8", "-mamx-bf16"]
        return flags

    def describe(self) -> str:
        vnni = {512: "vnni", 256: "avx-vnni"}.get(self.vnni_bits, "")
        extras = [name for name, on in ((vnni, self.vnni), ("bf16 units", self.bf16_units)) if on]
        capped = (
            ""
            if self.level == self.features.host_level
            else f" (capped from {self.features.host_level})"
        )
        return f"{self.level}{capped}" + (f" + {', '.join(extras)}" if extras else "")


def _read_cpuinfo() -> tuple[frozenset[str], str]:
    flags: set[str] = set()
    model = ""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "flags" and not flags:
                    flags = set(value.split())
                elif key == "model name" and not model:
                    model = value.strip()
                if flags and model:
                    break
    except OSError:
        pass
    return frozenset(flags), model


def _torch_flags() -> frozenset[str]:
    """Where /proc/cpuinfo is not readable: what torch's own dispatch detected."""
    try:
        import torch

        capability = torch.backends.cpu.get_cpu_capability()
    except (ImportError, AttributeError, RuntimeError):
        return frozenset()
    if capability.startswith("AVX512"):
        return frozenset(_AVX2 + _AVX512)
    return frozenset(_AVX2) if capability == "AVX2" else frozenset()


@functools.lru_cache(maxsize=1)
def detect() -> CpuFeatures:
    """The host's features (read once per process)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return CpuFeatures(frozenset(), platform.machine())
    flags, model = _read_cpuinfo()
    return CpuFeatures(flags or _torch_flags(), model)


def select(requested: str | None = None, features: CpuFeatures | None = None) -> CpuIsa:
    """The level to run at: `requested` (else $EDGELLM_CPU_ISA, else the host's own). A level
    above the host's is a ValueError that says what the CPU has."""
    features = features or detect()
    host = features.host_level
    name = (requested or env.cpu_isa() or host).lower()
    if name not in LEVELS:
        raise ValueError(f"{env.CPU_ISA}={name!r}: choose one of {', '.join(LEVELS[1:])}")
    if LEVELS.index(name) > LEVELS.index(host):
        raise ValueError(
            f"{env.CPU_ISA}={name}: this CPU ({features.model or 'unknown'}) supports up to "
            f"{host}; "
            f"choose one of {', '.join(LEVELS[: LEVELS.index(host) + 1][1:]) or 'none'}"
        )
    return CpuIsa(name, features)
