"""Prefix attention from bf16 operands (edgellm/kernels/csrc/cpu/prefix_softmax.cpp and
edgellm/attention/cpu_prefix.py): the C++ scores and softmax numerators at every ISA level this CPU
can run against a float64 reference on fresh random data at odd shapes, and the "scores" prefix
kernel inside cascade prefill against the fp32 reference, as close as the bf16 flash kernel."""

from __future__ import annotations

import pytest
import torch

from edgellm.attention.cpu import CpuAttention
from edgellm.attention.cpu_prefix import flash, prefix_kernel, scores_softmax
from edgellm.kernels import cpu_native
from edgellm.kernels.paged_attention import paged_attention_ref
from tests.helpers.isa_levels import ISA_LEVELS, native_at


@pytest.fixture(scope="module", params=ISA_LEVELS)
def native(request):
    return native_at(request.param)


@pytest.mark.parametrize("b,m,n,d", [(3, 37, 53, 64), (2, 7, 16, 18), (1, 5, 3, 2), (2, 21, 130, 128)])
def test_scores_and_softmax_numerators(native, b, m, n, d):
    g = torch.Generator().manual_seed(b * 1000 + m + n + d)
    q = (torch.randn(b, m, d, generator=g) * 2).bfloat16()
    k = (torch.randn(b, n, d, generator=g) * 2).bfloat16()
    scale = d ** -0.5
    p, mx, denom = native.prefix_softmax_bf16(q, k, scale)
    assert p.dtype == torch.bfloat16 and p.shape == (b, m, n) and mx.shape == denom.shape == (b, m)
    s = torch.bmm(q.double(), k.double().transpose(1, 2)) * scale
    magnitude = torch.bmm(q.double().abs(), k.double().abs().transpose(1, 2)) * scale
    # the max score: exact products, fp32 sums in another order
    assert ((mx.double() - s.amax(-1)).abs() <= 1e-6 * magnitude.amax(-1) + 1e-6).all()
    e = (s - s.amax(-1, keepdim=True)).exp()
    # numerators: the score's fp32 sum-order error (< 1e-6 x magnitude, here < 1e-4 relative after
    # exp) and exp's few ulps, then one bf16 rounding (half an ulp of 8 significant bits: 2^-8)
    slack = 1e-6 * magnitude + 1e-6
    assert ((p.double() - e).abs() <= e * (2.0 ** -8 + slack + 1e-6)).all()
    assert ((denom.double() - e.sum(-1)).abs() <= (1e-5 + slack.amax(-1)) * e.sum(-1)).all()
    assert (p.double() != e).any()  # the bf16 rounding is real: not a trivially exact case


def test_bad_shapes_are_errors(native):
    q, k = torch.randn(1, 4, 8).bfloat16(), torch.randn(1, 5, 8).bfloat16()
    with pytest.raises(RuntimeError, match="bf16"):
        native.prefix_softmax_bf16(q.float(), k, 1.0)
    with pytest.raises(RuntimeError, match="D even"):
        native.prefix_softmax_bf16(q[..., :7].contiguous(), k[..., :7].contiguous(), 1.0)
    with pytest.raises(RuntimeError, match="like q"):
        native.prefix_softmax_bf16(q, torch.randn(2, 5, 8).bfloat16(), 1.0)


def test_scores_kernel_matches_bf16_flash():
    native = cpu_native.load()
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, r, 64, generator=g).bfloat16() for r in (75, 40, 40))
    o, lse = scores_softmax(native, q, k, v, 0.125)
    o_ref, lse_ref = flash(q.float(), k.float(), v.float(), None, 0.125)
    o_flash, _ = flash(q, k, v, None, 0.125)
    assert o.dtype == torch.bfloat16 and lse.dtype == torch.float32
    assert (lse - lse_ref).abs().max().item() < 1e-5
    err, err_flash = (o.float() - o_ref).abs().max().item(), (o_flash.float() - o_ref).abs().max().item()
    assert 0 < err < 2 * err_flash + 1e-3


def test_cascade_prefill_with_the_scores_kernel():
    """Three chunks over a 128-token cached prefix: the scores kernel gives the fp32 reference as
    closely as bf16 attention does (the same bound as the bf16 flash path's)."""
    native = cpu_native.load()
    g = torch.Generator().manual_seed(4)
    nb, bs, hq, hkv, d = 40, 16, 9, 3, 64
    cache = torch.zeros(2, nb, bs, hkv, d)
    flat = cache.view(2, -1, hkv, d)
    flat.copy_(torch.randn(flat.shape, generator=g))
    shared = list(range(8))
    owns = [[8, 9, 10], [11, 12], [13, 14, 15]]
    lens = [150, 140, 170]
    tables = torch.tensor([shared + own + [0] * (12 - 8 - len(own)) for own in owns], dtype=torch.int32)
    starts = [0, 20, 27, 67]
    q = torch.randn(67, hq, d, generator=g)
    k = torch.randn(67, hkv, d, generator=g)
    want = paged_attention_ref(q, k, k, cache, tables, lens, starts, 0, d ** -0.5)
    step: dict = {}
    got = CpuAttention(native, torch.bfloat16, "scores").paged(q, k, k, cache, tables, lens, starts, 0,
                                                               d ** -0.5, step_cache=step)
    assert step[("cascade", 0)] == 8
    assert 0 < (got - want).abs().max().item() < 2e-2 * want.abs().max().item()


def test_prefix_kernel_is_measured_where_it_applies():
    native = cpu_native.load()
    assert prefix_kernel(native, torch.float32) == "flash" and prefix_kernel(None, torch.bfloat16) == "flash"
    assert prefix_kernel(native, torch.bfloat16) in ("flash", "scores")


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
    (record,) = caplog.records
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
