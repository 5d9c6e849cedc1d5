"""Paged KV-cache bookkeeping: fixed-size blocks, reference-counted and shared through the prefix cache.

The cache tensors themselves belong to the model runner; this module only decides which blocks a
sequence owns. The drafter's context cache shares the target's block tables (one slot per token
position in both), so one allocator serves both, and a cached block carries the drafter's
context K/V of its positions along with the target's.

Prefix caching (vLLM v1's design): once every position of a full block has its K/V written (the
target's, and the drafter's context when a drafter runs), the block is registered under its key
(engine/block_hash.py). A new sequence starts on the longest chain of registered blocks that
matches its tokens, capped one token short of its end so that the step still computes the logits
of its last token, and computes from there. Blocks are reference-counted; a block no sequence
holds stays registered on the free list, which hands out unregistered blocks first and then
evicts registered ones least recently used (a freed sequence's later blocks before its earlier
ones). Nothing ever writes into a registered block: every writer writes at or past its own
computed frontier, and a hit covers whole blocks below it.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from blockspec.engine.block_hash import BlockHash, block_hashes
from blockspec.engine.sequence import Sequence


@dataclass
class PrefixHit:
    """What a waiting sequence can start from: cached blocks covering positions [0, num_tokens)."""

    blocks: list[int] = field(default_factory=list)
    block_size: int = 0
    snapshot: int | None = None  # hybrids: the recurrent-state snapshot at num_tokens

    @property
    def num_tokens(self) -> int:
        return len(self.blocks) * self.block_size


@dataclass
class PrefixCacheStats:
    """Token counters under vLLM's metric names: prompt tokens looked up, and those found cached."""

    queries: int = 0
    hits: int = 0
    evictions: int = 0  # cached blocks handed out again (their contents lost)

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class BlockAllocator:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = False) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.tracks_drafter = False  # a drafter runs: a block is complete once its drafter context is written
        self.stats = PrefixCacheStats()
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))  # next to hand out first
        self._refs = [0] * num_blocks
        self._key: list[BlockHash | None] = [None] * num_blocks
        self._cached: dict[BlockHash, int] = {}

    @property
    def num_free(self) -> int:
        """Blocks no sequence holds (cached ones among them: they are evicted on demand)."""
        return len(self._free)

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free / self.num_blocks if self.num_blocks else 0.0

    def blocks_needed(self, seq: Sequence, num_positions: int) -> int:
        """Blocks `seq` lacks to hold positions [0, num_positions)."""
        return max(0, -(-num_positions // self.block_size) - len(seq.block_table))

    def ensure(self, seq: Sequence, num_positions: int) -> bool:
        """Grow `seq`'s block table to cover num_positions; False (and no change) if blocks run out."""
        need = self.blocks_needed(seq, num_positions)
        if need > len(self._free):
            return False
        seq.block_table.extend(self._take() for _ in range(need))
        return True

    def free(self, seq: Sequence) -> None:
        """Give back a finished, aborted or preempted sequence's blocks, registering its complete ones first."""
        self.cache_blocks(seq)
        for block in reversed(seq.block_table):  # its last blocks become the first to be evicted
            self._release(block)
        seq.block_table = []
        seq.num_cached_blocks = 0

    # ---- prefix cache -------------------------------------------------------------------------

    def lookup(self, seq: Sequence) -> PrefixHit:
        """The cached blocks a waiting sequence can start from (no side effects)."""
        if not self.enable_caching:
            return PrefixHit(block_size=self.block_size)
        blocks = []
        for key in block_hashes(seq, (seq.num_tokens - 1) // self.block_size, self.block_size):
            block = self._cached.get(key)
            if block is None:
                break
            blocks.append(block)
        return self._usable(seq, blocks)

    def _usable(self, seq: Sequence, blocks: list[int]) -> PrefixHit:
        """The part of a matched chain a sequence can resume from (all of it, for attention-only models)."""
        return PrefixHit(blocks, self.block_size)

    def admit(self, seq: Sequence, hit: PrefixHit, num_positions: int) -> bool:
        """Start a waiting sequence on `hit` plus new blocks up to num_positions; False (no change) if
        blocks run out."""
        need = -(-num_positions // self.block_size) - len(hit.blocks)
        revived = sum(1 for b in hit.blocks if self._refs[b] == 0)  # cached blocks taken off the free list
        if need + revived > len(self._free):
            return False
        for block in hit.blocks:
            if self._refs[block] == 0:
                del self._free[block]
            self._refs[block] += 1
        seq.block_table = list(hit.blocks) + [self._take() for _ in range(need)]
        seq.num_computed = seq.drafter_computed = hit.num_tokens  # the drafter's context rides on the blocks
        seq.num_cached_blocks = len(hit.blocks)
        if seq.stats.cached_tokens is None:  # counted once per request, not again after a preemption
            seq.stats.cached_tokens = hit.num_tokens
            if self.enable_caching:
                self.stats.queries += seq.num_tokens
                self.stats.hits += hit.num_tokens
        return True

    def cache_blocks(self, seq: Sequence) -> None:
        """Register seq's blocks whose every position has its K/V written (target, and drafter context)."""
        if not self.enable_caching:
            return
        done = min(seq.num_computed, seq.num_tokens)
        if self.tracks_drafter:
            done = min(done, seq.drafter_computed)
        full = min(done // self.block_size, len(seq.block_table))
        if full <= seq.num_cached_blocks:
            return
        keys = block_hashes(seq, full, self.block_size)
        for j in range(seq.num_cached_blocks, full):
            block, key = seq.block_table[j], keys[j]
            if self._key[block] is None and key not in self._cached:  # a duplicate of a cached block stays private
                self._key[block] = key
                self._cached[key] = block
        seq.num_cached_blocks = full

    def step_done(self, seqs: list[Sequence]) -> None:
        """After a step: register what the still-running sequences completed."""
        for seq in seqs:
            if not seq.finished and seq.block_table:
                self.cache_blocks(seq)

    def plan_step(self, items: list) -> None:
        """Hook for the scheduled items before they run (hybrids plan their state snapshots here)."""

    def reset_cache(self) -> None:
        """Forget every cached block (their contents no longer match their keys, e.g. the drafter changed)."""
        self._cached.clear()
        self._key = [None] * self.num_blocks

    # ---- blocks -------------------------------------------------------------------------------

    def _take(self) -> int:
        block, _ = self._free.popitem(last=False)
        key = self._key[block]
        if key is not None:  # evict
            self._key[block] = None
            del self._cached[key]
            self.stats.evictions += 1
        self._refs[block] = 1
        return block

    def _release(self, block: int) -> None:
        self._refs[block] -= 1
        if self._refs[block] > 0:
            return
        self._free[block] = None  # cached: the most recently used end
        if self._key[block] is None:
            self._free.move_to_end(block, last=False)  # holds nothing worth keeping: handed out first
