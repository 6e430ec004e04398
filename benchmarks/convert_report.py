"""`edgellm convert` on the embedded default model: quality, size and time per scheme.

Source: SmolLM2-135M-Instruct from its GGUF, dequantized to an fp16 HF
directory. For each scheme: perplexity of source and quantized model on the
held-out tail of the shipped calibration corpus (edgellm's own engine,
prompt_logits), relative logit error, KL, size on disk, convert time on this
machine, and served decode tokens/s when the engine loads the output natively
(else "n/a": the engine-side loaders for that format are not in yet).
SmolLM2's hidden size 576 is not a multiple of 128, so int4 uses group 64.

    python benchmarks/convert_report.py [--schemes rtn w4a16-gptq ...] [--num-samples 64]
Prints a markdown table; writes benchmarks/results/convert_report.json.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

import torch

from edgellm.bench.machine import cpu_name, machine_info
from edgellm.quant.convert import convert
from edgellm.quant.convert_options import ConvertOptions

DEFAULT_SCHEMES = ["w4a16-rtn", "w4a16-gptq", "w4a16-awq", "w8a16-int8", "w8a8-int8", "fp8-dynamic", "fp8-static"]


def decode_tokens_per_s(path: Path, new_tokens: int = 64) -> float | None:
    from edgellm import LLM, SamplingParams

    try:
        llm = LLM(str(path), kv_cache_memory=64 << 20)
    except Exception:
        return None
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    llm.generate(["Warm up."], SamplingParams(max_tokens=4, temperature=0.0))
    t = time.perf_counter()
    llm.generate(["Tell me about the sea."], params)
    return new_tokens / (time.perf_counter() - t)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--schemes", nargs="+", default=DEFAULT_SCHEMES)
    ap.add_argument("--num-samples", type=int, default=64)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--group-size", type=int, default=64)
    ap.add_argument("--out", default="benchmarks/results/convert_report.json")
    args = ap.parse_args()
    torch.set_num_threads(2)
    rows = []
    work = Path(tempfile.mkdtemp(prefix="edgellm-convert-bench-"))
    try:
        for scheme in args.schemes:
            int_w = scheme.startswith("w4a16") or scheme == "rtn"
            opts = ConvertOptions(src="default", out=str(work / scheme), scheme=scheme,
                                  num_samples=args.num_samples, seq_len=args.seq_len,
                                  group_size=args.group_size if int_w else None, force=True)
            t = time.perf_counter()
            report = convert(opts)
            report["convert_seconds"] = time.perf_counter() - t
            report["decode_tokens_per_s"] = decode_tokens_per_s(work / scheme)
            rows.append(report)
            shutil.rmtree(work / scheme, ignore_errors=True)
            print(f"{scheme}: ppl {report['perplexity_source']:.3f} -> {report['perplexity_quantized']:.3f}, "
                  f"logit err {report['logit_relative_error']:.4f}, {report['convert_seconds']:.0f} s", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    from edgellm.quant.convert import resolve_source

    source_tps = decode_tokens_per_s(resolve_source("default")[0])
    print()
    print("| scheme | algorithm | ppl source | ppl quantized | change | logit rel. err | KL | top-1 | "
          "size MiB | convert s | decode tok/s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        tps = r["decode_tokens_per_s"]
        print(f"| {r['scheme']} | {r['algorithm']} | {r['perplexity_source']:.3f} | {r['perplexity_quantized']:.3f} "
              f"| {100 * r['perplexity_relative_change']:+.2f}% | {r['logit_relative_error']:.4f} "
              f"| {r['mean_kl_divergence']:.4f} | {100 * r['top1_agreement']:.1f}% "
              f"| {r['size_bytes']['quantized'] / 2**20:.1f} | {r['convert_seconds']:.0f} "
              f"| {'n/a' if tps is None else f'{tps:.1f}'} |")
    print(f"\nsource size: {rows[0]['size_bytes']['source'] / 2**20:.1f} MiB (fp16); eval path: "
          f"{sorted({r.get('eval_path') for r in rows})}; machine: {cpu_name()}, "
          f"{torch.get_num_threads()} threads; source fp16 decode: "
          f"{'n/a' if source_tps is None else f'{source_tps:.1f}'} tok/s")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"machine": machine_info(), "rows": rows, "args": vars(args), "source_decode_tokens_per_s": source_tps}, indent=2))


if __name__ == "__main__":
    main()
