"""A correlated MoE router for the benchmarks (issue 13's routing honesty): each token keeps a share of the
previous token's experts, as tokens of a trained model's verify block do more than a uniform random router's.

Expert e sits in lane e % k. A stream of (lane, expert) picks is laid out so that token t routes to stream
positions [t * f, t * f + k) with f = k - keep fresh picks per token: consecutive tokens share `keep`
positions, and any k consecutive positions cover k distinct lanes, hence k distinct experts. Position p belongs
to the token that first reads it (its owner), and holds the owner's best expert of lane p % k by the owner's
own logits. A token's weights are its own softmax probabilities of its k experts (renormalised when the block
says so).

`correlated_router_ref` is the definition in tensor ops (CPU, and the oracle). On a GPU one Triton launch a
layer does the same: the tensor ops cost ~10 launches a layer (~1.2 ms a Qwen3-Coder-30B-A3B verify step on an
H200), which the benchmark would otherwise charge to the correlated mode's verify step.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from blockspec.kernels._triton import HAVE_TRITON, use_triton

RouteFn = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def keep_of(top_k: int, share: float) -> int:
    """Experts a token keeps from the previous token's k."""
    return min(top_k, max(0, round(share * top_k)))


def correlated_router_ref(logits: torch.Tensor, top_k: int, keep: int, renormalize: bool
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] in the logits' dtype, ids [T, k] int64 as torch.topk gives them: the eager experts
    path indexes with them), in tensor ops."""
    t, e = logits.shape
    dev = logits.device
    fresh = top_k - keep
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    lane = torch.arange(top_k, device=dev)
    best = probs.view(t, e // top_k, top_k).argmax(dim=1) * top_k + lane  # [T, k]: each lane's best expert
    pos = torch.arange(t, device=dev)[:, None] * fresh + lane[None, :]
    owner = ((pos - top_k).div(fresh, rounding_mode="floor") + 1).clamp(min=0) if fresh else pos * 0
    ids = best[owner, pos % top_k]
    weights = probs.gather(1, ids)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(logits.dtype), ids


if HAVE_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _correlated_kernel(L, W_OUT, IDS_OUT, E: tl.constexpr, EP: tl.constexpr, TOP_K: tl.constexpr,
                           KP: tl.constexpr, FRESH: tl.constexpr, RENORM: tl.constexpr):
        # One program a token: its own softmax, then for each slot the owner's best expert of the slot's lane
        # (argmax of the owner's logits over the lane's experts: the softmax keeps the order; ties to the
        # lowest id, as torch.argmax).
        t = tl.program_id(0)
        offs_e = tl.arange(0, EP)
        e_mask = offs_e < E
        row = tl.load(L + t.to(tl.int64) * E + offs_e, mask=e_mask, other=float("-inf")).to(tl.float32)
        mx = tl.max(row, axis=0)
        p = tl.exp(row - mx)
        probs = p / tl.sum(p, axis=0)
        offs_k = tl.arange(0, KP)
        ids = tl.zeros([KP], dtype=tl.int64)
        w = tl.zeros([KP], dtype=tl.float32)
        for j in tl.static_range(TOP_K):
            pos = t * FRESH + j
            if FRESH == 0:
                owner = t * 0
            else:
                owner = tl.maximum((pos - TOP_K + FRESH) // FRESH, 0)  # floor((pos - k) / f) + 1, pos - k >= -k
            lane = pos % TOP_K
            other = tl.load(L + owner.to(tl.int64) * E + offs_e, mask=e_mask, other=float("-inf")).to(tl.float32)
            in_lane = e_mask & (offs_e % TOP_K == lane)
            best = tl.argmax(tl.where(in_lane, other, float("-inf")), axis=0, tie_break_left=True)
            ids = tl.where(offs_k == j, best.to(tl.int64), ids)
            w = tl.where(offs_k == j, tl.sum(tl.where(offs_e == best, probs, 0.0), axis=0), w)
        if RENORM:
            w = w / tl.sum(w, axis=0)
        k_mask = offs_k < TOP_K
        tl.store(W_OUT + t * TOP_K + offs_k, w.to(W_OUT.dtype.element_ty), mask=k_mask)
        tl.store(IDS_OUT + t * TOP_K + offs_k, ids, mask=k_mask)


def correlated_router_triton(logits: torch.Tensor, top_k: int, keep: int, renormalize: bool
                             ) -> tuple[torch.Tensor, torch.Tensor]:
    """correlated_router_ref in one launch (graph-safe: shapes fixed by T)."""
    t, e = logits.shape
    logits = logits if logits.is_contiguous() else logits.contiguous()
    weights = torch.empty(t, top_k, dtype=logits.dtype, device=logits.device)
    ids = torch.empty(t, top_k, dtype=torch.int64, device=logits.device)
    if t:
        _correlated_kernel[(t,)](logits, weights, ids, E=e, EP=triton.next_power_of_2(e), TOP_K=top_k,
                                 KP=triton.next_power_of_2(top_k), FRESH=top_k - keep, RENORM=renormalize,
                                 num_warps=2)
    return weights, ids


def correlated_router(top_k: int, num_experts: int, share: float, renormalize: bool) -> RouteFn:
    """The router for one MoE block (its `route_override`): Triton where it runs, else the tensor ops."""
    if num_experts % top_k:
        raise ValueError(f"correlated routing needs num_experts ({num_experts}) divisible by top_k ({top_k})")
    keep = keep_of(top_k, share)

    def route(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if use_triton(logits):
            return correlated_router_triton(logits, top_k, keep, renormalize)
        return correlated_router_ref(logits, top_k, keep, renormalize)

    route.keep = keep
    return route
