"""The one interface every proposer gives the runner: DFlash 1 and 2, the target's MTP head, synthetic drafts.

What a proposer needs from the target each step (`TargetNeeds`): for every newly committed position, the
hidden states at some target layers (DFlash) or the target's final-normed hidden state (MTP), and for MTP
also the token that followed the position. The runner captures those in the verify pass and keeps them
per sequence (`Sequence.pending_features`, or rows of the decode path's feature buffer) until the
proposer's next pass reads them.

What it returns (`Drafts`): up to k draft tokens per drafting sequence and, when it sampled them, the
distribution q each was drawn from over a few candidate tokens, so that rejection sampling stays lossless
(no q: greedy drafts, q one-hot at the drafted token).

Two ways in: `propose` (general path: ragged batches, eager, host metadata) and `propose_decode`
(uniform decode steps: static shapes, no host reads, captured in the drafter's CUDA graph when
`in_graph`). `write_pending` projects context a general-path step left behind before a decode step (and a finishing
sequence's last context, for the prefix cache).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from blockspec.device import upload

if TYPE_CHECKING:
    from blockspec.engine.scheduler import ScheduledSeq
    from blockspec.engine.sequence import Sequence


@dataclass(frozen=True)
class TargetNeeds:
    """What a proposer reads from the target at each committed position."""

    layer_ids: tuple[int, ...] = ()  # hidden states at these target layers' outputs, concatenated (DFlash)
    final_hidden: bool = False  # the target's final-normed hidden state (MTP)
    next_tokens: bool = False  # the token after each position (MTP pairs h_p with x_{p+1})

    def width(self, hidden_size: int) -> int:
        """Features per position."""
        return hidden_size * (len(self.layer_ids) + int(self.final_hidden))

    def select(self, final: torch.Tensor, layers: torch.Tensor | None) -> torch.Tensor | None:
        """The features to keep from a target pass's (final-normed hidden, captured layers)."""
        return final if self.final_hidden else layers


@dataclass
class Drafts:
    """A proposer's drafts for the drafting sequences of a step, in the order it was given them.

    tokens [R, K]: row r's first num_drafts[r] entries are its drafts. When they were sampled: candidates
    [R, K, C] the token ids q is over, q [R, K, C] the probabilities each draft was drawn with.
    """

    tokens: torch.Tensor
    candidates: torch.Tensor | None = None
    q: torch.Tensor | None = None

    def dense_q(self, vocab: int, rows: int | None = None) -> torch.Tensor | None:
        """q of the first `rows` rows (all by default) spread over the vocabulary [R, K, V] (what
        verify_sampled takes)."""
        if self.q is None:
            return None
        cand, q = self.candidates[:rows], self.q[:rows]
        return torch.zeros(*cand.shape[:2], vocab, device=q.device, dtype=torch.float32).scatter_(
            -1, cand, q.float())


@dataclass
class StepContext:
    """What the runner lends a proposer on the general path: the target and the paged-cache geometry."""

    target: nn.Module
    device: torch.device
    dtype: torch.dtype
    block_size: int
    draft_window: int | None = None

    def tensor(self, values: list, dtype: torch.dtype = torch.int64) -> torch.Tensor:
        return upload(values, dtype, self.device)

    def slot(self, seq: Sequence, pos: int) -> int:
        return seq.block_table[pos // self.block_size] * self.block_size + pos % self.block_size

    def slots(self, seq: Sequence, start: int, end: int) -> list[int]:
        return [self.slot(seq, p) for p in range(start, end)]


@dataclass
class DecodeInputs:
    """A uniform decode step as the proposer's in-graph pass sees it (views of static buffers, `bp` rows of
    q = k + 1 positions each). Sections are those of runner/decode_graphs.py."""

    views: Any  # DecodeViews: anchor, token, num_drafts, tables, positions, slots, draft_* and ctx_* sections
    features: torch.Tensor  # [rows, width] committed context features (rows named by views.ctx_rows)
    feature_tokens: torch.Tensor | None  # [rows] the verify input token of each feature row (next_tokens)
    temperature: torch.Tensor | None  # [bp] sampling temperature per row (0: greedy), for proposers that sample
    noise: torch.Tensor | None  # [bp, k, C] Exp(1) draws for their sampled choices


def sampling_temperatures(seqs: list[Sequence], device: torch.device) -> torch.Tensor | None:
    """[R] temperature per sequence (0 for greedy), or None when every one is greedy."""
    if all(s.params.greedy for s in seqs):
        return None
    return upload([0.0 if s.params.greedy else s.params.temperature for s in seqs], torch.float32, device)


def exponential_noise(seq: Sequence, shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """Exp(1) draws from the request's own generator (a seed reproduces the output whatever shares the batch)."""
    return torch.empty(shape, device=device, dtype=torch.float32).exponential_(generator=seq.generator)


class Proposer(nn.Module):
    """Base of every proposer. Subclasses set `method`, `needs`, `max_drafts` and implement the two passes."""

    method = "none"
    needs = TargetNeeds()
    in_graph = True  # propose_decode can be captured in a CUDA graph
    num_candidates = 0  # C: the candidates sampled drafts choose among (0: never samples)

    @property
    def max_drafts(self) -> int | None:
        """The most drafts per step it can make (None: no limit)."""
        return None

    @property
    def attention_layers(self) -> list:
        """Layers with a paged K/V cache the runner allocates beside the target's (same block tables)."""
        return []

    def propose(self, items: list[ScheduledSeq], ctx: StepContext) -> Drafts | None:
        """General path: consume the items' pending context and draft for those with num_drafts > 0."""
        raise NotImplementedError

    def propose_decode(self, inputs: DecodeInputs, target: nn.Module) -> Drafts:
        """Uniform decode path: context rows and drafts of every row, from static buffers, no host reads."""
        raise NotImplementedError

    def write_pending(self, seqs: list[Sequence], ctx: StepContext, keep_last: bool = True) -> None:
        """Take each sequence's pending context into the proposer's cache. Before a decode step all but its
        last position (`keep_last`: the step itself reads that one, from the feature buffer's carry rows);
        for a finishing sequence all of it (its full blocks can then enter the prefix cache)."""

    def describe(self) -> str:
        return self.method
