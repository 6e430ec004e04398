"""Cases for the integer-dot CPU matmul tests (tests/kernels/test_cpu_int*.py): odd shapes, fresh
random activations / codes / scales, a run of the op in either layout, and the check of one case
against the plain references (edgellm/kernels/reference.py)."""

from __future__ import annotations

import torch

from edgellm.kernels.reference import (
    ACT_BLOCK,
    int_linear_ref,
    int_weight_ref,
    pack_int4_blocks_ref,
    pack_int_n16_ref,
    quantize_rows_ref,
    tile_n16_ref,
)

# (rows M, K, N, group)
SHAPES = [(1, 96, 37, 32), (3, 192, 21, 64), (5, 128, 9, 128), (2, 64, 5, 64), (7, 320, 13, 320), (17, 96, 11, 32),
          (4, 288, 19, 96),  # an odd number of blocks, groups of 3 that straddle block pairs
          # many rows (the wide order of the 512-bit tiles: tile pairs, 4 rows a pass, 64-row chunks):
          (70, 96, 37, 32), (13, 192, 50, 64), (9, 288, 19, 96)]


# int8 codes also come in groups of 16 (GGUF Q6_K / Q3_K / Q2_K sub-blocks)
SHAPES16 = [(1, 96, 37, 16), (3, 64, 21, 16), (17, 160, 11, 16), (2, 32, 5, 16)]


# the codes each storage holds (5 and 6 bits: int8 codes the n16 layout stores narrow)
CODE_RANGE = {4: (0, 15), 5: (-16, 15), 6: (-32, 31), 8: (-128, 127)}


def int_case(m: int, k: int, n: int, group: int, bits: int, half: bool, seed: int, offsets: bool = True,
          code_range: tuple[int, int] | None = None):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * torch.rand(m, 1, generator=g) * 4
    x[:, ::7] *= 20  # outliers inside blocks: the blocks' steps differ widely
    lo, hi = code_range or CODE_RANGE[bits]
    q = torch.randint(lo, hi + 1, (n, k), generator=g)
    offset = torch.randn(n, k // group, generator=g) if offsets or bits == 4 else None
    scale = torch.rand(n, k // group, generator=g) * 0.1 + 0.01
    if half:
        scale = scale.half()
        offset = None if offset is None else offset.half()
    bias = torch.randn(n, generator=g)
    return x, q, scale, offset, bias


# weights in the row layout (qgemm.h), and in the n16 layout (qgemm_n16.h) on VNNI (scalar code
# below avx512) and on AMX tiles from the first row (where the process runs them; VNNI otherwise)
LAYOUTS = ["rows", "n16", "n16-amx"]


def run_int_linear(native, x, q, scale, offset, bits, group, bias, layout="rows", zero=None):
    empty = torch.empty(0)
    bias = empty if bias is None else bias
    if layout == "rows":
        qweight = pack_int4_blocks_ref(q) if bits == 4 else q.to(torch.int8)
        return native.int_linear(x, qweight, scale, empty if offset is None else offset, bits, group, bias)
    offset = empty if offset is None else tile_n16_ref(offset)
    return native.int_linear_n16(x, pack_int_n16_ref(q, bits, zero), tile_n16_ref(scale), offset, bits, group, bias,
                                 q.shape[0], 1 if layout == "n16-amx" else 1 << 62, -1 if zero is None else zero)


def check_against_reference(native, shape, bits, offsets, half, layout, zero=None, code_range=None):
    m, k, n, group = shape
    x, q, scale, offset, bias = int_case(m, k, n, group, bits, half, seed=n * 31 + bits, offsets=offsets,
                                      code_range=code_range)
    y = run_int_linear(native, x, q, scale, offset, bits, group, bias, layout, zero)
    assert y.shape == (m, n) and y.dtype == torch.float32
    want = int_linear_ref(x, q, scale, offset, group, bias)
    w = int_weight_ref(q, scale, offset, group).double()
    codes, d, _ = quantize_rows_ref(x, group)
    xq = (codes.double().reshape(m, -1, ACT_BLOCK) * d.double()[..., None]).reshape(m, k)
    # (1) exact arithmetic on the rounded activations, up to fp32 summation noise
    magnitude = xq.abs() @ w.abs().t() + (offset is not None) * 1.0
    assert ((y.double() - want).abs() <= 1e-5 * magnitude + 1e-5).all()
    # (2) against the unrounded product: within the int8 rounding bound, and not trivially equal
    exact = x.double() @ w.t() + bias.double()
    step = d.double().repeat_interleave(ACT_BLOCK, 1)  # [m, k]: each column's block step
    bound = (step / 2) @ w.abs().t() + 1e-4 * magnitude
    err = (y.double() - exact).abs()
    assert (err <= bound).all()
    assert err.max() > 0
