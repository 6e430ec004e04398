"""What CPU prefill attention runs (mode auto), measured once per process where it is a choice,
never assumed from the CPU's flags: its dtype (`prefill_dtype`), and whether the C++ causal
kernel over the pages (fp32 math, whatever the prefill dtype) beats torch's flash in that dtype
(`causal_kernel`).

Without bf16 units a bf16 product is emulated, far slower than fp32: fp32, nothing to measure.
With them (AMX, AVX512-BF16) bf16 is usually the faster, but not on every such CPU (the README
names one where torch's bf16 flash attention is slower than its fp32). So both dtypes are timed
on representative shapes, a prompt's causal attention (a cold 256-token prompt and a 48-token
turn after cached context; each dtype by its faster path, the C++ kernel or torch's flash) and a
voice wave's cascade prefill (8 turns of 32 tokens over a 256-token cached prefix, by the prefix
kernel `prefix_kernel` picks for that dtype), and the dtype with the smaller sum wins.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from typing import Any

import torch

from edgellm.attention.cpu_prefix import flash, prefix_kernel

logger = logging.getLogger(__name__)


def _best_ms(run: Callable[[], object], reps: int = 3) -> float:
    run()  # warm-up
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    return min(times) * 1e3


def _wave_ms(native: Any, dtype: torch.dtype) -> float:
    """A voice wave's cascade prefill in `dtype` (edgellm/attention/cpu_cascade.wave_ms), by the
    prefix kernel chosen for that dtype."""
    from edgellm.attention.cpu_cascade import wave_ms

    return wave_ms(native, dtype, prefix_kernel(native, dtype))


def _causal_cost_ms(native: Any | None, dtype: torch.dtype = torch.float32) -> float:
    """A cold 256-token prompt and a 48-token turn after 256 cached tokens, GQA 2:1, 64 dims: by the
    C++ kernel over pages (native; fp32) or torch's flash over the keys in `dtype` (None)."""
    g = torch.Generator().manual_seed(1)
    cache = torch.randn(2, 20, 16, 2, 64, generator=g)
    table = torch.arange(20)
    k, v = cache[0].reshape(-1, 2, 64), cache[1].reshape(-1, 2, 64)
    total = 0.0
    for ctx, t in ((256, 256), (304, 48)):
        q = torch.randn(t, 4, 64, generator=g)
        if native is not None:
            run = functools.partial(native.prefill_attention, q, cache, table, ctx, ctx - t, 0.125)
        else:
            qh = q.transpose(0, 1)[None].to(dtype)
            kh, vh = (x[ctx - t : ctx].transpose(0, 1)[None].to(dtype) for x in (k, v))
            run = functools.partial(flash, qh, kh, vh, None, 0.125, causal=True)
        total += _best_ms(run)
    return total


@functools.lru_cache(maxsize=4)
def _native_causal_ms(native: Any) -> float | None:
    """The C++ kernel's probe time, or None where it cannot run (no module, a scalar build)."""
    usable = (
        native is not None
        and hasattr(native, "prefill_attention")
        and native.n16_variant() != "scalar"
    )
    return _causal_cost_ms(native) if usable else None


@functools.lru_cache(maxsize=4)
def _flash_causal_ms(dtype: torch.dtype) -> float:
    """torch's flash's probe time in `dtype`."""
    return _causal_cost_ms(None, dtype)


def _best_causal_ms(native: Any, dtype: torch.dtype) -> float:
    ours = _native_causal_ms(native)
    theirs = _flash_causal_ms(dtype)
    return theirs if ours is None else min(ours, theirs)


@functools.lru_cache(maxsize=4)
def prefill_dtype(native: Any, bf16_units: bool) -> torch.dtype:
    """bf16 or fp32 for prefill attention on this CPU (fp32 without bf16 units); each dtype's
    causal part is timed by its faster path (the C++ kernel or torch's flash in that dtype), as
    it would run."""
    if not bf16_units:
        return torch.float32
    fp32 = _best_causal_ms(native, torch.float32) + _wave_ms(native, torch.float32)
    bf16 = _best_causal_ms(native, torch.bfloat16) + _wave_ms(native, torch.bfloat16)
    chosen = torch.bfloat16 if bf16 < fp32 else torch.float32
    logger.info(
        "prefill attention: fp32 %.2f ms, bf16 %.2f ms (a prompt, a turn, a voice wave): %s",
        fp32,
        bf16,
        "bf16" if chosen == torch.bfloat16 else "fp32",
    )
    return chosen


@functools.lru_cache(maxsize=4)
def causal_kernel(native: Any, dtype: torch.dtype) -> bool:
    """Whether prefill chunks of prefill dtype `dtype` run their causal attention (a cold prompt,
    and each chunk's own tokens in cascade prefill) by the C++ kernel over the pages
    (csrc/cpu/prefill_attention.cpp, fp32 math) rather than torch's flash in `dtype`: a build with
    vector units, and measured faster here."""
    ours = _native_causal_ms(native)
    if ours is None:
        return False
    theirs = _flash_causal_ms(dtype)
    name = "bf16" if dtype == torch.bfloat16 else "fp32"
    logger.info(
        "causal prefill attention (%s): C++ %.2f ms, torch flash %.2f ms: %s",
        name,
        ours,
        theirs,
        "C++" if ours < theirs else "torch",
    )
    return ours < theirs
