"""The DFlash training loss: position-weighted cross-entropy over each block's B-1 predictions.

A draft is accepted only up to its first miss, so an early position's mistake costs every later
one: position k (1-based) is weighted exp(-(k-1) / gamma) (gamma 7 for B = 16, the paper's value).
Alongside the loss we report what acceptance would look like on the batch: per-position accuracy
and tau_est = 1 + mean length of each block's correct prefix (a cheap proxy for the engine's tau).

DFlash 2 drafters add their candidate selector's loss: at each labelled slot the candidates are the K
highest logits (the unary top-K the selector walks at inference), scored by logit + pairwise term from the
true previous token (teacher forcing, as the walk conditions on its own previous pick), and a K-way
cross-entropy trains the scores to pick the true token where it is among them. Slots whose true token is
outside the top-K only teach the unary cross-entropy, which is what brings it into the candidates.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from blockspec.spec.dflash2 import CandidateSelector


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
    selector_loss: torch.Tensor | None = None  # DFlash 2: the K-way loss (included in `loss`)
    selector_recall: torch.Tensor | None = None  # share of labels inside the unary top-K
    selector_accuracy: torch.Tensor | None = None  # share of those the selector's scores rank first


def selector_loss(selector: CandidateSelector, rows: torch.Tensor, logits: torch.Tensor, targets: torch.Tensor,
                  predecessors: torch.Tensor, weights: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """K-way cross-entropy of the selector over the unary top-K. rows [M, H] drafter hidden states, logits
    [M, V], targets [M] true tokens, predecessors [M] the true token before each, weights [M].
    Returns (loss, recall of the top-K, selector accuracy on the slots it can get right)."""
    unary, candidates = logits.topk(selector.top_k, dim=-1)
    context = selector.hidden_projection(rows)
    scores = unary + selector.pair_scores(context, predecessors, candidates)
    hit = candidates == targets[:, None]
    inside = hit.any(-1)
    index = hit.float().argmax(-1)
    ce = F.cross_entropy(scores[inside].float(), index[inside], reduction="none")
    w = weights[inside]
    loss = (ce * w).sum() / w.sum().clamp_min(1e-6)
    with torch.no_grad():
        accuracy = (scores[inside].argmax(-1) == index[inside]).float().mean() if inside.any() else loss.new_zeros(())
    return loss, inside.float().mean(), accuracy


def dflash_loss(hidden: torch.Tensor, labels: torch.Tensor, label_mask: torch.Tensor, anchor_valid: torch.Tensor,
                weights: torch.Tensor, logits_fn: Callable[[torch.Tensor], torch.Tensor],
                selector: CandidateSelector | None = None, anchor_ids: torch.Tensor | None = None) -> LossOutput:
    """hidden [N, A * B, H] drafter output; labels/label_mask [N, A, B-1]; anchor_valid [N, A]; for a DFlash 2
    drafter its selector and anchor_ids [N, A] (each block's first token).

    Logits are computed only for labelled positions (the LM head is the costly part)."""
    n, a, k = labels.shape
    rows = hidden.view(n, a, k + 1, -1)[:, :, 1:][label_mask]  # [M, H]
    target = labels[label_mask]
    w = weights.to(hidden.device).expand(n, a, k)[label_mask]
    logits = logits_fn(rows)
    ce = F.cross_entropy(logits.float(), target, reduction="none")
    loss = (ce * w).sum() / w.sum().clamp_min(1e-6)
    extra: dict[str, torch.Tensor] = {}
    if selector is not None:
        predecessors = torch.cat([anchor_ids[..., None], labels[..., :-1]], dim=-1)[label_mask]
        extra["selector_loss"], extra["selector_recall"], extra["selector_accuracy"] = selector_loss(
            selector, rows, logits, target, predecessors, w)
        loss = loss + extra["selector_loss"]
    with torch.no_grad():
        correct = torch.zeros_like(label_mask)
        correct[label_mask] = logits.argmax(-1) == target
        accuracy = correct.sum((0, 1)) / label_mask.sum((0, 1)).clamp_min(1)
        prefix = correct.long().cumprod(-1).sum(-1)  # [N, A]
        tau_est = 1 + (prefix * anchor_valid).sum() / anchor_valid.sum().clamp_min(1)
    return LossOutput(loss, accuracy, tau_est, int(target.numel()), **extra)

