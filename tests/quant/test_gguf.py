"""GGUF linears stay in their blocks and run through GGUFScheme: a tiny llama.cpp-style
GGUF (q/k rows permuted like llama.cpp's converter; Q4_0, Q4_1, Q5_0 and Q8_0 mixed,
also within one fused module) against the gguf package's reference dequantizer. The K-quant
files (Q4_K_M's mix): tests/quant/test_gguf_kquants.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from edgellm.cpu_isa import select
from edgellm.kernels import cpu_native
from edgellm.layers.linear import Linear
from edgellm.loader import load_model, resolve_checkpoint
from tests.helpers.gguf_files import write_llama_gguf

TYPES = {"attn_q": "Q4_0", "attn_k": "Q4_0", "attn_v": "Q4_1", "attn_output": "Q4_1",
         "ffn_gate": "Q5_0", "ffn_up": "Q8_0", "ffn_down": "Q4_0"}


@pytest.fixture(scope="module")
def tiny_gguf(tiny_dir, tmp_path_factory):
    """(path, {hf linear name: reference float32 weight [N, K]})."""
    return _write_tiny_gguf(tiny_dir, tmp_path_factory.mktemp("gguf") / "tiny.gguf", TYPES)


# int8 q/k/v, o and down (Q8_0), int4 gate and up (Q4_0, Q4_1)
Q8_TYPES = {"attn_q": "Q8_0", "attn_k": "Q8_0", "attn_v": "Q8_0", "attn_output": "Q8_0",
            "ffn_gate": "Q4_0", "ffn_up": "Q4_1", "ffn_down": "Q8_0"}


@pytest.fixture(scope="module")
def q8_gguf(tiny_dir, tmp_path_factory):
    return _write_tiny_gguf(tiny_dir, tmp_path_factory.mktemp("gguf") / "q8.gguf", Q8_TYPES)


def _write_tiny_gguf(tiny_dir, path, types: dict[str, str]):
    _, hf = tiny_dir("llama")
    return write_llama_gguf(hf, path, types)


def _check_linears(model, reference, fast: bool) -> dict[str, str]:
    torch.manual_seed(0)
    kinds = {}
    for name, module in model.named_modules():
        if not isinstance(module, Linear) or name == "lm_head":
            continue
        parts = ([f"{name.rpartition('.')[0]}.{s}" for s in ("q_proj", "k_proj", "v_proj")]
                 if name.endswith("qkv_proj") else
                 [f"{name.rpartition('.')[0]}.{s}" for s in ("gate_proj", "up_proj")]
                 if name.endswith("gate_up_proj") else [name])
        w = torch.cat([reference[p] for p in parts], 0)
        kinds[name.rpartition(".")[2]] = type(module.kernel).__name__
        for rows in (3, 100):  # a decode-sized (int4 GEMV) and a prefill-sized step (bf16 matmul)
            x = torch.randn(rows, w.shape[1])
            want = F.linear(x, w)
            got = module(x)
            if fast and kinds[name.rpartition(".")[2]] == "CpuInt4Kernel":  # bf16 activations
                assert 0 < ((got - want).abs().max() / want.abs().max()).item() < 2e-2
            else:
                assert (got - want).abs().max().item() < 1e-5
    return kinds


def test_gguf_linears_exact(tiny_gguf):
    path, reference = tiny_gguf
    model = load_model(resolve_checkpoint(path), torch.float32, cpu_kernels="exact")
    kinds = _check_linears(model, reference, fast=False)
    assert set(kinds.values()) == {"DenseKernel"}


def test_gguf_int4_blocks_stay_packed_on_the_fast_path(tiny_gguf):
    path, reference = tiny_gguf
    model = load_model(resolve_checkpoint(path), torch.float32, cpu_kernels="fast")
    kinds = _check_linears(model, reference, fast=True)
    # Q4_0 + Q4_0 + Q4_1 fuse into one int4 kernel; Q5_0 + Q8_0 are dequantized
    assert kinds == {"qkv_proj": "CpuInt4Kernel", "o_proj": "CpuInt4Kernel",
                     "gate_up_proj": "DenseKernel", "down_proj": "CpuInt4Kernel"}


def test_gguf_auto_mode_runs_q4_and_q8_0_as_integer_dots(tiny_gguf, q8_gguf):
    """CPU mode auto: modules whose shards are all int4 types (Q4_0/Q4_1) run int4 integer dots,
    any other mix (Q5_0 + Q8_0 here) int8 ones, over int8-rounded activations (each output equals
    the gguf package's dequantized weight times the activations rounded by the reference rule);
    the fused C++ decode takes both int4 and int8 linears."""
    from edgellm.kernels.reference import dequantize_rows_ref, quantize_rows_ref
    from edgellm.models.fused_decode import (
        LINEAR_INT8_DOT,
        LINEAR_INT8_N16,
        LINEAR_INT_DOT,
        LINEAR_INT_N16,
        LINEAR_META,
        META_PER_LAYER,
        FusedDecode,
    )

    for (path, reference), want_bits in ((tiny_gguf, {"qkv_proj": 4, "o_proj": 4, "gate_up_proj": 8, "down_proj": 4}),
                                          (q8_gguf, {"qkv_proj": 8, "o_proj": 8, "gate_up_proj": 4, "down_proj": 8})):
        model = load_model(resolve_checkpoint(path), torch.float32, cpu_kernels="auto")
        torch.manual_seed(0)
        for name, module in model.named_modules():
            if not isinstance(module, Linear) or name == "lm_head":
                continue
            leaf = name.rpartition(".")[2]
            kernel = module.kernel
            if leaf not in want_bits:
                assert type(kernel).__name__ == "DenseKernel", name
                continue
            assert type(kernel).__name__ == "CpuIntDotKernel" and kernel.bits == want_bits[leaf], name
            kernel.max_rows = 1 << 62  # integer dots at every size
            base = name.rpartition(".")[0]
            parts = ([f"{base}.{s}" for s in ("q_proj", "k_proj", "v_proj")] if leaf == "qkv_proj" else
                     [f"{base}.{s}" for s in ("gate_proj", "up_proj")] if leaf == "gate_up_proj" else [name])
            w = torch.cat([reference[p] for p in parts], 0).double()
            for rows in (1, 5, 40):
                x = torch.randn(rows, w.shape[1])
                codes, d, _ = quantize_rows_ref(x, 32)
                want = dequantize_rows_ref(codes, d).double() @ w.t()
                got = module(x)
                assert (got.double() - want).abs().max() <= 1e-5 * want.abs().max(), (name, rows)
        fused = FusedDecode.build(model.model, cpu_native.load())
        assert fused is not None
        per_layer = META_PER_LAYER
        kinds = {fused.meta[s + j * LINEAR_META] for s in range(0, len(fused.meta), per_layer) for j in range(4)}
        int4, int8 = (LINEAR_INT_N16, LINEAR_INT8_N16) if select().n16 else (LINEAR_INT_DOT, LINEAR_INT8_DOT)
        assert int4 in kinds and (int8 in kinds) == (8 in want_bits.values())
