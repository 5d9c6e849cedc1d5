"""A linear layer holding several checkpoint projections side by side (q|k|v, gate|up).

One GEMM instead of three (or two) reads the same weight bytes with fewer launches; checkpoints keep
the projections apart, so loading copies each into its slice (see weight_utils.copy_named).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from blockspec.kernels.skinny_linear import linear, skinny_linear

# checkpoint projection name -> (fused module name, shard index)
FUSED_SHARDS = {
    "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    # Qwen3.5 Gated DeltaNet inputs: [qkv | z] and [b | a], each pair one GEMM (the packed Qwen3-Next
    # checkpoints store these two fused tensors under the fused names already)
    "in_proj_qkv": ("in_proj_qkvz", 0), "in_proj_z": ("in_proj_qkvz", 1),
    "in_proj_b": ("in_proj_ba", 0), "in_proj_a": ("in_proj_ba", 1),
}


class Linear(nn.Linear):
    """nn.Linear through kernels.skinny_linear.linear, so every projection gets its CPU few-row path."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


class FusedLinear(Linear):
    def __init__(self, in_features: int, shard_sizes: list[int], bias: bool) -> None:
        super().__init__(in_features, sum(shard_sizes), bias=bias)
        self.shard_sizes = list(shard_sizes)

    def shard_offset(self, index: int) -> int:
        return sum(self.shard_sizes[:index])


# Decode-path residual sub-blocks (<= 16 rows on GPU), shared by the target's and the drafter's layers:
# each updates the residual stream h in place with two skinny GEMMs, the norm folded into the first.

def fused_attention_residual(h: torch.Tensor, norm: nn.Module, qkv_proj: nn.Linear, o_proj: nn.Linear,
                             attend: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """h += o_proj(attend(qkv_proj(norm(h)))); `attend` maps the fused q|k|v rows to attention output."""
    qkv = skinny_linear(h, qkv_proj.weight, qkv_proj.bias, norm_weight=norm.kernel_weight(), eps=norm.eps)
    return skinny_linear(attend(qkv), o_proj.weight, o_proj.bias, residual=h)


def fused_swiglu_residual(h: torch.Tensor, norm: nn.Module, gate_up_proj: nn.Linear,
                          down_proj: nn.Linear) -> torch.Tensor:
    """h += down_proj(silu(gate) * up) with [gate; up] = gate_up_proj(norm(h))."""
    act = skinny_linear(h, gate_up_proj.weight, gate_up_proj.bias, norm_weight=norm.kernel_weight(), eps=norm.eps,
                        gated=True)
    return skinny_linear(act, down_proj.weight, down_proj.bias, residual=h)
