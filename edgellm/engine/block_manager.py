"""KV-cache pages: block tables, ref counts, the free list and the prefix cache.

Full blocks are hashed as a chain (hash of parent hash + the block's tokens),
so a block's hash identifies the whole prefix up to its end. A new request
reuses every leading block whose hash is cached. Freed blocks keep their hash
and stay reusable until they are taken for new data: the free list is the LRU
order (front = evicted first). A sequence frees its blocks tail first, so the
tail of a prompt is evicted before its shared head.

With record_events, every change to the prefix cache is recorded as a KV-cache event
(engine/kv_events.py): BlockStored when full blocks get their hash, BlockRemoved when a cached
block is evicted or uncached, AllBlocksCleared when a reset empties the cache. The engine takes
them once per step (take_events) for its publisher.

A manager serves one of a sequence's page tables (`group`: Sequence.block_tables). The
sliding-window pool of a model that mixes window and global layers (engine/window_blocks.py) is a
second manager over table 1, whose leading pages, once out of every window, are released
(release_before) and read FREED.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence as Seq

from edgellm.engine.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    KVCacheEvent,
    external_hash,
    stored_events,
)
from edgellm.engine.sequence import Sequence


def block_hash(parent: bytes | None, tokens: Seq[int], extra: bytes = b"") -> bytes:
    h = hashlib.blake2b(digest_size=16)
    h.update(parent or b"\0" * 16)
    h.update(array("q", tokens).tobytes())
    h.update(extra)
    return h.digest()


FREED = -1  # a table entry whose page was released: out of every window, never read again


class Block:
    __slots__ = ("block_id", "hash", "ref_count")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.hash: bytes | None = None


class BlockManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        record_events: bool = False,
        group: int = 0,
    ) -> None:
        if num_blocks < 1:
            raise ValueError("the KV cache needs at least one block")
        self.group = group  # which of Sequence.block_tables this manager fills
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[bytes, int] = {}
        # per sequence: hashes of its full blocks, in order (the chain)
        self._seq_hashes: dict[str, list[bytes]] = {}
        self.prefix_queries = 0  # tokens looked up
        self.prefix_hits = 0  # tokens found
        self.events: list[KVCacheEvent] | None = [] if record_events else None

    def take_events(self) -> list[KVCacheEvent]:
        """The events recorded since the last call, oldest first (none without record_events)."""
        if not self.events:
            return []
        events, self.events = self.events, []
        return events

    def _removed(self, digest: bytes) -> None:
        if self.events is not None:
            self.events.append(BlockRemoved([external_hash(digest)]))

    # ----------------------------------------------------------------- queries
    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def num_held_blocks(self) -> int:
        """Blocks with a live reference."""
        return self.num_blocks - self.num_free_blocks

    @property
    def num_held_pages(self) -> int:
        """Pages with a live reference in every pool this manager runs (what a leak check
        counts)."""
        return self.num_held_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _hashes(self, seq: Sequence, num_full: int, extra: bytes) -> list[bytes]:
        hashes = self._seq_hashes.setdefault(seq.request_id, [])
        bs = self.block_size
        while len(hashes) < num_full:
            i = len(hashes)
            parent = hashes[-1] if hashes else None
            hashes.append(block_hash(parent, seq.token_ids[i * bs : (i + 1) * bs], extra))
        return hashes

    # -------------------------------------------------------------- mutation
    def allocate_prefix(self, seq: Sequence, extra: bytes = b"") -> int:
        """Give a newly admitted sequence its cached leading blocks; returns tokens covered.

        The last token is always recomputed (its logits are needed), so at most
        (num_tokens - 1) // block_size blocks are reused.
        """
        assert not seq.block_tables[self.group], "allocate_prefix on a sequence that holds blocks"
        if not self.enable_prefix_caching or seq.want_prompt_logits:
            return 0
        max_blocks = (seq.num_tokens - 1) // self.block_size
        hits: list[bytes] = []
        for h in self._hashes(seq, max_blocks, extra):
            if h not in self.cached:
                break
            hits.append(h)
        self.prefix_queries += seq.num_tokens
        self.prefix_hits += len(hits) * self.block_size
        seq.block_tables[self.group] = [self.take_cached(h) for h in hits]
        return len(hits) * self.block_size

    def take_cached(self, digest: bytes) -> int:
        """A reference to the cached block of this hash (taken off the free list if it sat
        there)."""
        block_id = self.cached[digest]
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.free_queue[block_id]
        block.ref_count += 1
        return block_id

    def can_allocate_prefix(self, seq: Sequence, num_new_tokens: int, extra: bytes = b"") -> bool:
        """Would admitting `seq` with `num_new_tokens` this step fit, counting cache hits?"""
        return self.blocks_to_admit(seq, num_new_tokens, extra) <= self.num_free_blocks

    def blocks_to_admit(self, seq: Sequence, num_new_tokens: int, extra: bytes = b"") -> int:
        """Free-list blocks that admitting `seq` with `num_new_tokens` this step would take: new
        blocks plus cached blocks that sit in the free list (reused, so no longer free)."""
        if self.enable_prefix_caching and not seq.want_prompt_logits:
            max_blocks = (seq.num_tokens - 1) // self.block_size
            reused_free = 0
            hit_blocks = 0
            for h in self._hashes(seq, max_blocks, extra):
                block_id = self.cached.get(h)
                if block_id is None:
                    break
                hit_blocks += 1
                reused_free += self.blocks[block_id].ref_count == 0
            covered = hit_blocks * self.block_size
        else:
            covered = reused_free = hit_blocks = 0
        new_total = covered + min(num_new_tokens, seq.num_tokens - covered)
        need = self.blocks_needed(new_total) - hit_blocks
        return need + reused_free

    def ensure_slots(self, seq: Sequence, num_total_tokens: int) -> bool:
        """Grow the block table to hold `num_total_tokens`; False (and no change) if it cannot."""
        table = seq.block_tables[self.group]
        need = self.blocks_needed(num_total_tokens) - len(table)
        if need <= 0:
            return True
        if need > self.num_free_blocks:
            return False
        for _ in range(need):
            table.append(self._take_free())
        return True

    def release_before(self, seq: Sequence, num_blocks: int) -> None:
        """Release the sequence's first `num_blocks` pages (no later query reads them); their
        entries read FREED. Released pages keep their hash, like freed ones. FREED entries always
        lead the table, so this walks back only over the pages it releases."""
        table = seq.block_tables[self.group]
        for j in range(min(num_blocks, len(table)) - 1, -1, -1):
            block_id = table[j]
            if block_id == FREED:
                break
            self._unref(block_id)
            table[j] = FREED

    def _unref(self, block_id: int) -> None:
        block = self.blocks[block_id]
        block.ref_count -= 1
        assert block.ref_count >= 0, f"block {block_id} freed twice"
        if block.ref_count == 0:
            self.free_queue[block_id] = None  # most recently used: evicted last

    def _take_free(self) -> int:
        block_id, _ = self.free_queue.popitem(last=False)
        block = self.blocks[block_id]
        if block.hash is not None:
            if self.cached.get(block.hash) == block_id:
                del self.cached[block.hash]  # evicted: least recently used first
                self._removed(block.hash)
            block.hash = None
        block.ref_count = 1
        return block_id

    def cache_full_blocks(
        self, seq: Sequence, num_computed_tokens: int, extra: bytes = b""
    ) -> None:
        """Register the hashes of blocks whose tokens now all have KV in the cache."""
        if not self.enable_prefix_caching or seq.want_prompt_logits:
            return
        table = seq.block_tables[self.group]
        num_full = min(num_computed_tokens // self.block_size, len(table))
        hashes = self._hashes(seq, num_full, extra)
        stored: list[int] = []
        for i in range(num_full):
            if table[i] == FREED:
                continue  # released: hashed before it left the window
            block = self.blocks[table[i]]
            if block.hash is not None:
                continue
            h = hashes[i]
            if h in self.cached:
                continue  # the same prefix already sits in another block
            block.hash = h
            self.cached[h] = block.block_id
            stored.append(i)
        if stored and self.events is not None:
            self.events.extend(stored_events(hashes, stored, seq.token_ids, self.block_size))

    def free(self, seq: Sequence) -> None:
        for block_id in reversed(seq.block_tables[self.group]):
            if block_id == FREED:
                break  # FREED entries lead the table: nothing before this one is held
            self._unref(block_id)
        seq.block_tables[self.group] = []

    def exclusive_blocks(self, seq: Sequence) -> list[int]:
        """The blocks only this sequence holds (freed with it)."""
        return [
            b for b in seq.block_tables[self.group] if b != FREED and self.blocks[b].ref_count == 1
        ]

    def exclusive_window_blocks(self, seq: Sequence) -> list[int]:
        """The sliding-window pool's blocks only this sequence holds; none here (one pool)."""
        return []

    def uncache(self, seq: Sequence) -> None:
        """Take the blocks only this sequence holds out of the prefix cache (their KV is
        suspect)."""
        for block_id in self.exclusive_blocks(seq):
            block = self.blocks[block_id]
            if block.hash is not None:
                if self.cached.get(block.hash) == block_id:
                    del self.cached[block.hash]
                    self._removed(block.hash)
                block.hash = None

    def forget(self, seq: Sequence) -> None:
        """Drop per-sequence bookkeeping once a request is done for good."""
        self._seq_hashes.pop(seq.request_id, None)

    def reset_prefix_cache(self) -> None:
        """Forget every cached block no live sequence holds."""
        for block in self.blocks:
            if block.ref_count == 0:
                block.hash = None
        kept = {h: b for h, b in self.cached.items() if self.blocks[b].hash == h}
        if self.events is not None and len(kept) < len(self.cached):
            if kept:
                self.events.append(
                    BlockRemoved([external_hash(h) for h in self.cached if h not in kept])
                )
            else:
                self.events.append(AllBlocksCleared())
        self.cached = kept
