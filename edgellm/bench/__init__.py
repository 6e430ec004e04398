"""`edgellm bench`: a serving benchmark for any OpenAI-compatible endpoint,
modelled on `vllm bench serve` (datasets, arrival processes, TTFT/TPOT/ITL/E2E
percentiles, throughput, goodput under SLOs, JSON and plots)."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path
from typing import Any

from tqdm import tqdm

from edgellm.bench.client import Target, run_load, send_one
from edgellm.bench.datasets import BenchRequest, file_requests, random_requests, voice_requests
from edgellm.bench.report import format_table, parse_goodput, plot, summarize

__all__ = ["add_bench_parser", "run_bench", "build_requests"]


def add_bench_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "bench", help="benchmark an OpenAI-compatible server (ours or another)"
    )
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument(
        "--model", default=None, help="served model name (default: the first of /v1/models)"
    )
    p.add_argument("--endpoint", choices=["chat", "completions"], default="chat")
    p.add_argument("--api-key", default=None)
    p.add_argument("--dataset", choices=["random", "voice", "file"], default="random")
    p.add_argument(
        "--prompts-file", default=None, help="for --dataset file: one prompt per line or JSONL"
    )
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--range-ratio", type=float, default=0.0, help="lengths drawn in mean*(1±ratio)")
    p.add_argument(
        "--system-prompt-len", type=int, default=512, help="voice: fixed system prompt tokens"
    )
    p.add_argument("--user-len", type=int, default=32, help="voice: user turn tokens")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument(
        "--request-rate", type=float, default=float("inf"), help="requests/s (inf: all at once)"
    )
    p.add_argument(
        "--burstiness", type=float, default=1.0, help="gamma shape; 1.0 = Poisson arrivals"
    )
    p.add_argument("--sweep", default=None, help="comma-separated concurrencies, e.g. 1,2,4,8,16")
    p.add_argument(
        "--duration", type=float, default=600.0, help="stop each run after this many seconds"
    )
    p.add_argument("--timeout", type=float, default=300.0, help="per-request timeout (s)")
    p.add_argument("--goodput", nargs="*", default=None, help="SLOs in ms, e.g. ttft:200 tpot:50")
    p.add_argument(
        "--no-ignore-eos",
        dest="ignore_eos",
        action="store_false",
        help="let requests stop at EOS (default: ignore_eos so output lengths are fixed)",
    )
    p.add_argument(
        "--tokenizer",
        default=None,
        help="HF dir or .gguf used to size prompts (default: the embedded default model's)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", dest="json_out", default=None, help="write results here")
    p.add_argument("--plot", default=None, help="write a PNG with TTFT/ITL CDFs (and the sweep)")
    p.add_argument("--no-progress", dest="progress", action="store_false")
    p.add_argument(
        "--skip-initial-test",
        dest="initial_test",
        action="store_false",
        help="skip the unmeasured first request (it checks the endpoint and, for --dataset "
        "voice, puts the system prompt in the server's prompt cache)",
    )
    p.set_defaults(func=run_bench)
    return p


def _tokenizer(path: str | None) -> Any:
    from edgellm.loader import default_model_path
    from edgellm.tokenizer import Tokenizer

    src = Path(path) if path else default_model_path()
    tok = Tokenizer.load(src, "gguf" if src.suffix == ".gguf" else "safetensors")
    if tok is None:
        raise ValueError(f"{src}: no tokenizer found to size the prompts")
    return tok


def build_requests(args: argparse.Namespace, tokenizer: Any) -> list[BenchRequest]:
    chat = args.endpoint == "chat"
    if args.dataset == "voice":
        if not chat:
            raise ValueError("--dataset voice needs --endpoint chat (it has a system prompt)")
        return voice_requests(
            tokenizer,
            args.num_prompts,
            args.system_prompt_len,
            args.user_len,
            args.output_len,
            args.seed,
        )
    if args.dataset == "file":
        if not args.prompts_file:
            raise ValueError("--dataset file needs --prompts-file")
        return file_requests(
            args.prompts_file, tokenizer, args.num_prompts, args.output_len, chat, args.seed
        )
    return random_requests(
        tokenizer,
        args.num_prompts,
        args.input_len,
        args.output_len,
        args.range_ratio,
        args.seed,
        chat,
    )


def _first_model(base_url: str, api_key: str | None) -> str:
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    resp = httpx.get(base_url.rstrip("/") + "/v1/models", headers=headers, timeout=30)
    resp.raise_for_status()
    data = resp.json().get("data") or []
    if not data:
        raise ValueError(f"{base_url} serves no models")
    return str(data[0]["id"])


def run_bench(args: argparse.Namespace) -> int:
    if args.num_prompts < 1:
        raise ValueError("--num-prompts must be >= 1")
    slos = parse_goodput(args.goodput)
    model = args.model or _first_model(args.base_url, args.api_key)
    target = Target(
        args.base_url, model, args.endpoint, args.api_key, args.ignore_eos, timeout=args.timeout
    )
    requests = build_requests(args, _tokenizer(args.tokenizer))
    levels: list[int | None] = (
        [int(x) for x in args.sweep.split(",") if x.strip()]
        if args.sweep
        else [args.max_concurrency]
    )
    if args.initial_test:  # as `vllm bench serve`: one request first, not measured
        first = send_one(target, requests[0], args.timeout)
        if first is None or not first.ok:
            print(
                "edgellm bench: the initial test request failed: "
                + (first.error if first else "no answer")
                + " (check --base-url, --model and the server's log)",
                file=sys.stderr,
            )
            return 1
    runs = []
    for level in levels:
        label = f"concurrency={level}" if level else f"rate={args.request_rate}"
        bar = tqdm(total=len(requests), desc=label, disable=not args.progress)
        results, elapsed = asyncio.run(
            run_load(
                target,
                requests,
                level,
                args.request_rate,
                args.burstiness,
                args.seed,
                args.duration,
                on_done=lambda _r, bar=bar: bar.update(1),
            )
        )
        bar.close()
        summary = summarize(results, elapsed, slos, label)
        summary["concurrency"] = level
        print(format_table(summary))
        runs.append((label, results, summary))
    if args.json_out:
        Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_out).write_text(
            json.dumps(
                {
                    "base_url": args.base_url,
                    "model": model,
                    "dataset": args.dataset,
                    "endpoint": args.endpoint,
                    "num_prompts": args.num_prompts,
                    "runs": [s for _, _, s in runs],
                },
                indent=2,
            )
        )
    if args.plot:
        plot(runs, args.plot)
    return 0 if all(s["completed"] for _, _, s in runs) else 1
