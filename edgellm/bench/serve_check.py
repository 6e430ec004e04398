"""`edgellm serve` of a random-weight int4 checkpoint, measured with the bench client.

`write_int4_checkpoint` writes a GPTQ (v1, symmetric, group 128) checkpoint of Phi-3.5-mini's
shapes (hidden 3072, intermediate 8192, 32 layers, 32 heads of 96) straight from random codes,
with the embedded default model's tokenizer (so its vocabulary: 49152 tokens, where Phi-3.5 has
32064). `measure` serves it and reports TTFT at a long prompt, single-stream decode tokens/s, and
total tokens/s and TTFT p95 at several stream counts. Prompts are random token ids, each one
different from its first token, so no request hits another's cached prefix.
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from edgellm.bench.client import RequestResult, Target, run_load
from edgellm.bench.datasets import BenchRequest
from edgellm.bench.report import summarize
from edgellm.bench.servers import served_model, serving

PHI35_MINI = {"hidden": 3072, "intermediate": 8192, "layers": 32, "heads": 32, "head_dim": 96}
TINY = {"hidden": 64, "intermediate": 96, "layers": 2, "heads": 4, "head_dim": 16}


@dataclass
class ServePlan:
    """What `measure` runs: the long prompt, the single-stream decode, the stream counts."""

    long_prompt: int = 1000
    long_repeats: int = 5
    decode_tokens: int = 256
    streams: tuple[int, ...] = (16, 64)
    load_prompt: int = 256
    load_tokens: int = 64
    rounds: int = 2  # requests per stream at each stream count


DRY_PLAN = ServePlan(64, 2, 8, (2,), 16, 4, 1)


def write_int4_checkpoint(out: Path, shape: dict[str, int], group: int = 128) -> Path:
    """A Phi-3 checkpoint of `shape` with GPTQ int4 linears of random codes (scales keep
    activations near unit size), fp16 embeddings, norms and head, and the default tokenizer."""
    import transformers

    from edgellm.loader import default_model_path
    from edgellm.tokenizer import Tokenizer

    tok = Tokenizer.load(default_model_path(), "gguf")
    if tok is None:
        raise RuntimeError("the default model's tokenizer did not load")
    h, inter, heads, hd = shape["hidden"], shape["intermediate"], shape["heads"], shape["head_dim"]
    if heads * hd != h:
        raise ValueError(f"Phi-3 needs heads x head_dim == hidden, got {heads} x {hd} != {h}")
    vocab = len(tok.hf)
    cfg = transformers.Phi3Config(
        vocab_size=vocab,
        hidden_size=h,
        intermediate_size=inter,
        num_hidden_layers=shape["layers"],
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=4096,
        original_max_position_embeddings=4096,
        sliding_window=None,
        tie_word_embeddings=False,
        bos_token_id=tok.hf.bos_token_id,
        eos_token_id=tok.hf.eos_token_id,
        pad_token_id=tok.hf.eos_token_id,
    )
    out.mkdir(parents=True, exist_ok=True)
    cfg.save_pretrained(out)
    tok.hf.save_pretrained(str(out))
    gen = torch.Generator().manual_seed(0)
    tensors: dict[str, torch.Tensor] = {
        "model.embed_tokens.weight": (torch.randn(vocab, h, generator=gen) * 0.5).half(),
        "model.norm.weight": torch.ones(h, dtype=torch.float16),
        "lm_head.weight": (torch.randn(vocab, h, generator=gen) * h**-0.5).half(),
    }
    linears = {
        "self_attn.qkv_proj": (3 * heads * hd, h),
        "self_attn.o_proj": (h, heads * hd),
        "mlp.gate_up_proj": (2 * inter, h),
        "mlp.down_proj": (h, inter),
    }
    for i in range(shape["layers"]):
        prefix = f"model.layers.{i}"
        tensors[f"{prefix}.input_layernorm.weight"] = torch.ones(h, dtype=torch.float16)
        tensors[f"{prefix}.post_attention_layernorm.weight"] = torch.ones(h, dtype=torch.float16)
        for name, (n, k) in linears.items():
            for key, value in _gptq_random(n, k, group, gen).items():
                tensors[f"{prefix}.{name}.{key}"] = value
    from safetensors.torch import save_file

    save_file(tensors, str(out / "model.safetensors"))
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "gptq",
        "bits": 4,
        "group_size": group,
        "desc_act": False,
        "sym": True,
        "checkpoint_format": "gptq",
        "lm_head": False,
    }
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def _gptq_random(n: int, k: int, group: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """GPTQ v1 tensors of an [N, K] linear: random 4-bit codes (eight a word), zero 8 (stored
    as 7), scales sized so the output has about the input's magnitude."""
    words = torch.randint(-(2**31), 2**31 - 1, (k // 8, n), generator=gen, dtype=torch.int32)
    scale = 1.0 / (4.6 * k**0.5)  # codes - 8 have a standard deviation of about 4.6
    scales = (torch.rand(k // group, n, generator=gen) * 0.4 + 0.8) * scale
    return {
        "qweight": words,
        "qzeros": torch.full((k // group, n // 8), 0x77777777, dtype=torch.int32),
        "scales": scales.half(),
        "g_idx": (torch.arange(k) // group).int(),
    }


def _requests(n: int, prompt_len: int, output_len: int, vocab: int, seed: int) -> list:
    rng = random.Random(seed)
    reqs = []
    for i in range(n):
        ids = [100 + i % 1000] + [rng.randrange(100, vocab - 100) for _ in range(prompt_len - 1)]
        reqs.append(BenchRequest(None, ids, prompt_len, output_len))  # type: ignore[arg-type]
    return reqs


def _load(target: Target, reqs: list, concurrency: int) -> tuple[list[RequestResult], float]:
    return asyncio.run(run_load(target, reqs, concurrency))


def _checked(results: list[RequestResult]) -> list[RequestResult]:
    bad = [r.error for r in results if not r.ok]
    if bad:
        raise RuntimeError(f"{len(bad)} of {len(results)} requests failed: {bad[0]}")
    return results


def measure(model: Path, serve_args: list[str], plan: ServePlan, log: Path) -> dict[str, Any]:
    """Serve `model` (`edgellm serve --model MODEL SERVE_ARGS`) and measure `plan`."""
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    out: dict[str, Any] = {"plan": vars(plan)}
    with serving(["--model", str(model), *serve_args], log, timeout=420) as srv:
        out["load_s"] = srv.load_s
        target = Target(srv.url, served_model(srv.url), "completions", timeout=300)
        # warm-up, unmeasured: the kernels of the long prefill and of every batch size
        _checked(_load(target, _requests(1, plan.long_prompt, 2, vocab, 1), 1)[0])
        top = max(plan.streams)
        _checked(_load(target, _requests(top, plan.load_prompt, 4, vocab, 2), top)[0])
        long_reqs = _requests(plan.long_repeats, plan.long_prompt, 2, vocab, 3)
        ttfts = [_checked(_load(target, [r], 1)[0])[0].ttft * 1000 for r in long_reqs]
        out["long_prompt_ttft_ms"] = {"median": statistics.median(ttfts), "all": ttfts}
        (one,) = _checked(_load(target, _requests(1, 32, plan.decode_tokens, vocab, 4), 1)[0])
        out["decode_tok_s_1_stream"] = (one.output_tokens - 1) / (one.e2e - one.ttft)
        out["streams"] = {}
        for s in plan.streams:
            reqs = _requests(s * plan.rounds, plan.load_prompt, plan.load_tokens, vocab, 10 + s)
            results, elapsed = _load(target, reqs, s)
            summary = summarize(_checked(results), elapsed, label=f"{s} streams")
            out["streams"][str(s)] = {
                "requests": summary["completed"],
                "total_tok_s": summary["total_token_throughput"],
                "output_tok_s": summary["output_token_throughput"],
                "ttft_p50_ms": summary["ttft_ms"]["median"],
                "ttft_p95_ms": summary["ttft_ms"]["p95"],
                "decode_tok_s_per_stream": summary["decode_tokens_per_s_per_stream"],
            }
    return out
