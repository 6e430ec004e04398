"""CPU decode of the embedded default model (SmolLM2-135M-Instruct, Q4_1 GGUF with a
Q8_0 embedding): weights dequantized to fp32 at load ("exact") vs int4 kept packed
("fast"), measured side by side in one process, against the memory roofline.

  1. memory bandwidth of this machine: a large torch copy and a large sum;
  2. per-linear matmul time vs rows M for the model's largest layer shape (gate_up,
     576 -> 3072): fp32 F.linear (the exact path), torch's int4 GEMV (bf16 activations),
     bf16 F.linear over the dequantized weight (the fast path's larger steps), exact
     dequant + fp32 matmul per call (past the dense budget) -> the M up to which the GEMV
     wins (edgellm/quant/linear_kernels/cpu_fast.gemv_max_rows);
  3. decode tokens/s at batch 1 (and batch 4), both modes, interleaved repeats;
     prefill time of a ~200-token prompt;
  4. roofline: weight bytes each decode step reads / measured read bandwidth, and the
     fraction of it achieved.
Greedy outputs of both modes are compared too. Prints tables, writes
benchmarks/results/cpu_quant_decode.json.

    python benchmarks/cpu_quant_decode.py [--new-tokens 64] [--repeats 3] [--threads N]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from edgellm.bench.machine import bandwidth, best_of, describe, machine_info

PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.",
           "Explain gravity to a child.", "List three uses of copper."]
LONG = ("You are a friendly voice assistant for a travel agency. Keep answers short, "
        "spoken-style, and polite. ") * 10


def gemm_sweep(repeats: int) -> list[dict[str, float]]:
    from edgellm.platform import Platform
    from edgellm.quant.int_codes import Int4Codes
    from edgellm.quant.linear_kernels.cpu_fast import CpuInt4Kernel

    n, k, gs = 3072, 576, 32
    torch.manual_seed(0)
    codes = torch.randint(0, 16, (n, k), dtype=torch.int32)
    scales = torch.rand(n, k // gs).half().float() / 100
    offsets = -torch.rand(n, k // gs).half().float() / 10
    kernel = CpuInt4Kernel.build(Int4Codes(codes, None, scales, gs, offsets=offsets), torch.float32,
                                 Platform.create("fast"))
    dense = kernel.dense()
    dense_bf16 = dense.bfloat16()
    rows = []
    for m in (1, 2, 4, 6, 8, 16, 32, 64, 96, 128, 256):
        x = torch.randn(m, k)
        inner = 20 if m <= 16 else 3
        calls = {
            "fp32_linear_us": lambda x=x: F.linear(x, dense),
            "int4_gemv_bf16_us": lambda x=x: torch.ops.aten._weight_int4pack_mm_for_cpu(
                x.bfloat16(), kernel.packed, kernel.tinygemm_group, kernel.scale_zero).float(),
            "dequant_fp32_linear_us": lambda x=x: F.linear(x, kernel.dense()),
            "bf16_linear_us": lambda x=x: F.linear(x.bfloat16(), dense_bf16).float(),
        }
        row = {"M": m}
        for key, fn in calls.items():
            row[key] = best_of(fn, repeats, 3 if key.startswith("dequant") else inner) * 1e6
        rows.append(row)
    return rows


def gemv_crossover(sweep: list[dict[str, float]]) -> int:
    """Largest M up to which the int4 GEMV beats the bf16 matmul (the fast path's other option)."""
    wins = [r["M"] for r in sweep if r["int4_gemv_bf16_us"] < r["bf16_linear_us"]]
    return max(wins) if wins else 0


def weight_bytes_per_token(model) -> int:
    """Bytes of weights one decode step reads (every linear once, plus the head)."""
    from edgellm.quant.linear_kernels.cpu_fast import CpuInt4Kernel
    from edgellm.quant.linear_kernels.dense import DenseKernel

    from edgellm.layers.linear import Linear

    total = 0
    for name, module in model.named_modules():
        if not isinstance(module, Linear):
            continue
        kernel = getattr(module, "kernel", None)
        if isinstance(kernel, CpuInt4Kernel):
            total += kernel.packed.numel() * kernel.packed.element_size()
            total += kernel.scale_zero.numel() * kernel.scale_zero.element_size()
        elif isinstance(kernel, DenseKernel):
            total += kernel.weight.numel() * kernel.weight.element_size()
        else:
            total += module.weight.numel() * module.weight.element_size()
    if model.lm_head is None:  # tied: the head reads the whole embedding
        emb = model.model.embed_tokens.weight
        total += emb.numel() * emb.element_size()
    return total


def load(mode: str):
    from edgellm import LLM

    os.environ["EDGELLM_CPU_QUANT"] = mode
    t = time.perf_counter()
    llm = LLM(kv_cache_memory=128 << 20, max_model_len=1024, enable_prefix_caching=False)
    return llm, time.perf_counter() - t


def decode_rate(llm, prompts: list[list[int]], new_tokens: int) -> tuple[float, list[list[int]]]:
    from edgellm import SamplingParams

    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    outs = llm.generate(prompts, params)
    tokens = sum(o.metrics.num_generated_tokens - 1 for o in outs)
    start = min(o.metrics.first_token for o in outs)
    end = max(o.metrics.finished for o in outs)
    return tokens / (end - start), [o.outputs[0].token_ids for o in outs]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "cpu_quant_decode.json"))
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    info = machine_info()
    print(describe(info))

    bw = bandwidth(args.repeats * 2)
    print(f"\nmemory bandwidth: copy {bw['copy_GBps']:.1f} GB/s (read+write), read {bw['read_GBps']:.1f} GB/s")

    sweep = gemm_sweep(args.repeats)
    print("\ngate_up 576 -> 3072 (Q4_1-like, group 32), microseconds per call")
    print(f"{'M':>4} {'fp32 F.linear':>14} {'int4 GEMV bf16':>15} {'dequant+fp32':>13} {'bf16 F.linear':>14}")
    for r in sweep:
        print(f"{r['M']:>4} {r['fp32_linear_us']:>14.0f} {r['int4_gemv_bf16_us']:>15.0f} "
              f"{r['dequant_fp32_linear_us']:>13.0f} {r['bf16_linear_us']:>14.0f}")
    from edgellm.quant.linear_kernels.cpu_fast import gemv_max_rows
    from edgellm.quant.linear_kernels.onednn import packed_available

    print(f"int4 GEMV beats the bf16 matmul up to M={gemv_crossover(sweep)} here "
          f"(edgellm/quant/linear_kernels/cpu_fast.gemv_max_rows: {gemv_max_rows(packed_available())})")

    llms, results = {}, {}
    for mode in ("exact", "fast"):
        llms[mode], load_s = load(mode)
        results[mode] = {"load_s": load_s, "bytes_per_token": weight_bytes_per_token(llms[mode].engine.model),
                         "batch1": [], "batch4": [], "prefill_s": []}
    tok = llms["exact"].get_tokenizer()
    chats = [tok.encode_chat([{"role": "user", "content": p}]) for p in PROMPTS]
    long_prompt = tok.encode_chat([{"role": "system", "content": LONG}, {"role": "user", "content": "Hi!"}])
    texts = {}
    for _ in range(args.repeats):  # interleaved, so both modes see the same machine load
        for mode, llm in llms.items():
            rate, _ = decode_rate(llm, chats[:1], args.new_tokens)
            results[mode]["batch1"].append(rate)
            rate4, ids4 = decode_rate(llm, chats, args.new_tokens)
            results[mode]["batch4"].append(rate4)
            texts[mode] = ids4
            t = time.perf_counter()
            llm.prompt_logits([long_prompt])
            results[mode]["prefill_s"].append(time.perf_counter() - t)

    print(f"\ndefault model decode ({args.new_tokens} new tokens, best of {args.repeats}; "
          f"prefill of {len(long_prompt)} tokens)")
    print(f"{'mode':>6} {'weights MB/token':>17} {'batch1 tok/s':>13} {'batch4 tok/s':>13} {'roofline tok/s':>15} "
          f"{'of roofline':>12} {'prefill s':>10} {'load s':>7}")
    for mode, r in results.items():
        r["batch1_best"] = max(r["batch1"])
        r["batch4_best"] = max(r["batch4"])
        r["prefill_best_s"] = min(r["prefill_s"])
        r["roofline_tok_s"] = bw["read_GBps"] * 1e9 / r["bytes_per_token"]
        r["fraction_of_roofline"] = r["batch1_best"] / r["roofline_tok_s"]
        print(f"{mode:>6} {r['bytes_per_token'] / 1e6:>17.1f} {r['batch1_best']:>13.1f} {r['batch4_best']:>13.1f} "
              f"{r['roofline_tok_s']:>15.1f} {r['fraction_of_roofline']:>12.0%} {r['prefill_best_s']:>10.2f} "
              f"{r['load_s']:>7.1f}")
    speedup = results["fast"]["batch1_best"] / results["exact"]["batch1_best"]
    same = [a == b for a, b in zip(texts["exact"], texts["fast"])]
    prefix = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
              for a, b in zip(texts["exact"], texts["fast"])]
    print(f"\nfast / exact decode at batch 1: {speedup:.2f}x; greedy outputs identical for "
          f"{sum(same)}/{len(same)} prompts (agreeing prefix lengths {prefix} of {args.new_tokens})")

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"machine": info, "bandwidth": bw, "gemm_sweep_gate_up": sweep,
                               "gemv_crossover_M": gemv_crossover(sweep),
                               "new_tokens": args.new_tokens, "results": results,
                               "fast_over_exact_batch1": speedup, "greedy_identical": same,
                               "greedy_agreeing_prefix": prefix}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
