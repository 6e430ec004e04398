"""SamplingParams and the sampler.

Order of operations on a row's float32 logits (the definitions the tests
check against):
  1. repetition penalty over prompt + output tokens (logit > 0: divide,
     else multiply), then frequency (x count) and presence (x [count > 0])
     penalties over output tokens, subtracted;
  2. while fewer than min_tokens are out, EOS and stop_token_ids are banned;
  3. temperature == 0: argmax. Otherwise logits / temperature, then top-k,
     then top-p (smallest set whose probability reaches top_p, over the
     top-k renormalized distribution), then min-p (drop tokens whose
     probability is below min_p x the largest);
  3b. a structured-output row (a grammar matcher on the sequence) has every token its grammar
     does not allow next at -inf, before any of 3; min_tokens does not ban EOS once the grammar
     allows nothing else;
  4. one draw from the remaining distribution, using the request's own
     generator when it has a seed (reproducible whatever the batch).
Logprobs are those of the model's raw distribution (log_softmax of the
unprocessed logits), for the chosen token and the top-N.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from edgellm.argmax import row_argmax
from edgellm.structured.spec import StructuredOutputs

_MAX_LOGPROBS = 20
# torch.Generator takes a 64-bit seed; n > 1 adds the choice index, so stay in int64 like vLLM
_SEED_MIN, _SEED_MAX = -(2**63), 2**63 - 1


@dataclass
class SamplingParams:
    n: int = 1
    max_tokens: int | None = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None  # None: off; 0: the chosen token only; N: plus the top N
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    structured_outputs: StructuredOutputs | None = None

    stop_strings: list[str] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        def bad(msg: str) -> None:
            raise ValueError(msg)

        if not isinstance(self.n, int) or self.n < 1:
            bad(f"n must be an integer >= 1, got {self.n!r}")
        if self.max_tokens is not None and (
            not isinstance(self.max_tokens, int) or self.max_tokens < 1
        ):
            bad(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if self.min_tokens < 0 or (
            self.max_tokens is not None and self.min_tokens > self.max_tokens
        ):
            bad(f"min_tokens must be in [0, max_tokens], got {self.min_tokens}")
        for name in (
            "temperature",
            "top_p",
            "min_p",
            "presence_penalty",
            "frequency_penalty",
            "repetition_penalty",
        ):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not math.isfinite(value):
                bad(f"{name} must be a finite number, got {value!r}")
        if self.temperature < 0:
            bad(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            bad(f"top_p must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            bad(f"top_k must be -1, 0 (off) or a positive integer, got {self.top_k!r}")
        if not 0.0 <= self.min_p <= 1.0:
            bad(f"min_p must be in [0, 1], got {self.min_p}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            bad(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            bad(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if not 0.0 < self.repetition_penalty <= 2.0:
            bad(f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}")
        if self.seed is not None and (
            not isinstance(self.seed, int) or not _SEED_MIN <= self.seed <= _SEED_MAX
        ):
            bad(f"seed must be an integer in [{_SEED_MIN}, {_SEED_MAX}], got {self.seed!r}")
        if self.logprobs is not None and not 0 <= self.logprobs <= _MAX_LOGPROBS:
            bad(f"logprobs must be in [0, {_MAX_LOGPROBS}], got {self.logprobs}")
        if self.structured_outputs is not None and not isinstance(
            self.structured_outputs, StructuredOutputs
        ):
            bad("structured_outputs must be a StructuredOutputs")
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if any(not isinstance(s, str) or not s for s in stops):
            bad("stop strings must be non-empty strings")
        self.stop_strings = stops
        self.stop_token_ids = [int(t) for t in self.stop_token_ids or []]

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    @property
    def argmax_only(self) -> bool:
        """Only the highest logit matters (greedy, no penalties, no logprobs): a logits head that is
        exact on its candidates for the maximum only (edgellm/quant/backends.CpuFastLogitsHead)
        gives the same token."""
        return (
            self.greedy
            and self.logprobs is None
            and self.structured_outputs is None
            and self.presence_penalty == 0.0
            and self.frequency_penalty == 0.0
            and self.repetition_penalty == 1.0
        )

    @property
    def sampling_only(self) -> bool:
        """Its logits only feed the sampler at a temperature (no logprobs to report): a logits
        head's approximate product (edgellm/quant/linear_kernels/cpu_int_head.IntDotLogitsHead,
        within the int8 layers' own noise of the fp32 logits) draws from as close a distribution."""
        return not self.greedy and self.logprobs is None

    @property
    def argmax_under_grammar(self) -> bool:
        """A structured-output row whose masked argmax is all that matters (as argmax_only, and no
        min_tokens, whose EOS ban could move the argmax off the head's exact window)."""
        return (
            self.structured_outputs is not None
            and self.greedy
            and self.logprobs is None
            and self.min_tokens == 0
            and not self.has_penalties
        )

    @property
    def has_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )


class GrammarMasks(Protocol):
    def mask(self, logits: torch.Tensor, matchers: Sequence[Matcher], rows: list[int]) -> None:
        """Set every token matchers[j] does not allow next to -inf in logits[rows[j]], in place."""

    def allowed(self, matcher: Matcher) -> torch.Tensor:
        """bool [V]: the tokens the matcher allows next."""


class SamplingRow(Protocol):
    """What the sampler reads of a sequence (read-only, so a sequence's own lists match)."""

    @property
    def params(self) -> SamplingParams: ...
    @property
    def generator(self) -> torch.Generator | None: ...
    @property
    def prompt_token_ids(self) -> Sequence[int]: ...
    @property
    def output_token_ids(self) -> Sequence[int]: ...
    @property
    def eos_token_ids(self) -> Sequence[int]: ...
    @property
    def grammar(self) -> Matcher | None:
        """Structured outputs: the sequence's grammar matcher."""


class Matcher(Protocol):
    def fill(self, bitmask: torch.Tensor, row: int) -> None: ...


@dataclass
class SampleResult:
    token_ids: list[int]
    # per row: None, or (chosen logprob, [(token, logprob) x top-N])
    logprobs: list[tuple[float, list[tuple[int, float]]] | None]


def apply_penalties(logits: torch.Tensor, row: SamplingRow) -> torch.Tensor:
    """One row [V]: repetition over prompt+output, frequency/presence over output."""
    p = row.params
    vocab = logits.shape[-1]
    out = torch.tensor(list(row.output_token_ids), dtype=torch.long)
    out = out[(out >= 0) & (out < vocab)]
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(
            list(row.prompt_token_ids) + list(row.output_token_ids), dtype=torch.long
        )
        seen = torch.unique(seen[(seen >= 0) & (seen < vocab)])
        vals = logits[seen]
        logits[seen] = torch.where(
            vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty
        )
    if p.frequency_penalty or p.presence_penalty:
        counts = torch.bincount(out, minlength=vocab).to(logits.dtype)
        logits -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)
    return logits


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """One row [V] of temperature-scaled logits -> logits with filtered tokens at -inf."""
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = sorted_logits.softmax(-1)
        before = probs.cumsum(-1) - probs  # probability mass strictly above each token
        remove = before >= top_p
        remove[0] = False
        logits = logits.masked_fill(
            torch.zeros_like(remove).scatter(0, order, remove), float("-inf")
        )
    if min_p > 0.0:
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < min_p * probs.max(), float("-inf"))
    return logits


class Sampler:
    def __init__(self, grammar: GrammarMasks | None = None) -> None:
        self.grammar = grammar  # how structured-output rows get their masks (None: no such rows)

    def __call__(
        self,
        logits: torch.Tensor,
        rows: Sequence[SamplingRow],
        premasked: Sequence[bool] | None = None,
    ) -> SampleResult:
        """logits float32 [B, V] -> one token per row. premasked: per row, whether its logits
        already carry its grammar's mask (a logits head that masks itself); those are not masked
        again."""
        raw = logits
        constrained = [i for i, r in enumerate(rows) if getattr(r, "grammar", None) is not None]
        to_mask = [i for i in constrained if not (premasked and premasked[i])]
        need_copy = bool(to_mask) or any(
            r.params.has_penalties or r.params.min_tokens for r in rows
        )
        work = logits.clone() if need_copy else logits
        if to_mask:
            if self.grammar is None:
                raise RuntimeError(
                    "a structured-output row reached a sampler without grammar masks"
                )
            # type: ignore[misc]
            self.grammar.mask(work, [rows[i].grammar for i in to_mask], to_mask)
        for i, row in enumerate(rows):
            p = row.params
            if p.has_penalties:
                apply_penalties(work[i], row)
            if p.min_tokens and len(row.output_token_ids) < p.min_tokens:
                banned = [
                    t
                    for t in list(row.eos_token_ids) + list(p.stop_token_ids or [])
                    if 0 <= t < work.shape[1]
                ]
                if banned:
                    kept = work[i, banned].clone()
                    work[i, banned] = float("-inf")
                    if i in constrained and not bool(torch.isfinite(work[i]).any()):
                        work[i, banned] = kept  # the grammar allows only the end here
        tokens = row_argmax(work)
        for i, row in enumerate(rows):
            p = row.params
            if p.greedy:
                continue
            scaled = filter_logits(work[i] / p.temperature, p.top_k, p.top_p, p.min_p)
            # Inverse CDF: the first token whose cumulative probability (summed in fp64) exceeds
            # one uniform draw; a token of probability 0 never does. One random number a row
            # (an exponential race needs one per token: 7x the time on a CPU for a vocabulary).
            cdf = scaled.softmax(-1).double().cumsum(-1)
            u = torch.rand((), generator=row.generator, dtype=torch.float64) * cdf[-1]
            tokens[i] = min(int(torch.searchsorted(cdf, u, right=True)), cdf.shape[0] - 1)
        token_list = tokens.tolist()
        logprobs: list[tuple[float, list[tuple[int, float]]] | None] = [None] * len(rows)
        wanted = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
        if wanted:
            lp = torch.log_softmax(raw[wanted], dim=-1)
            for j, i in enumerate(wanted):
                n = rows[i].params.logprobs or 0
                top: list[tuple[int, float]] = []
                if n:
                    vals, idx = torch.topk(lp[j], n)
                    top = list(zip(idx.tolist(), vals.tolist()))
                logprobs[i] = (float(lp[j, token_list[i]]), top)
        return SampleResult(token_list, logprobs)
