"""Training batches: sequences, random anchors inside the response, and the blocks they start.

An anchor is a position a whose token the target wrote and whose next token it wrote too, as at
decode time: the drafter gets [x_a, MASK * (B-1)] at positions a..a+B-1, sees the context features
of positions < a, and must predict x_{a+1}..x_{a+B-1}. Labels past the response (or the sequence)
are masked. Anchors are drawn afresh for every batch, so each epoch sees new ones; every sequence
gets exactly `num_anchors` slots (unused slots are padding with no loss), so shapes stay fixed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from blockspec.train.data import Sample


@dataclass
class TrainBatch:
    input_ids: torch.Tensor  # [N, S] right-padded with 0
    anchors: torch.Tensor  # [N, A] anchor positions (0 in padding slots)
    anchor_valid: torch.Tensor  # [N, A] bool
    block_ids: torch.Tensor  # [N, A * B] [x_a, MASK * (B-1)] per anchor
    block_positions: torch.Tensor  # [N, A * B] a .. a + B - 1
    labels: torch.Tensor  # [N, A, B-1] x_{a+1} .. x_{a+B-1} (0 where masked)
    label_mask: torch.Tensor  # [N, A, B-1] bool

    def to(self, device: torch.device) -> TrainBatch:
        return TrainBatch(*(getattr(self, f).to(device, non_blocking=True) for f in self.__dataclass_fields__))

    @property
    def num_labels(self) -> int:
        return int(self.label_mask.sum())


def anchor_candidates(mask: torch.Tensor) -> torch.Tensor:
    """Positions a with mask[a] and mask[a + 1]: the target wrote the anchor and its successor."""
    return torch.nonzero(mask[:-1] & mask[1:]).flatten()


def make_batch(samples: list[Sample], num_anchors: int, block_size: int, mask_token_id: int,
               generator: torch.Generator, pad_to: int = 1) -> TrainBatch:
    """Collate samples and draw up to `num_anchors` distinct anchors per sample (sorted)."""
    n, a_max, k = len(samples), num_anchors, block_size - 1
    seq_len = max(len(s.ids) for s in samples)
    seq_len = -(-seq_len // pad_to) * pad_to
    input_ids = torch.zeros(n, seq_len, dtype=torch.int64)
    anchors = torch.zeros(n, a_max, dtype=torch.int64)
    valid = torch.zeros(n, a_max, dtype=torch.bool)
    labels = torch.zeros(n, a_max, k, dtype=torch.int64)
    label_mask = torch.zeros(n, a_max, k, dtype=torch.bool)
    offsets = torch.arange(1, block_size)
    for i, s in enumerate(samples):
        length = len(s.ids)
        input_ids[i, :length] = s.ids
        cands = anchor_candidates(s.mask)
        if len(cands) > a_max:
            cands = cands[torch.randperm(len(cands), generator=generator)[:a_max]].sort().values
        m = len(cands)
        anchors[i, :m] = cands
        valid[i, :m] = True
        pos = cands[:, None] + offsets[None, :]  # [m, k]
        inside = pos < length
        ok = inside & s.mask[pos.clamp(max=length - 1)]
        ok = ok.cumprod(dim=1).bool()  # a block's labels stop at the first token the target did not write
        labels[i, :m] = torch.where(ok, s.ids[pos.clamp(max=length - 1)], 0)
        label_mask[i, :m] = ok
    block_ids = torch.full((n, a_max, block_size), mask_token_id, dtype=torch.int64)
    block_ids[:, :, 0] = torch.gather(input_ids, 1, anchors)
    block_positions = anchors[:, :, None] + torch.arange(block_size)[None, None, :]
    return TrainBatch(input_ids, anchors, valid, block_ids.view(n, -1), block_positions.view(n, -1), labels,
                      label_mask)


def greedy_labels(labels: torch.Tensor, label_mask: torch.Tensor, anchors: torch.Tensor,
                  next_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Relabel blocks with the target's greedy chain: (labels, label_mask) [N, A, B-1].

    Greedy verification accepts draft j only if it equals the target's argmax after the block's
    earlier tokens, and the drafter only sees x_a, so its ideal prediction at j is the greedy chain
    from a. Label j becomes next_ids[a + j - 1] (the target's argmax after x_{a+j-1}), kept only
    while every earlier stored token of the block equals the target's argmax (a sampled token or a
    rounding difference ends the chain). next_ids: [N, S] argmax next token after each position.
    """
    n, a, k = labels.shape
    pos = anchors[:, :, None] + torch.arange(k, device=anchors.device)  # predicts position pos + 1
    pos = pos.clamp(max=next_ids.shape[1] - 1).view(n, -1)
    teacher = torch.gather(next_ids, 1, pos).view(n, a, k)
    agree = teacher == labels
    chain = torch.cat([torch.ones_like(agree[..., :1]), agree[..., :-1]], dim=-1).long().cumprod(-1).bool()
    mask = label_mask & chain
    return torch.where(mask, teacher, torch.zeros_like(teacher)), mask
