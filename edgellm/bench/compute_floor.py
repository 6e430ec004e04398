"""The compute floor of a prefill step on CPU: its multiply-adds divided by this CPU's matmul rates.

`matmul_rates` measures what one large compute-bound product reaches on torch's threads, by dtype:
int8 x int8 -> int32 (torch._int_mm: oneDNN's VNNI / AMX kernels, no dequantization, no scales),
bf16 and fp32 (torch.matmul). `prefill_macs` counts a step's multiply-adds from a loaded model:
every decoder linear once per new token, and attention (scores and values) over the keys each new
token sees. A step's linears cannot run faster than their MACs at the int8 rate (edgellm's
integer-dot kernels also unpack codes and apply group scales), nor its attention faster than its
MACs at the rate of the dtype it runs in; the sum is the floor a measured step is compared with.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch


def _best_s(run: Callable[[], object], reps: int) -> float:
    from edgellm.quant.linear_kernels.cpu_int import _time

    run()  # warm-up: oneDNN builds its primitive on the first call
    return _time(run, reps)


def matmul_rates(m: int = 512, k: int = 2048, n: int = 2048, reps: int = 5) -> dict[str, float]:
    """GMAC/s of one [m, k] x [k, n] product per dtype ("int8", "bf16", "fp32"), best of `reps`
    on fresh random operands; a dtype torch cannot multiply here is left out."""
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(m, k, generator=g), torch.randn(k, n, generator=g)
    a16, b16 = a.bfloat16(), b.bfloat16()
    runs: dict[str, Callable[[], object]] = {"fp32": lambda: a @ b, "bf16": lambda: a16 @ b16}
    a8 = torch.randint(-127, 128, (m, k), generator=g, dtype=torch.int8)
    b8 = torch.randint(-127, 128, (k, n), generator=g, dtype=torch.int8)
    runs["int8"] = lambda: torch._int_mm(a8, b8)
    rates = {}
    for name, run in runs.items():
        try:
            rates[name] = m * k * n / _best_s(run, reps) / 1e9
        except RuntimeError:  # e.g. no int8 GEMM in this torch build
            continue
    return rates


def prefill_macs(
    model: Any, new_tokens: Sequence[int], contexts: Sequence[int]
) -> dict[str, float]:
    """Multiply-adds (in G) of one step that computes new_tokens[i] tokens ending at context
    length contexts[i] for each sequence i, in a loaded edgellm model: "linears" (every Linear of
    the decoder layers, once per new token; the logits head is left out: a prefill step computes
    one row of it per sequence) and "attention" (each new token's query heads against the keys up
    to and including its own position: scores and values, 2 x head_dim MACs per key; a
    sliding-window layer's keys capped at its window)."""
    from edgellm.layers.linear import Linear

    layers = model.model.layers
    per_token = sum(
        mod.input_size * mod.output_size
        for layer in layers
        for mod in layer.modules()
        if isinstance(mod, Linear)
    )
    attention = 0
    for layer in layers:
        att = layer.self_attn
        window = att.attn.sliding_window
        per_key = att.num_heads * att.head_dim * 2
        for t, ctx in zip(new_tokens, contexts, strict=True):
            for pos in range(ctx - t, ctx):
                attention += (pos + 1 if not window else min(pos + 1, window)) * per_key
    tokens = sum(new_tokens)
    return {"linears": tokens * per_token / 1e9, "attention": attention / 1e9}


def floor_ms(
    macs: dict[str, float], rates: dict[str, float], attention_dtype: str
) -> dict[str, float]:
    """ms the linears (at the int8 rate) and attention (at `attention_dtype`'s) take at least."""
    linears = macs["linears"] / rates["int8"] * 1e3 if "int8" in rates else float("nan")
    attention = macs["attention"] / rates[attention_dtype] * 1e3
    return {"linears": linears, "attention": attention, "total": linears + attention}
