"""RMSNorm, computed in float32 as the reference implementations do (fused kernel on GPU)."""

from __future__ import annotations

import torch
from torch import nn

from blockspec.kernels.rms_norm import rms_norm


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """norm(x), or with a residual: (norm(x + residual), x + residual)."""
        y, new_residual = rms_norm(x, self.weight, self.eps, residual)
        return y if residual is None else (y, new_residual)

    def kernel_weight(self) -> torch.Tensor:
        """The per-channel scale a GEMM with the norm folded in multiplies by (layers/linear.py)."""
        return self.weight
