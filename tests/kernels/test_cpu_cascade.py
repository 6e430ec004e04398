"""Cascade prefill in bf16 (edgellm/attention/cpu_cascade.py) with each chunk's own tokens by the
C++ causal kernel: that part is fp32 math whatever the prefill dtype."""

from __future__ import annotations

import pytest
import torch

from edgellm.attention.cpu import CpuAttention
from edgellm.kernels.paged_attention import paged_attention_ref, write_kv_ref
from tests.helpers.isa_levels import vector_native


def _wave(seed: int, qlens: list[int], hq: int, hkv: int):
    """Chunks of qlens new tokens over a 96-token shared prefix whose keys every query scores at
    about -60 (positive queries, prefix keys -10 in every dim): the prefix holds no weight, so
    the output is the suffix attention alone."""
    g = torch.Generator().manual_seed(seed)
    bs, d, shared = 16, 64, 6
    cache = torch.zeros(2, 40, bs, hkv, d)
    cache[0, :shared] = -10.0
    cache[1, :shared] = torch.randn(shared, bs, hkv, d, generator=g)
    tables = torch.tensor([list(range(shared)) + [10 + 4 * i + j for j in range(4)] for i in range(len(qlens))],
                          dtype=torch.int32)
    lens = [shared * bs + n for n in qlens]
    keys, values = [], []
    for i, n in enumerate(qlens):
        kk, vv = torch.randn(n, hkv, d, generator=g), torch.randn(n, hkv, d, generator=g)
        slots = torch.tensor([int(tables[i, t // bs]) * bs + t % bs for t in range(shared * bs, lens[i])])
        write_kv_ref(kk, vv, cache, slots)
        keys.append(kk)
        values.append(vv)
    q = torch.randn(sum(qlens), hq, d, generator=g).abs()
    starts = [sum(qlens[:i]) for i in range(len(qlens) + 1)]
    return (q, torch.cat(keys), torch.cat(values), cache, tables, lens, starts, 0, d ** -0.5)


@pytest.mark.parametrize("qlens,hq,hkv", [([25, 9], 4, 2), ([13, 40, 7], 9, 3)])
def test_bf16_cascade_attends_its_own_tokens_in_fp32_by_the_cpp_kernel(qlens, hq, hkv):
    args = _wave(11, qlens, hq, hkv)
    want = paged_attention_ref(*args)
    step: dict = {}
    cpp = CpuAttention(vector_native(), torch.bfloat16, "flash", causal_kernel=True)
    assert cpp.native_prefill is not None
    got = cpp.paged(*args, step_cache=step)
    assert step[("cascade", 0)] == 6  # the shared-prefix path ran
    assert (got - want).abs().max().item() < 1e-5  # fp32: the prefix's weight is below fp32's resolution
    # torch's flash in bf16 for the same part: bf16's rounding, so the C++ path is what made it exact
    torch_only = CpuAttention(None, torch.bfloat16, "flash").paged(*args, step_cache={})
    assert 1e-4 < (torch_only - want).abs().max().item() < 5e-2
