"""The n16 integer-dot matmul's compact scales (qgemm_n16.h: int8 multipliers per group times an
fp32 base per run of groups, GGUF's K-quant form) against the fp32 form of the same values, at
every ISA level this host builds, on fresh random data at odd shapes.

The compact form stands for exactly the fp32 values float(mult) * base (an fp16 base times a
small integer is exact in fp32), so the kernel must return the fp32 form's result bit for bit;
the fp32 form itself is checked against the plain reference in test_cpu_int.py.
"""

from __future__ import annotations

import pytest
import torch

from edgellm.kernels.reference import (
    compact_scales_n16_ref,
    expand_compact_ref,
    int_linear_ref,
    pack_int_n16_ref,
    tile_n16_ref,
)
from tests.helpers.isa_levels import ISA_LEVELS, native_at
from tests.helpers.cpu_int_cases import CODE_RANGE


@pytest.fixture(scope="module", params=ISA_LEVELS)
def native(request):
    return native_at(request.param)


def _compact_case(m, k, n, group, bits, offsets, seed):
    """Activations, codes, and K-quant-like group values: an fp16 base per 256 columns times
    integer multipliers (scales 0..63 or -128..127, minimums 0..63 with a negative base)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * 3
    x[:, ::5] *= 15
    lo, hi = CODE_RANGE[bits]
    q = torch.randint(lo, hi + 1, (n, k), generator=g)
    groups, bases = k // group, max(1, k // 256)
    base = (torch.rand(n, bases, generator=g) * 0.01 + 1e-4).half().float()
    mult = torch.randint(-128, 128, (n, groups), generator=g)
    off = None
    if offsets:
        off = (
            -(torch.rand(n, bases, generator=g) * 0.02).half().float(),
            torch.randint(0, 64, (n, groups), generator=g),
        )
    return x, q, (base, mult), off, torch.randn(n, generator=g)


def run_int_linear(native, x, q, bits, group, scale, offset, bias, compact, amx_rows):
    empty = torch.empty(0)
    if compact:
        s = compact_scales_n16_ref(scale[1], scale[0])
        o = compact_scales_n16_ref(offset[1], offset[0]) if offset else empty
    else:
        s = tile_n16_ref(expand_compact_ref(scale[1], scale[0]))
        o = tile_n16_ref(expand_compact_ref(offset[1], offset[0])) if offset else empty
    return native.int_linear_n16(
        x, pack_int_n16_ref(q, bits), s, o, bits, group, bias, q.shape[0], amx_rows
    )


# (rows, K, N, group, bits, offsets): groups of 32 (Q4_K, Q5_K, IQ4_XS) and 16 (Q6_K, Q3_K, Q2_K),
# one base per 256 columns (8 or 16 groups), odd N, few rows (decode) and many (the wide order)
CASES = [
    (1, 512, 37, 32, 4, True),
    (3, 256, 21, 32, 5, True),
    (5, 768, 19, 16, 6, False),
    (2, 512, 9, 16, 5, True),
    (1, 256, 13, 32, 8, False),
    (17, 512, 11, 16, 8, True),
    (70, 512, 37, 32, 4, True),
    (9, 768, 50, 32, 6, False),
    # groups of 16 over more than 8 rows: each tile's scales converted once, then the rows
    (13, 512, 21, 16, 5, True),
    (40, 256, 35, 16, 6, False),
]


@pytest.mark.parametrize("amx", [False, True])
@pytest.mark.parametrize("case", CASES)
def test_compact_scales_equal_the_fp32_form(native, case, amx):
    m, k, n, group, bits, offsets = case
    x, q, scale, offset, bias = _compact_case(m, k, n, group, bits, offsets, seed=m * k + n)
    rows = 1 if amx else 1 << 62  # AMX tiles from the first row where this process runs them
    got = run_int_linear(native, x, q, bits, group, scale, offset, bias, True, rows)
    want = run_int_linear(native, x, q, bits, group, scale, offset, bias, False, rows)
    assert torch.equal(got, want)
    # and the values are the right ones: the plain reference, within fp32 summation noise
    ref = int_linear_ref(
        x,
        q,
        expand_compact_ref(scale[1], scale[0]),
        expand_compact_ref(offset[1], offset[0]) if offset else None,
        group,
        bias,
    )
    assert torch.allclose(got.double(), ref, rtol=1e-4, atol=1e-4 * float(ref.abs().max()))


def test_compact_layout_is_multipliers_then_bases():
    mult = torch.randint(-128, 128, (19, 16))
    base = torch.rand(19, 2)
    c = compact_scales_n16_ref(mult, base)
    assert c.dtype == torch.int8 and c.shape == (2, 16 * 16 + 2 * 64)
    # output 18 (tile 1, lane 2): group 9's multiplier, then base 1 as fp32 bytes
    assert int(c[1, 9 * 16 + 2]) == int(mult[18, 9])
    assert int(c[1, 9 * 16 + 3]) == 0  # rows past N: multiplier 0
    bases = c[:, 16 * 16 :].contiguous().view(torch.float32).reshape(2, 2, 16)
    assert float(bases[1, 1, 2]) == float(base[18, 1])
    assert float(bases[1, 1, 3]) == 0.0  # rows past N: base 0
    with pytest.raises(ValueError, match="do not divide"):
        compact_scales_n16_ref(mult, torch.rand(19, 3))


def test_compact_scales_bad_shapes(native):
    x = torch.randn(2, 512)
    q = pack_int_n16_ref(torch.randint(0, 16, (16, 512)), 4)
    good = compact_scales_n16_ref(torch.randint(0, 64, (16, 16)), torch.rand(16, 2))
    empty = torch.empty(0)
    native.int_linear_n16(x, q, good, empty, 4, 32, empty, 16, 1 << 62)
    # no bases; a partial one; 3 bases for 16 groups
    for bad in (good[:, : 16 * 16], good[:, :-1], torch.cat((good, good[:, :64]), 1)):
        with pytest.raises(RuntimeError, match="compact scale"):
            native.int_linear_n16(x, q, bad.contiguous(), empty, 4, 32, empty, 16, 1 << 62)
    with pytest.raises(RuntimeError, match="offset"):  # offsets must take the scales' form
        native.int_linear_n16(
            x, q, good, tile_n16_ref(torch.rand(16, 16)), 4, 32, empty, 16, 1 << 62
        )
