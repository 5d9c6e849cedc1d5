"""The DFlash training loss: position-weighted cross-entropy over each block's B-1 predictions.

A draft is accepted only up to its first miss, so an early position's mistake costs every later
one: position k (1-based) is weighted exp(-(k-1) / gamma) (gamma 7 for B = 16, the paper's value).
Alongside the loss we report what acceptance would look like on the batch: per-position accuracy
and tau_est = 1 + mean length of each block's correct prefix (a cheap proxy for the engine's tau).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F


def default_gamma(block_size: int) -> float:
    """gamma 7 for B = 16, scaled with the block for other sizes."""
    return 7.0 * block_size / 16


def position_weights(block_size: int, gamma: float, device: torch.device | str | None = None) -> torch.Tensor:
    """[B-1] weights w_k = exp(-(k-1) / gamma) for block positions k = 1..B-1."""
    k = torch.arange(1, block_size, dtype=torch.float32, device=device)
    return torch.exp(-(k - 1) / gamma)


@dataclass
class LossOutput:
    loss: torch.Tensor  # scalar, differentiable
    accuracy: torch.Tensor  # [B-1] top-1 accuracy per position (over labelled positions)
    tau_est: torch.Tensor  # scalar: 1 + mean correct-prefix length over real anchors
    num_labels: int


def dflash_loss(hidden: torch.Tensor, labels: torch.Tensor, label_mask: torch.Tensor, anchor_valid: torch.Tensor,
                weights: torch.Tensor, logits_fn: Callable[[torch.Tensor], torch.Tensor]) -> LossOutput:
    """hidden [N, A * B, H] drafter output; labels/label_mask [N, A, B-1]; anchor_valid [N, A].

    Logits are computed only for labelled positions (the LM head is the costly part)."""
    n, a, k = labels.shape
    rows = hidden.view(n, a, k + 1, -1)[:, :, 1:][label_mask]  # [M, H]
    target = labels[label_mask]
    w = weights.to(hidden.device).expand(n, a, k)[label_mask]
    logits = logits_fn(rows)
    ce = F.cross_entropy(logits.float(), target, reduction="none")
    loss = (ce * w).sum() / w.sum().clamp_min(1e-6)
    with torch.no_grad():
        correct = torch.zeros_like(label_mask)
        correct[label_mask] = logits.argmax(-1) == target
        accuracy = correct.sum((0, 1)) / label_mask.sum((0, 1)).clamp_min(1)
        prefix = correct.long().cumprod(-1).sum(-1)  # [N, A]
        tau_est = 1 + (prefix * anchor_valid).sum() / anchor_valid.sum().clamp_min(1)
    return LossOutput(loss, accuracy, tau_est, int(target.numel()))

