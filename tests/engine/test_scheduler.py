"""Scheduler: token budget, decodes never starve behind a long chunked prefill,
preemption instead of failure, and aborts free blocks at once — driven without
a model (a step 'computes' the scheduled tokens and samples a fixed token)."""

from __future__ import annotations

import random

import pytest

from edgellm.engine.block_manager import BlockManager
from edgellm.engine.scheduler import Scheduler
from edgellm.engine.sequence import FinishReason, Sequence, Status
from edgellm.sampling import SamplingParams
from tests.helpers.scheduling import fake_step


def make(rid: str, prompt_len: int, max_tokens: int, index: int = 0) -> Sequence:
    return Sequence(rid, list(range(1, prompt_len + 1)), SamplingParams(max_tokens=max_tokens), [], index)


def test_budget_is_respected_and_chunks_cover_prompt():
    bm = BlockManager(200, 16)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=32)
    seqs = [make(f"s{i}", n, 4) for i, n in enumerate((100, 7, 45))]
    for s in seqs:
        sched.add(s)
    steps = 0
    while sched.has_unfinished():
        out, _ = fake_step(sched)
        assert 0 < out.num_batched_tokens <= 32
        steps += 1
        assert steps < 100
    assert all(s.is_finished and len(s.output_token_ids) == 4 for s in seqs)
    assert bm.num_held_blocks == 0


def test_decodes_are_not_starved_by_long_prefill():
    bm = BlockManager(400, 16)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64)
    short = [make(f"d{i}", 5, 50) for i in range(3)]
    for s in short:
        sched.add(s)
    fake_step(sched)  # the short prompts prefill in one step; they now decode
    long = make("long", 1000, 2)
    sched.add(long)
    chunks = 0
    while long.num_computed_tokens < long.num_prompt_tokens:
        before = [len(s.output_token_ids) for s in short]
        out, _ = fake_step(sched)
        chunks += 1
        # every decode got its token in this step, alongside a prefill chunk
        assert [len(s.output_token_ids) for s in short] == [b + 1 for b in before]
        assert out.num_decodes == 3
        assert out.num_batched_tokens <= 64
    assert chunks >= 1000 // 64


def test_preemption_instead_of_failure_and_recovery():
    bm = BlockManager(10, 16)  # 160 tokens
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=512)
    seqs = [make(f"s{i}", 40, 60) for i in range(4)]  # 100 tokens each at the end
    for s in seqs:
        sched.add(s)
    preempted = 0
    for _ in range(2000):
        if not sched.has_unfinished():
            break
        out, _ = fake_step(sched)
        preempted += len(out.preempted)
        assert bm.num_held_blocks <= 10
    assert not sched.has_unfinished()
    assert preempted > 0
    assert all(len(s.output_token_ids) == 60 for s in seqs)
    assert bm.num_held_blocks == 0


def test_preempts_most_recently_admitted():
    bm = BlockManager(6, 4)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64)
    a, b = make("a", 7, 100), make("b", 7, 100)
    sched.add(a)
    sched.add(b)
    victims = []
    for _ in range(20):
        out, _ = fake_step(sched)
        victims += [s.request_id for s in out.preempted]
        if victims:
            break
    assert victims and victims[0] == "b"
    assert a.status == Status.RUNNING


def test_max_num_seqs_caps_the_batch():
    bm = BlockManager(100, 16)
    sched = Scheduler(bm, max_num_seqs=2, max_num_batched_tokens=512)
    for i in range(5):
        sched.add(make(f"s{i}", 3, 10))
    out, _ = fake_step(sched)
    assert len(out.scheduled) == 2 and len(sched.waiting) == 3


@pytest.mark.parametrize("when", ["waiting", "mid_prefill", "mid_decode"])
def test_abort_frees_blocks_at_once(when):
    bm = BlockManager(50, 4)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=8)
    s = make("x", 30, 20)
    other = make("y", 6, 20)
    sched.add(other)
    fake_step(sched)
    sched.add(s)
    if when != "waiting":
        fake_step(sched)
        assert 0 < s.num_computed_tokens < s.num_prompt_tokens
    if when == "mid_decode":
        while not s.output_token_ids:
            fake_step(sched)
    if when != "waiting":
        assert s.block_table
    sched.finish(s, FinishReason.ABORT)
    assert s.status == Status.FINISHED and s.block_table == []
    assert s not in sched.running and s not in sched.waiting
    assert bm.num_held_blocks == len(other.block_table)  # only the other request holds blocks
    sched.finish(other, FinishReason.ABORT)
    assert bm.num_held_blocks == 0


def test_random_arrivals_and_aborts_never_leak_or_deadlock():
    rng = random.Random(1)
    bm = BlockManager(24, 8)
    sched = Scheduler(bm, max_num_seqs=6, max_num_batched_tokens=40)
    live: list[Sequence] = []
    for i in range(300):
        if rng.random() < 0.3:
            s = make(f"s{i}", rng.randrange(1, 60), rng.randrange(1, 30))
            sched.add(s)
            live.append(s)
        if live and rng.random() < 0.1:
            victim = live.pop(rng.randrange(len(live)))
            if not victim.is_finished:
                sched.finish(victim, FinishReason.ABORT)
        if sched.has_unfinished():
            out, _ = fake_step(sched)
            assert out.scheduled, "a step with work scheduled nothing (deadlock)"
    while sched.has_unfinished():
        fake_step(sched)
    assert bm.num_held_blocks == 0
