"""Voice-agent time to first token: edgellm serve with and without prefix caching.

The workload is `edgellm bench --dataset voice`: one fixed 512-token system prompt, a new
32-token user turn per request, 64-token answers, greedy, streamed; one turn is sent first and
not measured, so the system prompt is cached as in a deployed agent (the registry's
warm_prompts). Two arrival patterns:

  - closed loop, 8 concurrent streams (each sends its next turn when the last one ends);
    equal answer lengths keep the 8 streams in step, so 8 user turns arrive together;
  - Poisson arrivals at --rate requests/s (default 1.6: about 4 streams in flight).

With --tools N, the closed loop also runs with N function tools on every request
(`tool_choice: auto`, as a pipecat agent sends them; the tools are part of the cached prompt),
side by side with the same turns without tools; a tool call's first fragment counts as the
first token.

For each: TTFT p50 / p95 / p99 and decode tok/s per stream. Also the breakdown of one
"wave" (8 user turns admitted together over the cached system prompt) by phase, offline
in this process, which is what bounds the closed-loop TTFT, and that wave's compute floor
(edgellm/bench/compute_floor.py: its multiply-adds at this CPU's measured int8 / bf16 / fp32
matmul rates), which bounds the wave.

    python benchmarks/voice_ttft.py [--cpu-quant fast] [--requests 48] [--rate 1.6]

Writes benchmarks/results/voice_ttft.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from edgellm.bench.compute_floor import floor_ms, matmul_rates, prefill_macs
from edgellm.bench.machine import machine_info
from edgellm.bench.phases import PhaseTimer
from edgellm.bench.results import header, write_json
from edgellm.bench.servers import Server, free_port, served_model

RESULTS = Path(__file__).parent / "results"


def voice_tools(n: int) -> list[dict]:
    """n function tools of a voice agent (the first four: weather, table booking, order lookup,
    call transfer; more are numbered variants), in OpenAI's request shape."""

    def tool(name: str, description: str, **params: str) -> dict:
        props = {p: {"type": "string", "description": d} for p, d in params.items()}
        schema = {"type": "object", "properties": props, "required": list(params)}
        return {"type": "function",
                "function": {"name": name, "description": description, "parameters": schema}}

    base = [
        tool("get_weather", "Current weather for a city", city="the city name"),
        tool("book_table", "Book a restaurant table", restaurant="name", time="HH:MM", party="people"),
        tool("lookup_order", "Find an order by its number", order_id="the order number"),
        tool("transfer_call", "Transfer the caller to a department", department="sales or support"),
    ]
    return [base[i % 4] if i < 4 else tool(f"{base[i % 4]['function']['name']}_{i}",
                                            base[i % 4]["function"]["description"], value="a value")
            for i in range(n)]


def run_workload(url: str, tokenizer: Any, n: int, concurrency: int | None, rate: float, seed: int,
                 tools: int = 0) -> dict:
    from edgellm.bench.client import Target, run_load, send_one
    from edgellm.bench.datasets import random_requests, voice_requests_warmed
    from edgellm.bench.report import summarize

    extra = {"tools": voice_tools(tools), "tool_choice": "auto"} if tools else {}
    target = Target(url, served_model(url), "chat", None, ignore_eos=True, timeout=600.0, extra_body=extra)
    asyncio.run(run_load(target, random_requests(tokenizer, 2, 16, 4, 0.0, 12345, True), 1, duration=300))
    # one turn first, not measured: the system prompt is then cached (with prefix caching), as
    # for a deployed agent that lists it in the registry's warm_prompts
    first, reqs = voice_requests_warmed(tokenizer, n, 512, 32, 64, seed)
    send_one(target, first, 300)
    results, elapsed = asyncio.run(run_load(target, reqs, concurrency, rate, 1.0, seed, duration=900))
    s = summarize(results, elapsed, label="voice")
    return {"completed": s["completed"], "failed": s["failed"] + (n - len(results)),
            "ttft_p50_ms": s["ttft_ms"]["median"], "ttft_p95_ms": s["ttft_ms"]["p95"],
            "ttft_p99_ms": s["ttft_ms"]["p99"], "decode_tok_s_per_stream": s["decode_tokens_per_s_per_stream"],
            "output_tok_s": s["output_token_throughput"]}


def wave_breakdown(cpu_quant: str | None) -> dict:
    """One wave of 8 voice turns over the cached system prompt, timed by phase (offline)."""
    import torch

    from edgellm.bench.datasets import voice_requests
    from edgellm.config import EngineConfig
    from edgellm.engine.engine import LLMEngine
    from edgellm.sampling import SamplingParams

    cfg = EngineConfig(max_num_seqs=64, max_model_len=2048)
    if cpu_quant:
        cfg.cpu_quant = cpu_quant
    eng = LLMEngine(cfg)
    prompts = [eng.tokenizer.encode_chat(r.messages) for r in voice_requests(eng.tokenizer, 9, 512, 32, 64, 0)]
    params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    eng.add_request("warm", prompts[0], params)
    while eng.seqs:
        eng.step()
    timer = PhaseTimer(eng)  # engine phases (forward, logits, ...) plus the layers' parts below
    for layer in eng.runner.model.model.layers:
        timer.wrap(layer.self_attn, "forward", "attention block (norm excluded)")
        timer.wrap(layer.self_attn.attn, "forward", "attention (KV write + paged attention)")
        timer.wrap(layer.mlp, "forward", "MLP block")
        for lin in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
            timer.wrap(lin, "forward", "linears (all four)")
    timer.reset()
    for i in range(8):
        eng.add_request(f"w{i}", prompts[1 + i], params)
    t0 = time.perf_counter()
    eng.step()
    step_ms = (time.perf_counter() - t0) * 1e3
    phases = {k: sum(v) * 1e3 for k, v in timer.totals.items() if v}  # the prefill step alone
    seqs = list(eng.seqs.values())
    new = sum(s.num_computed_tokens - s.num_cached_tokens for s in seqs)
    t0 = time.perf_counter()
    eng.step()
    decode_ms = (time.perf_counter() - t0) * 1e3
    for rid in list(eng.seqs):
        eng.abort_request(rid)
    eng.step()
    model = eng.runner.model
    macs = prefill_macs(model, [s.num_prompt_tokens - s.num_cached_tokens for s in seqs],
                        [s.num_prompt_tokens for s in seqs])
    rates = matmul_rates()
    prefill_dtype = getattr(model.model.layers[0].self_attn.attn.backend, "prefill_dtype", None)
    att_dtype = "bf16" if prefill_dtype == torch.bfloat16 else "fp32"
    return {"prefill_step_ms": step_ms, "new_tokens": new, "cached_tokens_per_request": seqs[0].num_cached_tokens,
            "prompt_tokens_per_request": seqs[0].num_prompt_tokens, "next_decode_step_ms": decode_ms,
            "phases_ms": phases, "threads": torch.get_num_threads(),
            "floor": {"gmacs": macs, "matmul_gmac_s": rates, "attention_dtype": att_dtype,
                      "floor_ms": floor_ms(macs, rates, att_dtype)}}


def print_floor(floor: dict) -> None:
    fl, gm, rates = floor["floor_ms"], floor["gmacs"], floor["matmul_gmac_s"]
    print(f"compute floor of the wave: linears {gm['linears']:.1f} GMAC at the int8 rate "
          f"({rates.get('int8', float('nan')):.0f} GMAC/s) {fl['linears']:.0f} ms, attention {gm['attention']:.1f} GMAC "
          f"at the {floor['attention_dtype']} rate ({rates[floor['attention_dtype']]:.0f} GMAC/s) "
          f"{fl['attention']:.0f} ms: {fl['total']:.0f} ms in all (fp32 rate {rates['fp32']:.0f} GMAC/s)")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cpu-quant", choices=["auto", "exact", "fast"], default="auto")
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--rate", type=float, default=1.6)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tools", type=int, default=0,
                    help="also run the closed loop with this many function tools per request")
    ap.add_argument("--server-arg", action="append", default=[],
                    help="extra `edgellm serve` argument (repeatable), e.g. --server-arg=--max-num-batched-tokens=256")
    ap.add_argument("--closed-loop-only", action="store_true", help="skip the Poisson runs, the run without "
                    "prefix caching and the wave breakdown")
    ap.add_argument("--wave-only", action="store_true", help="only the wave breakdown and its compute floor")
    ap.add_argument("--out", default=str(RESULTS / "voice_ttft.json"))
    args = ap.parse_args()
    from edgellm.loader import default_model_path
    from edgellm.tokenizer import Tokenizer

    if args.wave_only:
        wave = wave_breakdown(args.cpu_quant)
        print(f"one wave: {wave['new_tokens']} new tokens, prefill step {wave['prefill_step_ms']:.0f} ms, "
              f"linears {wave['phases_ms'].get('linears (all four)', float('nan')):.0f} ms, attention "
              f"{wave['phases_ms'].get('attention (KV write + paged attention)', float('nan')):.0f} ms")
        print_floor(wave["floor"])
        write_json(args.out, {**header(__doc__, __file__), "machine": machine_info(),
                              "cpu_quant": args.cpu_quant, "wave": wave})
        return 0
    tokenizer = Tokenizer.load(Path(default_model_path()), "gguf")
    runs: list[dict] = []
    log_dir = Path(tempfile.mkdtemp(prefix="edgellm-voice-"))
    for prefix in (True,) if args.closed_loop_only else (True, False):
        port = free_port()
        cmd = [sys.executable, "-m", "edgellm.cli", "serve", "--port", str(port), "--no-access-log",
               f"--cpu-quant={args.cpu_quant}", *args.server_arg] + ([] if prefix else ["--no-enable-prefix-caching"])
        server = Server("edgellm" + ("" if prefix else "-no-prefix-cache"), cmd, port, log_dir)
        try:
            server.start(600)
            patterns = [("closed loop", args.concurrency, float("inf"), 0)]
            if args.tools and prefix:
                patterns.append(("closed loop", args.concurrency, float("inf"), args.tools))
            if not args.closed_loop_only:
                patterns.append(("poisson", None, args.rate, 0))
            for label, conc, rate, tools in patterns:
                row = run_workload(server.url, tokenizer, args.requests, conc, rate, args.seed, tools)
                row.update({"prefix_caching": prefix, "arrivals": label, "tools": tools,
                            "concurrency": conc, "request_rate": None if rate == float("inf") else rate})
                runs.append(row)
                label = f"{label} +{tools} tools" if tools else label
                print(f"prefix cache {'on ' if prefix else 'off'} {label:>11}: TTFT p50 {row['ttft_p50_ms']:7.1f} "
                      f"p95 {row['ttft_p95_ms']:7.1f} p99 {row['ttft_p99_ms']:7.1f} ms  decode "
                      f"{row['decode_tok_s_per_stream']:6.1f} tok/s/stream  ({row['completed']} ok, "
                      f"{row['failed']} failed)", flush=True)
        finally:
            server.stop()
    if args.closed_loop_only:
        Path(args.out).write_text(json.dumps({"runs": runs, "server_args": args.server_arg,
                                              "machine": machine_info(),
                                              "date": time.strftime("%Y-%m-%d %H:%M")}, indent=2))
        print(f"wrote {args.out}")
        return 0
    wave = wave_breakdown(args.cpu_quant)
    print(f"one wave of 8 turns: {wave['new_tokens']} new tokens over {wave['cached_tokens_per_request']} cached "
          f"each: prefill step {wave['prefill_step_ms']:.0f} ms; next decode step {wave['next_decode_step_ms']:.0f} ms")
    for k, v in sorted(wave["phases_ms"].items(), key=lambda kv: -kv[1]):
        print(f"  {k:42s} {v:7.1f} ms")
    print_floor(wave["floor"])
    write_json(args.out, {**header(__doc__, __file__), "machine": machine_info(),
                          "cpu_quant": args.cpu_quant, "server_args": args.server_arg,
                          "runs": runs, "wave": wave})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
