"""Offline throughput: edgellm vs transformers `generate`, same prompts, same
process, same machine, on the embedded default model (SmolLM2-135M-Instruct).

Measures, side by side:
  - decode throughput (generated tokens/s) at batch 1 (requests one by one)
    and with 16 requests at once (edgellm: continuous batching; transformers:
    one padded static batch);
  - prefill tokens/s of a long shared system prompt + short user turn, cold
    vs a prefix-cache hit (edgellm), and transformers' prefill of the same;
  - llama.cpp's prompt processing on the same GGUF (`llama-bench -p 512 -n 0`, same thread
    count), where benchmarks/build_llama_server.sh has built it.
Prints a table with ratios and writes benchmarks/results/offline_throughput.json.

    python benchmarks/offline_throughput.py [--new-tokens 64] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from edgellm import LLM, SamplingParams
from edgellm.bench.llama_cpp import find_llama_bench, find_llama_server, llama_bench_prompt
from edgellm.bench.machine import describe, machine_info
from edgellm.loader import default_model_path

QUESTIONS = [
    "What is the capital of France?", "Explain photosynthesis in one sentence.",
    "Name three primary colors.", "What is 12 times 12?", "Who wrote Hamlet?",
    "Give me a synonym for happy.", "What does a thermometer measure?",
    "How many legs does a spider have?", "What is the boiling point of water?",
    "Translate 'thank you' into Spanish.", "What is the largest planet?",
    "Suggest a name for a pet goldfish.", "What is the opposite of cold?",
    "Why is the sky blue?", "What language is spoken in Brazil?", "Define gravity briefly.",
]

SYSTEM = (
    "You are a friendly voice assistant for a travel agency. Keep answers short, "
    "spoken-style, and polite. " * 24
)


def timed(fn, repeats: int) -> tuple[float, object]:
    times, result = [], None
    for _ in range(repeats):
        t = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times), result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--cpu-quant", choices=["auto", "exact", "fast"], default="auto",
                    help="edgellm's CPU path for the GGUF's 4-bit weights (transformers always dequantizes)")
    ap.add_argument("--out", default=None, help="default: results/offline_throughput[_exact|_fast].json")
    args = ap.parse_args()
    suffix = "" if args.cpu_quant == "auto" else f"_{args.cpu_quant}"
    args.out = args.out or str(Path(__file__).parent / "results" / f"offline_throughput{suffix}.json")
    n_new = args.new_tokens

    from transformers import AutoModelForCausalLM

    path = default_model_path()
    llm = LLM(kv_cache_memory=512 << 20, cpu_quant=args.cpu_quant)
    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    tok = llm.get_tokenizer()
    prompts = [tok.encode_chat([{"role": "user", "content": q}]) for q in QUESTIONS]
    params = SamplingParams(max_tokens=n_new, temperature=0.0, ignore_eos=True)
    hf.generation_config.pad_token_id = tok.hf.pad_token_id or 0

    def hf_generate(batch: list[list[int]]) -> int:
        width = max(len(p) for p in batch)
        ids = torch.tensor([[0] * (width - len(p)) + p for p in batch])  # left padding
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        with torch.no_grad():
            out = hf.generate(ids, attention_mask=mask, max_new_tokens=n_new, min_new_tokens=n_new,
                              do_sample=False)
        return (out.shape[1] - width) * len(batch)

    llm.generate(prompts[:2], SamplingParams(max_tokens=4))  # warm-up both
    hf_generate(prompts[:2])
    rows = []

    t_e1, _ = timed(lambda: [llm.generate(p, params) for p in prompts[:4]], args.repeats)
    t_h1, _ = timed(lambda: [hf_generate([p]) for p in prompts[:4]], args.repeats)
    rows.append(("decode tok/s, batch 1", 4 * n_new / t_e1, 4 * n_new / t_h1))

    t_e16, _ = timed(lambda: llm.generate(prompts, params), args.repeats)
    t_h16, _ = timed(lambda: hf_generate(prompts), args.repeats)
    rows.append(("decode tok/s, 16 requests", 16 * n_new / t_e16, 16 * n_new / t_h16))

    # prefill: long system prompt + short user turn; time to the first token (max_tokens=1)
    one = SamplingParams(max_tokens=1, temperature=0.0)
    turns = [tok.encode_chat([{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}])
             for q in QUESTIONS[: args.repeats + 1]]
    n_prompt = len(turns[0])
    cold = LLM(kv_cache_memory=512 << 20, enable_prefix_caching=False, cpu_quant=args.cpu_quant)
    cold.generate(turns[0], one)
    t_cold, _ = timed(lambda: cold.generate(turns[1], one), args.repeats)
    llm.generate(turns[0], one)  # caches the system prompt
    hits = iter(turns[1:] * args.repeats)
    t_warm, _ = timed(lambda: llm.generate(next(hits), one), args.repeats)
    with torch.no_grad():
        t_hf_pre, _ = timed(lambda: hf(torch.tensor([turns[1]])), args.repeats)
    rows.append((f"prefill tok/s, {n_prompt}-token prompt, cold", n_prompt / t_cold, n_prompt / t_hf_pre))
    rows.append((f"prefill tok/s, {n_prompt}-token prompt, prefix hit", n_prompt / t_warm, n_prompt / t_hf_pre))
    llama = None
    bench = find_llama_bench(find_llama_server(None))
    if bench is not None:
        try:
            pp = llama_bench_prompt(bench, path, 512, torch.get_num_threads(), args.repeats)
            llama = {"binary": str(bench), "pp512_tok_s": pp, "edgellm_cold_tok_s": n_prompt / t_cold,
                     "ratio": n_prompt / t_cold / pp}
        except RuntimeError as exc:
            print(f"llama-bench: {exc}")

    print(f"\nmachine: {describe(machine_info())}")
    print(f"model: {path.name} (edgellm --cpu-quant {args.cpu_quant}; transformers fp32 dequantized from the same GGUF)\n")
    print(f"{'measure':48s} {'edgellm':>10s} {'transformers':>13s} {'ratio':>7s}")
    for name, e, h in rows:
        print(f"{name:48s} {e:10.1f} {h:13.1f} {e / h:6.2f}x")
    print(f"\nprefix hit vs cold prefill (edgellm): {t_cold / t_warm:.1f}x faster time-to-first-token")
    if llama is not None:
        print(f"cold prefill: edgellm {llama['edgellm_cold_tok_s']:.1f} tok/s ({n_prompt} tokens), llama.cpp "
              f"(llama-bench -p 512) {llama['pp512_tok_s']:.1f} tok/s: {llama['ratio']:.2f}x")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({
        "machine": machine_info(),
        "model": path.name,
        "cpu_quant": args.cpu_quant,
        "new_tokens": n_new,
        "rows": [{"measure": n, "edgellm": e, "transformers": h, "ratio": e / h} for n, e, h in rows],
        "prefix_hit_speedup": t_cold / t_warm,
        "llama_bench": llama,
    }, indent=2))


if __name__ == "__main__":
    main()
