"""Attention of many queries over keys they all see in full (no mask): the cached shared prefix of
cascade prefill (edgellm/attention/cpu.py). Two ways, returning (output, logsumexp) alike:

- "flash": torch's CPU flash-attention op in the prefill dtype;
- "scores": the scores from the C++ bf16 product into fp32 and their softmax numerators in bf16
  (kernels/csrc/cpu/prefix_softmax.cpp, one vdpbf16ps per two dims of 16 keys), then numerators x
  values as a bf16 matmul (oneDNN). Where the CPU has AVX512-BF16 but no AMX, torch's bf16 flash
  runs at fp32 speed while these two products use the bf16 dot units.

Which one a load uses is measured once per process on a representative shape (`prefix_kernel`),
never assumed from the CPU's name.
"""

from __future__ import annotations

import functools
import logging
import time
from typing import Any

import torch

logger = logging.getLogger(__name__)


def flash(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    causal: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(output [1, Hq, Lq, D], logsumexp [1, Hq, Lq] fp32) of softmax(q k^T * scale + mask) v
    (causal: query i sees keys 0..i); GQA by repeating the kv heads (the CPU flash op takes
    equal heads)."""
    group = q.shape[1] // k.shape[1]
    if group > 1:
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    out = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, causal, attn_mask=mask, scale=scale
    )
    return out[0], out[1].float()


def scores_softmax(
    native: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """flash(q, k, v, None, scale) for bf16 q [1, H, Lq, D], k/v [1, H, Lk, D] (equal heads):
    fp32 scores and softmax (one C++ pass), the softmax numerators rounded to bf16 for the
    product with v (as a bf16 flash kernel does); output bf16, logsumexp fp32."""
    p, mx, denom = native.prefix_softmax_bf16(q[0].contiguous(), k[0].contiguous(), float(scale))
    o = torch.matmul(p, v[0]).float().div_(denom.unsqueeze(-1))
    return o.to(torch.bfloat16)[None], mx.add_(denom.log_())[None]


def prefix_attention(
    kernel: str,
    native: Any,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """All queries over all keys by `kernel` ("flash" or "scores")."""
    if kernel == "scores":
        return scores_softmax(native, q, k, v, scale)
    return flash(q, k, v, None, scale)


@functools.lru_cache(maxsize=8)
def prefix_kernel(native: Any, dtype: torch.dtype) -> str:
    """The faster of "flash" and "scores" for prefix attention in `dtype` on this CPU, measured
    on a voice wave's shape (2 kv heads of 64 dims, 1024 query rows of the folded GQA groups,
    256 prefix keys), best of 3 each; "flash" where "scores" does not apply (fp32, no native)."""
    if native is None or dtype != torch.bfloat16 or not hasattr(native, "prefix_softmax_bf16"):
        return "flash"
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 2, 1024, 64, generator=g).to(dtype)
    k, v = (torch.randn(1, 2, 256, 64, generator=g).to(dtype) for _ in range(2))

    def best(kernel: str) -> float:
        times = []
        for _ in range(4):
            t0 = time.perf_counter()
            prefix_attention(kernel, native, q, k, v, 0.125)
            times.append(time.perf_counter() - t0)
        return min(times[1:])

    t_flash, t_scores = best("flash"), best("scores")
    chosen = "scores" if t_scores < t_flash else "flash"
    logger.info(
        "prefix attention in bf16: flash %.2f ms, scores %.2f ms: %s",
        t_flash * 1e3,
        t_scores * 1e3,
        chosen,
    )
    return chosen
