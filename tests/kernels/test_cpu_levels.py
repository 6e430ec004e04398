"""The C++ CPU kernels built at every ISA level this CPU can run (edgellm/kernels/csrc/cpu/vec.h: one
source, 16-lane vectors as one zmm on AVX-512 or two ymm on AVX2), each against the torch
reference on fresh random data: paged decode attention (GQA, scattered pages, lengths on and off
page edges, a sliding window, sequences sharing cached prefix pages, fp32 rows of odd widths that
take the scalar tail) and RMSNorm. tests/kernels/test_cpu_native.py covers the host level in depth."""

from __future__ import annotations

import pytest
import torch

from edgellm.kernels.paged_attention import paged_attention_ref
from tests.helpers.isa_levels import ISA_LEVELS, native_at
from tests.helpers.paged_kv import scattered_tables


@pytest.fixture(scope="module", params=ISA_LEVELS)
def native(request):
    return native_at(request.param)


@pytest.mark.parametrize("hq,hkv,d,window", [(9, 3, 64, None), (8, 2, 128, None), (6, 2, 48, 13), (5, 5, 24, None)])
def test_decode_attention(native, hq, hkv, d, window):
    g = torch.Generator().manual_seed(hq * 1000 + d)
    nb, bs = 300, 16
    cache = torch.randn(2, nb, bs, hkv, d, generator=g)
    shared = torch.randperm(nb, generator=g)[:6].tolist()  # a 96-token cached prefix for four of them
    heads = [shared] * 4 + [[]] * 3
    tables, lens = scattered_tables(g, nb, heads, [1, 2, 3, 1, 4, 1, 2], bs)
    q = torch.randn(len(lens), hq, d, generator=g)
    scale = d ** -0.5
    want = paged_attention_ref(q, q[:, :hkv], q[:, :hkv], cache, tables.int(), lens, list(range(len(lens) + 1)),
                               len(lens), scale, window)
    got = native.decode_attention(q.contiguous(), cache, tables, torch.tensor(lens), scale, int(window or 0))
    assert (got - want).abs().max().item() < 1e-5
    # a sequence's result does not depend on who shares its prefix
    alone = native.decode_attention(q[:1].contiguous(), cache, tables[:1], torch.tensor(lens[:1]), scale,
                                    int(window or 0))
    assert torch.equal(alone, got[:1])


@pytest.mark.parametrize("rows,width", [(2, 576), (5, 37), (300, 96), (33, 1536), (3, 40)])
def test_rms_norm(native, rows, width):
    g = torch.Generator().manual_seed(rows * width)
    x = torch.randn(rows, width, generator=g) * 3
    w = torch.randn(width, generator=g)
    want = torch.nn.functional.rms_norm(x, (width,), w, 1e-5)
    got = native.rms_norm(x, w, 1e-5)
    assert (got - want).abs().max().item() <= 1e-6 * want.abs().max().item()
    assert torch.equal(native.rms_norm(x[1:].contiguous(), w, 1e-5), got[1:])  # rows are independent


@pytest.mark.parametrize("dtype,window", [(torch.float32, None), (torch.float16, None), (torch.float32, 700)])
def test_long_contexts_run_in_chunks_alike_alone_and_in_a_batch(native, dtype, window):
    """Contexts past one softmax chunk (512 tokens: attention.h's kChunk), some sharing a cached
    320-token prefix and some alone, of one, two and three chunks (the last partial; a window of
    700 cuts them to two): each sequence's output is the reference's, and bit for bit its output
    when decoded alone, whether its chunks ran as items of their own or inside its shared-prefix
    group."""
    g = torch.Generator().manual_seed(77)
    hq, hkv, d, nb, bs = 6, 2, 64, 400, 16
    cache = torch.randn(2, nb, bs, hkv, d, generator=g).to(dtype)
    shared = torch.randperm(nb, generator=g)[:20].tolist()
    tables, lens = scattered_tables(g, nb, [shared] * 3 + [[]] * 3, [13, 30, 2, 70, 45, 3], bs)
    q = torch.randn(len(lens), hq, d, generator=g)
    scale = d ** -0.5
    want = paged_attention_ref(q, q[:, :hkv], q[:, :hkv], cache.float(), tables.int(), lens,
                               list(range(len(lens) + 1)), len(lens), scale, window)
    got = native.decode_attention(q, cache, tables, torch.tensor(lens), scale, int(window or 0))
    assert (got - want).abs().max().item() < 1e-5
    for b in range(len(lens)):
        alone = native.decode_attention(q[b:b + 1].contiguous(), cache, tables[b:b + 1], torch.tensor(lens[b:b + 1]),
                                        scale, int(window or 0))
        assert torch.equal(alone, got[b:b + 1]), b
