"""The block allocator's prefix cache: keys, sharing, reference counts, eviction order, and its counters."""

from __future__ import annotations

from blockspec.engine.block_hash import block_hashes
from blockspec.engine.kv_cache import BlockAllocator
from blockspec.engine.sampling_params import SamplingParams
from blockspec.engine.sequence import Sequence

BS = 4


def seq_of(tokens: list[int], name: str = "s") -> Sequence:
    return Sequence(name, tokens, SamplingParams(temperature=0, max_tokens=8), None, [], None)


def run(alloc: BlockAllocator, seq: Sequence, computed: int | None = None) -> None:
    """Admit seq on its hit and pretend the model computed `computed` positions (default: all but the last)."""
    assert alloc.admit(seq, alloc.lookup(seq), seq.num_tokens)
    seq.num_computed = seq.drafter_computed = seq.num_tokens - 1 if computed is None else computed
    alloc.cache_blocks(seq)


def test_keys_chain_the_whole_prefix():
    a, b, c = seq_of(list(range(12))), seq_of(list(range(12))), seq_of([99] + list(range(1, 12)))
    ka, kb, kc = (block_hashes(s, 3, BS) for s in (a, b, c))
    assert ka == kb and len(set(ka)) == 3
    assert all(x != y for x, y in zip(ka, kc))  # one token of block 0 differs: every later key differs too
    d = seq_of(list(range(8)) + [7, 7, 7, 7])
    assert block_hashes(d, 3, BS)[:2] == ka[:2] and block_hashes(d, 3, BS)[2] != ka[2]
    assert block_hashes(a, 3, BS) is a.block_hashes  # computed once, kept on the sequence


def test_shared_blocks_are_reference_counted_and_a_hit_leaves_the_last_token():
    alloc = BlockAllocator(16, BS, enable_caching=True)
    a = seq_of(list(range(14)))
    run(alloc, a)  # 13 positions computed: blocks 0..2 full
    assert alloc.num_cached == 3 and a.num_cached_blocks == 3
    b = seq_of(list(range(10)) + [50, 51, 52])
    hit = alloc.lookup(b)
    assert hit.blocks == a.block_table[:2] and hit.num_tokens == 8
    assert alloc.admit(b, hit, 13) and b.num_computed == b.drafter_computed == 8
    assert b.block_table[:2] == a.block_table[:2] and alloc.num_free == 16 - 4 - 2
    assert b.stats.cached_tokens == 8 and (alloc.stats.queries, alloc.stats.hits) == (14 + 13, 8)
    alloc.free(a)  # blocks 0, 1 still held by b; a's other blocks become free (cached or not)
    assert alloc.num_free == 16 - 4 and alloc.num_cached == 3
    same = seq_of(list(range(12)))  # 12 tokens, all in cached blocks: the hit stops one block short
    assert alloc.lookup(same).num_tokens == 8
    alloc.free(b)
    assert alloc.num_free == 16


def test_free_list_hands_out_plain_blocks_first_then_the_least_recently_used_cached_ones():
    alloc = BlockAllocator(6, BS, enable_caching=True)
    a = seq_of(list(range(9)))  # 3 blocks: 0, 1 complete and cached, block 2 partial
    run(alloc, a)
    alloc.free(a)  # the partial block goes to the front; a's later cached block will be evicted before its first
    hold = seq_of([7] * 5, "hold")
    assert alloc.ensure(hold, 4 * BS)  # 3 untouched + a's partial block: nothing evicted
    assert alloc.stats.evictions == 0 and alloc.num_cached == 2
    assert alloc.ensure(hold, 5 * BS)
    assert alloc.stats.evictions == 1 and alloc.lookup(seq_of(list(range(9)))).num_tokens == 4  # block 1 went


def test_a_block_another_sequence_holds_is_never_evicted():
    alloc = BlockAllocator(4, BS, enable_caching=True)
    a, b = seq_of(list(range(9)), "a"), seq_of(list(range(9)), "b")
    run(alloc, a)
    run(alloc, b)  # starts on a's two cached blocks, one new block
    assert b.block_table[:2] == a.block_table[:2] and alloc.num_free == 0
    alloc.free(a)  # only its private partial block comes back
    hog = seq_of([1], "hog")
    assert not alloc.ensure(hog, 2 * BS) and alloc.ensure(hog, BS)
    assert alloc.num_cached == 2 and alloc.stats.evictions == 0
    alloc.free(b)
    assert alloc.ensure(hog, 3 * BS) and alloc.stats.evictions == 1  # now evictable: b's later block first
    assert alloc.lookup(seq_of(list(range(9)), "c")).num_tokens == 4


def test_blocks_wait_for_the_drafter_context_and_duplicates_stay_private():
    alloc = BlockAllocator(16, BS, enable_caching=True)
    alloc.tracks_drafter = True
    a = seq_of(list(range(13)))
    assert alloc.admit(a, alloc.lookup(a), 13)
    a.num_computed, a.drafter_computed = 12, 5  # the drafter has projected positions < 5 only
    alloc.cache_blocks(a)
    assert alloc.num_cached == 1
    a.drafter_computed = 12
    alloc.cache_blocks(a)
    assert alloc.num_cached == 3
    twin = seq_of(list(range(13)), "twin")  # admitted before a's blocks were cached: computed on its own
    assert alloc.admit(twin, type(alloc.lookup(twin))(block_size=BS), 13)
    twin.num_computed = twin.drafter_computed = 12
    alloc.cache_blocks(twin)
    assert alloc.num_cached == 3 and alloc.lookup(seq_of(list(range(13)))).blocks == a.block_table[:3]
    alloc.free(twin)  # its private copies are handed out before any cached block
    assert alloc.ensure(seq_of([1], "y"), 4 * BS) and alloc.stats.evictions == 0


def test_reset_and_disabled_cache():
    alloc = BlockAllocator(8, BS, enable_caching=True)
    a = seq_of(list(range(9)))
    run(alloc, a)
    alloc.reset_cache()
    assert alloc.num_cached == 0 and alloc.lookup(seq_of(list(range(9)))).num_tokens == 0
    off = BlockAllocator(8, BS)
    b = seq_of(list(range(9)))
    run(off, b)
    assert off.num_cached == 0 and b.stats.cached_tokens == 0 and off.stats.queries == 0
