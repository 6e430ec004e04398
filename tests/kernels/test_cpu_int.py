"""The integer-dot CPU matmuls (edgellm/kernels/csrc/cpu/qgemm.cpp) against the plain references of
edgellm/kernels/reference.py, at every ISA level this CPU can run (EDGELLM_CPU_ISA-style caps), on
fresh random data at odd shapes.

Two properties per case: (1) with the activations rounded exactly as the kernel rounds them
(the reference quantizer, which the kernel's codes must equal bit for bit), the result is the
exact product up to fp32 summation noise; (2) against the unrounded fp32 product the error is
within the bound the int8 activation rounding allows: sum over blocks of (d_b / 2) * |W| row sums.
"""

from __future__ import annotations

import pytest
import torch

from edgellm.cpu_isa import CpuIsa, detect
from edgellm.kernels import cpu_native
from edgellm.kernels.reference import (
    ACT_BLOCK,
    int_linear_ref,
    pack_int4_blocks_ref,
    pack_int_n16_ref,
    quantize_rows_ref,
    tile_n16_ref,
    unpack_int4_blocks_ref,
    unpack_int_n16_ref,
)
from tests.helpers.cpu_int_cases import (
    CODE_RANGE,
    LAYOUTS,
    SHAPES,
    SHAPES16,
    check_against_reference,
    int_case,
    run_int_linear,
)
from tests.helpers.isa_levels import ISA_LEVELS, native_at


@pytest.mark.parametrize("level", ISA_LEVELS)
def test_each_level_builds_its_widest_vnni(level):
    """The n16 tiles a level's build runs: 512-bit vpdpbusd, AVX-VNNI's 256-bit one, or AVX2's
    vpmaddubsw; the tests below then check whichever this host's levels build."""
    isa = CpuIsa(level, detect())
    module = cpu_native.load(isa)
    assert module is not None
    assert module.n16_variant() == {512: "avx512-vnni", 256: "avx-vnni", 0: "avx2"}[isa.vnni_bits]


@pytest.fixture(scope="module", params=ISA_LEVELS)
def native(request):
    return native_at(request.param)


@pytest.mark.parametrize("shape", SHAPES)
def test_activation_codes_equal_the_reference(native, shape):
    m, k, _, group = shape
    x, *_ = int_case(m, k, 1, group, 4, False, seed=k + m)
    x[0, :ACT_BLOCK] = 0.0  # an all-zero block: step 0, codes 0
    a, d, dsum = native.quantize_rows(x, group)
    ra, rd, rdsum = quantize_rows_ref(x, group)
    assert torch.equal(a, ra) and torch.equal(d, rd)
    assert int(a.abs().max()) <= 127 and int(a.abs().max()) >= 120
    torch.testing.assert_close(dsum, rdsum, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shape", SHAPES16)
def test_activation_sums_per_half_block(native, shape):
    m, k, _, group = shape
    x, *_ = int_case(m, k, 1, group, 8, False, seed=k + m)
    a, d, dsum = native.quantize_rows(x, group)
    ra, rd, rdsum = quantize_rows_ref(x, group)
    assert dsum.shape == (m, k // 16) and torch.equal(a, ra) and torch.equal(d, rd)
    torch.testing.assert_close(dsum, rdsum, rtol=1e-5, atol=1e-5)


# int4: always an offset (zero points, Q4_1/Q4_K minima); int8 with and without (Q5_1/Q5_K/Q2_K
# minima); groups of 16 for int8 only (int4 rejects them: test_zero_rows_and_bad_shapes)
CASES = ([(s, 4, True) for s in SHAPES] + [(s, 8, o) for s in SHAPES + SHAPES16 for o in (False, True)])
# int8 codes stored in 5 or 6 bits (the n16 layout only)
NARROW = [(s, b, o) for b in (5, 6) for s in SHAPES + SHAPES16 for o in (False, True)]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("half", [False, True])
@pytest.mark.parametrize("shape,bits,offsets", CASES)
def test_int_linear_matches_the_reference(native, shape, bits, offsets, half, layout):
    check_against_reference(native, shape, bits, offsets, half, layout)


@pytest.mark.parametrize("layout", LAYOUTS[1:])
@pytest.mark.parametrize("half", [False, True])
@pytest.mark.parametrize("shape,bits,offsets", NARROW)
def test_narrow_codes_match_the_reference(native, shape, bits, offsets, half, layout):
    check_against_reference(native, shape, bits, offsets, half, layout)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("bits,sign,group", [(b, s, g) for b in (4, 5, 6, 8) for s in (1, -1) for g in (16, 32)
                                             if not (b == 4 and g == 16)])
def test_extreme_codes_do_not_saturate(native, bits, sign, group, layout):
    """The largest sums the 16-bit steps can meet: every weight code at its extreme (int4 15,
    5 / 6 bits 15 / 31 (stored 31 / 63), int8 -128) times activations whose codes are all +-127
    (a constant row; the last row mixes signs block by block). vpmaddubsw saturates at 2^15 - 1,
    so any overflow shows as a wrong sum; every path must equal the reference exactly up to fp32
    summation noise."""
    if layout == "rows" and bits in (5, 6):
        layout = "n16"  # narrow codes exist in the n16 layout only
    m, k, n = 5, 256, 21
    lo, hi = CODE_RANGE[bits]
    x = torch.full((m, k), 0.7 * sign)
    x[-1] *= torch.tensor([1.0, -1.0]).repeat_interleave(ACT_BLOCK).repeat(k // (2 * ACT_BLOCK))
    q = torch.full((n, k), hi if bits in (4, 5, 6) else lo)
    q[1::2, ::3] = lo if bits in (4, 5, 6) else hi  # some rows not constant
    scale = torch.rand(n, k // group) * 0.1 + 0.01
    offset = torch.randn(n, k // group)
    y = run_int_linear(native, x, q, scale, offset, bits, group, None, layout)
    want = int_linear_ref(x, q, scale, offset, group, None).float()
    assert torch.equal(quantize_rows_ref(x, group)[0].abs(), torch.full((m, k), 127, dtype=torch.int8))
    torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))


def test_int4_block_packing_round_trips():
    q = torch.randint(0, 16, (5, 96))
    packed = pack_int4_blocks_ref(q)
    assert packed.shape == (5, 48) and packed.dtype == torch.uint8
    assert torch.equal(unpack_int4_blocks_ref(packed), q.to(torch.uint8))
    assert int(packed[0, 0]) == int(q[0, 0]) | (int(q[0, 16]) << 4)


@pytest.mark.parametrize("bits", [4, 5, 6, 8])
def test_n16_packing_round_trips(bits):
    n, k = 37, 96  # a partial last tile of 5 rows
    lo, hi = CODE_RANGE[bits]
    q = torch.randint(lo, hi + 1, (n, k))
    packed = pack_int_n16_ref(q, bits)
    assert packed.shape == (3, 3, {4: 256, 5: 320, 6: 384, 8: 512}[bits]) and packed.dtype == torch.uint8
    assert torch.equal(unpack_int_n16_ref(packed, n, bits), q.to(torch.int16))
    # tile 0, block 1, layout row 6, output 5: columns 32 + 24 .. 32 + 27 of row 5, stored + zero
    e = packed[0, 1].to(torch.int16)
    if bits != 8:
        e = torch.cat((e[:256] & 15, e[:256] >> 4))
        for i in range(bits - 4):  # plane byte j, bit 6: bit 4 + i of stored code 6 * 64 + j
            e = e | (((packed[0, 1, 256 + 64 * i: 320 + 64 * i].to(torch.int16) >> 6) & 1) << (4 + i)).repeat(8)
    zero = {4: 0, 5: 16, 6: 32, 8: 128}[bits]
    assert e[6 * 64 + 5 * 4: 6 * 64 + 5 * 4 + 4].tolist() == (q[5, 56:60] + zero).tolist()
    scale = torch.rand(n, 3)
    tiled = tile_n16_ref(scale)
    assert tiled.shape == (3, 3, 16) and torch.equal(tiled[2, 1, :5], scale[32:, 1]) and not tiled[2, :, 5:].any()


@pytest.mark.parametrize("rows", [1, 16, 40])
def test_n16_paths_agree_with_the_row_layout(native, rows):
    """The same weights in both layouts, on VNNI and on AMX tiles (where they run): the exact
    integer block dots make every path equal up to fp32 summation order."""
    x, q, scale, offset, bias = int_case(rows, 256, 70, 64, 4, True, seed=rows)
    want = run_int_linear(native, x, q, scale, offset, 4, 64, bias)
    for layout in LAYOUTS[1:]:
        got = run_int_linear(native, x, q, scale, offset, 4, 64, bias, layout)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))


@pytest.mark.parametrize("bits,group", [(4, 32), (5, 32), (6, 32), (8, 32), (5, 16), (6, 16), (8, 16)])
def test_n16_rows_do_not_depend_on_the_batch(native, bits, group):
    """Each row's outputs come out of the same operations whatever rows share its call (decode
    rows one by one, or a prefill chunk of 70 in the many-rows order, groups of 16 too):
    bit-equal, not just close, so a request's logits do not depend on what it is batched with."""
    x, q, scale, offset, bias = int_case(70, 160, 45, group, bits, False, seed=bits, offsets=True)
    args = (pack_int_n16_ref(q, bits), tile_n16_ref(scale), tile_n16_ref(offset), bits, group, bias, 45, 1 << 62)
    whole = native.int_linear_n16(x, *args)
    for lo, hi in ((0, 1), (1, 9), (9, 13), (13, 70)):
        assert torch.equal(native.int_linear_n16(x[lo:hi].contiguous(), *args), whole[lo:hi])


def test_n16_zero_rows_and_bad_shapes(native):
    q = torch.randint(0, 16, (20, 64))
    p, s = pack_int_n16_ref(q, 4), tile_n16_ref(torch.rand(20, 2))
    empty = torch.empty(0)
    assert native.int_linear_n16(torch.empty(0, 64), p, s, empty, 4, 32, empty, 20, 0).shape == (0, 20)
    with pytest.raises(RuntimeError, match="n16 layout"):
        native.int_linear_n16(torch.randn(1, 64), p, s, empty, 4, 32, empty, 40, 0)  # N past the tiles
    with pytest.raises(RuntimeError, match="n16 layout"):
        native.int_linear_n16(torch.randn(1, 64), p, s, empty, 8, 32, empty, 20, 0)  # int4 bytes as int8
    with pytest.raises(RuntimeError, match="n16 layout"):
        native.int_linear_n16(torch.randn(1, 64), p, s, empty, 5, 32, empty, 20, 0)  # int4 bytes as 5 bits
    with pytest.raises(RuntimeError, match="bits must be 4, 5, 6 or 8"):
        native.int_linear_n16(torch.randn(1, 64), p, s, empty, 7, 32, empty, 20, 0)
    with pytest.raises(RuntimeError, match="group"):
        native.int_linear_n16(torch.randn(1, 64), p, tile_n16_ref(torch.rand(20, 4)), empty, 4, 16, empty, 20, 0)
    with pytest.raises(RuntimeError, match="scale"):
        native.int_linear_n16(torch.randn(1, 64), p, torch.rand(20, 2), empty, 4, 32, empty, 20, 0)
    with pytest.raises(RuntimeError, match="bias"):
        native.int_linear_n16(torch.randn(1, 64), p, s, empty, 4, 32, torch.randn(19), 20, 0)


def test_zero_rows_and_bad_shapes(native):
    q = torch.randint(0, 16, (8, 64))
    scale = torch.rand(8, 2)
    empty = native.int_linear(torch.empty(0, 64), pack_int4_blocks_ref(q), scale, torch.empty(0), 4, 32,
                              torch.empty(0))
    assert empty.shape == (0, 8)
    with pytest.raises(RuntimeError, match="group"):
        native.int_linear(torch.randn(1, 64), pack_int4_blocks_ref(q), scale, torch.empty(0), 4, 48,
                          torch.empty(0))
    with pytest.raises(RuntimeError, match="qweight"):
        native.int_linear(torch.randn(1, 64), q.to(torch.uint8), scale, torch.empty(0), 4, 32, torch.empty(0))
    with pytest.raises(RuntimeError, match="int4 weights take groups of 32"):
        native.int_linear(torch.randn(1, 64), pack_int4_blocks_ref(q), torch.rand(8, 4), torch.empty(0), 4, 16,
                          torch.empty(0))
    with pytest.raises(RuntimeError, match="group must be 16 or a multiple of 32"):
        native.int_linear(torch.randn(1, 48), q[:, :48].to(torch.int8), torch.rand(8, 3), torch.empty(0), 8, 16,
                          torch.empty(0))
