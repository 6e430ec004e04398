"""GGUF blocks -> integer codes (edgellm/quant/gguf_blocks.py): for every type, on fresh random
blocks, the codes' dequantization is bit-equal to gguf-py's reference dequantizer, and the CPU
integer-dot kernel over those codes equals dequantize-then-matmul within its activation bound."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from edgellm.quant import gguf_blocks
from edgellm.quant.int_codes import Int4Codes
from tests.helpers.gguf_files import random_rows


def gguf_reference(raw: torch.Tensor, type_name: str) -> torch.Tensor:
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    arr = dequantize(raw.numpy(), GGMLQuantizationType[type_name])
    return torch.from_numpy(np.array(arr, dtype=np.float32)).reshape(raw.shape[0], -1)


@pytest.mark.parametrize("type_name", gguf_blocks.SUPPORTED)
def test_codes_dequantize_bit_equal_to_gguf_py(type_name):
    for seed, (n, k) in enumerate([(3, 256), (7, 512), (1, 768)]):
        raw = random_rows(type_name, n, k, seed)
        want = gguf_reference(raw, type_name)
        assert want.shape == (n, k) and want.abs().max() > 0
        codes = gguf_blocks.int8_codes(raw, type_name)
        assert codes.codes.dtype == torch.int8 and codes.group_size == gguf_blocks.group_of(type_name)
        assert torch.equal(codes.dequantize(), want), type_name
        split = gguf_blocks.int8_codes(raw, type_name, group=16)  # as one shard of a mixed module
        assert split.group_size == 16 and torch.equal(split.dequantize(), want)
        if type_name in gguf_blocks.INT4_TYPES:
            c4 = gguf_blocks.int4_codes(raw, type_name)
            assert isinstance(c4, Int4Codes) and int(c4.codes.max()) <= 15
            assert torch.equal(c4.dequantize(), want), type_name


def test_code_ranges_are_the_formats():
    ranges = {"Q4_K": (0, 15), "Q5_0": (-16, 15), "Q5_1": (0, 31), "Q5_K": (0, 31), "Q6_K": (-32, 31),
              "Q3_K": (-4, 3), "Q2_K": (0, 3), "IQ4_NL": (-127, 113), "IQ4_XS": (-127, 113)}
    for type_name, (lo, hi) in ranges.items():
        codes = gguf_blocks.int8_codes(random_rows(type_name, 8, 512, 5), type_name).codes
        assert (int(codes.min()), int(codes.max())) == (lo, hi), type_name


def test_mixed_shards_concatenate_in_the_finest_group():
    parts = [random_rows("Q4_K", 5, 256, 1), random_rows("Q6_K", 3, 256, 2), random_rows("Q8_0", 4, 256, 3)]
    types = ["Q4_K", "Q6_K", "Q8_0"]
    merged = gguf_blocks.concat_int8([gguf_blocks.int8_codes(r, t, 16) for r, t in zip(parts, types)])
    want = torch.cat([gguf_reference(r, t) for r, t in zip(parts, types)], 0)
    assert merged.group_size == 16 and merged.offsets is not None
    assert torch.equal(merged.dequantize(), want)


def test_bad_rows_and_types_are_errors():
    with pytest.raises(ValueError, match="Q6_K: rows must be uint8"):
        gguf_blocks.decode(torch.zeros(2, 211, dtype=torch.uint8), "Q6_K")
    with pytest.raises(ValueError, match="no integer decoding; supported: Q4_0"):
        gguf_blocks.decode(torch.zeros(2, 66, dtype=torch.uint8), "IQ2_XXS")
    with pytest.raises(ValueError, match="not an int4 type"):
        gguf_blocks.int4_codes(random_rows("Q6_K", 1, 256, 0), "Q6_K")


@pytest.mark.parametrize("type_name", ["Q4_K", "Q5_K", "Q6_K", "Q3_K", "Q2_K", "IQ4_XS", "Q5_1"])
def test_integer_dot_kernel_equals_dequantize_then_matmul(type_name):
    """The kept-quantized matmul against the reference weight: exact on the rounded activations
    up to fp32 summation noise, within the int8 activation rounding bound otherwise."""
    from edgellm.kernels import cpu_native
    from edgellm.kernels.reference import ACT_BLOCK, quantize_rows_ref
    from edgellm.platform import Platform
    from edgellm.quant.linear_kernels.cpu_int import CpuIntDotKernel

    platform = Platform.create(cpu_quant="auto")
    native = cpu_native.load()
    raw = random_rows(type_name, 13, 512, 7)
    w = gguf_reference(raw, type_name).double()
    codes = (gguf_blocks.int4_codes(raw, type_name) if type_name in gguf_blocks.INT4_TYPES
             else gguf_blocks.int8_codes(raw, type_name))
    ok, why = CpuIntDotKernel.can_implement(codes=codes, platform=platform, native=native, dtype=torch.float32)
    assert ok, why
    kernel = CpuIntDotKernel(codes, native, platform)
    for rows in (1, 3, 9):
        x = torch.randn(rows, 512) * 3
        got = kernel.int_dot(x, None).double()
        a, d, _ = quantize_rows_ref(x, 32)
        xq = (a.double().reshape(rows, -1, ACT_BLOCK) * d.double()[..., None]).reshape(rows, -1)
        magnitude = xq.abs() @ w.abs().t()
        assert ((got - xq @ w.t()).abs() <= 1e-5 * magnitude + 1e-6).all(), (type_name, rows)
        step = d.double().repeat_interleave(ACT_BLOCK, 1)
        err = (got - x.double() @ w.t()).abs()
        assert (err <= (step / 2) @ w.abs().t() + 1e-4 * magnitude).all() and err.max() > 0


SPLIT_TYPES = ("Q4_K", "Q5_K", "Q6_K", "Q3_K", "Q2_K", "IQ4_XS")  # an fp16 per 256 x integers per group


@pytest.mark.parametrize("type_name", gguf_blocks.SUPPORTED)
def test_split_scales_are_the_scales_exactly(type_name):
    """The K-quants carry their scales (and minimums) as integer multipliers of an fp16 per 256
    columns; those stand for exactly the fp32 scales and offsets, also split into groups of 16 and
    concatenated with other types' shards. The other types carry none."""
    raw = random_rows(type_name, 6, 768, 11)
    for codes in (gguf_blocks.int8_codes(raw, type_name), gguf_blocks.int8_codes(raw, type_name, group=16)):
        if type_name not in SPLIT_TYPES:
            assert codes.scale_split is None and codes.offset_split is None
            continue
        s = codes.scale_split
        assert s.mult.dtype == torch.int8 and s.base.shape == (6, 3)
        assert torch.equal(s.values(), codes.scales)
        assert (codes.offsets is None) == (codes.offset_split is None)
        if codes.offsets is not None:
            assert torch.equal(codes.offset_split.values(), codes.offsets)
    mixed = gguf_blocks.concat_int8([gguf_blocks.int8_codes(random_rows(t, 5, 512, 2), t, 16)
                                     for t in ("Q4_K", "Q6_K", "Q2_K")])
    assert torch.equal(mixed.scale_split.values(), mixed.scales)
    assert torch.equal(mixed.offset_split.values(), mixed.offsets)  # Q6_K's rows: zero offsets
    with_q8 = gguf_blocks.concat_int8([gguf_blocks.int8_codes(random_rows(t, 5, 512, 2), t, 16)
                                       for t in ("Q4_K", "Q8_0")])
    assert with_q8.scale_split is None and with_q8.offset_split is None


@pytest.mark.parametrize("type_name", SPLIT_TYPES + ("Q4_K_M",))
def test_compact_scales_change_no_bit(type_name):
    """The CPU integer-dot kernel stores split scales in the n16 layout's compact form (int8) where
    it can, and its outputs are bit-equal to the fp32 form's, at decode and at prefill sizes."""
    from edgellm.kernels import cpu_native
    from edgellm.platform import Platform
    from edgellm.quant.linear_kernels.cpu_int import CpuIntDotKernel

    platform = Platform.create(cpu_quant="auto")
    native = cpu_native.load()
    if type_name == "Q4_K_M":  # a fused module: Q4_K and Q6_K shards
        codes = gguf_blocks.concat_int8([gguf_blocks.int8_codes(random_rows(t, 21, 512, 4), t, 16)
                                         for t in ("Q4_K", "Q6_K")])
    else:
        raw = random_rows(type_name, 37, 512, 3)
        codes = (gguf_blocks.int4_codes(raw, type_name) if type_name in gguf_blocks.INT4_TYPES
                 else gguf_blocks.int8_codes(raw, type_name))
    kernel = CpuIntDotKernel(codes, native, platform)
    codes.scale_split = codes.offset_split = None
    plain = CpuIntDotKernel(codes, native, platform)
    assert plain.scale.dtype == torch.float32
    assert kernel.scale.dtype == torch.int8 and kernel.scale.nbytes <= plain.scale.nbytes / 2
    for rows in (1, 4, 40):
        x = torch.randn(rows, 512) * 2
        assert torch.equal(kernel.int_dot(x, None), plain.int_dot(x, None)), rows
