"""`edgellm serve`: the OpenAI-compatible HTTP server's flags, and the check that the server
extras are installed before edgellm/server/launch.py runs it."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from edgellm.commands.engine_args import add_engine_args, memory_size


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


def add_serve_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser("serve", help="the OpenAI-compatible HTTP server (FastAPI + uvicorn)")
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
        type=memory_size,
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
    p.add_argument(
        "--engine-core",
        default="process",
        choices=["process", "thread"],
        help="where the engine steps: process (default: a process of its own, so the HTTP "
        "server's work never holds up a step) or thread (a thread of the server's process)",
    )
    p.add_argument("--uvicorn-log-level", default="info")
    p.add_argument("--access-log", action=argparse.BooleanOptionalAction, default=True)
    add_engine_args(p)
    p.set_defaults(func=cmd_serve)
    return p
