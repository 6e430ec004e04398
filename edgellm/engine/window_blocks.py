"""Pages for a model that mixes sliding-window and global attention layers (Gemma 3, EXAONE 4).

A global layer reads a sequence's whole context; a sliding layer with window W reads only the last
W positions before each query. Giving both the same pages would keep every sliding layer's K/V for
the whole context. So the sliding layers get a pool of their own: the manager below is the global
layers' pool (Sequence.block_table, the pool the scheduler budgets) and holds the window pool
(`self.window`, Sequence.window_table). Once no later query of a sequence can reach a page of the
window pool (every position in it is W or more before the next query), the page is released back
to the pool and its entry reads FREED; the runner points FREED entries at the pool's zero page.

Prefix caching stays exact: both pools cache full blocks under the same chained hash. A prefix hit
of m blocks needs the global pool to hold all m and the window pool the blocks that the first new
query's window reaches (those from position m * block_size - W + 1 on); the hit is the longest m
for which both hold. Sequences never share a window page unless they share the prefix up to it.

Admission and growth check both pools: a step that does not fit in either preempts, as one pool
would. engine/kv_layout.py sizes the window pool so that live sequences never fill it.
"""

from __future__ import annotations

from edgellm.engine.block_manager import FREED, BlockManager
from edgellm.engine.sequence import Sequence

WINDOW_GROUP = 1  # Sequence.block_tables[1]


class HybridBlockManager(BlockManager):
    """The global layers' pages (this manager) plus the sliding-window layers' own pool."""

    def __init__(
        self,
        num_blocks: int,
        num_window_blocks: int,
        block_size: int,
        window: int,
        enable_prefix_caching: bool = True,
        record_events: bool = False,
    ) -> None:
        super().__init__(num_blocks, block_size, enable_prefix_caching, record_events)
        if window < 1:
            raise ValueError(f"sliding window must be >= 1, got {window}")
        self.window_size = window
        self.window = BlockManager(
            num_window_blocks, block_size, enable_prefix_caching, group=WINDOW_GROUP
        )
        self.window._seq_hashes = self._seq_hashes  # the same chain, computed once

    @property
    def num_held_pages(self) -> int:
        return self.num_held_blocks + self.window.num_held_blocks

    def first_needed_block(self, position: int) -> int:
        """The first block a query at `position` reads in a sliding layer (earlier ones are out of
        its window, and out of every later query's)."""
        return max(0, position - self.window_size + 1) // self.block_size

    # ------------------------------------------------------------ prefix hits
    def _hit(self, seq: Sequence, extra: bytes) -> tuple[list[bytes], int]:
        """(the hashes of the reusable blocks, the first of them the window pool must give)."""
        if not self.enable_prefix_caching or seq.want_prompt_logits:
            return [], 0
        max_blocks = (seq.num_tokens - 1) // self.block_size
        hashes = self._hashes(seq, max_blocks, extra)
        m = 0
        while m < len(hashes) and hashes[m] in self.cached:
            m += 1
        in_window = [h in self.window.cached for h in hashes[:m]]
        while m > 0:
            lo = self.first_needed_block(m * self.block_size)
            if all(in_window[lo:m]):
                return hashes[:m], lo
            m -= 1
        return [], 0

    def allocate_prefix(self, seq: Sequence, extra: bytes = b"") -> int:
        assert not seq.block_table and not seq.window_table, "allocate_prefix: blocks held"
        if not self.enable_prefix_caching or seq.want_prompt_logits:
            return 0
        hits, lo = self._hit(seq, extra)
        self.prefix_queries += seq.num_tokens
        self.prefix_hits += len(hits) * self.block_size
        seq.block_table = [self.take_cached(h) for h in hits]
        seq.window_table = [FREED] * lo + [self.window.take_cached(h) for h in hits[lo:]]
        return len(hits) * self.block_size

    def _needs(self, seq: Sequence, num_new_tokens: int, extra: bytes) -> tuple[int, int]:
        """Free-list blocks each pool gives to admit `seq` with `num_new_tokens` this step."""
        hits, lo = self._hit(seq, extra)
        covered = len(hits) * self.block_size
        new = self.blocks_needed(covered + min(num_new_tokens, seq.num_tokens - covered))
        new -= len(hits)
        reused = sum(self.blocks[self.cached[h]].ref_count == 0 for h in hits)
        window = self.window
        reused_window = sum(window.blocks[window.cached[h]].ref_count == 0 for h in hits[lo:])
        return new + reused, new + reused_window

    def blocks_to_admit(self, seq: Sequence, num_new_tokens: int, extra: bytes = b"") -> int:
        return self._needs(seq, num_new_tokens, extra)[0]

    def can_allocate_prefix(self, seq: Sequence, num_new_tokens: int, extra: bytes = b"") -> bool:
        need, need_window = self._needs(seq, num_new_tokens, extra)
        return need <= self.num_free_blocks and need_window <= self.window.num_free_blocks

    # ------------------------------------------------------------ growth
    def ensure_slots(self, seq: Sequence, num_total_tokens: int) -> bool:
        """Grow both tables to `num_total_tokens` (or change neither), after releasing the window
        pages the step's first query no longer reads."""
        self.window.release_before(seq, self.first_needed_block(seq.num_computed_tokens))
        total = self.blocks_needed(num_total_tokens)
        if (
            total - len(seq.block_table) > self.num_free_blocks
            or total - len(seq.window_table) > self.window.num_free_blocks
        ):
            return False
        return super().ensure_slots(seq, num_total_tokens) and self.window.ensure_slots(
            seq, num_total_tokens
        )

    def cache_full_blocks(
        self, seq: Sequence, num_computed_tokens: int, extra: bytes = b""
    ) -> None:
        """Cache the full blocks of both pools, then release the window pages that the next query
        (at `num_computed_tokens`) and every later one no longer read."""
        super().cache_full_blocks(seq, num_computed_tokens, extra)
        self.window.cache_full_blocks(seq, num_computed_tokens, extra)
        self.window.release_before(seq, self.first_needed_block(num_computed_tokens))

    # ------------------------------------------------------------ release
    def free(self, seq: Sequence) -> None:
        super().free(seq)
        self.window.free(seq)

    def exclusive_window_blocks(self, seq: Sequence) -> list[int]:
        return self.window.exclusive_blocks(seq)

    def uncache(self, seq: Sequence) -> None:
        super().uncache(seq)
        self.window.uncache(seq)

    def reset_prefix_cache(self) -> None:
        super().reset_prefix_cache()
        self.window.reset_prefix_cache()
