"""What the layers of a load run (edgellm/layer_ops.py): decided once from the Platform, the
device and the dtype, for every CPU mode and every ISA level this host can run, and handed to
the layers at construction."""

from __future__ import annotations

import pytest
import torch

from edgellm.attention.cpu import CpuAttention
from edgellm.attention.cpu_dtype import prefill_dtype
from edgellm.attention.torch_ref import TorchRefAttention
from edgellm.attention.triton import TritonAttention
from edgellm.cpu_isa import LEVELS, CpuIsa, detect
from edgellm.layer_ops import LayerOps
from edgellm.platform import Platform

HOST = detect().host_level
ISA_LEVELS = [lvl for lvl in LEVELS[1:] if LEVELS.index(lvl) <= LEVELS.index(HOST)]


@pytest.mark.parametrize("level", ISA_LEVELS)
@pytest.mark.parametrize("mode", ["auto", "exact", "fast"])
@pytest.mark.parametrize("quantized", [True, False])
def test_cpu_fp32_choices(level, mode, quantized):
    isa = CpuIsa(level, detect())
    ops = LayerOps.for_load(Platform(mode, isa), "cpu", torch.float32, quantized)
    assert isinstance(ops.attention, CpuAttention) and ops.attention.native is not None
    tuned = mode == "fast" or (mode == "auto" and quantized)
    if not tuned:  # transformers' math: prefill chunks one at a time in fp32, torch norms
        assert ops.attention.prefill_dtype is None and ops.native is None and not ops.bf16_mlp
        return
    if mode == "fast":
        want = torch.bfloat16
    elif isa.bf16_units:  # measured at load, once per process: whichever ran faster here
        want = prefill_dtype(ops.attention.native, True)
    else:  # no bf16 units: fp32, unmeasured
        want = torch.float32
    assert ops.attention.prefill_dtype == want
    assert ops.native is ops.attention.native
    assert ops.bf16_mlp == (mode == "fast" or isa.bf16_units)


def test_other_devices_and_dtypes():
    platform = Platform("auto", CpuIsa(HOST, detect()))
    assert isinstance(LayerOps.for_load(platform, "cuda", torch.float16, True).attention, TritonAttention)
    bf16_cpu = LayerOps.for_load(platform, "cpu", torch.bfloat16, True)
    assert isinstance(bf16_cpu.attention, TorchRefAttention) and bf16_cpu.native is None
    assert isinstance(LayerOps().attention, TorchRefAttention)


def test_the_model_takes_them_at_construction(tiny_dir):
    """Every layer of a loaded model holds the load's one attention backend and its C++ module;
    nothing is switched afterwards."""
    from edgellm.loader import load_model, resolve_checkpoint

    path, _ = tiny_dir("llama")
    model = load_model(resolve_checkpoint(str(path)), torch.float32, cpu_kernels="fast")
    layers = model.model.layers
    backend = layers[0].self_attn.attn.backend
    assert isinstance(backend, CpuAttention) and backend.prefill_dtype == torch.bfloat16
    for layer in layers:
        assert layer.self_attn.attn.backend is backend
        assert layer.input_layernorm.native is backend.native
    exact = load_model(resolve_checkpoint(str(path)), torch.float32, cpu_kernels="exact")
    assert exact.model.layers[0].self_attn.attn.backend.prefill_dtype is None
    assert exact.model.norm.native is None
