"""CPU feature detection, the ISA level cap (EDGELLM_CPU_ISA) and the Platform's mode choice."""

from __future__ import annotations

import logging

import pytest

from edgellm import env
from edgellm.config import EngineConfig
from edgellm.cpu_isa import LEVELS, CpuFeatures, CpuIsa, detect, select
from edgellm.platform import Platform, resolve_cpu_quant

ZEN3 = CpuFeatures(frozenset("sse4_2 avx avx2 fma f16c bmi2".split()), "AMD EPYC")
ZEN4 = CpuFeatures(ZEN3.flags | frozenset("avx512f avx512bw avx512dq avx512vl avx512_vnni avx512_bf16".split()),
                   "AMD EPYC 9004")
SPR = CpuFeatures(ZEN4.flags | frozenset("amx_tile amx_int8 amx_bf16 avx_vnni".split()), "Intel Xeon")
ALDER_LAKE = CpuFeatures(ZEN3.flags | {"avx_vnni"}, "Intel Core i7-12700")
OLD = CpuFeatures(frozenset("sse4_2 avx".split()), "old")


def test_host_levels():
    assert [f.host_level for f in (OLD, ZEN3, ZEN4, SPR)] == ["none", "avx2", "avx512", "amx"]
    assert detect().host_level in LEVELS


def test_capabilities_per_level():
    assert not CpuIsa("avx2", ZEN3).vnni and not CpuIsa("avx2", SPR).bf16_units
    # AVX-VNNI: 256-bit vpdpbusd at level avx2 (client cores, or an AVX-512 CPU capped to avx2)
    assert CpuIsa("avx2", ALDER_LAKE).vnni_bits == 256 and CpuIsa("avx2", SPR).vnni_bits == 256
    assert CpuIsa("avx512", SPR).vnni_bits == 512 and CpuIsa("amx", SPR).vnni_bits == 512
    assert CpuIsa("avx2", ALDER_LAKE).describe() == "avx2 + avx-vnni"
    assert CpuIsa("avx512", ZEN4).vnni and CpuIsa("avx512", ZEN4).bf16_units
    assert CpuIsa("amx", SPR).bf16_units
    assert not CpuIsa("avx512", CpuFeatures(ZEN4.flags - {"avx512_bf16", "avx512_vnni"})).bf16_units


def test_compile_flags_hold_nothing_above_the_level():
    avx2 = CpuIsa("avx2", SPR).compile_flags()
    assert "-march=x86-64-v3" in avx2 and not any("avx512" in f or "amx" in f or f == "-march=native" for f in avx2)
    assert "-mavxvnni" in avx2 and "-mavxvnni" not in CpuIsa("avx2", ZEN3).compile_flags()
    avx512 = CpuIsa("avx512", SPR).compile_flags()
    assert "-march=x86-64-v4" in avx512 and "-mavx512vnni" in avx512 and not any("amx" in f for f in avx512)
    assert {"-mamx-tile", "-mamx-int8"} <= set(CpuIsa("amx", SPR).compile_flags())
    assert "-mavx512bf16" not in CpuIsa("avx512", CpuFeatures(ZEN4.flags - {"avx512_bf16"})).compile_flags()


def test_select_caps_and_refuses_levels_the_cpu_lacks(monkeypatch):
    monkeypatch.delenv(env.CPU_ISA, raising=False)  # the suite may run capped (EDGELLM_CPU_ISA=avx2)
    assert select("avx2", SPR).level == "avx2"
    assert select(None, SPR).level == "amx"
    monkeypatch.setenv(env.CPU_ISA, "avx512")
    assert select(None, SPR).level == "avx512"
    with pytest.raises(ValueError, match="supports up to avx2"):
        select(None, ZEN3)
    with pytest.raises(ValueError, match="choose one of"):
        select("sse9", SPR)


def test_cpu_quant_default_and_override(monkeypatch):
    monkeypatch.delenv(env.CPU_QUANT, raising=False)
    assert resolve_cpu_quant(None) == "auto"
    monkeypatch.setenv(env.CPU_QUANT, "exact")
    assert resolve_cpu_quant(None) == "exact" and resolve_cpu_quant("fast") == "fast"
    monkeypatch.setenv(env.CPU_QUANT, "quick")
    with pytest.raises(ValueError, match=env.CPU_QUANT):
        resolve_cpu_quant(None)
    with pytest.raises(ValueError, match="cpu_quant"):
        EngineConfig(cpu_quant="quick")
    with pytest.raises(ValueError, match="cpu_isa"):
        EngineConfig(cpu_isa="avx9")


def test_platform_without_avx2_runs_exact_with_one_warning(caplog):
    with caplog.at_level(logging.WARNING):
        platform = Platform("auto", CpuIsa("none", OLD))
    assert platform.cpu_quant == "exact" and not platform.int_dot and platform.native() is None
    assert sum("no AVX2" in r.getMessage() for r in caplog.records) == 1


def test_fast_mode_warns_without_bf16_units(caplog):
    with caplog.at_level(logging.WARNING):
        Platform("fast", CpuIsa("avx2", ZEN3))
    assert any("no bf16 units" in r.getMessage() for r in caplog.records)


def test_dense_budget_is_per_platform():
    a, b = Platform("auto", CpuIsa("avx2", ZEN3), dense_budget=100), Platform("auto", CpuIsa("avx2", ZEN3),
                                                                           dense_budget=100)
    assert a.reserve_dense(60) and not a.reserve_dense(60)
    assert b.reserve_dense(60)  # another load's budget is its own
