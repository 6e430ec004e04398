"""Checks and times the whole GPU path in one call: kernels, engine, server, against the targets.

One command for a lent GPU machine (about 5-8 minutes on an H100), in four sections, each in its
own try (a section or a part of one that fails prints its error and the run goes on):
  a  the Triton kernels at the shapes of Phi-3.5-mini, Llama-3.1-8B and Qwen3-4B: W4A16, W8A16
     and FP8 GEMMs against cuBLAS fp16, paged attention (decode, chunked prefill; fp16 and fp8
     KV) against SDPA, the KV write; max error against the torch references, GB/s, TFLOP/s
     next to the GPU's copy bandwidth and fp16 matmul rate (edgellm/bench/gpu_kernels.py,
     gpu_attention.py);
  b  the engine on CUDA (fp32 and bf16) against the CPU fp32 path (cpu_quant exact): greedy
     tokens of tiny random models of every supported architecture; per architecture the
     fraction of identical tokens and the first divergence (edgellm/bench/engine_check.py);
  c  `edgellm serve` of a random-weight GPTQ int4 checkpoint of Phi-3.5-mini's shapes, measured
     with the bench client: TTFT at a 1000-token prompt, decode tok/s at 1 stream, total tok/s
     and TTFT p95 at 16 and 64 streams (edgellm/bench/serve_check.py);
  d  CUDA graphs for decode (off by default, --no-enforce-eager): greedy tokens with them
     against eager on tiny models of every architecture, and decode tok/s with and without them
     on a ~0.5B int4 checkpoint at 1 and 16 streams (edgellm/bench/graph_check.py).
Prints each section's tables, then one table of section status and the targets (W4A16 GEMV at
batch 1 >= 3x cuBLAS fp16; paged decode attention >= 70% of the copy bandwidth at the longest
context; TTFT < 50 ms at the 1k prompt; TTFT p95 < 200 ms at 64 streams), and writes JSON
(machine, per-section status / error / numbers, targets) to $OUT/gpu_check.json when OUT is set,
else benchmarks/results/gpu_check.json (--out overrides both).

    OUT=/tmp/out python benchmarks/gpu_check.py                 # on CUDA
    python benchmarks/gpu_check.py --dry-run                     # CPU: tiny shapes, interpreter
    python benchmarks/gpu_check.py --sections a,c                # a subset
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

DRY = ("--dry-run", "--quick")
if any(flag in sys.argv for flag in DRY) and not os.environ.get("TRITON_INTERPRET"):
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported

import torch

from edgellm import env
from edgellm.bench import engine_check, graph_check, serve_check
from edgellm.bench.gpu_attention import attention_rows, kv_write_rows
from edgellm.bench.gpu_check import parse_sections, run_section, summary, targets
from edgellm.bench.gpu_kernels import DRY_MODELS, MODELS, ceilings, gemm_rows, parse_shape, table, worst_error
from edgellm.bench.machine import bandwidth, machine_info
from edgellm.bench.results import RESULTS, header, write_json
from edgellm.bench.tiny_models import ARCHS


def section_a(args: argparse.Namespace, cuda: bool) -> dict:
    dev = torch.device("cuda" if cuda else "cpu")
    dtype = torch.float16 if cuda else torch.float32
    models = [parse_shape(s) for s in args.shape] if args.shape else (MODELS if cuda else DRY_MODELS)
    iters = 20 if cuda else 1
    t0 = time.monotonic()
    out: dict = {"models": models}
    out["ceilings"] = ceilings(dev) if cuda else {"copy_GBps": bandwidth(2, 64)["copy_GBps"]}
    print(f"ceilings: {out['ceilings']}", flush=True)
    ms = [1, 16, 1024] if cuda else [1, 5]
    out["gemm"] = gemm_rows(models, ms, dev, dtype, iters, ("w4a16", "w8a16", "fp8"),
                            deadline=t0 + 0.55 * args.kernel_budget)
    cases = [(8, 8192, 1), (16, 2048, 1), (1, 1024, 1024), (1, 2048, 512)] if cuda else [(2, 37, 1), (1, 40, 9)]
    out["attention"] = attention_rows(models, cases, dev, dtype, iters, deadline=t0 + args.kernel_budget)
    out["kv_write"] = kv_write_rows(models, [64, 2048] if cuda else [7], dev, dtype, iters)
    rows = out["gemm"] + out["attention"] + out["kv_write"]
    out["budget_hit"] = time.monotonic() > t0 + args.kernel_budget
    print("\n".join(table(rows)), flush=True)
    out["worst_rel_err"] = worst = worst_error(rows)
    errors = sorted({f"{r['model']} {r['op']} {r['kernel']}: {r['error']}" for r in rows if "error" in r})
    if errors:
        return {**out, "status": "failed", "error": f"{len(errors)} failed: " + " | ".join(errors)[:2000]}
    if worst >= 3e-2:
        return {**out, "status": "failed", "error": f"worst max relative error {worst:.2e} >= 3e-2"}
    return out


def section_b(args: argparse.Namespace, cuda: bool) -> dict:
    sides = engine_check.CUDA_SIDES if cuda else engine_check.DRY_SIDES
    with tempfile.TemporaryDirectory() as root:
        archs = engine_check.compare_archs(Path(root), ARCHS, sides, 32 if cuda else 8)
    out = {"note": "" if cuda else engine_check.DRY_NOTE, "reference": engine_check.REFERENCE,
           "sides": sides, "prompt_lens": engine_check.PROMPT_LENS, "archs": archs}
    failed = [f"{arch}: {r['error']}" for arch, r in archs.items() if "error" in r]
    if failed:
        return {**out, "status": "failed", "error": " | ".join(failed)[:2000]}
    return out


def section_c(args: argparse.Namespace, cuda: bool) -> dict:
    shape = serve_check.PHI35_MINI if cuda else serve_check.TINY
    plan = serve_check.ServePlan() if cuda else serve_check.DRY_PLAN
    serve = (["--device", "cuda", "--kv-cache-memory", "16G", "--max-model-len", "4096"] if cuda
             else ["--kv-cache-memory", "64M", "--max-model-len", "512"])
    with tempfile.TemporaryDirectory() as root:
        t0 = time.monotonic()
        model = serve_check.write_int4_checkpoint(Path(root) / "model", shape, 128 if cuda else 32)
        out = {"shape": shape, "serve_args": serve, "checkpoint_write_s": time.monotonic() - t0,
               "checkpoint_bytes": (model / "model.safetensors").stat().st_size}
        out.update(serve_check.measure(model, serve, plan, Path(root) / "serve.log"))
    ttft = out["long_prompt_ttft_ms"]["median"]
    print(f"load {out['load_s']:.1f} s; TTFT at {plan.long_prompt} prompt tokens {ttft:.1f} ms (median); "
          f"decode {out['decode_tok_s_1_stream']:.1f} tok/s at 1 stream", flush=True)
    for s, r in out["streams"].items():
        print(f"{s:>3} streams: total {r['total_tok_s']:.1f} tok/s, output {r['output_tok_s']:.1f} tok/s, "
              f"TTFT p50 {r['ttft_p50_ms']:.1f} ms, p95 {r['ttft_p95_ms']:.1f} ms", flush=True)
    return out


def section_d(args: argparse.Namespace, cuda: bool) -> dict:
    archs = ARCHS if cuda else ["llama"]
    with tempfile.TemporaryDirectory() as root:
        out: dict = {"note": "" if cuda else graph_check.DRY_NOTE}
        out["archs"] = graph_check.compare(Path(root), archs, cuda, 32 if cuda else 4)
        shape = graph_check.SMALL if cuda else serve_check.TINY
        model = serve_check.write_int4_checkpoint(Path(root) / "small", shape, 128 if cuda else 32)
        out["shape"] = shape
        out["speed"] = graph_check.speed(model, cuda, (1, 16) if cuda else (1, 2), 128 if cuda else 3)
    for n, r in out["speed"].items():
        print(f"graphs {n:>3} streams: eager {r['eager_tok_s']:.1f} tok/s, graphs {r['graphs_tok_s']:.1f} "
              f"tok/s ({r['ratio']:.2f}x)", flush=True)
    failed = [f"{a}: {r['error']}" for a, r in out["archs"].items() if "error" in r]
    fp32 = [a for a, r in out["archs"].items() if "error" not in r and r["float32"]["identical_fraction"] < 1]
    if failed or fp32:
        why = " | ".join(failed + [f"{a}: fp32 tokens differ from eager" for a in fp32])
        return {**out, "status": "failed", "error": why[:2000]}
    return out


SECTION_FNS = {"a": section_a, "b": section_b, "c": section_c, "d": section_d}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry-run", "--quick", dest="dry_run", action="store_true",
                    help="no GPU: tiny shapes, Triton under TRITON_INTERPRET=1, the engine and server on CPU")
    ap.add_argument("--sections", default="a,b,c,d", type=_sections,
                    help="a subset of a,b,c,d (default: all)")
    ap.add_argument("--shape", action="append", default=[], metavar="NAME:H,I,QH,KVH,HD",
                    help="section a: kernel shapes instead of the built-in models (repeatable)")
    ap.add_argument("--kernel-budget", type=float, default=180.0,
                    help="seconds section a may spend on GEMM and attention sweeps before it stops")
    out_dir = env.out_dir()
    ap.add_argument("--out", default=str((out_dir or RESULTS) / "gpu_check.json"),
                    help="the JSON result (default: $OUT/gpu_check.json when OUT is set)")
    args = ap.parse_args()
    cuda = torch.cuda.is_available() and not args.dry_run
    if not cuda and not args.dry_run:
        print("no CUDA device: run with --dry-run (interpreter, tiny shapes) or on a lent GPU")
        return 2
    if not cuda:
        torch.set_num_threads(1)  # tiny shapes: one thread is fastest on a shared machine
    t0 = time.monotonic()
    sections = {}
    for name, fn in SECTION_FNS.items():
        if name in args.sections:
            sections[name] = run_section(name, lambda fn=fn: fn(args, cuda))
        else:
            sections[name] = {"status": "skipped"}
    goals = targets(sections, judged=cuda)
    machine = machine_info()
    print(f"\ngpu_check on {machine['gpu']['name'] if machine['gpu'] else 'CPU (dry run)'} "
          f"in {time.monotonic() - t0:.0f} s")
    print("\n".join(summary(sections, goals)))
    write_json(args.out, {**header(__doc__, __file__), "machine": machine, "dry_run": not cuda,
                          "seconds": time.monotonic() - t0, "sections": sections, "targets": goals})
    return 0 if all(s["status"] in ("ok", "skipped") for s in sections.values()) else 1


def _sections(text: str) -> list[str]:
    try:
        return parse_sections(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


if __name__ == "__main__":
    sys.exit(main())
