"""The sliding-window layers' own pool: pages out of every window go back, prefix hits need both
pools, admission and growth check both, nothing leaks; under the scheduler, a random workload
keeps the window pool within the bound engine/kv_layout.py sizes it by; the torch reference and
the Triton kernels (interpreter) read the pool's tables exactly."""

from __future__ import annotations

import random

import pytest
import torch

from edgellm import LLM, SamplingParams
from edgellm.attention.torch_ref import TorchRefAttention
from edgellm.attention.triton import TritonAttention
from edgellm.config import EngineConfig
from edgellm.engine.block_manager import FREED
from edgellm.engine.kv_layout import window_pool_cap
from edgellm.engine.scheduler import Scheduler
from edgellm.engine.sequence import Sequence
from edgellm.engine.window_blocks import HybridBlockManager
from edgellm.sampling import SamplingParams
from tests.helpers.scheduling import fake_step

BS = 4
WINDOW = 6  # a query at position p reads p - 5 .. p: at most 3 blocks of 4 (with the next query's)


def seq(rid: str, tokens: list[int], max_tokens: int = 16) -> Sequence:
    return Sequence(rid, tokens, SamplingParams(max_tokens=max_tokens), [], 0)


def step(bm: HybridBlockManager, s: Sequence, n: int) -> None:
    """Compute the next n tokens of s, as the engine would."""
    assert bm.ensure_slots(s, s.num_computed_tokens + n)
    s.num_computed_tokens += n
    bm.cache_full_blocks(s, s.num_computed_tokens)


def held(table: list[int]) -> int:
    return sum(b != FREED for b in table)


def test_window_pages_are_released_as_the_sequence_moves_on():
    bm = HybridBlockManager(32, 32, BS, WINDOW)
    s = seq("a", list(range(30)))
    bm.allocate_prefix(s)
    step(bm, s, 30)  # one chunk longer than the window: every block is needed during the step
    # the next query (position 30) reads 25..30: blocks 6 and 7
    assert s.window_table[:6] == [FREED] * 6 and held(s.window_table) == 2
    assert held(s.block_table) == 8 and FREED not in s.block_table
    for _ in range(20):  # decode: between steps at most ceil((W - 1) / BS) + 1 window pages
        s.append_token(1)
        step(bm, s, 1)
        first = max(0, s.num_computed_tokens - WINDOW + 1) // BS
        assert s.window_table[:first] == [FREED] * first
        assert held(s.window_table) <= -(-(WINDOW - 1) // BS) + 1
    assert held(s.block_table) == bm.blocks_needed(s.num_computed_tokens)
    assert bm.window.num_held_blocks == held(s.window_table)
    bm.free(s)
    assert bm.num_held_pages == 0 and bm.window.num_free_blocks == 32


def test_a_prefix_hit_takes_only_the_window_pages_its_first_query_reads():
    bm = HybridBlockManager(32, 32, BS, WINDOW)
    a = seq("a", list(range(22)))
    bm.allocate_prefix(a)
    step(bm, a, 22)
    a_blocks = list(a.block_table)
    bm.free(a)
    b = seq("b", list(range(21)) + [99, 98])
    # 5 full blocks match; the first new query (position 20) reads 15..20, so window blocks 3, 4
    assert bm.allocate_prefix(b) == 20
    assert b.block_table == a_blocks[:5]
    assert b.window_table[:3] == [FREED] * 3 and held(b.window_table) == 2
    for blk in b.window_table[3:]:
        assert bm.window.blocks[blk].ref_count == 1 and bm.window.blocks[blk].hash is not None
    step(bm, b, 3)
    bm.free(b)
    assert bm.num_held_pages == 0


def test_a_hit_stops_where_the_window_pool_lost_what_its_first_query_reads():
    bm = HybridBlockManager(32, 6, BS, WINDOW)
    a = seq("a", list(range(22)))
    bm.allocate_prefix(a)
    step(bm, a, 22)
    bm.free(a)
    # another request takes every window page: the LRU evicts a's cached window blocks
    c = seq("c", [7] * 24)
    bm.allocate_prefix(c)
    assert bm.ensure_slots(c, 24)
    assert bm.window.num_free_blocks == 0
    bm.free(c)
    b = seq("b", list(range(21)) + [99])
    # the global pool still holds a's blocks, the window pool none of them: every hit length's
    # first query would read one of the lost window blocks, so there is no hit
    assert all(h in bm.cached for h in bm._seq_hashes["a"][:5])
    assert bm.allocate_prefix(b) == 0
    assert b.block_table == [] and b.window_table == []


def test_admission_and_growth_check_the_window_pool():
    bm = HybridBlockManager(64, 3, BS, WINDOW)
    a = seq("a", list(range(40)))
    # 40 tokens in one chunk need 10 window pages at once: the global pool has room, the window
    # pool does not
    assert not bm.can_allocate_prefix(a, 40)
    assert bm.can_allocate_prefix(a, 8)
    bm.allocate_prefix(a)
    assert not bm.ensure_slots(a, 40)
    assert a.block_table == [] and a.window_table == []  # a refused growth changes neither
    for _ in range(10):  # in chunks of 4 it runs through, the window pool recycling its pages
        step(bm, a, 4)
    assert held(a.block_table) == 10 and held(a.window_table) <= 2
    bm.free(a)
    assert bm.num_held_pages == 0


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_live_sequences_stay_within_the_window_pool_cap(seed):
    """Random prompts, shared prefixes, chunked prefill and preemption under the scheduler: the
    window pages live sequences hold never pass window_pool_cap (the pool engine/kv_layout.py
    sizes; here a larger one, so that only the global pool can refuse), and nothing leaks."""
    rng = random.Random(seed)
    cfg = EngineConfig(block_size=BS, max_num_seqs=4, max_num_batched_tokens=19)
    cap = window_pool_cap(cfg, WINDOW)
    bm = HybridBlockManager(24, 10 * cap, BS, WINDOW)
    sched = Scheduler(bm, cfg.max_num_seqs, cfg.max_num_batched_tokens)
    shared = [rng.randrange(50) for _ in range(13)]
    seqs = []
    for i in range(24):
        head = shared if rng.random() < 0.5 else []
        prompt = head + [rng.randrange(50) for _ in range(rng.randrange(1, 30))]
        seqs.append(seq(f"r{i}", prompt, max_tokens=rng.randrange(1, 20)))
        sched.add(seqs[-1])
    peak = 0
    for _ in range(2000):
        if not sched.has_unfinished():
            break
        out, _ = fake_step(sched)
        peak = max(peak, bm.window.num_held_blocks)
        for s in sched.running:  # between steps: only what the next query's window reaches
            assert held(s.window_table) <= -(-(WINDOW - 1) // BS) + 1
    assert all(s.is_finished for s in seqs)
    assert 0 < peak <= cap
    assert sched.num_preemptions > 0 and bm.prefix_hits > 0  # the run went through both
    assert bm.num_held_pages == 0


@pytest.mark.parametrize("arch", ["gemma3", "exaone4"])
@pytest.mark.parametrize("backend", [TorchRefAttention, TritonAttention])
def test_every_attention_backend_reads_the_window_pool(tiny_dir, monkeypatch, arch, backend):
    """The layer path (no fused C++ decode) through the torch reference and the Triton kernels:
    prompts past the window, chunked, then again from the prefix cache (window tables that start
    FREED), give transformers' greedy tokens."""
    path, hf_model = tiny_dir(arch)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 320, (n,), generator=g).tolist() for n in (70, 45, 9)]
    prompts.append(prompts[0][:50] + [3, 4, 5])
    hf_model.generation_config.eos_token_id = None
    hf_model.generation_config.pad_token_id = 0
    ref = []
    with torch.no_grad():
        for p in prompts:
            x = torch.tensor([p])
            out = hf_model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=12,
                                    do_sample=False)
            ref.append(out[0, len(p):].tolist())
    llm = LLM(str(path), kv_cache_memory=1 << 20, max_num_batched_tokens=29, max_num_seqs=2)
    model = llm.engine.model
    monkeypatch.setattr(model.model, "fused", None)
    attn = backend()
    for layer in model.attention_layers():  # a test's injection: loads choose by device
        monkeypatch.setattr(layer, "backend", attn)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    bm = llm.engine.block_manager
    assert isinstance(bm, HybridBlockManager)
    for _ in range(2):
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == ref
    assert bm.prefix_hits >= 64 and bm.num_held_pages == 0
