"""The decode roofline of an edgellm model on CPU: the weight bytes one decode step reads, which
divided into the memory read bandwidth (edgellm/bench/machine.py) bound single-stream tokens/s."""

from __future__ import annotations

import gc
import os
from pathlib import Path
from typing import Any

from edgellm import env


def decode_weight_bytes(model: Any) -> dict[str, int]:
    """Bytes of weights one decode step reads in a loaded edgellm model: every linear once
    (what its kernel reads for a decode-sized step: packed int4 codes + scales for the int4
    GEMV, else its matrix), the norms, one embedding row, and the matrix the logits
    multiply by (lm_head, or the embedding when tied)."""
    from edgellm.layers.linear import Linear

    def nbytes(t: Any) -> int:
        return t.numel() * t.element_size() if t is not None and hasattr(t, "element_size") else 0

    linear = norms = 0
    for module in model.modules():
        if isinstance(module, Linear):
            kernel = getattr(module, "kernel", None)
            if kernel is not None and hasattr(kernel, "packed"):  # the CPU int4 GEMV
                linear += nbytes(kernel.packed) + nbytes(getattr(kernel, "scale_zero", None))
            elif kernel is not None and hasattr(
                kernel, "qweight"
            ):  # integer dots: codes, scales, offsets
                linear += nbytes(kernel.qweight) + nbytes(kernel.scale) + nbytes(kernel.offset)
            elif kernel is not None:
                linear += sum(
                    nbytes(v) for v in vars(kernel).values() if hasattr(v, "element_size")
                )
            else:
                linear += sum(nbytes(p) for p in module.parameters(recurse=False))
                linear += sum(nbytes(b) for b in module.buffers(recurse=False))
            if getattr(module, "bias", None) is not None and kernel is not None:
                linear += nbytes(module.bias)
        elif "norm" in type(module).__name__.lower():
            norms += sum(nbytes(p) for p in module.parameters(recurse=False))
    emb = model.model.embed_tokens.weight
    head = (
        nbytes(emb) if getattr(model, "lm_head", None) is None else 0
    )  # tied: logits read the embedding
    fast_head = getattr(model, "fast_logits", None)
    if (
        fast_head is not None
    ):  # the CPU int8 logits head reads its int8 codes and row scales instead
        head = nbytes(fast_head.codes) + nbytes(
            getattr(fast_head, "scales", getattr(fast_head, "scale", None))
        )
    row = emb.shape[1] * emb.element_size()
    return {
        "linears": linear,
        "norms": norms,
        "tied_logits_matrix": head,
        "embedding_row": row,
        "total": linear + norms + head + row,
    }


def edgellm_roofline_bytes(cpu_kernels: str | None, model_path: Path | None) -> dict[str, Any]:
    """Load the model as `edgellm serve` does (same CPU kernel mode) and count."""
    from edgellm import LLM

    if cpu_kernels:
        os.environ["EDGELLM_CPU_QUANT"] = cpu_kernels
    llm = LLM(
        str(model_path) if model_path else None,
        kv_cache_memory=32 << 20,
        max_model_len=256,
        enable_prefix_caching=False,
    )
    model = llm.engine.model
    out: dict[str, Any] = decode_weight_bytes(model)
    out["dtype"] = str(next(model.parameters()).dtype).removeprefix("torch.")
    out["cpu_kernels"] = cpu_kernels or env.cpu_quant() or "auto"
    del llm, model
    gc.collect()
    return out


# ------------------------------------------------------------------------ servers
