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


@torch.no_grad()
def target_features(target: nn.Module, input_ids: torch.Tensor, layer_ids: Sequence[int]) -> torch.Tensor:
    """[B, S] token ids -> [B, S, len(layer_ids) * H] hidden states at the output of those layers."""
    b, s = input_ids.shape
    positions = torch.arange(s, device=input_ids.device).repeat(b)
    with forward_context(DenseCausalMetadata(batch=b)):
        _, features = target(input_ids.reshape(-1), positions, tuple(layer_ids))
    return features.view(b, s, -1)
