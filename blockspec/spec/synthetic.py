"""Synthetic acceptance: drafts taken from a known continuation, corrupted to reach a chosen rate.

With reference continuations (the target's own greedy output), each draft position is right with
probability `accept_prob`, so the acceptance length follows a truncated geometric law:
tau = (1 - a^(k+1)) / (1 - a). Benchmarks use it to time the verify path at a controlled tau, and
tests use it to drive the accept/rollback machinery hard. Everything it produces is labelled
synthetic by its users. It is a proposer like the others (spec/proposer.py) that needs nothing from the
target; its drafts are made on the host, so the decode path asks for them outside the CUDA graphs.
"""

from __future__ import annotations

import random
from typing import TYPE_CHECKING

from blockspec.spec.proposer import Drafts, Proposer, StepContext

if TYPE_CHECKING:
    from blockspec.engine.scheduler import ScheduledSeq
    from blockspec.engine.sequence import Sequence


def expected_tau(accept_prob: float, k: int) -> float:
    a = accept_prob
    return float(k + 1) if a >= 1 else (1 - a ** (k + 1)) / (1 - a)


class SyntheticProposer(Proposer):
    method = "synthetic"
    in_graph = False

    def __init__(self, references: dict[str, list[int]], accept_prob: float, vocab_size: int, seed: int = 0) -> None:
        super().__init__()
        self.references = references
        self.accept_prob = accept_prob
        self.vocab_size = vocab_size
        self.rng = random.Random(seed)

    def draft(self, seq: Sequence, k: int) -> list[int]:
        """k drafts following seq's committed tokens; a wrong token where the coin says so."""
        ref = self.references.get(seq.request_id, [])
        start = seq.num_output
        drafts = []
        for i in range(k):
            true = ref[start + i] if start + i < len(ref) else 0
            if self.rng.random() < self.accept_prob:
                drafts.append(true)
            else:
                drafts.append((true + 1 + self.rng.randrange(self.vocab_size - 1)) % self.vocab_size)
        return drafts

    def propose(self, items: list[ScheduledSeq], ctx: StepContext) -> Drafts | None:
        drafting = [item for item in items if item.num_drafts]
        if not drafting:
            return None
        width = max(item.num_drafts for item in drafting)
        rows = [self.draft(item.seq, item.num_drafts) + [0] * (width - item.num_drafts) for item in drafting]
        return Drafts(ctx.tensor(rows))
