"""Structured outputs: the cost of a grammar, side by side in one run on the default model.

  1. Grammar engines, on the same 20 random schemas and the default model's tokenizer: xgrammar
     (what edgellm uses) vs llguidance (measured only if installed): compile time per schema and
     the per-token mask time along one valid output of each schema. The mask is what a batched
     decode step pays per constrained row.
  2. Decode throughput (generated tokens/s) of requests under a JSON schema vs free requests of the
     same length, at 1 and 16 at once, runs of the two kinds interleaved; the ratio of medians.
  3. The compile time a first-seen schema adds to its request's TTFT.
Writes benchmarks/results/structured_outputs.json.

    python benchmarks/structured_outputs.py [--cpu-quant auto] [--tokens 64]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from edgellm import LLM, SamplingParams
from edgellm.bench.machine import machine_info
from edgellm.bench.schemas import schemas
from edgellm.structured import StructuredOutputs
from edgellm.structured.grammar import GrammarService


def valid_path(service: GrammarService, spec: StructuredOutputs, eos: list[int], seed: int) -> list[int]:
    """The tokens of one output the grammar allows (greedy over random logits, up to its end)."""
    m = service.matcher(service.compile(spec))
    gen = torch.Generator().manual_seed(seed)
    out: list[int] = []
    for _ in range(400):
        logits = torch.randn(1, service.vocab_size, generator=gen) * 4
        service.mask(logits, [m], [0])
        tok = int(logits[0].argmax())
        m.accept(tok)
        if tok in eos:
            break
        out.append(tok)
    return out


def engines(tok, vocab: int) -> dict:
    svc = GrammarService(tok.hf, vocab, tok.eos_token_ids)
    specs = [StructuredOutputs(json=s) for s in schemas(20, seed=5)]
    paths = [valid_path(svc, s, tok.eos_token_ids, i) for i, s in enumerate(specs)]
    import xgrammar as xgr

    info = xgr.TokenizerInfo.from_huggingface(tok.hf, vocab_size=vocab, stop_token_ids=tok.eos_token_ids)
    comp = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    bm = xgr.allocate_token_bitmask(1, vocab)
    res: dict = {"xgrammar": {"compile_ms": [], "mask_us": []}}
    for spec, path in zip(specs, paths):
        t = time.perf_counter()
        cg = comp.compile_json_schema(spec.schema(), any_whitespace=False)
        res["xgrammar"]["compile_ms"].append((time.perf_counter() - t) * 1e3)
        m = xgr.GrammarMatcher(cg)
        for tid in path:
            t = time.perf_counter()
            m.fill_next_token_bitmask(bm, 0)
            res["xgrammar"]["mask_us"].append((time.perf_counter() - t) * 1e6)
            m.accept_token(tid)
    try:
        import llguidance
        import llguidance.hf
        import llguidance.torch as lt
    except ImportError:
        res["llguidance"] = "not installed"
    else:
        ll = llguidance.hf.from_tokenizer(tok.hf, n_vocab=vocab)
        lbm = lt.allocate_token_bitmask(1, vocab)
        res["llguidance"] = {"compile_ms": [], "mask_us": []}
        for spec, path in zip(specs, paths):
            t = time.perf_counter()
            m = llguidance.LLMatcher(ll, llguidance.LLMatcher.grammar_from_json_schema(
                json.dumps(spec.schema()), defaults={"whitespace_flexible": False}))
            res["llguidance"]["compile_ms"].append((time.perf_counter() - t) * 1e3)
            for tid in path:
                t = time.perf_counter()
                lt.fill_next_token_bitmask(m, lbm, 0)
                res["llguidance"]["mask_us"].append((time.perf_counter() - t) * 1e6)
                m.consume_token(tid)
    summary = {}
    for name, r in res.items():
        if isinstance(r, dict):
            summary[name] = {"compile_ms_median": statistics.median(r["compile_ms"]),
                             "mask_us_mean": statistics.fmean(r["mask_us"]),
                             "mask_us_p99": sorted(r["mask_us"])[int(0.99 * len(r["mask_us"]))]}
        else:
            summary[name] = r
    svc.shutdown()
    return summary


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cpu-quant", default="auto")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3, help="interleaved runs of each kind per level")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "structured_outputs.json"))
    args = ap.parse_args()
    llm = LLM(None, max_model_len=1024, cpu_quant=args.cpu_quant)
    tok = llm.get_tokenizer()
    vocab = llm.engine.model_config.vocab_size
    result: dict = {"machine": machine_info(), "cpu_quant": args.cpu_quant, "engines": engines(tok, vocab)}
    # a schema whose valid outputs are all long; the free requests then generate as many tokens
    items = max(4, args.tokens // 4)
    long_schema = {"type": "array", "items": {"type": "integer", "minimum": 10, "maximum": 99},
                   "minItems": items, "maxItems": items}
    constrained = SamplingParams(max_tokens=8 * items, temperature=0,
                                 structured_outputs=StructuredOutputs(json=long_schema))
    llm.generate(["warm up"], constrained)
    result["decode"] = {}
    for streams in (1, 16):
        prompts = [f"List some numbers, set {i}:" for i in range(streams)]
        n = len(llm.generate(prompts[:1], constrained)[0].outputs[0].token_ids)
        free = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
        runs: dict[str, list[tuple[int, float]]] = {"json_schema": [], "free": []}
        for _ in range(args.repeats):  # interleaved, so drift in the machine's speed hits both
            for name, params in (("json_schema", constrained), ("free", free)):
                t = time.perf_counter()
                outs = llm.generate(prompts, params)
                dt = time.perf_counter() - t
                runs[name].append((sum(len(o.outputs[0].token_ids) for o in outs), dt))
        row = {}
        for name, got in runs.items():
            rates = [g / dt for g, dt in got]
            row[name] = {"tokens": got[0][0], "tokens_per_s_median": round(statistics.median(rates), 1),
                         "tokens_per_s": [round(r, 1) for r in rates]}
        row["json_schema_vs_free"] = round(row["json_schema"]["tokens_per_s_median"]
                                           / row["free"]["tokens_per_s_median"], 3)
        result["decode"][f"{streams}_streams"] = row
    fresh = {"type": "object", "properties": {f"k{i}": {"type": "string", "maxLength": 9} for i in range(12)},
             "required": [f"k{i}" for i in range(12)], "additionalProperties": False}
    t = time.perf_counter()
    llm.engine.grammars.compile(StructuredOutputs(json=fresh))
    result["first_schema_compile_ms"] = round((time.perf_counter() - t) * 1e3, 2)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
