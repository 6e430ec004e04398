"""One engine and the names it answers to (ServedModel): its admission bound (running batch plus
waiting line, 503 + Retry-After beyond it), the count of sub-requests in flight, and token texts
for logprobs."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from edgellm.server.errors import APIError, bad_request
from edgellm.server.metrics import ServerMetrics
from edgellm.tools.families import check_parser_name


@dataclass
class ServedModel:
    """One engine and the names it answers to."""

    names: list[str]
    engine: Any  # AsyncEngine
    max_waiting_requests: int
    metrics: ServerMetrics | None = None
    inflight: int = 0  # admitted sub-requests not yet finished
    created: int = field(default_factory=lambda: int(time.time()))
    # the format of tool calls in its output (a tools.families.PARSERS name); None: the one its
    # chat template asks for, else hermes
    tool_parser: str | None = None
    _token_text: dict[int, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.tool_parser is not None:
            check_parser_name(self.tool_parser)

    @property
    def name(self) -> str:
        return self.names[0]

    def token_text(self, token_id: int) -> str:
        text = self._token_text.get(token_id)
        if text is None:
            tok = self.engine.tokenizer
            text = (
                tok.decode([token_id], skip_special_tokens=False)
                if tok is not None
                else f"<{token_id}>"
            )
            if len(self._token_text) < 200_000:
                self._token_text[token_id] = text
        return text

    @property
    def capacity(self) -> int:
        """Sequences in flight at most: the running batch plus the waiting line."""
        return int(self.engine.config.max_num_seqs) + self.max_waiting_requests

    @property
    def full(self) -> bool:
        return self.inflight >= self.capacity

    def overloaded(self) -> APIError:
        """503 + Retry-After, as OpenAI answers 'engine overloaded' (its 429 means a per-key rate
        limit, which this server has none of); clients, the openai SDK included, retry both."""
        if self.metrics is not None:
            self.metrics.rejected.labels("503").inc()
        return APIError(
            503,
            f"The server is overloaded ({self.inflight} requests in flight, "
            f"room for {self.capacity}); retry shortly.",
            code="server_overloaded",
            headers={"Retry-After": "1"},
        )

    def admit(self, num: int) -> None:
        """Bounded queue: refuse when the waiting line would pass its bound."""
        if num > self.capacity:  # could never run: retrying would not help
            raise bad_request(
                f"this request needs {num} sequences (prompts x n) but the server runs at "
                f"most {self.capacity} at once",
                param="n",
                code="too_many_sequences",
            )
        if self.inflight + num > self.capacity:
            raise self.overloaded()
        self.add_inflight(num)

    def add_inflight(self, delta: int) -> None:
        self.inflight += delta
        if self.metrics is not None:
            self.metrics.inflight.labels(self.name).set(self.inflight)
