"""A stand-in for AsyncEngine with failures on demand, for the server guard and security tests.

Each request picks its behaviour with its first prompt token id: OK streams two tokens, BLOCK waits
for `release`, ENGINE_ERROR fails inside a step, RAISE raises, DEAD reports a stopped engine, and
PREPARE_RAISES fails before the request is queued.
"""

from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace

from edgellm.engine.async_engine import EngineDeadError
from edgellm.engine.output import CompletionOutput, RequestMetrics, RequestOutput

OK, BLOCK, ENGINE_ERROR, RAISE, DEAD, PREPARE_RAISES = 10, 1, 2, 3, 4, 5


class ScriptedEngine:
    """What the server uses of AsyncEngine, with failures chosen by the prompt's first token."""

    tokenizer = None
    max_model_len = 64
    scheduling_policy = "fcfs"

    def __init__(self) -> None:
        self.config = SimpleNamespace(max_num_seqs=1, block_size=16)
        self.release = threading.Event()
        self.aborted: list[str] = []
        self.running = 0

    def prepare(self, prompt, params):
        if prompt[0] == PREPARE_RAISES:
            raise RuntimeError("kaboom: secret internal detail")
        return None, list(prompt)

    def _out(self, rid, ids, tokens, finished, reason=None, error=None):
        now = time.monotonic()
        return RequestOutput(
            request_id=rid,
            prompt=None,
            prompt_token_ids=ids,
            outputs=[CompletionOutput(0, "x" * len(tokens), list(tokens), reason)],
            finished=finished,
            delta_text="x" if tokens else "",
            delta_token_ids=tokens[-1:],
            metrics=RequestMetrics(
                now - 0.01,
                now - 0.008,
                now - 0.005,
                now if finished else None,
                len(ids),
                0,
                len(tokens),
                0,
            ),
            error=error,
        )

    async def generate(self, request_id, prompt, params, prepared=None, priority=0):
        ids = list(prompt)
        kind = ids[0]
        self.running += 1
        try:
            if kind == RAISE:
                raise RuntimeError("secret internal detail")
            if kind == DEAD:
                raise EngineDeadError("the engine has stopped")
            if kind == ENGINE_ERROR:
                yield self._out(request_id, ids, [7], False)
                yield self._out(
                    request_id, ids, [7], True, "error", "internal error in the engine step: boom"
                )
                return
            if kind == BLOCK:
                while not self.release.is_set():
                    await asyncio.sleep(0.01)
            yield self._out(request_id, ids, [7], False)
            yield self._out(request_id, ids, [7, 8], True, "length")
        finally:
            self.running -= 1

    def abort(self, request_id):
        self.aborted.append(request_id)

    def cache_info(self):
        return {
            "block_size": "16",
            "cache_dtype": "auto",
            "enable_prefix_caching": "True",
            "num_gpu_blocks": "8",
        }

    def stats(self):
        return {
            "num_running": self.running,
            "num_waiting": 0,
            "kv_blocks_total": 8,
            "kv_blocks_held": 0,
            "prefix_cache_queries": 0,
            "prefix_cache_hits": 0,
            "num_preemptions": 0,
        }
