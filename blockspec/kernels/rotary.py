"""Rotary embedding of queries and keys in place, with the optional per-head q/k RMSNorm of Qwen3 fused.

One program per (token, head) row of the fused qkv projection: norm (if any), rotate by the token's
position from the precomputed cos/sin table, write back. Replaces about fifteen small kernels.
"""

from __future__ import annotations

import torch

from blockspec.kernels._triton import HAVE_TRITON, use_triton

if HAVE_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _rope_kernel(QKV, POS, COS, SIN, QW, KW, stride_t, num_q, num_k, eps,
                     HAS_NORM: tl.constexpr, HEAD_DIM: tl.constexpr, HALF: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1)
        half = HALF
        i = tl.arange(0, HALF)
        base = QKV + t * stride_t + h * HEAD_DIM
        x1 = tl.load(base + i).to(tl.float32)
        x2 = tl.load(base + half + i).to(tl.float32)
        if HAS_NORM:
            var = (tl.sum(x1 * x1, 0) + tl.sum(x2 * x2, 0)) / HEAD_DIM
            inv = tl.rsqrt(var + eps)
            is_q = h < num_q
            w1 = tl.where(is_q, tl.load(QW + i), tl.load(KW + i)).to(tl.float32)
            w2 = tl.where(is_q, tl.load(QW + half + i), tl.load(KW + half + i)).to(tl.float32)
            x1 = (x1 * inv).to(QKV.dtype.element_ty).to(tl.float32) * w1
            x2 = (x2 * inv).to(QKV.dtype.element_ty).to(tl.float32) * w2
            x1 = x1.to(QKV.dtype.element_ty).to(tl.float32)
            x2 = x2.to(QKV.dtype.element_ty).to(tl.float32)
        pos = tl.load(POS + t)
        c1 = tl.load(COS + pos * HEAD_DIM + i)
        c2 = tl.load(COS + pos * HEAD_DIM + half + i)
        s1 = tl.load(SIN + pos * HEAD_DIM + i)
        s2 = tl.load(SIN + pos * HEAD_DIM + half + i)
        tl.store(base + i, (x1 * c1 - x2 * s1).to(QKV.dtype.element_ty))
        tl.store(base + half + i, (x2 * c2 + x1 * s2).to(QKV.dtype.element_ty))


def rope_qk_ref(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_q: int,
                num_k: int, head_dim: int, q_weight: torch.Tensor | None, k_weight: torch.Tensor | None,
                eps: float) -> None:
    """In place on the q and k heads of qkv [T, (num_q + 2 num_k) * head_dim]."""
    t = qkv.shape[0]
    heads = qkv.view(t, -1, head_dim)
    q, k = heads[:, :num_q], heads[:, num_q:num_q + num_k]
    if q_weight is not None:
        for x, w in ((q, q_weight), (k, k_weight)):
            xf = x.float()
            x.copy_(w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype))
    c = cos[positions].unsqueeze(1).to(qkv.dtype)
    s = sin[positions].unsqueeze(1).to(qkv.dtype)
    half = head_dim // 2
    for x in (q, k):
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        x.copy_(x * c + rotated * s)


def rope_qk(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_q: int,
            num_k: int, head_dim: int, q_weight: torch.Tensor | None = None, k_weight: torch.Tensor | None = None,
            eps: float = 1e-6) -> None:
    if not use_triton(qkv) or not qkv.is_contiguous():
        return rope_qk_ref(qkv, positions, cos, sin, num_q, num_k, head_dim, q_weight, k_weight, eps)
    has_norm = q_weight is not None
    _rope_kernel[(qkv.shape[0], num_q + num_k)](
        qkv, positions, cos, sin, q_weight if has_norm else cos, k_weight if has_norm else cos,
        qkv.stride(0), num_q, num_k, eps, HAS_NORM=has_norm, HEAD_DIM=head_dim, HALF=head_dim // 2, num_warps=1)
