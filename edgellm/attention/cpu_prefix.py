"""How cascade prefill attends a cached shared prefix on CPU (edgellm/attention/cpu_cascade.py),
two ways:

- "flash": torch's CPU flash-attention op in the prefill dtype over the prefix, each chunk's own
  tokens apart (the C++ causal kernel or flash), merged by log-sum-exp;
- "scores": one C++ pass per query row over the prefix and the chunk's own keys together
  (kernels/csrc/cpu/cascade_attention.cpp: fp32 softmax, no merge), in bf16 products (vdpbf16ps
  for the scores and for the values: where the CPU has AVX512-BF16 but no AMX, torch's bf16 flash
  runs at fp32 speed while this uses the bf16 dot units) or in fp32 (FMA; CPUs without bf16 units).

Which one a load uses is measured once per process on a voice wave's shape over pages
(`prefix_kernel`), never assumed from the CPU's name.
"""

from __future__ import annotations

import functools
import logging
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


@functools.lru_cache(maxsize=8)
def prefix_kernel(native: Any, dtype: torch.dtype) -> str:
    """The faster of "flash" and "scores" for cascade prefill in `dtype` (bf16 or fp32) on this
    CPU, each timed on the same voice wave over pages (edgellm/attention/cpu_cascade.wave_ms);
    "flash" where "scores" does not apply (no native module, a build without vector units)."""
    if (
        native is None
        or dtype not in (torch.bfloat16, torch.float32)
        or not hasattr(native, "cascade_attention")
        or native.n16_variant() == "scalar"
    ):
        return "flash"
    from edgellm.attention.cpu_cascade import wave_ms

    t_flash, t_scores = wave_ms(native, dtype, "flash"), wave_ms(native, dtype, "scores")
    chosen = "scores" if t_scores < t_flash else "flash"
    logger.info(
        "cascade prefill attention in %s: flash %.2f ms, scores %.2f ms: %s",
        "bf16" if dtype == torch.bfloat16 else "fp32",
        t_flash,
        t_scores,
        chosen,
    )
    return chosen
