"""Cross-check `edgellm bench` against an independent client, GuideLLM, on the same server.

Starts `edgellm serve` (the embedded default model unless --model) on a free
port, warms it up, then drives it with the same workload twice:

  1. `guidellm run` (the vLLM project's benchmark tool), synthetic text
     prompts of --input-len tokens, --output-len output tokens (it sends
     ignore_eos, so output lengths are fixed), concurrent profile with
     --concurrency streams, --requests requests;
  2. `python -m edgellm.cli bench`, random dataset with the same input and
     output lengths (range ratio 0, ignore_eos), the same concurrency and
     request count, on the chat completions endpoint like GuideLLM.

Each tool runs --rounds times (default 2), alternating which goes first
(guidellm then edgellm bench, then the reverse), with a new seed per round so
that no prompt is served from the prefix cache twice; on a shared machine
this keeps a change in background load from favouring one tool. The script
prints both tools' TTFT p50/p95, decode time per token, E2E latency, and
output throughput (means over rounds) side by side with the ratio
edgellm bench / guidellm, and the ratios of each round.
The two tools measure the same things under different names:

  - TTFT: both from sending the request to the first streamed chunk with
    content.
  - decode time per token: GuideLLM's "ITL" is (last token - first token) /
    (output tokens - 1) per request; `edgellm bench`'s TPOT is the same
    quantity (measured to the end of the stream). GuideLLM's "TPOT" is
    (last token - request start) / output tokens, i.e. it includes TTFT.
    `edgellm bench`'s ITL is the mean gap between content chunks.
  - output throughput: completed output tokens / benchmark wall time.

Both send the same requests: chat completions, streamed, greedy
(temperature 0, which GuideLLM is given through its backend `extras`),
ignore_eos with a fixed max token count.

Prompt token counts differ by design: GuideLLM counts the server's reported
prompt tokens (chat template included), `edgellm bench` the raw user text.
The client runs on the same cores as the server, so the CPU time each tool
used is recorded too: on a 2-core machine a heavier client slows the server.

Results go to benchmarks/results/guidellm_check.json with the machine
described. The run is bounded (each tool has a wall-clock limit) and the
server is always stopped. Everything runs offline: GuideLLM sizes its
synthetic prompts with the default model's tokenizer, saved to a temporary
directory, and HF_HUB_OFFLINE / TRANSFORMERS_OFFLINE / HF_DATASETS_OFFLINE
are set so that nothing is fetched from the Hugging Face hub.

Installing GuideLLM
-------------------
GuideLLM is not part of edgellm's dependencies. It requires `torch`; install
the pinned CPU torch first so that pip does not pull a CUDA build, and check
with a dry run that torch stays as it is:

    .venv/bin/pip install guidellm==0.8.1 --dry-run     # must not list torch

`pip install guidellm` also installs `sanic` (for GuideLLM's mock server,
not needed here), which brings `uvloop` and `httptools`; uvicorn picks
uvloop up automatically, which would change the event loop `edgellm serve`
runs on. To keep the server's environment unchanged, install GuideLLM
without its dependencies and add the ones it imports:

    .venv/bin/pip install "culsans~=0.10.0" "datasets>=5.0.1" eval_type_backport faker \\
        "ftfy>=6.0.0" "httpx[http2]<1.0.0" loguru msgpack protobuf "pydantic>=2.11.7" \\
        "pydantic-settings>=2.0.0" rich tabulate "more-itertools>=10.8.0" "websockets>=13.0"
    .venv/bin/pip install --no-deps guidellm==0.8.1

(GuideLLM 0.8.1 pins click~=8.4.0; it runs with click 8.5 as well. It warns
that uvloop is not installed; that only affects the client's own overhead.)

Usage:

    python benchmarks/guidellm_check.py                   # 4 streams, 32 requests, 128 in / 64 out, 2 rounds
    python benchmarks/guidellm_check.py --concurrency 8 --requests 64 --rounds 1
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from edgellm.bench.guidellm import (
    compare,
    format_table,
    mean_of_rounds,
    parse_edgellm,
    parse_guidellm,
)
from edgellm.bench.guidellm_runs import (
    edgellm_bench_cmd,
    guidellm_cmd,
    guidellm_executable,
    run_tool,
    save_tokenizer,
    versions,
    warm_up,
)
from edgellm.bench.machine import load_average, machine_info
from edgellm.bench.servers import ServerProcess, served_model

REPO = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO / "benchmarks" / "results" / "guidellm_check.json"

def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="HF directory or .gguf to serve (default: the embedded model)")
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2,
                    help="runs per tool, alternating which goes first (A-B, B-A, ...) so that a change in "
                         "machine load affects both alike; each round uses a new seed (no prefix-cache reuse)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--kv-cache-memory", default="512M")
    ap.add_argument("--request-timeout", type=float, default=300.0, help="per-request timeout (s)")
    ap.add_argument("--tool-timeout", type=float, default=600.0, help="wall-clock limit for each tool run (s)")
    ap.add_argument("--client-nice", type=int, default=0,
                    help="run both clients at this nice level (e.g. 10) so that their CPU use competes "
                         "less with the server on a small machine")
    ap.add_argument("--out", default=str(DEFAULT_OUT))
    ap.add_argument("--keep-logs", default=None, help="copy the server and tool logs to this directory")
    args = ap.parse_args()
    if args.rounds < 1:
        ap.error("--rounds must be >= 1")

    if not guidellm_executable():
        print("guidellm is not installed; see the installation notes in this script's docstring",
              file=sys.stderr)
        return 2

    info = machine_info()
    info["versions"] = versions()
    work = Path(tempfile.mkdtemp(prefix="guidellm_check_"))
    tok_dir = save_tokenizer(args.model, work / "tokenizer")
    serve_args = ["--kv-cache-memory", args.kv_cache_memory] + (["--model", args.model] if args.model else [])
    server = ServerProcess(serve_args, work / "server.log", cwd=REPO)
    g_runs: list[dict[str, Any]] = []
    e_runs: list[dict[str, Any]] = []
    t_start = time.monotonic()
    try:
        server.wait_ready(300)
        model = served_model(server.url)
        warm_up(server.url, model)
        for rnd in range(args.rounds):
            seed = args.seed + rnd
            rargs = argparse.Namespace(**{**vars(args), "seed": seed})
            g_json, e_json = work / f"guidellm.{rnd}.json", work / f"edgellm_bench.{rnd}.json"
            g_cmd = guidellm_cmd(server.url, model, tok_dir, rargs, g_json)
            e_cmd = edgellm_bench_cmd(server.url, model, args.model, rargs, e_json)
            if args.client_nice:
                g_cmd = ["nice", "-n", str(args.client_nice), *g_cmd]
                e_cmd = ["nice", "-n", str(args.client_nice), *e_cmd]
            order = ["guidellm", "edgellm bench"] if rnd % 2 == 0 else ["edgellm bench", "guidellm"]
            for name in order:
                if name == "guidellm":
                    run = run_tool(name, g_cmd, g_json, work / f"guidellm.{rnd}.log", args.tool_timeout)
                    g_runs.append({**parse_guidellm(g_json), "round": rnd, "seed": seed, **run})
                else:
                    run = run_tool(name, e_cmd, e_json, work / f"edgellm_bench.{rnd}.log", args.tool_timeout)
                    e_runs.append({**parse_edgellm(e_json), "round": rnd, "seed": seed, **run})
    finally:
        server.stop()
        if args.keep_logs:
            dest = Path(args.keep_logs)
            dest.mkdir(parents=True, exist_ok=True)
            for f in work.iterdir():
                if f.is_file():
                    shutil.copy(f, dest / f.name)
        shutil.rmtree(work, ignore_errors=True)

    g, e = mean_of_rounds(g_runs), mean_of_rounds(e_runs)
    rows = compare(g, e)
    per_round = [{"round": gr["round"], "comparison": compare(gr, er)} for gr, er in zip(g_runs, e_runs)]
    notes = [
        "decode ms/token: GuideLLM's ITL and edgellm bench's TPOT, both (last - first token) / (n - 1)",
        (f"GuideLLM TPOT including TTFT, mean: {g['guidellm_tpot_incl_ttft_mean_ms']:.1f} ms; "
         f"edgellm bench mean chunk gap (ITL): {e['itl_mean_ms']:.1f} ms"),
        f"GuideLLM throughput from totals: {g['output_throughput_from_totals_tok_s']:.1f} tok/s",
        (f"prompt tokens per request: GuideLLM {g['prompt_tokens_mean']:.0f} (server count, chat "
         f"template included), edgellm bench {e['prompt_tokens_mean']:.0f} (raw user text)"),
        (f"client CPU per run (the client shares the machine's cores with the server): GuideLLM "
         f"{g['client_cpu_s']:.0f} s in {g['wall_s']:.0f} s, edgellm bench {e['client_cpu_s']:.0f} s "
         f"in {e['wall_s']:.0f} s (process start-up included)"),
        (f"{args.rounds} round(s) per tool on the same warm server, alternating which tool goes first; "
         "values are means over rounds"),
    ]
    result = {
        "workload": {"endpoint": "/v1/chat/completions", "concurrency": args.concurrency,
                     "requests": args.requests, "input_len": args.input_len, "output_len": args.output_len,
                     "ignore_eos": True, "rounds": args.rounds, "client_nice": args.client_nice, "seeds": [r["seed"] for r in g_runs]},
        "server": {"model": model,
                   "source": args.model or "embedded default (SmolLM2-135M-Instruct Q4_1 GGUF)",
                   "kv_cache_memory": args.kv_cache_memory},
        "machine": {**info, "load_avg_1m_at_end": load_average(),
                    "total_wall_s": round(time.monotonic() - t_start, 1)},
        "comparison": rows,
        "per_round": per_round,
        "guidellm_runs": g_runs,
        "edgellm_bench_runs": e_runs,
        "notes": notes,
    }

    print(f"\nGuideLLM vs edgellm bench on edgellm serve ({model}): {args.concurrency} streams, "
          f"{args.requests} requests, {args.input_len} in / {args.output_len} out, {args.rounds} round(s)")
    print(f"machine: {info['cpu']}, {info['cores']} cores, {info['date']}, load average "
          f"{info['load_average_start']} at start, {result['machine']['load_avg_1m_at_end']} at end\n")
    print(format_table(rows))
    if args.rounds > 1:
        for pr in per_round:
            ratios = {r["key"]: r["ratio_edgellm_over_guidellm"] for r in pr["comparison"]}
            print(f"  round {pr['round']}: ratio e/g TTFT p50 {ratios['ttft_p50_ms']:.3f}, "
                  f"decode ms/token {ratios['decode_ms_per_token_mean']:.3f}, "
                  f"output tok/s {ratios['output_throughput_tok_s']:.3f}")
    for note in notes:
        print(f"  - {note}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
