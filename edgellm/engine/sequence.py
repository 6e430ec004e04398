"""One request's state as it moves through the engine."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from edgellm.sampling import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or max_model_len
    ABORT = "abort"
    ERROR = "error"


@dataclass
class Timing:
    arrival: float = field(default_factory=time.monotonic)
    first_scheduled: float | None = None
    first_token: float | None = None
    finished: float | None = None


class Sequence:
    """Tokens (prompt then output), how many have KV in the cache, and the block table."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        eos_token_ids: list[int],
        arrival_index: int,
        want_prompt_logits: bool = False,
        priority: int = 0,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.token_ids = list(prompt_token_ids)
        self.params = params
        self.eos_token_ids = [] if params.ignore_eos else list(eos_token_ids)
        self.arrival_index = arrival_index  # admission order, for preemption
        self.priority = priority  # lower runs sooner (the priority scheduling policy)
        self.arrival_order = arrival_index  # the scheduler's arrival counter (set when added)
        self.status = Status.WAITING
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prompt tokens served from the prefix cache (first admission)
        # one page table per KV pool: [0] the pages of every layer (of the global layers when the
        # model mixes sliding-window and global layers), [1] the sliding-window layers' own pool
        # (engine/window_blocks.py), where pages out of every window are released as FREED
        self.block_tables: list[list[int]] = [[], []]
        self.num_preemptions = 0
        self.finish_reason: FinishReason | None = None
        self.error: str | None = None
        # the request field at fault when the error is the request's own (an HTTP 400)
        self.error_param: str | None = None
        self.stop_reason: int | str | None = None
        self.generator: torch.Generator | None = None
        if params.seed is not None:
            self.generator = torch.Generator().manual_seed(params.seed)
        self.logprobs: list[tuple[float, list[tuple[int, float]]]] = []
        # prompt_logits mode: logits of every prompt position, no prefix-cache reuse
        self.want_prompt_logits = want_prompt_logits
        self.prompt_logits: list[torch.Tensor] = []
        self.timing = Timing()
        self.grammar: Any = None  # structured outputs: a structured.grammar.Matcher

    @property
    def block_table(self) -> list[int]:
        return self.block_tables[0]

    @block_table.setter
    def block_table(self, table: list[int]) -> None:
        self.block_tables[0] = table

    @property
    def window_table(self) -> list[int]:
        return self.block_tables[1]

    @window_table.setter
    def window_table(self, table: list[int]) -> None:
        self.block_tables[1] = table

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status == Status.FINISHED

    def append_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.token_ids.append(token_id)

    def __repr__(self) -> str:
        return (
            f"Sequence({self.request_id}, {self.status.value}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens}, blocks={len(self.block_table)})"
        )
