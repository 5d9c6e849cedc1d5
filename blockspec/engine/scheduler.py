"""Continuous batching: which sequences run this step, and how many tokens each.

Every scheduled sequence processes its uncomputed committed tokens (a prefill chunk, or the single
anchor token of a decoding sequence) plus, when it is decoding, k draft tokens. Running sequences go
first; waiting ones join between steps while the token budget, `max_num_seqs` and free KV blocks
allow, starting past the blocks the prefix cache already holds for them (engine/kv_cache.py), with
long prompts split into chunks. When blocks run out, the most recently admitted sequence is
preempted and later recomputed. The scheduler never touches tensors.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from blockspec.engine.kv_cache import BlockAllocator
from blockspec.engine.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_new: int  # committed tokens processed from seq.num_computed on
    num_drafts: int  # draft tokens verified after them (0 for a prefill chunk)
    # hybrids: (tokens into this span, snapshot entry) where the pass saves the recurrent state (state_pool.py)
    snapshots: list[tuple[int, int]] = field(default_factory=list)

    @property
    def samples(self) -> bool:
        """True when this step reaches the end of the sequence and so draws its next token(s)."""
        return self.seq.num_computed + self.num_new == self.seq.num_tokens


@dataclass
class SchedulerOutput:
    items: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(i.num_new + i.num_drafts for i in self.items)


class Scheduler:
    def __init__(self, allocator: BlockAllocator, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int, num_speculative_tokens: int) -> None:
        self.allocator = allocator
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.k = num_speculative_tokens
        self.lookahead = 0  # positions to allocate past a decode step (the chained step's k + 1)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def drafts_for(self, seq: Sequence) -> int:
        """k for this step: never past max_tokens or max_model_len; none before a first output token."""
        if self.k == 0 or seq.num_output == 0:
            return 0
        left = min(seq.max_tokens - seq.num_output, self.max_model_len - seq.num_tokens + 1)
        return max(0, min(self.k, left - 1))

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        scheduled: set[int] = set()
        i = 0
        while i < len(self.running):
            seq = self.running[i]
            remaining = seq.num_tokens - seq.num_computed
            drafts = self.drafts_for(seq) if remaining == 1 else 0
            num_new = min(remaining, budget - drafts) if remaining > 1 else 1
            if num_new <= 0 or budget < num_new + drafts:
                i += 1
                continue
            want = seq.num_computed + num_new + drafts
            # Pipelined decoding chains the next step before this one is read: blocks for it too, if free.
            ahead = remaining == 1 and self.lookahead and self.allocator.ensure(seq, want + self.lookahead)
            while not ahead and not self.allocator.ensure(seq, want):
                victim = self.running[-1]
                self._preempt(victim, out)
                if victim is seq:
                    break
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted itself; the list shrank at the end
            out.items.append(ScheduledSeq(seq, num_new, drafts))
            scheduled.add(id(seq))
            budget -= num_new + drafts
            i += 1
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and not out.preempted:
            seq = self.waiting[0]
            hit = self.allocator.lookup(seq)  # at least its last token is left to compute
            num_new = min(seq.num_tokens - hit.num_tokens, budget)
            if not self.allocator.admit(seq, hit, hit.num_tokens + num_new):
                break
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.items.append(ScheduledSeq(seq, num_new, 0))
            budget -= num_new
        self.allocator.plan_step(out.items)
        return out

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.running.remove(seq)
        self.allocator.free(seq)
        seq.reset_for_recompute()
        self.waiting.appendleft(seq)
        out.preempted.append(seq)
        out.items = [item for item in out.items if item.seq is not seq]

    def finish(self, seq: Sequence) -> None:
        """Release a finished or aborted sequence's blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.allocator.free(seq)
        seq.pending_features = None
        seq.status = SequenceStatus.FINISHED
