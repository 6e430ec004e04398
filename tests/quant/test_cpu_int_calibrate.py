"""CPU mode auto's load-time choices (edgellm/quant/linear_kernels/cpu_int.calibrate): the layout
each CPU gets, the AMX-vs-VNNI and integer-vs-dense crossovers, and that a kernel's output is
the same integer-dot product on both sides of every crossover it sets."""

from __future__ import annotations

import pytest
import torch

from edgellm.cpu_isa import CpuIsa, detect
from edgellm.kernels.reference import int_linear_ref
from edgellm.platform import Platform
from edgellm.quant.int_codes import Int4Codes, Int8Codes
from edgellm.quant.linear_kernels.cpu_int import CALIBRATION_ROWS, CpuIntDotKernel, calibrate
from tests.helpers.isa_levels import ISA_LEVELS

NEVER = 1 << 62


def _kernels(platform: Platform, seed: int) -> list[CpuIntDotKernel]:
    g = torch.Generator().manual_seed(seed)
    native = platform.native()
    assert native is not None
    out = []
    for n, k in ((96, 64), (160, 96), (64, 160)):  # one "layer": qkv, o, gate_up, down-like shapes
        int4 = Int4Codes(torch.randint(0, 16, (n, k), generator=g), None, torch.rand(n, k // 32, generator=g) + 0.1,
                         32, offsets=torch.randn(n, k // 32, generator=g))
        out.append(CpuIntDotKernel(int4, native, platform))
    int8 = Int8Codes(torch.randint(-128, 128, (48, 96), generator=g, dtype=torch.int8),
                     torch.rand(48, 6, generator=g) + 0.1, 16)
    out.append(CpuIntDotKernel(int8, native, platform))
    return out


@pytest.mark.parametrize("level", ISA_LEVELS)
def test_layout_follows_the_isa(level):
    isa = CpuIsa(level, detect())
    for kernel in _kernels(Platform("auto", isa, dense_budget=0), 1):
        assert kernel.n16 == isa.n16
        assert kernel.qweight.dim() == (3 if isa.n16 else 2)


@pytest.mark.parametrize("level", ISA_LEVELS)
def test_crossovers_keep_the_integer_dot_product(level):
    """calibrate() sets amx_rows (n16 on an AMX host: a measured row count, else never) and
    max_rows (dense copies kept only when dense won somewhere); whatever it picked, every
    row count at or below max_rows gives the reference integer-dot product."""
    isa = CpuIsa(level, detect())
    platform = Platform("auto", isa, dense_budget=1 << 30)
    kernels = _kernels(platform, 2)
    assert all(k.dense is not None for k in kernels)
    crossover = calibrate(kernels, layers=1)
    ready = kernels[0].native.amx_ready() and isa.vnni
    for kernel in kernels:
        assert kernel.amx_rows == NEVER or (ready and kernel.amx_rows in CALIBRATION_ROWS)
        if crossover is None:
            assert kernel.dense is None and kernel.max_rows == NEVER
        else:
            assert kernel.max_rows == crossover and kernel.dense is not None
    g = torch.Generator().manual_seed(3)
    for kernel in kernels:
        amx = kernel.amx_rows if kernel.amx_rows != NEVER else None
        for rows in sorted({1, 7, 33} | ({amx - 1, amx} if amx else set())):
            if rows < 1 or rows > kernel.max_rows:
                continue
            x = torch.randn(rows, kernel.k, generator=g)
            want = int_linear_ref(x, _codes_of(kernel), *_scales_of(kernel), kernel.group)
            got = kernel(x, None).double()
            assert (got - want).abs().max() <= 1e-5 * want.abs().max() + 1e-5, (kernel.n, rows)


def _codes_of(kernel: CpuIntDotKernel) -> torch.Tensor:
    from edgellm.kernels.reference import unpack_int4_blocks_ref, unpack_int_n16_ref

    if kernel.n16:
        return unpack_int_n16_ref(kernel.qweight, kernel.n, kernel.bits, kernel.zero)
    return kernel.qweight if kernel.bits == 8 else unpack_int4_blocks_ref(kernel.qweight)


def _scales_of(kernel: CpuIntDotKernel) -> tuple[torch.Tensor, torch.Tensor | None]:
    def rows(t: torch.Tensor) -> torch.Tensor:  # n16 tiles [NT, G, 16] back to [N, G]
        return t.transpose(1, 2).reshape(-1, t.shape[1])[: kernel.n] if kernel.n16 else t

    offset = rows(kernel.offset) if kernel.offset.numel() else None
    return rows(kernel.scale), offset


@pytest.mark.parametrize("level", ISA_LEVELS)
@pytest.mark.parametrize("lo,hi,offsets,bits", [(-16, 15, False, 5), (0, 3, True, 5), (0, 31, True, 5),
                                                (0, 31, False, 5), (-32, 31, False, 6), (0, 63, True, 8),
                                                (-128, 127, True, 8)])
def test_int8_codes_are_stored_as_narrow_as_they_fit(level, lo, hi, offsets, bits):
    """Int8Codes within -16..15 are stored in 5 bits, within 0..31 (Q5_1 / Q5_K) as they are in 5
    bits (zero 0), within -32..31 in 6 bits, else in 8 (the row layout: always 8); the kernel's
    product stays the weights' integer-dot product (W from the codes as given), up to fp32
    summation."""
    from edgellm.kernels.reference import int_weight_ref, quantize_rows_ref

    isa = CpuIsa(level, detect())
    platform = Platform("auto", isa, dense_budget=0)
    g = torch.Generator().manual_seed(lo * 7 + hi)
    n, k, group = 37, 160, 32
    q = torch.randint(lo, hi + 1, (n, k), generator=g, dtype=torch.int16).to(torch.int8)
    scale = torch.rand(n, k // group, generator=g) * 0.1 + 0.01
    offset = torch.randn(n, k // group, generator=g) if offsets else None
    kernel = CpuIntDotKernel(Int8Codes(q, scale, group, offsets=offset), platform.native(), platform)
    assert kernel.bits == (bits if isa.n16 else 8)
    unsigned5 = bits == 5 and lo >= 0 and hi > 15  # 0..31: stored as they are
    assert kernel.zero == ((0 if unsigned5 else {5: 16, 6: 32, 8: 128}[bits]) if isa.n16 else 0)
    x = torch.randn(9, k, generator=g)
    codes, d, _ = quantize_rows_ref(x, group)
    xq = (codes.double().reshape(9, -1, 32) * d.double()[..., None]).reshape(9, k)
    w = int_weight_ref(q, scale, offset, group).double()
    want = xq @ w.t()
    got = kernel(x, None).double()
    assert (got - want).abs().max() <= 1e-5 * (xq.abs() @ w.abs().t()).max()
