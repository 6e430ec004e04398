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
        return unpack_int_n16_ref(kernel.qweight, kernel.n, kernel.bits)
    return kernel.qweight if kernel.bits == 8 else unpack_int4_blocks_ref(kernel.qweight)


def _scales_of(kernel: CpuIntDotKernel) -> tuple[torch.Tensor, torch.Tensor | None]:
    def rows(t: torch.Tensor) -> torch.Tensor:  # n16 tiles [NT, G, 16] back to [N, G]
        return t.transpose(1, 2).reshape(-1, t.shape[1])[: kernel.n] if kernel.n16 else t

    offset = rows(kernel.offset) if kernel.offset.numel() else None
    return rows(kernel.scale), offset
