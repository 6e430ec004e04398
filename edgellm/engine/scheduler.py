"""Token-budget step planner (continuous batching with chunked prefill).

There is no prefill phase and decode phase: every request has tokens and
computed tokens, and each step lets computed catch up within a budget of
max_num_batched_tokens. Running requests that decode (one token left to
compute) go first, so a long prefill never starves them; then running
requests still prefilling, then waiting requests in arrival order, each
getting a chunk of what is left of the budget. When the cache runs out of
blocks the most recently admitted request is preempted: its blocks are
freed and it goes back to the front of the queue to be recomputed (its
prefix-cached blocks usually survive, so recompute is cheap).
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from edgellm.engine.block_manager import BlockManager
from edgellm.engine.sequence import FinishReason, Sequence, Status

logger = logging.getLogger(__name__)


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int  # computed this step, starting at seq.num_computed_tokens

    @property
    def samples(self) -> bool:
        """Does this chunk reach the end of the known tokens (so a new token is sampled)?"""
        return self.seq.num_computed_tokens + self.num_new_tokens == self.seq.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)  # decodes first, then prefills
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def num_decodes(self) -> int:
        n = 0
        for s in self.scheduled:
            if s.num_new_tokens != 1 or s.seq.num_computed_tokens + 1 != s.seq.num_tokens:
                break
            n += 1
        return n

    def __bool__(self) -> bool:
        return bool(self.scheduled)


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        cache_key: Callable[[Sequence], bytes] = lambda seq: b"",
    ) -> None:
        self.bm = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.cache_key = cache_key
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._admissions = 0
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        """Take a sequence out for good (finished, aborted or failed); its blocks are free at once."""
        if seq.status == Status.RUNNING:
            self.running.remove(seq)
        elif seq.status == Status.WAITING:
            self.waiting.remove(seq)
        self.bm.free(seq)
        self.bm.forget(seq)
        seq.status = Status.FINISHED
        seq.finish_reason = reason

    def recompute(self, seq: Sequence) -> None:
        """Drop a running sequence's KV so that all its tokens are computed again."""
        self.bm.free(seq)
        self.bm.forget(seq)
        seq.num_computed_tokens = 0

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.bm.free(seq)
        seq.status = Status.WAITING
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)
        logger.debug("preempted %s", seq.request_id)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        scheduled_ids: set[str] = set()

        decodes = [s for s in self.running if s.num_tokens - s.num_computed_tokens == 1]
        prefills = [s for s in self.running if s.num_tokens - s.num_computed_tokens > 1]
        for seq in decodes + prefills:
            if budget <= 0:
                break
            if seq.status != Status.RUNNING:
                continue  # preempted earlier in this loop
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            while not self.bm.ensure_slots(seq, seq.num_computed_tokens + n):
                victims = [s for s in self.running
                           if s is not seq and s.request_id not in scheduled_ids]
                victim = max(victims, key=lambda s: s.arrival_index) if victims else seq
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
            else:
                out.scheduled.append(ScheduledSeq(seq, n))
                scheduled_ids.add(seq.request_id)
                budget -= n

        if not out.preempted:
            # Keep a block per running request in reserve for their next tokens, so a new
            # admission does not immediately force a preemption.
            reserve = len(self.running)
            while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
                seq = self.waiting[0]
                key = self.cache_key(seq)
                if not self.bm.can_allocate_prefix(seq, budget, key):
                    break
                cached = self.bm.allocate_prefix(seq, key)
                n = min(seq.num_tokens - cached, budget)
                if (self.running and self.bm.blocks_needed(cached + n) - len(seq.block_table)
                        > self.bm.num_free_blocks - reserve) or not self.bm.ensure_slots(seq, cached + n):
                    self.bm.free(seq)
                    break
                self.waiting.popleft()
                seq.num_computed_tokens = cached
                if seq.num_preemptions == 0:
                    seq.num_cached_tokens = cached
                seq.status = Status.RUNNING
                self._admissions += 1
                seq.arrival_index = self._admissions
                self.running.append(seq)
                out.scheduled.append(ScheduledSeq(seq, n))
                budget -= n
        return out
