"""Where a decode step's time goes: scheduler, batch building, the model, logits, sampling, and
the engine's per-token bookkeeping, at several batch sizes; plus the torch operator profile of the
forward pass.

    python benchmarks/profile_decode.py                       # default model, batch 1 and 16
    python benchmarks/profile_decode.py --batch 1,4,16 --cpu-quant fast --ops
    python benchmarks/profile_decode.py --prompt-len 300 --kv-cache-dtype fp32   # vs the fp16 default

Prints a table of milliseconds per step by phase, the decode tokens/s each batch size reaches, and
(with --ops) the top operators by self CPU time. Writes benchmarks/results/profile_decode.json.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from edgellm import env
from edgellm.bench.machine import machine_info
from edgellm.bench.phases import PhaseTimer
from edgellm.bench.results import RESULTS, header, write_json
from edgellm.config import EngineConfig
from edgellm.engine.engine import LLMEngine
from edgellm.sampling import SamplingParams


def run_batch(engine: LLMEngine, timer: PhaseTimer, batch: int, prompt_len: int, steps: int,
              ops: bool, temperature: float = 0.0) -> dict:
    params = SamplingParams(max_tokens=steps + 8, temperature=temperature, ignore_eos=True)
    vocab = engine.model_config.vocab_size
    g = torch.Generator().manual_seed(batch)
    for i in range(batch):
        ids = torch.randint(100, min(vocab, 20000), (prompt_len,), generator=g).tolist()
        engine.add_request(f"b{batch}-{i}", ids, params)
    # prefill (and the first decode) out of the way
    while any(s.num_computed_tokens < s.num_prompt_tokens for s in engine.seqs.values()):
        engine.step()
    for _ in range(3):
        engine.step()
    timer.reset()
    step_times = []
    prof = None
    if ops:
        prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
        prof.__enter__()
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.step()
        step_times.append(time.perf_counter() - t0)
    if prof is not None:
        prof.__exit__(None, None, None)
    for rid in list(engine.seqs):
        engine.abort_request(rid)
    engine.step()
    step_ms = statistics.median(step_times) * 1e3
    phases = {k: statistics.median(v) * 1e3 for k, v in timer.totals.items() if v}
    phases["engine_other"] = step_ms - sum(phases.values())
    row = {"batch": batch, "step_ms": step_ms, "tok_s": batch * 1e3 / step_ms, "phases_ms": phases}
    if prof is not None:
        events = prof.key_averages()
        row["ops_table"] = events.table(sort_by="self_cpu_time_total", row_limit=25)
        row["ops_per_step"] = sum(e.count for e in events if e.key.startswith("aten::")) / steps
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="default: the embedded SmolLM2 GGUF")
    ap.add_argument("--batch", default="1,16")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--cpu-quant", choices=["auto", "exact", "fast"], default=None)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--kv-cache-dtype", default="auto", help="auto | fp32 | fp16 | fp8 (EngineConfig's)")
    ap.add_argument("--ops", action="store_true", help="torch profiler operator table per batch size")
    ap.add_argument("--temperature", type=float, default=0.0, help="0: greedy; above: every row samples")
    ap.add_argument("--out", default=str(RESULTS / "profile_decode.json"))
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.cpu_quant:
        os.environ["EDGELLM_CPU_QUANT"] = args.cpu_quant
    cfg = EngineConfig(model=args.model, max_num_seqs=64, max_model_len=1024, kv_cache_dtype=args.kv_cache_dtype)
    if "cpu_quant" in EngineConfig.__dataclass_fields__ and args.cpu_quant:
        cfg.cpu_quant = args.cpu_quant
    engine = LLMEngine(cfg)
    timer = PhaseTimer(engine)
    rows = []
    for b in (int(x) for x in args.batch.split(",")):
        row = run_batch(engine, timer, b, args.prompt_len, args.steps, args.ops, args.temperature)
        rows.append(row)
        ph = "  ".join(f"{k} {v:.2f}" for k, v in row["phases_ms"].items())
        print(f"batch {b:3d}: step {row['step_ms']:.2f} ms  {row['tok_s']:.1f} tok/s  |  {ph}")
        if args.ops:
            print(row["ops_table"])
    write_json(args.out, {
        **header(__doc__, __file__), "machine": machine_info(),
        "cpu_quant": args.cpu_quant or env.cpu_quant() or "auto",
        "kv_cache_dtype": str(engine.kv_dtype).replace("torch.", ""), "prompt_len": args.prompt_len,
        "temperature": args.temperature,
        "rows": [{k: v for k, v in r.items() if k != "ops_table"} for r in rows],
    })


if __name__ == "__main__":
    main()
