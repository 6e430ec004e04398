"""edgellm command line: generate | chat | serve | models | convert | bench."""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Any

from edgellm.config import EngineConfig


def _memory(value: str) -> int:
    """Bytes, with an optional K/M/G/KiB/MiB/GiB suffix."""
    v = value.strip().upper().replace("IB", "").replace("B", "")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(v[-1:], 1)
    try:
        return int(float(v[:-1] if v[-1:] in "KMG" else v) * mult)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a memory size: {value!r} (e.g. 512M, 2G)") from None


def add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument(
        "--model",
        default=None,
        help="HF directory or .gguf file (default: the embedded SmolLM2-135M-Instruct); "
        "for serve, also a served name from models.yaml",
    )
    g.add_argument(
        "--dtype", default="auto", help="auto | float32 | bfloat16 | float16 (auto: fp32 on CPU)"
    )
    g.add_argument("--device", default="cpu", help="cpu | cuda")
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--max-num-seqs", type=int, default=64)
    g.add_argument("--max-num-batched-tokens", type=int, default=2048)
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    g.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"])
    g.add_argument(
        "--kv-cache-memory",
        type=_memory,
        default=None,
        help="KV cache size in bytes (e.g. 1G); default: on CUDA what --gpu-memory-utilization "
        "leaves after a profile of the largest step, on CPU a fraction of free memory (<= 1G)",
    )
    g.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=0.9,
        help="CUDA: the share of the GPU's memory for weights, activations and the KV cache "
        "(vLLM's flag; default 0.9)",
    )
    g.add_argument(
        "--cpu-quant",
        default=None,
        choices=["auto", "exact", "fast"],
        help="quantized weights on CPU: auto (the fastest this CPU has: integer dots over int8 "
        "activations, dense matmuls for large steps where measured faster), exact (dequantized "
        "once, fp32 matmuls: transformers' logits) or fast (torch's int4 GEMV and bf16 matmuls; "
        "for CPUs with bf16 units). Default: $EDGELLM_CPU_QUANT, else auto",
    )
    g.add_argument(
        "--cpu-isa",
        default=None,
        choices=["avx2", "avx512", "amx"],
        help="cap the instruction-set level of the CPU kernels (default: $EDGELLM_CPU_ISA, else "
        "what this CPU has)",
    )
    g.add_argument("--seed", type=int, default=0)
    g.add_argument(
        "--kv-events-config",
        type=_kv_events_config,
        default=None,
        help='KV-cache events as vLLM publishes them, JSON: {"enable_kv_cache_events": true, '
        '"publisher": "zmq", "endpoint": "tcp://127.0.0.1:5557", '
        '"replay_endpoint": ..., "topic": ...}',
    )
    g.add_argument("--chat-template", default=None, help="a Jinja chat template (file or string)")
    g.add_argument(
        "--architecture",
        default=None,
        help="override the checkpoint's architecture (llama, mistral, qwen2, phi3, exaone)",
    )


def _kv_events_config(text: str) -> Any:
    from edgellm.engine.kv_publisher import KVEventsConfig

    try:
        return KVEventsConfig.from_json(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def engine_config(args: argparse.Namespace, **overrides: Any) -> EngineConfig:
    fields: dict[str, Any] = {
        "model": args.model,
        "dtype": args.dtype,
        "device": args.device,
        "max_model_len": args.max_model_len,
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "block_size": args.block_size,
        "enable_prefix_caching": args.enable_prefix_caching,
        "kv_cache_dtype": args.kv_cache_dtype,
        "kv_cache_memory": args.kv_cache_memory,
        "gpu_memory_utilization": getattr(args, "gpu_memory_utilization", 0.9),
        "seed": args.seed,
        "chat_template": args.chat_template,
        "architecture": getattr(args, "architecture", None),
        "cpu_quant": getattr(args, "cpu_quant", None),
        "cpu_isa": getattr(args, "cpu_isa", None),
        "scheduling_policy": getattr(args, "scheduling_policy", "fcfs"),
        "kv_events": getattr(args, "kv_events_config", None),
    }
    fields.update(overrides)
    return EngineConfig(**fields)


def _sampling(args: argparse.Namespace) -> Any:
    from edgellm.sampling import SamplingParams

    return SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.sampling_seed,
    )


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--sampling-seed", type=int, default=None)


def cmd_generate(args: argparse.Namespace) -> int:
    from edgellm.llm import LLM

    llm = LLM.from_config(engine_config(args))
    prompts = args.prompt or [sys.stdin.read()]
    outs = (
        llm.chat([[{"role": "user", "content": p}] for p in prompts], _sampling(args))
        if args.chat
        else llm.generate(prompts, _sampling(args))
    )
    for out in outs:
        print(out.outputs[0].text)
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    from edgellm.llm import LLM

    llm = LLM.from_config(engine_config(args))
    messages: list[dict[str, str]] = []
    if args.system:
        messages.append({"role": "system", "content": args.system})
    print("edgellm chat: empty line or Ctrl-D to quit", file=sys.stderr)
    while True:
        try:
            line = input("> ").strip()
        except EOFError:
            break
        if not line:
            break
        messages.append({"role": "user", "content": line})
        reply = llm.chat(messages, _sampling(args))[0].outputs[0].text
        print(reply)
        messages.append({"role": "assistant", "content": reply})
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    try:
        import fastapi  # noqa: F401
        import prometheus_client  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as exc:
        print(
            f"edgellm serve needs the server extras ({exc.name} is missing): "
            f"pip install 'edgellm[server]'",
            file=sys.stderr,
        )
        return 2
    if args.max_waiting_requests < 0:
        print("edgellm: error: --max-waiting-requests must be >= 0", file=sys.stderr)
        return 2
    from edgellm.server.launch import serve

    return serve(args)


def cmd_models(args: argparse.Namespace) -> int:
    from edgellm.registry import load_registry

    specs = load_registry(args.config, check_files=False)
    if not specs:
        print(f"{args.config}: no models")
        return 0
    rows = [("NAME", "SOURCE", "QUANT", "KV", "MAX LEN", "WARM", "STATUS")]
    bad = 0
    for spec in specs.values():
        try:
            spec.check_files()
            status = "ok"
        except ValueError as exc:
            status = f"error: {exc}"
            bad += 1
        rows.append(
            (
                spec.name,
                spec.source,
                spec.quantization,
                spec.kv_cache_dtype,
                str(spec.max_model_len or "model"),
                str(len(spec.warm_prompts)),
                status,
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    for row in rows:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths)) + "  " + row[-1])
    return 1 if bad else 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="edgellm", description="Low-latency LLM serving for one machine"
    )
    parser.add_argument("--log-level", default="INFO")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser(
        "generate", help="complete prompts (or chat turns with --chat) and print them"
    )
    p.add_argument("prompt", nargs="*", help="prompts (default: stdin)")
    p.add_argument(
        "--chat",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="wrap each prompt as a user turn of the chat template (default on)",
    )
    add_engine_args(p)
    _add_sampling_args(p)
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("chat", help="interactive chat in the terminal")
    p.add_argument("--system", default=None, help="a system prompt")
    add_engine_args(p)
    _add_sampling_args(p)
    p.set_defaults(func=cmd_chat)

    p = sub.add_parser("serve", help="the OpenAI-compatible HTTP server (FastAPI + uvicorn)")
    p.add_argument(
        "--config",
        default=None,
        help="model registry (default: ./models.yaml when it exists); --model may name an entry",
    )
    p.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        help="name(s) clients put in 'model' (default: the registry name or the model path's name)",
    )
    p.add_argument(
        "--host", default="127.0.0.1", help="bind address (default 127.0.0.1: this machine only)"
    )
    p.add_argument("--port", type=int, default=8000)
    p.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' (default: $EDGELLM_API_KEY; none if unset)",
    )
    p.add_argument(
        "--metrics-public", action="store_true", help="serve /metrics without the API key"
    )
    p.add_argument(
        "--max-waiting-requests",
        type=int,
        default=128,
        help="requests allowed to wait beyond --max-num-seqs before 503 + Retry-After",
    )
    p.add_argument(
        "--max-request-body",
        type=_memory,
        default=4 << 20,
        help="largest request body (default 4M); bigger is a 413",
    )
    p.add_argument(
        "--scheduling-policy",
        default="fcfs",
        choices=["fcfs", "priority"],
        help="fcfs (default; a request 'priority' other than 0 is a 400) or priority "
        "(lower 'priority' runs sooner and may preempt worse-priority requests)",
    )
    p.add_argument(
        "--tool-call-parser",
        default=None,
        metavar="NAME",
        help="the format of the model's tool calls: hermes, llama3_json, mistral or pythonic "
        "(default: models.yaml's tool_parser, else the one the chat template asks for, "
        "else hermes)",
    )
    p.add_argument("--uvicorn-log-level", default="info")
    p.add_argument("--access-log", action=argparse.BooleanOptionalAction, default=True)
    add_engine_args(p)
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("models", help="list the model registry (models.yaml)")
    p.add_argument("--config", default="models.yaml")
    p.set_defaults(func=cmd_models)

    from edgellm.quant.convert_cli import add_convert_parser

    add_convert_parser(sub)

    try:
        from edgellm.bench import add_bench_parser
    except ImportError as exc:  # the load generator needs httpx (the server/bench extras)
        missing = exc.name
        p = sub.add_parser("bench", help="benchmark an OpenAI-compatible server (needs httpx)")
        p.set_defaults(func=lambda _args: _missing_extra("bench", missing))
    else:
        add_bench_parser(sub)
    return parser


def _missing_extra(command: str, module: str | None) -> int:
    print(
        f"edgellm {command} needs {module or 'an optional package'}: pip install 'edgellm[server]'",
        file=sys.stderr,
    )
    return 2


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        return int(args.func(args) or 0)
    except (ValueError, OSError) as exc:
        print(f"edgellm: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
