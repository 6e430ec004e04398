"""Multi-turn conversations for the load generator: callers of a few personas (each persona a long
fixed system prompt), each caller's turns sent one after another over the real answers so far (the
history grows turn by turn, as in a voice call), many callers at once."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx

from edgellm.bench.client import RequestResult, Target, send
from edgellm.bench.datasets import BenchRequest, text_of_len


@dataclass
class Conversation:
    persona: int  # index of the system prompt
    system: str
    user_turns: list[str]
    output_len: int  # tokens per answer
    system_len: int  # tokens, as counted by the benchmark's tokenizer
    user_len: int


def persona_conversations(
    tokenizer: Any,
    personas: int,
    callers: int,
    turns: int,
    system_len: int,
    user_len: int,
    output_len: int,
    seed: int,
) -> list[Conversation]:
    """`callers` conversations of `turns` user turns each; caller i speaks to persona i mod
    `personas` (every persona has the same number of callers when `personas` divides `callers`),
    callers in a seeded random order. Persona prompts are `system_len` tokens of random words, all
    different from their first words on; user turns are `user_len` tokens, every one different."""
    if personas < 1 or callers < 1 or turns < 1:
        raise ValueError("personas, callers and turns must be >= 1")
    systems = [
        f"You are persona {p}. "
        + text_of_len(tokenizer, random.Random(seed * 7919 + 1_000_003 + p), system_len)
        for p in range(personas)
    ]
    rng = random.Random(seed)
    order = [i % personas for i in range(callers)]
    rng.shuffle(order)
    return [
        Conversation(
            p,
            systems[p],
            [text_of_len(tokenizer, rng, user_len) for _ in range(turns)],
            output_len,
            system_len,
            user_len,
        )
        for p in order
    ]


def turn_request(conv: Conversation, history: list[dict[str, str]], turn: int) -> BenchRequest:
    """The request of turn `turn` (0-based): the system prompt, the history so far (user turns and
    the answers received) and the next user turn. prompt_len estimates the tokens of the contents
    (answers counted at output_len), chat template excluded."""
    messages = [
        {"role": "system", "content": conv.system},
        *history,
        {"role": "user", "content": conv.user_turns[turn]},
    ]
    prompt_len = conv.system_len + (turn + 1) * conv.user_len + turn * conv.output_len
    return BenchRequest(messages, None, prompt_len, conv.output_len)


async def run_conversations(
    target: Target,
    conversations: list[Conversation],
    max_concurrency: int,
    think_time: float = 0.0,
    duration: float | None = None,
    on_done: Callable[[RequestResult], None] | None = None,
) -> tuple[list[RequestResult], float]:
    """Run up to `max_concurrency` conversations at once (a caller holds its slot for the whole
    call); within one, each turn is sent when the previous answer has ended and `think_time` seconds
    have passed, with that answer's text in the history. A failed turn ends its conversation. Stops
    after `duration` seconds (unfinished turns are not counted). Returns the results of every turn
    sent, in completion order, and the elapsed time."""
    limits = httpx.Limits(max_connections=max(max_concurrency, 1) + 4)
    sem = asyncio.Semaphore(max(max_concurrency, 1))
    results: list[RequestResult] = []
    async with httpx.AsyncClient(limits=limits, timeout=target.timeout) as client:
        t0 = time.perf_counter()

        async def call(conv: Conversation) -> None:
            async with sem:
                history: list[dict[str, str]] = []
                for turn, user in enumerate(conv.user_turns):
                    res = await send(client, target, turn_request(conv, history, turn))
                    results.append(res)
                    if on_done:
                        on_done(res)
                    if not res.ok:
                        return
                    history += [
                        {"role": "user", "content": user},
                        {"role": "assistant", "content": res.text},
                    ]
                    if think_time and turn + 1 < len(conv.user_turns):
                        await asyncio.sleep(think_time)

        tasks = [asyncio.create_task(call(conv)) for conv in conversations]
        done, pending = await asyncio.wait(tasks, timeout=duration)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        for task in done:
            task.result()  # an exception in the driver itself is not a measurement
        elapsed = time.perf_counter() - t0
    return results, elapsed
