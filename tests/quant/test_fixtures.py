"""The community tools' own checkpoints (../shared/fixtures) load and reproduce the tools' logits.

Tolerances (logits are about 1.3 in magnitude; see the fixtures' README):
- weight-only formats: the tools computed the reference in fp16, edgellm runs fp32 with
  the exact weights. edgellm's own fp16 and fp32 runs differ by 1.2e-3 on these
  fixtures, and an independent dequantizer agreed with the tools to 0..1e-3, so max
  |diff| < 3e-3 (a wrong group, zero or nibble order moves logits by > 1e-1). My own
  tiny checkpoints (test_quant_formats.py) match transformers on the dequantized
  weights bit for bit.
- W8A8 (int8, fp8): rounding activations to 8 bits turns tiny compute differences
  into whole quantization steps. edgellm's own fp32 and fp16 runs differ by 2.3e-2
  (int8) and 5.8e-2 (fp8), and so do edgellm and the tools; the exact check is
  against an independent fp32 implementation (transformers + the format's fake
  quantization): fp8 agrees bit for bit, int8 to 1e-6 except where a last-bit
  difference flips one activation's rounding (int32 vs fp32 accumulation).
- the fast CPU path (int4 GEMV with bf16 activations and scales) stays within 2e-2.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from edgellm import LLM
from tests.helpers.fixture_paths import FIXTURES, MISSING

pytestmark = pytest.mark.skipif(not (FIXTURES / "README.md").is_file(), reason=MISSING)

INT4 = ["autoawq_gemm_w4g128", "gptqmodel_gptq_w4g128_sym", "llmcompressor_w4a16_gptq"]
WEIGHT_ONLY = INT4 + ["bitsandbytes_nf4_dq"]
W8A8 = ["llmcompressor_w8a8_int8", "llmcompressor_fp8_dynamic"]


def _reference(name: str) -> tuple[list[list[int]], torch.Tensor]:
    ref = load_file(FIXTURES / name / "reference.safetensors")
    return ref["input_ids"].tolist(), ref["logits"]


def _run(name: str, **kwargs) -> tuple[torch.Tensor, set[str]]:
    llm = LLM(str(FIXTURES / name), kv_cache_memory=4 << 20, **kwargs)
    ids, _ = _reference(name)
    kernels = {type(m.kernel).__name__ for m in llm.engine.model.modules() if hasattr(m, "kernel")}
    return torch.stack(llm.prompt_logits(ids)), kernels


@pytest.mark.parametrize("name", WEIGHT_ONLY)
def test_weight_only_fixture_matches_the_tool(name):
    got, kernels = _run(name, cpu_quant="exact")
    _, want = _reference(name)
    diff = (got - want).abs()
    assert kernels == {"DenseKernel"}
    assert diff.max().item() < 3e-3, diff.max().item()
    assert diff.mean().item() < 5e-4
    assert torch.equal(got.argmax(-1), want.argmax(-1))


@pytest.mark.parametrize("name", INT4)
def test_int4_fixture_on_the_fast_cpu_path(name, monkeypatch):
    monkeypatch.setenv("EDGELLM_CPU_QUANT", "fast")
    got, kernels = _run(name, max_num_batched_tokens=8)  # 8-row steps: the int4 GEMV runs
    _, want = _reference(name)
    assert kernels == {"CpuInt4Kernel"}
    diff = (got - want).abs().max().item()
    assert 3e-3 < diff < 2e-2  # bf16 activations: visibly not the exact path, but close
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() > 0.95


@pytest.mark.parametrize("name", INT4)
def test_int4_fixture_on_the_auto_cpu_path(name):
    """The default mode: int4 codes kept, integer dots over int8 activations in every step size
    calibration leaves them (edgellm/kernels/csrc/cpu/qgemm.cpp); only the activations' rounding differs."""
    # capped at avx2: fp32 prompt attention on every CPU (bf16 where the CPU has bf16 units)
    llm = LLM(str(FIXTURES / name), kv_cache_memory=4 << 20, cpu_quant="auto", cpu_isa="avx2")
    ids, want = _reference(name)
    kernels = [m.kernel for m in llm.engine.model.modules() if hasattr(m, "kernel")]
    assert {type(k).__name__ for k in kernels} == {"CpuIntDotKernel"}
    for k in kernels:  # integer dots at every step size (calibration may pick dense for large ones)
        k.max_rows = 1 << 62
    got = torch.stack(llm.prompt_logits(ids))
    diff = (got - want).abs().max().item()
    assert 0 < diff < 2e-2  # int8 activations per 32 columns: close, but not the exact path
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() > 0.95


def _fake_quant(kind: str):
    """The format's activation quantization, written from the compressed-tensors definition."""
    def hook(module, args):
        (x,) = args
        if kind == "int8":  # symmetric int8: scale = absmax / ((127 - -128) / 2)
            s = x.abs().amax(-1, keepdim=True) / 127.5
            return (torch.clamp(torch.round(x / s), -128, 127) * s,)
        s = x.abs().amax(-1, keepdim=True) / 448.0  # float8_e4m3fn: max 448
        return ((x / s).clamp(-448, 448).to(torch.float8_e4m3fn).float() * s,)
    return hook


@pytest.fixture(scope="module")
def independent_w8a8():
    """transformers' Llama with the fixture's weights dequantized by the README's formula,
    activations fake-quantized per token: an independent fp32 implementation."""
    from transformers import LlamaConfig, LlamaForCausalLM

    def build(name: str) -> torch.nn.Module:
        cfg = json.loads((FIXTURES / name / "config.json").read_text())
        cfg.pop("quantization_config")
        model = LlamaForCausalLM(LlamaConfig(**cfg)).float().eval()
        tensors = load_file(FIXTURES / name / "model.safetensors")
        state = {}
        for key, t in tensors.items():
            if key.endswith(".weight_scale"):
                continue
            if f"{key}_scale" in tensors:  # W = q * s per output channel
                t = t.float() * tensors[f"{key}_scale"].float()
            state[key] = t.float()
        model.load_state_dict(state, strict=True)
        kind = "int8" if "int8" in name else "fp8"
        for mname, module in model.named_modules():
            if isinstance(module, torch.nn.Linear) and mname != "lm_head":
                module.register_forward_pre_hook(_fake_quant(kind))
        return model

    return build


@pytest.mark.parametrize("name", W8A8)
def test_w8a8_fixture_matches_independent_fake_quant(name, independent_w8a8):
    got, kernels = _run(name, cpu_quant="exact")
    ids, _ = _reference(name)
    with torch.no_grad():
        want = independent_w8a8(name)(torch.tensor(ids)).logits
    per_position = (got - want).abs().amax(-1)
    if "int8" in name:
        # int8: edgellm accumulates in int32 (torch._int_mm), the reference in fp32 on
        # dequantized values; last-bit differences flip a rounding tie now and then
        assert kernels == {"Int8W8A8Kernel"}
        assert (per_position < 1e-5).float().mean() > 0.75
        assert per_position.max().item() < 2e-2
    else:
        assert kernels == {"FP8Kernel"}
        assert per_position.max().item() < 1e-5


@pytest.mark.parametrize("name,tol", [("llmcompressor_w8a8_int8", 4e-2), ("llmcompressor_fp8_dynamic", 1e-1)])
def test_w8a8_fixture_close_to_the_tool(name, tol):
    got, _ = _run(name, cpu_quant="exact")
    _, want = _reference(name)
    diff = (got - want).abs()
    assert diff.max().item() < tol, diff.max().item()
    assert diff.mean().item() < tol / 4
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() > 0.97


def test_fixtures_are_left_untouched(tmp_path):
    """Loading reads only: nothing is written beside a read-only fixture."""
    before = {p: p.stat().st_mtime_ns for p in FIXTURES.rglob("*")}
    _run("autoawq_gemm_w4g128")
    assert {p: p.stat().st_mtime_ns for p in FIXTURES.rglob("*")} == before
