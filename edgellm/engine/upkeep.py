"""Upkeep of the engine thread outside its steps: on CPU, oneDNN's matmul primitives built for
every step size when the engine starts (`warm_matmuls`), the start-up heap taken out of the
garbage collector's reach (`freeze_startup_heap`), and freed heap handed back to the OS once the
engine has been idle `TRIM_AFTER_IDLE_S` (`release_memory`)."""

from __future__ import annotations

import ctypes
import gc
import logging
import sys
import time
from typing import Any

from edgellm.engine.engine import LLMEngine

logger = logging.getLogger(__name__)

TRIM_AFTER_IDLE_S = 1.0
_malloc_trim: Any = None


def warm_matmuls(engine: LLMEngine) -> None:
    """CPU fast mode: build oneDNN's matmul primitives for every step size now rather than in the
    first requests of each size (edgellm/quant/linear_kernels/cpu_fast.warm_matmul_shapes)."""
    from edgellm.quant.linear_kernels.cpu_fast import warm_matmul_shapes

    if not str(engine.config.device).startswith("cpu"):
        return
    t0 = time.perf_counter()
    runs = warm_matmul_shapes(
        engine.runner.model, engine.config.max_num_batched_tokens, engine.config.max_num_seqs
    )
    if runs:
        logger.info("built %d matmul shapes in %.1f s", runs, time.perf_counter() - t0)


def freeze_startup_heap() -> int:
    """Collect once, then move every object alive now (the model, the tokenizer, transformers and
    torch modules: ~230k tracked objects with the default model) to the collector's permanent
    generation, so the full collections that serving triggers from time to time no longer walk
    them. Unfrozen, one full collection of that heap takes ~110 ms, all other work of the process
    stopped: in the engine a step, in the API server every stream's next token
    (benchmarks/gc_pauses.py). For a serving process, once its load is done; it returns how many
    objects are frozen. (vLLM freezes its start-up heap the same way.)"""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def release_memory() -> None:
    """Return freed heap to the OS (glibc keeps it: large temporaries of long prefills fragment the
    heap and RSS creeps up, though nothing leaks). Only run when the engine is idle. (No
    gc.collect here: with transformers loaded a full collection is slow.)"""
    global _malloc_trim
    if _malloc_trim is None:
        _malloc_trim = False
        if sys.platform.startswith("linux"):
            try:
                _malloc_trim = ctypes.CDLL("libc.so.6").malloc_trim
            except (OSError, AttributeError):  # not glibc (musl has no malloc_trim)
                pass
    if _malloc_trim:
        _malloc_trim(0)
