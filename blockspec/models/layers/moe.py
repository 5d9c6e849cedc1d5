"""Sparse mixture-of-experts MLP: top-k routing, routed SwiGLU experts, optional gated shared expert.

Routing follows the Qwen MoE family: softmax over all experts in float32, top-k, and (when the config
says so) the k weights renormalised to sum to one. The experts live as two stacked tensors,
`gate_up_proj` [E, 2I, H] and `down_proj` [E, H, I], the layout grouped GEMMs want and the one
transformers 5 uses in memory; checkpoints that store one tensor per expert are copied into slices
(`load_expert_weight`).

Two ways to run the routed experts, picked per call by `experts_forward`:
- `experts_reference`: loop over the experts that received tokens. The oracle, and the CPU path.
- `experts_grouped`: sort the (token, expert) pairs by expert and run both projections as one
  `torch._grouped_mm` each (CUTLASS grouped GEMM on Hopper). Only the experts that received tokens
  are read, which is what makes batch-1 decode cost the *active* parameters.
"""

from __future__ import annotations

import os
import re

import torch
import torch.nn.functional as F
from torch import nn

from blockspec.errors import ConfigError
from blockspec.models.layers.linear import Linear

BACKENDS = ("auto", "reference", "grouped")
_EXPERT_NAME = re.compile(r"^(?P<prefix>.+\.experts)\.(?P<expert>\d+)\.(?P<proj>gate|up|down)_proj\.weight$")


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, E] logits -> (weights [T, k] in the logits' dtype, expert ids [T, k])."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(router_logits.dtype), ids


def experts_reference(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                      weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """x [T, H]; gate_up [E, 2I, H]; down [E, H, I]; weights/ids [T, k] -> [T, H]."""
    out = torch.zeros_like(x)
    for e in torch.unique(ids).tolist():
        token, slot = torch.where(ids == e)
        gate, up = F.linear(x[token], gate_up[e]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, down[e]) * weights[token, slot, None]
        out.index_add_(0, token, y.to(out.dtype))
    return out


def grouped_layout(ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(order, offsets): pair order sorted by expert (stable), and each expert's end offset (int32)."""
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    # scatter_add, not bincount: bincount reads the max id back to the host (no CUDA graphs then)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=ids.device).scatter_add_(0, flat, torch.ones_like(flat))
    return order, torch.cumsum(counts, 0).to(torch.int32)


def experts_grouped(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                    weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Same result as `experts_reference`, as two grouped GEMMs over the expert-sorted pairs.

    Each token's k expert outputs are summed in a fixed order (its top-k order), so the result does
    not depend on which other tokens share the batch.
    """
    t, k = ids.shape
    order, offsets = grouped_layout(ids, gate_up.shape[0])
    token = order // k
    h = torch._grouped_mm(x[token], gate_up.transpose(1, 2), offs=offsets)  # [T*k, 2I]
    gate, up = h.chunk(2, dim=-1)
    y = torch._grouped_mm(F.silu(gate) * up, down.transpose(1, 2), offs=offsets)  # [T*k, H]
    pairs = torch.empty_like(y)
    pairs[order] = y
    return (pairs.view(t, k, -1) * weights[..., None]).sum(dim=1).to(x.dtype)


def grouped_supported(x: torch.Tensor) -> bool:
    """torch's grouped GEMM: CPU (any float dtype, used in tests) or CUDA bf16 on sm90+."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    if x.device.type == "cuda":
        return x.dtype == torch.bfloat16 and torch.cuda.get_device_capability(x.device) >= (9, 0)
    return x.device.type == "cpu"


def experts_forward(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, weights: torch.Tensor,
                    ids: torch.Tensor, backend: str = "auto") -> torch.Tensor:
    """Routed experts through the chosen backend (auto: grouped on CUDA when supported, else reference)."""
    if backend == "auto":
        backend = "grouped" if x.device.type == "cuda" and grouped_supported(x) else "reference"
    if backend == "grouped":
        return experts_grouped(x, gate_up, down, weights, ids)
    return experts_reference(x, gate_up, down, weights, ids)


class Experts(nn.Module):
    """The stacked expert weights; `forward` runs them for routed tokens."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.intermediate_size = intermediate_size
        # Initialised (not left empty) so that dummy-weight runs route and compute on finite numbers.
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size).normal_(0, 0.02))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size).normal_(0, 0.02))
        self.backend = os.environ.get("BLOCKSPEC_MOE_BACKEND", "auto")
        if self.backend not in BACKENDS:
            raise ConfigError(f"BLOCKSPEC_MOE_BACKEND={self.backend!r}: use one of {', '.join(BACKENDS)}")

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return experts_forward(x, self.gate_up_proj, self.down_proj, weights, ids, self.backend)

    def load_expert(self, expert: int, proj: str, tensor: torch.Tensor) -> None:
        """Copy one expert's gate/up/down matrix (checkpoint layout [out, in]) into its slice."""
        if not 0 <= expert < self.num_experts:
            raise ConfigError(f"checkpoint has expert {expert} but config.json says num_experts={self.num_experts}")
        i = self.intermediate_size
        target = {"gate": lambda: self.gate_up_proj[expert, :i], "up": lambda: self.gate_up_proj[expert, i:],
                  "down": lambda: self.down_proj[expert]}[proj]()
        if target.shape != tensor.shape:
            raise ConfigError(f"expert {expert} {proj}_proj: checkpoint shape {tuple(tensor.shape)} does not match "
                              f"the model's {tuple(target.shape)}: config.json and the weights disagree")
        with torch.no_grad():
            target.copy_(tensor)


class SharedExpert(nn.Module):
    """A dense SwiGLU MLP every token goes through (Qwen3-Next, Qwen3.5-MoE)."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class SparseMoeBlock(nn.Module):
    """Router + routed experts (+ sigmoid-gated shared expert when `shared_intermediate_size` > 0)."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, intermediate_size: int,
                 renormalize: bool, shared_intermediate_size: int = 0) -> None:
        super().__init__()
        self.top_k = top_k
        self.renormalize = renormalize
        self.gate = Linear(hidden_size, num_experts, bias=False)
        self.experts = Experts(num_experts, hidden_size, intermediate_size)
        self.shared_expert = SharedExpert(hidden_size, shared_intermediate_size) if shared_intermediate_size else None
        self.shared_expert_gate = Linear(hidden_size, 1, bias=False) if shared_intermediate_size else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = route(self.gate(x), self.top_k, self.renormalize)
        out = self.experts(x, weights, ids)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out


def load_expert_weight(model: nn.Module, name: str, tensor: torch.Tensor) -> bool:
    """Route checkpoint expert tensors into the stacked parameters; False for other names.

    Handles per-expert names (`...mlp.experts.7.gate_proj.weight`) and stacked tensors stored
    transposed ([E, H, 2I] / [E, I, H], as some exporters write them); stacked tensors in our own
    layout need nothing special and are left to the ordinary by-name copy.
    """
    m = _EXPERT_NAME.match(name)
    if m is not None:
        experts = model.get_submodule(m["prefix"])
        experts.load_expert(int(m["expert"]), m["proj"], tensor)
        return True
    if name.endswith((".experts.gate_up_proj", ".experts.down_proj")):
        prefix, attr = name.rsplit(".", 1)
        param = getattr(model.get_submodule(prefix), attr)
        if tensor.dim() == 3 and tensor.shape != param.shape and tensor.transpose(1, 2).shape == param.shape:
            with torch.no_grad():
                param.copy_(tensor.transpose(1, 2))
            return True
    return False
