"""edgellm command line: generate | chat | serve | models | convert | bench (the parser and main;
each command in edgellm/commands/, convert in edgellm/quant/convert_cli.py, bench in
edgellm/bench)."""

from __future__ import annotations

import argparse
import logging
import sys

from edgellm.commands.generate import add_chat_parser, add_generate_parser
from edgellm.commands.models import add_models_parser
from edgellm.commands.serve import add_serve_parser


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="edgellm", description="Low-latency LLM serving for one machine"
    )
    parser.add_argument("--log-level", default="INFO")
    sub = parser.add_subparsers(dest="command", required=True)

    add_generate_parser(sub)
    add_chat_parser(sub)
    add_serve_parser(sub)
    add_models_parser(sub)

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
