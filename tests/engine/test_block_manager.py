"""Block manager: allocation, ref counts under shared prefixes, LRU eviction, no leaks."""

from __future__ import annotations

import random

from edgellm.engine.block_manager import BlockManager
from edgellm.engine.sequence import Sequence
from edgellm.sampling import SamplingParams

BS = 4


def seq(rid: str, tokens: list[int]) -> Sequence:
    return Sequence(rid, tokens, SamplingParams(), [], 0)


def run_prefill(bm: BlockManager, s: Sequence) -> int:
    """Admit and compute the whole prompt, as the engine would; returns cached tokens."""
    cached = bm.allocate_prefix(s)
    assert bm.ensure_slots(s, s.num_tokens)
    s.num_computed_tokens = s.num_tokens
    bm.cache_full_blocks(s, s.num_tokens)
    return cached


def test_allocate_and_free_returns_every_block():
    bm = BlockManager(10, BS)
    s = seq("a", list(range(10)))
    assert run_prefill(bm, s) == 0
    assert len(s.block_table) == 3 and bm.num_free_blocks == 7
    bm.free(s)
    assert bm.num_free_blocks == 10 and bm.num_held_blocks == 0


def test_shared_prefix_reuses_blocks_and_counts_refs():
    bm = BlockManager(16, BS)
    a = seq("a", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    run_prefill(bm, a)
    b = seq("b", [1, 2, 3, 4, 5, 6, 7, 8, 42, 43])
    assert run_prefill(bm, b) == 8  # two full shared blocks
    assert b.block_table[:2] == a.block_table[:2]
    assert b.block_table[2] != a.block_table[2]
    for blk in a.block_table[:2]:
        assert bm.blocks[blk].ref_count == 2
    bm.free(a)
    for blk in b.block_table[:2]:
        assert bm.blocks[blk].ref_count == 1
    bm.free(b)
    assert bm.num_held_blocks == 0


def test_last_prompt_token_is_always_recomputed():
    bm = BlockManager(16, BS)
    a = seq("a", list(range(8)))  # exactly two blocks
    run_prefill(bm, a)
    bm.free(a)
    b = seq("b", list(range(8)))
    # the whole prompt is cached, but the last token must be computed for its logits
    assert run_prefill(bm, b) == 4


def test_different_prefix_same_block_tokens_do_not_match():
    bm = BlockManager(16, BS)
    run_prefill(bm, seq("a", [1, 2, 3, 4, 5, 6, 7, 8, 9]))
    # the second block's tokens match but the first block differs: the chain hash differs
    assert run_prefill(bm, seq("b", [9, 9, 9, 9, 5, 6, 7, 8, 9])) == 0


def test_eviction_is_least_recently_used():
    bm = BlockManager(6, BS)
    old = seq("old", [1] * 4 + [0])
    new = seq("new", [2] * 4 + [0])
    run_prefill(bm, old)
    run_prefill(bm, new)
    bm.free(old)
    bm.free(new)
    # touch "old" again so that "new" becomes the least recently used
    again = seq("again", [1] * 4 + [7])
    assert run_prefill(bm, again) == 4
    bm.free(again)
    # Filling the cache evicts blocks in LRU order: the cached "new" prefix goes before "old".
    hog = seq("hog", list(range(100, 100 + 4 * 5)))  # 5 blocks of 6
    bm.allocate_prefix(hog)
    assert bm.ensure_slots(hog, 20)
    probe_old = seq("p1", [1] * 4 + [3])
    probe_new = seq("p2", [2] * 4 + [3])
    assert bm.allocate_prefix(probe_old) == 4
    assert bm.allocate_prefix(probe_new) == 0


def test_freed_blocks_are_evicted_tail_first():
    bm = BlockManager(4, BS)
    a = seq("a", list(range(13)))  # blocks 0..3 (last partial)
    run_prefill(bm, a)
    head = a.block_table[0]
    bm.free(a)
    b = seq("b", list(range(50, 53)))  # needs 1 block: must take the tail, not the head
    bm.allocate_prefix(b)
    assert bm.ensure_slots(b, 3)
    assert b.block_table[0] != head
    c = seq("c", list(range(5)))
    assert bm.allocate_prefix(c) == 4  # the head block survived


def test_ensure_slots_all_or_nothing():
    bm = BlockManager(3, BS)
    s = seq("a", list(range(20)))
    bm.allocate_prefix(s)
    assert not bm.ensure_slots(s, 20)  # needs 5 blocks, has 3
    assert s.block_table == [] and bm.num_free_blocks == 3


def test_random_workload_never_leaks():
    rng = random.Random(0)
    bm = BlockManager(64, BS)
    live: list[Sequence] = []
    prefixes = [[rng.randrange(50) for _ in range(rng.randrange(4, 20))] for _ in range(5)]
    for step in range(400):
        if live and rng.random() < 0.4:
            bm.free(live.pop(rng.randrange(len(live))))
            continue
        tokens = rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randrange(1, 12))]
        s = seq(f"s{step}", tokens)
        if not bm.can_allocate_prefix(s, s.num_tokens):
            continue
        run_prefill(bm, s)
        live.append(s)
        held = {}
        for x in live:
            for blk in x.block_table:
                held[blk] = held.get(blk, 0) + 1
        for blk, count in held.items():
            assert bm.blocks[blk].ref_count == count
        assert bm.num_held_blocks == len(held)
    for s in live:
        bm.free(s)
    assert bm.num_held_blocks == 0 and bm.num_free_blocks == 64
