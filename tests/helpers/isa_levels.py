"""The CPU kernels' ISA levels this host can run (edgellm/cpu_isa.py: each level's build holds no
instruction above it), for tests that check every level."""

from __future__ import annotations

from edgellm.cpu_isa import LEVELS, CpuIsa, detect
from edgellm.kernels import cpu_native

HOST = detect().host_level
ISA_LEVELS = [lvl for lvl in LEVELS[1:] if LEVELS.index(lvl) <= LEVELS.index(HOST)]


def vector_native():
    """The C++ module, for kernels built only with vector units (AVX2 and up); skips on a CPU
    without AVX2 (a hardware limit)."""
    import pytest

    module = cpu_native.load()
    assert module is not None, "the C++ CPU kernels did not build (g++ and torch headers needed)"
    if module.n16_variant() == "scalar":
        pytest.skip("this CPU has no AVX2: the causal prefill kernel is built only with vector units")
    return module


def native_at(level: str):
    """The C++ module built for `level` (asserting that it built)."""
    module = cpu_native.load(CpuIsa(level, detect()))
    assert module is not None, f"the C++ kernels did not build at level {level}"
    return module
