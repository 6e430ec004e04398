"""CUDA graphs for decode (edgellm/engine/cuda_graphs.py) checked and timed: greedy tokens with
the graphs against the same engine eager, per architecture (tiny random models), and decode
tokens/s with and without them on a small model (SMALL: about Qwen2.5-0.5B's shapes, as a
Phi-3 GPTQ int4 checkpoint), where launch overhead is most of a step.

On CUDA the graphs are the engine's own (enforce_eager=False). Without CUDA (a dry run) the
engine runs on CPU with the Triton attention kernels under the interpreter and DecodeGraphs on
RerunBackend, which checks the capture discipline (no host reads, static buffers only); its
timings say nothing about GPUs and are marked so.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from edgellm.bench.engine_check import agreement, free_memory, greedy, prompts

SMALL = {"hidden": 896, "intermediate": 4864, "layers": 24, "heads": 14, "head_dim": 64}
DRY_NOTE = (
    "no CUDA: graphs replayed by RerunBackend on CPU (Triton interpreter); timings mean nothing"
)
DRY_PROMPT_LENS = (5, 9, 17)  # the interpreter is slow: short prompts in a dry run


def _llm(path: Path, cuda: bool, graphs: bool, **engine: Any):
    """An LLM on CUDA (graphs: enforce_eager False) or, without CUDA, on CPU with the Triton
    attention injected and, with graphs, DecodeGraphs on RerunBackend."""
    from edgellm.config import EngineConfig
    from edgellm.llm import LLM

    if cuda:
        cfg = EngineConfig(model=str(path), device="cuda", enforce_eager=not graphs, **engine)
        return LLM.from_config(cfg)
    from edgellm.attention.triton import TritonAttention
    from edgellm.engine.cuda_graphs import DecodeGraphs, RerunBackend

    cfg = EngineConfig(model=str(path), cpu_quant="exact", **engine)
    llm = LLM.from_config(cfg)
    model = llm.engine.model
    model.model.fused = None  # the layer path, through the backend below
    attn = TritonAttention()
    for layer in model.attention_layers():
        layer.backend = attn
    if graphs:
        runner = llm.engine.runner
        blocks = -(-llm.engine.max_model_len // cfg.block_size)
        runner.graphs = DecodeGraphs(
            model,
            RerunBackend(),
            cfg.max_num_seqs,
            blocks,
            cfg.block_size,
            runner.null_block,
            runner.device,
            runner.needs_seq_lens,
        )
    return llm


def compare(root: Path, archs: list[str], cuda: bool, new_tokens: int) -> dict[str, Any]:
    """{arch: {"dtype": {agreement of graphs vs eager, "buckets": captured}} or {"error"}}."""
    from edgellm.bench.tiny_models import build_tiny, tiny_config

    dtypes = ("float32", "bfloat16") if cuda else ("float32",)
    results: dict[str, Any] = {}
    for arch in archs:
        try:
            path, _ = build_tiny(arch, root / arch)
            vocab = tiny_config(arch).vocab_size
            token_prompts = prompts(vocab) if cuda else prompts(vocab, DRY_PROMPT_LENS)
            per: dict[str, Any] = {}
            for dtype in dtypes:
                engine = {"dtype": dtype, "kv_cache_memory": 4 << 20, "max_num_seqs": 4}
                llm = _llm(path, cuda, False, **engine)
                want = greedy(llm, token_prompts, new_tokens)
                del llm
                free_memory()
                llm = _llm(path, cuda, True, **engine)
                got = greedy(llm, token_prompts, new_tokens)
                graphs = llm.engine.runner.graphs
                captured = sorted(graphs.graphs) if graphs else []
                per[dtype] = {**agreement(want, got), "buckets": captured}
                del llm, graphs
                free_memory()
            results[arch] = per
        except Exception as exc:  # noqa: BLE001  (one architecture failing is a result)
            results[arch] = {"error": f"{type(exc).__name__}: {exc}"}
        print(f"graphs {arch}: {results[arch]}", flush=True)
    return results


def speed(path: Path, cuda: bool, streams: tuple[int, ...], new_tokens: int) -> dict[str, Any]:
    """{streams: {"eager_tok_s", "graphs_tok_s", "ratio"}}: greedy decode of `streams` 8-token
    prompts for new_tokens tokens each, after one warm-up run (which captures the graphs)."""
    out: dict[str, Any] = {}
    engine = {
        "dtype": "float16" if cuda else "float32",
        "kv_cache_memory": (1 << 30) if cuda else 32 << 20,
        "max_num_seqs": max(streams),
        "max_model_len": 512,
    }
    for graphs in (False, True):
        llm = _llm(path, cuda, graphs, **engine)
        for n in streams:
            token_prompts = [[3 + i, 7, 11, 13, 17, 19, 23, 29] for i in range(n)]
            greedy(llm, token_prompts, 4)  # warm-up: kernels compiled, graphs captured
            if cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            greedy(llm, token_prompts, new_tokens)
            if cuda:
                torch.cuda.synchronize()
            key = "graphs_tok_s" if graphs else "eager_tok_s"
            out.setdefault(n, {})[key] = n * new_tokens / (time.perf_counter() - t0)
        del llm
        free_memory()
    for r in out.values():
        r["ratio"] = r["graphs_tok_s"] / r["eager_tok_s"]
    return out
