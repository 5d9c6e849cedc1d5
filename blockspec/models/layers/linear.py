"""A linear layer holding several checkpoint projections side by side (q|k|v, gate|up).

One GEMM instead of three (or two) reads the same weight bytes with fewer launches; checkpoints keep
the projections apart, so loading copies each into its slice (see weight_utils.copy_named).
"""

from __future__ import annotations

from torch import nn

# checkpoint projection name -> (fused module name, shard index)
FUSED_SHARDS = {
    "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
}


class FusedLinear(nn.Linear):
    def __init__(self, in_features: int, shard_sizes: list[int], bias: bool) -> None:
        super().__init__(in_features, sum(shard_sizes), bias=bias)
        self.shard_sizes = list(shard_sizes)

    def shard_offset(self, index: int) -> int:
        return sum(self.shard_sizes[:index])
