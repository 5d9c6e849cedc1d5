"""A linear layer holding several checkpoint projections side by side (q|k|v, gate|up).

One GEMM instead of three (or two) reads the same weight bytes with fewer launches; checkpoints keep
the projections apart, so loading copies each into its slice (see weight_utils.copy_named).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from blockspec.kernels._triton import use_triton
from blockspec.kernels.rms_norm import releases_early, rms_norm
from blockspec.kernels.skinny_linear import linear, skinny_linear, skinny_supported

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


# Decode-path residual sub-blocks (<= 16 rows on GPU), shared by the target's and the drafter's layers: each updates
# the residual stream h in place with two GEMMs, the norm folded into the first. A projection is a plain Linear or
# a quantized one (models/layers/quant_linear.QuantLinear), each through its own kernels (`folded_linear`).

def folded_linear(x: torch.Tensor, proj: nn.Module, norm: nn.Module | None = None, *, gated: bool = False,
                  residual: torch.Tensor | None = None) -> torch.Tensor:
    """proj(norm(x)), SwiGLU over its [gate; up] halves where gated, added in place into `residual` where given
    (and returned). A plain projection: one skinny_linear launch with all of it folded in. A quantized one: the
    norm as a kernel of its own before quant_linear, the residual add in its GEMM, SwiGLU in its GEMM where the
    1-16-row mma kernels take the rows (free in their epilogue) and a kernel of its own after it elsewhere, which
    is what measured fastest (bench/quant_gemm.py --folds, H200: on the dot path folding the norm lost at 1 and 16
    rows, SwiGLU lost for NVFP4, the residual add won)."""
    if isinstance(proj, nn.Linear):
        nw, eps = (norm.kernel_weight(), norm.eps) if norm is not None else (None, 0.0)
        return skinny_linear(x, proj.weight, proj.bias, norm_weight=nw, eps=eps, gated=gated, residual=residual)
    if norm is not None:  # early release measured faster before quantized projections only (releases_early)
        x = rms_norm(x, norm.kernel_weight(), norm.eps, release_early=releases_early(x.shape[0]))[0]
    if residual is not None and not gated:
        return proj.forward_residual(x, residual)
    y = proj.forward_gated(x) if gated else proj(x)
    return y if residual is None else residual.add_(y)


def folds(x: torch.Tensor, proj: nn.Module) -> bool:
    """Whether folded_linear runs proj on its kernels for rows like x's (a layer asks with its residual stream for
    all of its projections, whatever their input widths)."""
    if isinstance(proj, nn.Linear):
        return skinny_supported(x, proj.weight)
    return use_triton(x) and x.dim() == 2 and 1 <= x.shape[0] <= 16 and x.is_contiguous()


def fused_attention_residual(h: torch.Tensor, norm: nn.Module, qkv_proj: nn.Module, o_proj: nn.Module,
                             attend: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """h += o_proj(attend(qkv_proj(norm(h)))); `attend` maps the fused q|k|v rows to attention output."""
    return folded_linear(attend(folded_linear(h, qkv_proj, norm)), o_proj, residual=h)


def fused_swiglu_residual(h: torch.Tensor, norm: nn.Module, gate_up_proj: nn.Module,
                          down_proj: nn.Module) -> torch.Tensor:
    """h += down_proj(silu(gate) * up) with [gate; up] = gate_up_proj(norm(h))."""
    return folded_linear(folded_linear(h, gate_up_proj, norm, gated=True), down_proj, residual=h)
