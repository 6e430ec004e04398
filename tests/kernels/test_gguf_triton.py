"""GGUF weights kept quantized on the CUDA path, run under the Triton interpreter on CPU: every
type edgellm decodes (quant/gguf_blocks.SUPPORTED) through the kernel the loader picks for it
(Q4_0/Q4_1/Q4_K: the W4A16 GEMM, with offsets for Q4_1/Q4_K; the rest: the grouped W8 GEMM over
int8 codes), and the mixed shards of a Q4_K_M qkv, against gguf-py's dequantization followed by
an fp32 matmul, on random valid blocks.
Without CUDA the kernels run under Triton's interpreter, set up for every test in conftest.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from edgellm.kernels import grouped_gemm
from edgellm.quant import gguf_blocks
from edgellm.quant.linear_kernels.triton import TritonInt4Kernel, TritonInt8GroupedKernel
from tests.helpers.gguf_files import random_rows
from tests.helpers.triton_device import DEVICE

pytestmark = pytest.mark.usefixtures("triton_device")


def _gguf_py(raw: torch.Tensor, type_name: str, k: int) -> torch.Tensor:
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    w = dequantize(raw.numpy(), GGMLQuantizationType[type_name])
    return torch.from_numpy(np.asarray(w, dtype=np.float32)).reshape(raw.shape[0], k)


def _kernel(parts: list[tuple[torch.Tensor, str]]):
    types = {t for _, t in parts}
    if types <= set(gguf_blocks.INT4_TYPES) and len(parts) == 1:
        return TritonInt4Kernel(gguf_blocks.int4_codes(*parts[0]), torch.device(DEVICE))
    group = min(gguf_blocks.group_of(t) for t in types)
    codes = gguf_blocks.concat_int8([gguf_blocks.int8_codes(raw, t, group) for raw, t in parts])
    return TritonInt8GroupedKernel(codes, torch.device(DEVICE))


def _check(parts, k: int, m: int, seed: int) -> None:
    w = torch.cat([_gguf_py(raw, t, k) for raw, t in parts], 0)
    kernel = _kernel(parts)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g)
    bias = torch.randn(w.shape[0], generator=g)
    out = kernel(x.to(DEVICE), bias.to(DEVICE)).cpu()
    ref = x.double() @ w.double().t() + bias.double()
    scale = ref.abs().max().item()
    assert scale > 0
    # fp32 accumulation over K products of fp32 weights (the reference's rounding, one per element)
    assert (out.double() - ref).abs().max().item() <= 1e-5 * scale * (k / 256) ** 0.5 + 1e-6 * scale


@pytest.mark.parametrize("type_name", gguf_blocks.SUPPORTED)
@pytest.mark.parametrize("m", [1, 19])
def test_every_gguf_type_through_its_triton_kernel(type_name, m):
    k = 512  # two super-blocks of the K-quants, 16 blocks of the 32-element types
    raw = random_rows(type_name, 37, k, seed=gguf_blocks.SUPPORTED.index(type_name))
    kernel = _kernel([(raw, type_name)])
    want = TritonInt4Kernel if type_name in gguf_blocks.INT4_TYPES else TritonInt8GroupedKernel
    assert isinstance(kernel, want)
    _check([(raw, type_name)], k, m, seed=m)


@pytest.mark.parametrize("m", [1, 19])
def test_q4_k_m_mixed_shards_as_one_grouped_weight(m):
    k = 256
    parts = [
        (random_rows("Q4_K", 24, k, 1), "Q4_K"),
        (random_rows("Q4_K", 8, k, 2), "Q4_K"),
        (random_rows("Q6_K", 8, k, 3), "Q6_K"),
    ]
    assert isinstance(_kernel(parts), TritonInt8GroupedKernel)
    _check(parts, k, m, seed=10 + m)


def test_grouped_gemm_reference_and_split_k_agree():
    g = torch.Generator().manual_seed(5)
    n, k, group = 33, 192, 16
    codes = torch.randint(-32, 32, (n, k), generator=g, dtype=torch.int8)
    scales = torch.rand(k // group, n, generator=g) * 0.01
    offsets = torch.randn(k // group, n, generator=g) * 0.01
    x = torch.randn(3, k, generator=g)
    ref = grouped_gemm.w8g_gemm_ref(x, codes, scales, group, offsets)
    for split in (1, 2, 3):
        out = grouped_gemm.w8g_gemm(
            x.to(DEVICE),
            codes.to(DEVICE),
            scales.to(DEVICE),
            group,
            offsets.to(DEVICE),
            split_k=split,
        ).cpu()
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
    with pytest.raises(ValueError, match="scales must be fp32"):
        grouped_gemm.w8g_gemm(x, codes, scales.half(), group)
    with pytest.raises(ValueError, match="grouped int8"):
        grouped_gemm.w8g_gemm(x, codes, scales, 40)
