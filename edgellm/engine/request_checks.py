"""What a request must be before an engine takes it.

A prompt comes as text (tokenized here) or as token ids; it must be non-empty, leave one position
of max_model_len for the output, and hold only ids inside the vocabulary. A priority must be an
integer, and anything but 0 needs the priority scheduling policy. Stop strings need a tokenizer.
Each check raises ValueError (TypeError for a priority that is no integer) with the message the
API returns to the client.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

from edgellm.sampling import SamplingParams
from edgellm.tokenizer import Tokenizer


def tokenize_prompt(
    tokenizer: Tokenizer | None, prompt: str | Seq[int]
) -> tuple[str | None, list[int]]:
    """(the prompt's text or None, its token ids)."""
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError("this model has no tokenizer: give the prompt as token ids")
        return prompt, tokenizer.encode(prompt)
    ids = [int(t) for t in prompt]
    return None, ids


def check_priority(priority: int, scheduling_policy: str) -> None:
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise TypeError(f"priority must be an integer, got {priority!r}")
    if priority != 0 and scheduling_policy != "priority":
        raise ValueError(
            f"Got priority {priority} but priority scheduling is not enabled "
            f"(start the engine with scheduling_policy='priority')"
        )


def check_prompt(ids: list[int], max_model_len: int, vocab_size: int) -> None:
    if not ids:
        raise ValueError("the prompt is empty")
    if len(ids) >= max_model_len:
        raise ValueError(
            f"the prompt has {len(ids)} tokens; this model accepts at most "
            f"{max_model_len - 1} "
            f"(max_model_len {max_model_len}, one position is kept for the output)"
        )
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise ValueError(f"token id {bad} is out of the vocabulary (size {vocab_size})")


def check_stop_strings(params: SamplingParams, tokenizer: Tokenizer | None) -> None:
    if params.stop_strings and tokenizer is None:
        raise ValueError("stop strings need a tokenizer; this model has none")


def prepare(
    tokenizer: Tokenizer | None,
    prompt: str | Seq[int],
    params: SamplingParams,
    max_model_len: int,
    vocab_size: int,
) -> tuple[str | None, list[int]]:
    """The prompt tokenized and the request checked: (text or None, token ids)."""
    text, ids = tokenize_prompt(tokenizer, prompt)
    check_prompt(ids, max_model_len, vocab_size)
    check_stop_strings(params, tokenizer)
    return text, ids
