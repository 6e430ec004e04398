"""Shared-prefix prefill attention in one pass per query row (edgellm/kernels/csrc/cpu/
cascade_attention.cpp, chosen by edgellm/attention/cpu_prefix.py): the C++ op in bf16 and in fp32 at
every ISA level this CPU can run against a float64 reference of the same arithmetic on fresh random
pages at odd shapes, inside cascade prefill against the fp32 reference, and the load-time choices
of prefill attention."""

from __future__ import annotations

import pytest
import torch

from edgellm.attention.cpu import CpuAttention
from edgellm.attention.cpu_prefix import prefix_kernel
from edgellm.kernels import cpu_native
from edgellm.kernels.paged_attention import paged_attention_ref
from tests.helpers.isa_levels import ISA_LEVELS, native_at


@pytest.fixture(scope="module", params=ISA_LEVELS)
def native(request):
    return native_at(request.param)


def _bf16(t: torch.Tensor) -> torch.Tensor:
    return t.float().bfloat16().double()


def _pages(seed, prefix, owns, hkv, d, dtype, bs=16):
    """A paged cache with a shared prefix (blocks 0 .. prefix / bs) and per chunk `owns[c]` keys
    of its own after it, in blocks scattered past the prefix; (cache, tables [C, W] int64)."""
    g = torch.Generator().manual_seed(seed)
    own_blocks = [-(-n // bs) for n in owns]
    nb = prefix // bs + sum(own_blocks) + 3
    cache = (torch.randn(2, nb, bs, hkv, d, generator=g) * 1.5).to(dtype)
    free = list(range(prefix // bs, nb))
    free = [free[i] for i in torch.randperm(len(free), generator=g).tolist()]
    width = prefix // bs + max(own_blocks)
    rows = []
    for n in own_blocks:
        mine, free = free[:n], free[n:]
        rows.append(list(range(prefix // bs)) + mine + [0] * (width - prefix // bs - n))
    return cache, torch.tensor(rows, dtype=torch.int64)


def _reference(q, cache, tables, ctx, starts, scale, bf16):
    """The op's contract in float64: bf16 operands and softmax numerators (bf16) or fp32 ones;
    also each row's sum of e |v| / l (for the rounding bound)."""
    r = _bf16 if bf16 else (lambda t: t.double())
    hq, d = q.shape[1], q.shape[2]
    hkv, bs = cache.shape[3], cache.shape[2]
    out = torch.empty(q.shape, dtype=torch.float64)
    mag = torch.empty(q.shape[:2], dtype=torch.float64)
    for c in range(len(ctx)):
        pos = torch.arange(ctx[c])
        slots = tables[c, pos // bs] * bs + pos % bs
        k = r(cache[0].reshape(-1, hkv, d)[slots].float())  # [ctx, Hkv, D]
        v = r(cache[1].reshape(-1, hkv, d)[slots].float())
        t = starts[c + 1] - starts[c]
        for i in range(t):
            seen = ctx[c] - t + i + 1
            for h in range(hq):
                kv = h // (hq // hkv)
                s = (r(q[starts[c] + i, h]) @ k[:seen, kv].T) * scale
                e = (s - s.max()).exp()
                l = e.sum()
                out[starts[c] + i, h] = (r(e) @ v[:seen, kv]) / l
                mag[starts[c] + i, h] = (e @ v[:seen, kv].abs().amax(-1)) / l
    return out, mag


@pytest.mark.parametrize("bf16", [True, False])
@pytest.mark.parametrize("prefix,owns,turns,hq,hkv,d,dtype", [
    (64, [7, 30, 16], [7, 12, 16], 9, 3, 64, torch.float16),  # own history cached before chunk 1's turn
    (32, [5, 41], [5, 41], 4, 2, 128, torch.float32),
    (48, [3], [2], 2, 1, 96, torch.float16),
])
def test_cascade_attention_against_the_reference(native, prefix, owns, turns, hq, hkv, d, dtype, bf16):
    cache, tables = _pages(prefix + sum(owns) + hq, prefix, owns, hkv, d, dtype)
    g = torch.Generator().manual_seed(len(owns) * 7 + d)
    starts = [sum(turns[:i]) for i in range(len(turns) + 1)]
    wide = torch.randn(starts[-1], hq + 3, d, generator=g) * 1.5  # q rows strided, as a qkv view is
    q = wide[:, :hq]
    ctx = [prefix + n for n in owns]
    scale = d ** -0.5
    got = native.cascade_attention(q, cache, tables, ctx, starts, prefix, scale, bf16)
    want, mag = _reference(q, cache, tables, ctx, starts, scale, bf16)
    assert got.shape == q.shape and got.dtype == torch.float32
    # bf16: each probability may round to a neighbouring bf16 (its fp32 score sums in another order,
    # exp within a few ulp): at most 2^-7 of its weight; fp32: sums in another order, exp's ulps
    bound = (2.0 ** -7 if bf16 else 1e-5) * mag[..., None] + 1e-5
    assert ((got.double() - want).abs() <= bound).all()
    fp32 = paged_attention_ref(q.contiguous(), None, None, cache.float(), tables, ctx, starts, 0, scale)
    err = (got - fp32).abs().max().item()
    if bf16:  # bf16 is real, and no worse than bf16 attention
        assert 0 < err < 2e-2 * fp32.abs().max().item()
    else:
        assert err < 1e-5 * fp32.abs().max().item()


def test_bad_inputs_are_errors(native):
    cache, tables = _pages(1, 32, [8, 8], 2, 64, torch.float32)
    q = torch.randn(8, 4, 64)
    args = (cache, tables, [40, 40], [0, 4, 8])
    with pytest.raises(RuntimeError, match="prefix"):
        native.cascade_attention(q, *args, 24, 0.125, True)  # not a multiple of 16
    with pytest.raises(RuntimeError, match="prefix wholly before"):
        native.cascade_attention(q, cache, tables, [40, 40], [0, 4, 8], 48, 0.125, False)
    with pytest.raises(RuntimeError, match="head dim"):
        native.cascade_attention(q[..., :32].contiguous(), cache[..., :32].contiguous(), tables,
                                 [40, 40], [0, 4, 8], 32, 0.125, True)
    with pytest.raises(RuntimeError, match="fp32 or fp16"):
        native.cascade_attention(q, cache.to(torch.float8_e4m3fn), *args[1:], 32, 0.125, True)
    bad = tables.clone()
    bad[1, 2] = 10_000
    with pytest.raises(RuntimeError, match="outside the cache"):
        native.cascade_attention(q, cache, bad, [40, 40], [0, 4, 8], 32, 0.125, False)


def test_prefix_kernel_is_measured_where_it_applies(caplog):
    """Measured in bf16 and fp32 (both times logged); "flash" without the C++ module."""
    import logging

    native = cpu_native.load()
    assert prefix_kernel(None, torch.bfloat16) == "flash" and prefix_kernel(None, torch.float32) == "flash"
    prefix_kernel.cache_clear()
    with caplog.at_level(logging.INFO, logger="edgellm.attention.cpu_prefix"):
        chosen = {dt: prefix_kernel(native, dt) for dt in (torch.bfloat16, torch.float32)}
    assert set(chosen.values()) <= {"flash", "scores"}
    if native.n16_variant() != "scalar":
        logged = [r.getMessage() for r in caplog.records if r.getMessage().startswith("cascade prefill")]
        assert len(logged) == 2 and all("flash" in m and "scores" in m for m in logged)


def test_prefill_dtype_is_measured_only_with_bf16_units(caplog):
    """Without bf16 units fp32, unmeasured; with them the faster of the two, with both times logged."""
    import logging

    from edgellm.attention.cpu_dtype import prefill_dtype

    native = cpu_native.load()
    prefill_dtype.cache_clear()
    with caplog.at_level(logging.INFO, logger="edgellm.attention.cpu_dtype"):
        assert prefill_dtype(native, False) == torch.float32
        assert not caplog.records
        chosen = prefill_dtype(native, True)
    assert chosen in (torch.float32, torch.bfloat16)
    (record,) = [r for r in caplog.records if r.getMessage().startswith("prefill attention:")]
    assert "fp32" in record.getMessage() and "bf16" in record.getMessage()
    prefill_dtype.cache_clear()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_causal_kernel_is_chosen_by_measurement(caplog, dtype):
    """The C++ causal prefill kernel runs only where it measured faster than torch's flash in the
    prefill dtype (logged), never without the C++ module or without a prefill dtype."""
    import logging

    from edgellm.attention.cpu import CpuAttention
    from edgellm.attention.cpu_dtype import causal_kernel

    native = cpu_native.load()
    assert causal_kernel(None, dtype) is False
    causal_kernel.cache_clear()
    with caplog.at_level(logging.INFO, logger="edgellm.attention.cpu_dtype"):
        chosen = causal_kernel(native, dtype)
    if native is not None and native.n16_variant() != "scalar":
        (record,) = caplog.records
        name = "bf16" if dtype == torch.bfloat16 else "fp32"
        assert "C++" in record.getMessage() and "torch flash" in record.getMessage() and name in record.getMessage()
    assert (CpuAttention(native, dtype).native_prefill is not None) is chosen
    assert CpuAttention(native, None, causal_kernel=True).native_prefill is None  # exact mode: the reference


@pytest.mark.parametrize("prefill_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16])
def test_cascade_prefill_with_the_scores_kernel(cache_dtype, prefill_dtype):
    """Three chunks over a 128-token cached prefix through CpuAttention: the one-pass kernel gives
    the fp32 reference as closely as bf16 attention does in bf16, and equals it in fp32, from fp32
    and from fp16 pages."""
    native = cpu_native.load()
    g = torch.Generator().manual_seed(4)
    nb, bs, hq, hkv, d = 40, 16, 9, 3, 64
    cache = torch.zeros(2, nb, bs, hkv, d)
    flat = cache.view(2, -1, hkv, d)
    flat.copy_(torch.randn(flat.shape, generator=g))
    cache = cache.to(cache_dtype)
    shared = list(range(8))
    owns = [[8, 9, 10], [11, 12], [13, 14, 15]]
    lens = [150, 140, 170]
    tables = torch.tensor([shared + own + [0] * (12 - 8 - len(own)) for own in owns], dtype=torch.int32)
    starts = [0, 20, 27, 67]
    q = torch.randn(67, hq, d, generator=g)
    k = torch.randn(67, hkv, d, generator=g)
    want = paged_attention_ref(q, k, k, cache.float(), tables, lens, starts, 0, d ** -0.5)
    step: dict = {}
    got = CpuAttention(native, prefill_dtype, "scores").paged(q, k, k, cache, tables, lens, starts, 0,
                                                              d ** -0.5, step_cache=step)
    assert step[("cascade", 0)] == 8
    err = (got - want).abs().max().item()
    if prefill_dtype == torch.bfloat16:
        assert 0 < err < 2e-2 * want.abs().max().item()
    else:
        assert err < 1e-5 * want.abs().max().item()
