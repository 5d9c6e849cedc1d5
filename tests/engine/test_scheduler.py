"""Scheduler and block allocator: budgets, chunking, caps, preemption and freeing."""

from __future__ import annotations

from blockspec.engine.kv_cache import BlockAllocator
from blockspec.engine.sampling_params import SamplingParams
from blockspec.engine.scheduler import Scheduler
from blockspec.engine.sequence import Sequence


def make_seq(name: str, n_prompt: int, max_tokens: int = 50) -> Sequence:
    seq = Sequence(name, list(range(n_prompt)), SamplingParams(temperature=0, max_tokens=max_tokens), None, [], None)
    return seq


def test_allocator_free_list_round_trip():
    alloc = BlockAllocator(10, 16)
    a, b = make_seq("a", 1), make_seq("b", 1)
    assert alloc.ensure(a, 33) and a.block_table == [0, 1, 2]
    assert alloc.ensure(b, 16) and len(b.block_table) == 1
    assert alloc.ensure(a, 48) and len(a.block_table) == 3  # already covered
    assert not alloc.ensure(b, 16 * 8)  # needs 7 more, 6 free: nothing taken
    assert len(b.block_table) == 1 and alloc.num_free == 6
    alloc.free(a)
    assert alloc.num_free == 9 and a.block_table == []


def test_chunked_prefill_respects_token_budget_and_seq_cap():
    sched = Scheduler(BlockAllocator(100, 16), max_num_seqs=2, max_num_batched_tokens=64, max_model_len=512,
                      num_speculative_tokens=4)
    seqs = [make_seq(f"s{i}", 100) for i in range(3)]
    for s in seqs:
        sched.add(s)
    out = sched.schedule()
    assert [(i.seq.request_id, i.num_new, i.num_drafts) for i in out.items] == [("s0", 64, 0)]
    seqs[0].num_computed += 64
    out = sched.schedule()  # s0's remaining 36, then s1 gets the other 28; s2 waits (max_num_seqs=2)
    assert [(i.seq.request_id, i.num_new) for i in out.items] == [("s0", 36), ("s1", 28)]
    assert out.items[0].samples and not out.items[1].samples
    assert len(sched.running) == 2 and list(sched.waiting) == [seqs[2]]


def test_decoding_sequences_get_drafts_clipped_at_max_tokens():
    sched = Scheduler(BlockAllocator(100, 16), max_num_seqs=4, max_num_batched_tokens=256, max_model_len=512,
                      num_speculative_tokens=15)
    seq = make_seq("d", 10, max_tokens=6)
    sched.add(seq)
    sched.schedule()
    seq.num_computed = 10
    seq.output_ids = [1]
    (item,) = sched.schedule().items
    assert (item.num_new, item.num_drafts) == (1, 4)  # 5 tokens left: at most 4 drafts + 1 bonus
    seq.output_ids = [1, 2, 3, 4, 5]
    seq.num_computed = 14
    (item,) = sched.schedule().items
    assert item.num_drafts == 0


def test_preemption_when_blocks_run_out_and_finish_frees():
    alloc = BlockAllocator(4, 16)
    sched = Scheduler(alloc, max_num_seqs=4, max_num_batched_tokens=256, max_model_len=512, num_speculative_tokens=0)
    a, b = make_seq("a", 30), make_seq("b", 30)
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    assert [i.seq.request_id for i in out.items] == ["a", "b"] and alloc.num_free == 0
    for s in (a, b):
        s.num_computed = 30
        s.output_ids = [7, 7, 7]  # a needs a third block now
    out = sched.schedule()
    assert out.preempted == [b] and [i.seq.request_id for i in out.items] == ["a"]
    assert b.num_computed == 0 and list(sched.waiting) == [b]
    sched.finish(a)
    assert alloc.num_free == 4 - len(b.block_table)
