"""`edgellm generate` (complete prompts, or chat turns, and print them) and `edgellm chat` (an
interactive chat in the terminal): the engine in this process, with the sampling flags both take."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from edgellm.commands.engine_args import add_engine_args, engine_config


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


def add_generate_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
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
    return p


def add_chat_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser("chat", help="interactive chat in the terminal")
    p.add_argument("--system", default=None, help="a system prompt")
    add_engine_args(p)
    _add_sampling_args(p)
    p.set_defaults(func=cmd_chat)
    return p
