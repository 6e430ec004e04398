"""Driving the scheduler without a model: a step 'computes' the scheduled tokens and samples 7."""

from __future__ import annotations

from edgellm.engine.scheduler import Scheduler
from edgellm.engine.sequence import FinishReason, Sequence


def fake_step(sched: Scheduler) -> tuple[object, list[Sequence]]:
    out = sched.schedule()
    done = []
    for item in out.scheduled:
        s = item.seq
        samples = item.samples
        s.num_computed_tokens += item.num_new_tokens
        sched.bm.cache_full_blocks(s, s.num_computed_tokens)
        if samples:
            s.append_token(7)
            if len(s.output_token_ids) >= s.params.max_tokens:
                sched.finish(s, FinishReason.LENGTH)
                done.append(s)
    return out, done
