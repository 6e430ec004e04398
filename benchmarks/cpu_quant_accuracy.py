"""What the CPU modes cost in accuracy on the embedded default model: teacher-forced top-1
agreement with the exact path and perplexity, over the project's own docs as text.

Every mode reads the same token chunks; logits come from `LLM.prompt_logits` (fp32), prefilled
in pieces of --step-tokens so that each piece reads the earlier ones' K/V from the cache's pages
as decode does. "auto" runs as the engine calibrated it on this CPU (large steps may take the
exact dense matmul) with its default fp16 KV cache; "auto, fp32 KV cache" the same with fp32
pages, and "exact, fp16 KV cache" the exact path with fp16 pages (the fp16 rounding's cost
alone); "auto, integer dots forced" runs the int-dot
kernels at every size, which is what every decode step does, so its numbers are the int8
activation rounding's full cost; "auto, sampling rows" gives those steps' hidden states to the
int8 logits head alone, as rows that sample at a temperature get them. Each mode also reports how
far its sampling distribution at temperature --temperature is from the exact path's (KL and total
variation, mean over positions). Writes benchmarks/results/cpu_quant_accuracy.json.

    python benchmarks/cpu_quant_accuracy.py [--chunks 8] [--chunk-tokens 256] [--step-tokens 64] [--fast]
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch

from edgellm import LLM
from edgellm.bench.machine import machine_info
from edgellm.cpu_isa import select
from edgellm.quant.linear_kernels.cpu_int import int_dot_kernels

ROOT = Path(__file__).resolve().parent.parent
TEXTS = [ROOT / "README.md", ROOT / "docs" / "ARCHITECTURE.md"]


def chunks(llm: LLM, n: int, size: int) -> list[list[int]]:
    ids = llm.get_tokenizer().encode("\n\n".join(p.read_text() for p in TEXTS if p.is_file()))
    out = [ids[i:i + size] for i in range(0, len(ids) - size + 1, size)][:n]
    if not out:
        raise SystemExit("not enough text for one chunk")
    return out


def logits_of(llm: LLM, data: list[list[int]]) -> list[torch.Tensor]:
    return [t.float() for t in llm.prompt_logits(data)]


def stats(logits: list[torch.Tensor], data: list[list[int]], ref: list[torch.Tensor],
          temperature: float = 0.7) -> dict:
    nll, n, agree, max_diff, kl, tv = 0.0, 0, 0, 0.0, 0.0, 0.0
    for lg, ids, rf in zip(logits, data, ref):
        target = torch.tensor(ids[1:])
        nll += torch.nn.functional.cross_entropy(lg[:-1], target, reduction="sum").item()
        n += len(target)
        agree += (lg.argmax(-1) == rf.argmax(-1)).sum().item()
        max_diff = max(max_diff, (lg - rf).abs().max().item())
        p, q = (rf / temperature).log_softmax(-1), (lg / temperature).log_softmax(-1)
        kl += (p.exp() * (p - q)).sum().item()
        tv += 0.5 * (p.exp() - q.exp()).abs().sum().item()
    positions = sum(len(ids) for ids in data)
    return {"perplexity": math.exp(nll / n), "top1_agreement_with_exact": agree / positions,
            "max_logit_diff": max_diff, "sampling_temperature": temperature,
            "sampling_kl_mean": kl / positions, "sampling_tv_mean": tv / positions}


def sampling_logits_of(llm: LLM, data: list[list[int]]) -> list[torch.Tensor]:
    """The logits rows that sample at a temperature get: the steps' hidden states through the
    fast logits head's approximate product alone."""
    model = llm.engine.model
    seen: list[torch.Tensor] = []
    original = model.compute_logits

    def grab(hidden: torch.Tensor, *a, **k) -> torch.Tensor:
        seen.append(hidden.detach().clone())
        return original(hidden, *a, **k)

    model.compute_logits = grab
    try:
        logits_of(llm, data)
    finally:
        model.compute_logits = original
    flat = model.fast_logits.sampling_logits(torch.cat(seen))
    return list(flat.split([len(ids) for ids in data]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chunks", type=int, default=8)
    ap.add_argument("--chunk-tokens", type=int, default=256)
    ap.add_argument("--step-tokens", type=int, default=64, help="prefill piece (max_num_batched_tokens)")
    ap.add_argument("--fast", action="store_true", help="also the fast mode (bf16; slow without bf16 units)")
    ap.add_argument("--temperature", type=float, default=0.7, help="of the sampling distributions compared")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "cpu_quant_accuracy.json"))
    args = ap.parse_args()
    kw = {"kv_cache_memory": 64 << 20, "max_model_len": args.chunk_tokens + 16, "enable_prefix_caching": False,
          "max_num_batched_tokens": args.step_tokens}
    exact = LLM(cpu_quant="exact", **kw)
    data = chunks(exact, args.chunks, args.chunk_tokens)
    ref = logits_of(exact, data)
    t = args.temperature
    rows = {"exact": stats(ref, data, ref, t)}
    del exact
    rows["exact, fp16 KV cache"] = stats(logits_of(LLM(cpu_quant="exact", kv_cache_dtype="fp16", **kw), data), data, ref, t)
    rows["auto, fp32 KV cache"] = stats(logits_of(LLM(cpu_quant="auto", kv_cache_dtype="fp32", **kw), data), data, ref, t)
    auto = LLM(cpu_quant="auto", **kw)
    kv_dtype = str(auto.engine.model.attention_layers()[0].kv_cache.dtype).replace("torch.", "")
    kernels = int_dot_kernels(auto.engine.model)
    rows["auto"] = stats(logits_of(auto, data), data, ref, t)
    rows["auto"]["int_dot_max_rows"] = min((k.max_rows for k in kernels), default=None)
    rows["auto"]["kv_cache_dtype"] = kv_dtype
    for k in kernels:
        k.max_rows = 1 << 62
    rows["auto, integer dots forced"] = stats(logits_of(auto, data), data, ref, t)
    rows["auto, sampling rows"] = stats(sampling_logits_of(auto, data), data, ref, t)
    del auto
    if args.fast:
        rows["fast"] = stats(logits_of(LLM(cpu_quant="fast", **kw), data), data, ref, t)
    for name, r in rows.items():
        print(f"{name:28s} perplexity {r['perplexity']:.4f}  top-1 = exact {100 * r['top1_agreement_with_exact']:.2f}%"
              f"  max |logit diff| {r['max_logit_diff']:.3f}  at T={t}: KL {r['sampling_kl_mean']:.2e}"
              f" TV {r['sampling_tv_mean']:.4f}")
    out = {"machine": {**machine_info(), "isa": select().describe()},
           "date": time.strftime("%Y-%m-%d %H:%M"), "tokens": sum(len(c) for c in data),
           "step_tokens": args.step_tokens,
           "text": [str(p.relative_to(ROOT)) for p in TEXTS], "modes": rows}
    Path(args.out).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
