"""The integer-dot logits head of CPU mode auto (edgellm/quant/linear_kernels/cpu_int_head.py and its C++
op, edgellm/kernels/csrc/cpu/logits_head.cpp) at every ISA level this CPU can run, on fresh random
weights and hidden states: the argmax is the fp32 head's, the window holds every fp32 logit, the
recomputed tokens carry fp32 values, a near-tie between two vocabulary rows whose int8 codes are
the same is settled in fp32, and a row with too many candidates is recomputed whole."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from edgellm.cpu_isa import CpuIsa, detect
from edgellm.kernels import cpu_native
from edgellm.quant.linear_kernels.cpu_int_head import IntDotLogitsHead
from tests.helpers.isa_levels import ISA_LEVELS

V, K = 3001, 192  # an odd vocabulary, six activation blocks


# the head's codes in the row layout, and in the n16 layout (VNNI, or scalar code below
# avx512) with, at level amx, its products on AMX tiles from the first row
CASES = [(lvl, lay) for lvl in ISA_LEVELS for lay in ("rows", "n16", "n16-amx") if lay != "n16-amx" or lvl == "amx"]


@pytest.fixture(scope="module", params=CASES, ids=lambda p: f"{p[0]}-{p[1]}")
def native(request):
    level, layout = request.param
    module = cpu_native.load(CpuIsa(level, detect()))
    assert module is not None, f"the C++ kernels did not build at level {level}"
    return module, layout


def _head(w: torch.Tensor, native) -> IntDotLogitsHead:
    module, layout = native
    head = IntDotLogitsHead(w, module, n16=layout != "rows")
    if layout == "n16-amx":
        head.amx_rows = 1
    return head


def _weight(g: torch.Generator) -> torch.Tensor:
    w = torch.randn(V, K, generator=g) * 0.05
    w[::97] *= 4  # rows of different scales, as an embedding has
    return w


def test_argmax_and_window(native):
    g = torch.Generator().manual_seed(1)
    w = _weight(g)
    head = _head(w, native)
    x = torch.randn(7, K, generator=g) * 2
    x[:, 5] *= 20  # an outlier channel: its block's other entries round coarsely
    want = F.linear(x, w)
    approx, hi, bound = head.approximate(x)
    assert ((approx - want).abs() <= bound).all()  # the window holds every fp32 logit
    got = head(x)
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    top = want.argmax(-1, keepdim=True)
    assert torch.allclose(got.gather(1, top), want.gather(1, top), rtol=1e-5, atol=1e-6)
    assert not torch.allclose(got, want, rtol=1e-5, atol=1e-6)  # the tail stays approximate
    # rows that need every logit (here the even ones) take the fp32 weight
    argmax_only = [i % 2 == 1 for i in range(7)]
    mixed = head(x, argmax_only)
    assert torch.equal(mixed[::2], want[::2]) and torch.equal(mixed.argmax(-1), want.argmax(-1))


def test_sampling_rows_take_the_int8_products(native):
    """Rows that sample at a temperature get every logit from the int8 products (within the
    window of the fp32 ones, not equal to them); argmax rows keep the fp32 argmax, the rest fp32."""
    g = torch.Generator().manual_seed(5)
    w = _weight(g)
    head = _head(w, native)
    x = torch.randn(5, K, generator=g) * 2
    want = F.linear(x, w)
    _, _, bound = head.approximate(x)
    got = head(x, [False, True, False, False, True], [True, False, False, True, True])
    sampled = [0, 3]
    assert torch.equal(got[sampled], head.int_dot(x[sampled]))
    assert ((got[sampled] - want[sampled]).abs() <= bound[sampled]).all()
    assert not torch.allclose(got[sampled], want[sampled], rtol=1e-5, atol=1e-6)
    assert torch.equal(got[2], want[2])  # neither: every logit in fp32
    assert torch.equal(got[[1, 4]].argmax(-1), want[[1, 4]].argmax(-1))  # argmax wins over sampling
    assert torch.equal(head(x[sampled], [False, False], [True, True]), head.int_dot(x[sampled]))


def test_a_q8_0_head_keeps_its_own_codes(native):
    """A head dequantized from GGUF Q8_0 blocks (32 int8 codes, an fp16 step) comes back as those
    codes and steps: no rounding of its own (err_ms 0), fp16 scales, and its products are the
    Q8_0 weight's up to the activations' int8 rounding."""
    g = torch.Generator().manual_seed(6)
    codes = torch.randint(-127, 128, (V, K // 32, 32), generator=g)
    codes[..., 0] = 127 * torch.where(torch.rand(V, K // 32, generator=g) < 0.5, -1, 1)  # Q8_0: amax -> +-127
    d = (torch.rand(V, K // 32, 1, generator=g) * 0.01 + 1e-4).half().float()
    w = (codes.float() * d).view(V, K)
    head = _head(w, native)
    assert head.err_ms == 0.0 and head.scale.dtype == torch.float16
    x = torch.randn(3, K, generator=g)
    _, _, bound = head.approximate(x)
    assert ((head.int_dot(x) - F.linear(x, w)).abs() <= bound).all()


def test_a_near_tie_is_settled_in_fp32(native):
    g = torch.Generator().manual_seed(2)
    w = _weight(g)
    x = torch.randn(3, K, generator=g)
    for i in range(3):
        t = int(F.linear(x[i:i + 1], w).argmax())
        twin = (t + 1 + i) % V
        w[twin] = w[t]
        w[twin, 0] += 1e-4 * (1 if x[i, 0] > 0 else -1) * (1 if i % 2 else -1)  # ahead or behind by ~1e-4
    head = _head(w, native)
    want = F.linear(x, w)
    assert torch.equal(head(x).argmax(-1), want.argmax(-1))


def test_too_many_candidates_recompute_the_row(native, monkeypatch):
    g = torch.Generator().manual_seed(3)
    w = _weight(g)
    head = _head(w, native)
    x = torch.randn(4, K, generator=g)
    monkeypatch.setattr(head, "MAX_CANDIDATES", 0)
    got, want = head(x), F.linear(x, w)
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-6) and torch.equal(got.argmax(-1), want.argmax(-1))


def test_masked_argmax_is_the_fp32_heads(native):
    """Greedy rows under a grammar: with the mask applied inside the head, the argmax over the
    allowed tokens is the fp32 head's, the disallowed tokens are -inf, the winner carries its fp32
    value; masks that drop the unmasked maximum, leave a handful of tokens, or a near-tie."""
    g = torch.Generator().manual_seed(5)
    w = _weight(g)
    head = _head(w, native)
    x = torch.randn(6, K, generator=g) * 2
    want = F.linear(x, w)
    allowed = torch.rand(6, V, generator=g) < 0.5
    allowed[0] = True
    allowed[1, want[1].argmax()] = False  # the free maximum is not allowed
    allowed[2] = False
    allowed[2, torch.randperm(V, generator=g)[:3]] = True  # three tokens
    order = want[3].argsort(descending=True)
    w[order[1]] = w[order[0]] + 1e-7 * torch.randn(K, generator=g)  # a near-tie among allowed tokens
    head = _head(w, native)
    want = F.linear(x, w)
    allowed[3] = False
    allowed[3, order[:2]] = True
    ref = want.masked_fill(~allowed, float("-inf"))
    top = ref.argmax(-1, keepdim=True)
    for got in (head.masked(x, _bitmask(allowed)), head.masked_ref(x, allowed)):
        assert torch.equal(got.argmax(-1), ref.argmax(-1))
        assert torch.isinf(got[~allowed]).all() and torch.isfinite(got[allowed]).all()
        assert torch.allclose(got.gather(1, top), ref.gather(1, top), rtol=1e-5, atol=1e-6)


def _bitmask(allowed: torch.Tensor) -> torch.Tensor:
    """bool [M, V] -> int32 [M, ceil(V / 32)], bit j of word i = token 32 i + j (xgrammar's)."""
    pad = -allowed.shape[1] % 32
    bits = np.packbits(np.pad(allowed.numpy(), ((0, 0), (0, pad))), axis=-1, bitorder="little")
    return torch.from_numpy(bits.view("<i4").copy())


def test_masked_head_takes_an_xgrammar_bitmask(native):
    """The bitmask the grammar service hands the head (xgrammar's own, for a real grammar) gives
    the same tokens -inf as xgrammar's own apply_token_bitmask_inplace."""
    import xgrammar as xgr

    g = torch.Generator().manual_seed(9)
    w = _weight(g)
    head = _head(w, native)
    x = torch.randn(2, K, generator=g)
    allowed = torch.rand(2, V, generator=g) < 0.3
    bits = _bitmask(allowed)
    want = F.linear(x, w)
    xgr.apply_token_bitmask_inplace(want, bits, vocab_size=V)
    got = head.masked(x, bits)
    assert torch.equal(torch.isinf(got), torch.isinf(want)) and torch.equal(got.argmax(-1), want.argmax(-1))


def test_matmul_warm_up_takes_a_model_with_the_int8_head(native):
    """warm_matmul_shapes (run at every server start) on a model whose logits head is the int8
    one: that head keeps no bf16 oneDNN copy, so nothing of it is warmed and nothing fails."""
    from edgellm.quant.linear_kernels.cpu_fast import warm_matmul_shapes

    model = torch.nn.Module()
    model.fast_logits = _head(_weight(torch.Generator().manual_seed(5)), native)
    assert warm_matmul_shapes(model, 64, 8) == 0


def test_a_row_alone_and_in_a_batch_give_the_same_logits(native):
    """A batch of rows at least as many as the threads finishes each row on one thread, a single
    row over all of them: the same window, candidates and fp32 rechecks, so the same values."""
    g = torch.Generator().manual_seed(11)
    w = _weight(g)
    head = _head(w, native)
    x = torch.randn(9, K, generator=g) * 2
    allowed = torch.rand(9, V, generator=g) < 0.7
    batch, masked = head(x), head.masked(x, _bitmask(allowed))
    for i in range(9):
        assert torch.equal(head(x[i:i + 1])[0], batch[i])
        assert torch.equal(head.masked(x[i:i + 1], _bitmask(allowed[i:i + 1]))[0], masked[i])
    assert torch.equal(batch.argmax(-1), F.linear(x, w).argmax(-1))
