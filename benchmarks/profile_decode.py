"""Where a decode step's time goes: scheduler, batch building, the model, logits, sampling, and
the engine's per-token bookkeeping, at several batch sizes; plus the torch operator profile of the
forward pass.

    python benchmarks/profile_decode.py                       # default model, batch 1 and 16
    python benchmarks/profile_decode.py --batch 1,4,16 --cpu-quant fast --ops

Prints a table of milliseconds per step by phase, the decode tokens/s each batch size reaches, and
(with --ops) the top operators by self CPU time. Writes benchmarks/results/profile_decode.json.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch

from edgellm.bench.report import cpu_name
from edgellm.config import EngineConfig
from edgellm.engine.engine import LLMEngine
from edgellm.sampling import SamplingParams

RESULTS = Path(__file__).parent / "results"


class _Timed:
    """A callable object whose calls go through `timed`, every other attribute through to it."""

    def __init__(self, inner: object, timed) -> None:
        self._inner, self._timed = inner, timed

    def __call__(self, *a, **k):
        return self._timed(*a, **k)

    def __getattr__(self, name: str):
        return getattr(self._inner, name)


class PhaseTimer:
    """Wraps the engine's phases with perf_counter timers (monkeypatching bound methods)."""

    def __init__(self, engine: LLMEngine) -> None:
        self.totals: dict[str, list[float]] = {}
        runner, model = engine.runner, engine.runner.model
        self.wrap(engine.scheduler, "schedule", "schedule")
        self.wrap(runner, "build_batch", "build_batch")
        self.wrap(model, "forward", "forward")
        self.wrap(model, "compute_logits", "logits")
        self.wrap(runner, "sampler", "sample")

    def wrap(self, owner: object, name: str, key: str) -> None:
        """Time every call of owner.name under `key` (seconds per call in self.totals[key]); a
        callable object (the sampler) keeps its attributes through a proxy."""
        fn = getattr(owner, name)
        bucket = self.totals.setdefault(key, [])

        def timed(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                bucket.append(time.perf_counter() - t0)

        setattr(owner, name, timed if inspect.ismethod(fn) or inspect.isfunction(fn) else _Timed(fn, timed))

    def reset(self) -> None:
        for v in self.totals.values():
            v.clear()


def run_batch(engine: LLMEngine, timer: PhaseTimer, batch: int, prompt_len: int, steps: int,
              ops: bool) -> dict:
    params = SamplingParams(max_tokens=steps + 8, temperature=0.0, ignore_eos=True)
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
    ap.add_argument("--ops", action="store_true", help="torch profiler operator table per batch size")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.cpu_quant:
        os.environ["EDGELLM_CPU_QUANT"] = args.cpu_quant
    cfg = EngineConfig(model=args.model, max_num_seqs=64, max_model_len=1024)
    if "cpu_quant" in EngineConfig.__dataclass_fields__ and args.cpu_quant:
        cfg.cpu_quant = args.cpu_quant
    engine = LLMEngine(cfg)
    timer = PhaseTimer(engine)
    rows = []
    for b in (int(x) for x in args.batch.split(",")):
        row = run_batch(engine, timer, b, args.prompt_len, args.steps, args.ops)
        rows.append(row)
        ph = "  ".join(f"{k} {v:.2f}" for k, v in row["phases_ms"].items())
        print(f"batch {b:3d}: step {row['step_ms']:.2f} ms  {row['tok_s']:.1f} tok/s  |  {ph}")
        if args.ops:
            print(row["ops_table"])
    out = {
        "machine": {"cpu": cpu_name(), "threads": torch.get_num_threads(), "torch": torch.__version__,
                    "platform": platform.platform()},
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "cpu_quant": os.environ.get("EDGELLM_CPU_QUANT", "auto"),
        "rows": [{k: v for k, v in r.items() if k != "ops_table"} for r in rows],
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "profile_decode.json").write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
