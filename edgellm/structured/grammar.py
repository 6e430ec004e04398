"""Compiled grammars and per-sequence matchers over xgrammar.

`GrammarService` is built once per engine from its tokenizer. It compiles constraints
(StructuredOutputs) on its own worker thread, so a first-seen schema never holds up the engine's
steps; compilations are cached by the constraint's key (LRU, MAX_CACHED). A `Matcher` follows one
sequence: `fill(bitmask, row)` writes the tokens allowed next into row `row` of a bitmask,
`accept(token)` advances it.

Why xgrammar (benchmarks/grammar_engines.py, results/grammar_engines.json): on the default
model's 49k-token vocabulary its per-token mask is several times cheaper than llguidance's, which
is what a batched decode step pays per constrained row; llguidance compiles faster, but
compilation is off the engine thread and cached. xgrammar ignores some schema keywords silently;
schema_check refuses those.
"""

from __future__ import annotations

import collections
import concurrent.futures
import threading
from typing import Any

import torch

from edgellm.structured.spec import StructuredOutputError, StructuredOutputs

MAX_CACHED = 256


def _xgr() -> Any:
    import xgrammar

    return xgrammar


class Matcher:
    """One sequence's position in its grammar."""

    def __init__(self, compiled: Any, vocab_size: int) -> None:
        self._m = _xgr().GrammarMatcher(compiled)
        self._vocab_size = vocab_size

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        self._m.fill_next_token_bitmask(bitmask, row)

    def accept(self, token: int) -> bool:
        return bool(self._m.accept_token(token))

    @property
    def is_terminated(self) -> bool:
        return bool(self._m.is_terminated())

    def allows_nothing(self) -> bool:
        """No token of the vocabulary can come next: a dead end of the grammar (a constraint this
        vocabulary cannot spell, e.g. a character no token holds)."""
        bitmask = _xgr().allocate_token_bitmask(1, self._vocab_size)
        self._m.fill_next_token_bitmask(bitmask, 0)
        return not bool(bitmask.any())


class GrammarService:
    def __init__(self, hf_tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> None:
        self._hf = hf_tokenizer
        self.vocab_size = vocab_size
        self._stop = list(stop_token_ids)
        self._compiler: Any = None
        self._lock = threading.Lock()
        self._cache: collections.OrderedDict[str, concurrent.futures.Future[Any]] = (
            collections.OrderedDict()
        )
        self._bitmask: torch.Tensor | None = None
        self._one: torch.Tensor | None = None
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="edgellm-grammar")

    def _get_compiler(self) -> Any:
        if self._compiler is None:  # only ever on the worker thread
            xgr = _xgr()
            info = xgr.TokenizerInfo.from_huggingface(
                self._hf, vocab_size=self.vocab_size, stop_token_ids=self._stop
            )
            self._compiler = xgr.GrammarCompiler(info, max_threads=1)
        return self._compiler

    def _compile(self, spec: StructuredOutputs) -> Any:
        comp = self._get_compiler()
        try:
            if spec.kind == "json":
                return comp.compile_json_schema(
                    spec.schema(), any_whitespace=False, strict_mode=True
                )
            if spec.kind == "regex":
                return comp.compile_regex(spec.regex)
            if spec.kind == "choice":
                alts = " | ".join(_ebnf_string(c) for c in spec.choice or [])
                return comp.compile_grammar(f"root ::= {alts}")
            return comp.compile_grammar(spec.grammar)
        except StructuredOutputError:
            raise
        except Exception as exc:  # noqa: BLE001  (xgrammar raises RuntimeError/ValueError with its message)
            msg = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
            raise StructuredOutputError(
                f"{spec.source}: cannot compile the {spec.kind} constraint: {msg}", spec.source
            ) from None

    def compile_future(self, spec: StructuredOutputs) -> concurrent.futures.Future[Any]:
        """The compiled grammar for `spec`, compiling on the worker thread if not cached."""
        key = spec.key
        with self._lock:
            fut = self._cache.get(key)
            if fut is not None:
                self._cache.move_to_end(key)
                return fut
            fut = self._pool.submit(self._compile, spec)
            self._cache[key] = fut
            while len(self._cache) > MAX_CACHED:
                self._cache.popitem(last=False)
        fut.add_done_callback(lambda f, k=key: self._forget_failure(k, f))
        return fut

    def _forget_failure(self, key: str, fut: concurrent.futures.Future[Any]) -> None:
        if fut.cancelled() or fut.exception() is not None:
            with self._lock:
                if self._cache.get(key) is fut:
                    del self._cache[key]

    def compile(self, spec: StructuredOutputs) -> Any:
        return self.compile_future(spec).result()

    def matcher(self, compiled: Any) -> Matcher:
        return Matcher(compiled, self.vocab_size)

    def mask(self, logits: torch.Tensor, matchers: list[Matcher], rows: list[int]) -> None:
        """The sampler's GrammarMasks: disallowed tokens of each constrained row to -inf, in place.
        Runs on the engine thread (a matcher is only ever touched there)."""
        if self._bitmask is None or self._bitmask.shape[0] < logits.shape[0]:
            self._bitmask = _xgr().allocate_token_bitmask(max(logits.shape[0], 16), self.vocab_size)
        bitmask = self._bitmask
        for matcher, row in zip(matchers, rows):
            matcher.fill(bitmask, row)
        _xgr().apply_token_bitmask_inplace(
            logits, bitmask[: logits.shape[0]], vocab_size=self.vocab_size, indices=rows
        )

    def allowed(self, matcher: Matcher) -> torch.Tensor:
        """int32 [ceil(vocab / 32)]: the tokens `matcher` allows next as a bitmask (bit j of word
        i: token 32 i + j, set = allowed), for a logits head that masks itself."""
        if self._one is None:  # reused: this runs per constrained row per step
            self._one = _xgr().allocate_token_bitmask(1, self.vocab_size)
        matcher.fill(self._one, 0)
        return self._one[0].clone()

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _ebnf_string(text: str) -> str:
    out = ['"']
    for ch in text:
        if ch in '"\\':
            out.append("\\" + ch)
        elif ch == "\n":
            out.append("\\n")
        elif ch == "\r":
            out.append("\\r")
        elif ch == "\t":
            out.append("\\t")
        else:
            out.append(ch)
    out.append('"')
    return "".join(out)
