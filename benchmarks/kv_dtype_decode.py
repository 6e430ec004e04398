"""What the KV cache's element type costs a CPU decode step: one engine per --kv dtype, all in one
process on the same model, decode steps timed at each (batch, context), the engines alternating
round by round so the machine's drift hits them alike; plus the C++ decode attention op alone
over the same pages in each dtype. Ratios are the first dtype's time over each other's (> 1: the
other is faster).

    python benchmarks/kv_dtype_decode.py [--kv fp32,fp16] [--batch 1,16] [--context 128,512,1024]
        [--rounds 5] [--steps 8] [--model FILE] [--out FILE]

Writes benchmarks/results/kv_dtype_decode.json.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

import torch

from edgellm.bench.machine import best_of, describe, machine_info
from edgellm.bench.results import RESULTS, header, write_json
from edgellm.config import EngineConfig
from edgellm.cpu_isa import select
from edgellm.engine.engine import LLMEngine
from edgellm.kernels import cpu_native
from edgellm.sampling import SamplingParams


def start(engine: LLMEngine, tag: str, batch: int, context: int, steps: int, rounds: int) -> None:
    """`batch` requests with `context`-token prompts, prefilled and one token decoded."""
    params = SamplingParams(max_tokens=steps * rounds + 8, temperature=0.0, ignore_eos=True)
    g = torch.Generator().manual_seed(batch * 7919 + context)
    for i in range(batch):
        ids = torch.randint(100, 20000, (context,), generator=g).tolist()
        engine.add_request(f"{tag}-{i}", ids, params)
    while any(s.num_computed_tokens <= s.num_prompt_tokens for s in engine.seqs.values()):
        engine.step()


def step_ms(engine: LLMEngine, steps: int) -> float:
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def attention_op_ms(native, dtypes: list[torch.dtype], batch: int, context: int, rounds: int) -> list[float]:
    """The decode_attention op over SmolLM2's heads (9 q, 3 kv, 64 dims) in each dtype's pages."""
    bs = 16
    blocks = -(-context // bs)
    g = torch.Generator().manual_seed(context)
    cache = torch.randn(2, batch * blocks + 8, bs, 3, 64, generator=g)
    tables = torch.randperm(batch * blocks + 8, generator=g)[: batch * blocks].view(batch, blocks).contiguous()
    lens = torch.full((batch,), context, dtype=torch.long)
    q = torch.randn(batch, 9, 64, generator=g)
    caches = [cache.to(dt) for dt in dtypes]
    best = [float("inf")] * len(dtypes)
    for _ in range(rounds):  # the dtypes alternating
        for i, c in enumerate(caches):
            run = functools.partial(native.decode_attention, q, c, tables, lens, 0.125, 0)
            best[i] = min(best[i], best_of(run, 1, 20) * 1e3)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kv", default="fp32,fp16", help="kv_cache_dtype values, the first the base")
    ap.add_argument("--batch", default="1,16")
    ap.add_argument("--context", default="128,512,1024")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=8, help="decode steps timed per engine per round")
    ap.add_argument("--model", default=None, help="default: the embedded SmolLM2 GGUF")
    ap.add_argument("--out", default=str(RESULTS / "kv_dtype_decode.json"))
    args = ap.parse_args()
    info = machine_info()
    print(describe(info))
    kvs = args.kv.split(",")
    batches = [int(x) for x in args.batch.split(",")]
    contexts = [int(x) for x in args.context.split(",")]
    longest = max(contexts) + args.steps * args.rounds + 16
    engines = {
        kv: LLMEngine(EngineConfig(model=args.model, kv_cache_dtype=kv, max_num_seqs=max(batches),
                                   max_model_len=longest, kv_cache_memory=max(batches) * longest * 4 * 1536 * 40,
                                   enable_prefix_caching=False))
        for kv in kvs
    }
    dtypes = [e.kv_dtype for e in engines.values()]
    native = cpu_native.load()
    rows = []
    for batch in batches:
        for context in contexts:
            for kv, e in engines.items():
                start(e, kv, batch, context, args.steps, args.rounds)
            times: dict[str, list[float]] = {kv: [] for kv in kvs}
            for _ in range(args.rounds):
                for kv, e in engines.items():
                    times[kv].append(step_ms(e, args.steps))
            for e in engines.values():
                for rid in list(e.seqs):
                    e.abort_request(rid)
                e.step()
            ms = {kv: statistics.median(t) for kv, t in times.items()}
            row = {"batch": batch, "context": context, "step_ms": ms,
                   "step_speedup_x": {kv: ms[kvs[0]] / ms[kv] for kv in kvs[1:]}}
            if native is not None and all(d in (torch.float32, torch.float16) for d in dtypes):
                op = attention_op_ms(native, dtypes, batch, context, args.rounds)
                row["attention_op_ms_per_layer"] = dict(zip(kvs, op))
                row["attention_op_speedup_x"] = {kv: op[0] / o for kv, o in zip(kvs[1:], op[1:])}
            rows.append(row)
            print(f"batch {batch:3d} context {context:5d}: step "
                  + "  ".join(f"{kv} {ms[kv]:.2f} ms" for kv in kvs)
                  + "  |  " + "  ".join(f"{kv} {x:.2f}x" for kv, x in row["step_speedup_x"].items())
                  + ("  |  attention op " + "  ".join(f"{kv} {x:.2f}x" for kv, x in row["attention_op_speedup_x"].items())
                     if "attention_op_speedup_x" in row else ""))
    write_json(args.out, {
        **header(__doc__, __file__), "machine": {**info, "isa": select().describe()}, "kv_cache_dtypes": dict(zip(kvs, (str(d).replace("torch.", "") for d in dtypes))),
        "rows": rows,
    })


if __name__ == "__main__":
    main()
