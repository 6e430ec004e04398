"""Priority scheduling with vLLM's semantics: the waiting queue in (priority, arrival) order, a
higher-priority arrival preempting lower-priority running work when the batch or the KV cache is
full, equal priorities first come first served, nothing lost or leaked.

Scheduler tests drive the real Scheduler and BlockManager without a model (a step 'computes' its
tokens and samples a fixed token), so orders are exact; the engine test runs a tiny real model and
compares the preempted request's greedy output with its solo run.
"""

from __future__ import annotations

import pytest
import torch

from edgellm.config import EngineConfig
from edgellm.engine.block_manager import BlockManager
from edgellm.engine.engine import LLMEngine
from edgellm.engine.runner import kv_cache_bytes_per_block
from edgellm.engine.scheduler import Scheduler
from edgellm.engine.sequence import Sequence
from edgellm.sampling import SamplingParams
from tests.helpers.scheduling import fake_step
from tests.helpers.tiny_models import build_tiny


def make(rid: str, prompt_len: int, max_tokens: int, priority: int = 0, first: int = 1) -> Sequence:
    return Sequence(rid, list(range(first, first + prompt_len)), SamplingParams(max_tokens=max_tokens), [], 0,
                    priority=priority)


def check_invariants(sched: Scheduler) -> None:
    """Every block's ref count is the number of live block tables holding it; the free list holds
    exactly the unreferenced blocks; the prefix cache points at blocks carrying that hash."""
    bm = sched.bm
    refs = [0] * bm.num_blocks
    for seq in [*sched.running, *sched.waiting]:
        assert len(set(seq.block_table)) == len(seq.block_table)
        for b in seq.block_table:
            refs[b] += 1
    for seq in sched.waiting:
        assert not seq.block_table, f"{seq} waits while holding blocks"
    assert [b.ref_count for b in bm.blocks] == refs
    assert set(bm.free_queue) == {i for i, r in enumerate(refs) if r == 0}
    assert all(bm.blocks[b].hash == h for h, b in bm.cached.items())


def run(sched: Scheduler, arrivals: dict[int, list[Sequence]] | None = None, max_steps: int = 500):
    """Step until idle; arrivals[k] are added before step k. Returns (finish order, admission order,
    preempted ids in order)."""
    arrivals = arrivals or {}
    finished, admitted, preempted = [], [], []
    step = 0
    while sched.has_unfinished() or any(k >= step for k in arrivals):
        for seq in arrivals.get(step, []):
            sched.add(seq)
        out, done = fake_step(sched)
        preempted += [s.request_id for s in out.preempted]
        for item in out.scheduled:  # a first chunk: it started from no computed tokens
            s = item.seq
            if s.num_computed_tokens == item.num_new_tokens and s.request_id not in admitted:
                admitted.append(s.request_id)
        finished += [s.request_id for s in done]
        check_invariants(sched)
        step += 1
        assert step < max_steps
    return finished, admitted, preempted


def test_waiting_queue_runs_in_priority_then_arrival_order():
    sched = Scheduler(BlockManager(200, 16), max_num_seqs=1, max_num_batched_tokens=64, policy="priority")
    prios = [3, 1, 2, 1, 0, 3, 2, 0]
    seqs = [make(f"r{i}", 10, 3, p, first=1 + 20 * i) for i, p in enumerate(prios)]
    finished, admitted, preempted = run(sched, {0: seqs})
    want = [s.request_id for s in sorted(seqs, key=lambda s: (s.priority, int(s.request_id[1:])))]
    assert admitted == want and finished == want
    assert preempted == []
    assert sched.bm.num_held_blocks == 0


def test_fcfs_ignores_priorities_and_equal_priorities_stay_fcfs():
    for policy, prios in (("fcfs", [3, 1, 2, 0]), ("priority", [2, 2, 2, 2])):
        sched = Scheduler(BlockManager(200, 16), max_num_seqs=1, max_num_batched_tokens=64, policy=policy)
        seqs = [make(f"r{i}", 10, 3, p, first=1 + 20 * i) for i, p in enumerate(prios)]
        # later arrivals of the same priority while the first runs: they queue behind, never preempt
        late = [make(f"late{i}", 10, 3, prios[0], first=200 + 20 * i) for i in range(3)]
        finished, _, preempted = run(sched, {0: seqs, 2: late[:1], 4: late[1:]})
        assert finished == [s.request_id for s in seqs + late], policy
        assert preempted == []


def test_high_priority_arrival_preempts_when_the_batch_is_full():
    sched = Scheduler(BlockManager(200, 16), max_num_seqs=2, max_num_batched_tokens=64, policy="priority")
    low = [make("low-a", 10, 30, 5, first=1), make("low-b", 10, 30, 4, first=40)]
    urgent = make("urgent", 10, 3, 0, first=80)
    finished, _, preempted = run(sched, {0: low, 5: [urgent]})
    # the worst running request (priority 5) makes room; the urgent one finishes first
    assert preempted == ["low-a"]
    assert finished[0] == "urgent"
    assert sorted(finished) == ["low-a", "low-b", "urgent"]
    assert all(len(s.output_token_ids) == s.params.max_tokens for s in [*low, urgent])
    assert sched.bm.num_held_blocks == 0


def test_high_priority_arrival_preempts_when_the_cache_is_full():
    # 10 blocks of 16: two 60-token requests (4 blocks each, growing) leave no room for a 40-token one
    bm = BlockManager(10, 16)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=256, policy="priority")
    low = [make("low-old", 60, 20, 1, first=1), make("low-new", 60, 20, 1, first=100)]
    urgent = make("urgent", 40, 4, 0, first=300)
    same = make("same-prio", 40, 4, 1, first=400)  # equal priority: must not preempt anyone
    finished, _, preempted = run(sched, {0: low, 2: [same], 3: [urgent]})
    assert preempted and preempted[0] == "low-new"  # worst (priority, admission): the later one
    assert finished.index("urgent") < finished.index("low-new")
    assert finished.index("low-old") < finished.index("same-prio")
    assert sorted(finished) == ["low-new", "low-old", "same-prio", "urgent"]
    assert bm.num_held_blocks == 0 and bm.num_free_blocks == bm.num_blocks


@pytest.mark.parametrize("max_num_seqs", [1, 8])  # the batch full too, or only the cache
def test_no_preemption_that_could_not_make_room(max_num_seqs):
    # the urgent prompt needs more blocks than the whole cache: preempting would only waste work
    bm = BlockManager(6, 16)
    sched = Scheduler(bm, max_num_seqs=max_num_seqs, max_num_batched_tokens=512, policy="priority")
    sched.add(make("low", 30, 40, 3))
    for _ in range(3):
        out = sched.schedule()
        for item in out.scheduled:
            samples = item.samples
            item.seq.num_computed_tokens += item.num_new_tokens
            if samples:
                item.seq.append_token(7)
    big = make("big", 200, 2, 0, first=500)
    sched.add(big)
    out = sched.schedule()
    assert out.preempted == [] and [i.seq.request_id for i in out.scheduled] == ["low"]
    check_invariants(sched)


# ------------------------------------------------------------------ engine
@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    path, _ = build_tiny("llama", tmp_path_factory.mktemp("tiny-llama"))
    return path


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def drain(engine: LLMEngine, done: dict[str, list[int]]) -> None:
    steps = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = list(out.outputs[0].token_ids)
                assert out.outputs[0].finish_reason == "length"
        steps += 1
        assert steps < 2000


def test_engine_priority_preemption_loses_nothing(tiny_llama):
    probe = LLMEngine(EngineConfig(model=str(tiny_llama), kv_cache_memory=1 << 20))
    per_block = kv_cache_bytes_per_block(probe.model, 16, probe.kv_dtype)
    low_prompt = list(range(3, 43))  # 40 tokens + 40 generated: 5 blocks at the end
    high_prompt = list(range(50, 90))  # 40 tokens + 8 generated: 3 blocks
    solo: dict[str, list[int]] = {}
    probe.add_request("low", low_prompt, greedy(40))
    probe.add_request("high", high_prompt, greedy(8))
    drain(probe, solo)  # plenty of room: no preemption, the reference outputs
    assert probe.scheduler.num_preemptions == 0

    engine = LLMEngine(EngineConfig(model=str(tiny_llama), kv_cache_memory=6 * per_block, max_model_len=96,
                                    scheduling_policy="priority"))
    assert engine.block_manager.num_blocks == 6
    engine.add_request("low", low_prompt, greedy(40), priority=10)
    done: dict[str, list[int]] = {}
    for _ in range(6):  # low prefills and decodes a few tokens, holding 3 blocks
        engine.step()
    engine.add_request("high", high_prompt, greedy(8), priority=-1)
    outs = engine.step()
    assert engine.scheduler.num_preemptions == 1
    assert engine.running_request_ids() == ["high"]
    assert not any(o.request_id == "low" for o in outs)
    drain(engine, done)
    assert done == solo  # the preempted request resumed and produced exactly its solo output
    assert engine.block_manager.num_held_blocks == 0
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_engine_refuses_priority_under_fcfs(tiny_llama):
    engine = LLMEngine(EngineConfig(model=str(tiny_llama), kv_cache_memory=1 << 20))
    with pytest.raises(ValueError, match="priority"):
        engine.add_request("x", [1, 2, 3], greedy(2), priority=1)
    with pytest.raises(TypeError, match="priority"):
        engine.add_request("y", [1, 2, 3], greedy(2), priority="1")  # type: ignore[arg-type]
    engine.add_request("z", [1, 2, 3], greedy(2), priority=0)
    assert engine.num_unfinished_requests == 1
    with pytest.raises(ValueError, match="scheduling_policy"):
        EngineConfig(scheduling_policy="lifo")


def test_offline_api_takes_one_priority_per_prompt(tiny_llama):
    from edgellm.llm import LLM

    llm = LLM(str(tiny_llama), kv_cache_memory=1 << 20, max_num_seqs=1, scheduling_policy="priority")
    prompts = [list(range(3 + 10 * i, 10 + 10 * i)) for i in range(4)]
    outs = llm.generate(prompts, greedy(3), priority=[2, 0, 3, 1])
    assert [len(o.outputs[0].token_ids) for o in outs] == [3] * 4  # outputs stay in prompt order
    started = sorted(range(4), key=lambda i: outs[i].metrics.first_scheduled)
    assert started == [1, 3, 0, 2]  # one at a time, in priority order
    with pytest.raises(ValueError, match="one priority per prompt"):
        llm.generate(prompts, greedy(3), priority=[0])
