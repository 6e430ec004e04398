"""Layer building blocks against transformers' own implementations, bit for bit in fp32: the
fused RMSNorm and the joint q/k rotation must change speed only."""

from __future__ import annotations

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb

from edgellm.layers.norm import RMSNorm
from edgellm.layers.rotary import RotaryEmbedding


@pytest.mark.parametrize("hidden, tokens", [(64, 1), (96, 7), (576, 33), (3072, 5)])
def test_rmsnorm_equals_transformers_bitwise(hidden, tokens):
    g = torch.Generator().manual_seed(hidden + tokens)
    x = torch.randn(tokens, hidden, generator=g) * 3
    ref = LlamaRMSNorm(hidden, eps=1e-5)
    ref.weight.data = torch.randn(hidden, generator=g)
    ours = RMSNorm(hidden, 1e-5)
    ours.weight.data = ref.weight.data.clone()
    assert torch.equal(ours(x), ref(x))
    # bf16 keeps the transformers formula (fp32 math, cast back, then the weight)
    ref_bf, ours_bf = ref.to(torch.bfloat16), RMSNorm(hidden, 1e-5, torch.bfloat16)
    ours_bf.weight.data = ref_bf.weight.data.clone()
    assert torch.equal(ours_bf(x.bfloat16()), ref_bf(x.bfloat16()))


@pytest.mark.parametrize("heads, kv_heads, head_dim, partial", [(4, 2, 16, 1.0), (5, 1, 32, 1.0), (3, 3, 32, 0.5)])
def test_joint_qk_rotation_equals_separate_and_transformers(heads, kv_heads, head_dim, partial):
    g = torch.Generator().manual_seed(heads * 100 + head_dim)
    rot = RotaryEmbedding(head_dim, 256, 10000.0, None, partial)
    pos = torch.randint(0, 256, (11,), generator=g)
    cos, sin = rot.cos_sin_for(pos, None, torch.float32)
    q = torch.randn(11, heads, head_dim, generator=g)
    k = torch.randn(11, kv_heads, head_dim, generator=g)
    qk = rot.rotate(torch.cat((q, k), dim=1), cos, sin)
    q1, k1 = rot.apply(q, k, cos, sin)
    assert torch.equal(qk[:, :heads], q1) and torch.equal(qk[:, heads:], k1)
    if partial == 1.0:  # transformers: [B, H, T, D] with cos/sin [B, T, D]
        rq, rk = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                      cos[:, 0][None], sin[:, 0][None])
        assert torch.equal(q1, rq[0].transpose(0, 1)) and torch.equal(k1, rk[0].transpose(0, 1))
