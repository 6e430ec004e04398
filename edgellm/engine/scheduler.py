"""Token-budget step planner (continuous batching with chunked prefill).

There is no prefill phase and decode phase: every request has tokens and
computed tokens, and each step lets computed catch up within a budget of
max_num_batched_tokens. Running requests that decode (one token left to
compute) go first, so a long prefill never starves them; then running
requests still prefilling, then waiting requests in the waiting queue's order
(engine/request_queue.py), each getting a chunk of what is left of the budget.
When the cache runs out of blocks a running request is preempted: its blocks
are freed and it goes back to the waiting queue to be recomputed (its
prefix-cached blocks usually survive, so recompute is cheap).

Policies (vLLM's): fcfs preempts the most recently admitted request and puts it
at the front of the queue. priority orders the queue by (priority, arrival),
lower values first; the request preempted for blocks is the running one of the
worst (priority, admission); and a waiting request that cannot be admitted
(cache or batch full) preempts running requests of strictly worse priority
until it fits. Equal priorities never preempt each other, so they stay first
come, first served. A request preempted in a step is not readmitted in that
step.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from edgellm.engine.block_manager import BlockManager
from edgellm.engine.request_queue import make_waiting_queue, priority_key
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
        policy: str = "fcfs",
    ) -> None:
        self.bm = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.cache_key = cache_key
        self.policy = policy
        self.waiting = make_waiting_queue(policy)
        self.running: list[Sequence] = []
        self._admissions = 0
        self._arrivals = itertools.count()
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        seq.arrival_order = next(self._arrivals)
        self.waiting.add(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        """Take a sequence out for good (finished, aborted or failed); its blocks are free at
        once."""
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
        self.waiting.add_preempted(seq)
        logger.debug("preempted %s", seq.request_id)

    def _rank(self, seq: Sequence) -> tuple[int, int]:
        """Preemption order under the priority policy: the largest is preempted first."""
        return (seq.priority, seq.arrival_index)

    def _evict_for(
        self, seq: Sequence, out: SchedulerOutput, budget: int, reserve: int
    ) -> int | None:
        """Priority policy: preempt the worst running request of strictly worse priority than the
        waiting `seq`, taking it out of this step's plan; returns the tokens of budget it gave
        back. None when nothing may be preempted, or when preempting every such request would
        still not free blocks enough for `seq` (a preemption that cannot help is never made)."""
        if self.policy != "priority":
            return None
        cands = [s for s in self.running if s.priority > seq.priority]
        if not cands:
            return None
        ids = {id(s) for s in cands}
        freeable = sum(len(self.bm.exclusive_blocks(s)) for s in cands)
        refundable = sum(i.num_new_tokens for i in out.scheduled if id(i.seq) in ids)
        need = self.bm.blocks_to_admit(seq, budget + refundable, self.cache_key(seq))
        keep = reserve - len(cands) if len(cands) < len(self.running) else 0
        if need > self.bm.num_free_blocks + freeable - keep:
            return None
        victim = max(cands, key=self._rank)
        refund = 0
        for i, item in enumerate(out.scheduled):
            if item.seq is victim:
                refund = item.num_new_tokens
                del out.scheduled[i]
                break
        self._preempt(victim)
        out.preempted.append(victim)
        return refund

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        scheduled_ids: set[str] = set()

        decodes = [s for s in self.running if s.num_tokens - s.num_computed_tokens == 1]
        prefills = [s for s in self.running if s.num_tokens - s.num_computed_tokens > 1]
        if self.policy == "priority":
            decodes.sort(key=priority_key)
            prefills.sort(key=priority_key)
        for seq in decodes + prefills:
            if budget <= 0:
                break
            if seq.status != Status.RUNNING:
                continue  # preempted earlier in this loop
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            while not self.bm.ensure_slots(seq, seq.num_computed_tokens + n):
                victims = [
                    s for s in self.running if s is not seq and s.request_id not in scheduled_ids
                ]
                if self.policy == "priority":
                    victim = max([*victims, seq], key=self._rank)
                else:
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
            self._admit(out, budget)
        return out

    def _admit(self, out: SchedulerOutput, budget: int) -> None:
        # Keep a block per running request in reserve for their next tokens, so a new
        # admission does not immediately force a preemption.
        reserve = len(self.running)
        evicted: list[Sequence] = []
        while self.waiting and budget > 0:
            seq = self.waiting.peek()
            if any(seq is e for e in evicted):
                break  # preempted in this step: not readmitted before the next
            if len(self.running) >= self.max_num_seqs:
                refund = self._evict_for(seq, out, budget, reserve)
                if refund is None:
                    break
                evicted.append(out.preempted[-1])
                budget, reserve = budget + refund, reserve - 1
                continue
            key = self.cache_key(seq)
            fits = self.bm.can_allocate_prefix(seq, budget, key)
            if fits:
                cached = self.bm.allocate_prefix(seq, key)
                n = min(seq.num_tokens - cached, budget)
                if (
                    self.running
                    and self.bm.blocks_needed(cached + n) - len(seq.block_table)
                    > self.bm.num_free_blocks - reserve
                ) or not self.bm.ensure_slots(seq, cached + n):
                    self.bm.free(seq)
                    fits = False
            if not fits:
                refund = self._evict_for(seq, out, budget, reserve)
                if refund is None:
                    break
                evicted.append(out.preempted[-1])
                budget, reserve = budget + refund, reserve - 1
                continue
            self.waiting.pop()
            seq.num_computed_tokens = cached
            if seq.num_preemptions == 0:
                seq.num_cached_tokens = cached
            seq.status = Status.RUNNING
            self._admissions += 1
            seq.arrival_index = self._admissions
            self.running.append(seq)
            out.scheduled.append(ScheduledSeq(seq, n))
            budget -= n
