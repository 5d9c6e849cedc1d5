"""Sparse mixture-of-experts MLP: top-k routing, routed SwiGLU experts, optional gated shared expert.

Routing follows the Qwen MoE family: softmax over all experts in float32, top-k, and (when the config
says so) the k weights renormalised to sum to one (GPT-OSS's softmax over the top-k logits is that
renormalised case; its router and experts also carry biases, and its experts' gate is the clamped
SwiGLU of `GatedActivation`). The experts live as two stacked tensors,
`gate_up_proj` [E, 2I, H] and `down_proj` [E, H, I], the layout grouped GEMMs want and the one
transformers 5 uses in memory; checkpoints that store one tensor per expert are copied into slices
(`load_expert_weight`).

Three ways to run the routed experts, picked per call by `experts_forward`:
- `experts_reference`: loop over the experts that received tokens. The oracle, and the CPU path.
- `experts_grouped`: sort the (token, expert) pairs by expert and run both projections as one
  `torch._grouped_mm` each (CUTLASS grouped GEMM on Hopper). Only the experts that received tokens
  are read, which is what makes batch-1 decode cost the *active* parameters. Prefill.
- `experts_fused` (kernels/moe_grouped.py): Triton kernels for decode and verify steps (up to
  FUSED_MAX_TOKENS tokens) with no host sync, so the routing runs inside CUDA graphs; `SparseMoeBlock`
  then also routes with one kernel and folds a same-sized shared expert into the grouped launches.
  Biases and GPT-OSS's clamped SwiGLU ride in the kernels' epilogues, and quantized experts
  (layers.quant_linear.QuantExperts: the same `gate_up_proj` / `down_proj` names, holding packed layouts)
  are dequantized in registers. A quantized shared expert in the routed experts' NVFP4 layout rides in a decode
  step's or a verify block's launches too (kernels/quant_gemv.py's one-token and rows kernels); otherwise it runs
  beside them on its QuantLinears, its output added in the combine launch.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from blockspec.device import cuda_capability
from blockspec.errors import ConfigError
from blockspec.kernels.moe_grouped import (
    SharedWeights,
    fused_supported,
    layout_wanted,
    moe_experts,
    moe_route,
    moe_route_align,
    shared_foldable,
)
from blockspec.kernels.quant_gemv import Nvfp4Shared
from blockspec.kernels.rms_norm import rms_norm
from blockspec.kernels.skinny_linear import skinny_linear, skinny_supported
from blockspec.models.layers.linear import FusedLinear, Linear

BACKENDS = ("auto", "reference", "grouped", "fused")
# "auto" takes the fused kernels up to this many tokens (decode and verify steps: (k + 1) x batch), above it
# torch's grouped GEMM (prefill). The fused kernels tile 16 rows per expert, right while an expert sees few
# tokens; bench/moe_kernels.py measures both paths per token count.
FUSED_MAX_TOKENS = int(os.environ.get("BLOCKSPEC_MOE_FUSED_MAX_TOKENS", "256"))
_EXPERT_NAME = re.compile(r"^(?P<prefix>.+\.experts)\.(?P<expert>\d+)\.(?P<proj>gate|up|down)_proj\.weight$")


@dataclass(frozen=True)
class GatedActivation:
    """How an expert joins its gate and up halves: silu(gate) * up when `limit` is None; else GPT-OSS's
    clamped SwiGLU, gate * sigmoid(alpha * gate) * (up + 1) with gate clamped above at `limit` and up to
    [-limit, limit]."""

    limit: float | None = None
    alpha: float = 1.702

    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        if self.limit is None:
            return F.silu(gate) * up
        gate = gate.clamp(max=self.limit)
        up = up.clamp(-self.limit, self.limit)
        return gate * torch.sigmoid(gate * self.alpha) * (up + 1)


SILU = GatedActivation()
ExpertFn = Callable[[torch.Tensor, int], torch.Tensor]


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, E] logits -> (weights [T, k] in the logits' dtype, expert ids [T, k])."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(router_logits.dtype), ids


def experts_loop(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, gate_up: ExpertFn, down: ExpertFn,
                 act: GatedActivation = SILU) -> torch.Tensor:
    """The definition of a routed expert layer: for each expert that received tokens, its projections
    (`gate_up(rows, e)` -> [n, 2I], `down(rows, e)` -> [n, H]) on its tokens, weighted and summed."""
    out = torch.zeros_like(x)
    for e in torch.unique(ids).tolist():
        token, slot = torch.where(ids == e)
        gate, up = gate_up(x[token], e).chunk(2, dim=-1)
        y = down(act(gate, up), e) * weights[token, slot, None]
        out.index_add_(0, token, y.to(out.dtype))
    return out


def experts_reference(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, weights: torch.Tensor,
                      ids: torch.Tensor, act: GatedActivation = SILU, gate_up_bias: torch.Tensor | None = None,
                      down_bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, H]; gate_up [E, 2I, H]; down [E, H, I]; weights/ids [T, k]; biases [E, 2I] / [E, H] -> [T, H]."""
    def project(w: torch.Tensor, b: torch.Tensor | None) -> ExpertFn:
        return lambda rows, e: F.linear(rows, w[e], None if b is None else b[e])

    return experts_loop(x, weights, ids, project(gate_up, gate_up_bias), project(down, down_bias), act)


def grouped_layout(ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(order, offsets): pair order sorted by expert (stable), and each expert's end offset (int32)."""
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    # scatter_add, not bincount: bincount reads the max id back to the host (no CUDA graphs then)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=ids.device).scatter_add_(0, flat, torch.ones_like(flat))
    return order, torch.cumsum(counts, 0).to(torch.int32)


def experts_grouped(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, weights: torch.Tensor,
                    ids: torch.Tensor, act: GatedActivation = SILU, gate_up_bias: torch.Tensor | None = None,
                    down_bias: torch.Tensor | None = None) -> torch.Tensor:
    """Same result as `experts_reference`, as two grouped GEMMs over the expert-sorted pairs.

    Each token's k expert outputs are summed in a fixed order (its top-k order), so the result does
    not depend on which other tokens share the batch.
    """
    t, k = ids.shape
    order, offsets = grouped_layout(ids, gate_up.shape[0])
    token = order // k
    expert = ids.reshape(-1)[order]  # each sorted pair's expert (for the biases)
    h = torch._grouped_mm(x[token], gate_up.transpose(1, 2), offs=offsets)  # [T*k, 2I]
    if gate_up_bias is not None:
        h = h + gate_up_bias[expert]
    gate, up = h.chunk(2, dim=-1)
    y = torch._grouped_mm(act(gate, up), down.transpose(1, 2), offs=offsets)  # [T*k, H]
    if down_bias is not None:
        y = y + down_bias[expert]
    pairs = torch.empty_like(y)
    pairs[order] = y
    return (pairs.view(t, k, -1) * weights[..., None]).sum(dim=1).to(x.dtype)


def grouped_supported(x: torch.Tensor) -> bool:
    """torch's grouped GEMM: CPU (any float dtype, used in tests) or CUDA bf16 on sm90+."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    if x.device.type == "cuda":
        return x.dtype == torch.bfloat16 and cuda_capability(x.device) >= (9, 0)
    return x.device.type == "cpu"


def experts_fused(x: torch.Tensor, gate_up, down, weights: torch.Tensor, ids: torch.Tensor,
                  act: GatedActivation = SILU, gate_up_bias: torch.Tensor | None = None,
                  down_bias: torch.Tensor | None = None) -> torch.Tensor:
    """Same result as `experts_reference` through the graph-safe Triton kernels (kernels/moe_grouped.py);
    gate_up / down are stacked tensors or quantized expert holders."""
    return moe_experts(x, gate_up, down, weights, ids, gate_up_bias=gate_up_bias, down_bias=down_bias,
                       limit=act.limit, alpha=act.alpha)


def fused_applies(x: torch.Tensor, gate_up, down, backend: str) -> bool:
    """The fused kernels run for backend "fused", and for "auto" up to FUSED_MAX_TOKENS tokens (where Triton
    runs: CUDA, or CPU under TRITON_INTERPRET=1, without grad), and at any size while a CUDA graph is being
    captured (a prefill graph's 512-token bucket): the other paths read the routing back to the host (the
    reference loop; on an H100 a float32 Qwen3-MoE's prefill capture failed there), which a capture cannot."""
    if backend not in ("auto", "fused") or not fused_supported(x, gate_up, down):
        return False
    if backend == "fused" or x.shape[0] <= FUSED_MAX_TOKENS:
        return True
    return x.is_cuda and torch.cuda.is_current_stream_capturing()


def experts_forward(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, weights: torch.Tensor,
                    ids: torch.Tensor, backend: str = "auto", act: GatedActivation = SILU,
                    gate_up_bias: torch.Tensor | None = None, down_bias: torch.Tensor | None = None) -> torch.Tensor:
    """Routed experts through the chosen backend (auto: fused for few tokens, else grouped on CUDA when
    supported, else reference)."""
    if fused_applies(x, gate_up, down, backend):
        return experts_fused(x, gate_up, down, weights, ids, act, gate_up_bias, down_bias)
    if backend in ("auto", "fused"):
        backend = "grouped" if x.device.type == "cuda" and grouped_supported(x) else "reference"
    fn = experts_grouped if backend == "grouped" else experts_reference
    return fn(x, gate_up, down, weights, ids, act, gate_up_bias, down_bias)


class Experts(nn.Module):
    """The stacked expert weights (and, with `bias`, per-expert biases [E, 2I] / [E, H]); `forward` runs
    them for routed tokens."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, bias: bool = False,
                 activation: GatedActivation = SILU) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.intermediate_size = intermediate_size
        self.activation = activation
        # Initialised (not left empty) so that dummy-weight runs route and compute on finite numbers.
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size).normal_(0, 0.02))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size).normal_(0, 0.02))
        self.gate_up_proj_bias = nn.Parameter(torch.zeros(num_experts, 2 * intermediate_size)) if bias else None
        self.down_proj_bias = nn.Parameter(torch.zeros(num_experts, hidden_size)) if bias else None
        self.backend = os.environ.get("BLOCKSPEC_MOE_BACKEND", "auto")
        if self.backend not in BACKENDS:
            raise ConfigError(f"BLOCKSPEC_MOE_BACKEND={self.backend!r}: use one of {', '.join(BACKENDS)}")

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return experts_forward(x, self.gate_up_proj, self.down_proj, weights, ids, self.backend, self.activation,
                               self.gate_up_proj_bias, self.down_proj_bias)

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
    """A dense SwiGLU MLP every token goes through (Qwen3-Next, Qwen3.5-MoE). Its gate and up projections are held
    fused ([gate; up] rows, the checkpoint's gate_proj / up_proj load into the halves), as a routed expert's are:
    one launch for both, and the layout that lets the grouped kernels read it as one more expert."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.intermediate_size = intermediate_size
        self.gate_up_proj = FusedLinear(hidden_size, [intermediate_size, intermediate_size], bias=False)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


RouteFn = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


class SparseMoeBlock(nn.Module):
    """Router + routed experts (+ sigmoid-gated shared expert when `shared_intermediate_size` > 0).

    Benchmark hooks: `route_override`, a callable router_logits [T, E] -> (weights [T, k], ids [T, k]) used
    instead of `route` (it must be graph-safe where the block runs inside a CUDA graph); `record_routing`:
    when True, `last_ids` holds the last forward's expert ids (the device tensor, int32 on the fused path;
    no host sync) and `ids_by_tokens[T]` the last ids of a T-token forward: a CUDA graph's replays keep
    refreshing the tensor it captured there, while an eager call of another size (a prefill) moves
    `last_ids` elsewhere.
    """

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, intermediate_size: int,
                 renormalize: bool, shared_intermediate_size: int = 0, bias: bool = False,
                 activation: GatedActivation = SILU) -> None:
        super().__init__()
        self.top_k = top_k
        self.renormalize = renormalize
        self.gate = Linear(hidden_size, num_experts, bias=bias)
        self.experts = Experts(num_experts, hidden_size, intermediate_size, bias, activation)
        self.shared_expert = SharedExpert(hidden_size, shared_intermediate_size) if shared_intermediate_size else None
        self.shared_expert_gate = Linear(hidden_size, 1, bias=False) if shared_intermediate_size else None
        self.route_override: RouteFn | None = None
        self.record_routing = False
        self.last_ids: torch.Tensor | None = None
        self.ids_by_tokens: dict[int, torch.Tensor] = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        if fused_applies(x, self.experts.gate_up_proj, self.experts.down_proj, self.experts.backend):
            return self._forward_fused(x).view(shape)
        logits = self.gate(x)
        if self.route_override is not None:
            weights, ids = self.route_override(logits)
        else:
            weights, ids = route(logits, self.top_k, self.renormalize)
        if self.record_routing:
            self._record(ids)
        out = self.experts(x, weights, ids)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out.view(shape)

    def forward_residual(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """residual + self(x): on the fused path the add rides in the combine launch (rounded as the add is)."""
        flat = x.reshape(-1, x.shape[-1])
        res = residual.reshape(-1, residual.shape[-1])
        if (res.is_contiguous() and res.dtype == flat.dtype
                and fused_applies(flat, self.experts.gate_up_proj, self.experts.down_proj, self.experts.backend)):
            return self._forward_fused(flat, res).view(residual.shape)
        return residual + self.forward(x)

    def forward_norm_residual(self, h: torch.Tensor, norm: nn.Module) -> torch.Tensor:
        """h + self(norm(h)) (the decoder layer's post-attention half). On the fused path with a bf16 router, one
        token's router GEMM takes the norm in and writes the normed row the experts read: one launch for both. A
        verify block's norm runs first on its own: folded into the router's few programs (128-256 columns) it
        took 20.6 us a layer of a Qwen3-Coder-30B-A3B verify step on an H200 (hybrid_gpu --profile), against
        1.8 us for the norm kernel and ~6 us for the plain 16-row router GEMM (bench/results/
        tune_skinny_coder30b_m16_h100_0c3de9e.json)."""
        flat = h.reshape(-1, h.shape[-1])
        w, eps = norm.kernel_weight(), norm.eps
        if (isinstance(self.gate, Linear) and flat.is_contiguous() and skinny_supported(flat, self.gate.weight)
                and fused_applies(flat, self.experts.gate_up_proj, self.experts.down_proj, self.experts.backend)):
            if flat.shape[0] == 1:
                x = torch.empty_like(flat)
                logits = skinny_linear(flat, self.gate.weight, self.gate.bias, norm_weight=w, eps=eps, norm_out=x)
            else:
                x = rms_norm(flat, w, eps)[0]
                logits = skinny_linear(x, self.gate.weight, self.gate.bias)
            return self._forward_fused(x, flat, logits).view(h.shape)
        return self.forward_residual(rms_norm(h, w, eps)[0], h)

    def _record(self, ids: torch.Tensor) -> None:
        self.last_ids = self.ids_by_tokens[ids.shape[0]] = ids

    def _folded_shared(self, x: torch.Tensor) -> SharedWeights | Nvfp4Shared | None:
        """The shared expert's weights where it can ride in the routed launches as expert E for x's step: both
        unquantized, or both NVFP4 on quant_gemv's MoE kernels (kernels/moe_grouped.shared_foldable); its gate a
        plain bias-free Linear (its weight goes to the routing kernel)."""
        se, gate = self.shared_expert, self.shared_expert_gate
        if se is None or not isinstance(gate, Linear) or gate.bias is not None:
            return None
        ex = self.experts
        if all(isinstance(p, Linear) for p in (se.gate_up_proj, se.down_proj)):
            g, u = se.gate_up_proj.weight.split(se.intermediate_size)
            shared = SharedWeights(g, u, se.down_proj.weight)
            return shared if shared_foldable(shared, ex.gate_up_proj, ex.down_proj) else None
        shared = Nvfp4Shared(se.gate_up_proj, se.down_proj)
        biases = ex.gate_up_proj_bias is not None or ex.down_proj_bias is not None
        return shared if shared_foldable(shared, ex.gate_up_proj, ex.down_proj, x, biases,
                                         ex.activation.limit is not None) else None

    def _forward_fused(self, x: torch.Tensor, residual: torch.Tensor | None = None,
                       logits: torch.Tensor | None = None) -> torch.Tensor:
        """Router GEMM (unless its `logits` are given), routing (top-k and the shared gate) + grouping by expert,
        gate_up, down, combine: five launches for a small step (the routing and grouping share one, or a verify
        block's grouped GEMMs find their experts' pairs themselves: moe_grouped.layout_wanted), six for a large
        one."""
        x = x if x.is_contiguous() else x.contiguous()
        gate = self.gate
        if logits is None:
            logits = skinny_linear(x, gate.weight, gate.bias) if isinstance(gate, Linear) else gate(x)  # or quantized
        shared = self._folded_shared(x)
        separate = self.shared_expert is not None and shared is None  # quantized or differently sized: beside
        # where its gate is a plain linear: the gate from the routing kernel (no top-k, the layout left without the
        # shared slot) and the output added in the combine launch
        beside = separate and isinstance(self.shared_expert_gate, Linear) and self.shared_expert_gate.bias is None
        shared_gate = self.shared_expert_gate.weight if shared is not None else None
        layout = None
        ex = self.experts  # Experts, or QuantExperts (the kernels dequantize its layouts in registers)
        if self.route_override is None:
            biases = ex.gate_up_proj_bias is not None or ex.down_proj_bias is not None
            group = layout_wanted(x, self.top_k, ex.gate_up_proj, ex.down_proj, shared, biases,
                                  ex.activation.limit is not None)
            weights, ids, shared_w, layout = moe_route_align(logits, self.top_k, self.renormalize, x, shared_gate,
                                                             group=group)
        else:
            weights, ids = self.route_override(logits)
            shared_w = moe_route(logits, self.top_k, self.renormalize, x, shared_gate, topk=False)[2]
        if beside:
            shared_w = moe_route(logits, self.top_k, self.renormalize, x, self.shared_expert_gate.weight,
                                 topk=False)[2]
        if self.record_routing:
            self._record(ids)
        alone = separate and not beside  # the shared expert's whole path in module ops
        out = moe_experts(x, ex.gate_up_proj, ex.down_proj, weights, ids, shared, shared_w, layout=layout,
                          residual=None if alone else residual, gate_up_bias=ex.gate_up_proj_bias,
                          down_bias=ex.down_proj_bias, limit=ex.activation.limit, alpha=ex.activation.alpha,
                          shared_out=self.shared_expert(x) if beside else None)
        if alone:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
            if residual is not None:
                out = residual + out
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
