"""The engine on one device against the CPU fp32 reference, architecture by architecture: tiny
random models of every supported architecture (`tiny_models`), the same token prompts greedy on
both, and per architecture the fraction of identical tokens and the first divergence.

The reference is `device="cpu"`, fp32, `cpu_quant="exact"` (transformers' math). On CUDA the
sides under test are the engine on the GPU in fp32 (Triton attention; fp32 should agree
almost everywhere) and in bf16 (what serving runs; divergences after near-ties are expected).
Without CUDA (a dry run) the side under test is the CPU in bf16 (the torch reference
attention), which runs the same comparison on what this machine has; the result says so.
"""

from __future__ import annotations

import gc
import random
from pathlib import Path
from typing import Any

import torch

REFERENCE = {"device": "cpu", "dtype": "float32", "cpu_quant": "exact"}
CUDA_SIDES = {
    "cuda fp32": {"device": "cuda", "dtype": "float32"},
    "cuda bf16": {"device": "cuda", "dtype": "bfloat16"},
}
DRY_SIDES = {"cpu bf16": {"device": "cpu", "dtype": "bfloat16"}}
DRY_NOTE = "no CUDA: the side under test is the CPU in bf16 (torch reference attention)"
# lengths that cross the tiny models' sliding windows (24) and Phi-3's original context (48)
PROMPT_LENS = (5, 17, 40, 70)


def prompts(vocab: int, lens: tuple[int, ...] = PROMPT_LENS, seed: int = 0) -> list[list[int]]:
    """Random token-id prompts of the given lengths."""
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lens]


def greedy_tokens(
    path: Path, token_prompts: list[list[int]], new_tokens: int, **engine: Any
) -> list[list[int]]:
    """Greedy continuations (ignore_eos) of every prompt, submitted together, with
    EngineConfig(model=path, **engine)."""
    from edgellm.config import EngineConfig
    from edgellm.llm import LLM

    llm = LLM.from_config(EngineConfig(model=str(path), kv_cache_memory=4 << 20, **engine))
    try:
        return greedy(llm, token_prompts, new_tokens)
    finally:
        del llm
        free_memory()


def greedy(llm: Any, token_prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """Greedy continuations (ignore_eos) of every prompt, submitted together, by `llm`."""
    from edgellm.sampling import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    return [list(out.outputs[0].token_ids) for out in llm.generate(token_prompts, params)]


def free_memory() -> None:
    """Collect what an LLM the caller just let go of held (the device's cache too), before the
    next one loads."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def agreement(want: list[list[int]], got: list[list[int]]) -> dict[str, Any]:
    """Position-wise identical tokens over all prompts, and the first divergence (the earliest
    generated position at which any prompt differs; None when all are equal)."""
    same = total = 0
    first: dict[str, int] | None = None
    for i, (a, b) in enumerate(zip(want, got)):
        total += max(len(a), len(b))
        same += sum(x == y for x, y in zip(a, b))
        diff = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if diff is None and len(a) != len(b):
            diff = min(len(a), len(b))
        if diff is not None and (first is None or diff < first["token"]):
            first = {"prompt": i, "token": diff}
    return {"identical_fraction": same / total if total else 0.0, "first_divergence": first}


def compare_archs(
    root: Path, archs: list[str], sides: dict[str, dict[str, Any]], new_tokens: int
) -> dict[str, Any]:
    """{arch: {"sides": {side: agreement}} or {"error": text}} over tiny models built under
    root; an architecture that fails is reported and the others still run."""
    from edgellm.bench.tiny_models import build_tiny, tiny_config

    results: dict[str, Any] = {}
    for arch in archs:
        try:
            path, _ = build_tiny(arch, root / arch)
            token_prompts = prompts(tiny_config(arch).vocab_size)
            want = greedy_tokens(path, token_prompts, new_tokens, **REFERENCE)
            per_side = {}
            for side, engine in sides.items():
                got = greedy_tokens(path, token_prompts, new_tokens, **engine)
                per_side[side] = agreement(want, got)
            results[arch] = {"sides": per_side}
        except Exception as exc:  # noqa: BLE001  (one architecture failing is a result)
            results[arch] = {"error": f"{type(exc).__name__}: {exc}"}
        print("\n".join(table({arch: results[arch]})[1:]), flush=True)
    return results


def table(results: dict[str, Any]) -> list[str]:
    """One printed line per architecture and side."""
    lines = [f"{'arch':10s} {'side':10s} {'identical':>9s}  first divergence"]
    for arch, result in results.items():
        if "error" in result:
            lines.append(f"{arch:10s} ERROR {result['error'][:200]}")
            continue
        for side, a in result["sides"].items():
            first = a["first_divergence"]
            where = "none" if first is None else f"prompt {first['prompt']} token {first['token']}"
            lines.append(f"{arch:10s} {side:10s} {a['identical_fraction']:9.3f}  {where}")
    return lines
