"""Request sets for `edgellm bench`: random lengths, the voice-agent workload
(one long fixed system prompt + a short user turn), or prompts from a file."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Plain words; random prompts are drawn from these, then trimmed to a token length.
_WORDS = (
    "time person year way day thing man world life hand part child eye woman place work week case "
    "point government company number group problem fact be have do say get make go know take see "
    "come think look want give use find tell ask seem feel try leave call good new first last long "
    "great little own other old right big high different small large next early young important "
    "few "
    "public bad same able to of in for on with at by from up about into over after river mountain "
    "city music coffee train window garden ocean story question answer morning evening weather"
).split()


@dataclass
class BenchRequest:
    messages: list[dict[str, str]] | None  # chat endpoint
    prompt: str | None  # completions endpoint
    prompt_len: int  # tokens, as counted by the benchmark's tokenizer
    output_len: int


def text_of_len(tokenizer: Any, rng: random.Random, n_tokens: int) -> str:
    """Random words trimmed to n_tokens tokens (by the given tokenizer)."""
    words = [rng.choice(_WORDS) for _ in range(max(1, n_tokens))]
    ids = tokenizer.encode(" ".join(words), add_special_tokens=False)[:n_tokens]
    return tokenizer.decode(ids)


def _lens(rng: random.Random, mean: int, ratio: float) -> int:
    lo, hi = int(mean * (1 - ratio)), int(mean * (1 + ratio))
    return max(1, rng.randint(lo, hi) if hi > lo else mean)


def random_requests(
    tokenizer: Any,
    num: int,
    input_len: int,
    output_len: int,
    range_ratio: float,
    seed: int,
    chat: bool,
) -> list[BenchRequest]:
    rng = random.Random(seed)
    out = []
    for _ in range(num):
        n_in, n_out = _lens(rng, input_len, range_ratio), _lens(rng, output_len, range_ratio)
        text = text_of_len(tokenizer, rng, n_in)
        out.append(_user_request(text, chat, n_in, n_out))
    return out


def voice_requests(
    tokenizer: Any, num: int, system_len: int, user_len: int, output_len: int, seed: int
) -> list[BenchRequest]:
    """A voice agent: the same long system prompt on every request, a short new user turn."""
    rng = random.Random(seed)
    system = text_of_len(tokenizer, random.Random(seed + 1_000_003), system_len)
    return [
        BenchRequest(
            [
                {"role": "system", "content": system},
                {"role": "user", "content": text_of_len(tokenizer, rng, user_len)},
            ],
            None,
            system_len + user_len,
            output_len,
        )
        for _ in range(num)
    ]


def voice_requests_warmed(
    tokenizer: Any, num: int, system_len: int, user_len: int, output_len: int, seed: int
) -> tuple[BenchRequest, list[BenchRequest]]:
    """A one-token turn to send first, unmeasured, so the system prompt sits in the server's prompt
    cache as for a deployed agent, and the `num` measured voice requests."""
    first, *reqs = voice_requests(tokenizer, num + 1, system_len, user_len, output_len, seed)
    first.output_len = 1
    return first, reqs


def file_requests(
    path: str, tokenizer: Any, num: int, output_len: int, chat: bool, seed: int
) -> list[BenchRequest]:
    """One prompt per line; JSONL lines may be {"prompt": ..., "output_len": ...}."""
    lines = [ln for ln in Path(path).read_text(encoding="utf-8").splitlines() if ln.strip()]
    if not lines:
        raise ValueError(f"{path}: no prompts")
    rng = random.Random(seed)
    out = []
    for i in range(num):
        line = lines[i % len(lines)] if num <= len(lines) else rng.choice(lines)
        n_out = output_len
        if line.lstrip().startswith("{"):
            obj = json.loads(line)
            text, n_out = str(obj["prompt"]), int(obj.get("output_len", output_len))
        else:
            text = line
        n_in = len(tokenizer.encode(text, add_special_tokens=False))
        out.append(_user_request(text, chat, n_in, n_out))
    return out


def _user_request(text: str, chat: bool, n_in: int, n_out: int) -> BenchRequest:
    """One user turn, as chat messages or as a plain completion prompt."""
    messages = [{"role": "user", "content": text}] if chat else None
    return BenchRequest(messages, None if chat else text, n_in, n_out)
