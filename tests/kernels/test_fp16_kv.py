"""An fp16 KV cache on CPU (kv_cache_dtype fp16; edgellm/kernels/csrc/cpu/vec.h load16/to_half):
the C++ decode and causal prefill attention read fp16 pages by converting each value exactly to
fp32, so on fresh random data they give bit for bit what they give on fp32 pages holding the same
(fp16-representable) values, at every ISA level this host runs, and the writes round as torch's
.to(float16) does (nearest even). The engine-level checks are in tests/engine/test_fp16_kv.py."""

from __future__ import annotations

import pytest
import torch

from edgellm.kernels.paged_attention import write_kv_ref
from tests.helpers.isa_levels import ISA_LEVELS, native_at
from tests.helpers.paged_kv import paged, reference, scattered_tables


@pytest.fixture(scope="module", params=ISA_LEVELS)
def native(request):
    return native_at(request.param)


@pytest.mark.parametrize("hq,hkv,d,window", [(9, 3, 64, None), (8, 2, 128, 21), (5, 5, 24, None)])
def test_decode_attention_reads_fp16_pages_exactly(native, hq, hkv, d, window):
    """(24 wide: the scalar tail after one 16-lane chunk)"""
    g = torch.Generator().manual_seed(hq * 100 + d)
    nb, bs = 200, 16
    cache = (torch.randn(2, nb, bs, hkv, d, generator=g) * 3).half()
    shared = torch.randperm(nb, generator=g)[:5].tolist()  # an 80-token prefix three of them share
    tables, lens = scattered_tables(g, nb, [shared] * 3 + [[]] * 4, [2, 1, 3, 1, 4, 2, 1], bs)
    q = torch.randn(len(lens), hq, d, generator=g)
    args = (tables, torch.tensor(lens), d**-0.5, int(window or 0))
    got = native.decode_attention(q, cache, *args)
    assert torch.equal(got, native.decode_attention(q, cache.float(), *args))
    assert got.abs().sum() > 0 and torch.isfinite(got).all()


@pytest.mark.parametrize("t,ctx,key_start,hq,hkv,d", [(29, 29, 0, 6, 2, 64), (13, 77, 32, 4, 1, 128)])
def test_prefill_attention_reads_fp16_pages_exactly(native, t, ctx, key_start, hq, hkv, d):
    if native.n16_variant() == "scalar":
        pytest.skip("the causal prefill kernel is built only with vector units")
    g = torch.Generator().manual_seed(t + ctx)
    cache, table, k, v = paged(ctx, hkv, d, 16, g)
    cache = cache.half()
    q = torch.randn(t, hq, d, generator=g)
    out, lse = native.prefill_attention(q, cache, table, ctx, key_start, d**-0.5)
    out32, lse32 = native.prefill_attention(q, cache.float(), table, ctx, key_start, d**-0.5)
    assert torch.equal(out, out32) and torch.equal(lse, lse32)
    want, _ = reference(q, k.half().float(), v.half().float(), ctx, key_start, d**-0.5)
    assert (out.double() - want).abs().max().item() < 1e-5


def test_the_write_rounds_to_nearest_even():
    """write_kv_ref into an fp16 cache stores torch's rounding of each value, ties included (values
    exactly halfway between two fp16 numbers)."""
    g = torch.Generator().manual_seed(7)
    cache = torch.zeros(2, 4, 16, 2, 8, dtype=torch.float16)
    key = torch.randn(5, 2, 8, generator=g) * 5
    key[0, 0, :4] = torch.tensor([1 + 2**-11, 1 + 3 * 2**-11, -(2 + 2**-10), 65520.0])  # ties; overflow
    value = torch.randn(5, 2, 8, generator=g)
    slots = torch.tensor([3, 17, 40, 41, 63])
    write_kv_ref(key, value, cache, slots)
    flat = cache.view(2, 64, 2, 8)
    assert torch.equal(flat[0, slots], key.half()) and torch.equal(flat[1, slots], value.half())
    assert flat[0, 3, 0, :4].tolist() == [1.0, 1 + 2**-9, -2.0, float("inf")]
