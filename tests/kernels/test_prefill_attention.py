"""The C++ causal prefill attention (kernels/csrc/cpu/prefill_attention.cpp) against a plain fp32
softmax reference, on fresh random data at odd shapes: cold chunks, chunks after cached context,
the suffix part of shared-prefix attention (key_start past the prefix), GQA groups, head dims 64
to 256, pages in shuffled order; and its checks on bad input."""

from __future__ import annotations

import pytest
import torch

from edgellm.kernels import cpu_native
from tests.helpers.paged_kv import paged, reference


@pytest.fixture(scope="module")
def native():
    mod = cpu_native.load()
    assert mod is not None, "the C++ CPU kernels did not build (g++ and torch headers needed)"
    if mod.n16_variant() == "scalar":  # a hardware limit: the module builds, this kernel does not
        pytest.skip("this CPU has no AVX2: the causal prefill kernel is built only with vector units")
    return mod


@pytest.mark.parametrize("t,ctx,key_start,hq,hkv,d,bs", [
    (37, 37, 0, 6, 2, 64, 16),      # a cold prompt, GQA 3:1
    (21, 85, 32, 9, 3, 64, 16),     # a turn's suffix after a 32-token shared prefix
    (50, 130, 0, 4, 4, 96, 32),     # a chunk after cached context, no GQA, larger pages
    (16, 16, 0, 8, 2, 128, 16),     # exactly one tile
    (1, 45, 0, 2, 1, 256, 16),      # one query row (Gemma's head dim)
    (70, 70, 0, 3, 1, 64, 16),      # more query blocks than threads, partial last tile
])
def test_matches_the_softmax_reference(native, t, ctx, key_start, hq, hkv, d, bs):
    g = torch.Generator().manual_seed(t * 1000 + ctx)
    cache, table, k, v = paged(ctx, hkv, d, bs, g)
    q = torch.randn(t, hq, d, generator=g) * 2
    scale = d ** -0.5
    out, lse = native.prefill_attention(q, cache, table, ctx, key_start, scale)
    want, want_lse = reference(q, k, v, ctx, key_start, scale)
    assert out.shape == (t, hq, d) and lse.shape == (t, hq)
    assert (out.double() - want).abs().max().item() < 1e-5
    assert (lse.double() - want_lse).abs().max().item() < 1e-5


def test_strided_queries_and_a_nan_beyond_the_context(native):
    """q may be a token slice of a larger batch; whatever a page holds past the context (NaN here)
    never reaches the output."""
    g = torch.Generator().manual_seed(3)
    ctx, t, hq, hkv, d = 29, 29, 4, 2, 64
    cache, table, k, v = paged(ctx, hkv, d, 16, g)
    cache[:, table[-1], ctx % 16:] = float("nan")
    batch = torch.randn(t + 10, hq, d, generator=g)
    out, lse = native.prefill_attention(batch[5:5 + t], cache, table, ctx, 0, 0.125)
    want, want_lse = reference(batch[5:5 + t], k, v, ctx, 0, 0.125)
    assert torch.isfinite(out).all() and (out.double() - want).abs().max().item() < 1e-5


def test_bad_input_is_refused(native):
    g = torch.Generator().manual_seed(4)
    cache, table, _, _ = paged(40, 2, 64, 16, g)
    q = torch.randn(8, 4, 64, generator=g)
    with pytest.raises(RuntimeError, match="key_start"):
        native.prefill_attention(q, cache, table, 40, 8, 0.125)  # not a multiple of 16
    with pytest.raises(RuntimeError, match="outside the cache"):
        native.prefill_attention(q, cache, torch.tensor([0, 1, 99]), 40, 0, 0.125)
    with pytest.raises(RuntimeError, match="head dim"):
        native.prefill_attention(torch.randn(8, 4, 48), torch.randn(2, 4, 16, 2, 48), table, 40, 0, 0.125)


def test_many_chunks_in_one_call(native):
    """prefill_attention_many: chunks of different lengths, contexts and key starts (a cold prompt,
    two turns over one shared prefix's pages, a chunk after cached context), as one step's batch
    lays them out: each chunk's rows equal its own call bit for bit, and the reference."""
    g = torch.Generator().manual_seed(5)
    hq, hkv, d, bs = 6, 2, 64, 16
    cache = torch.randn(2, 40, bs, hkv, d, generator=g)
    pages = torch.randperm(40, generator=g)
    shared = pages[:4]  # 64 tokens every turn starts with
    # (T, ctx, key_start, the chunk's pages)
    chunks = [(23, 23, 0, pages[4:6]), (19, 83, 64, torch.cat((shared, pages[6:8]))),
              (7, 71, 64, torch.cat((shared, pages[8:9]))), (40, 100, 0, pages[10:17])]
    width = max(len(p) for *_, p in chunks)
    tables = torch.stack([torch.cat((p, p.new_zeros(width - len(p)))) for *_, p in chunks])
    starts = [0]
    for t, *_ in chunks:
        starts.append(starts[-1] + t)
    q = torch.randn(starts[-1], hq, d, generator=g)
    out, lse = native.prefill_attention_many(q, cache, tables, [c[1] for c in chunks], starts,
                                             [c[2] for c in chunks], 0.125)
    for i, (t, ctx, key_start, p) in enumerate(chunks):
        rows = slice(starts[i], starts[i + 1])
        one, one_lse = native.prefill_attention(q[rows], cache, p, ctx, key_start, 0.125)
        assert torch.equal(out[rows], one) and torch.equal(lse[rows], one_lse)
        k = cache[0, p].reshape(-1, hkv, d)[:ctx]
        v = cache[1, p].reshape(-1, hkv, d)[:ctx]
        want, want_lse = reference(q[rows], k, v, ctx, key_start, 0.125)
        assert (out[rows].double() - want).abs().max().item() < 1e-5
        assert (lse[rows].double() - want_lse).abs().max().item() < 1e-5
    with pytest.raises(RuntimeError, match="q_start"):
        native.prefill_attention_many(q, cache, tables, [23, 83, 71, 100], starts[:-1], [0, 64, 64, 0], 0.125)
    with pytest.raises(RuntimeError, match="chunk 1"):
        native.prefill_attention_many(q, cache, tables, [23, 18, 71, 100], starts, [0, 64, 64, 0], 0.125)
