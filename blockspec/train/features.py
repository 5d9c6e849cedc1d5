"""Context features of whole training sequences from the frozen target, computed on the fly.

Training sees each sequence at once, so the target runs one dense causal pass over a right-padded
batch (attention.DenseCausalMetadata: no paged cache, no step metadata). Padding sits after every
real token, so causal attention keeps it from changing the features of real positions.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from blockspec.models.layers.attention import DenseCausalMetadata, forward_context

GREEDY_CHUNK = 4096  # rows of target logits at a time


@torch.no_grad()
def target_features(target: nn.Module, input_ids: torch.Tensor, layer_ids: Sequence[int],
                    greedy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """[B, S] token ids -> ([B, S, len(layer_ids) * H] hidden states at the output of those layers,
    and with `greedy` the target's argmax next token after each position [B, S], else None)."""
    b, s = input_ids.shape
    positions = torch.arange(s, device=input_ids.device).repeat(b)
    with forward_context(DenseCausalMetadata(batch=b)):
        hidden, features = target(input_ids.reshape(-1), positions, tuple(layer_ids))
    next_ids = None
    if greedy:
        # chunks: the full [B*S, vocab] logits of a training batch would not fit next to the drafter
        next_ids = torch.cat([target.compute_logits(rows).argmax(-1) for rows in hidden.split(GREEDY_CHUNK)])
        next_ids = next_ids.view(b, s)
    return features.view(b, s, -1), next_ids
