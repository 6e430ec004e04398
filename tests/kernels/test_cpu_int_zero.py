"""The n16 layout's other zero (qgemm_n16.h: n16_other_zero): symmetric int4 codes -8..7 stored
+ 8 with no offsets (GGUF Q4_0, symmetric GPTQ), and 5-bit codes 0..31 stored as they are (GGUF
Q5_1 and Q5_K), against the plain reference at every ISA level this host builds, on fresh random
data at odd shapes, on VNNI and on AMX tiles from the first row (where this process runs them)."""

from __future__ import annotations

import pytest
import torch

from edgellm.kernels.reference import (
    int_linear_ref,
    n16_other_zero,
    pack_int_n16_ref,
    quantize_rows_ref,
    tile_n16_ref,
    unpack_int_n16_ref,
)
from tests.helpers.isa_levels import ISA_LEVELS, native_at
from tests.helpers.cpu_int_cases import SHAPES, SHAPES16, check_against_reference, run_int_linear

OTHER_RANGE = {4: (-8, 7), 5: (0, 31)}  # the codes each width holds with its other zero
CASES = ([(s, 4, o) for s in SHAPES for o in (False, True)]
         + [(s, 5, o) for s in SHAPES + SHAPES16 for o in (False, True)])


@pytest.fixture(scope="module", params=ISA_LEVELS)
def native(request):
    return native_at(request.param)


@pytest.mark.parametrize("layout", ["n16", "n16-amx"])
@pytest.mark.parametrize("shape,bits,offsets", CASES)
def test_other_zero_matches_the_reference(native, shape, bits, offsets, layout):
    check_against_reference(native, shape, bits, offsets, False, layout, zero=n16_other_zero(bits),
                             code_range=OTHER_RANGE[bits])


@pytest.mark.parametrize("layout", ["n16", "n16-amx"])
@pytest.mark.parametrize("bits,group", [(4, 32), (5, 32), (5, 16)])
def test_other_zero_extremes_do_not_saturate(native, bits, group, layout):
    """Every stored code at its top (int4 -8..7: stored 15 or 0; 5 bits: 31) against activation
    codes of +-127: the 16-bit steps of AVX2 must not saturate."""
    m, k, n = 5, 256, 21
    lo, hi = OTHER_RANGE[bits]
    x = torch.full((m, k), 0.7)
    x[-1] *= torch.tensor([1.0, -1.0]).repeat_interleave(32).repeat(k // 64)
    q = torch.full((n, k), hi)
    q[1::2, ::3] = lo
    scale = torch.rand(n, k // group) * 0.1 + 0.01
    offset = torch.randn(n, k // group)
    y = run_int_linear(native, x, q, scale, offset, bits, group, None, layout, n16_other_zero(bits))
    want = int_linear_ref(x, q, scale, offset, group, None).float()
    assert torch.equal(quantize_rows_ref(x, group)[0].abs(), torch.full((m, k), 127, dtype=torch.int8))
    torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))


@pytest.mark.parametrize("bits", [4, 5])
def test_other_zero_packing_round_trips(bits):
    lo, hi = OTHER_RANGE[bits]
    q = torch.randint(lo, hi + 1, (19, 96))
    zero = n16_other_zero(bits)
    assert torch.equal(unpack_int_n16_ref(pack_int_n16_ref(q, bits, zero), 19, bits, zero), q.short())
    with pytest.raises(ValueError, match="do not fit"):
        pack_int_n16_ref(q, bits)  # the default zero does not hold these codes in that width


def test_bad_zeros_are_refused(native):
    x = torch.randn(2, 64)
    empty = torch.empty(0)
    p4 = pack_int_n16_ref(torch.randint(0, 16, (16, 64)), 4)
    s = tile_n16_ref(torch.rand(16, 2))
    native.int_linear_n16(x, p4, s, empty, 4, 32, empty, 16, 1 << 62, 8)
    for bits, zero in ((4, 7), (4, 16), (8, 0), (6, 0)):
        with pytest.raises(RuntimeError, match="zero must be"):
            native.int_linear_n16(x, p4, s, empty, bits, 32, empty, 16, 1 << 62, zero)
